"""Sampled Smooth-AP, Recall@quantile and pAUC@budget when every row shares the same negatives (fused).

``StepLoss``'s sampled candidates are, for row b: its positive (the target, scored on the rank that owns it)
and the negatives every rank drew for the step, shared by all rows; a negative equal to the row's target is an
accidental hit (labelled positive: the generic path's ``candidate_labels``). ``bigrank.losses.softrank`` would
take them as [B, C] scores, labels and mask; here the positive is a dot product ``p_b = u_b . v_{y_b}`` and the
negatives are one [B, N_r] GEMM, so each loss reduces to per-row statistics (the same reduction as
``softrank_catalog`` over the whole catalog). Every positive of row b (the target and its hits) has the score
``p_b``, so with K_b = 1 + hits_b positives and the row's other negatives N_b:

* Smooth-AP (Brown et al., ECCV 2020, eq. 4-7): every positive has the same precision, so
  ``loss_b = 1 - (K_b + 1) / (K_b + 1 + 2 S_b)`` with ``S_b = sum_{j in N_b} sigmoid((s_bj - p_b) / tau)``;
  S is one fused pass over the [B, N_r] buffer (GEMM, sigmoid in place, row sums, the sigmoid's slope kept
  in the same buffer for backward) and the gradient w.r.t. users and negative rows is the two GEMMs of it.
* Recall@quantile: ``1 - sigmoid((p_b - theta_b) / tau)`` with theta the k-th largest valid score, k =
  ceil(q (1 + |negatives|)), taken over the negatives' top-k (no gradient) merged with p_b.
* pAUC@budget: thresholds among the top negatives (hits excluded), the IQR from the same column sample as
  the generic path; the TPR is ``sigmoid((p_b - t_i) / tau_eff)``.

Recall and pAUC take no gradient through the negatives: one no-grad GEMM and a top-k a step. Each function
equals its ``softrank`` twin on the materialised columns [unique positives | negatives] with the generic
path's labels and mask (values and gradients; ``tests/test_sampled_softrank_fused.py``), with or without a
process group splitting the negatives.
"""

from __future__ import annotations

import math

import torch

from bigrank.distributed.collectives import (
    all_gather_no_grad,
    all_gather_rows,
    all_reduce_sum,
    group_rank,
    group_size,
    is_distributed,
)
from bigrank.losses.sampled import accidental_hits, block_rows, low_precision
from bigrank.losses.scores import gather_row_stats, merge_rank_topk
from bigrank.losses.softrank import (
    check_pauc_params,
    check_positive_float,
    check_recall_params,
    count_from_fraction,
    finish,
    row_iqr,
)
from bigrank.losses.validation import check_reduction

__all__ = [
    "pauc_at_budget_shared_negatives",
    "recall_at_quantile_shared_negatives",
    "smooth_ap_shared_negatives",
]

# Rows of the [B, N] buffer handled at once: a block of the GEMM output stays in cache for the passes after it.
_ROW_BLOCK_ELEMENTS = 1 << 20


def _row_totals(positive_scores, hit_rows, width, group, *, local_anchor: bool):
    """(p [B] differentiable, hits [B] int64, other negatives [B] int64), summed over ranks in one collective.

    ``local_anchor``: p enters each rank's own computation (Smooth-AP's sigmoid pass), so its gradient must be
    summed over ranks (an all-gather whose backward reduce-scatters); otherwise p feeds only the replicated
    formula and an all-reduce with identity backward is right.
    """
    batch = positive_scores.shape[0]
    hits = torch.bincount(hit_rows, minlength=batch).to(torch.float64)
    # float64 carries the counts exactly next to the score (one collective for all three).
    packed = torch.stack([positive_scores.to(torch.float64), hits, width - hits], dim=1)
    if is_distributed(group):
        if local_anchor:
            packed = all_gather_rows(packed, group, [batch] * group_size(group)).view(-1, batch, 3).sum(dim=0)
        else:
            packed = all_reduce_sum(packed, group)
    counts = packed[:, 1:].detach().round().to(torch.int64)
    return packed[:, 0].to(positive_scores.dtype), counts[:, 0], counts[:, 1]


