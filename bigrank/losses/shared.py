"""User-major full-catalog losses, item-parallel: one score vector per user and the loss of every one of the
user's positives taken against it (``train.batching: users``).

A row-wise step scores the catalog once per (user, item) row; a user with |P| train items has its n scores
computed |P| times although the k = 1 Rankmax loss and the softmax loss of a row depend only on the user's
score vector and the row's item. Here the U users of a step are scored once, ``z = U_vectors @ V.T`` [U, n], and

    softmax:  sum_b sum_{y in P_b} (logsumexp(z_b) - z_by)  = sum_b (|P_b| logsumexp(z_b) - sum_{y in P_b} z_by)
    rankmax:  sum_b sum_{y in P_b} log D_by - log eta,   D_by = sum_i (z_bi - t_by)_+,  t_by = z_by - eta   (eq. 15)

(Mult-VAE's multinomial likelihood, Liang et al. WWW 2018, is the softmax line; Kong et al. NeurIPS 2020, eq. 15,
the Rankmax one). Both equal the row-wise ``softmax_loss`` / ``rankmax_loss(k=1)`` summed over the same rows,
and the single-process ``softmax_shared_loss`` / ``rankmax_shared_loss`` (a [U, n] positive mask, one sort per
user), which the tests check on 1, 2 and 3 ranks.

Item-parallel, as the row-wise losses: rank r holds catalog rows ``[offset, offset + n_r)`` and the same U user
vectors; only per-row statistics cross ranks.

* The positives are index lists (``indptr`` int64[U + 1], ``items`` int64[R], global ids), not a [U, n] mask.
  Each positive's score comes from the rank that owns its item (one all-reduce of R floats).
* Rankmax: every rank places its scores among each user's sorted thresholds t_by (a bucketize, O(n log |P_b|);
  ``bigrank.losses.buckets``) and sums the scores and counts per bucket; the [U, |P_b| + 1] bucket sums are
  all-reduced, and the suffix sums over buckets give every ``D_by`` and ``c_by = |{i : z_bi > t_by}|``. The
  gradient ``dL/dz_bi = sum_{y : t_by < z_bi} w / D_by - [i in P_b] w c_bi / D_bi`` (eq. 16 summed over the
  positives) is a prefix sum over the buckets read back at each score's bucket: the backward keeps the forward's
  bucket of every score (2 bytes a score) instead of recomputing the scores and searching again.
* Softmax: each rank's row max and sum of exponentials (2U floats, as ``softmax_loss``).

Rankmax with k > 1 is not user-major here: its threshold mu_y = min(z_y, z_[k]) - eta also reads the row's top
k and its clipped count t, which a shared pass could compute once per user (the top k is the user's), but it is
not built; sparsemax's threshold tau does not depend on y at all, so it would share as softmax does, also not
built. Both, and the soft-rank losses, stay row-wise (``train.batching: rows``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from bigrank.distributed.collectives import all_reduce_no_grad, is_distributed
from bigrank.losses.buckets import bucket_gather, bucket_stats, threshold_table
from bigrank.losses.kernels import exp_grad
from bigrank.losses.scores import as_score_source, divide_scores
from bigrank.losses.softmax import local_max_sum_exp, log_normalizers
from bigrank.losses.validation import check_temperature

__all__ = ["rankmax_shared_catalog_loss", "softmax_shared_catalog_loss"]


@dataclass
class _Positives:
    """The step's positives as this rank sees them: ``row`` int64[R] (the score row of each), ``lengths``
    int64[U], ``score`` float64[R] (z_by, replicated), and the ones whose item this rank holds: ``local``
    int64[R_r] indices into the R positives, ``column`` int64[R_r] their local columns, sorted by column."""

    row: torch.Tensor
    lengths: torch.Tensor
    score: torch.Tensor
    local: torch.Tensor
    column: torch.Tensor

    def add_in_block(self, grad: torch.Tensor, start: int, values: torch.Tensor) -> None:
        """``grad[row_p, item_p - offset - start] += values[p]`` for the positives p whose items are columns
        ``[start, start + width)`` of ``grad`` [U, width] (``values``: float64[R], or [1] for all of them)."""
        bounds = torch.tensor([start, start + grad.shape[1]], device=self.column.device)
        lo, hi = torch.searchsorted(self.column, bounds).tolist()
        if hi > lo:
            held = self.local[lo:hi]
            values = values.expand(self.score.numel())[held].to(grad.dtype)
            grad.index_put_((self.row[held], self.column[lo:hi] - start), values, accumulate=True)


def _check_positives(indptr: torch.Tensor, items: torch.Tensor, users: int) -> None:
    if indptr.dim() != 1 or indptr.numel() != users + 1 or indptr.dtype not in (torch.int64, torch.int32):
        raise ValueError(
            f"indptr must be an integer tensor of shape ({users + 1},), got {indptr.dtype}{list(indptr.shape)}"
        )
    if items.dim() != 1 or items.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"items must be a 1-d integer tensor, got {items.dtype}{list(items.shape)}")
    if int(indptr[0]) != 0 or int(indptr[-1]) != items.numel() or bool((indptr[1:] < indptr[:-1]).any()):
        raise ValueError(f"indptr must rise from 0 to len(items) = {items.numel()}")
    if items.numel() and int(items.min()) < 0:
        raise ValueError(f"positive item ids must be >= 0, got {int(items.min())}")


def _locate(source, indptr: torch.Tensor, items: torch.Tensor, group, offset: int) -> _Positives:
    """Every positive's score from the rank holding its item, in one all-reduce that also carries the checks
    every rank must agree on (no rank is left in a collective): each positive held by exactly one rank, no
    non-finite factor anywhere."""
    device = source.device
    indptr, items = indptr.to(device=device, dtype=torch.int64), items.to(device=device, dtype=torch.int64)
    lengths = indptr[1:] - indptr[:-1]
    row = torch.repeat_interleave(torch.arange(source.batch, device=device), lengths)
    held = (items >= offset) & (items < offset + source.num_local)
    local = held.nonzero().squeeze(1)
    column = items[local] - offset
    column, order = torch.sort(column)
    local = local[order]
    score = torch.zeros(items.numel(), dtype=torch.float64, device=device)
    if local.numel():
        score[local] = source.gather_columns(column, rows=row[local]).to(torch.float64)
    bad = source.nonfinite_rows().any().to(torch.float64).reshape(1)
    totals = all_reduce_no_grad(torch.cat([score, bad, held.sum().to(torch.float64).reshape(1)]), group)
    if float(totals[-2]) > 0:
        raise ValueError("scores hold NaN or infinite values (the user vectors or a rank's catalog rows)")
    if int(totals[-1]) != items.numel():
        raise ValueError(
            f"positive item ids must lie in the catalog: {items.numel() - int(totals[-1])} of {items.numel()} "
            "are held by no rank"
        )
    return _Positives(row, lengths, totals[:-2], local, column)


class _RankmaxShared:
    """k = 1 Rankmax of every positive against its user's score vector (module docstring)."""

    needs_scores = False  # the backward reads the buckets kept by the forward

    def __init__(self, margin: float):
        self.margin = float(margin)

    def forward(self, source, positives: _Positives, group):
        compare = torch.float64 if source.dtype == torch.float64 else torch.float32
        thresholds = positives.score.to(compare) - self.margin  # t_y = z_y - eta, compared as the scores are
        table = threshold_table(thresholds, positives.lengths)  # each user at its own depth
        counts, sums = table.zeros(), table.zeros()
        buckets = torch.empty(source.batch, source.num_local, dtype=table.index_dtype, device=source.device)
        for start, block in source.blocks():
            bucket_stats(block, table, counts, sums, buckets[:, start : start + block.shape[1]])
        # Only buckets 0..|P_b| of a row can hold scores: the sums cross ranks compacted (R + U values a stat).
        if is_distributed(group):
            used = table.buckets_at
            summed = all_reduce_no_grad(torch.cat([counts[used], sums[used]]), group)
            counts[used], sums[used] = summed[: used.numel()], summed[used.numel() :]
        # Scores above a threshold are those in the buckets above it: suffix sums over each row's buckets.
        above, above_sum = table.above(counts), table.above(sums)  # c_y and sum z, [R] (sorted by row)
        support = above_sum - above * table.values[table.at].to(torch.float64)  # D_y
        loss = torch.log(support).sum() - thresholds.numel() * math.log(self.margin)
        return loss, {"buckets": buckets, "table": table, "support": support, "above": above}

    def grad_fn(self, source, positives: _Positives, state, weight: torch.Tensor):
        """``grad_block(start, width)``: dL/dz of columns ``[start, start + width)`` for the loss times ``weight``."""
        table = state["table"]
        inverse = weight / state["support"]  # w / D_y, by sorted threshold
        prefix = table.below(inverse)  # bucket k: the sum of w / D_y over the k thresholds below it
        at_positive = torch.zeros_like(positives.score)  # -w c_y / D_y at each positive's own item
        at_positive[table.order] = -(inverse * state["above"])
        buckets, dtype = state["buckets"], source.dtype
        gather_prefix = prefix.to(torch.promote_types(dtype, torch.float32))

        def grad_block(start: int, width: int) -> torch.Tensor:
            grad = bucket_gather(buckets[:, start : start + width], table, gather_prefix)
            positives.add_in_block(grad, start, at_positive)
            return grad.to(dtype)

        return grad_block


