"""Smooth-AP, Recall@quantile and pAUC@budget over the whole catalog shard, through the chunked score engine.

With ``candidates = catalog`` every item is a candidate and each row has exactly one positive, its target.
``bigrank.losses.softrank`` would need the [B, n_local] scores plus [B, n_local] labels (6.3 GB at 849K
items); here the scores are read as column blocks (``ChunkedScores`` from ``score_matrix``: never the whole
matrix) and the losses reduce to per-row statistics, like the full-catalog losses of ``scores.py``:

* Recall@quantile and pAUC@budget: thresholds are top-k values (no gradient), so a forward scan of the
  blocks (no autograd) finds them and the loss is a function of the positive's score alone, differentiable
  through ``u_b . v_{y_b}`` (a dot product): one GEMM pass a step, no backward GEMM.
* Smooth-AP with one positive: ``1 - 1 / (0.5 + sum_j sigmoid((s_j - s_y) / tau))`` — a sum over all columns,
  so it runs in ``scores.catalog_loss_rows`` (fused sigmoid sums forward, the gradient block by block).

Each equals its ``softrank`` twin on the dense scores with one-hot labels (values and gradients; tests), and
the distributed result equals the single-process one (per-row statistics only cross ranks).
"""

from __future__ import annotations

import math

import torch

from bigrank.distributed.collectives import all_gather_no_grad, all_reduce_sum, is_distributed
from bigrank.losses.kernels import sigmoid_grad, sigmoid_sums
from bigrank.losses.scores import (
    ChunkedScores,
    DenseScores,
    Layout,
    as_score_source,
    catalog_layout,
    catalog_loss_rows,
    check_finite_positive,
    empty_topk,
    gather_row_stats,
    merge_rank_topk,
    merge_topk,
    poison_bad_rows,
    sum_row_stats,
)
from bigrank.losses.softrank import (
    check_pauc_params,
    check_positive_float,
    check_recall_params,
    count_from_fraction,
    row_iqr,
)
from bigrank.losses.validation import check_reduction, reduce_rows

__all__ = ["pauc_at_budget_catalog_loss", "recall_at_quantile_catalog_loss", "smooth_ap_catalog_loss"]


def _prepare(scores, target, group, offset):
    source = as_score_source(scores)
    with torch.no_grad():
        layout = catalog_layout(source, target, group, offset)
    return source, layout


def _positive_scores(source, layout: Layout, group) -> torch.Tensor:
    """s_{b, y_b} [B], replicated, differentiable (summed from the rank that owns y_b; backward identity)."""
    if layout.num_local:
        local = source.gather_columns(layout.local_target)
    else:
        local = source.user_vectors.new_zeros(source.batch) if isinstance(source, ChunkedScores) else None
        local = source.scores.new_zeros(source.batch) if local is None else local
    positive = all_reduce_sum(poison_bad_rows(torch.where(layout.owned, local, local.new_zeros(())), layout), group)
    check_finite_positive(positive, layout)
    return positive


@torch.no_grad()
def _global_topk(source, layout: Layout, k: int, group, exclude_positive: bool) -> torch.Tensor:
    """The k largest scores of each row over all ranks (float64 [B, k], descending, -inf padded), optionally
    leaving each row's positive column out (pAUC ranks negatives only)."""
    best = empty_topk(source.batch, k, source.device)
    for start, block in source.blocks():
        if exclude_positive:
            inside = layout.owned & (layout.local_target >= start) & (layout.local_target < start + block.shape[1])
            if bool(inside.any()):
                if isinstance(source, DenseScores):
                    block = block.clone()  # the caller's tensor
                rows = inside.nonzero().squeeze(1)
                block[rows, layout.local_target[rows] - start] = float("-inf")
        best = merge_topk(best, block)
    return merge_rank_topk(gather_row_stats(best, group)) if is_distributed(group) else best


# ----------------------------------------------------------------------------------------- Recall@quantile
def recall_at_quantile_catalog_loss(
    scores, target: torch.Tensor, reduction: str = "mean", *, group=None, offset: int = 0,
    quantile: float = 0.005, temperature: float = 0.01,
) -> torch.Tensor:  # fmt: skip
    """``recall_at_quantile_loss`` with the whole catalog as candidates and ``target`` as the one positive.

    theta_b = the k-th largest score of row b over all n items, k = ceil(quantile * n) (stop-gradient);
    loss_b = 1 - sigmoid((s_{b,y} - theta_b) / tau). Args: scores float[B, n_local] or ``ChunkedScores``
    (columns ``[offset, offset + n_local)`` with a group), target int64[B] global ids.
    """
    check_reduction(reduction)
    tau = check_recall_params(quantile, temperature)
    source, layout = _prepare(scores, target, group, offset)
    k = int(count_from_fraction(float(quantile), torch.tensor(layout.num_items)))
    theta = _global_topk(source, layout, k, group, exclude_positive=False)[:, k - 1]
    positive = _positive_scores(source, layout, group)
    per_row = 1.0 - torch.sigmoid((positive - theta.to(positive.dtype)) / tau)
    return reduce_rows(per_row, reduction, torch.full_like(layout.owned, layout.num_items > 1))