@torch.no_grad()
def _negative_scores(user_vectors, negative_rows, hit_rows, hit_cols, fill: float, compute_dtype) -> torch.Tensor:
    """``u_b . v_j`` [B, N_r] without gradient (in ``compute_dtype`` when lower), ``fill`` at the accidental hits
    (None: no fill)."""
    if low_precision(compute_dtype, user_vectors.dtype):
        scores = user_vectors.detach().to(compute_dtype) @ negative_rows.detach().to(compute_dtype).T
    else:
        scores = user_vectors.detach() @ negative_rows.detach().T
    if hit_rows is not None and hit_rows.numel():
        scores[hit_rows, hit_cols] = fill
    return scores


def _global_top(values: torch.Tensor, k: int, group) -> torch.Tensor:
    """The ``k`` largest entries of each row over all ranks: [B, k] descending, -inf padded."""
    batch, width = values.shape
    top = values.new_full((batch, k), float("-inf"))
    if width:
        # torch.topk: on these [B, N_r] blocks (N_r in the thousands, k ~ 0.5% of it) it measured 2-4x faster
        # than kernels.topk_values' two-stage selection, which pays off on catalog-wide rows.
        top[:, : min(k, width)] = values.topk(min(k, width), dim=1).values
    return merge_rank_topk(gather_row_stats(top, group)) if is_distributed(group) else top