class _SoftmaxShared:
    """Softmax cross-entropy of every positive against its user's score vector (module docstring)."""

    needs_scores = True

    def forward(self, source, positives: _Positives, group):
        log_normalizer = log_normalizers(*local_max_sum_exp(source), group)
        log_normalizer = torch.where(positives.lengths > 0, log_normalizer, 0.0)
        loss = (positives.lengths.to(torch.float64) * log_normalizer).sum() - positives.score.sum()
        return loss, {"log_normalizer": log_normalizer}

    def grad_fn(self, source, positives: _Positives, state, weight: torch.Tensor):
        scale = weight * positives.lengths.to(torch.float64)  # |P_b| w softmax(z_b)

        def grad_block(start: int, block: torch.Tensor) -> torch.Tensor:
            grad = exp_grad(block, state["log_normalizer"], scale)
            positives.add_in_block(grad, start, -weight.reshape(1))
            return grad

        return grad_block


class _SharedCatalogLoss(torch.autograd.Function):
    """The summed loss of a shared impl, with the gradient its ``grad_fn`` supplies."""

    @staticmethod
    def forward(ctx, impl, source_type, params, indptr, items, group, offset, *tensors):
        source = source_type.rebuild(tensors, params)
        positives = _locate(source, indptr, items, group, offset)
        loss, state = impl.forward(source, positives, group)
        ctx.impl, ctx.source_type, ctx.params, ctx.positives, ctx.state = impl, source_type, params, positives, state
        ctx.save_for_backward(*tensors)
        return loss.to(torch.promote_types(source.dtype, torch.float32))

    @staticmethod
    def backward(ctx, grad_loss):
        source = ctx.source_type.rebuild(ctx.saved_tensors, ctx.params)
        weight = grad_loss.to(torch.float64)
        grad_block = ctx.impl.grad_fn(source, ctx.positives, ctx.state, weight)
        grads = source.backward(grad_block, scores=ctx.impl.needs_scores)
        return (None, None, None, None, None, None, None, *grads)


