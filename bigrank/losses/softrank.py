"""Sigmoid soft-rank losses over candidate columns: Smooth-AP, Recall@quantile, pAUC@budget.

Each row of ``scores: float[B, C]`` is a query (a user) and its columns are candidates (the catalog shard or
sampled items); ``labels: bool[B, C]`` marks the positives and ``mask: bool[B, C]`` the valid columns (columns
with ``mask == False`` are neither candidates nor positives). The hard rank of a candidate (how many candidates
score above it) is a step function with zero gradient, so these losses replace the indicator
``1[s_j > s_k]`` by ``sigmoid((s_j - s_k) / temperature)``, which tends to the indicator as the temperature
goes to 0 (the temperature semantics of the ``imbalanced-losses`` package: SmoothAPLoss,
RecallAtQuantileLoss, PAUCAtBudgetLoss).

Item-parallel use: with ``group``, every rank holds ALL B rows but only its own columns; the loss value (and
the gradient w.r.t. each rank's local scores) equals the single-process result on the columns concatenated in
rank order. Ranks exchange only per-row statistics: counts, the positives' scores (O(B * P)), each shard's
top values (O(B * K)) and per-positive partial sums.

Degenerate rows (no positive, or every valid candidate positive) are left out of ``mean``/``sum`` (and are 0
with ``reduction="none"``), never NaN. Pass ``return_valid=True`` to get the per-row flag ``valid: bool[B]``
(identical on every rank); the module classes store the number of excluded rows of their last call in
``last_excluded_rows``.

The helpers ``check_candidates``, ``row_counts``, ``local_positives``, ``gather_positives`` and
``global_top_values`` are shared with ``softndcg.py`` and ``sampled.py``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from bigrank.distributed.collectives import (
    all_gather_no_grad,
    all_gather_replicated,
    all_gather_rows,
    all_reduce_sum,
    group_rank,
    is_distributed,
)
from bigrank.losses.kernels import topk_values
from bigrank.losses.scores import gather_row_stats, merge_rank_topk
from bigrank.losses.validation import check_reduction, check_scores, first_nonfinite_row, reduce_rows

__all__ = [
    "PAUCAtBudgetLoss",
    "RecallAtQuantileLoss",
    "SmoothAPLoss",
    "pauc_at_budget_loss",
    "recall_at_quantile_loss",
    "smooth_ap_loss",
]

# Elements of the [B, P, chunk] pairwise block materialised at once by Smooth-AP (bounded memory).
PAIRWISE_BLOCK_ELEMENTS = 1 << 22
# Rounding guard when turning a fraction into a count: ceil(0.005 * 1000) must be 5, not 6.
_COUNT_EPS = 1e-9


# ------------------------------------------------------------------------------------------- shared helpers
@dataclass
class Candidates:
    """Checked inputs of a candidate loss on this rank, and per-row counts over all ranks.

    ``scores`` are the local scores with masked-out columns replaced by 0 (so a NaN or inf in a masked column
    can never reach a sum or a gradient); ``valid`` and ``positive`` are local [B, C] flags; ``n_valid``,
    ``n_positive`` and ``n_negative`` are global per-row counts [B] (int64, replicated).
    """

    scores: torch.Tensor
    valid: torch.Tensor
    positive: torch.Tensor
    n_valid: torch.Tensor
    n_positive: torch.Tensor

    @property
    def n_negative(self) -> torch.Tensor:
        return self.n_valid - self.n_positive

    @property
    def nondegenerate(self) -> torch.Tensor:
        """Rows with at least one positive and at least one negative candidate: bool [B]."""
        return (self.n_positive > 0) & (self.n_positive < self.n_valid)


def check_flags(flags: torch.Tensor | None, scores: torch.Tensor, name: str) -> None:
    if flags is None:
        return
    if not isinstance(flags, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(flags).__name__}")
    if flags.dtype != torch.bool:
        raise ValueError(f"{name} must be a bool tensor, got dtype {flags.dtype}")
    if flags.shape != scores.shape:
        raise ValueError(f"{name} must have the shape of scores {tuple(scores.shape)}, got {tuple(flags.shape)}")


def check_pauc_params(alpha, beta, temperature, tau_scale, n_knots, scale_sample_size) -> float:
    """Check pAUC@budget's parameters (ValueError naming the bad one); returns the temperature as a float."""
    tau = check_positive_float(temperature, "temperature")
    if not (0.0 <= float(alpha) < float(beta) <= 1.0):
        raise ValueError(f"need 0 <= alpha < beta <= 1, got alpha={alpha!r}, beta={beta!r}")
    if tau_scale not in ("iqr", "band"):
        raise ValueError(f"tau_scale must be 'iqr' or 'band', got {tau_scale!r}")
    if isinstance(n_knots, bool) or not isinstance(n_knots, int) or n_knots < 2:
        raise ValueError(f"n_knots must be an integer >= 2, got {n_knots!r}")
    if isinstance(scale_sample_size, bool) or not isinstance(scale_sample_size, int) or scale_sample_size < 4:
        raise ValueError(f"scale_sample_size must be an integer >= 4, got {scale_sample_size!r}")
    return tau