# ------------------------------------------------------------------------------------------------ Smooth-AP
class _SharedSigmoidSums(torch.autograd.Function):
    """``S[b] = sum_{j not a hit of b} sigmoid((u_b . v_j - p_b) / tau)``: [B] over this rank's negatives.

    One [B, N_r] buffer: the forward GEMM of ``[u / tau, -p / tau] . [v, 1]`` writes it in row blocks, each
    block turned in cache into the sigmoid (summed) and then its slope ``s (1 - s)``; backward scales the
    slopes in place into dS/dz and runs the two gradient GEMMs. 3 GEMMs of B x N_r x d a step.

    ``compute_dtype`` bf16: the GEMMs run on bf16 operands into a bf16 buffer (the anchor is subtracted from
    each block in float32, not folded into the bf16 GEMM: p / tau would lose its low bits), sums in float32.
    """

    @staticmethod
    def forward(ctx, users, negative_rows, anchors, hit_rows, hit_cols, tau, compute_dtype=None):
        batch, width = users.shape[0], negative_rows.shape[0]
        low = low_precision(compute_dtype, users.dtype)
        slopes = users.new_empty(batch, width, dtype=compute_dtype if low else users.dtype)
        sums = users.new_zeros(batch)
        if low:
            left, right = users.to(compute_dtype), negative_rows.to(compute_dtype)
            right_t, shift = right.t(), anchors.detach().unsqueeze(1)
        else:
            left = torch.cat([users / tau, (-anchors / tau).unsqueeze(1)], dim=1)
            right_t = torch.cat([negative_rows, negative_rows.new_ones(width, 1)], dim=1).t()
        if width:
            block = max(1, _ROW_BLOCK_ELEMENTS // width)
            for start in range(0, batch, block):
                stop = min(start + block, batch)
                out = slopes[start:stop]
                torch.mm(left[start:stop], right_t, out=out)
                s = out.to(users.dtype).sub_(shift[start:stop]).div_(tau) if low else out
                s.sigmoid_()
                hits = block_rows(hit_rows, hit_cols, start, stop)
                if hits is not None:
                    s[hits] = 0.0  # hits are positives: not in S
                sums[start:stop] = s.sum(dim=1)
                s.addcmul_(s, s, value=-1.0)  # s (1 - s); 0 stays 0 at the hits
                if low:
                    out.copy_(s)
        ctx.save_for_backward(left if low else users, right if low else negative_rows, slopes)
        ctx.tau, ctx.dtype = tau, users.dtype
        return sums

    @staticmethod
    def backward(ctx, grad_sums):
        users, negative_rows, slopes = ctx.saved_tensors
        # dS_b / dz_bj = s (1 - s) / tau with z = u . v - p; the buffer becomes dL/dz (one backward only).
        grad_z = slopes.mul_((grad_sums / ctx.tau).to(slopes.dtype).unsqueeze(1))
        grad_anchors = -grad_z.sum(dim=1, dtype=ctx.dtype)
        grad_users = (grad_z @ negative_rows).to(ctx.dtype)
        grad_rows = (grad_z.t() @ users).to(ctx.dtype)
        return grad_users, grad_rows, grad_anchors, None, None, None, None


def smooth_ap_shared_negatives(
    user_vectors: torch.Tensor,
    negative_rows: torch.Tensor,
    negative_ids: torch.Tensor,
    target: torch.Tensor,
    positive_scores: torch.Tensor,
    *,
    temperature: float = 0.01,
    reduction: str = "mean",
    group=None,
    return_valid: bool = False,
    compute_dtype: torch.dtype | None = None,
):
    """1 - Smooth-AP of each row over [its positive | the shared negatives] (Brown et al. 2020, eq. 4-7):
    ``smooth_ap_loss`` on the generic sampled columns, without them.

    Args:
        user_vectors: float[B, d] (all-gathered). negative_rows: float[N_r, d] this rank's negatives (with
            repeats), ``negative_ids`` int64[N_r] their global ids.
        target: int64[B] global positive ids, the same on every rank.
        positive_scores: float[B] ``u_b . v_{y_b}`` for the rows whose target this rank owns, 0 elsewhere.
        temperature: sigmoid temperature tau (score units). reduction: "mean" | "sum" | "none" over rows
            with at least one negative that is not a hit.
        group: process group splitting the negatives across ranks.
        compute_dtype: dtype of the negatives' GEMMs and buffer (``torch.bfloat16`` for ``train.precision=bf16``;
            sigmoids and sums in float32); None = the inputs' dtype.
    """
    check_reduction(reduction)
    tau = check_positive_float(temperature, "temperature")
    hit_rows, hit_cols = accidental_hits(target, negative_ids)
    p, hits, others = _row_totals(positive_scores, hit_rows, negative_ids.numel(), group, local_anchor=True)
    local = _SharedSigmoidSums.apply(user_vectors, negative_rows, p, hit_rows, hit_cols, tau, compute_dtype)
    sums = all_reduce_sum(local, group)
    k = (hits + 1).to(sums.dtype)
    precision = (k + 1) / (k + 1 + 2 * sums)
    return finish(1.0 - precision, others > 0, reduction, return_valid)


# ------------------------------------------------------------------------------------------ Recall@quantile
def recall_at_quantile_shared_negatives(
    user_vectors: torch.Tensor,
    negative_rows: torch.Tensor,
    negative_ids: torch.Tensor,
    target: torch.Tensor,
    positive_scores: torch.Tensor,
    *,
    quantile: float = 0.005,
    temperature: float = 0.01,
    reduction: str = "mean",
    group=None,
    return_valid: bool = False,
    compute_dtype: torch.dtype | None = None,
):
    """1 - soft recall above the row's top-``quantile`` threshold (``recall_at_quantile_loss`` on the generic
    sampled columns). theta = the k-th largest of {p_b} and every negative's score (hits included: they are
    valid columns), k = ceil(quantile * (1 + N)); gradient through p_b only. Args as
    ``smooth_ap_shared_negatives`` plus ``quantile`` in (0, 1)."""
    check_reduction(reduction)
    tau = check_recall_params(quantile, temperature)
    hit_rows, hit_cols = accidental_hits(target, negative_ids)
    p, hits, others = _row_totals(positive_scores, hit_rows, negative_ids.numel(), group, local_anchor=False)
    k = count_from_fraction(float(quantile), 1 + hits + others)  # [B], n_valid = 1 + every negative
    with torch.no_grad():
        scores = _negative_scores(user_vectors, negative_rows, None, None, 0.0, compute_dtype)
        top = _global_top(scores, int(k.max()) if k.numel() else 1, group).to(p.dtype)
        merged = torch.cat([top, p.detach().unsqueeze(1)], dim=1).sort(dim=1, descending=True).values
        theta = merged.gather(1, (k - 1).unsqueeze(1)).squeeze(1)
        theta = torch.where(torch.isfinite(theta), theta, theta.new_zeros(()))
    recall = torch.sigmoid((p - theta) / tau)
    return finish(1.0 - recall, others > 0, reduction, return_valid)


# -------------------------------------------------------------------------------------------- pAUC@budget
def pauc_at_budget_shared_negatives(
    user_vectors: torch.Tensor,
    negative_rows: torch.Tensor,
    negative_ids: torch.Tensor,
    target: torch.Tensor,
    positive_scores: torch.Tensor,
    *,
    positive_columns: int = 0,
    alpha: float = 0.0,
    beta: float = 0.005,
    temperature: float = 0.1,
    tau_scale: str = "iqr",
    n_knots: int = 2,
    scale_sample_size: int = 2048,
    reduction: str = "mean",
    group=None,
    return_valid: bool = False,
    compute_dtype: torch.dtype | None = None,
):
    """1 - normalised partial AUC over FPR [alpha, beta] (``pauc_at_budget_loss`` on the generic sampled
    columns). The negatives of row b are the shared negatives that are not its hits; thresholds t_i = the
    ceil(f_i |N_b|)-th largest of them (no gradient); TPR_i = sigmoid((p_b - t_i) / tau_eff).

    ``positive_columns``: how many positive columns precede this rank's negatives in the generic layout
    [unique positives | negatives] (the unique targets this rank owns); the IQR sample picks the same global
    column stride over that layout, so ``tau_scale="iqr"`` gives the generic value exactly. Other args as
    ``smooth_ap_shared_negatives`` and ``pauc_at_budget_loss``.
    """
    check_reduction(reduction)
    tau = check_pauc_params(alpha, beta, temperature, tau_scale, n_knots, scale_sample_size)
    hit_rows, hit_cols = accidental_hits(target, negative_ids)
    p, hits, others = _row_totals(positive_scores, hit_rows, negative_ids.numel(), group, local_anchor=False)
    with torch.no_grad():
        negatives = _negative_scores(user_vectors, negative_rows, hit_rows, hit_cols, float("-inf"), compute_dtype)
        knots = torch.linspace(float(alpha), float(beta), n_knots, dtype=torch.float64)
        k = count_from_fraction(knots.unsqueeze(0), others.unsqueeze(1))  # [B, n_knots]
        top = _global_top(negatives, int(k.max()) if k.numel() else 1, group).to(p.dtype)
        thresholds = top.gather(1, k - 1)
        thresholds = torch.where(torch.isfinite(thresholds), thresholds, thresholds.new_zeros(()))
        if tau_scale == "band":
            scale = thresholds[:, 0] - thresholds[:, -1]
        else:
            scale = _sampled_iqr(negatives, positive_columns, scale_sample_size, group)
        usable = torch.isfinite(scale) & (scale > 0)
        tau_eff = torch.where(usable, tau * scale, scale.new_ones(()))
    tpr = torch.sigmoid((p.unsqueeze(1) - thresholds) / tau_eff.unsqueeze(1))  # [B, n_knots]
    pauc = (0.5 * (tpr[:, 0] + tpr[:, -1]) + tpr[:, 1:-1].sum(dim=1)) / (n_knots - 1)
    return finish(1.0 - pauc, (others > 0) & usable, reduction, return_valid)


@torch.no_grad()
def _sampled_iqr(negatives: torch.Tensor, positive_columns: int, sample_size: int, group) -> torch.Tensor:
    """IQR of each row's negatives among the columns of ``softrank._negative_iqr``'s stride over the generic
    layout (``positive_columns`` positives, then the negatives, rank after rank): [B], NaN without a sample.
    The positive columns are never negatives (NaN there), so only the negatives' columns are taken."""
    width = positive_columns + negatives.shape[1]
    if is_distributed(group):
        sizes = all_gather_no_grad(torch.tensor([width], dtype=torch.int64, device=negatives.device), group).tolist()
        offset, total = sum(sizes[: group_rank(group)]), sum(sizes)
    else:
        offset, total = 0, width
    stride = max(1, math.ceil(total / sample_size))
    first = (-offset) % stride
    if first < positive_columns:  # the first sampled column at or after the negatives
        first += math.ceil((positive_columns - first) / stride) * stride
    sample = negatives[:, first - positive_columns :: stride]  # a strided view: no index tensor
    sample = sample.to(torch.promote_types(negatives.dtype, torch.float32))
    sample = sample.masked_fill(sample == float("-inf"), float("nan"))  # the hits (-inf) are not negatives
    if is_distributed(group):
        sample = all_gather_no_grad(sample.t().contiguous(), group).t()
    if sample.shape[1] == 0:
        return negatives.new_full((negatives.shape[0],), float("nan"))
    return row_iqr(sample)