def _shared_loss(impl, scores, indptr, items, reduction: str, group, offset: int) -> torch.Tensor:
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
    source = as_score_source(scores)
    _check_positives(indptr, items, source.batch)
    loss = _SharedCatalogLoss.apply(
        impl, type(source), source.params, indptr, items, group, int(offset), *source.tensors
    )
    return loss / max(items.numel(), 1) if reduction == "mean" else loss


def rankmax_shared_catalog_loss(
    scores,
    indptr: torch.Tensor,
    items: torch.Tensor,
    margin: float = 1.0,
    reduction: str = "mean",
    *,
    group=None,
    offset: int = 0,
) -> torch.Tensor:
    """k = 1 Rankmax cross-entropy (eq. 15) of every positive ``(b, items[indptr[b]:indptr[b + 1]])`` against row
    b's scores: ``sum_{b, y} log sum_i (z_bi - z_by + margin)_+ - log margin`` (module docstring).

    Args:
        scores: float[U, n_r] (or ``ChunkedScores`` of the user vectors [U, d] and this rank's catalog rows), the
            same U users on every rank; with ``group``, columns ``[offset, offset + n_r)`` of the full matrix.
        indptr: int64[U + 1], items: int64[R]: each row's positives as global item ids (CSR), the same on every
            rank; a row may have none.
        margin: eta > 0 in eq. 11.
        reduction: "mean" (over the R positives) or "sum".

    Gradients are exact (analytic, eq. 16 summed over each row's positives). Memory beside the score blocks:
    each score's bucket, int16 [U, n_r] (int32 past 32,767 positives a row).
    """
    if not isinstance(margin, int | float) or not math.isfinite(margin) or margin <= 0:
        raise ValueError(f"margin must be a finite number > 0, got {margin!r}")
    return _shared_loss(_RankmaxShared(margin), scores, indptr, items, reduction, group, offset)


def softmax_shared_catalog_loss(
    scores,
    indptr: torch.Tensor,
    items: torch.Tensor,
    reduction: str = "mean",
    *,
    temperature: float = 1.0,
    group=None,
    offset: int = 0,
) -> torch.Tensor:
    """Softmax cross-entropy ``-log softmax(z_b / T)_y`` of every positive ``(b, y)`` (CSR ``indptr``/``items``,
    as :func:`rankmax_shared_catalog_loss`), summed or averaged over the R positives; item-parallel with
    ``group``/``offset``. Gradient ``sum_b (|P_b| softmax(z_b / T) - 1_{P_b}) / T``."""
    check_temperature(temperature)
    if temperature != 1.0:
        scores = divide_scores(scores, float(temperature))
    return _shared_loss(_SoftmaxShared(), scores, indptr, items, reduction, group, offset)
