"""Where full-catalog losses read their scores from, and the autograd glue they share.

A full-catalog loss needs a handful of *per-row statistics* of the score matrix (top-k values, the positive's
score, sums, counts, maxima). It reads the matrix as a sequence of column blocks:

* ``DenseScores``: a materialised ``scores: float[B, n_local]`` tensor, read as one block;
* ``ChunkedScores``: the product ``user_vectors @ item_rows.T`` computed ``chunk_size`` items at a time and
  recomputed in backward, so the ``B x n_local`` matrix never exists at once (the "fused linear + loss"
  pattern). Gradients go straight to ``user_vectors`` and ``item_rows``.

Devices and precision: every tensor a loss creates lives on the scores' device, and the step makes no
host-device round trip except the replicated input check (``catalog_layout``) and the few
decisions that pick collectives (e.g. which rows need Rankmax's second pass). Scores may be bfloat16
(``score_matrix(..., dtype=torch.bfloat16)``: bf16 GEMM inputs and scores, float32 parameters and gradients);
the per-row statistics (top-k, sums, counts, maxima, log-sum-exp) are accumulated in float64 whatever the
score dtype, and the row kernels compare and exponentiate in float32 (``bigrank.losses.kernels``).

With a process group, each rank holds columns ``[offset, offset + n_local)`` of the full matrix; per-row
statistics are exchanged with collectives whose number and shapes are decided from replicated values, so all
ranks call the same collectives (no hang on bad input: every rank raises the same error).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from bigrank.distributed.collectives import all_gather_equal, all_reduce_no_grad, group_size, is_distributed
from bigrank.losses.kernels import topk_values
from bigrank.losses.validation import check_target, check_target_range, first_nonfinite_row

__all__ = [
    "ChunkedScores",
    "DenseScores",
    "Layout",
    "PatchedScores",
    "as_score_source",
    "catalog_loss_rows",
    "divide_scores",
    "replicated_inputs",
    "score_matrix",
]


class DenseScores:
    """A materialised score matrix ``[B, n_local]`` read as a single column block."""

    def __init__(self, scores: torch.Tensor):
        if scores.dim() != 2:
            raise ValueError(f"scores must have shape [B, n], got shape {tuple(scores.shape)}")
        if not scores.is_floating_point():
            raise ValueError(f"scores must be floating point, got dtype {scores.dtype}")
        self.scores = scores

    @property
    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.scores,)

    @classmethod
    def rebuild(cls, tensors, _params) -> DenseScores:
        return cls(*tensors)

    @property
    def params(self) -> tuple:
        return ()

    @property
    def batch(self) -> int:
        return self.scores.shape[0]

    @property
    def num_local(self) -> int:
        return self.scores.shape[1]

    @property
    def dtype(self) -> torch.dtype:
        return self.scores.dtype

    @property
    def device(self) -> torch.device:
        return self.scores.device

    def blocks(self, rows: torch.Tensor | None = None) -> Iterator[tuple[int, torch.Tensor]]:
        yield 0, self.scores if rows is None else self.scores[rows]

    def gather_columns(self, columns: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """``scores[b, columns[b]]`` for every row: [B]; with ``rows``, ``scores[rows[p], columns[p]]``: [P]."""
        if rows is not None:
            return self.scores[rows, columns]
        return self.scores.gather(1, columns.unsqueeze(1)).squeeze(1)

    def nonfinite_rows(self) -> torch.Tensor:
        return first_nonfinite_row(self.scores)

    def backward(self, grad_block: Callable[[int, torch.Tensor], torch.Tensor], scores: bool = True):
        """The gradient of the scores, ``(grad_block(0, block),)``; ``scores=False`` passes the block's width
        instead of the block (a loss that kept what it needs from the forward)."""
        return (grad_block(0, self.scores if scores else self.scores.shape[1]),)


class ChunkedScores:
    """Lazy scores ``user_vectors @ item_rows.T`` ([B, d] x [n_local, d] -> [B, n_local]), ``chunk_size`` items
    at a time.

    Peak extra memory is ``O(B * chunk_size)`` instead of ``O(B * n_local)``; the price is that the scores are
    recomputed in backward (one more GEMM per chunk). Passing a ``ChunkedScores`` to a full-catalog loss gives
    the same loss and gradients (w.r.t. both inputs) as passing the materialised product.

    ``compute_dtype`` (e.g. ``torch.bfloat16``): the GEMMs run on inputs cast to it and the score blocks have
    it; the gradients of ``user_vectors`` and ``item_rows`` keep their dtype (float32), summed over chunks in
    that dtype. None: the factors' dtype.
    """

    def __init__(
        self,
        user_vectors: torch.Tensor,
        item_rows: torch.Tensor,
        chunk_size: int,
        compute_dtype: torch.dtype | None = None,
    ):
        if user_vectors.dim() != 2 or item_rows.dim() != 2 or user_vectors.shape[1] != item_rows.shape[1]:
            raise ValueError(
                "ChunkedScores needs user_vectors [B, d] and item_rows [n, d] with the same d, got "
                f"{tuple(user_vectors.shape)} and {tuple(item_rows.shape)}"
            )
        if int(chunk_size) < 1:
            raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
        if user_vectors.dtype != item_rows.dtype:
            raise ValueError(f"user_vectors ({user_vectors.dtype}) and item_rows ({item_rows.dtype}) differ in dtype")
        self.user_vectors = user_vectors
        self.item_rows = item_rows
        self.chunk_size = int(chunk_size)
        self.compute_dtype = compute_dtype if compute_dtype is not None else user_vectors.dtype

    @property
    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.user_vectors, self.item_rows)

    @property
    def params(self) -> tuple:
        return (self.chunk_size, self.compute_dtype)

    @classmethod
    def rebuild(cls, tensors, params) -> ChunkedScores:
        return cls(*tensors, *params)

    @property
    def batch(self) -> int:
        return self.user_vectors.shape[0]

    @property
    def num_local(self) -> int:
        return self.item_rows.shape[0]

    @property
    def dtype(self) -> torch.dtype:
        return self.compute_dtype

    @property
    def device(self) -> torch.device:
        return self.user_vectors.device

    def blocks(self, rows: torch.Tensor | None = None) -> Iterator[tuple[int, torch.Tensor]]:
        users = self.user_vectors if rows is None else self.user_vectors[rows]
        users = users.to(self.compute_dtype)
        for start in range(0, self.num_local, self.chunk_size):
            yield start, users @ self.item_rows[start : start + self.chunk_size].to(self.compute_dtype).T

    def gather_columns(self, columns: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        users = self.user_vectors if rows is None else self.user_vectors[rows]
        if self.num_local == 0:
            return users.new_zeros(users.shape[0], dtype=self.compute_dtype)
        # The dot product of the rounded factors in (at least) float32, rounded like the GEMM's output.
        users, items = users.to(self.compute_dtype), self.item_rows[columns].to(self.compute_dtype)
        accumulate = torch.promote_types(self.compute_dtype, torch.float32)
        return (users.to(accumulate) * items.to(accumulate)).sum(dim=1).to(self.compute_dtype)

    def nonfinite_rows(self) -> torch.Tensor:
        # Scores are finite when both factors are (barring overflow): check the small factors, not B x n.
        bad_rows = first_nonfinite_row(self.user_vectors)
        if self.num_local and bool(first_nonfinite_row(self.item_rows).any()):
            bad_rows = torch.ones_like(bad_rows)
        return bad_rows

    def backward(self, grad_block: Callable[[int, torch.Tensor], torch.Tensor], scores: bool = True):
        """``(dL/d user_vectors, dL/d item_rows)`` from ``grad_block(start, block)``, the gradient of each block
        of scores; ``scores=False`` passes the block's width instead of the recomputed block (a loss that kept
        what it needs from the forward: no GEMM to recompute the scores)."""
        grad_users = torch.zeros_like(self.user_vectors)
        grad_items = torch.empty_like(self.item_rows)
        same_dtype = self.compute_dtype == self.user_vectors.dtype
        users = self.user_vectors.to(self.compute_dtype)
        widths = (
            (start, min(self.chunk_size, self.num_local - start)) for start in range(0, self.num_local, self.chunk_size)
        )
        for start, block in self.blocks() if scores else widths:
            grad = grad_block(start, block)
            rows = self.item_rows[start : start + self.chunk_size].to(self.compute_dtype)
            if same_dtype:
                grad_users.addmm_(grad, rows)
                torch.mm(grad.T, users, out=grad_items[start : start + grad.shape[1]])
            else:  # low-precision GEMMs, float32 sums over chunks
                grad_users += grad @ rows
                grad_items[start : start + grad.shape[1]] = grad.T @ users
        return grad_users, grad_items


class PatchedScores:
    """The scores of another source (``base``: ``DenseScores``, ``ChunkedScores``) plus a sparse patch:
    ``values[p]`` added at row ``rows[p]``, local column ``columns[p]``; every loss reads the patched scores, and
    ``values`` gets its gradient (the score gradient read at its entries).

    The patch is how a model corrects a few scores of a row that a dot product cannot express: the item-bag
    model's user vector pools the very items it scores, and each of a user's items loses its own term there
    (EASE's zero diagonal: one entry per item of the bag).

    Args:
        base: the score source (a tensor [B, n_local] reads as ``DenseScores``);
        rows int64[P], columns int64[P] (local, ``0 <= column < base.num_local``): where;
        values: float[P] what is added (any float dtype: added in the scores' dtype, in the same way in
        :meth:`blocks` and :meth:`gather_columns`, so a score read either way is the same number).
    """

    def __init__(self, base, rows: torch.Tensor, columns: torch.Tensor, values: torch.Tensor):
        base = as_score_source(base)
        if (
            not (rows.dim() == columns.dim() == values.dim() == 1)
            or not rows.numel() == columns.numel() == values.numel()
        ):
            raise ValueError(
                "PatchedScores needs rows, columns and values of one length, got shapes "
                f"{tuple(rows.shape)}, {tuple(columns.shape)}, {tuple(values.shape)}"
            )
        if columns.numel() and (int(columns.min()) < 0 or int(columns.max()) >= base.num_local):
            raise ValueError(
                f"patch columns must lie in [0, {base.num_local}), got [{int(columns.min())}, {int(columns.max())}]"
            )
        if rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= base.batch):
            raise ValueError(f"patch rows must lie in [0, {base.batch}), got [{int(rows.min())}, {int(rows.max())}]")
        self.base, self.values = base, values
        self._rows_in, self._columns_in = rows.to(torch.int64), columns.to(torch.int64)  # as given: ``params``
        # Sorted by column, so that the entries of a block of columns are one slice.
        self._order = torch.argsort(self._columns_in, stable=True)
        self.rows, self.columns = self._rows_in[self._order], self._columns_in[self._order]

    @property
    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (*self.base.tensors, self.values)

    @property
    def params(self) -> tuple:
        return (type(self.base), self.base.params, self._rows_in, self._columns_in)

    @classmethod
    def rebuild(cls, tensors, params) -> PatchedScores:
        base_type, base_params, rows, columns = params
        return cls(base_type.rebuild(tensors[:-1], base_params), rows, columns, tensors[-1])

    @property
    def batch(self) -> int:
        return self.base.batch

    @property
    def num_local(self) -> int:
        return self.base.num_local

    @property
    def dtype(self) -> torch.dtype:
        return self.base.dtype

    @property
    def device(self) -> torch.device:
        return self.base.device

    def _sorted_values(self) -> torch.Tensor:
        return self.values[self._order]

    def _in_block(self, start: int, width: int) -> tuple[int, int]:
        bounds = torch.tensor([start, start + width], device=self.columns.device)
        lo, hi = torch.searchsorted(self.columns, bounds).tolist()
        return lo, hi

    def _patch(self, start: int, block: torch.Tensor, row_map: torch.Tensor | None = None) -> torch.Tensor:
        """``block`` (columns ``[start, start + width)``; rows ``rows`` of the base when ``row_map`` maps base rows
        to block rows, -1 for absent) with the patch added, in place on a block the base made for this read."""
        lo, hi = self._in_block(start, block.shape[1])
        if hi == lo:
            return block
        rows, columns = self.rows[lo:hi], self.columns[lo:hi] - start
        values = self._sorted_values()[lo:hi].detach().to(block.dtype)
        if row_map is not None:
            rows = row_map[rows]
            keep = rows >= 0
            rows, columns, values = rows[keep], columns[keep], values[keep]
        if isinstance(self.base, DenseScores):
            block = block.clone()  # the caller's tensor
        return block.index_put_((rows, columns), values, accumulate=True)

    def blocks(self, rows: torch.Tensor | None = None) -> Iterator[tuple[int, torch.Tensor]]:
        row_map = None
        if rows is not None:
            row_map = torch.full((self.batch,), -1, dtype=torch.int64, device=self.device)
            row_map[rows] = torch.arange(rows.numel(), device=self.device)
        for start, block in self.base.blocks(rows):
            yield start, self._patch(start, block, row_map)

    def gather_columns(self, columns: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        base = self.base.gather_columns(columns, rows)
        if self.columns.numel() == 0 or base.numel() == 0:
            return base
        rows = torch.arange(base.numel(), device=base.device) if rows is None else rows.to(torch.int64)
        # The patch entries at the queried (row, column) pairs: both sides keyed row * n_local + column.
        width = max(self.num_local, 1)
        keys = self.rows * width + self.columns
        keys, order = torch.sort(keys, stable=True)
        values = self._sorted_values().detach()[order]
        queries = rows * width + columns.to(torch.int64)
        first = torch.searchsorted(keys, queries)
        last = torch.searchsorted(keys, queries, right=True)
        hits = (last > first).nonzero().squeeze(1)
        if hits.numel() == 0:
            return base
        # Entries at one place add up (as index_put_ with accumulate does in a block): repeat each query per entry.
        counts = last[hits] - first[hits]
        query = torch.repeat_interleave(hits, counts)
        entry = torch.repeat_interleave(first[hits] - torch.cumsum(counts, 0) + counts, counts) + torch.arange(
            int(counts.sum()), device=base.device
        )
        base = base.clone()
        return base.index_put_((query,), values[entry].to(base.dtype), accumulate=True)

    def nonfinite_rows(self) -> torch.Tensor:
        bad = self.base.nonfinite_rows()
        nonfinite = ~torch.isfinite(self.values.detach())
        if bool(nonfinite.any()):
            bad = bad.clone()
            bad[self.rows[nonfinite[self._order]]] = True
        return bad

    def backward(self, grad_block: Callable[[int, torch.Tensor], torch.Tensor], scores: bool = True):
        """The base's gradients and the patch values': ``grad_block(start, block)`` sees the patched block; the
        gradient of ``values[p]`` is the block gradient at its entry."""
        grad_values = torch.zeros(self.values.numel(), dtype=self.values.dtype, device=self.values.device)
        sorted_grad = torch.zeros_like(grad_values)

        def patched(start: int, block):
            width = block.shape[1] if scores else int(block)
            if scores:
                block = self._patch(start, block)
            grad = grad_block(start, block)
            lo, hi = self._in_block(start, width)
            if hi > lo:
                sorted_grad[lo:hi] = grad[self.rows[lo:hi], self.columns[lo:hi] - start].to(sorted_grad.dtype)
            return grad

        grads = self.base.backward(patched, scores=scores)
        grad_values[self._order] = sorted_grad
        return (*grads, grad_values)


# Scores per block for chunk_size="auto": on CPU 2^22 (16 MB in float32: cache-sized, and 16x the block size from
# which the row passes run compiled); on CUDA 2^27 (512 MB) so that each block is a few large kernels, not
# thousands of launches.
AUTO_BLOCK_ELEMENTS = {"cpu": 1 << 22, "cuda": 1 << 27}


def score_matrix(
    user_vectors: torch.Tensor,
    item_rows: torch.Tensor,
    chunk_size: int | str | None = None,
    dtype: torch.dtype | None = None,
):
    """``user_vectors @ item_rows.T`` ([B, d] x [n, d]) for a full-catalog loss: the dense [B, n] tensor when
    ``chunk_size`` is None, else ``ChunkedScores`` of ``chunk_size`` items. ``"auto"`` picks blocks of about
    ``AUTO_BLOCK_ELEMENTS[device type]`` scores. ``dtype`` (e.g. ``torch.bfloat16``, ``train.precision=bf16``)
    is the dtype the GEMM runs in and the scores have; gradients reach the factors in their own dtype.
    (``bigrank.losses.fused.source.kernel_scores`` adds ``train.kernel``'s fused choice.)"""
    if chunk_size is None:
        if dtype is not None and dtype != user_vectors.dtype:
            return user_vectors.to(dtype) @ item_rows.to(dtype).T
        return user_vectors @ item_rows.T
    if chunk_size == "auto":
        elements = AUTO_BLOCK_ELEMENTS.get(user_vectors.device.type, AUTO_BLOCK_ELEMENTS["cpu"])
        chunk_size = -(-elements // max(user_vectors.shape[0], 1))
    return ChunkedScores(user_vectors, item_rows, chunk_size, dtype)


def as_score_source(scores) -> DenseScores | ChunkedScores | PatchedScores:
    if isinstance(scores, ChunkedScores | DenseScores | PatchedScores):
        return scores
    if isinstance(scores, torch.Tensor):
        return DenseScores(scores)
    raise ValueError(f"scores must be a tensor [B, n] or ChunkedScores, got {type(scores).__name__}")


@dataclass
class Layout:
    """Where this rank's columns sit in the full catalog, and where each row's positive is.

    ``owned[b]`` is True when row b's target lies in this rank's columns, at local column ``local_target[b]``
    (clamped to a valid column otherwise). ``positive`` is the positive's score z_y [B], replicated.
    """

    num_items: int
    offset: int
    num_local: int
    owned: torch.Tensor
    local_target: torch.Tensor
    positive: torch.Tensor | None = None
    bad_rows: torch.Tensor | None = None  # bool [B], set when the non-finite check is deferred to the all-reduce

    def add_at_target(self, grad: torch.Tensor, start: int, values: torch.Tensor, rows=None) -> None:
        """``grad[b, y_b - start] += values[b]`` for rows whose positive falls in this block of columns.

        No host-device sync (it runs once per block): rows outside the block add 0 at a clamped column.
        """
        owned, local = (self.owned, self.local_target) if rows is None else (self.owned[rows], self.local_target[rows])
        if grad.shape[1] == 0:
            return
        inside = owned & (local >= start) & (local < start + grad.shape[1])
        columns = (local - start).clamp(0, grad.shape[1] - 1)
        values = torch.where(inside, values, torch.zeros_like(values)).to(grad.dtype)
        grad.index_put_((torch.arange(grad.shape[0], device=grad.device), columns), values, accumulate=True)


_replicated = threading.local()  # ``depth``: inside ``replicated_inputs``
_checked_shards: dict[tuple, int] = {}  # (group, offset, n_local) -> n, checked by one all-gather


@contextlib.contextmanager
def replicated_inputs() -> Iterator[None]:
    """Inside this context the caller guarantees that every rank passes the same batch and the same target to
    the full-catalog losses (the trainer all-gathers both), so ``catalog_layout`` checks the shard layout once
    per (group, offset, shard size) and then makes no collective of its own.

    Non-finite scores are still found on every rank at once: a rank that sees them poisons its contribution
    to the positive scores' all-reduce (which every catalog loss makes anyway), and every rank raises the same
    ``ValueError`` from the replicated result (``check_finite_positive``).
    """
    _replicated.depth = getattr(_replicated, "depth", 0) + 1
    try:
        yield
    finally:
        _replicated.depth -= 1


def catalog_layout(source, target: torch.Tensor, group, offset: int) -> Layout:
    """Check the inputs of a full-catalog loss on every rank at once and locate each row's positive.

    One all-gather of 6 integers per rank carries what each rank needs to check that shards are contiguous
    and in rank order, that every rank has the same batch and the same targets, and that no rank saw
    non-finite scores; every rank then raises the same ``ValueError`` (no rank is left in a collective).
    Inside ``replicated_inputs`` that all-gather runs once per shard layout; later calls check locally and
    leave non-finite scores to the positive-score all-reduce (``Layout.bad_rows``).
    """
    check_target(target, source.batch)
    target = target.to(device=source.device, dtype=torch.int64)
    bad_rows = source.nonfinite_rows()
    shard_key = (group, int(offset), source.num_local)
    if getattr(_replicated, "depth", 0) and shard_key in _checked_shards:
        num_items = _checked_shards[shard_key]
        check_target_range(target, num_items)
        return _locate(target, num_items, int(offset), source.num_local, bad_rows=bad_rows)
    weights = torch.arange(1, target.numel() + 1, dtype=torch.int64, device=target.device)
    # Built on the scores' device without reading anything back: the one sync is the gathered result's .cpu().
    sizes = torch.tensor([int(offset), source.num_local, source.batch], dtype=torch.int64, device=source.device)
    checks = torch.stack([bad_rows.sum(), target.sum(), (target * weights).sum()]).to(torch.int64)
    mine = torch.cat([sizes, checks])
    if is_distributed(group):
        everyone = all_gather_equal(mine.unsqueeze(0).to(source.device), group).cpu()
    else:
        if int(offset) != 0:
            raise ValueError(f"offset must be 0 without a process group, got {offset}")
        everyone = mine.unsqueeze(0).cpu()
    offsets, sizes, batches, bad, tsum, twsum = everyone.T.tolist()
    if len(set(batches)) != 1:
        raise ValueError(f"every rank must score the same rows: batch sizes by rank are {batches}")
    expected = [0]
    for size in sizes[:-1]:
        expected.append(expected[-1] + size)
    if offsets != expected:
        raise ValueError(
            f"shards must be contiguous and in rank order: offsets by rank are {offsets} for shard sizes "
            f"{sizes} (expected offsets {expected})"
        )
    if len(set(tsum)) != 1 or len(set(twsum)) != 1:
        raise ValueError("every rank must pass the same target (global item ids); they differ across ranks")
    if sum(bad):
        ranks = [r for r, count in enumerate(bad) if count]
        local = bad_rows.nonzero().squeeze(1)[:5].tolist()
        raise ValueError(f"scores hold NaN or infinite values (on ranks {ranks}; rows here: {local})")
    num_items = sum(sizes)
    check_target_range(target, num_items)  # target is the same on every rank (checked above)
    _checked_shards[shard_key] = num_items
    return _locate(target, num_items, int(offset), source.num_local)


def _locate(target, num_items: int, offset: int, num_local: int, bad_rows=None) -> Layout:
    local = target - offset
    owned = (local >= 0) & (local < num_local)
    local_target = local.clamp(0, max(num_local - 1, 0))
    return Layout(num_items, offset, num_local, owned, local_target, bad_rows=bad_rows)


def poison_bad_rows(local_positive: torch.Tensor, layout: Layout) -> torch.Tensor:
    """This rank's share of the positive scores [B], NaN in the rows where it saw non-finite scores (only
    when ``catalog_layout`` deferred that check): the all-reduce then carries the finding to every rank."""
    if layout.bad_rows is None:
        return local_positive
    return torch.where(layout.bad_rows, torch.full_like(local_positive, float("nan")), local_positive)


def check_finite_positive(positive: torch.Tensor, layout: Layout) -> None:
    """Raise on every rank alike when the replicated positive scores [B] are not finite (deferred check)."""
    if layout.bad_rows is not None and not bool(torch.isfinite(positive).all()):
        rows = (~torch.isfinite(positive)).nonzero().squeeze(1)[:5].tolist()
        raise ValueError(f"scores hold NaN or infinite values (rows {rows} on some rank)")


def positive_scores(source, layout: Layout, group) -> torch.Tensor:
    """z_y for every row [B] in float64, replicated on all ranks (summed from the rank that owns y)."""
    if layout.num_local:
        local = source.gather_columns(layout.local_target).to(torch.float64)
    else:
        local = torch.zeros(source.batch, dtype=torch.float64, device=source.device)
    local = torch.where(layout.owned, local, torch.zeros_like(local))
    positive = all_reduce_no_grad(poison_bad_rows(local, layout), group)
    check_finite_positive(positive, layout)
    return positive


def gather_row_stats(stats: torch.Tensor, group) -> torch.Tensor:
    """Per-row statistics [B, c] from every rank -> [W, B, c] (no autograd: gradients are analytic)."""
    if not is_distributed(group):
        return stats.unsqueeze(0)
    return all_gather_equal(stats, group).view(group_size(group), *stats.shape)


def merge_rank_topk(gathered: torch.Tensor) -> torch.Tensor:
    """The k largest of every rank's top-k ``gathered`` [W, B, k] -> [B, k] descending: the merge step of
    all-gather thresholding (exact: the global top k are among the ranks' top k)."""
    world, batch, k = gathered.shape
    return gathered.permute(1, 0, 2).reshape(batch, world * k).topk(k, dim=1).values


def sum_row_stats(stats: torch.Tensor, group) -> torch.Tensor:
    """Sum of per-row statistics over ranks (no autograd)."""
    return all_reduce_no_grad(stats, group)


def merge_topk(best: torch.Tensor, block: torch.Tensor) -> torch.Tensor:
    """The k largest of ``best`` [R, k] (float64, descending) and of the columns of ``block`` [R, c]."""
    if block.shape[1] == 0:
        return best
    k = best.shape[1]
    return torch.cat([best, topk_values(block, k).to(torch.float64)], dim=1).topk(k, dim=1).values


def empty_topk(rows: int, k: int, device) -> torch.Tensor:
    """A running top-k [rows, k] with nothing in it yet (-inf, so shards narrower than k pad with -inf)."""
    return torch.full((rows, k), float("-inf"), dtype=torch.float64, device=device)


def local_topk(source, k: int, rows: torch.Tensor | None = None) -> torch.Tensor:
    """The ``k`` largest scores of each row in this rank's columns, float64 [R, k], descending, padded with
    -inf when the shard has fewer than ``k`` columns. O(n) per row for n >> k (``kernels.topk_values``)."""
    best = empty_topk(source.batch if rows is None else rows.numel(), k, source.device)
    for _, block in source.blocks(rows):
        best = merge_topk(best, block)
    return best


class _CatalogLoss(torch.autograd.Function):
    """Per-row loss [B] of a full-catalog loss ``impl``, with the gradient ``impl.grad_block`` supplies."""

    @staticmethod
    def forward(ctx, impl, source_type, params, target, group, offset, *tensors):
        source = source_type.rebuild(tensors, params)
        layout = catalog_layout(source, target, group, offset)
        layout.positive = positive_scores(source, layout, group)
        per_row, state = impl.forward(source, layout, group)
        ctx.impl, ctx.source_type, ctx.params, ctx.layout, ctx.state = (
            impl,
            source_type,
            params,
            layout,
            state,
        )
        ctx.save_for_backward(*tensors)
        # The loss keeps at least float32 (bf16 scores give a float32 loss; float64 scores a float64 one).
        return per_row.to(torch.promote_types(source.dtype, torch.float32))

    @staticmethod
    def backward(ctx, grad_rows):
        source = ctx.source_type.rebuild(ctx.saved_tensors, ctx.params)
        grad_rows = grad_rows.to(torch.float64)

        def grad_block(start: int, block: torch.Tensor) -> torch.Tensor:
            return ctx.impl.grad_block(block, start, ctx.state, ctx.layout, grad_rows)

        if hasattr(ctx.impl, "backward"):  # a fused kernel (``bigrank.losses.fused``): no score blocks
            grads = ctx.impl.backward(source, ctx.state, ctx.layout, grad_rows)
        else:
            grads = source.backward(grad_block)
        return (None, None, None, None, None, None, *grads)


def catalog_loss_rows(impl, scores, target: torch.Tensor, group, offset: int) -> torch.Tensor:
    """Run the full-catalog loss ``impl`` on ``scores`` (tensor or ChunkedScores): per-row loss [B]."""
    source = as_score_source(scores)
    fuse = getattr(source, "fuse", None)  # ``FusedScores`` swaps in the loss's fused kernels (or refuses)
    if fuse is not None:
        impl = fuse(impl)
    return _CatalogLoss.apply(impl, type(source), source.params, target, group, offset, *source.tensors)


def divide_scores(scores, temperature: float):
    """``scores / temperature`` for a float[B, n] tensor; for ``ChunkedScores`` the user vectors are divided
    instead (the same scores, no B x n tensor)."""
    if isinstance(scores, ChunkedScores):
        # The same kind of source (chunked or fused) and compute dtype: bf16 scores stay bf16 after a temperature.
        return type(scores).rebuild((scores.user_vectors / temperature, scores.item_rows), scores.params)
    if isinstance(scores, PatchedScores):
        base = scores.base.scores if isinstance(scores.base, DenseScores) else scores.base
        divided = divide_scores(base, temperature)
        return PatchedScores(divided, scores._rows_in, scores._columns_in, scores.values / temperature)
    return scores / temperature
