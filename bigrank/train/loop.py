"""The training worker: one function run by every process of an already initialised process group.

One step on rank r of W (global batch B, local batch B/W)::

    users, items  = the rank's next batch of (user, item) train pairs         ParquetStream, same steps on all ranks
    u_local       = tower(users)              [B/W, d]                         torchrec row-wise sharded user table
    U             = all_gather_rows(u_local)  [B, d]      (backward: reduce-scatter of dL/dU to the owners)
    target        = all-gathered items        [B]         global item ids
    loss          = L(U @ V_r^T, target; group, offset=start_r)               V_r: this rank's catalog rows
    loss.backward(); item_optimizer.step()                 the fused user-table optimizer updates in backward

The loss is the loss of the global batch, replicated on every rank; the catalog rows get exactly their
gradient of it, so no gradient all-reduce is needed. ``train_worker(config)`` holds no process-group setup:
the local launcher (``bigrank.train.launcher``) and Ray Train workers call it after ``init_process_group``.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from bigrank.atomic import write_text_atomic
from bigrank.config import Config, config_from_dict, save_config

__all__ = ["Model", "build_model", "evaluate_worker", "export_worker", "train_worker", "user_vectors"]


def as_config(config: Config | dict) -> Config:
    """A Config from a Config or its ``to_dict()`` (what Ray passes as ``train_loop_config``)."""
    return config if isinstance(config, Config) else config_from_dict(config)


def _require_process_group():
    if not dist.is_initialized():
        raise RuntimeError(
            "bigrank's workers need an initialised torch.distributed process group: start them with "
            "bigrank.train.launcher.launch_local (or Ray Train)"
        )
    group = dist.group.WORLD
    return group, dist.get_rank(group), dist.get_world_size(group)


# ------------------------------------------------------------------------------------------------- model
@dataclass
class Model:
    """The item-parallel model of one rank: the sharded user tower and the catalog shard."""

    tower: Any  # DistributedModelParallel around bigrank.model.towers.UserTower
    shard: Any  # bigrank.distributed.catalog.CatalogShard
    plan: Any
    num_users: int
    num_items: int
    history: tuple[np.ndarray, np.ndarray] | None  # (indptr, items) CSR of the train split, when used

    @property
    def user_module(self):
        return self.tower.module


def build_model(config: Config, group) -> Model:
    """Build the sharded user tower and this rank's catalog shard (collective)."""
    from bigrank.data.manifest import load_manifest
    from bigrank.distributed.catalog import CatalogShard
    from bigrank.model.sharding import shard_row_wise
    from bigrank.model.towers import UserTower

    manifest = load_manifest(config.data.root)
    num_users, num_items = int(manifest["num_users"]), int(manifest["num_items"])
    model_cfg = config.model
    tower = UserTower(
        num_users,
        model_cfg.dim,
        num_items=num_items if model_cfg.history else None,
        history=model_cfg.history,
        init_std=model_cfg.init_std,
        seed=config.seed,
        device="meta",
    )
    dmp, plan = shard_row_wise(
        tower, optimizer=config.optim.user_optimizer, lr=config.optim.user_lr, process_group=group
    )
    shard = CatalogShard(num_items, model_cfg.dim, group, init_std=model_cfg.item_init_std, seed=config.seed + 1)
    history = None
    if model_cfg.history:
        from bigrank.data.stream import read_user_items

        history = read_user_items(config.data.root, "train", num_users)
    return Model(dmp, shard, plan, num_users, num_items, history)


def _history_bags(history, user_ids: torch.Tensor, exclude: torch.Tensor | None):
    """``(values, lengths)`` of each user's train items, minus the row's own positive ``exclude`` (training:
    the bag must not contain the item being predicted). Unknown users (id < 0) get an empty bag."""
    indptr, items = history
    parts, lengths = [], []
    excluded = exclude.tolist() if exclude is not None else None
    for k, user in enumerate(user_ids.tolist()):
        row = items[indptr[user] : indptr[user + 1]] if user >= 0 else items[:0]
        if excluded is not None:
            row = row[row != excluded[k]]
        parts.append(row)
        lengths.append(len(row))
    values = np.concatenate(parts).astype(np.int64) if parts else np.empty(0, np.int64)
    return torch.from_numpy(values), torch.tensor(lengths, dtype=torch.int64)


