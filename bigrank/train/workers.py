"""The functions every rank runs, after the launcher (local processes or Ray Train) set up the process group:
``train_worker`` (a :class:`~bigrank.train.trainer.Trainer`), ``evaluate_worker`` and ``export_worker`` (load a
checkpoint on any number of workers: the checkpoint reshards through DCP). Each starts with the worker
bootstrap (``bigrank.train.bootstrap.start_worker``: device, seed, control group).

Each takes the dataset's :class:`~bigrank.data.manifest.DatasetManifest` when its caller has read it (the run
layer's pre-flight, sent to the local workers); without it the worker reads it once, here, and passes it down
to the model, the stream, evaluation and export."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch.distributed as dist

from bigrank.config import Config
from bigrank.data.manifest import DatasetManifest, dataset_manifest
from bigrank.model.registry import model_spec
from bigrank.train.bootstrap import require_process_group, start_worker
from bigrank.train.checkpoint import Checkpointer, latest_checkpoint
from bigrank.train.evaluate import write_eval_json
from bigrank.train.evaluator import Evaluator, RankingModel
from bigrank.train.trainer import Trainer, as_config

__all__ = ["evaluate_worker", "export_worker", "load_trained_model", "train_worker"]


def train_worker(config: Config | dict, manifest: DatasetManifest | None = None) -> dict[str, Any]:
    """Train (or resume) the run of ``config`` in this process (every rank calls it); returns the summary
    (same on every rank): steps, epochs, first/last loss, examples/s, the final checkpoint, the evaluation.
    Raises FloatingPointError when the loss is NaN/inf (naming the step and the last good checkpoint)."""
    return Trainer(as_config(config), manifest).train()


def load_trained_model(
    config: Config, checkpoint: str | None = None, manifest: DatasetManifest | None = None
) -> tuple[RankingModel, dict, Path]:
    """The model of a checkpoint (default: the run's newest) on this process group, any worker count
    (collective), for the dataset of ``manifest`` (default: read from ``data.root``). Returns ``(model,
    trainer.json of the checkpoint, its path)``; the model is the kind's (``bigrank.train.kind.ModelKind.load``)."""
    worker = start_worker(config)  # device, seed, control group, allocator (bigrank.train.bootstrap)
    path = Path(checkpoint) if checkpoint else latest_checkpoint(config.run_dir)
    if path is None:
        raise FileNotFoundError(f"no complete checkpoint in {Path(config.run_dir) / 'checkpoints'}")
    manifest = dataset_manifest(config.data.root, manifest)
    kind = model_spec(config.model.kind).kind
    model, parts = kind.load(config, worker, manifest)
    checkpointer = Checkpointer(config.run_dir, parts, every=None, keep=1, identity=kind.identity(config, model))
    meta = checkpointer.load(path, parts)
    return model, meta, path


def evaluate_worker(
    config: Config | dict,
    checkpoint: str | None = None,
    splits: list[str] | None = None,
    sample_users=None,
    manifest: DatasetManifest | None = None,
    use_index: bool = True,
) -> dict[str, Any]:
    """Evaluate a checkpoint (default: the newest) on ``splits`` (default ``eval.splits``); rank 0 writes
    ``RUN_DIR/eval.json`` with one section per split. Collective. Returns the sections. ``use_index``: read the
    users' items from the dataset's user indexes where they exist (``bigrank.train.evaluate.evaluation_data``)."""
    config = as_config(config)
    manifest = dataset_manifest(config.data.root, manifest)
    model, meta, path = load_trained_model(config, checkpoint, manifest)
    group, rank, _ = require_process_group()
    evaluator = Evaluator(config, model, group, manifest, use_index=use_index)
    sample = config.eval.sample_users if sample_users is None else sample_users
    results = {}
    for split in splits or config.eval.splits:
        values = evaluator.evaluate(split, sample)
        results[split] = dict(values, step=int(meta["step"]), epoch=meta.get("epoch"), checkpoint=str(path))
    if rank == 0:
        write_eval_json(Path(config.run_dir), results)
    dist.barrier(group)
    return results


def export_worker(
    config: Config | dict,
    out_dir: str,
    checkpoint: str | None = None,
    index: tuple[str, ...] = (),
    quantize: tuple[str, ...] = (),
    seen: bool = True,
    manifest: DatasetManifest | None = None,
) -> dict[str, Any]:
    """Write the user (and history) and item embeddings of a checkpoint (default: the newest) with
    ``bigrank.export.writer.export_embeddings``, each rank its own rows (``seen``: also the seen-items
    table). Collective; returns the export manifest (rank 0) or None."""
    from bigrank.export.writer import export_embeddings

    config = as_config(config)
    manifest = dataset_manifest(config.data.root, manifest)
    model, meta, path = load_trained_model(config, checkpoint, manifest)
    group, rank, world_size = require_process_group()
    info = {
        "run_dir": config.run_dir,
        "checkpoint": str(path),
        "step": int(meta["step"]),
        "dim": config.model.dim,
        "loss": config.loss.name,
        "has_history": config.model.history,
        "num_users": model.num_users,
        "num_items": model.num_items,
    }
    rows = model_spec(config.model.kind).kind.export_rows(model, rank, world_size)
    info.update(rows.info)  # what the kind's vectors are, where they differ from the defaults
    manifest = export_embeddings(
        out_dir,
        rank=rank,
        world_size=world_size,
        group=group,
        item_rows=rows.items,
        user_rows=rows.users,
        dataset_root=manifest,
        model_info=info,
        quantize=tuple(quantize),
        history_rows=rows.history,
        index=tuple(index),
        seen=seen,
    )
    dist.barrier(group)
    return {"out": str(out_dir), "checkpoint": str(path), "manifest": manifest}
