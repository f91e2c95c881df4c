"""Sampled softmax with the logQ correction (Bengio & Senecal, "Adaptive importance sampling to accelerate
training of a neural probabilistic language model", IEEE TNN 2008; Jean et al. ACL 2015; Yi et al.,
"Sampling-bias-corrected neural modeling for large corpus item recommendations", RecSys 2019, eq. 3).

A row's candidates are its positives and negatives drawn from a proposal Q (uniform, popularity^beta, or the
other rows' items for in-batch negatives: see ``bigrank.data.samplers``). Softmax over sampled candidates is a
biased estimate of the full softmax unless each logit is corrected by the log of how often the item is
drawn: ``z_j = s_j - log q_j``. Columns may be split across ranks (each rank scores the candidates of its own
item shard); the result equals the single-process loss on the concatenated columns.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from bigrank.distributed.collectives import all_reduce_max, all_reduce_sum
from bigrank.losses.softrank import (
    Candidates,
    check_candidates,
    finish,
    gather_positives,
    local_positives,
    row_counts,
)
from bigrank.losses.validation import check_reduction

__all__ = ["SampledSoftmaxLoss", "sampled_softmax_loss"]


def _check_log_q(log_q, scores) -> torch.Tensor | None:
    if log_q is None:
        return None
    if not isinstance(log_q, torch.Tensor) or not log_q.is_floating_point():
        raise ValueError(f"log_q must be a floating-point tensor [C] or [B, C], got {type(log_q).__name__}")
    if log_q.shape not in (scores.shape[1:], scores.shape):
        raise ValueError(
            f"log_q must have shape [C]={tuple(scores.shape[1:])} or [B, C]={tuple(scores.shape)}, "
            f"got {tuple(log_q.shape)}"
        )
    return log_q.detach().to(scores.dtype)


def sampled_softmax_loss(
    scores: torch.Tensor,
    labels: torch.Tensor,
    log_q: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
    reduction: str = "mean",
    *,
    group=None,
    return_valid: bool = False,
):
    """Sampled softmax cross-entropy with logQ correction, averaged over each row's positives.

    With corrected logits ``z_j = s_j - log_q_j`` and N the row's negative candidates, each positive p costs
    ``-log(exp(z_p) / (exp(z_p) + sum_{n in N} exp(z_n)))``: other positives are left out of p's denominator
    (they are not negatives: "accidental hit" removal), so with one positive per row this is the usual
    cross-entropy over the candidates.

    Args:
        scores: float[B, C] candidate scores (local columns with a group). labels: bool[B, C] positives.
        log_q: float[C] or [B, C], log of the expected number of draws of each candidate under the proposal
            (``bigrank.data.samplers`` returns it); applied to positives and negatives alike, as in Yi et al.
            Pass 0 where a column should not be corrected; None = no correction.
        mask: bool[B, C] valid columns. reduction: "mean" | "sum" | "none" over non-degenerate rows.
        group: process group splitting the columns across ranks.
        return_valid: also return ``valid: bool[B]`` (False = no positive or no negative: excluded).
    """
    clean, valid, positive = check_candidates(scores, labels, mask, reduction)
    log_q = _check_log_q(log_q, scores)
    bad_log_q = None
    if log_q is not None:
        nonfinite = ~torch.isfinite(log_q)
        if mask is not None:
            bad_log_q = (nonfinite & valid).any(dim=1)
        elif nonfinite.dim() == 2:
            bad_log_q = nonfinite.any(dim=1)
        else:
            bad_log_q = nonfinite.any().expand(valid.shape[0])
    n_valid, n_positive = row_counts(
        clean, valid, positive, group, raw_scores=None if mask is None else scores, bad_labels=bad_log_q,
        labels_problem="log_q must be finite in every valid column (an item never drawn has no column)",
    )  # fmt: skip
    cand = Candidates(clean, valid, positive, n_valid, n_positive)
    if log_q is not None and mask is not None:
        log_q = torch.where(cand.valid, log_q, log_q.new_zeros(()))  # masked columns may hold +-inf
    logits = cand.scores if log_q is None else cand.scores - log_q
    negative = ~cand.positive if mask is None else cand.valid & ~cand.positive
    has_negative = negative.any(dim=1)  # on this rank
    negatives = logits.masked_fill(~negative, float("-inf"))
    if not bool(has_negative.all()):
        # logsumexp of an all -inf row has a NaN gradient: give such rows finite dummies, dropped just below.
        negatives = negatives.masked_fill(~has_negative.unsqueeze(1), 0.0)
    # Log-sum-exp of the negatives across ranks: each rank's own log-sum-exp, shifted by their all-reduced max
    # (a stabiliser, no gradient needed) and summed, as Megatron's vocab-parallel cross-entropy.
    local_lse = torch.logsumexp(negatives, dim=1) if negatives.shape[1] else negatives.new_zeros(negatives.shape[0])
    local_lse = torch.where(has_negative, local_lse, local_lse.new_full((), float("-inf")))
    shift = all_reduce_max(local_lse, group)
    shift = torch.where(torch.isfinite(shift), shift, shift.new_zeros(()))
    sum_exp = all_reduce_sum(torch.exp(local_lse - shift), group)
    log_sum_neg = shift + torch.log(sum_exp.clamp_min(torch.finfo(sum_exp.dtype).tiny))
    # The rest is replicated on every rank (so that each rank's gradient w.r.t. its partial sum is complete):
    # gather all positives' corrected logits.
    values, present = gather_positives(*local_positives(logits, cand.positive), group, replicated=True)
    per_positive = F.softplus(log_sum_neg.unsqueeze(1) - values) * present  # -log sigmoid(z_p - lse_neg)
    per_row = per_positive.sum(dim=1) / cand.n_positive.clamp_min(1)
    return finish(per_row, cand.nondegenerate, reduction, return_valid)


class SampledSoftmaxLoss(nn.Module):
    """``sampled_softmax_loss`` as a module; ``last_excluded_rows`` counts the degenerate rows of the last call.

    ``temperature`` divides the scores before the logQ correction (1.0 = plain sampled softmax), so the loss
    can be annealed by ``LossWarmupWrapper`` like the soft-rank losses.
    """

    def __init__(self, temperature: float = 1.0, reduction: str = "mean"):
        super().__init__()
        check_reduction(reduction)
        if not temperature > 0:
            raise ValueError(f"temperature must be > 0, got {temperature!r}")
        self.temperature, self.reduction = float(temperature), reduction
        self.last_excluded_rows = 0

    def forward(self, scores, labels, mask=None, *, group=None, log_q=None):
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature!r}")
        if self.temperature != 1.0:
            scores = scores / self.temperature  # the logQ correction applies to the tempered logits
        loss, valid = sampled_softmax_loss(scores, labels, log_q, mask, self.reduction, group=group, return_valid=True)
        self.last_excluded_rows = int((~valid).sum())
        return loss


# ------------------------------------------------------------------------------- fused, shared negatives
# Rows of the [B, N] logit block handled at once in the forward pass: the GEMM output of a block stays in
# cache for the max / exp / sum passes that follow it (2^21 floats = 8 MB: 512 rows of 4,096 negatives).
_ROW_BLOCK_ELEMENTS = 1 << 21


def accidental_hits(target: torch.Tensor, negative_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The pairs ``(row b, column j)`` with ``negative_ids[j] == target[b]``: (rows int64[h], columns int64[h]).

    O((B + N) log N) with a sort and two binary searches, instead of the [B, N] comparison.
    """
    if negative_ids.numel() == 0 or target.numel() == 0:
        empty = torch.empty(0, dtype=torch.int64, device=target.device)
        return empty, empty
    sorted_ids, order = negative_ids.sort()
    lo = torch.searchsorted(sorted_ids, target, right=False)
    hi = torch.searchsorted(sorted_ids, target, right=True)
    counts = hi - lo
    total = int(counts.sum())
    if total == 0:
        empty = torch.empty(0, dtype=torch.int64, device=target.device)
        return empty, empty
    rows = torch.repeat_interleave(torch.arange(target.numel(), device=target.device), counts)
    first = torch.repeat_interleave(lo - (torch.cumsum(counts, 0) - counts), counts)
    return rows, order[first + torch.arange(total, device=target.device)]


