"""The Trainer: every rank of an initialised process group runs ``Trainer(config).train()``.

One step on rank r of W (global batch B, local batch b = B/W)::

    users, items  = the rank's next batch of (user, item) train pairs         ParquetStream, same steps on all ranks
    u_local       = tower(users)              [b, d]                           torchrec row-wise sharded user table
    U, target     = all_gather_rows_with_ids(u_local, items)   [B, d], int64[B]   one all-gather
                                                           (backward: reduce-scatter of dL/dU to the owners)
    loss          = L(U @ V_r^T, target; group, offset=start_r)               V_r: this rank's catalog rows
    loss.backward(); item_optimizer.step_rows(touched rows) | step_dense()   the fused user-table optimizer
                                                           updates in backward

The loss is the loss of the global batch, replicated on every rank; the catalog rows get exactly their
gradient of it, so no gradient all-reduce is needed.

The trainer's parts each do one job: the stream (data position), the model (tower + catalog shard), the item
optimizer, the step loss, the :class:`~bigrank.train.checkpoint.Checkpointer` (when to save; every stateful
part registered once and saved/loaded generically through DCP, so a run resumes on any worker count), the
:class:`~bigrank.train.evaluator.Evaluator` (when to evaluate; each split's data read once) and the
:class:`RunLog` (``metrics.jsonl`` + TensorBoard). Process-group setup is the launcher's job (the local
launcher, Ray Train); the rank's device, seed and control group are the worker bootstrap's
(``bigrank.train.bootstrap.start_worker``).
"""

from __future__ import annotations

import math
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from bigrank.atomic import write_text_atomic
from bigrank.config import Config, config_from_dict, save_config
from bigrank.data.manifest import DatasetManifest, dataset_manifest
from bigrank.data.stream import ParquetStream
from bigrank.devices import setup_precision
from bigrank.distributed.collectives import all_gather_replicated, all_gather_rows_with_ids, all_reduce_no_grad
from bigrank.losses.scores import replicated_inputs
from bigrank.records import (
    EVAL,
    PLAN_JSON,
    PLAN_TEXT,
    EvalRecord,
    TrainRecord,
    append_record,
    truncate_metrics,
    write_eval_json,
)
from bigrank.signals import Stopped, signal_name, step_boundaries
from bigrank.train.bootstrap import start_worker
from bigrank.train.checkpoint import Checkpointer, latest_checkpoint, model_identity, remove_partial_checkpoints
from bigrank.train.evaluator import Evaluator
from bigrank.train.item_optim import catalog_optimizer
from bigrank.train.losses import StepLoss
from bigrank.train.model import build_model, history_generator, user_vectors
from bigrank.train.regularization import user_l2_penalty
from bigrank.train.replicas import ReplicaSync
from bigrank.train.schedule import LearningRateSchedule
from bigrank.train.state import CatalogState, LossState, RNGState, StreamState, TowerState, TrainState

__all__ = ["RunLog", "Trainer", "as_config"]

# The sharded step's stop flag travels in the all-gathered item ids: bit 62 of a rank's ids (an item id is < 2**31,
# the padding -1) says that this rank has a stop request, so every rank reads every rank's request in the one
# collective the step makes anyway, at no extra byte.
_STOP_BIT = 1 << 62


def as_config(config: Config | dict) -> Config:
    """A Config from a Config or its ``to_dict()`` (what Ray passes as ``train_loop_config``)."""
    return config if isinstance(config, Config) else config_from_dict(config)


