"""Collectives with autograd, and a counter of the bytes they send.

Two kinds of all-gather exist because the consumers of a gathered tensor differ:

* ``all_gather_rows``: every rank uses the gathered tensor in a *different* local computation (e.g. scoring
  all-gathered user vectors against its own item rows), so each rank holds only a partial gradient of the
  gathered tensor. Backward sums the partial gradients across ranks and returns each rank its own slice
  (a reduce-scatter), as Megatron's sequence-parallel gather does.
* ``all_gather_replicated``: every rank feeds the gathered tensor into the *same* replicated computation (e.g.
  merging per-shard top-k values into a global top-k), so the gradient arriving on each rank is already the
  full gradient. Backward returns this rank's slice without communication.

``all_reduce_sum`` is the matching reduction of local partial sums into a replicated value: forward all-reduce,
backward identity (Megatron's ``reduce_from_tensor_model_parallel_region``). ``all_reduce_partials`` is the
reduction whose result every rank then uses in a *different* local computation (e.g. user vectors pooled from
each rank's item rows, then scored against each rank's own catalog rows): backward all-reduces the ranks'
partial gradients, as ``all_gather_rows`` does for a gather.

``all_reduce_max``, ``all_reduce_no_grad``, ``all_gather_no_grad`` and ``all_gather_equal`` carry statistics
without autograd (``all_gather_equal`` for tensors of the same shape on every rank: no size exchange).

Every collective here goes through one counted path (``_counted``), so ``count_bytes`` sees all the bytes a
rank sends; inside ``count_bytes`` a direct ``torch.distributed`` collective raises ``UncountedCollectiveError``.

All functions accept ``group=None`` meaning "no distribution" (the identity), so single-process code and
distributed code share one path. Sizes along dim 0 may differ by rank.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch
import torch.distributed as dist

__all__ = [
    "ByteCounter",
    "UncountedCollectiveError",
    "all_gather_equal",
    "all_gather_no_grad",
    "all_gather_replicated",
    "all_gather_rows",
    "all_gather_rows_with_ids",
    "all_reduce_max",
    "all_reduce_inplace",
    "all_reduce_no_grad",
    "all_reduce_partials",
    "all_reduce_sum",
    "all_to_all_no_grad",
    "count_bytes",
    "group_rank",
    "group_size",
    "is_distributed",
]


# --------------------------------------------------------------------------------------------- byte counting
class ByteCounter:
    """Counts the bytes this rank contributes to collectives (the payload it sends), by collective name."""

    def __init__(self) -> None:
        self.by_op: dict[str, int] = {}
        self.calls: dict[str, int] = {}

    @property
    def total(self) -> int:
        return sum(self.by_op.values())

    def add(self, op: str, nbytes: int) -> None:
        self.by_op[op] = self.by_op.get(op, 0) + int(nbytes)
        self.calls[op] = self.calls.get(op, 0) + 1


# The torch.distributed functions that move data between ranks. Inside ``count_bytes`` each is replaced by a
# guard that raises unless the call comes through ``_counted`` (the one counted path), so a collective that
# bypasses the counter is an error instead of silently missing from the byte count.
GUARDED_COLLECTIVES = (
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_gather_single",
    "all_reduce",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "batch_isend_irecv",
    "broadcast",
    "broadcast_object_list",
    "gather",
    "gather_object",
    "irecv",
    "isend",
    "recv",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_single",
    "reduce_scatter_tensor",
    "scatter",
    "scatter_object_list",
    "send",
)

_active: list[ByteCounter] = []  # process-wide: autograd may run a backward collective on another thread
_lock = threading.Lock()
_local = threading.local()  # ``inside``: this thread is in ``_counted``
_originals: dict[tuple[object, str], object] = {}


class UncountedCollectiveError(RuntimeError):
    """A torch.distributed collective was called directly inside ``count_bytes`` (its bytes would be missed)."""


def _guard(name: str, original):
    def guarded(*args, **kwargs):
        if _active and not getattr(_local, "inside", False):
            raise UncountedCollectiveError(
                f"torch.distributed.{name} called directly inside count_bytes: route it through "
                "bigrank.distributed.collectives so that its bytes are counted"
            )
        return original(*args, **kwargs)

    guarded.__wrapped__ = original
    return guarded


def _install_guards() -> None:
    from torch.distributed import distributed_c10d

    for module in (dist, distributed_c10d):
        for name in GUARDED_COLLECTIVES:
            original = getattr(module, name, None)
            if original is not None:
                _originals[(module, name)] = original
                setattr(module, name, _guard(name, original))


def _remove_guards() -> None:
    for (module, name), original in _originals.items():
        setattr(module, name, original)
    _originals.clear()


@contextlib.contextmanager
def count_bytes() -> Iterator[ByteCounter]:
    """Context manager recording the payload of every bigrank collective called inside it (this rank only).

    Every collective of bigrank goes through one counted path (``_counted``); a direct ``torch.distributed``
    collective called inside the context raises ``UncountedCollectiveError``, so the count is complete.
    Counters nest (an outer counter also counts what an inner one sees).

    Example::

        with count_bytes() as counter:
            loss = rankmax_loss(scores, target, group=group, offset=start)
            loss.backward()
        print(counter.total, counter.by_op)
    """
    counter = ByteCounter()
    with _lock:
        if not _active:
            _install_guards()
        _active.append(counter)
    try:
        yield counter
    finally:
        with _lock:
            _active.remove(counter)
            if not _active:
                _remove_guards()


def _counted(name: str, payload: torch.Tensor, collective, /, *args, **kwargs):
    """The one path of every bigrank collective: add ``payload``'s bytes (what this rank sends) to the active
    counters, then run ``collective(*args, **kwargs)`` (a ``torch.distributed`` function)."""
    nbytes = payload.numel() * payload.element_size()
    for counter in list(_active):
        counter.add(name, nbytes)
    previous = getattr(_local, "inside", False)
    _local.inside = True
    try:
        return collective(*args, **kwargs)
    finally:
        _local.inside = previous


# ---------------------------------------------------------------------------------------------- group helpers
def is_distributed(group: dist.ProcessGroup | None) -> bool:
    """True when ``group`` is a process group with more than one rank."""
    return group is not None and dist.get_world_size(group) > 1


def group_size(group: dist.ProcessGroup | None) -> int:
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group: dist.ProcessGroup | None) -> int:
    return 0 if group is None else dist.get_rank(group)


def _gather_sizes(n: int, group: dist.ProcessGroup, device: torch.device) -> list[int]:
    size = torch.tensor([n], dtype=torch.int64, device=device)
    sizes = [torch.empty_like(size) for _ in range(dist.get_world_size(group))]
    _counted("all_gather", size, dist.all_gather, sizes, size, group=group)
    return [int(s.item()) for s in sizes]


def _all_gather_dim0(
    x: torch.Tensor, group: dist.ProcessGroup, sizes: list[int] | None
) -> tuple[torch.Tensor, list[int]]:
    """Concatenation along dim 0 of ``x`` from every rank (sizes may differ). Returns (gathered, sizes)."""
    x = x.contiguous()
    if sizes is None:
        sizes = _gather_sizes(x.shape[0], group, x.device)
    if all(n == x.shape[0] for n in sizes):  # one buffer, no padding and no concatenation
        out = x.new_empty((len(sizes) * x.shape[0], *x.shape[1:]))
        _counted("all_gather", x, dist.all_gather_single, out, x, group=group)
        return out, sizes
    largest = max(sizes)
    if x.shape[0] < largest:
        # gloo's all_gather wants equal shapes: pad to the largest shard and cut the padding off afterwards.
        x = torch.cat([x, x.new_zeros((largest - x.shape[0], *x.shape[1:]))])
    parts = [torch.empty_like(x) for _ in sizes]
    _counted("all_gather", x, dist.all_gather, parts, x, group=group)
    return torch.cat([part[:n] for part, n in zip(parts, sizes, strict=True)], dim=0), sizes


class _AllGatherRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, sizes):
        gathered, sizes = _all_gather_dim0(x, group, sizes)
        ctx.group, ctx.sizes = group, sizes
        return gathered

    @staticmethod
    def backward(ctx, grad):
        group, sizes = ctx.group, ctx.sizes
        rank = dist.get_rank(group)
        grad = grad.contiguous()
        # Reduce-scatter with uneven sizes: gloo has no reduce_scatter, so all-reduce then slice. The payload
        # is the gathered gradient (B_total x d), the same order as the forward gather.
        _counted("all_reduce", grad, dist.all_reduce, grad, op=dist.ReduceOp.SUM, group=group)
        start = sum(sizes[:rank])
        return grad[start : start + sizes[rank]].clone(), None, None


class _AllGatherReplicated(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, sizes):
        gathered, sizes = _all_gather_dim0(x, group, sizes)
        ctx.rank, ctx.sizes = dist.get_rank(group), sizes
        return gathered

    @staticmethod
    def backward(ctx, grad):
        start = sum(ctx.sizes[: ctx.rank])
        return grad[start : start + ctx.sizes[ctx.rank]].contiguous(), None, None


class _AllReduceSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        out = x.clone(memory_format=torch.contiguous_format)
        _counted("all_reduce", out, dist.all_reduce, out, op=dist.ReduceOp.SUM, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _AllReducePartials(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        out = x.clone(memory_format=torch.contiguous_format)
        _counted("all_reduce", out, dist.all_reduce, out, op=dist.ReduceOp.SUM, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone(memory_format=torch.contiguous_format)
        _counted("all_reduce", grad, dist.all_reduce, grad, op=dist.ReduceOp.SUM, group=ctx.group)
        return grad, None


def all_gather_rows(
    x: torch.Tensor, group: dist.ProcessGroup | None = None, sizes: list[int] | None = None
) -> torch.Tensor:
    """Concatenate ``x: [n_r, ...]`` from all ranks in rank order -> ``[sum_r n_r, ...]``.

    Backward: the gradient is summed over ranks and each rank receives its own slice (reduce-scatter), because
    each rank consumes the gathered tensor in its own local computation. ``sizes`` (per-rank n_r) skips the
    size exchange when the caller knows them. With ``group=None`` this is the identity.
    """
    if not is_distributed(group):
        return x
    return _AllGatherRows.apply(x, group, sizes)


class _AllGatherRowsWithIds(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, ids, group, pad_to):
        rows, width = x.shape
        # Byte-exact packing (an int64 id never passes through a float): [pad_to, width * itemsize + 8] uint8.
        row_bytes = width * x.element_size()
        packed = torch.zeros((pad_to, row_bytes + 8), dtype=torch.uint8, device=x.device)
        packed[rows:, row_bytes:] = 255  # id -1 (all bits set) marks a padding row
        packed[:rows, :row_bytes] = x.detach().contiguous().view(torch.uint8)
        ids = ids.to(device=x.device, dtype=torch.int64).contiguous()
        packed[:rows, row_bytes:] = ids.view(-1, 1).view(torch.uint8)
        world = dist.get_world_size(group)
        out = packed.new_empty((world * pad_to, row_bytes + 8))
        _counted("all_gather", packed, dist.all_gather_single, out, packed, group=group)
        ctx.group, ctx.rows, ctx.pad_to = group, rows, pad_to
        gathered = out[:, :row_bytes].contiguous().view(x.dtype)
        gathered_ids = out[:, row_bytes:].contiguous().view(torch.int64).view(-1)
        ctx.mark_non_differentiable(gathered_ids)
        return gathered, gathered_ids

    @staticmethod
    def backward(ctx, grad, _grad_ids):
        grad = grad.contiguous()
        _counted("all_reduce", grad, dist.all_reduce, grad, op=dist.ReduceOp.SUM, group=ctx.group)
        start = dist.get_rank(ctx.group) * ctx.pad_to
        return grad[start : start + ctx.rows].clone(), None, None, None


def all_gather_rows_with_ids(
    x: torch.Tensor, ids: torch.Tensor, pad_to: int, group: dist.ProcessGroup | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``all_gather_rows`` of ``x: float[b, d]`` and, in the same all-gather, of ``ids: int64[b]``.

    Every rank pads its rows to ``pad_to >= b`` (zero vectors, id -1), so the result is
    ``(X: float[W * pad_to, d], ids: int64[W * pad_to])`` in rank order, padding included: the caller drops the
    rows whose id is -1. One collective instead of two (ids travel byte-exact beside the vectors); backward
    is ``all_gather_rows``'s reduce-scatter (an all-reduce, then this rank's rows).
    """
    if x.dim() != 2 or ids.dim() != 1 or ids.shape[0] != x.shape[0]:
        raise ValueError(f"x must be [b, d] and ids [b], got {tuple(x.shape)} and {tuple(ids.shape)}")
    if x.shape[0] > pad_to:
        raise ValueError(f"pad_to={pad_to} is smaller than the {x.shape[0]} rows to gather")
    if not is_distributed(group):
        pad = pad_to - x.shape[0]
        filler = torch.full((pad,), -1, dtype=torch.int64, device=x.device)
        return torch.cat([x, x.new_zeros((pad, x.shape[1]))]), torch.cat([ids.to(x.device, torch.int64), filler])
    return _AllGatherRowsWithIds.apply(x, ids, group, pad_to)


