"""Sparsemax and the sparsemax loss (Martins & Astudillo, ICML 2016), the Rankmax paper's third baseline.

sparsemax(z) = (z - tau)_+ with tau such that sum_i (z_i - tau)_+ = 1 (their eq. 2 / Algorithm 1): with
z_(1) >= z_(2) >= ..., the support size is K = max{j : 1 + j z_(j) > sum_{i<=j} z_(i)} and
tau = (sum_{i<=K} z_(i) - 1) / K.

Loss (their eq. 18): L(z, y) = -z_y + 1/2 sum_{j in S} (z_j^2 - tau^2) + 1/2, gradient sparsemax(z) - e_y.
Since sum_S (z_j - tau) = 1 this equals -z_y + 1/2 sum_j (z_j - tau)_+^2 + tau + 1/2, whose derivative in tau
vanishes: the form used here, so only sum_j (z_j - tau)_+^2 needs reducing across ranks.

tau needs the sorted support only. We take the top m scores of each row (each shard's top m, merged), and if
the support fills all m (K = m < n) we double m and retry for those rows, as entmax's top-k sparsemax does;
each retry costs one more top-m pass and B x m floats per rank on the wire.
"""

from __future__ import annotations

import torch

from bigrank.losses.kernels import relu_grad
from bigrank.losses.scores import (
    DenseScores,
    Layout,
    catalog_loss_rows,
    divide_scores,
    gather_row_stats,
    local_topk,
    merge_rank_topk,
)
from bigrank.losses.validation import (
    check_reduction,
    check_scores,
    check_temperature,
    first_nonfinite_row,
    raise_if_nonfinite,
    reduce_rows,
)

__all__ = ["sparsemax", "sparsemax_loss", "SparsemaxLoss", "DEFAULT_SUPPORT_GUESS"]

DEFAULT_SUPPORT_GUESS = 64


def _threshold_from_top(top: torch.Tensor):
    """tau and the support size K from the m largest values of each row (descending) [B, m]."""
    m = top.shape[1]
    cumulative = torch.cumsum(top, dim=1)
    ranks = torch.arange(1, m + 1, dtype=top.dtype, device=top.device)
    support_size = ((1 + ranks * top) > cumulative).sum(dim=1)  # the condition holds exactly for j <= K
    tau = (cumulative.gather(1, (support_size - 1).unsqueeze(1)).squeeze(1) - 1) / support_size.to(top.dtype)
    return tau, support_size


def _sparsemax_threshold(source, num_items: int, group, support_guess: int):
    """tau [B] and sum_j (z_j - tau)_+^2 [B] (float64), exact.

    Grows the gathered top-m until every row's support lies strictly inside it (K < m, or m = n); the support
    is then among the gathered values, so the sum of squares needs no further pass over the scores.
    """
    tau = torch.empty(source.batch, dtype=torch.float64, device=source.device)
    squares = torch.empty_like(tau)
    rows = torch.arange(source.batch, device=source.device)
    m = min(max(int(support_guess), 1), num_items)
    while rows.numel():
        top = local_topk(source, m, rows=None if rows.numel() == source.batch else rows)
        top = merge_rank_topk(gather_row_stats(top, group))  # each rank sends R x m values
        row_tau, support_size = _threshold_from_top(top)
        done = (support_size < m) | (m == num_items)
        tau[rows[done]] = row_tau[done]
        inside = (top - row_tau.unsqueeze(1)).clamp_min(0)
        squares[rows[done]] = inside[done].square().sum(dim=1)
        rows = rows[~done]  # replicated on every rank, so every rank retries together
        m = min(2 * m, num_items)
    return tau, squares


class _SparsemaxImpl:
    def __init__(self, support_guess: int):
        self.support_guess = support_guess

    def forward(self, source, layout: Layout, group):
        tau, squares = _sparsemax_threshold(source, layout.num_items, group, self.support_guess)
        return -layout.positive + 0.5 * squares + tau + 0.5, dict(tau=tau)

    def grad_block(self, block, start, state, layout: Layout, grad_rows):
        grad = relu_grad(block, state["tau"], grad_rows)
        layout.add_at_target(grad, start, -grad_rows)
        return grad


def sparsemax(scores: torch.Tensor, support_guess: int = DEFAULT_SUPPORT_GUESS) -> torch.Tensor:
    """Sparsemax of each row, float[B, n] -> float[B, n] (rows on the probability simplex, sparse).

    Single process; differentiable by autograd (tau is computed from ``torch.topk`` values). Cost O(n log m)
    per row with m the support size rounded up to ``support_guess * 2^j``.
    """
    check_scores(scores)
    raise_if_nonfinite(first_nonfinite_row(scores))
    n = scores.shape[1]
    with torch.no_grad():
        tau, _ = _sparsemax_threshold(DenseScores(scores.detach()), n, None, support_guess)
        support_size = (scores.detach() > tau.to(scores.dtype).unsqueeze(1)).sum(dim=1)
    m = int(support_size.max()) if n else 0
    top = scores.topk(m, dim=1).values
    inside = torch.arange(m, device=scores.device).unsqueeze(0) < support_size.unsqueeze(1)
    tau = ((top * inside).sum(dim=1) - 1) / support_size.to(scores.dtype)
    return (scores - tau.unsqueeze(1)).clamp_min(0)


def sparsemax_loss(
    scores,
    target: torch.Tensor,
    reduction: str = "mean",
    *,
    group=None,
    offset: int = 0,
    support_guess: int = DEFAULT_SUPPORT_GUESS,
    temperature: float = 1.0,
) -> torch.Tensor:
    """Sparsemax loss (Martins & Astudillo eq. 18) of ``z / temperature`` per row; gradient
    ``(sparsemax(z / T) - e_y) / T``.

    Args:
        scores: float[B, n] (or ``ChunkedScores``); with ``group``, columns ``[offset, offset + n_local)``.
        target: int64[B] positive item of each row (global ids).
        support_guess: first m of the gathered top-m (doubled while a row's support fills it).
        temperature: T > 0 divides the scores. Sparsemax has no scale of its own: its support is every item
            within about 1 of the threshold, so scores kept small (L2 on the towers) give supports of
            thousands of items; T < 1 sharpens it, as Rankmax's margin and softmax's temperature do.
    """
    check_reduction(reduction)
    check_temperature(temperature)
    if isinstance(scores, torch.Tensor):
        check_scores(scores)
    if int(support_guess) < 1:
        raise ValueError(f"support_guess must be >= 1, got {support_guess}")
    if temperature != 1.0:
        scores = divide_scores(scores, float(temperature))
    per_row = catalog_loss_rows(_SparsemaxImpl(int(support_guess)), scores, target, group, offset)
    return reduce_rows(per_row, reduction)


class SparsemaxLoss(torch.nn.Module):
    """``sparsemax_loss`` as a module."""

    def __init__(self, reduction: str = "mean", support_guess: int = DEFAULT_SUPPORT_GUESS, temperature: float = 1.0):
        super().__init__()
        check_reduction(reduction)
        check_temperature(temperature)
        self.reduction, self.support_guess, self.temperature = reduction, support_guess, float(temperature)

    def forward(self, scores, target: torch.Tensor, *, group=None, offset: int = 0) -> torch.Tensor:
        return sparsemax_loss(
            scores,
            target,
            self.reduction,
            group=group,
            offset=offset,
            support_guess=self.support_guess,
            temperature=self.temperature,
        )