# ------------------------------------------------------------------------------------------- run records
class RunLog:
    """Rank 0's records: ``metrics.jsonl`` (``bigrank.records``) and TensorBoard events."""

    def __init__(self, run_dir: Path, enabled: bool, resume_step: int):
        self.enabled = enabled
        self.run_dir = run_dir
        self.writer = None
        if not enabled:
            return
        # A resumed run: drop what was logged after the checkpoint it resumes from (and a line cut short).
        truncate_metrics(run_dir, resume_step)
        try:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(str(run_dir / "tensorboard"), purge_step=resume_step or None)
        except ImportError:  # tensorboard is optional
            self.writer = None

    def write(self, record: TrainRecord | EvalRecord, prefix: str) -> None:
        if not self.enabled:
            return
        append_record(self.run_dir, record)
        if self.writer is not None:
            for key, value in record.to_json().items():
                if key not in ("step", "epoch", "type", "split") and isinstance(value, int | float):
                    self.writer.add_scalar(f"{prefix}/{key}", value, record.step)
            self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


class _Window:
    """Loss and throughput over the steps since the last log record (time of steps only, data wait included):
    the rows (training examples) the steps took, whatever a step's batch is made of (rows or users)."""

    def __init__(self):
        self.loss, self.steps, self.seconds, self.rows = 0.0, 0, 0.0, 0

    def add(self, loss: float, seconds: float, rows: int) -> None:
        self.loss, self.steps, self.seconds = self.loss + loss, self.steps + 1, self.seconds + seconds
        self.rows += rows


