"""Atomic, resumable training checkpoints through ``torch.distributed.checkpoint`` (DCP), on any worker count.

A checkpoint holds the state of every registered part of the trainer (the ``Stateful`` protocol of DCP:
``state_dict()`` / ``load_state_dict()``), all written with one ``dcp.save``:

    tower      the row-wise sharded torchrec user tower and its fused optimizer state (torchrec ShardedTensors)
    catalog    the catalog rows and the item optimizer's row-aligned state (``row_sharded``: ShardedTensors
               whose shards are each rank's rows ``[start, stop)`` of the global ``[num_items, ...]`` tensors)
    stream     the data position (rank-independent, see ``bigrank.data.stream``)
    loss       the loss schedule (warm-up / temperature)
    train      step, first and last loss
    rng.<r>    rank r's torch RNG state

Because the sharded tensors carry their global offsets, DCP reshards them on load: a run saved by W workers
resumes on W' workers, and evaluate/export load the same files on any worker count. Layout::

    RUN_DIR/checkpoints/step-00000120/
        *.distcp, .metadata     the DCP files (each rank writes its own shards)
        trainer.json            step, epoch, world size, the model identity, last loss, and the byte size and
                                CRC-32 of every DCP file (``files``); written last

The directory is written as ``step-….partial`` and renamed by rank 0 after every rank has finished, so a
crash mid-save leaves no half checkpoint under the final name (a checkpoint is complete iff ``trainer.json``
exists); ``keep`` complete checkpoints are kept.

Integrity (``bigrank.integrity``): loading checks every DCP file's size against ``trainer.json`` (a few
``stat`` calls, every rank), then its CRC-32 (``check_checkpoint_checksums``: each rank reads a disjoint share of
the files, about 1/W of the bytes, and the ranks agree), and names a truncated, missing or changed one, with the
advice to delete that checkpoint and resume from the previous one; all before DCP reads a tensor, so a flipped
byte in a shard is never loaded as a weight. ``bigrank verify`` reports every damaged file
(``verify_checkpoint``). Checkpoints written before sizes and checksums were recorded load unchecked.
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist

from bigrank import integrity
from bigrank.atomic import write_atomic
from bigrank.errors import CorruptFileError

__all__ = [
    "Checkpointer",
    "Stateful",
    "check_checkpoint_checksums",
    "checkpoint_path",
    "latest_checkpoint",
    "list_checkpoints",
    "load_parts",
    "read_trainer_state",
    "remove_partial_checkpoints",
    "row_sharded",
    "save_parts",
    "verify_checkpoint",
]

CHECKPOINTS = "checkpoints"
TRAINER_FILE = "trainer.json"
_PREFIX = "step-"


class Stateful(Protocol):
    """A part of the trainer that a checkpoint saves and restores (DCP's protocol)."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


# ------------------------------------------------------------------------------------------------ paths
def checkpoint_root(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir) / CHECKPOINTS


def checkpoint_path(run_dir: str | os.PathLike, step: int) -> Path:
    return checkpoint_root(run_dir) / f"{_PREFIX}{step:08d}"


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
    """``trainer.json`` of a checkpoint directory (FileNotFoundError when the checkpoint is incomplete)."""
    file = Path(path) / TRAINER_FILE
    if not file.is_file():
        raise FileNotFoundError(f"{path} is not a complete checkpoint (no {TRAINER_FILE})")
    return json.loads(file.read_text())


# ------------------------------------------------------------------------------------------------ integrity
def describe_checkpoint_files(path: str | os.PathLike) -> dict[str, dict]:
    """``{relative name: {bytes, crc32}}`` of the DCP files in the checkpoint directory ``path`` (all but
    ``trainer.json``). CRC-32 at ~0.6-1 GB/s a core, in parallel threads, on rank 0 while the others wait at the
    save's last barrier: a small part of a save, which has just written the same bytes."""
    path = Path(path)
    names = sorted(
        str(file.relative_to(path)) for file in path.rglob("*") if file.is_file() and file.name != TRAINER_FILE
    )
    return integrity.describe_files(path, names)


def repair_advice(path: str | os.PathLike) -> str:
    """What to do about a damaged checkpoint ``path``: delete it so that the run resumes from the one before."""
    path = Path(path)
    older = [c for c in list_checkpoints(path.parent.parent) if c.name < path.name]  # step-NNNNNNNN sort by step
    then = f"resumes from the previous checkpoint {older[-1].name}" if older else "starts over (no earlier checkpoint)"
    return f"The checkpoint is damaged: delete the directory {path} and run the same command again; it then {then}."


def check_checkpoint_sizes(path: str | os.PathLike, meta: Mapping[str, Any]) -> None:
    """Check that every DCP file ``trainer.json`` lists (``meta["files"]``) exists with its recorded size.

    ValueError naming the first damaged file and what to do (``repair_advice``); nothing to check for a
    checkpoint written before sizes were recorded. Every rank sees the same files, so every rank raises alike
    before the collective load (none is left waiting in it)."""
    path = Path(path)
    for name, entry in (meta.get("files") or {}).items():
        problem = integrity.check_file(path / name, entry, checksum=False)
        if problem is not None:
            raise damaged_checkpoint(path, name, problem)


def check_checkpoint_checksums(path: str | os.PathLike, meta: Mapping[str, Any], group=None) -> None:
    """Check the CRC-32 of every DCP file ``trainer.json`` lists (``meta["files"]``) before they are loaded.

    Collective over ``group`` (the control group) when torch.distributed is initialised: each rank reads a
    disjoint share of the files (``integrity.check_files_shared``, ~1/W of the checkpoint's bytes at ~1 GB/s a
    core), and every rank raises the same CorruptFileError (a ValueError) naming the first damaged file and what
    to do (``repair_advice``). A same-size change of a shard (a flipped byte) otherwise loads as a wrong weight:
    DCP reads tensors by offset and checks nothing. Nothing to check for a checkpoint written before checksums
    were recorded."""
    path = Path(path)
    files = {name: entry for name, entry in (meta.get("files") or {}).items() if integrity.CHECKSUM in entry}
    problems = integrity.check_files_shared(path, files, group=group)
    if problems:
        name, problem = problems[0]
        raise damaged_checkpoint(path, name, problem)


def damaged_checkpoint(path: Path, name: str, problem: str) -> CorruptFileError:
    """The error for the DCP file ``name`` of the checkpoint ``path`` that is ``problem`` (``check_file``'s words)."""
    return CorruptFileError(f"checkpoint file {path / name} is {problem}. {repair_advice(path)}", path=path / name)


def verify_checkpoint(path: str | os.PathLike) -> integrity.Report:
    """Check every DCP file of the checkpoint ``path`` against the sizes and CRC-32 checksums in its
    ``trainer.json`` and report each damaged one by name (``bigrank verify``)."""
    path = Path(path)
    meta = read_trainer_state(path)
    report = integrity.Report("checkpoint", path, repair_advice(path))
    files = meta.get("files")
    if files is None:
        report.notes.append("trainer.json records no file sizes or checksums (written by an older bigrank)")
    for name, entry in (files or {}).items():
        report.check(name, entry)
    return report


# ---------------------------------------------------------------------------------------- sharded state
def row_sharded(local: torch.Tensor, start: int, num_rows: int, group=None):
    """``local`` (rows ``[start, start + len(local))`` of a global ``[num_rows, ...]`` tensor) as a
    ShardedTensor that DCP saves with its global offset and reshards on load; it shares ``local``'s storage,
    so a ``dcp.load`` into it writes ``local`` in place. Without a process group: ``local`` itself."""
    if not (dist.is_available() and dist.is_initialized()):
        return local
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor import Shard, init_from_local_shards

    rank = dist.get_rank()  # ShardedTensor placements name global ranks
    metadata = ShardMetadata(
        shard_offsets=[int(start)] + [0] * (local.dim() - 1),
        shard_sizes=list(local.shape),
        placement=f"rank:{rank}/{local.device}",
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # ShardedTensor's deprecation notice (torchrec uses it too)
        return init_from_local_shards(
            [Shard(local, metadata)], [int(num_rows)] + list(local.shape[1:]), process_group=group
        )


def _dcp():
    import torch.distributed.checkpoint as dcp

    return dcp


def save_parts(path: str | os.PathLike, parts: Mapping[str, Stateful]) -> None:
    """``dcp.save`` of ``{name: part.state_dict()}`` into the directory ``path`` (collective)."""
    from bigrank.model.sharding import quiet_torchrec

    state = {name: part.state_dict() for name, part in parts.items()}
    with quiet_torchrec(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _dcp().save(state, checkpoint_id=os.fspath(path))


def load_parts(path: str | os.PathLike, parts: Mapping[str, Stateful]) -> None:
    """Fill ``{name: part.state_dict()}`` from the DCP directory ``path`` and hand each part its state
    (collective; sharded tensors are resharded to this run's layout)."""
    from bigrank.model.sharding import quiet_torchrec

    state = {name: part.state_dict() for name, part in parts.items()}
    with quiet_torchrec(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _dcp().load(state, checkpoint_id=os.fspath(path))
    for name, part in parts.items():
        part.load_state_dict(state[name])


# ----------------------------------------------------------------------------------------- checkpointer
class Checkpointer:
    """Decides when to checkpoint, writes checkpoints atomically, finds and loads the newest one.

    Args:
        run_dir: the run directory (``checkpoints/`` is created below it).
        parts: the trainer's stateful parts by name; per-rank parts (RNG) are registered separately with
            ``rank_parts`` because a checkpoint of W workers holds W of them.
        every: steps between checkpoints (None: only at epoch ends and at the end).
        keep: complete checkpoints kept (the oldest are removed).
        identity: the settings a checkpoint's tensors depend on (the model kind's ``identity``); loading a
            checkpoint of another identity is refused naming the differing settings.

    ``pinned``: steps whose checkpoints the pruning keeps beyond ``keep`` (the best evaluation's, with
    ``train.early_stopping``).
    """

    def __init__(
        self,
        run_dir: str | os.PathLike,
        parts: Mapping[str, Stateful],
        *,
        rank_parts: Mapping[str, Stateful] | None = None,
        every: int | None,
        keep: int,
        identity: Mapping[str, Any],
        group=None,
    ):
        self.run_dir = Path(run_dir)
        self.parts = dict(parts)
        self.rank_parts = dict(rank_parts or {})
        self.every, self.keep = every, int(keep)
        self.identity = dict(identity)
        self.group = group
        self.rank = dist.get_rank(group) if dist.is_initialized() else 0
        self.world_size = dist.get_world_size(group) if dist.is_initialized() else 1
        self.last: Path | None = None
        self.pinned: set[int] = set()

    def due(self, step: int, *, epoch_end: bool, last: bool) -> bool:
        """Whether step ``step`` ends with a checkpoint: every ``every`` steps, at epoch ends and at the end."""
        return last or epoch_end or bool(self.every and step % self.every == 0)

    def _all_parts(self, world_size_saved: int | None = None) -> dict[str, Stateful]:
        parts = dict(self.parts)
        if world_size_saved is None or self.rank < world_size_saved:
            parts.update({f"{name}.{self.rank}": part for name, part in self.rank_parts.items()})
        return parts

    def save(self, step: int, meta: Mapping[str, Any]) -> Path:
        """Write checkpoint ``step`` (collective) and prune to the ``keep`` newest; returns its directory.
        ``meta`` (JSON-ready, replicated) goes into ``trainer.json`` with the step, world size and identity.
        An existing complete checkpoint of that step is left as it is."""
        final = checkpoint_path(self.run_dir, step)
        if (final / TRAINER_FILE).is_file():
            self.last = final
            return final
        partial = final.with_name(final.name + ".partial")
        if self.rank == 0:
            if partial.exists():
                shutil.rmtree(partial)  # left by a crash mid-save
            partial.mkdir(parents=True)
        self._barrier()
        save_parts(partial, self._all_parts())
        self._barrier()
        if self.rank == 0:
            files = describe_checkpoint_files(partial)  # every rank's files are complete: after the barrier
            state = dict(meta, step=int(step), world_size=self.world_size, model=self.identity, files=files)
            write_atomic(partial / TRAINER_FILE, lambda tmp: tmp.write_text(json.dumps(state, indent=2) + "\n"))
            if final.exists():  # an incomplete directory under the final name (a crash after a rename)
                shutil.rmtree(final)
            os.replace(partial, final)
            pinned = {checkpoint_path(self.run_dir, step) for step in self.pinned}
            for old in [path for path in list_checkpoints(self.run_dir)[: -self.keep] if path not in pinned]:
                # trainer.json first: a kill during the removal then leaves an incomplete checkpoint, which
                # nothing loads, not a "complete" one with shards missing.
                (old / TRAINER_FILE).unlink(missing_ok=True)
                shutil.rmtree(old, ignore_errors=True)
        self._barrier()
        self.last = final
        return final

    def replace(self, step: int, meta: Mapping[str, Any]) -> Path:
        """Write checkpoint ``step`` anew from the parts' current state (collective): the one of that step, if any,
        is removed first (``trainer.json`` first, so that a kill in between leaves the older checkpoints as the
        newest complete one). The end of an early-stopped run writes the best weights under its last step."""
        final = checkpoint_path(self.run_dir, step)
        if self.rank == 0 and final.exists():
            (final / TRAINER_FILE).unlink(missing_ok=True)
            shutil.rmtree(final)
        self._barrier()
        return self.save(step, meta)

    def load(self, path: str | os.PathLike, parts: Mapping[str, Stateful] | None = None) -> dict[str, Any]:
        """Load checkpoint ``path`` into ``parts`` (default: every registered part; collective) and return its
        ``trainer.json``. Per-rank parts are restored only on the ranks the checkpoint has (a run resumed on
        more workers starts the new ranks' RNG from the seed). Raises ValueError for another model's checkpoint,
        and CorruptFileError (a ValueError) for a DCP file missing, of another size than recorded
        (``check_checkpoint_sizes``) or with another CRC-32 (``check_checkpoint_checksums``)."""
        path = Path(path)
        meta = read_trainer_state(path)
        check_checkpoint_sizes(path, meta)
        saved = meta.get("model")
        if saved is not None and saved != self.identity:
            changed = sorted(key for key in self.identity if saved.get(key) != self.identity[key])
            raise ValueError(
                f"{path} is a checkpoint of another model ({', '.join(changed)} differ from this config): "
                "use a new run_dir, or restore those settings to resume"
            )
        # After the cheap checks (a wrong model is named without reading the shards), before any tensor is read.
        check_checkpoint_checksums(path, meta, _control_group())
        if parts is None:
            parts = self._all_parts(int(meta.get("world_size", self.world_size)))
        load_parts(path, parts)
        self.last = path
        return meta

    def _barrier(self) -> None:
        if dist.is_initialized():
            dist.barrier(group=self.group)


def _control_group():
    """The group CPU-side checks gather through (``bigrank.distributed.groups``), or None without a process group."""
    if not dist.is_initialized():
        return None
    from bigrank.distributed.groups import control_group

    return control_group()
