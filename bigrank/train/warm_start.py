"""A warm start (``bigrank train CONFIG --init-from RUN_DIR``, ``train.init_from``): a new run begins from an earlier
run's last checkpoint on a grown vocabulary (``bigrank ingest --vocab-from``).

The new run is built exactly as a fresh run (every row initialised as a fresh run of this dataset initialises it,
optimizer state empty); then the rows the earlier run has are overwritten by its checkpoint's, weights and
optimizer state alike (row-wise Adagrad's accumulators, Adam's moments, item-item's W block):

* old users and items keep their dense ids across ``--vocab-from``, so old row ``r`` is new row ``r``: a tensor
  whose dimension is the vocabulary (``[users, d]``, ``[items, d]``, the item-item ``W [items, items]``) is loaded
  into its leading ``[old, ...]`` block, every other tensor as it is;
* rows past the old vocabulary keep the fresh initialisation (a new user of a history-tower model gets a fresh
  user row; its history term is built from the warm item rows of the items it rated);
* the data position, step, loss schedule and RNG are the new run's own (it trains its own epochs over its own
  dataset); the optimizers' step counts are carried.

It works on any worker count and layout, as resume does: each rank asks DCP for the intersection of the rows it
holds with the old vocabulary, as a sharded tensor of the old global shape (``_clipped``), and DCP reshards.

:func:`check_init_from` runs before any worker starts (``bigrank.run.prepare_run``) and refuses a run directory
without a checkpoint, another ``model.kind`` or ``model.dim`` (or other settings the checkpoint's tensors depend
on), and a dataset that is not the run's dataset or one of its descendants (the manifest's ``lineage``).
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from bigrank.config import get_key
from bigrank.errors import ConfigError

__all__ = ["check_init_from", "load_grown"]

# Identity keys (the checkpoint's trainer.json "model") that a grown vocabulary changes; the others must match.
_VOCABULARY_KEYS = ("dataset users", "dataset items")


def check_init_from(config, manifest) -> Path:
    """Before any worker starts: the checkpoint ``train.init_from`` warm-starts from (its run's newest). ConfigError
    naming the problem: no run or checkpoint there; another ``model.kind``, ``model.dim`` or setting the tensors
    depend on; a dataset that is not the run's own or a descendant of it (``bigrank ingest --vocab-from``), or
    whose vocabularies are smaller."""
    from bigrank.config import load_run_config
    from bigrank.data.ingest.vocab import dataset_id, lineage_of
    from bigrank.data.manifest import load_manifest
    from bigrank.train.checkpoint import latest_checkpoint, read_trainer_state

    source = Path(config.train.init_from)
    try:
        earlier = load_run_config(source)
    except FileNotFoundError as error:
        raise ConfigError(f"train.init_from: {error}") from None
    checkpoint = latest_checkpoint(source)
    if checkpoint is None:
        raise ConfigError(f"train.init_from: {source} has no complete checkpoint to start from")
    for key in ("model.kind", "model.dim"):
        old, new = get_key(earlier.to_dict(), key), get_key(config.to_dict(), key)
        if old != new:
            raise ConfigError(f"train.init_from: {source} was trained with {key}={old!r}, this config has {new!r}")
    meta = read_trainer_state(checkpoint)
    identity = meta.get("model") or {}
    for key, old in identity.items():
        if key in _VOCABULARY_KEYS or "." not in key:
            continue
        new = get_key(config.to_dict(), key)
        if new != old:
            raise ConfigError(f"train.init_from: {source} was trained with {key}={old!r}, this config has {new!r}")

    parent_id = meta.get("dataset_id")
    if parent_id is None:  # a checkpoint written before the dataset's id was recorded: its run's dataset
        try:
            parent_id = dataset_id(load_manifest(earlier.data.root))
        except (FileNotFoundError, ValueError) as error:
            raise ConfigError(f"train.init_from: cannot identify the dataset of {source}: {error}") from None
    raw = dict(manifest.raw)
    if parent_id != dataset_id(raw) and parent_id not in lineage_of(raw):
        raise ConfigError(
            f"train.init_from: {config.data.root} does not descend from the dataset {source} was trained on "
            f"(dataset {parent_id}): ingest it with `bigrank ingest … --vocab-from` that dataset (or a descendant)"
        )
    for what, key, now in (
        ("users", "dataset users", manifest.num_users),
        ("items", "dataset items", manifest.num_items),
    ):
        if key in identity and int(identity[key]) > int(now):
            raise ConfigError(f"train.init_from: {source} has {identity[key]:,} {what}, {config.data.root} {now:,}")
    return checkpoint


# --------------------------------------------------------------------------------------------- worker side
def _saved_sizes(path: Path) -> dict[str, tuple[int, ...] | None]:
    """``{fqn: global size}`` of the tensors of the DCP checkpoint ``path`` (None for a non-tensor value)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    return {
        fqn: tuple(entry.size) if isinstance(entry, TensorStorageMetadata) else None for fqn, entry in metadata.items()
    }


def _grown_dims(fqn: str, old: tuple, new: tuple, vocab: set[tuple[int, int]]) -> None:
    """ValueError unless every dimension of the saved tensor ``fqn`` (``old``) equals the new one or is a
    vocabulary that grew (``(old, new)`` in ``vocab``)."""
    if len(old) != len(new) or any(o != n and (o, n) not in vocab for o, n in zip(old, new, strict=True)):
        raise ValueError(
            f"train.init_from: the checkpoint's {fqn} has shape {list(old)}, this run's {list(new)}: only the user "
            "and item dimensions may grow"
        )


def _clipped(tensor, old: tuple) -> tuple[Any, list[tuple[torch.Tensor, torch.Tensor]]]:
    """A target for DCP holding the part of ``tensor`` (a ShardedTensor or a plain tensor of this run) inside the
    saved global shape ``old``, and the ``(buffer, destination view)`` pairs to copy once DCP has filled it."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    if not isinstance(tensor, ShardedTensor):
        view = tensor[tuple(slice(0, size) for size in old)]
        buffer = torch.empty_like(view)
        return buffer, [(buffer, view)]
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor import Shard, init_from_local_shards

    shards, copies = [], []
    for shard in tensor.local_shards():
        offsets, sizes = shard.metadata.shard_offsets, shard.metadata.shard_sizes
        kept = [max(0, min(o + s, limit) - o) for o, s, limit in zip(offsets, sizes, old, strict=True)]
        if any(k == 0 for k in kept):
            continue  # rows this rank holds past the old vocabulary: they keep the fresh initialisation
        view = shard.tensor[tuple(slice(0, k) for k in kept)]
        buffer = torch.empty_like(view, memory_format=torch.contiguous_format)
        metadata = ShardMetadata(shard_offsets=list(offsets), shard_sizes=kept, placement=shard.metadata.placement)
        shards.append(Shard(buffer, metadata))
        copies.append((buffer, view))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        target = init_from_local_shards(shards, list(old), process_group=tensor._process_group)
    return target, copies


def load_grown(path: str | Path, parts: dict, vocabulary: dict[str, tuple[int, int]], group=None) -> dict:
    """Fill ``parts`` (the kind's checkpoint parts, freshly built) from the checkpoint ``path`` of a run on a smaller
    vocabulary: every saved tensor into its leading block (module docstring), non-tensor state left as built.
    ``vocabulary``: ``{"users": (old, new), "items": (old, new)}``. Collective; returns the ``trainer.json``."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    from bigrank.model.sharding import quiet_torchrec
    from bigrank.train.checkpoint import (
        _control_group,
        _dcp,
        check_checkpoint_checksums,
        check_checkpoint_sizes,
        read_trainer_state,
    )

    path = Path(path)
    meta = read_trainer_state(path)
    check_checkpoint_sizes(path, meta)
    check_checkpoint_checksums(path, meta, _control_group())
    saved = _saved_sizes(path)
    grows = {pair for pair in vocabulary.values() if pair[0] != pair[1]}
    state = {name: part.state_dict() for name, part in parts.items()}
    flat, _ = flatten_state_dict(state)
    targets, copies = {}, []
    for fqn, value in flat.items():
        old = saved.get(fqn)
        if old is None or not (torch.is_tensor(value) or isinstance(value, ShardedTensor)):
            continue  # not in the checkpoint, or not a tensor (schedules, positions): the new run's own
        new = tuple(value.size())
        if new == old:
            targets[fqn] = value
            continue
        _grown_dims(fqn, old, new, grows)
        targets[fqn], pairs = _clipped(value, old)
        copies.extend(pairs)
    with quiet_torchrec(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _dcp().load(targets, checkpoint_id=str(path))
    with torch.no_grad():
        for buffer, view in copies:
            view.copy_(buffer)
    for name, part in parts.items():
        part.load_state_dict(state[name])
    if dist.is_initialized():
        dist.barrier(group=group)
    return meta