def check_recall_params(quantile, temperature) -> float:
    """Check Recall@quantile's parameters (ValueError naming the bad one); returns the temperature as a float."""
    tau = check_positive_float(temperature, "temperature")
    if not 0.0 < float(quantile) < 1.0:
        raise ValueError(f"quantile must be in (0, 1), got {quantile!r}")
    return tau


def check_positive_float(value: float, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a positive finite number, got {value!r}")
    return float(value)


def check_candidates(scores, labels, mask, reduction: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Check shapes/dtypes; return (scores with masked columns zeroed, valid [B, C], positive [B, C])."""
    check_reduction(reduction)
    check_scores(scores)
    check_flags(labels, scores, "labels")
    if labels is None:
        raise ValueError("labels must be a bool tensor [B, C], got None")
    check_flags(mask, scores, "mask")
    if mask is None:
        return scores, torch.ones_like(labels), labels
    return scores.masked_fill(~mask, 0.0), mask, labels & mask


def row_counts(
    scores, valid, positive, group, raw_scores=None, bad_labels=None, labels_problem: str = ""
) -> tuple[torch.Tensor, torch.Tensor]:
    """Global per-row (n_valid, n_positive) [B] int64, and a ValueError on every rank at once when any rank
    holds a NaN/inf score in a valid column, or flags a row in ``bad_labels`` (bool [B], described by
    ``labels_problem``). One all-reduce of B x 4 integers. ``raw_scores``: the scores before masking when a
    mask was given; None means no mask (every column valid, so no need to count ``valid``)."""
    raw = scores if raw_scores is None else raw_scores
    bad = first_nonfinite_row(raw)
    if bool(bad.any()) and raw_scores is not None:
        # Only valid columns matter: masked columns may hold -inf on purpose.
        rows = bad.nonzero().squeeze(1)
        finite_or_masked = torch.isfinite(raw.detach()[rows]) | ~valid[rows]
        bad[rows] = ~finite_or_masked.all(dim=1)
    if bad_labels is None:
        bad_labels = torch.zeros_like(bad)
    if raw_scores is None:
        n_valid = torch.full_like(bad, scores.shape[1], dtype=torch.int64)
    else:
        n_valid = valid.sum(dim=1)
    counts = torch.stack([n_valid, positive.sum(dim=1), bad.to(torch.int64), bad_labels.to(torch.int64)], dim=1)
    with torch.no_grad():
        counts = all_reduce_sum(counts, group)
    if bool(counts[:, 2].any()):
        rows = counts[:, 2].nonzero().squeeze(1)[:5].tolist()
        raise ValueError(f"scores hold NaN or infinite values in valid columns of rows {rows}")
    if bool(counts[:, 3].any()):
        rows = counts[:, 3].nonzero().squeeze(1)[:5].tolist()
        raise ValueError(f"{labels_problem} (rows {rows})")
    return counts[:, 0], counts[:, 1]


def prepare(scores, labels, mask, reduction: str, group) -> Candidates:
    """``check_candidates`` + ``row_counts`` in one call."""
    clean, valid, positive = check_candidates(scores, labels, mask, reduction)
    n_valid, n_positive = row_counts(clean, valid, positive, group, raw_scores=None if mask is None else scores)
    return Candidates(clean, valid, positive, n_valid, n_positive)


def local_positives(values: torch.Tensor, flags: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The flagged entries of each row, left-aligned and padded: (values [B, P], present bool [B, P]).

    P = max(1, most flags in a row), so the result is never empty; padding holds 0 and has no gradient.
    O(B * C) for the scan plus O(nnz), no sort.
    """
    batch = flags.shape[0]
    per_row = flags.sum(dim=1)
    width = max(1, int(per_row.max())) if batch else 1
    rows, cols = flags.nonzero(as_tuple=True)
    starts = torch.cumsum(per_row, 0) - per_row
    slot = torch.arange(rows.numel(), device=flags.device) - starts[rows]
    index = torch.zeros(batch, width, dtype=torch.int64, device=flags.device)
    present = torch.zeros(batch, width, dtype=torch.bool, device=flags.device)
    index[rows, slot] = cols
    present[rows, slot] = True
    if values.shape[1] == 0:
        # An empty shard still joins the autograd graph (the sum of no columns is an exact 0), so that this
        # rank runs the same backward collectives as the others.
        return values.new_zeros(batch, width) + values.sum(dim=1, keepdim=True), present
    picked = values.gather(1, index)
    return torch.where(present, picked, picked.new_zeros(())), present


def gather_positives(
    values: torch.Tensor, present: torch.Tensor, group, replicated: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Concatenate every rank's local positives [B, P_r] into [B, sum_r P_r] (rank order).

    ``replicated=False`` (``all_gather_rows``): each rank compares the gathered positives with its own columns
    (a different local computation per rank), so their gradient is summed over ranks and each rank keeps its
    own slice. ``replicated=True`` (``all_gather_replicated``): every rank runs the same computation on them.
    """
    if not is_distributed(group):
        return values, present
    gather = all_gather_replicated if replicated else all_gather_rows
    packed = torch.stack([values, present.to(values.dtype)], dim=-1).transpose(0, 1)  # [P_r, B, 2]
    gathered = gather(packed.contiguous(), group).transpose(0, 1)  # [B, sum P_r, 2]
    return gathered[..., 0], gathered[..., 1].detach() > 0.5


@torch.no_grad()
def global_top_values(values: torch.Tensor, k: int, group) -> torch.Tensor:
    """The ``k`` largest entries of each row over all ranks' columns: [B, k] descending, padded with -inf.

    Each rank sends its own top-k (B x k values) and every rank merges them: the all-gather thresholding of
    the item-parallel design; exact, no approximation. ``values`` uses -inf for excluded columns.
    """
    batch, width = values.shape
    top = values.new_full((batch, k), float("-inf"))
    if width:
        local = topk_values(values, k)
        top[:, : local.shape[1]] = local
    return merge_rank_topk(gather_row_stats(top, group)) if is_distributed(group) else top


def count_from_fraction(fraction: float | torch.Tensor, total: torch.Tensor) -> torch.Tensor:
    """ceil(fraction * total) clamped to [1, max(total, 1)]: how many top entries a fraction covers."""
    count = torch.ceil(torch.as_tensor(fraction, dtype=torch.float64) * total.to(torch.float64) - _COUNT_EPS)
    return torch.minimum(count.clamp_min(1), total.clamp_min(1).to(torch.float64)).to(torch.int64)


def finish(per_row, valid, reduction, return_valid):
    loss = reduce_rows(per_row, reduction, valid)
    return (loss, valid) if return_valid else loss


# ------------------------------------------------------------------------------------------------ Smooth-AP
class _PairwiseSigmoidSums(torch.autograd.Function):
    """For every row b and positive k, the local sums over this rank's columns j

        S_all[b, k] = sum_j valid[b, j]    * sigmoid((s[b, j] - p[b, k]) / tau)
        S_pos[b, k] = sum_j positive[b, j] * sigmoid((s[b, j] - p[b, k]) / tau)

    computed in column chunks of a [B, P, chunk] block and recomputed in backward, so memory stays
    O(B * P * chunk) instead of O(B * P * C) saved activations.
    """

    @staticmethod
    def forward(ctx, scores, pos_scores, valid, positive, temperature):
        batch, width = scores.shape
        chunk = max(1, PAIRWISE_BLOCK_ELEMENTS // max(1, batch * pos_scores.shape[1]))
        sums = scores.new_zeros(batch, pos_scores.shape[1], 2)
        for start in range(0, width, chunk):
            weights = _column_weights(valid, positive, start, chunk, scores.dtype)  # [B, J, 2]
            block = _sigmoid_block(scores, pos_scores, start, chunk, temperature)  # [B, P, J]
            sums += torch.bmm(block, weights)
        ctx.save_for_backward(scores, pos_scores, valid, positive)
        ctx.temperature, ctx.chunk = temperature, chunk
        return sums[..., 0], sums[..., 1]

    @staticmethod
    def backward(ctx, grad_all, grad_pos):
        scores, pos_scores, valid, positive = ctx.saved_tensors
        tau, chunk = ctx.temperature, ctx.chunk
        upstream = torch.stack([grad_all, grad_pos], dim=1)  # [B, 2, P]
        grad_scores = torch.zeros_like(scores)
        grad_positives = torch.zeros_like(pos_scores)
        for start in range(0, scores.shape[1], chunk):
            weights = _column_weights(valid, positive, start, chunk, scores.dtype)  # [B, J, 2]
            block = _sigmoid_block(scores, pos_scores, start, chunk, tau)
            slope = block.mul_(1.0 - block).div_(tau)  # d sigmoid(x / tau) / dx, [B, P, J]
            by_column = torch.bmm(upstream, slope)  # [B, 2, J]
            grad_scores[:, start : start + chunk] = (by_column * weights.transpose(1, 2)).sum(dim=1)
            by_positive = torch.bmm(slope, weights)  # [B, P, 2]
            grad_positives -= (by_positive * upstream.transpose(1, 2)).sum(dim=2)
        return grad_scores, grad_positives, None, None, None


def _column_weights(valid, positive, start, chunk, dtype):
    return torch.stack([valid[:, start : start + chunk], positive[:, start : start + chunk]], dim=2).to(dtype)


def _sigmoid_block(scores, pos_scores, start, chunk, tau):
    diff = scores[:, None, start : start + chunk] - pos_scores[:, :, None]
    return torch.sigmoid(diff.div_(tau))


def smooth_ap_loss(
    scores: torch.Tensor,
    labels: torch.Tensor,
    mask: torch.Tensor | None = None,
    reduction: str = "mean",
    *,
    group=None,
    temperature: float = 0.01,
    return_valid: bool = False,
):
    """1 - Smooth-AP per row (Brown et al., ECCV 2020, eq. 4-7; sigmoid ranks as in ``imbalanced-losses``).

    For each positive k of a row, with P the positives and V the valid candidates::

        rank_all(k) = 1 + sum_{j in V, j != k} sigmoid((s_j - s_k) / tau)
        rank_pos(k) = 1 + sum_{j in P, j != k} sigmoid((s_j - s_k) / tau)
        loss        = 1 - mean_{k in P} rank_pos(k) / rank_all(k)

    As tau -> 0 this is 1 - AP (hard average precision). Cost O(P * C) per row (positives against all
    columns), never O(C^2); memory O(B * P * chunk) (see ``PAIRWISE_BLOCK_ELEMENTS``), with P the largest
    positive count of a row in the batch (rows are padded to it). With a group, the positives' scores are
    all-gathered (B x P per rank) and the per-positive sums all-reduced.

    Args:
        scores: float[B, C] local columns. labels: bool[B, C] positives. mask: bool[B, C] valid columns.
        reduction: "mean" | "sum" | "none" (over non-degenerate rows).
        group: process group splitting the columns across ranks (None = single process).
        temperature: sigmoid temperature tau in score units (> 0).
        return_valid: also return the per-row ``valid: bool[B]`` (False = degenerate row, excluded).
    """
    tau = check_positive_float(temperature, "temperature")
    cand = prepare(scores, labels, mask, reduction, group)
    values, present = gather_positives(*local_positives(cand.scores, cand.positive), group)
    sum_all, sum_pos = _PairwiseSigmoidSums.apply(cand.scores, values, cand.valid, cand.positive, tau)
    sum_all, sum_pos = all_reduce_sum(sum_all, group), all_reduce_sum(sum_pos, group)
    # Each positive meets itself once in both sums with sigmoid(0) = 1/2 (and zero net gradient), so
    # "1 + sum over j != k" is "sum over all j + 1/2".
    precision = (sum_pos + 0.5) / (sum_all + 0.5)
    average_precision = (precision * present).sum(dim=1) / cand.n_positive.clamp_min(1)
    return finish(1.0 - average_precision, cand.nondegenerate, reduction, return_valid)


# ------------------------------------------------------------------------------------------ Recall@quantile
def recall_at_quantile_loss(
    scores: torch.Tensor,
    labels: torch.Tensor,
    mask: torch.Tensor | None = None,
    reduction: str = "mean",
    *,
    group=None,
    quantile: float = 0.005,
    temperature: float = 0.01,
    return_valid: bool = False,
):
    """1 - soft recall of the positives above the row's top-``quantile`` threshold (``imbalanced-losses``).

    theta = the k-th largest valid score of the row with k = ceil(quantile * n_valid) (the (1 - q) quantile,
    "higher" interpolation), under stop-gradient; ``loss = 1 - mean_{i in P} sigmoid((s_i - theta) / tau)``.
    Gradients reach the positives only. With a group theta is exact: each shard sends its top k values
    (B x max_b k_b per rank, so meant for small quantiles: 0.005 of 849K columns is 4,245 values per row).

    Args: as ``smooth_ap_loss``, plus ``quantile`` in (0, 1) (fraction of candidates treated as retrieved).
    """
    tau = check_recall_params(quantile, temperature)
    cand = prepare(scores, labels, mask, reduction, group)
    k = count_from_fraction(float(quantile), cand.n_valid)  # [B]
    ranked = cand.scores.detach()
    if mask is not None:
        ranked = ranked.masked_fill(~cand.valid, float("-inf"))
    top = global_top_values(ranked, int(k.max()) if k.numel() else 1, group)
    theta = top.gather(1, (k - 1).unsqueeze(1)).squeeze(1)
    theta = torch.where(torch.isfinite(theta), theta, theta.new_zeros(()))  # empty rows: any finite value
    values, present = local_positives(cand.scores, cand.positive)
    above = torch.sigmoid((values - theta.unsqueeze(1)) / tau) * present
    recall = all_reduce_sum(above.sum(dim=1), group) / cand.n_positive.clamp_min(1)
    return finish(1.0 - recall, cand.nondegenerate, reduction, return_valid)


# -------------------------------------------------------------------------------------------- pAUC@budget
def pauc_at_budget_loss(
    scores: torch.Tensor,
    labels: torch.Tensor,
    mask: torch.Tensor | None = None,
    reduction: str = "mean",
    *,
    group=None,
    alpha: float = 0.0,
    beta: float = 0.005,
    temperature: float = 0.1,
    tau_scale: str = "iqr",
    n_knots: int = 2,
    scale_sample_size: int = 2048,
    return_valid: bool = False,
):
    """1 - normalised partial AUC over the false-positive-rate band [alpha, beta] (trapezoid surrogate of
    ``imbalanced-losses``' PAUCAtBudgetLoss; partial AUC: McClish 1989, Narasimhan & Agarwal 2013).

    With N the row's negatives, knots f_i = alpha + i (beta - alpha) / (n_knots - 1) and thresholds
    t_i = the ceil(f_i |N|)-th largest negative score (at least the 1st; stop-gradient; t_0 = t_alpha,
    t_last = t_beta)::

        tau_eff = temperature * scale            scale = IQR of the negatives  (tau_scale="iqr")
                                                       = t_alpha - t_beta       (tau_scale="band")
        TPR_i   = mean_{p in P} sigmoid((s_p - t_i) / tau_eff)
        loss    = 1 - trapezoid mean of TPR_i over the knots

    ``temperature`` is dimensionless here (a fraction of the scale). Gradients reach the positives only. The
    thresholds are exact with a group (each shard sends its top ceil(beta |N|) negatives); the IQR is taken
    over the negatives among at most ``scale_sample_size`` columns picked by a fixed stride of the global
    column index (exact when the row has <= that many columns), so it is the same with or without a group;
    the default 2,048 keeps the sort behind the quartiles cheap (an IQR from ~2,000 negatives is within a few
    per cent, plenty for a temperature scale).
    Rows whose scale is not positive are degenerate (excluded), like rows without a positive or a negative.
    """
    tau = check_pauc_params(alpha, beta, temperature, tau_scale, n_knots, scale_sample_size)
    cand = prepare(scores, labels, mask, reduction, group)
    negative = ~cand.positive if mask is None else cand.valid & ~cand.positive
    n_negative = cand.n_negative
    knots = torch.linspace(float(alpha), float(beta), n_knots, dtype=torch.float64)
    k = count_from_fraction(knots.unsqueeze(0), n_negative.unsqueeze(1))  # [B, n_knots]
    negatives = cand.scores.detach().masked_fill(~negative, float("-inf"))
    top = global_top_values(negatives, int(k.max()) if k.numel() else 1, group)
    thresholds = top.gather(1, k - 1)  # [B, n_knots]
    thresholds = torch.where(torch.isfinite(thresholds), thresholds, thresholds.new_zeros(()))
    if tau_scale == "band":
        scale = thresholds[:, 0] - thresholds[:, -1]
    else:
        scale = _negative_iqr(cand.scores.detach(), negative, scale_sample_size, group)
    usable = torch.isfinite(scale) & (scale > 0)
    tau_eff = torch.where(usable, tau * scale, scale.new_ones(()))
    values, present = local_positives(cand.scores, cand.positive)
    above = torch.sigmoid((values.unsqueeze(2) - thresholds.unsqueeze(1)) / tau_eff[:, None, None])
    tpr = all_reduce_sum((above * present.unsqueeze(2)).sum(dim=1), group) / cand.n_positive.clamp_min(1)[:, None]
    pauc = (0.5 * (tpr[:, 0] + tpr[:, -1]) + tpr[:, 1:-1].sum(dim=1)) / (n_knots - 1)
    return finish(1.0 - pauc, cand.nondegenerate & usable, reduction, return_valid)


@torch.no_grad()
def _negative_iqr(scores, negative, sample_size, group) -> torch.Tensor:
    """IQR (q75 - q25, linear interpolation) of each row's negatives among the columns whose GLOBAL index is a
    multiple of ceil(C_total / sample_size): [B], NaN for rows without a sampled negative."""
    width = scores.shape[1]
    if is_distributed(group):
        sizes = all_gather_no_grad(torch.tensor([width], dtype=torch.int64, device=scores.device), group).tolist()
        offset, total = sum(sizes[: group_rank(group)]), sum(sizes)
    else:
        offset, total = 0, width
    stride = max(1, math.ceil(total / sample_size))
    columns = torch.arange((-offset) % stride, width, stride, device=scores.device)
    sample = scores[:, columns].masked_fill(~negative[:, columns], float("nan"))
    if is_distributed(group):
        sample = all_gather_no_grad(sample.t().contiguous(), group).t()
    if sample.shape[1] == 0:
        return scores.new_full((scores.shape[0],), float("nan"))
    return row_iqr(sample)


@torch.no_grad()
def row_iqr(sample: torch.Tensor) -> torch.Tensor:
    """q75 - q25 of each row's non-NaN entries (linear interpolation: ``torch.nanquantile``'s values), [B];
    NaN for a row without one. On CPU the rows are sorted by numpy (~7x faster than ``torch.sort`` on rows of
    a few hundred values here), elsewhere by torch."""
    missing = torch.isnan(sample)
    if sample.device.type == "cpu":
        wide = sample.to(torch.promote_types(sample.dtype, torch.float32))
        ordered = torch.from_numpy(np.sort(wide.numpy(), axis=1)).to(sample.dtype)  # NaN sorts last
    else:
        ordered = sample.masked_fill(missing, float("inf")).sort(dim=1).values
    count = (~missing).sum(dim=1)
    quartiles = []
    for fraction in (0.25, 0.75):
        position = fraction * (count - 1).clamp_min(0).to(torch.float64)
        low, high = position.floor().to(torch.int64), position.ceil().to(torch.int64)
        below = ordered.gather(1, low.unsqueeze(1)).squeeze(1)
        above = ordered.gather(1, high.unsqueeze(1)).squeeze(1)
        quartiles.append(torch.lerp(below, above, (position - low).to(sample.dtype)))
    return torch.where(count > 0, quartiles[1] - quartiles[0], sample.new_full((), float("nan")))


# ------------------------------------------------------------------------------------------------- modules
class _CandidateLoss(nn.Module):
    """Shared module plumbing: hyper-parameters as attributes, ``last_excluded_rows`` after each call."""

    def __init__(self, reduction: str):
        super().__init__()
        check_reduction(reduction)
        self.reduction = reduction
        self.last_excluded_rows = 0

    def _run(self, fn, scores, labels, mask, group, **params):
        loss, valid = fn(scores, labels, mask, self.reduction, group=group, return_valid=True, **params)
        self.last_excluded_rows = int((~valid).sum())
        return loss


class SmoothAPLoss(_CandidateLoss):
    """``smooth_ap_loss`` as a module; ``temperature`` is mutable (``LossWarmupWrapper`` schedules it)."""

    def __init__(self, temperature: float = 0.01, reduction: str = "mean"):
        super().__init__(reduction)
        self.temperature = check_positive_float(temperature, "temperature")

    def forward(self, scores, labels, mask=None, *, group=None):
        return self._run(smooth_ap_loss, scores, labels, mask, group, temperature=self.temperature)


class RecallAtQuantileLoss(_CandidateLoss):
    """``recall_at_quantile_loss`` as a module; ``temperature`` is mutable."""

    def __init__(self, quantile: float = 0.005, temperature: float = 0.01, reduction: str = "mean"):
        super().__init__(reduction)
        self.temperature = check_recall_params(quantile, temperature)
        self.quantile = float(quantile)

    def forward(self, scores, labels, mask=None, *, group=None):
        return self._run(
            recall_at_quantile_loss, scores, labels, mask, group, quantile=self.quantile, temperature=self.temperature
        )


class PAUCAtBudgetLoss(_CandidateLoss):
    """``pauc_at_budget_loss`` as a module; ``temperature`` (dimensionless) is mutable."""

    def __init__(
        self,
        alpha: float = 0.0,
        beta: float = 0.005,
        temperature: float = 0.1,
        tau_scale: str = "iqr",
        n_knots: int = 2,
        scale_sample_size: int = 2048,
        reduction: str = "mean",
    ):
        super().__init__(reduction)
        self.temperature = check_pauc_params(alpha, beta, temperature, tau_scale, n_knots, scale_sample_size)
        self.alpha, self.beta = float(alpha), float(beta)
        self.tau_scale, self.n_knots, self.scale_sample_size = tau_scale, n_knots, scale_sample_size

    def forward(self, scores, labels, mask=None, *, group=None):
        return self._run(
            pauc_at_budget_loss,
            scores,
            labels,
            mask,
            group,
            alpha=self.alpha,
            beta=self.beta,
            temperature=self.temperature,
            tau_scale=self.tau_scale,
            n_knots=self.n_knots,
            scale_sample_size=self.scale_sample_size,
        )
