"""The item catalog of one rank: the rows of the item embedding matrix it holds, sharded or replicated.

Two layouts (``bigrank.model.layout`` decides which, per run):

* **sharded** (item-parallel, "vocab-parallel"): each rank holds a contiguous row range; full-catalog losses
  score the all-gathered user vectors of the global batch against the local rows only and exchange per-row
  statistics (see ``bigrank.losses``);
* **replicated**: every rank holds every row, scores its own batch rows against the whole catalog with no
  collective in the loss, and the trainer all-reduces the catalog's gradient.

Whatever the layout, each rank *owns* the rows ``shard_range(n, rank, W)`` (:meth:`CatalogShard.owned`): the
rows it checkpoints, exports and ranks in evaluation, so checkpoints, exports and evaluation do not depend on
the layout. Evaluation ranks the whole catalog with ``distributed_topk``: each rank's top-K values and ids are
gathered, never the B x n scores.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from bigrank.distributed.collectives import all_gather_no_grad, group_rank, group_size, is_distributed

__all__ = ["CatalogShard", "CatalogView", "distributed_topk", "gather_owned_rows", "owned_range", "shard_range"]


def shard_range(num_items: int, rank: int, world_size: int) -> tuple[int, int]:
    """Contiguous ``[start, stop)`` of items owned by ``rank``: the first ``num_items % world_size`` ranks get one
    extra row (the split ``torch.tensor_split`` uses), so shards differ by at most one row."""
    if num_items < 0 or world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"bad shard request: num_items={num_items}, rank={rank}, world_size={world_size}")
    base, extra = divmod(num_items, world_size)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


def owned_range(num_rows: int, group: dist.ProcessGroup | None) -> tuple[int, int]:
    """The rows ``[start, stop)`` of a ``num_rows`` table this rank owns in ``group`` (``shard_range``)."""
    return shard_range(num_rows, group_rank(group), group_size(group))


@torch.no_grad()
def gather_owned_rows(tensor: torch.Tensor, group: dist.ProcessGroup | None) -> None:
    """Make a replicated row-aligned ``tensor`` (``[num_rows, ...]``, every row held) whole on every rank from the
    rows each rank owns (``owned_range``), e.g. after a checkpoint load wrote only those; collective."""
    if not is_distributed(group):
        return
    world, rows = group_size(group), tensor.shape[0]
    ranges = [shard_range(rows, r, world) for r in range(world)]
    widest = max(stop - start for start, stop in ranges)
    start, stop = ranges[group_rank(group)]
    mine = tensor.new_zeros((widest, *tensor.shape[1:]))
    mine[: stop - start] = tensor[start:stop]
    gathered = all_gather_no_grad(mine, group, [widest] * world).view(world, widest, *tensor.shape[1:])
    for r, (first, last) in enumerate(ranges):
        tensor[first:last] = gathered[r, : last - first]


@dataclass
class CatalogView:
    """Rows ``[start, stop)`` of the ``[num_items, dim]`` item matrix: ``weight`` float[stop - start, dim] (a
    view of the live parameter's data)."""

    start: int
    stop: int
    num_items: int
    dim: int
    weight: torch.Tensor

    @property
    def num_local(self) -> int:
        return self.stop - self.start


class CatalogShard(nn.Module):
    """The rows of the item embedding matrix ``[num_items, dim]`` that this rank holds.

    Args:
        num_items: size of the full catalog n.
        dim: embedding dimension d.
        group: process group the catalog belongs to (None: one process owns everything).
        replicated: hold every row (``[0, n)``) rather than the owned range; the loss then runs without a
            group (:attr:`loss_group` is None) and the trainer all-reduces the gradient.
        init_std: items are initialised N(0, init_std^2) from ``seed``, row by row in global order, so the
            full matrix is the same whatever the number of ranks and the layout.
        bounds: explicit owned ``(start, stop)`` for uneven splits; the default is ``shard_range``.
        device: where the rows live (this worker's device, ``bigrank.devices.worker_device``); they are drawn
            on the CPU (the same values on every device) and copied there once.
        initialize: False leaves the rows zero, for a shard that a checkpoint load fills next.

    ``start``/``stop``/``weight`` are the rows held (what the loss scores, at column offset ``start``);
    :meth:`owned` the rows owned (what checkpoints, exports and evaluation read).
    """

    def __init__(
        self,
        num_items: int,
        dim: int,
        group: dist.ProcessGroup | None = None,
        *,
        replicated: bool = False,
        init_std: float = 0.1,
        seed: int = 0,
        bounds: tuple[int, int] | None = None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        initialize: bool = True,
    ):
        super().__init__()
        if num_items < 1 or dim < 1:
            raise ValueError(f"num_items and dim must be >= 1, got num_items={num_items}, dim={dim}")
        self.num_items, self.dim, self.group = int(num_items), int(dim), group
        self.rank, self.world_size = group_rank(group), group_size(group)
        self.replicated = bool(replicated)
        start, stop = bounds if bounds is not None else shard_range(num_items, self.rank, self.world_size)
        if not 0 <= start <= stop <= num_items:
            raise ValueError(f"shard bounds [{start}, {stop}) must lie inside [0, {num_items})")
        self.owned_start, self.owned_stop = int(start), int(stop)
        self.start, self.stop = (0, self.num_items) if self.replicated else (self.owned_start, self.owned_stop)
        if initialize:
            self.weight = nn.Parameter(self._initial_rows(init_std, seed, dtype).to(device))
        else:  # a checkpoint load fills every row next: drawing the initial rows would be wasted
            self.weight = nn.Parameter(torch.zeros((self.stop - self.start, self.dim), dtype=dtype, device=device))

    def _initial_rows(self, init_std: float, seed: int, dtype: torch.dtype) -> torch.Tensor:
        # Generate the held rows only, in fixed blocks of the global matrix, so that any split of the catalog
        # yields the same full matrix without materialising it on every rank.
        block = 65_536
        rows = []
        for first in range(self.start // block * block, self.stop, block):
            generator = torch.Generator().manual_seed(seed * 1_000_003 + first // block)
            values = torch.randn((min(block, self.num_items - first), self.dim), generator=generator)
            lo, hi = max(self.start - first, 0), min(self.stop - first, values.shape[0])
            rows.append(values[lo:hi])
        local = torch.cat(rows) if rows else torch.empty((0, self.dim))
        return (local * init_std).to(dtype)

    @property
    def num_local(self) -> int:
        """Rows held."""
        return self.stop - self.start

    @property
    def loss_group(self) -> dist.ProcessGroup | None:
        """The group a loss over these rows spans: the catalog's group when sharded, none when replicated."""
        return None if self.replicated else self.group

    def owned_rows(self, tensor: torch.Tensor) -> torch.Tensor:
        """The owned rows of a row-aligned tensor of the held rows (the weight, an optimizer's accumulator):
        a view, ``[owned_stop - owned_start, ...]``."""
        return tensor[self.owned_start - self.start : self.owned_stop - self.start]

    def owned(self) -> CatalogView:
        """The rows this rank owns ``[owned_start, owned_stop)`` (all it holds when sharded)."""
        return CatalogView(
            self.owned_start, self.owned_stop, self.num_items, self.dim, self.owned_rows(self.weight.data)
        )

    def fill_from_owned(self, tensor: torch.Tensor) -> None:
        """Replicated catalog: make every rank's copy of the row-aligned ``tensor`` (held rows) whole from the
        rows each rank owns (after a checkpoint load wrote only those); collective. Sharded: nothing to do."""
        if not self.replicated:
            return
        if (self.owned_start, self.owned_stop) != owned_range(self.num_items, self.group):
            raise ValueError("fill_from_owned needs the default shard_range split of the owned rows")
        gather_owned_rows(tensor, self.group)

    def extra_repr(self) -> str:
        layout = "replicated" if self.replicated else "sharded"
        rows = f"[{self.start}, {self.stop})"
        return f"num_items={self.num_items}, dim={self.dim}, rows={rows}, {layout}, world_size={self.world_size}"


@torch.no_grad()
def distributed_topk(
    scores: torch.Tensor,
    k: int,
    *,
    group: dist.ProcessGroup | None = None,
    offset: int = 0,
    exclude: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-``k`` values and *global* item ids of each row over a catalog split by columns across ranks.

    Args:
        scores: float[B, n_local], columns ``[offset, offset + n_local)`` of the full matrix.
        k: number of items to return (clipped to the catalog size).
        exclude: optional bool[B, n_local] of local columns to leave out (e.g. a user's train items).

    Returns ``(values [B, k], ids [B, k])`` sorted by decreasing score, replicated on every rank; ties keep the
    lower id first. Uses ``torch.no_grad`` collectives (gloo's all-gather fails under ``inference_mode``).
    Excluded items get score -inf; if fewer than k items remain their ids are -1.
    """
    if scores.dim() != 2:
        raise ValueError(f"scores must have shape [B, n_local], got {tuple(scores.shape)}")
    batch, num_local = scores.shape
    if exclude is not None:
        if exclude.shape != scores.shape:
            raise ValueError(f"exclude must have the shape of scores {tuple(scores.shape)}, got {tuple(exclude.shape)}")
        scores = scores.masked_fill(exclude, float("-inf"))
    counts = (
        all_gather_no_grad(torch.tensor([num_local], device=scores.device), group)
        if is_distributed(group)
        else torch.tensor([num_local])
    )
    k = min(int(k), int(counts.sum()))
    local_k = min(k, num_local)
    values = torch.full((batch, k), float("-inf"), dtype=scores.dtype, device=scores.device)
    ids = torch.full((batch, k), -1, dtype=torch.int64, device=scores.device)
    if local_k:
        top_values, top_columns = _row_topk(scores, local_k)
        values[:, :local_k] = top_values
        ids[:, :local_k] = torch.where(torch.isfinite(top_values), top_columns + offset, -1)
    if is_distributed(group):
        world = group_size(group)
        values = all_gather_no_grad(values, group).view(world, batch, k).permute(1, 0, 2).reshape(batch, -1)
        ids = all_gather_no_grad(ids, group).view(world, batch, k).permute(1, 0, 2).reshape(batch, -1)
    # Sort by (score desc, id asc) so that the answer does not depend on how the catalog is split.
    order = torch.argsort(ids.masked_fill(ids < 0, torch.iinfo(torch.int64).max), dim=1, stable=True)
    values, ids = values.gather(1, order), ids.gather(1, order)
    order = torch.argsort(values, dim=1, descending=True, stable=True)[:, :k]
    return values.gather(1, order), ids.gather(1, order)


def _row_topk(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``scores.topk(k, dim=1)`` (values, column indices) of ``scores`` [B, n], faster for large k (evaluation's
    top 1,000 of a 428K-column shard) by a threshold that every top-k entry reaches.

    The columns are split into g strided groups (column j in group j mod G); the k-th largest group maximum
    t_b is reached by at least k entries (one per group), so the row's top k are among the entries >= t_b,
    typically ~k of them. One vectorised max pass, one top-k over G maxima and one compare replace the
    top-k over n. Rows with NaN take ``torch.topk`` (it ranks NaN first); small k or narrow rows too.
    """
    rows, width = scores.shape
    group = int((width / max(k, 1)) ** 0.5)
    groups = width // max(group, 1)
    if k < 128 or group < 4 or scores.stride(1) != 1:
        top = scores.topk(k, dim=1)
        return top.values, top.indices
    group_max = scores.as_strided((rows, group, groups), (scores.stride(0), groups, 1)).amax(dim=1)
    threshold = group_max.topk(k, dim=1).values[:, -1:]
    if bool(torch.isnan(threshold).any()) or bool(torch.isnan(group_max).any()):
        top = scores.topk(k, dim=1)
        return top.values, top.indices
    # The last width mod G columns are in no group; the compare covers them (a top-k entry is >= t_b anyway).
    row, column = (scores >= threshold).nonzero(as_tuple=True)
    counts = torch.bincount(row, minlength=rows)
    starts = torch.cumsum(counts, 0) - counts
    slot = torch.arange(row.numel(), device=scores.device) - starts[row]
    candidates = scores.new_full((rows, int(counts.max())), float("-inf"))
    columns = torch.zeros((rows, candidates.shape[1]), dtype=torch.int64, device=scores.device)
    candidates[row, slot] = scores[row, column]
    columns[row, slot] = column
    top = candidates.topk(k, dim=1)
    return top.values, columns.gather(1, top.indices)