def low_precision(compute_dtype: torch.dtype | None, dtype: torch.dtype) -> bool:
    """True when the fused GEMMs should run in ``compute_dtype`` (e.g. bf16) below the parameters' ``dtype``."""
    return compute_dtype is not None and compute_dtype != dtype and torch.finfo(compute_dtype).bits < 32


def block_rows(hit_rows, hit_cols, start, stop):
    """The accidental hits inside rows [start, stop) of a row block: (block rows, columns), or None."""
    if hit_rows.numel() == 0:
        return None
    inside = (hit_rows >= start) & (hit_rows < stop)
    return (hit_rows[inside] - start, hit_cols[inside]) if bool(inside.any()) else None


class _NegativeLogSumExp(torch.autograd.Function):
    """``lse[b] = log sum_{j not a hit of b} exp(u_b . v_j / T - log_q_j)``: [B], -inf for rows without a
    negative. One [B, N] buffer: the forward GEMM writes it in row blocks, each block turned into
    ``exp(z - rowmax)`` while in cache; backward scales it in place into dL/dz and runs the two gradient GEMMs.
    So a step costs the 3 GEMMs of B x N x d plus ~4 passes over the buffer (no second [B, N] tensor).

    ``compute_dtype`` bf16 (``train.precision=bf16``): the GEMMs run on bf16 operands into a bf16 buffer; each
    block is shifted, exponentiated and summed in float32 (logQ added there, not in the bf16 GEMM), and the
    gradients come back in the parameters' dtype."""

    @staticmethod
    def forward(ctx, user_vectors, negative_rows, log_q, hit_rows, hit_cols, temperature, compute_dtype=None):
        batch, width = user_vectors.shape[0], negative_rows.shape[0]
        low = low_precision(compute_dtype, user_vectors.dtype)
        scaled = user_vectors / temperature
        exps = user_vectors.new_empty(batch, width, dtype=compute_dtype if low else user_vectors.dtype)
        row_max = user_vectors.new_full((batch,), float("-inf"))
        sums = user_vectors.new_zeros(batch)
        if low:
            left, right = scaled.to(compute_dtype), negative_rows.to(compute_dtype)
            right_t, shift = right.t(), (-log_q).to(user_vectors.dtype)
        else:
            # The logQ correction rides in the GEMM as one more dimension: [u / T, 1] . [v, -log q] = z.
            left = torch.cat([scaled, scaled.new_ones(batch, 1)], dim=1)
            right_t = torch.cat([negative_rows, (-log_q).to(negative_rows.dtype).unsqueeze(1)], dim=1).t()
            right = None
        if width:
            block = max(1, _ROW_BLOCK_ELEMENTS // width)
            for start in range(0, batch, block):
                stop = min(start + block, batch)
                out = exps[start:stop]
                torch.mm(left[start:stop], right_t, out=out)
                z = out.to(user_vectors.dtype).add_(shift) if low else out  # a cache-sized float32 block
                hits = block_rows(hit_rows, hit_cols, start, stop)
                if hits is not None:
                    z[hits] = float("-inf")
                top = z.amax(dim=1)
                top = torch.where(torch.isfinite(top), top, top.new_zeros(()))
                z.sub_(top.unsqueeze(1)).exp_()
                row_max[start:stop] = top
                sums[start:stop] = z.sum(dim=1)
                if low:
                    out.copy_(z)
        lse = torch.where(sums > 0, row_max + torch.log(sums), sums.new_full((), float("-inf")))
        ctx.save_for_backward(left if low else scaled, right if low else negative_rows, exps, sums)
        ctx.temperature, ctx.dtype = temperature, user_vectors.dtype
        return lse

    @staticmethod
    def backward(ctx, grad_lse):
        scaled, negative_rows, exps, sums = ctx.saved_tensors
        # dlse_b / dz_bj = exp(z_bj - lse_b) = exps_bj / sums_b; the buffer is reused for dL/dz (one backward).
        scale = torch.where(sums > 0, grad_lse / sums, sums.new_zeros(()))
        grad_z = exps.mul_(scale.to(exps.dtype).unsqueeze(1))
        grad_users = (grad_z @ negative_rows).to(ctx.dtype).div_(ctx.temperature)
        grad_rows = (grad_z.t() @ scaled).to(ctx.dtype)
        return grad_users, grad_rows, None, None, None, None, None


def sampled_softmax_shared_negatives(
    user_vectors: torch.Tensor,
    negative_rows: torch.Tensor,
    negative_ids: torch.Tensor,
    negative_log_q: torch.Tensor,
    target: torch.Tensor,
    positive_logits: torch.Tensor,
    *,
    temperature: float = 1.0,
    reduction: str = "mean",
    group=None,
    return_valid: bool = False,
    compute_dtype: torch.dtype | None = None,
):
    """Sampled softmax with logQ correction when every row shares the same negatives: the loss of
    ``sampled_softmax_loss`` on the columns [row positives | shared negatives] of ``StepLoss``'s sampled
    candidates, computed without the [B, C] scores, labels, mask and log_q tensors.

    Each row has exactly one positive (its target, scored on the rank that owns it) and the negatives drawn
    by every rank; a negative equal to the row's target is an accidental hit and leaves the denominator (in
    ``sampled_softmax_loss`` it is a second positive with the same value, so the row's mean is unchanged)::

        loss_b = softplus(log sum_{j in N_b} exp(z_bj) - z_b+)        z = s / T - log q   (Yi et al. 2019)

    Args:
        user_vectors: float[B, d] (all-gathered). negative_rows: float[N_r, d] this rank's negatives (with
            repeats), ``negative_ids`` int64[N_r] their global ids, ``negative_log_q`` [N_r] their logQ.
        target: int64[B] global positive ids, the same on every rank.
        positive_logits: float[B] the corrected positive logit ``s_b+ / T - log q_b+`` for the rows whose
            target this rank owns, 0 elsewhere (summed over ranks here).
        temperature: T > 0. reduction: "mean" | "sum" | "none" (over rows with a negative).
        group: process group splitting the negatives across ranks.
        compute_dtype: dtype of the negatives' GEMMs and buffer (``torch.bfloat16`` for ``train.precision=bf16``;
            row statistics stay float32); None = the inputs' dtype.
    """
    check_reduction(reduction)
    hits = accidental_hits(target, negative_ids)
    lse_local = _NegativeLogSumExp.apply(
        user_vectors, negative_rows, negative_log_q, *hits, float(temperature), compute_dtype
    )
    positive = all_reduce_sum(positive_logits, group)
    shift = all_reduce_max(lse_local, group)
    has_negative = torch.isfinite(shift)
    shift = torch.where(has_negative, shift, shift.new_zeros(()))
    sum_exp = all_reduce_sum(torch.exp(lse_local - shift), group)
    log_sum_neg = shift + torch.log(sum_exp.clamp_min(torch.finfo(sum_exp.dtype).tiny))
    per_row = F.softplus(log_sum_neg - positive)
    return finish(per_row, has_negative, reduction, return_valid)
