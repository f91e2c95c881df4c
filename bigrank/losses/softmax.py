"""Softmax cross-entropy over the full catalog, single-process or item-parallel.

loss(z, y) = -z_y + log sum_i exp(z_i)  (Section 3.3 of the Rankmax paper, "Comparison to Softmax"); gradient
softmax(z) - e_y. Distributed, as Megatron's vocab-parallel cross-entropy: each rank sends its row max and
sum-exp (B x 2 floats) and the positive's score comes from its owner.
"""

from __future__ import annotations

import torch

from bigrank.losses.kernels import exp_grad, max_and_sum_exp
from bigrank.losses.scores import Layout, catalog_loss_rows, divide_scores, gather_row_stats
from bigrank.losses.validation import (
    check_reduction,
    check_scores,
    check_temperature,
    first_nonfinite_row,
    raise_if_nonfinite,
    reduce_rows,
)

__all__ = ["softmax_loss", "softmax_shared_loss", "SoftmaxLoss"]


def local_max_sum_exp(source) -> tuple[torch.Tensor, torch.Tensor]:
    """(max_i z_i, sum_i exp(z_i - max)) over this rank's columns of ``source`` (a score source,
    ``bigrank.losses.scores``), float64 [B] each, block by block."""
    row_max = torch.full((source.batch,), float("-inf"), dtype=torch.float64, device=source.device)
    sum_exp = torch.zeros(source.batch, dtype=torch.float64, device=source.device)
    for _, block in source.blocks():
        if block.shape[1] == 0:
            continue
        block_max, block_sum = max_and_sum_exp(block)
        new_max = torch.maximum(row_max, block_max)
        # Online log-sum-exp: rescale what was summed under the old max (Milakov & Gimelshein, 2018).
        sum_exp = sum_exp * torch.exp(row_max - new_max) + block_sum * torch.exp(block_max - new_max)
        row_max = new_max
    return row_max, sum_exp


def log_normalizers(row_max: torch.Tensor, sum_exp: torch.Tensor, group) -> torch.Tensor:
    """Each row's log sum_i exp(z_i) over the whole catalog, float64 [B], from every rank's
    :func:`local_max_sum_exp` (one all-gather of 2B floats)."""
    stats = gather_row_stats(torch.stack([row_max, sum_exp], dim=1), group)  # [W, B, 2]
    row_max = stats[..., 0].max(dim=0).values
    scale = torch.exp(stats[..., 0] - row_max)
    sum_exp = (stats[..., 1] * torch.where(stats[..., 1] > 0, scale, 0.0)).sum(dim=0)
    return row_max + torch.log(sum_exp)


class _SoftmaxImpl:
    def local_max_sum_exp(self, source) -> tuple[torch.Tensor, torch.Tensor]:
        """:func:`local_max_sum_exp` (the fused kernels, ``bigrank.losses.fused``, compute the same two numbers
        without blocks)."""
        return local_max_sum_exp(source)

    def forward(self, source, layout: Layout, group):
        log_normalizer = log_normalizers(*self.local_max_sum_exp(source), group)
        return log_normalizer - layout.positive, dict(log_normalizer=log_normalizer)

    def grad_block(self, block, start, state, layout: Layout, grad_rows):
        grad = exp_grad(block, state["log_normalizer"], grad_rows)
        layout.add_at_target(grad, start, -grad_rows)
        return grad


def softmax_loss(
    scores, target: torch.Tensor, reduction: str = "mean", *, group=None, offset: int = 0, temperature: float = 1.0
):
    """Softmax cross-entropy ``-log softmax(z / temperature)_y`` per row.

    Args:
        scores: float[B, n] (or ``ChunkedScores``); with ``group``, columns ``[offset, offset + n_local)``.
        target: int64[B] positive item of each row (global ids).
        reduction: "mean" | "sum" | "none".
        temperature: T > 0 divides the scores (T < 1 sharpens the distribution); for ``ChunkedScores`` the
            user vectors are divided instead (same scores, no B x n tensor).
    """
    check_reduction(reduction)
    check_temperature(temperature)
    if isinstance(scores, torch.Tensor):
        check_scores(scores)
    if temperature != 1.0:
        scores = divide_scores(scores, float(temperature))
    per_row = catalog_loss_rows(_SoftmaxImpl(), scores, target, group, offset)
    return reduce_rows(per_row, reduction)


def softmax_shared_loss(
    scores: torch.Tensor, positives: torch.Tensor, reduction: str = "mean", temperature: float = 1.0
) -> torch.Tensor:
    """Softmax cross-entropy of every row ``(b, y)`` with ``positives[b, y]``, where the rows of one ``b`` (a
    user's positives) share its score vector: ``sum_b (|P_b| * logsumexp(z_b / T) - sum_{y in P_b} z_by / T)``,
    equal to ``softmax_loss(scores[b], y)`` summed over those rows (the softmax twin of
    ``bigrank.losses.rankmax_shared_loss``).

    Args:
        scores: float[U, n], one score vector per user (single process).
        positives: bool[U, n], the positives of each row (rows without any add nothing).
        reduction: "mean" (over the positives) or "sum".
        temperature: T > 0 divides the scores.
    """
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
    check_temperature(temperature)
    check_scores(scores)
    if positives.shape != scores.shape or positives.dtype != torch.bool:
        raise ValueError(f"positives must be bool{list(scores.shape)}, got {positives.dtype}{list(positives.shape)}")
    raise_if_nonfinite(first_nonfinite_row(scores))
    logits = scores / temperature if temperature != 1.0 else scores
    positives = positives.to(scores.device)
    counts = positives.sum(dim=1).to(logits.dtype)
    loss = (counts * torch.logsumexp(logits, dim=1)).sum() - logits[positives].sum()
    return loss / max(int(positives.sum()), 1) if reduction == "mean" else loss


class SoftmaxLoss(torch.nn.Module):
    """``softmax_loss`` as a module."""

    def __init__(self, reduction: str = "mean", temperature: float = 1.0):
        super().__init__()
        check_reduction(reduction)
        check_temperature(temperature)
        self.reduction = reduction
        self.temperature = float(temperature)

    def forward(self, scores, target: torch.Tensor, *, group=None, offset: int = 0) -> torch.Tensor:
        return softmax_loss(scores, target, self.reduction, group=group, offset=offset, temperature=self.temperature)
