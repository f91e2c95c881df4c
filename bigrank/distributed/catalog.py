"""The item-parallel ("vocab-parallel") catalog: each rank owns a contiguous range of item rows.

Full-catalog losses score the all-gathered user vectors of the global batch against the local rows only
(``CatalogShard.scores``) and exchange per-row statistics (see ``bigrank.losses``). Evaluation ranks the whole
catalog with ``distributed_topk``: each rank's top-K values and ids are gathered, never the B x n scores.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from bigrank.distributed.collectives import all_gather_no_grad, group_rank, group_size, is_distributed
from bigrank.losses.scores import score_matrix

__all__ = ["CatalogShard", "distributed_topk", "shard_range"]


def shard_range(num_items: int, rank: int, world_size: int) -> tuple[int, int]:
    """Contiguous ``[start, stop)`` of items owned by ``rank``: the first ``num_items % world_size`` ranks get one
    extra row (the split ``torch.tensor_split`` uses), so shards differ by at most one row."""
    if num_items < 0 or world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"bad shard request: num_items={num_items}, rank={rank}, world_size={world_size}")
    base, extra = divmod(num_items, world_size)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


class CatalogShard(nn.Module):
    """This rank's rows ``[start, stop)`` of the item embedding matrix ``[num_items, dim]``.

    Args:
        num_items: size of the full catalog n.
        dim: embedding dimension d.
        group: process group the catalog is split over (None: one process owns everything).
        init_std: items are initialised N(0, init_std^2) from ``seed``, row by row in global order, so the
            full matrix is the same whatever the number of ranks.
        bounds: explicit ``(start, stop)`` for uneven splits; the default is ``shard_range``.
        device: where the rows live (this worker's device, ``bigrank.devices.worker_device``); they are drawn
            on the CPU (the same values on every device) and copied there once.
    """

    def __init__(
        self,
        num_items: int,
        dim: int,
        group: dist.ProcessGroup | None = None,
        *,
        init_std: float = 0.1,
        seed: int = 0,
        bounds: tuple[int, int] | None = None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ):
        super().__init__()
        if num_items < 1 or dim < 1:
            raise ValueError(f"num_items and dim must be >= 1, got num_items={num_items}, dim={dim}")
        self.num_items, self.dim, self.group = int(num_items), int(dim), group
        self.rank, self.world_size = group_rank(group), group_size(group)
        start, stop = bounds if bounds is not None else shard_range(num_items, self.rank, self.world_size)
        if not 0 <= start <= stop <= num_items:
            raise ValueError(f"shard bounds [{start}, {stop}) must lie inside [0, {num_items})")
        self.start, self.stop = int(start), int(stop)
        self.weight = nn.Parameter(self._initial_rows(init_std, seed, dtype).to(device))

    def _initial_rows(self, init_std: float, seed: int, dtype: torch.dtype) -> torch.Tensor:
        # Generate the rows of this shard only, in fixed blocks of the global matrix, so that any split of the
        # catalog yields the same full matrix without materialising it on every rank.
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
        return self.stop - self.start

    def scores(self, user_vectors: torch.Tensor, chunk_size: int | str | None = None, dtype: torch.dtype | None = None):
        """Scores of the (all-gathered) user vectors ``[B, d]`` against the local rows.

        Returns ``[B, n_local]`` (columns ``[start, stop)`` of the full matrix), or with ``chunk_size`` (items,
        or ``"auto"``) a ``ChunkedScores`` that full-catalog losses read a chunk of items at a time, so that the
        ``B x n_local`` matrix never exists at once (scores are recomputed in backward); see ``score_matrix``.
        ``dtype``: the score dtype (``Precision.score_dtype``: bf16 GEMMs for ``train.precision=bf16``).
        """
        if user_vectors.dim() != 2 or user_vectors.shape[1] != self.dim:
            raise ValueError(f"user_vectors must have shape [B, {self.dim}], got {tuple(user_vectors.shape)}")
        if user_vectors.device != self.weight.device:
            raise ValueError(f"user_vectors are on {user_vectors.device}, the catalog rows on {self.weight.device}")
        return score_matrix(user_vectors, self.weight, chunk_size, dtype)

    def extra_repr(self) -> str:
        rows = f"[{self.start}, {self.stop})"
        return f"num_items={self.num_items}, dim={self.dim}, rows={rows}, world_size={self.world_size}"


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
