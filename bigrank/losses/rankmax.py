"""Rankmax: the adaptive Euclidean projection on the (n, k)-simplex and its cross-entropy loss.

Kong, Krichene, Mayoraz, Rendle, Zhang, "Rankmax: An Adaptive Projection Alternative to the Softmax Function"
(NeurIPS 2020), Section 3. Notation: z = scores of one row, y = its positive item, z_[i] = i-th largest score,
eta = margin.

    mu_y    = min(z_y, z_[k]) - eta                                         (eq. 11)
    alpha_y = (k - t) / sum_{i=t+1..s} (z_[i] - mu_y),  s = |{i : z_i > mu_y}|  (eq. 12)
    Rankmax(z, y) = clip_[0,1](alpha_y (z - mu_y))                          (eq. 13)
    loss(z, y)    = -log min(1, alpha_y (z_y - mu_y))                       (eq. 14)

``t`` (the number of coordinates clipped at 1) is the smallest t in [0, k) with alpha_t (z_[t+1] - mu) <= 1,
found from the top-k values only, so a row costs O(n log k) (``torch.topk``) plus O(n) sums.

k may differ per row (an int64[B] tensor): Section 3 defines the (n, k)-simplex for a label set Y_x, and in item
recommendation a row's natural k grows with its user's number of positives (``RankmaxLoss(k_fraction=...)``).
The rows then share one top-k of width max(k) and each reads its own z_[k_b] and its own range t in [0, k_b).

Gradient (derived from eq. 14; the loss is log D - log(z_y - mu) - log(k - t) with D = sum over the
"middle" set M = {i : mu < z_i, i not among the top t}): for rows with alpha_y (z_y - mu) < 1,

    d loss / d z_i = [i in M] / D  +  [i carries mu] * (1 / (z_y - mu) - (s - t) / D)  -  [i = y] / (z_y - mu),

where mu is carried by y when z_y <= z_[k], else by the k-th largest score (shared equally among ties).
For k = 1 this is eq. 16 with s counting the support *without* y: the gradient at y is -(s - 1) / D, so that
the gradient sums to zero as Section 3.3 states (eq. 16 as printed, -s Rankmax_y, does not sum to zero).
"""

from __future__ import annotations

import math

import torch

from bigrank.losses.kernels import masked_scale, max_support_sum_count, support_sum_count
from bigrank.losses.scores import (
    Layout,
    catalog_loss_rows,
    empty_topk,
    gather_row_stats,
    merge_rank_topk,
    merge_topk,
    sum_row_stats,
)
from bigrank.losses.validation import (
    check_reduction,
    check_scores,
    check_target,
    check_target_range,
    first_nonfinite_row,
    raise_if_nonfinite,
    reduce_rows,
)

__all__ = ["positives_to_k", "rankmax", "rankmax_loss", "rankmax_shared_loss", "RankmaxLoss"]


def _check_params(k, margin) -> None:
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"k must be an integer >= 1, got {k!r}")
    if not isinstance(margin, int | float) or not math.isfinite(margin) or margin <= 0:
        raise ValueError(f"margin must be a finite number > 0, got {margin!r}")


def _check_k_fraction(k_fraction) -> None:
    ok = isinstance(k_fraction, int | float) and not isinstance(k_fraction, bool) and 0.0 <= k_fraction <= 1.0
    if not ok:
        raise ValueError(f"k_fraction must be a number in [0, 1], got {k_fraction!r}")


def _row_k(k, batch: int) -> torch.Tensor | None:
    """``k`` as given to ``rankmax_loss``: None for an int, else the checked int64[B] per-row k."""
    if isinstance(k, torch.Tensor):
        if k.shape != (batch,) or k.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"per-row k must be an integer tensor of shape ({batch},), got {k.dtype} {tuple(k.shape)}")
        if k.numel() and int(k.min()) < 1:
            raise ValueError(f"per-row k must be >= 1, got {int(k.min())}")
        return k.to(torch.int64)
    _check_params(k, 1.0)
    return None


def positives_to_k(positives: torch.Tensor, k: int, k_fraction: float) -> torch.Tensor:
    """Per-row k int64[B] = max(k, ceil(k_fraction * positives)) from each row's number of positives int[B]
    (its user's train items: the label set Y_x of Section 3)."""
    scaled = torch.ceil(positives.to(torch.float64) * k_fraction).to(torch.int64)
    return scaled.clamp_min(k)