def all_gather_replicated(
    x: torch.Tensor, group: dist.ProcessGroup | None = None, sizes: list[int] | None = None
) -> torch.Tensor:
    """Concatenate ``x: [n_r, ...]`` from all ranks along dim 0 for a computation replicated on every rank.

    Backward returns this rank's slice of the (already complete, replicated) gradient, no communication.
    Used for per-row statistics (e.g. each shard's top-k values, gathered as ``[W*B, k]`` after a transpose).
    """
    if not is_distributed(group):
        return x
    return _AllGatherReplicated.apply(x, group, sizes)


def all_reduce_sum(x: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Sum of ``x`` over ranks (same shape everywhere). Backward is the identity: the result feeds a computation
    replicated on every rank, so each rank already holds the full gradient of its own partial sum."""
    if not is_distributed(group):
        return x
    return _AllReduceSum.apply(x, group)


def all_reduce_partials(x: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Sum of the ranks' partial terms ``x`` (same shape everywhere), which every rank then uses in its own local
    computation, so each rank holds only part of the sum's gradient: backward sums the ranks' gradients (an
    all-reduce each way). E.g. user vectors pooled from the item rows each rank holds, scored against each rank's
    own catalog rows."""
    if not is_distributed(group):
        return x
    return _AllReducePartials.apply(x, group)


def all_reduce_max(x: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Element-wise max over ranks, without gradient (used for stabilising shifts such as log-sum-exp's max)."""
    if not is_distributed(group):
        return x.detach()
    out = x.detach().clone(memory_format=torch.contiguous_format)
    _counted("all_reduce", out, dist.all_reduce, out, op=dist.ReduceOp.MAX, group=group)
    return out


def all_reduce_no_grad(x: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Sum of ``x`` over ranks without autograd (per-row statistics whose gradients are analytic). Sums a
    contiguous copy and returns it; with ``group=None`` returns ``x`` detached."""
    if not is_distributed(group):
        return x.detach()
    out = x.detach().clone(memory_format=torch.contiguous_format)
    _counted("all_reduce", out, dist.all_reduce, out, op=dist.ReduceOp.SUM, group=group)
    return out


def all_reduce_inplace(x: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Sum ``x`` (contiguous, no autograd) over ranks in place, e.g. a persistent gradient buffer; returns it."""
    if not x.is_contiguous():
        raise ValueError("all_reduce_inplace needs a contiguous tensor")
    if is_distributed(group):
        _counted("all_reduce", x, dist.all_reduce, x, op=dist.ReduceOp.SUM, group=group)
    return x


def all_gather_equal(x: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """``x: [n, ...]`` from every rank, concatenated along dim 0 -> ``[W * n, ...]``, without autograd.

    For tensors whose shape is the same on every rank by construction (per-row statistics of one replicated
    batch, fixed-size check vectors): one all-gather into one buffer, no size exchange. Shapes that differ
    across ranks are the caller's bug; use ``all_gather_no_grad`` when they may.
    """
    if not is_distributed(group):
        return x.detach()
    x = x.detach().contiguous()
    out = x.new_empty((dist.get_world_size(group) * x.shape[0], *x.shape[1:]))
    _counted("all_gather", x, dist.all_gather_single, out, x, group=group)
    return out


def all_gather_no_grad(
    x: torch.Tensor, group: dist.ProcessGroup | None = None, sizes: list[int] | None = None
) -> torch.Tensor:
    """Concatenate ``x`` from all ranks along dim 0 without autograd (evaluation, thresholds, checks);
    ``sizes`` (per-rank rows) skips the size exchange when the caller knows them."""
    if not is_distributed(group):
        return x.detach()
    gathered, _ = _all_gather_dim0(x.detach(), group, sizes)
    return gathered


def all_to_all_no_grad(
    x: torch.Tensor, input_sizes: list[int], output_sizes: list[int], group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """Rows ``x[sum(input_sizes[:r]) : sum(input_sizes[:r + 1])]`` go to rank ``r``; returns the rows every rank
    sent here, in rank order (``sum(output_sizes)`` rows: ``output_sizes[r]`` from rank ``r``, which the caller
    knows, e.g. from an all-gather of the sizes), without autograd. ``group=None``: ``x`` itself."""
    if not is_distributed(group):
        return x.detach()
    x = x.detach().contiguous()
    out = x.new_empty((sum(output_sizes), *x.shape[1:]))
    _counted(
        "all_to_all", x, dist.all_to_all_single, out, x,
        output_split_sizes=list(output_sizes), input_split_sizes=list(input_sizes), group=group,
    )  # fmt: skip
    return out
