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
backward identity (Megatron's ``reduce_from_tensor_model_parallel_region``).

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
    "all_gather_replicated",
    "all_gather_rows",
    "all_reduce_max",
    "all_reduce_sum",
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


_local = threading.local()


@contextlib.contextmanager
def count_bytes() -> Iterator[ByteCounter]:
    """Context manager recording the payload of every bigrank collective called inside it (this rank only).

    Example::

        with count_bytes() as counter:
            loss = rankmax_loss(scores, target, group=group, offset=start)
            loss.backward()
        print(counter.total, counter.by_op)
    """
    counter = ByteCounter()
    previous = getattr(_local, "counter", None)
    _local.counter = counter
    try:
        yield counter
    finally:
        _local.counter = previous


def _record(op: str, tensor: torch.Tensor) -> None:
    counter = getattr(_local, "counter", None)
    if counter is not None:
        counter.add(op, tensor.numel() * tensor.element_size())


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
    _record("all_gather", size)
    dist.all_gather(sizes, size, group=group)
    return [int(s.item()) for s in sizes]


def _all_gather_dim0(
    x: torch.Tensor, group: dist.ProcessGroup, sizes: list[int] | None
) -> tuple[torch.Tensor, list[int]]:
    """Concatenation along dim 0 of ``x`` from every rank (sizes may differ). Returns (gathered, sizes)."""
    x = x.contiguous()
    if sizes is None:
        sizes = _gather_sizes(x.shape[0], group, x.device)
    largest = max(sizes)
    if x.shape[0] < largest:
        # gloo's all_gather wants equal shapes: pad to the largest shard and cut the padding off afterwards.
        x = torch.cat([x, x.new_zeros((largest - x.shape[0], *x.shape[1:]))])
    parts = [torch.empty_like(x) for _ in sizes]
    _record("all_gather", x)
    dist.all_gather(parts, x, group=group)
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
        _record("all_reduce", grad)
        dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=group)
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
        _record("all_reduce", out)
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
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


def all_reduce_max(x: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Element-wise max over ranks, without gradient (used for stabilising shifts such as log-sum-exp's max)."""
    if not is_distributed(group):
        return x.detach()
    out = x.detach().clone(memory_format=torch.contiguous_format)
    _record("all_reduce", out)
    dist.all_reduce(out, op=dist.ReduceOp.MAX, group=group)
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