# --------------------------------------------------------------------------------------------- pAUC@budget
def pauc_at_budget_catalog_loss(
    scores, target: torch.Tensor, reduction: str = "mean", *, group=None, offset: int = 0,
    alpha: float = 0.0, beta: float = 0.005, temperature: float = 0.1, tau_scale: str = "iqr",
    n_knots: int = 2, scale_sample_size: int = 2048,
) -> torch.Tensor:  # fmt: skip
    """``pauc_at_budget_loss`` with the whole catalog as candidates and ``target`` as the one positive: the
    thresholds are the ceil(f_i (n - 1))-th largest negative scores (the positive's column left out), the
    IQR scale comes from the same strided columns of the global index as there."""
    check_reduction(reduction)
    tau = check_pauc_params(alpha, beta, temperature, tau_scale, n_knots, scale_sample_size)
    source, layout = _prepare(scores, target, group, offset)
    knots = torch.linspace(float(alpha), float(beta), n_knots, dtype=torch.float64)
    k = count_from_fraction(knots, torch.tensor(layout.num_items - 1))  # [n_knots]
    top = _global_topk(source, layout, int(k.max()), group, exclude_positive=True)
    thresholds = top[:, k - 1]  # [B, n_knots]
    thresholds = torch.where(torch.isfinite(thresholds), thresholds, thresholds.new_zeros(()))
    if tau_scale == "band":
        scale = thresholds[:, 0] - thresholds[:, -1]
    else:
        scale = _negative_iqr(source, layout, scale_sample_size, group)
    usable = torch.isfinite(scale) & (scale > 0) & (layout.num_items > 1)
    tau_eff = torch.where(usable, tau * scale, scale.new_ones(()))
    positive = _positive_scores(source, layout, group)
    dtype = positive.dtype
    tpr = torch.sigmoid((positive.unsqueeze(1) - thresholds.to(dtype)) / tau_eff.to(dtype).unsqueeze(1))
    pauc = (0.5 * (tpr[:, 0] + tpr[:, -1]) + tpr[:, 1:-1].sum(dim=1)) / (n_knots - 1)
    return reduce_rows(1.0 - pauc, reduction, usable)


@torch.no_grad()
def _negative_iqr(source, layout: Layout, sample_size: int, group) -> torch.Tensor:
    """``softrank._negative_iqr`` on the columns whose global index is a multiple of ceil(n / sample_size):
    only those columns are scored (B x ~sample_size / W per rank)."""
    stride = max(1, math.ceil(layout.num_items / sample_size))
    columns = torch.arange((-layout.offset) % stride, layout.num_local, stride, device=source.device)
    if isinstance(source, ChunkedScores):
        sample = source.user_vectors.detach() @ source.item_rows.detach()[columns].T
    else:
        sample = source.scores.detach()[:, columns]
    positive = layout.owned.unsqueeze(1) & (layout.local_target.unsqueeze(1) == columns.unsqueeze(0))
    sample = sample.masked_fill(positive, float("nan"))
    if is_distributed(group):
        sample = all_gather_no_grad(sample.t().contiguous(), group).t()
    if sample.shape[1] == 0:
        return torch.full((source.batch,), float("nan"), dtype=torch.float64, device=source.device)
    return row_iqr(sample).to(torch.float64)


# ------------------------------------------------------------------------------------------------ Smooth-AP
class _SmoothAPImpl:
    """Smooth-AP with one positive per row for ``scores.catalog_loss_rows``.

    Forward: S_b = sum_j sigmoid((z_bj - z_by) / tau) (the positive's own term is 1/2) and
    D_b = sum_j sigma'_bj, summed over ranks; loss_b = 1 - 1 / (S_b + 1/2) (``smooth_ap_loss`` with
    rank_pos = 1/2 + 1/2). Backward per block: dL/dz_bj = c_b sigma'_bj / tau with c_b = dL_b/dS_b, and the
    positive column also gets -c_b D_b / tau (it is the anchor of every sigmoid; its own term cancels).
    """

    def __init__(self, temperature: float):
        self.tau = temperature

    def forward(self, source, layout: Layout, group):
        anchor = layout.positive
        sums = torch.zeros(source.batch, 2, dtype=torch.float64, device=source.device)
        for _, block in source.blocks():
            if block.shape[1]:
                sums += torch.stack(sigmoid_sums(block, anchor, self.tau), dim=1)
        sums = sum_row_stats(sums, group)
        total = sums[:, 0] + 0.5
        per_row = 1.0 - 1.0 / total
        return per_row, dict(slope=1.0 / total.square(), derivative_sum=sums[:, 1])

    def grad_block(self, block, start, state, layout: Layout, grad_rows):
        scale = grad_rows * state["slope"] / self.tau
        grad = sigmoid_grad(block, layout.positive, self.tau, scale)
        layout.add_at_target(grad, start, -scale * state["derivative_sum"])
        return grad


def smooth_ap_catalog_loss(
    scores, target: torch.Tensor, reduction: str = "mean", *, group=None, offset: int = 0, temperature: float = 0.01
) -> torch.Tensor:
    """``smooth_ap_loss`` with the whole catalog as candidates and ``target`` as the one positive (Brown et al.
    ECCV 2020): ``1 - 1 / (1 + sum_{j != y} sigmoid((s_j - s_y) / tau))`` per row, chunked (``ChunkedScores``)
    or dense, single-process or item-parallel."""
    check_reduction(reduction)
    tau = check_positive_float(temperature, "temperature")
    per_row = catalog_loss_rows(_SmoothAPImpl(tau), scores, target, group, offset)
    return reduce_rows(per_row, reduction)
