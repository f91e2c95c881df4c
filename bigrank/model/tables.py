"""The tables of the user tower: feature and table names, and their deterministic initial rows.

A leaf module (torch only) shared by ``bigrank.model.towers`` (which builds the tables) and
``bigrank.model.sharding`` (which shards and reads them), so neither imports the other's internals.

Initial weights are a pure function of ``(seed, table, global row)``: rows are drawn in fixed blocks of
``INIT_BLOCK_ROWS``, each from its own generator, so a rank that owns rows ``[a, b)`` draws exactly the
values the single-process module holds there, whatever the world size (resume and equality tests rely on it).
"""

from __future__ import annotations

import torch

__all__ = ["HISTORY_FEATURE", "HISTORY_TABLE", "INIT_BLOCK_ROWS", "USER_FEATURE", "USER_TABLE", "deterministic_rows"]

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