def _solve_alpha(top: torch.Tensor, mu: torch.Tensor, support_sum: torch.Tensor, k: int, row_k=None):
    """Eq. 12 for every row: t, D_t = sum_{i=t+1..s}(z_[i] - mu) and alpha = (k - t) / D_t.

    ``top`` [B, k] are the k largest scores (descending), ``support_sum`` [B] is sum_i (z_i - mu)_+. t is the
    smallest index with alpha_t (z_[t+1] - mu) <= 1; it exists because at t = k - 1, D_t >= z_[k] - mu.
    ``row_k`` int64[B] (each <= k): row b's own k; its t is searched in [0, row_k[b]) only.
    """
    gaps = top - mu.unsqueeze(1)  # z_[i] - mu > 0 for the top k, since mu <= z_[k] - eta
    clipped_sums = torch.cumsum(gaps, dim=1) - gaps  # sum_{i<=t} (z_[i] - mu) for t = 0..k-1
    denominators = support_sum.unsqueeze(1) - clipped_sums
    index = torch.arange(k, device=top.device)
    if row_k is None:
        remaining = (k - index).to(top.dtype)  # k - t
        alphas = remaining / denominators
        feasible = alphas * gaps <= 1
        # t = k - 1 is always feasible in exact arithmetic; when the support is exactly the top k (a gap of at
        # least eta below z_[k]) the test there is an equality that rounding may break, so force it.
        feasible[:, k - 1] = True
    else:
        remaining = (row_k.unsqueeze(1) - index).to(top.dtype)
        inside = remaining > 0  # t < k_b; the columns past a row's k hold no candidate t (alpha 0 there)
        alphas = torch.where(inside, remaining / torch.where(inside, denominators, 1.0), 0.0)
        feasible = alphas * gaps <= 1
        # As above, t = k_b - 1 is forced; being feasible, it also bounds the argmax below the columns past k_b.
        feasible.scatter_(1, (row_k - 1).unsqueeze(1), True)
    t = feasible.to(torch.int64).argmax(dim=1)  # first feasible t
    pick = t.unsqueeze(1)
    return t, denominators.gather(1, pick).squeeze(1), alphas.gather(1, pick).squeeze(1)