# ---------------------------------------------------------------------------------------------- trainer
class Trainer:
    """Train (or resume) the run of ``config`` in this process; every rank of the group builds one.

    Needs ``torch.distributed`` initialised (gloo on CPU) with any number of ranks dividing
    ``train.batch_size``; resumes from the newest complete checkpoint of ``run_dir``, whatever worker count
    wrote it (the data position is re-split as ``bigrank.data.stream`` documents). ``manifest``: the dataset's
    :class:`~bigrank.data.manifest.DatasetManifest` when the caller has read it (default: read here, once); the
    model, the stream, the item counts and the evaluator all take it from here.
    """

    # A stop request (bigrank.signals.step_boundaries) while train() runs, and whether this step's collective
    # carried one from any rank: then every rank stops after this step.
    stop_request = None
    stopping = False

    def __init__(self, config: Config | dict, manifest: DatasetManifest | None = None):
        from bigrank.model.sharding import format_plan, write_plan

        self._start_run(config, manifest)
        config, manifest, train_cfg = self.config, self.manifest, self.config.train
        self.model = model = build_model(config, self.group, self.manifest, self.device)
        if self.rank == 0:
            print(f"training on {self.device} ({self.world_size} workers, precision {self.precision.name})", flush=True)
            plan_text = f"precision {self.precision.describe()}\n{model.layout_plan}\n\n{format_plan(model.plan)}"
            print(f"sharding plan ({self.world_size} workers):\n{plan_text}", flush=True)
            write_plan(model.plan, self.run_dir / PLAN_JSON)
            write_text_atomic(self.run_dir / PLAN_TEXT, plan_text + "\n")
        self.local_batch = train_cfg.batch_size // self.world_size
        self.stream = ParquetStream(
            manifest,
            "train",
            self.local_batch,
            rank=self.rank,
            world_size=self.world_size,
            seed=config.seed,
            shuffle_buffer=config.data.shuffle_buffer,
            drop_last=train_cfg.drop_last,
            prefetch=config.data.prefetch,
        )
        steps_per_epoch = self.stream.steps_per_epoch()
        if steps_per_epoch < 1:
            raise ValueError(f"train split too small: no full step of {train_cfg.batch_size} rows (train.batch_size)")
        shard = model.shard
        optim = config.optim
        by_popularity = config.loss.sampler == "popularity" and config.loss.candidates == "sampled"
        self.item_optimizer = catalog_optimizer(shard.weight, optim)
        self.step_loss = StepLoss(
            config.loss,
            num_items=model.num_items,
            shard_start=shard.start,
            shard_stop=shard.stop,
            item_counts=_item_counts(manifest, shard.start, shard.stop) if by_popularity else None,
            seed=config.seed,
            rank=self.rank,
            score_dtype=self.precision.score_dtype,
        )
        # A loss whose k follows each row's label set (rankmax, loss.params.k_fraction) reads every user's
        # number of train items: int64[num_users], 8 bytes a user.
        self.user_positives = None
        if self.step_loss.needs_positives:
            self.user_positives = _user_counts(manifest, model.num_users)
        self.replicas = ReplicaSync(
            model,
            self.item_optimizer,
            optim.user_optimizer,
            optim.user_lr,
            self.group,
            full_catalog=config.loss.candidates != "sampled",
            max_touched_rows=self.local_batch + self.step_loss.num_samples,
        )
        self.state = TrainState()
        self.lr_schedule = LearningRateSchedule.for_run(config, steps_per_epoch)
        self.lr_factor = 1.0
        self.checkpointer = Checkpointer(
            self.run_dir,
            {
                "tower": TowerState(
                    model.tower,
                    {t: (p, self.replicas.tower_optimizers[t]) for t, p in model.replicated_tower.items()},
                    self.group,
                ),
                "catalog": CatalogState(shard, self.item_optimizer),
                "stream": StreamState(self.stream),
                "loss": LossState(self.step_loss),
                "train": self.state,
            },
            rank_parts={"rng": RNGState()},
            every=train_cfg.checkpoint_every,
            keep=train_cfg.keep_checkpoints,
            identity=model_identity(config, model),
            group=self.group,
        )
        self.evaluator = Evaluator(config, model, self.group, manifest)
        self.eval_history: list[dict] = []

    def _start_run(self, config: Config | dict, manifest: DatasetManifest | None) -> None:
        """What every kind of model's trainer starts with: the worker (process group, device, seed), the
        precision, the run directory (config saved, partial checkpoints removed) and the dataset's manifest."""
        self.config = config = as_config(config)
        worker = start_worker(config)  # process group, device, seed (bigrank.train.bootstrap)
        self.group, self.rank, self.world_size, self.device = (
            worker.group,
            worker.rank,
            worker.world_size,
            worker.device,
        )
        self.control_group = worker.control_group  # CPU-side control traffic (the dataset check)
        self.precision = setup_precision(config.train.precision, self.device)  # how this device scores
        train_cfg = config.train
        if train_cfg.batch_size % self.world_size:
            raise ValueError(
                f"train.batch_size={train_cfg.batch_size} is not divisible by the {self.world_size} workers"
            )
        self.run_dir = Path(config.run_dir)
        if self.rank == 0:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            save_config(config, self.run_dir / "config.yaml")
            remove_partial_checkpoints(self.run_dir)
        dist.barrier(self.group)

        # The dataset's manifest, read once in this process (or by the run's pre-flight) and passed down.
        self.manifest = dataset_manifest(config.data.root, manifest)
        self._check_dataset()

    def _check_dataset(self) -> None:
        """Before anything reads the data (the model's history bags, item counts, the stream): the files of the
        splits the run reads against the manifest, sizes and footers, then with ``data.verify: full`` (default)
        their CRC-32s, each rank a disjoint share (collective; every rank raises the same CorruptFileError). A
        flipped byte in a row group the stream reaches late in an epoch then stops the run before its first step,
        not after hours of steps (and, without page checksums, never)."""
        config = self.config
        splits = ["train"]
        if config.eval.every_epochs:
            splits.append(config.eval.splits[0])
        if config.eval.at_end:
            splits.extend(config.eval.splits)
        splits = [split for split in dict.fromkeys(splits) if split in self.manifest.splits]
        self.manifest.validate(splits)  # sizes, footers: once per process, the readers skip it then
        if config.data.verify != "full":
            return
        started = time.perf_counter()
        progress = (lambda line: print(line, flush=True)) if self.rank == 0 else None
        files, size = self.manifest.check_checksums(splits, self.control_group, progress=progress)
        if self.rank != 0:
            return
        if files == 0:
            root = self.manifest.root
            line = f"dataset {root} records no checksums (an older bigrank wrote it): sizes and footers checked"
        else:
            seconds = time.perf_counter() - started
            plural = "s" if files != 1 else ""
            line = (
                f"dataset checksums: {files} file{plural} of {', '.join(splits)}, {size / 1e6:,.1f} MB, match the "
                f"manifest ({seconds:.1f} s, {self.world_size} workers; data.verify: quick skips this)"
            )
        print(line, flush=True)

    # ----- the loop -----
    def train(self) -> dict[str, Any]:
        """Train until ``train.epochs`` epochs (or ``train.max_steps`` steps) are done; returns the summary."""
        resumed_from = self.resume()
        self.log = RunLog(self.run_dir, self.rank == 0, self.state.step)
        progress = self._progress_bar()
        window, examples, train_seconds = _Window(), 0, 0.0
        tick = time.perf_counter()
        # SIGINT/SIGTERM wait for a step boundary (local workers); the ranks agree on it in train_step.
        with step_boundaries() as self.stop_request:
            try:
                while not self.finished():
                    epoch = self.stream.epoch
                    for batch in self.stream:
                        loss, rows = self.train_step(batch)
                        seconds = time.perf_counter() - tick
                        window.add(loss, seconds, rows)
                        examples, train_seconds = examples + rows, train_seconds + seconds
                        epoch_end, last = self.stream.epoch != epoch, self.finished()
                        if self.state.step % self.config.train.log_every == 0 or last:
                            self._log_train(window, progress)
                            window = _Window()
                        progress.update(1)
                        if self.stopping:  # every rank at the same step
                            self._stop_at_boundary()
                        # The checkpoint first: a stop that comes during a long evaluation (the launchers give
                        # the workers 10 s) then loses the evaluation only, never the steps before it.
                        if self.checkpointer.due(self.state.step, epoch_end=epoch_end, last=last):
                            self.save_checkpoint()
                        if self.evaluator.due(self.stream.epoch, epoch_end=epoch_end, last=last):
                            self._evaluate_during_training()
                        if last:
                            break
                        tick = time.perf_counter()
                if self.checkpointer.last is None or self.checkpointer.last.name != f"step-{self.state.step:08d}":
                    self.save_checkpoint()
            finally:
                progress.close()
        final_eval = self._final_evaluation(examples)
        self.log.close()
        dist.barrier(self.group)
        return self._summary(resumed_from, examples, train_seconds, final_eval)

    def train_step(self, batch: dict[str, torch.Tensor]) -> tuple[float, int]:
        """One optimisation step on the global batch; returns ``(loss, rows of the global batch)``."""
        _fail_once(self.config, self.run_dir, self.state.step + 1, self.rank)
        optim = self.config.optim
        if not self.lr_schedule.constant:  # before the forward: fbgemm's fused update takes the forward's rate
            self.lr_factor = self.lr_schedule.apply(
                self.state.step, self.item_optimizer, optim.item_lr, self.model.tower, optim.user_lr
            )
            self.replicas.set_user_lr(optim.user_lr * self.lr_factor)
        users, items = batch["user_id"], batch["item_id"]
        dropout, sample = self.config.model.history_dropout, self.config.model.history_sample_size
        rng = None
        if dropout > 0 or sample is not None:
            rng = history_generator(self.config.seed, self.state.step, self.rank)
        local_vectors = user_vectors(
            self.model,
            users,
            pad_to=self.local_batch,
            exclude=items,
            history_dropout=dropout,
            rng=rng,
            history_sample_size=sample,
        )
        items = items.to(self.device, non_blocking=True)
        stats = None
        if self.model.shard.replicated:
            loss, value, rows, stats = self._local_loss(local_vectors, items, users)
        else:
            loss, value, rows = self._global_loss(local_vectors, items, users)
        if stats is None:
            self._check_finite(value)
        penalty = user_l2_penalty(local_vectors, rows, optim.user_l2)  # this rank's rows
        self.model.shard.weight.grad = None
        self.replicas.zero_grad()
        (loss if penalty is None else loss + penalty).backward()
        touched = self.step_loss.last_rows  # candidate losses: only the rows the step read (sparse update)
        if self.model.shard.replicated and self.world_size > 1:
            # Sums the catalog's and the tower's replicated gradients (and the folded loss sum and row count).
            summed = self.replicas.reduce(touched, stats)
            scale = 1.0
            if stats is not None:  # the shares were taken of the nominal batch: rescale to the real one
                total_loss, total_rows, stops = summed.tolist()
                self.stopping = stops > 0
                value, scale, rows = total_loss / max(total_rows, 1), rows / max(total_rows, 1), int(total_rows)
                self._check_finite(value)
            self.replicas.apply(scale)
        else:
            self.replicas.step()  # the tower's replicated tables, if any
            if touched is not None:
                self.item_optimizer.step_rows(touched.ids, touched.grad)
            else:
                self.item_optimizer.step_dense(self.model.shard.weight.grad)
        self.step_loss.after_step()
        self.state.step += 1
        self.state.first_loss = value if self.state.first_loss is None else self.state.first_loss
        self.state.last_loss = value
        return value, rows

    def _check_finite(self, value: float) -> None:
        if not math.isfinite(value):
            last = self.checkpointer.last
            where = f"the last good checkpoint is {last}" if last else "no checkpoint yet"
            raise FloatingPointError(
                f"loss is {value} at step {self.state.step + 1} (epoch {self.stream.epoch}); {where}. "
                "Lower optim.item_lr / optim.user_lr or check the data; the run stopped before updating."
            )

    def _global_loss(self, local_vectors, items, users) -> tuple[torch.Tensor, float, int]:
        """Sharded catalog: the loss of the all-gathered global batch against this rank's rows, the same value
        on every rank; ``(loss, value, rows of the global batch)``."""
        global_vectors, target = self._gather_batch(local_vectors, items)
        with replicated_inputs():  # the target and the batch are all-gathered: the same on every rank
            loss = self.step_loss(
                global_vectors,
                target,
                self.model.shard.weight,
                group=self.group,
                chunk_size=self.config.train.chunk_size,
                step=self.state.step,
                positives=self._gather_positives(users),
            )
        if self.config.debug.nan_at_step == self.state.step + 1:
            loss = loss * float("nan")
        return loss, float(loss.detach()), int(target.numel())

    def _local_loss(self, local_vectors, items, users):
        """Replicated catalog: this rank's rows against the whole catalog, no collective in the loss.

        Returns ``(share, value, rows, stats)``: ``share`` is this rank's share of the global batch's mean loss
        (the shares of all ranks add up to the global loss, so their gradients add up to its gradient),
        ``value`` the global mean and ``rows`` the global batch's rows. The loss sum and row count cross ranks
        once so that every rank sees the same value (and the same NaN): folded into the gradient all-reduce
        after backward when nothing is updated inside backward (``stats`` float32[3] is then this rank's
        ``[sum, rows, stop request]``, ``share`` is taken of the nominal batch and ``value`` is None until the
        sum arrives), else in a small all-reduce before backward (``stats`` None). Either way the ranks' stop
        requests travel summed beside the loss and set :attr:`stopping`."""
        rows = items.numel()
        if rows:
            positives = None if self.user_positives is None else self.user_positives[users].to(self.device)
            mean = self.step_loss(
                local_vectors,
                items,
                self.model.shard.weight,
                group=None,
                chunk_size=self.config.train.chunk_size,
                step=self.state.step,
                positives=positives,
            )
            local_sum = mean * rows
        else:  # an empty last batch: still part of the step's collectives (and of a sharded tower's backward)
            local_sum = local_vectors.sum() * 0.0
        if self.config.debug.nan_at_step == self.state.step + 1:
            local_sum = local_sum * float("nan")
        # [sum, rows, stop requests]: the ranks' stop requests are summed with the loss (see train()).
        counts = torch.tensor([float(rows), float(self._stop_requested())], device=self.device)
        totals = torch.cat([local_sum.detach().float().reshape(1), counts])
        if self.replicas.folds_loss:
            nominal = self.config.train.batch_size
            return local_sum / nominal, None, nominal, totals
        total_loss, total_rows, stops = all_reduce_no_grad(totals.double(), self.group).tolist()
        self.stopping = stops > 0
        total_rows = max(int(total_rows), 1)
        return local_sum / total_rows, total_loss / total_rows, total_rows, None

    def _gather_batch(self, local_vectors: torch.Tensor, items: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The global batch's user vectors float[B', d] and positives int64[B'] in one all-gather (each rank's
        rows padded to the local batch: the last batch of an epoch can be smaller, even empty). Sets
        :attr:`stopping` when any rank's ids carry its stop request (``_STOP_BIT``)."""
        if self._stop_requested():
            items = items.to(torch.int64) | _STOP_BIT
        vectors, target = all_gather_rows_with_ids(local_vectors, items, self.local_batch, self.group)
        low, high = torch.stack(torch.aminmax(target)).tolist()  # one device-to-host read for both checks
        self.stopping = high >= _STOP_BIT
        if self.stopping:
            target = torch.where(target >= _STOP_BIT, target - _STOP_BIT, target)
        if low >= 0:
            return vectors, target
        valid = target >= 0
        return vectors[valid], target[valid]

    def _gather_positives(self, users: torch.Tensor) -> torch.Tensor | None:
        """The train-item counts int64[B'] of the global batch's users, in ``_gather_batch``'s row order (None
        unless the loss needs them)."""
        if self.user_positives is None:
            return None
        local = torch.full((self.local_batch,), -1, dtype=torch.int64)
        local[: users.numel()] = self.user_positives[users.to(torch.int64)]
        gathered = all_gather_replicated(local.to(self.device), self.group)
        return gathered[gathered >= 0]

    def _stop_requested(self) -> bool:
        """Whether a signal asked this rank to stop (the ranks then agree on the step in its collective)."""
        return self.stop_request is not None and self.stop_request.signum is not None

    def _stop_at_boundary(self) -> None:
        """Every rank, at the step boundary they agreed on: write the final checkpoint (unless this step's is
        written) and raise :class:`~bigrank.signals.Stopped` (the local launcher reports the stop). A rank whose
        peers got the signal but not itself stops as by SIGTERM."""
        last = self.checkpointer.last
        path = last if last is not None and last.name == f"step-{self.state.step:08d}" else self.save_checkpoint()
        signum = self.stop_request.signum if self._stop_requested() else signal.SIGTERM
        if self.rank == 0:
            print(f"stopped by {signal_name(signum)} at step {self.state.step}: checkpoint {path}", flush=True)
        self.log.close()
        raise Stopped(signum)

    def finished(self) -> bool:
        max_steps = self.config.train.max_steps
        return self.stream.epoch >= self.config.train.epochs or (max_steps is not None and self.state.step >= max_steps)

    # ----- checkpoints -----
    def resume(self) -> Path | None:
        """Load the newest complete checkpoint of the run, if any (collective); returns its path."""
        path = latest_checkpoint(self.run_dir)
        if path is None:
            return None
        meta = self.checkpointer.load(path)
        if self.rank == 0:
            saved = meta.get("world_size", self.world_size)
            note = "" if saved == self.world_size else f", written by {saved} workers, now {self.world_size}"
            print(f"resuming from {path} (step {self.state.step}{note})", flush=True)
        return path

    def save_checkpoint(self) -> Path:
        meta = {"epoch": self.stream.epoch, "last_loss": self.state.last_loss, "first_loss": self.state.first_loss}
        return self.checkpointer.save(self.state.step, meta)

    # ----- records -----
    def epochs_done(self) -> float:
        return self.state.step / self.stream.steps_per_epoch()

    def _progress_bar(self):
        import threading

        from tqdm import tqdm

        # tqdm's default lock is a multiprocessing semaphore: a worker stopped by SIGTERM leaves it to the
        # resource tracker, which warns about "leaked semaphore objects". Only rank 0 draws a bar, so a thread
        # lock is enough.
        tqdm.set_lock(threading.RLock())
        cfg = self.config.train
        left = self.stream.steps_left_in_epoch() + (cfg.epochs - self.stream.epoch - 1) * self.stream.steps_per_epoch()
        total = self.state.step + max(left, 0)
        if cfg.max_steps is not None:
            total = min(total, cfg.max_steps)
        return tqdm(
            total=total,
            initial=self.state.step,
            disable=self.rank != 0 or not cfg.progress,
            desc="train",
            unit="step",
            mininterval=0.1 if sys.stderr.isatty() else 30.0,  # logs (Ray, files) get a line every 30 s
        )

    def _log_train(self, window: _Window, progress) -> None:
        record = TrainRecord(
            step=self.state.step,
            epoch=self.epochs_done(),
            loss=window.loss / window.steps,
            examples_per_s=window.rows / max(window.seconds, 1e-9),
            lr=self.config.optim.item_lr * self.lr_factor,
            user_lr=self.config.optim.user_lr * self.lr_factor,
            temperature=self._temperature(),
        )
        self.log.write(record, "train")
        progress.set_postfix(loss=f"{record.loss:.4f}", ex_s=f"{record.examples_per_s:.0f}")

    def _temperature(self) -> float | None:
        return self.step_loss.temperature

    def _evaluate_during_training(self) -> None:
        split = self.config.eval.splits[0]
        results = self.evaluator.evaluate(split)
        record = EvalRecord.from_results(split, self.state.step, self.stream.epoch, results)
        self.log.write(record, f"eval_{split}")
        self.eval_history.append(record.to_json())

    def _final_evaluation(self, examples: int) -> dict[str, dict]:
        final: dict[str, dict] = {}
        if not self.config.eval.at_end or not (examples or not (self.run_dir / EVAL).exists()):
            return final
        for split in self.config.eval.splits:
            results = self.evaluator.evaluate(split)
            final[split] = dict(results, step=self.state.step, epoch=self.epochs_done())
            self.log.write(
                EvalRecord.from_results(split, self.state.step, self.epochs_done(), results), f"eval_{split}"
            )
        if self.rank == 0:
            write_eval_json(self.run_dir, final)
        return final

    def _summary(self, resumed_from, examples: int, train_seconds: float, final_eval: dict) -> dict[str, Any]:
        last = self.checkpointer.last
        return {
            "run_dir": str(self.run_dir),
            "steps": self.state.step,
            "steps_per_epoch": self.stream.steps_per_epoch(),
            "epochs": self.epochs_done(),
            "world_size": self.world_size,
            "first_loss": self.state.first_loss,
            "last_loss": self.state.last_loss,
            "examples": examples,
            "examples_per_s": examples / train_seconds if train_seconds else None,
            "train_seconds": train_seconds,
            "checkpoint": str(last) if last else None,
            "resumed_from": str(resumed_from) if resumed_from else None,
            "eval": final_eval or None,
            "eval_history": self.eval_history,
        }


def _item_counts(manifest: DatasetManifest, start: int, stop: int) -> torch.Tensor:
    """Train interactions of items ``[start, stop)`` (popularity sampler), read row group by row group."""
    import numpy as np

    from bigrank.data.stream import iter_row_groups

    counts = np.zeros(stop - start, dtype=np.int64)
    for group in iter_row_groups(manifest, "train", columns=("item_id",)):
        items = group["item_id"].astype(np.int64)
        items = items[(items >= start) & (items < stop)] - start
        counts += np.bincount(items, minlength=stop - start)
    return torch.from_numpy(counts)


def _user_counts(manifest: DatasetManifest, num_users: int) -> torch.Tensor:
    """Train interactions of every user, int64[num_users], read row group by row group."""
    import numpy as np

    from bigrank.data.stream import iter_row_groups

    counts = np.zeros(num_users, dtype=np.int64)
    for group in iter_row_groups(manifest, "train", columns=("user_id",)):
        counts += np.bincount(group["user_id"].astype(np.int64), minlength=num_users)
    return torch.from_numpy(counts)


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
