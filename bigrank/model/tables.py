"""The tables of the user tower: feature and table names, their deterministic initial rows, and the rows a rank
holds once sharded (``local_table_rows``: a row-wise shard or the whole table; ``replicated_table_parameters``).

A leaf module (torch only), read by ``bigrank.model.towers`` (which builds and initialises the tables), the
model assembly (``bigrank.train.model``) and export; ``bigrank.model.sharding`` shards the tables and imports
neither.

Initial weights are a pure function of ``(seed, table, global row)``: rows are drawn in fixed blocks of
``INIT_BLOCK_ROWS``, each from its own generator, so a rank that owns rows ``[a, b)`` draws exactly the
values the single-process module holds there, whatever the world size (resume and equality tests rely on it).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

__all__ = [
    "HISTORY_FEATURE",
    "HISTORY_TABLE",
    "INIT_BLOCK_ROWS",
    "USER_FEATURE",
    "USER_TABLE",
    "deterministic_rows",
    "full_table",
    "full_user_table",
    "local_table_rows",
    "local_user_rows",
    "replicated_table_parameters",
]

USER_FEATURE = "user_id"
HISTORY_FEATURE = "history"
USER_TABLE = "user_table"
HISTORY_TABLE = "history_table"
INIT_BLOCK_ROWS = 8192

_TABLE_SEED_SALT = {USER_TABLE: 0x5EED_0001, HISTORY_TABLE: 0x5EED_0002}


def deterministic_rows(
    seed: int, table: str, num_rows: int, dim: int, row_start: int, row_stop: int, std: float
) -> torch.Tensor:
    """Initial rows ``[row_start, row_stop)`` of a ``num_rows × dim`` table, ``N(0, std²)``: float32[rows, dim].

    The value of a row depends only on ``(seed, table, num_rows, dim, row)``, never on which slice is asked
    for, so every sharding of the table reproduces the single-process initialisation exactly.
    """
    if not 0 <= row_start <= row_stop <= num_rows:
        raise ValueError(f"row range [{row_start}, {row_stop}) is not inside [0, {num_rows})")
    salt = _TABLE_SEED_SALT.get(table, sum(map(ord, table)))
    out = torch.empty(row_stop - row_start, dim, dtype=torch.float32)
    if row_stop == row_start:
        return out
    for block in range(row_start // INIT_BLOCK_ROWS, (row_stop - 1) // INIT_BLOCK_ROWS + 1):
        block_start = block * INIT_BLOCK_ROWS
        block_rows = min(INIT_BLOCK_ROWS, num_rows - block_start)
        # The block's size depends only on the table, so its draw is identical in every world size.
        generator = torch.Generator().manual_seed((seed * 1_000_003 + salt * 7919 + block) % (2**63))
        values = torch.randn(block_rows, dim, generator=generator) * std
        lo, hi = max(row_start, block_start), min(row_stop, block_start + block_rows)
        out[lo - row_start : hi - row_start] = values[lo - block_start : hi - block_start]
    return out


# ---------------------------------------------------------------------------------------------------------
# The rows a rank holds (after bigrank.model.sharding.shard_row_wise, or of a plain module: all of them)


def _table_weight(module: nn.Module, table: str):
    suffix = f"embedding_bags.{table}.weight"
    seq_suffix = f"embeddings.{table}.weight"
    for key, value in module.state_dict().items():
        if key.endswith(suffix) or key.endswith(seq_suffix):
            return value
    raise KeyError(f"no embedding table named {table!r} in {type(module).__name__}")


def local_table_rows(module: nn.Module, table: str) -> tuple[int, int, torch.Tensor]:
    """This rank's rows of ``table``: ``(row_start, row_stop, weight float32[row_stop-row_start, d])``.

    Works on a plain module (all rows) and on a row-wise sharded one (the local shard, no communication).
    ``weight`` is a view of the live table (writing to it under ``torch.no_grad()`` changes the model);
    clone it to keep a snapshot while training goes on.
    """
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    weight = _table_weight(module, table)
    if isinstance(weight, ShardedTensor):
        shards = weight.local_shards()
        if not shards:
            rows = weight.size(0)
            return rows, rows, torch.empty(0, weight.size(1))
        if len(shards) != 1 or shards[0].metadata.shard_offsets[1] != 0:
            raise ValueError(f"table {table!r} is not row-wise sharded (local shards: {len(shards)})")
        start = int(shards[0].metadata.shard_offsets[0])
        return start, start + shards[0].tensor.size(0), shards[0].tensor
    if isinstance(weight, torch.Tensor):
        return 0, weight.size(0), weight.detach()
    raise TypeError(f"unsupported weight type {type(weight).__name__} for table {table!r}")


def local_user_rows(module: nn.Module) -> tuple[int, int, torch.Tensor]:
    """This rank's shard of the user table: ``(row_start, row_stop, float32[rows, d])`` (a live view)."""
    return local_table_rows(module, USER_TABLE)


def full_table(module: nn.Module, table: str, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """All rows of ``table`` on every rank, float32[n, d] on the CPU — gathers the whole table; for tests and
    tiny tables."""
    start, stop, rows = local_table_rows(module, table)
    if not dist.is_initialized():
        return rows.detach().cpu().clone()
    pieces: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(pieces, (start, stop, rows.detach().cpu().clone()), group=group)
    pieces.sort(key=lambda piece: piece[0])
    return torch.cat([piece[2] for piece in pieces if piece[1] > piece[0]])


def full_user_table(module: nn.Module, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """The whole user table float32[num_users, d] on every rank (a gather: tests only)."""
    return full_table(module, USER_TABLE, group)


def replicated_table_parameters(module: nn.Module) -> dict[str, torch.Tensor]:
    """The parameter of each data-parallel (replicated) table of a sharded module, by table name: float[n, d]
    views of torchrec's dense kernel weights (writable in place under ``no_grad``; ``.grad`` after backward)."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    state = module.state_dict()
    found = {}
    for name, parameter in module.named_parameters():
        # Row-wise sharded tables show up here too (fused, never a .grad): their state is a ShardedTensor.
        if name.endswith(".weight") and ".embedding_bags." in name and not isinstance(state.get(name), ShardedTensor):
            found[name.removesuffix(".weight").rsplit(".", 1)[1]] = parameter
    return found