class _RankmaxImpl:
    """Per-row statistics and analytic gradient of eq. 14, shared by the dense, chunked and distributed forms."""

    def __init__(self, k: int, margin: float, row_k: torch.Tensor | None = None):
        self.row_k = row_k  # int64[B] per-row k, or None: k for every row
        self.k = k if row_k is None else (int(row_k.max()) if row_k.numel() else 1)
        self.margin = float(margin)

    def forward(self, source, layout: Layout, group):
        k, margin, row_k = self.k, self.margin, self.row_k
        if k > layout.num_items:
            raise ValueError(f"k must be <= the number of items n = {layout.num_items}, got k = {k}")
        if row_k is not None:
            row_k = row_k.to(source.device)
        positive = layout.positive
        # Pass 1: local top-k, and the support sums for the common case mu = z_y - eta (y not in the top k).
        guess = positive - margin
        top, sums = self.local_top_and_support(source, guess)
        gathered = gather_row_stats(torch.cat([top, sums], dim=1), group)  # [W, B, k + 2]
        top = merge_rank_topk(gathered[..., :k])
        sums = gathered[..., k:].sum(dim=0)
        kth = top[:, k - 1] if row_k is None else top.gather(1, (row_k - 1).unsqueeze(1)).squeeze(1)
        y_carries_mu = positive <= kth
        mu = torch.where(y_carries_mu, guess, kth - margin)
        ties_at_kth = torch.ones_like(kth)
        # Pass 2, only for rows whose positive is in the top k (mu = z_[k] - eta): the replicated row set
        # keeps the collectives identical on every rank.
        rows = (~y_carries_mu).nonzero().squeeze(1)
        if rows.numel():
            extra = sum_row_stats(self.local_support_and_ties(source, rows, mu[rows], kth[rows]), group)
            sums[rows] = extra[:, :2]
            ties_at_kth[rows] = extra[:, 2].clamp_min(1)
        support_sum, support_size = sums[:, 0], sums[:, 1]
        t, denominator, alpha = _solve_alpha(top, mu, support_sum, k, row_k)
        prob_positive = alpha * (positive - mu)
        per_row = -torch.log(prob_positive.clamp(max=1.0))
        upper = torch.where(t > 0, top.gather(1, (t - 1).clamp_min(0).unsqueeze(1)).squeeze(1), torch.inf)
        active = prob_positive < 1
        # Rows whose k-th largest score carries mu, found once here rather than in every block of backward
        # (a .nonzero() per block would stall the GPU queue once per block).
        kth_rows = (~y_carries_mu & active).nonzero().squeeze(1)
        state = dict(
            mu=mu, upper=upper, t=t, denominator=denominator, support_size=support_size, kth=kth,
            y_carries_mu=y_carries_mu, ties_at_kth=ties_at_kth, active=active, kth_rows=kth_rows,
        )  # fmt: skip
        return per_row, state

    def local_top_and_support(self, source, guess: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's top-k [B, k] (descending, -inf padded) and (sum_i (z_i - guess)_+, |{i : z_i > guess}|)
        [B, 2], float64, over its columns block by block (``bigrank.losses.fused`` computes them without blocks)."""
        k = self.k
        top = empty_topk(source.batch, k, source.device)
        sums = torch.zeros((source.batch, 2), dtype=torch.float64, device=source.device)
        for _, block in source.blocks():  # one pass: chunked scores are computed once in forward
            if k == 1 and block.shape[1]:  # the max and the support sums in one read of the block
                block_max, support_sum, support_size = max_support_sum_count(block, guess)
                top = torch.maximum(top, block_max.unsqueeze(1))
                sums[:, 0] += support_sum
                sums[:, 1] += support_size
            else:
                top = merge_topk(top, block)
                _accumulate_support(block, guess, sums)
        return top, sums

    def local_support_and_ties(self, source, rows: torch.Tensor, mu: torch.Tensor, kth: torch.Tensor) -> torch.Tensor:
        """For ``rows`` int64[R] of the batch: (sum_i (z_i - mu)_+, |{i : z_i > mu}|, |{i : z_i == kth}|) over
        this rank's columns, float64 [R, 3] (Rankmax's second pass, mu = z_[k] - eta)."""
        extra = torch.zeros((rows.numel(), 3), dtype=torch.float64, device=source.device)
        for _, block in source.blocks(rows):
            _accumulate_support(block, mu, extra[:, :2])
            extra[:, 2] += (block == kth.to(block.dtype).unsqueeze(1)).sum(dim=1)
        return extra

    def grad_block(self, block, start, state, layout: Layout, grad_rows):
        active = state["active"].to(torch.float64)
        weight = grad_rows * active
        denominator, mu = state["denominator"], state["mu"]
        inv_gap = 1.0 / (layout.positive - mu)
        grad = masked_scale(block, mu, state["upper"], weight / denominator)
        via_mu = weight * (inv_gap - (state["support_size"] - state["t"]) / denominator)
        y_carries = state["y_carries_mu"]
        layout.add_at_target(grad, start, torch.where(y_carries, via_mu, 0.0) - weight * inv_gap)
        rows = state["kth_rows"]
        if rows.numel():
            # mu = z_[k] - eta: the k-th largest score carries mu; ties share it equally.
            kth = state["kth"][rows].to(block.dtype).unsqueeze(1)
            share = (via_mu[rows] / state["ties_at_kth"][rows]).to(block.dtype).unsqueeze(1)
            grad[rows] += (block[rows] == kth).to(block.dtype) * share
        return grad


def _accumulate_support(block: torch.Tensor, mu: torch.Tensor, sums: torch.Tensor) -> None:
    """sums[:, 0] += sum_i (z_i - mu)_+ and sums[:, 1] += |{i : z_i > mu}| over this block of columns."""
    support_sum, support_size = support_sum_count(block, mu)
    sums[:, 0] += support_sum
    sums[:, 1] += support_size


def rankmax_loss(
    scores,
    target: torch.Tensor,
    k: int | torch.Tensor = 1,
    margin: float = 1.0,
    reduction: str = "mean",
    *,
    group=None,
    offset: int = 0,
) -> torch.Tensor:
    """Rankmax cross-entropy, eq. 14: ``-log min(1, alpha_y (z_y - mu_y))``; for k = 1, eq. 15's
    ``log sum_i (z_i - z_y + margin)_+``.

    Args:
        scores: float[B, n] scores (or ``ChunkedScores`` for a lazily computed ``U @ V.T``). With ``group``,
            columns ``[offset, offset + n_local)`` of the full [B, n] matrix, the same B rows on every rank.
        target: int64[B], the positive item of each row (global item ids).
        k: size of the (n, k)-simplex, 1 <= k <= n; or int64[B], each row's own k (a label-set size, e.g. from
            ``positives_to_k``), the same tensor on every rank.
        margin: eta > 0 in eq. 11 (the paper uses 1).
        reduction: "mean" | "sum" | "none" (per-row loss [B]).
        group: process group over which the catalog's columns are split (None: single process).
        offset: first global column held by this rank.

    Only per-row statistics cross the wire: each rank's top-k values and two sums (B x (max k + 2) floats), the
    positive's score (B floats), and, for rows whose positive is in the top k, three more sums.
    Gradients are exact (analytic, see the module docstring) w.r.t. ``scores`` (or its factors).
    """
    _check_params(1, margin)
    check_reduction(reduction)
    if isinstance(scores, torch.Tensor):
        check_scores(scores)
    row_k = _row_k(k, int(target.shape[0]) if target.dim() == 1 else -1)
    per_row = catalog_loss_rows(_RankmaxImpl(k if row_k is None else 1, margin, row_k), scores, target, group, offset)
    return reduce_rows(per_row, reduction)


def rankmax(scores: torch.Tensor, target: torch.Tensor, k: int = 1, margin: float = 1.0) -> torch.Tensor:
    """The Rankmax projection of Definition 4 (eq. 13): ``clip_[0,1](alpha_y (z - mu_y))``, float[B, n].

    Each row lies in [0, 1], sums to k and has its positive ``target[b]`` in the support. Single process;
    differentiable by autograd (t and the support are piecewise constant). Cost O(n log k) per row.
    """
    _check_params(k, margin)
    check_scores(scores)
    check_target(target, scores.shape[0])
    raise_if_nonfinite(first_nonfinite_row(scores))
    n = scores.shape[1]
    if k > n:
        raise ValueError(f"k must be <= the number of items n = {n}, got k = {k}")
    target = target.to(device=scores.device, dtype=torch.int64)
    check_target_range(target, n)
    positive = scores.gather(1, target.unsqueeze(1)).squeeze(1)
    top = scores.topk(k, dim=1).values
    mu = torch.minimum(positive, top[:, k - 1]) - margin
    support_sum = (scores - mu.unsqueeze(1)).clamp_min(0).sum(dim=1)
    with torch.no_grad():
        t, _, _ = _solve_alpha(top.double(), mu.double(), support_sum.double(), k)
    gaps = top - mu.unsqueeze(1)
    clipped = (torch.cumsum(gaps, dim=1) - gaps).gather(1, t.unsqueeze(1)).squeeze(1)
    alpha = (k - t).to(scores.dtype) / (support_sum - clipped)
    return (alpha.unsqueeze(1) * (scores - mu.unsqueeze(1))).clamp(0.0, 1.0)


class _SharedRankmax(torch.autograd.Function):
    """Sum over the positives of each row of the k = 1 Rankmax loss, one sort per row (:func:`rankmax_shared_loss`)."""

    @staticmethod
    def forward(ctx, scores: torch.Tensor, positives: torch.Tensor, margin: float):
        n = scores.shape[1]
        ordered, order = torch.sort(scores, dim=1)  # ascending
        cumulative = torch.cumsum(ordered.double(), dim=1)
        total = cumulative[:, -1:]
        threshold = ordered - margin  # t_y = z_y - eta of every item (eq. 11 for k = 1), in sorted order
        at_or_below = torch.searchsorted(ordered, threshold, right=True)  # |{j : z_j <= t_y}|
        above = n - at_or_below  # c_y = |{j : z_j > t_y}|, the row's support
        below_sum = torch.where(
            at_or_below > 0, cumulative.gather(1, (at_or_below - 1).clamp_min(0)), torch.zeros_like(total)
        )
        support_sum = (total - below_sum) - above.double() * threshold.double()  # D_y = sum_i (z_i - t_y)_+
        positive = positives.gather(1, order)
        loss = (torch.log(support_sum) - math.log(margin))[positive].sum()
        inverse = torch.where(positive, 1.0 / support_sum, torch.zeros_like(support_sum))
        # Item i is in the support of every positive y with t_y < z_i: thresholds sort as the scores do, so
        # those y are a prefix of the sorted order and their 1/D_y a prefix sum.
        prefix = torch.cumsum(inverse, dim=1)
        reached = torch.searchsorted(threshold, ordered, right=False)  # |{y : t_y < z_i}|
        in_support = torch.where(reached > 0, prefix.gather(1, (reached - 1).clamp_min(0)), torch.zeros_like(prefix))
        grad = torch.empty_like(scores)
        grad.scatter_(1, order, (in_support - inverse * above.double()).to(scores.dtype))
        ctx.save_for_backward(grad)
        return loss.to(torch.promote_types(scores.dtype, torch.float32))

    @staticmethod
    def backward(ctx, grad_loss):
        (grad,) = ctx.saved_tensors
        return grad * grad_loss.to(grad.dtype), None, None


def rankmax_shared_loss(
    scores: torch.Tensor, positives: torch.Tensor, margin: float = 1.0, reduction: str = "mean"
) -> torch.Tensor:
    """Rankmax cross-entropy for k = 1 (eq. 15) of every row ``(b, y)`` with ``positives[b, y]``, where the rows of
    one ``b`` (a user's positives) share its score vector: ``sum_{b, y} log sum_i (z_bi - z_by + margin)_+ -
    log margin``, equal to ``rankmax_loss(scores[b], y, k=1, margin)`` over those rows.

    One sort per row of ``scores`` instead of one pass per positive: O(n log n) per user against O(|P_b| n).
    With t_y = z_y - margin, D_y the row's sum and c_y = |{j : z_j > t_y}|, the gradient of row b is
    ``dL/dz_i = sum_{y in P_b, t_y < z_i} 1 / D_y - [i in P_b] c_i / D_i`` (eq. 16 summed over the positives).

    Args:
        scores: float[U, n], one score vector per user (single process: no item-parallel split).
        positives: bool[U, n], the positives of each row (rows without any add nothing).
        margin: eta > 0 in eq. 11.
        reduction: "mean" (over the positives) or "sum".
    """
    _check_params(1, margin)
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
    check_scores(scores)
    if positives.shape != scores.shape or positives.dtype != torch.bool:
        raise ValueError(f"positives must be bool{list(scores.shape)}, got {positives.dtype}{list(positives.shape)}")
    raise_if_nonfinite(first_nonfinite_row(scores))
    loss = _SharedRankmax.apply(scores, positives.to(scores.device), float(margin))
    return loss / max(int(positives.sum()), 1) if reduction == "mean" else loss


class RankmaxLoss(torch.nn.Module):
    """``rankmax_loss`` with its hyper-parameters held by the module (k, margin, k_fraction, reduction).

    ``k_fraction`` > 0 sets each row's k from its number of positives (``forward(..., positives=int[B])``, the
    row's user's train items): k_b = max(k, ceil(k_fraction * positives_b)), so k_fraction = 1 projects on the
    (n, |Y_x|)-simplex of Section 3. 0 (default): k for every row.
    """

    def __init__(self, k: int = 1, margin: float = 1.0, reduction: str = "mean", k_fraction: float = 0.0):
        super().__init__()
        _check_params(k, margin)
        _check_k_fraction(k_fraction)
        check_reduction(reduction)
        self.k, self.margin, self.reduction, self.k_fraction = k, margin, reduction, float(k_fraction)

    @property
    def needs_positives(self) -> bool:
        """Whether ``forward`` needs each row's number of positives."""
        return self.k_fraction > 0

    def forward(self, scores, target: torch.Tensor, *, group=None, offset: int = 0, positives=None) -> torch.Tensor:
        k = self.k
        if self.needs_positives:
            if positives is None:
                raise ValueError("RankmaxLoss(k_fraction > 0) needs positives: each row's number of positives")
            k = positives_to_k(torch.as_tensor(positives), self.k, self.k_fraction)
        return rankmax_loss(scores, target, k, self.margin, self.reduction, group=group, offset=offset)

    def extra_repr(self) -> str:
        extra = f", k_fraction={self.k_fraction}" if self.k_fraction else ""
        return f"k={self.k}, margin={self.margin}{extra}, reduction={self.reduction!r}"