def user_vectors(model: Model, user_ids: torch.Tensor, *, pad_to: int | None = None, exclude=None) -> torch.Tensor:
    """User vectors float32[len(user_ids), d] (collective: every rank calls it with the same ``pad_to``).

    ``exclude``: int64[b] item to leave out of each user's history bag (training); ids < 0 are unknown users.
    """
    history = None if model.history is None else _history_bags(model.history, user_ids, exclude)
    features = model.user_module.features(user_ids, history, pad_to=pad_to)
    return model.tower(features)[: user_ids.numel()]


def _user_vectors_fn(model: Model):
    """``user_vectors_fn(user_ids int64[b]) -> float[b, d]`` for evaluation (no grad; callers pad collectively)."""

    def fn(user_ids: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return user_vectors(model, torch.as_tensor(user_ids, dtype=torch.int64))

    return fn


def _item_optimizer(config: Config, params):
    optim = config.optim
    if optim.item_optimizer == "sgd":
        return torch.optim.SGD(params, lr=optim.item_lr, weight_decay=optim.weight_decay)
    if optim.item_optimizer == "adagrad":
        return torch.optim.Adagrad(params, lr=optim.item_lr, weight_decay=optim.weight_decay)
    return torch.optim.Adam(params, lr=optim.item_lr, weight_decay=optim.weight_decay)


def _item_counts(root: str, start: int, stop: int) -> torch.Tensor:
    """Train interactions of items ``[start, stop)`` (popularity sampler), read row group by row group."""
    from bigrank.data.stream import iter_row_groups

    counts = np.zeros(stop - start, dtype=np.int64)
    for group in iter_row_groups(root, "train", columns=("item_id",)):
        items = group["item_id"].astype(np.int64)
        items = items[(items >= start) & (items < stop)] - start
        counts += np.bincount(items, minlength=stop - start)
    return torch.from_numpy(counts)


def _model_identity(config: Config, model: Model) -> dict[str, Any]:
    """The settings a checkpoint's tensors depend on (a resume with other values cannot load them)."""
    return {
        "model.dim": config.model.dim,
        "model.history": config.model.history,
        "dataset users": model.num_users,
        "dataset items": model.num_items,
        "optim.user_optimizer": config.optim.user_optimizer,
        "optim.item_optimizer": config.optim.item_optimizer,
    }


def _load_training_state(model: Model, config: Config, item_optimizer, path, group, world_size):
    from bigrank.train.checkpoint import load_checkpoint, read_trainer_state

    saved = read_trainer_state(path).get("model")
    expected = _model_identity(config, model)
    if saved is not None and saved != expected:
        changed = sorted(key for key in expected if saved.get(key) != expected[key])
        raise ValueError(
            f"{path} is a checkpoint of another model ({', '.join(changed)} differ from this config): "
            "use a new run_dir, or restore those settings to resume"
        )
    trainer_state, rank_state = load_checkpoint(path, tower=model.tower, world_size=world_size, group=group)
    shard = model.shard
    if (rank_state["start"], rank_state["stop"]) != (shard.start, shard.stop):
        raise ValueError(f"checkpoint {path} holds catalog rows {rank_state['start']}…, not [{shard.start}, …)")
    with torch.no_grad():
        shard.weight.copy_(rank_state["catalog"])
    item_optimizer.load_state_dict(rank_state["item_optimizer"])
    return trainer_state, rank_state


# ------------------------------------------------------------------------------------------- run records
class RunLog:
    """Rank 0's records: ``metrics.jsonl`` (one JSON object per line) and TensorBoard events."""

    def __init__(self, run_dir: Path, enabled: bool, resume_step: int):
        self.enabled = enabled
        self.path = run_dir / "metrics.jsonl"
        self.writer = None
        if not enabled:
            return
        if self.path.exists():  # a resumed run: drop what was logged after the checkpoint it resumes from
            kept = [line for line in self.path.read_text().splitlines() if _step_of(line) <= resume_step]
            write_text_atomic(self.path, "".join(line + "\n" for line in kept))
        try:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(str(run_dir / "tensorboard"), purge_step=resume_step or None)
        except ImportError:  # tensorboard is optional
            self.writer = None

    def write(self, record: dict[str, Any], prefix: str) -> None:
        if not self.enabled:
            return
        with open(self.path, "a") as handle:
            handle.write(json.dumps(record) + "\n")
        if self.writer is not None:
            for key, value in record.items():
                if key not in ("step", "epoch", "type", "split") and isinstance(value, int | float):
                    self.writer.add_scalar(f"{prefix}/{key}", value, record["step"])
            self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def _step_of(line: str) -> int:
    try:
        return int(json.loads(line).get("step", 0))
    except (ValueError, AttributeError):
        return 0


def _evaluation_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("bigrank.train.evaluate") is not None


def _evaluate(model: Model, config: Config, split: str, group, sample_users) -> dict | None:
    """Distributed full-catalog evaluation of ``split`` (None when bigrank.train.evaluate is not installed)."""
    if not _evaluation_available():
        return None
    from bigrank.train.evaluate import evaluate_model

    return evaluate_model(
        _user_vectors_fn(model),
        model.shard,
        config.data.root,
        split,
        list(config.eval.ks),
        group=group,
        sample_users=sample_users,
        seed=config.seed,
        batch_size=config.eval.batch_size,
    )


def _write_eval_json(run_dir: Path, results: dict[str, dict]) -> None:
    """``RUN_DIR/eval.json`` with one section per split (bigrank.train.evaluate's writer: NaN → null)."""
    from bigrank.train.evaluate import write_eval_json

    write_eval_json(run_dir, results)


def _fail_once(config: Config, run_dir: Path, step: int, rank: int) -> None:
    """Test switch ``debug.fail_at_step``: rank ``fail_rank`` dies (no clean-up) the first time it reaches the step."""
    debug = config.debug
    if debug.fail_at_step != step or rank != debug.fail_rank:
        return
    marker = run_dir / f".debug-failed-at-{step}"
    if marker.exists():
        return
    marker.write_text(f"rank {rank} exited on purpose at step {step}\n")
    os._exit(17)


# --------------------------------------------------------------------------------------------- training
def train_worker(config: Config | dict) -> dict[str, Any]:
    """Train (or resume) the run of ``config`` in this process; every rank of the group calls it.

    Needs ``torch.distributed`` initialised (gloo on CPU, nccl on GPU) with ``config.workers`` ranks or any
    number dividing ``train.batch_size`` (the checkpoint then needs that same number to resume). Resumes from
    the newest complete checkpoint of ``run_dir``. Returns a summary (same on every rank): steps, epochs,
    first/last loss, examples/s, the final checkpoint and the evaluation results.
    Raises FloatingPointError when the loss is NaN/inf (naming the step and the last good checkpoint).
    """
    from tqdm import tqdm

    from bigrank.data.stream import ParquetStream
    from bigrank.distributed.collectives import all_gather_no_grad, all_gather_rows
    from bigrank.model.sharding import format_plan, silence_torchrec_step_warnings, write_plan
    from bigrank.train.checkpoint import latest_checkpoint, remove_partial_checkpoints, save_checkpoint
    from bigrank.train.losses import StepLoss

    config = as_config(config)
    group, rank, world_size = _require_process_group()
    silence_torchrec_step_warnings()
    train_cfg = config.train
    if train_cfg.batch_size % world_size:
        raise ValueError(f"train.batch_size={train_cfg.batch_size} is not divisible by the {world_size} workers")
    run_dir = Path(config.run_dir)
    if rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        save_config(config, run_dir / "config.yaml")
        remove_partial_checkpoints(run_dir)
    dist.barrier(group)
    torch.manual_seed(config.seed * 1_000 + rank)

    model = build_model(config, group)
    if rank == 0:
        plan_text = format_plan(model.plan)
        print(f"sharding plan ({world_size} workers):\n{plan_text}", flush=True)
        (run_dir / "plan.txt").write_text(plan_text + "\n")
        write_plan(model.plan, run_dir / "plan.json")
    local_batch = train_cfg.batch_size // world_size
    stream = ParquetStream(
        config.data.root,
        "train",
        local_batch,
        rank=rank,
        world_size=world_size,
        seed=config.seed,
        shuffle_buffer=config.data.shuffle_buffer,
        drop_last=train_cfg.drop_last,
        prefetch=config.data.prefetch,
    )
    steps_per_epoch = stream.steps_per_epoch()
    if steps_per_epoch < 1:
        raise ValueError(f"train split too small: no full step of {train_cfg.batch_size} rows (train.batch_size)")
    total_steps = train_cfg.epochs * steps_per_epoch
    if train_cfg.max_steps is not None:
        total_steps = min(total_steps, train_cfg.max_steps)
    shard = model.shard
    item_optimizer = _item_optimizer(config, [shard.weight])
    counts = None
    if config.loss.sampler == "popularity" and config.loss.candidates == "sampled":
        counts = _item_counts(config.data.root, shard.start, shard.stop)
    step_loss = StepLoss(
        config.loss,
        num_items=model.num_items,
        shard_start=shard.start,
        shard_stop=shard.stop,
        item_counts=counts,
        seed=config.seed,
        rank=rank,
    )

    # >>> tune: lr schedule + user L2 (bigrank.train.schedule / regularization)
    from bigrank.train.regularization import user_l2_penalty
    from bigrank.train.schedule import LearningRateSchedule

    lr_schedule = LearningRateSchedule.from_config(config.optim, total_steps)
    lr_factor = 1.0
    # <<< tune
    step, last_checkpoint, first_loss = 0, None, None
    resume_from = latest_checkpoint(run_dir)
    if resume_from is not None:
        trainer_state, rank_state = _load_training_state(model, config, item_optimizer, resume_from, group, world_size)
        stream.load_state_dict(rank_state["stream"])
        step_loss.load_state_dict(trainer_state.get("loss", {}))
        torch.set_rng_state(rank_state["rng"])
        step, last_checkpoint = int(trainer_state["step"]), resume_from
        first_loss = trainer_state.get("first_loss")
        if rank == 0:
            print(f"resuming from {resume_from} (step {step})", flush=True)

    log = RunLog(run_dir, rank == 0, step)
    progress = tqdm(
        total=total_steps,
        initial=step,
        disable=rank != 0 or not train_cfg.progress,
        desc="train",
        unit="step",
        mininterval=0.1 if sys.stderr.isatty() else 30.0,  # logs (Ray, files) get a line every 30 s
    )
    # Throughput counts the time of the steps (data wait included), not evaluation or checkpoint writes.
    window_loss, window_steps, window_seconds = 0.0, 0, 0.0
    examples, train_seconds, last_loss = 0, 0.0, None
    eval_history: list[dict] = []

    def checkpoint_now() -> Path:
        rank_state = {
            "start": shard.start,
            "stop": shard.stop,
            "catalog": shard.weight.detach().clone(),
            "item_optimizer": item_optimizer.state_dict(),
            "stream": stream.state_dict(),
            "rng": torch.get_rng_state(),
        }
        trainer_state = {
            "epoch": step // steps_per_epoch,
            "world_size": world_size,
            "num_items": model.num_items,
            "num_users": model.num_users,
            "loss": step_loss.state_dict(),
            "model": _model_identity(config, model),
            "last_loss": last_loss,
            "first_loss": first_loss,
        }
        return save_checkpoint(
            run_dir,
            step,
            tower=model.tower,
            rank_state=rank_state,
            trainer_state=trainer_state,
            keep=train_cfg.keep_checkpoints,
            group=group,
        )

    tick = time.perf_counter()
    try:
        while step < total_steps:
            stream.set_epoch(step // steps_per_epoch)
            for batch in stream:
                _fail_once(config, run_dir, step + 1, rank)
                # >>> tune: the rates of this step's updates, set before the forward pass: fbgemm's fused user
                # update (inside backward) uses the rate its lookup saw in forward
                if not lr_schedule.constant:
                    lr_factor = lr_schedule.apply(
                        step, item_optimizer, config.optim.item_lr, model.tower, config.optim.user_lr
                    )
                # <<< tune
                users, items = batch["user_id"], batch["item_id"]
                local_vectors = user_vectors(model, users, pad_to=local_batch, exclude=items)
                global_vectors = all_gather_rows(local_vectors, group)
                target = all_gather_no_grad(items, group)
                loss = step_loss(
                    global_vectors,
                    target,
                    shard.weight,
                    group=group,
                    chunk_size=train_cfg.chunk_size,
                    step=step,
                )
                if config.debug.nan_at_step == step + 1:
                    loss = loss * float("nan")
                value = float(loss.detach())
                if not math.isfinite(value):
                    where = f"the last good checkpoint is {last_checkpoint}" if last_checkpoint else "no checkpoint yet"
                    raise FloatingPointError(
                        f"loss is {value} at step {step + 1} (epoch {step // steps_per_epoch}); {where}. "
                        "Lower optim.item_lr / optim.user_lr or check the data; the run stopped before updating."
                    )
                item_optimizer.zero_grad(set_to_none=True)
                # >>> tune: the user L2 term
                penalty = user_l2_penalty(local_vectors, train_cfg.batch_size, config.optim.user_l2)
                if penalty is not None:
                    loss = loss + penalty
                # <<< tune
                loss.backward()
                item_optimizer.step()
                step_loss.after_step()
                step += 1
                rows = int(target.numel())
                examples += rows
                step_seconds = time.perf_counter() - tick
                train_seconds += step_seconds
                window_seconds += step_seconds
                first_loss = value if first_loss is None else first_loss
                last_loss = value
                window_loss += value
                window_steps += 1
                if step % train_cfg.log_every == 0 or step == total_steps:
                    record = {
                        "type": "train",
                        "step": step,
                        "epoch": step / steps_per_epoch,
                        "loss": window_loss / window_steps,
                        "examples_per_s": window_steps * train_cfg.batch_size / max(window_seconds, 1e-9),
                        "lr": config.optim.item_lr * lr_factor,  # tune: scheduled rates
                        "user_lr": config.optim.user_lr * lr_factor,
                    }
                    if step_loss.temperature is not None:
                        record["temperature"] = step_loss.temperature
                    log.write(record, "train")
                    progress.set_postfix(loss=f"{record['loss']:.4f}", ex_s=f"{record['examples_per_s']:.0f}")
                    window_loss, window_steps, window_seconds = 0.0, 0, 0.0
                progress.update(1)
                epoch_end = step % steps_per_epoch == 0
                every = config.eval.every_epochs
                if epoch_end and every and (step // steps_per_epoch) % every == 0 and step < total_steps:
                    split = config.eval.splits[0]
                    results = _evaluate(model, config, split, group, config.eval.sample_users)
                    if results is not None:
                        record = {"type": "eval", "split": split, "step": step, "epoch": step // steps_per_epoch}
                        record.update(results)
                        log.write(record, f"eval_{split}")
                        eval_history.append(record)
                every_ckpt = train_cfg.checkpoint_every
                if (every_ckpt and step % every_ckpt == 0) or epoch_end or step == total_steps:
                    last_checkpoint = checkpoint_now()
                if step >= total_steps:
                    break
                tick = time.perf_counter()
        if last_checkpoint is None or not str(last_checkpoint).endswith(f"{step:08d}"):
            last_checkpoint = checkpoint_now()
    finally:
        progress.close()

    final_eval: dict[str, dict] = {}
    if config.eval.at_end and (examples or not (run_dir / "eval.json").exists()):
        for split in config.eval.splits:
            results = _evaluate(model, config, split, group, config.eval.sample_users)
            if results is None:
                break
            final_eval[split] = dict(results, step=step, epoch=step / steps_per_epoch)
            log.write(
                {"type": "eval", "split": split, "step": step, "epoch": step / steps_per_epoch, **results},
                f"eval_{split}",
            )
        if final_eval and rank == 0:
            _write_eval_json(run_dir, final_eval)
    log.close()
    dist.barrier(group)
    return {
        "run_dir": str(run_dir),
        "steps": step,
        "steps_per_epoch": steps_per_epoch,
        "epochs": step / steps_per_epoch,
        "world_size": world_size,
        "first_loss": first_loss,
        "last_loss": last_loss,
        "examples": examples,
        "examples_per_s": examples / train_seconds if train_seconds else None,
        "train_seconds": train_seconds,
        "checkpoint": str(last_checkpoint) if last_checkpoint else None,
        "resumed_from": str(resume_from) if resume_from else None,
        "eval": final_eval or None,
        "eval_history": eval_history,
        "eval_available": _evaluation_available(),
    }


# --------------------------------------------------------------------------------- evaluate and export
def _load_for_inference(config: Config, checkpoint: str | None):
    from bigrank.model.sharding import silence_torchrec_step_warnings
    from bigrank.train.checkpoint import latest_checkpoint, load_weights_only

    group, rank, world_size = _require_process_group()
    silence_torchrec_step_warnings()
    path = Path(checkpoint) if checkpoint else latest_checkpoint(config.run_dir)
    if path is None:
        raise FileNotFoundError(f"no complete checkpoint in {Path(config.run_dir) / 'checkpoints'}")
    model = build_model(config, group)
    shard = model.shard
    trainer_state, rows = load_weights_only(path, tower=model.tower, row_start=shard.start, row_stop=shard.stop)
    if shard.num_local:
        with torch.no_grad():
            shard.weight.copy_(rows)
    return model, trainer_state, path, group, rank, world_size


def evaluate_worker(
    config: Config | dict, checkpoint: str | None = None, splits: list[str] | None = None, sample_users=None
) -> dict[str, Any]:
    """Evaluate a checkpoint (default: the newest) on ``splits`` (default ``eval.splits``); rank 0 writes
    ``RUN_DIR/eval.json`` with one section per split. Collective. Returns the sections."""
    config = as_config(config)
    if not _evaluation_available():
        raise RuntimeError("bigrank.train.evaluate is not available yet: evaluation cannot run")
    model, trainer_state, path, group, rank, _ = _load_for_inference(config, checkpoint)
    step = int(trainer_state["step"])
    sample = config.eval.sample_users if sample_users is None else sample_users
    results = {}
    for split in splits or config.eval.splits:
        values = _evaluate(model, config, split, group, sample)
        results[split] = dict(values, step=step, epoch=trainer_state.get("epoch"), checkpoint=str(path))
    if rank == 0:
        _write_eval_json(Path(config.run_dir), results)
    dist.barrier(group)
    return results


def export_worker(
    config: Config | dict,
    out_dir: str,
    checkpoint: str | None = None,
    index: tuple[str, ...] = (),
    quantize: tuple[str, ...] = (),
) -> dict[str, Any]:
    """Write the user (and history) and item embeddings of a checkpoint (default: the newest) with
    ``bigrank.export.writer.export_embeddings``, each rank its own rows. Collective; returns the export
    manifest (rank 0) or None."""
    import importlib.util

    from bigrank.model.sharding import local_table_rows, local_user_rows
    from bigrank.model.towers import HISTORY_TABLE

    config = as_config(config)
    if importlib.util.find_spec("bigrank.export.writer") is None:
        raise RuntimeError("bigrank.export is not available yet: export cannot run")
    from bigrank.export.writer import export_embeddings

    model, trainer_state, path, group, rank, world_size = _load_for_inference(config, checkpoint)
    user_start, user_stop, user_rows = local_user_rows(model.user_module)
    history_rows = None
    if config.model.history:
        start, stop, rows = local_table_rows(model.user_module, HISTORY_TABLE)
        history_rows = (start, stop, rows.detach().clone())
    shard = model.shard
    info = {
        "run_dir": config.run_dir,
        "checkpoint": str(path),
        "step": int(trainer_state["step"]),
        "dim": config.model.dim,
        "loss": config.loss.name,
        "has_history": config.model.history,
        "num_users": model.num_users,
        "num_items": model.num_items,
    }
    manifest = export_embeddings(
        out_dir,
        rank=rank,
        world_size=world_size,
        group=group,
        item_rows=(shard.start, shard.stop, shard.weight.detach().clone()),
        user_rows=(user_start, user_stop, user_rows.detach().clone()),
        dataset_root=config.data.root,
        model_info=info,
        quantize=tuple(quantize),
        history_rows=history_rows,
        index=tuple(index),
    )
    dist.barrier(group)
    return {"out": str(out_dir), "checkpoint": str(path), "manifest": manifest}
