"""Atomic, resumable training checkpoints of the item-parallel model.

Layout of ``RUN_DIR/checkpoints/step-00000120/`` (a checkpoint is complete iff ``trainer.json`` exists)::

    tower/               torch.distributed.checkpoint (DCP) of the row-wise sharded user tower and its fused
                         optimizer state (Adagrad accumulators); each rank writes its own rows
    rank-00000.pt …      one file per rank (torch.save): its catalog rows [start, stop), the item optimizer's
                         state, the data stream's position, the torch RNG state
    trainer.json         step, epoch, world size, loss-schedule state, last loss; written last

The directory is written as ``step-….partial`` and renamed by rank 0 after every rank has finished, so a
crash mid-save leaves no half checkpoint under the final name; ``keep`` complete checkpoints are kept.
Resuming needs the same number of workers (the catalog and stream shares are per rank).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from bigrank.atomic import write_atomic

CHECKPOINTS = "checkpoints"
TRAINER_FILE = "trainer.json"
_PREFIX = "step-"


def checkpoint_root(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir) / CHECKPOINTS


def checkpoint_path(run_dir: str | os.PathLike, step: int) -> Path:
    return checkpoint_root(run_dir) / f"{_PREFIX}{step:08d}"


def rank_file(path: str | os.PathLike, rank: int) -> Path:
    return Path(path) / f"rank-{rank:05d}.pt"


def list_checkpoints(run_dir: str | os.PathLike) -> list[Path]:
    """Complete checkpoints of a run, oldest first (partial ones are ignored)."""
    root = checkpoint_root(run_dir)
    if not root.is_dir():
        return []
    found = []
    for entry in root.iterdir():
        name = entry.name
        if name.startswith(_PREFIX) and name[len(_PREFIX) :].isdigit() and (entry / TRAINER_FILE).is_file():
            found.append((int(name[len(_PREFIX) :]), entry))
    return [path for _, path in sorted(found)]


def latest_checkpoint(run_dir: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint of ``run_dir``, or None."""
    found = list_checkpoints(run_dir)
    return found[-1] if found else None


def remove_partial_checkpoints(run_dir: str | os.PathLike) -> list[Path]:
    """Delete the ``step-….partial`` directories a crash mid-save left behind; returns what was removed."""
    root = checkpoint_root(run_dir)
    removed = []
    if root.is_dir():
        for entry in root.iterdir():
            if entry.name.startswith(_PREFIX) and entry.name.endswith(".partial"):
                shutil.rmtree(entry, ignore_errors=True)
                removed.append(entry)
    return removed


def read_trainer_state(path: str | os.PathLike) -> dict[str, Any]:
    """``trainer.json`` of a checkpoint directory."""
    file = Path(path) / TRAINER_FILE
    if not file.is_file():
        raise FileNotFoundError(f"{path} is not a complete checkpoint (no {TRAINER_FILE})")
    return json.loads(file.read_text())


def _barrier(group) -> None:
    if dist.is_initialized():
        dist.barrier(group=group)


def _rank(group) -> int:
    return dist.get_rank(group) if dist.is_initialized() else 0


def save_checkpoint(
    run_dir: str | os.PathLike,
    step: int,
    *,
    tower,
    rank_state: dict[str, Any],
    trainer_state: dict[str, Any],
    keep: int,
    group=None,
) -> Path:
    """Write checkpoint ``step`` (collective: every rank calls it) and prune to the ``keep`` newest.

    Args:
        tower: the ``DistributedModelParallel`` user tower (saved with DCP, each rank its rows).
        rank_state: this rank's picklable state (catalog rows, item optimizer, stream, RNG).
        trainer_state: JSON-ready replicated state, written by rank 0 as ``trainer.json`` (last).
    Returns the checkpoint directory. An existing complete checkpoint of that step is left as it is.
    """
    from bigrank.model.sharding import save_tower_state

    final = checkpoint_path(run_dir, step)
    if (final / TRAINER_FILE).is_file():
        return final
    partial = final.with_name(final.name + ".partial")
    rank = _rank(group)
    if rank == 0:
        if partial.exists():
            shutil.rmtree(partial)  # left by a crash mid-save
        partial.mkdir(parents=True)
    _barrier(group)
    save_tower_state(tower, partial / "tower")
    write_atomic(rank_file(partial, rank), lambda tmp: torch.save(rank_state, tmp))
    _barrier(group)
    if rank == 0:
        state = dict(trainer_state, step=int(step))
        write_atomic(partial / TRAINER_FILE, lambda tmp: tmp.write_text(json.dumps(state, indent=2) + "\n"))
        if final.exists():  # an incomplete directory under the final name (should not happen): replace it
            shutil.rmtree(final)
        os.replace(partial, final)
        for old in list_checkpoints(run_dir)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    _barrier(group)
    return final


def load_checkpoint(path: str | os.PathLike, *, tower, world_size: int, group=None) -> tuple[dict, dict]:
    """Load a checkpoint into ``tower`` (collective) and return ``(trainer_state, this rank's rank_state)``.

    Raises ValueError when it was written by a different number of workers, FileNotFoundError when incomplete.
    """
    from bigrank.model.sharding import load_tower_state

    path = Path(path)
    trainer_state = read_trainer_state(path)
    saved = int(trainer_state.get("world_size", world_size))
    if saved != world_size:
        raise ValueError(
            f"checkpoint {path} was written by {saved} workers; resume it with workers={saved} "
            f"(this run has {world_size})"
        )
    load_tower_state(tower, path / "tower")
    file = rank_file(path, _rank(group))
    if not file.is_file():
        raise FileNotFoundError(f"checkpoint {path} has no {file.name}")
    rank_state = torch.load(file, map_location="cpu", weights_only=False)
    return trainer_state, rank_state


def load_weights_only(path: str | os.PathLike, *, tower, row_start: int, row_stop: int) -> tuple[dict, torch.Tensor]:
    """Load only the parameters of a checkpoint, for any number of workers (evaluation, export).

    The tower is resharded by DCP (collective); the catalog rows ``[row_start, row_stop)`` are cut from the
    per-rank files that overlap them. Returns ``(trainer_state, catalog rows float[row_stop - row_start, d])``.
    """
    from bigrank.model.sharding import load_tower_state

    path = Path(path)
    trainer_state = read_trainer_state(path)
    load_tower_state(tower, path / "tower")
    pieces, covered = [], row_start
    for file in sorted(path.glob("rank-*.pt")):
        state = torch.load(file, map_location="cpu", weights_only=False)
        lo, hi = max(row_start, int(state["start"])), min(row_stop, int(state["stop"]))
        if lo < hi:
            pieces.append((lo, state["catalog"][lo - int(state["start"]) : hi - int(state["start"])]))
        del state
    pieces.sort(key=lambda piece: piece[0])
    for lo, rows in pieces:
        if lo != covered:
            break
        covered += rows.shape[0]
    if covered != row_stop:
        raise ValueError(f"checkpoint {path} does not hold catalog rows [{covered}, {row_stop}) (missing rank files?)")
    if not pieces:
        return trainer_state, torch.empty(0)
    return trainer_state, torch.cat([rows for _, rows in pieces])
