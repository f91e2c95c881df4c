"""The Trainer: every rank of an initialised process group runs ``Trainer(config).train()``, for every model kind.

The loop is one: the process group and run directory (``_start_run``), resume, checkpoint cadence, the agreed
stop at a step boundary, the learning-rate schedule, the debug switches, the finite-loss guard, the step
counters, the logs and evaluation timing live here once. The model kind (``model.kind``, looked up in
``bigrank.model.registry``) supplies what differs through its ``bigrank.train.kind.Training``: the model built
and laid out, the stream of batches, the optimisers, the checkpoint parts, and the forward, backward and update
of one step (each kind's module documents its step: ``bigrank.train.towers`` for the default kind), as a
torchtitan model supplies its builders through its ``TrainSpec``.

The trainer's parts each do one job: the kind's training parts, the
:class:`~bigrank.train.checkpoint.Checkpointer` (when to save; every stateful part registered once and
saved/loaded generically through DCP, so a run resumes on any worker count), the
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

import torch.distributed as dist

from bigrank.config import Config, config_from_dict, save_config
from bigrank.data.manifest import DatasetManifest, dataset_manifest
from bigrank.devices import setup_precision
from bigrank.model.registry import model_spec
from bigrank.records import EVAL, EvalRecord, TrainRecord, append_record, truncate_metrics, write_eval_json
from bigrank.signals import Stopped, signal_name, step_boundaries
from bigrank.train.bootstrap import start_worker
from bigrank.train.checkpoint import Checkpointer, latest_checkpoint, remove_partial_checkpoints
from bigrank.train.evaluator import Evaluator
from bigrank.train.kind import StepContext, TrainingRun
from bigrank.train.schedule import LearningRateSchedule
from bigrank.train.state import RNGState, StreamState, TrainState

__all__ = ["RunLog", "Trainer", "as_config"]


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
    warm_started_from: Path | None = None  # the checkpoint a warm start (train.init_from) began from

    def __init__(self, config: Config | dict, manifest: DatasetManifest | None = None):
        self._start_run(config, manifest)
        config, train_cfg = self.config, self.config.train
        kind = model_spec(config.model.kind).kind
        run = TrainingRun(config, self.manifest, self.worker, self.precision, self.run_dir)
        self.training = training = kind.start_training(run)  # the model, built and laid out; the step's parts
        self.model, self.stream = training.model, training.stream
        self.state = TrainState()
        self.lr_schedule = LearningRateSchedule.for_run(config, self.stream.steps_per_epoch())
        self.lr_factor = 1.0
        self.checkpointer = Checkpointer(
            self.run_dir,
            {**training.parts, "stream": StreamState(self.stream), "train": self.state},
            rank_parts={"rng": RNGState()},
            every=train_cfg.checkpoint_every,
            keep=train_cfg.keep_checkpoints,
            identity=kind.identity(config, self.model),
            group=self.group,
        )
        self.evaluator = Evaluator(config, self.model, self.group, self.manifest)
        self.eval_history: list[dict] = []
        self.early_stopping = None
        if train_cfg.early_stopping is not None:
            from bigrank.train.early_stopping import EarlyStopping

            self.early_stopping = EarlyStopping(train_cfg.early_stopping, self.state)
        self.weights_from_step: int | None = None  # an early-stopped run's best step, once its weights are loaded

    def _start_run(self, config: Config | dict, manifest: DatasetManifest | None) -> None:
        """What every run starts with, whatever its model kind: the worker (process group, device, seed), the
        precision, the run directory (config saved, partial checkpoints removed) and the dataset's manifest."""
        self.config = config = as_config(config)
        self.worker = worker = start_worker(config)  # process group, device, seed (bigrank.train.bootstrap)
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
                if resumed_from is not None:
                    self._catch_up_evaluation()
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
                        if self.evaluator.due(self.stream.epoch, epoch_end=epoch_end, last=last) or (
                            last and self.early_stopping is not None
                        ):
                            self._evaluate_during_training()
                        if last or self.state.stopped:
                            break
                        tick = time.perf_counter()
                if self.checkpointer.last is None or self.checkpointer.last.name != f"step-{self.state.step:08d}":
                    self.save_checkpoint()
                if self.early_stopping is not None:
                    self._keep_best()
            finally:
                progress.close()
        final_eval = self._final_evaluation(examples)
        self.log.close()
        dist.barrier(self.group)
        return self._summary(resumed_from, examples, train_seconds, final_eval)

    def train_step(self, batch: dict) -> tuple[float, int]:
        """One optimisation step on the global batch (the kind's :meth:`~bigrank.train.kind.Training.step` between
        the loop's bookkeeping); returns ``(loss, rows of the global batch)``."""
        step = self.state.step
        _fail_once(self.config, self.run_dir, step + 1, self.rank)
        if not self.lr_schedule.constant:  # a constant schedule leaves the optimisers' rates as built
            self.lr_factor = self.lr_schedule.factor(step)
            self.training.set_lr_factor(self.lr_factor)
        nan = self.config.debug.nan_at_step == step + 1
        context = StepContext(step, self._stop_requested(), nan, self._check_finite)
        result = self.training.step(batch, context)
        self.stopping = result.stopping
        self.state.step += 1
        self.state.first_loss = result.loss if self.state.first_loss is None else self.state.first_loss
        self.state.last_loss = result.loss
        return result.loss, result.rows

    def _check_finite(self, value: float) -> None:
        if not math.isfinite(value):
            last = self.checkpointer.last
            where = f"the last good checkpoint is {last}" if last else "no checkpoint yet"
            raise FloatingPointError(
                f"loss is {value} at step {self.state.step + 1} (epoch {self.stream.epoch}); {where}. "
                "Lower optim.item_lr / optim.user_lr or check the data; the run stopped before updating."
            )

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
        if self.state.stopped:  # train.early_stopping
            return True
        return self.stream.epoch >= self.config.train.epochs or (max_steps is not None and self.state.step >= max_steps)

    # ----- checkpoints -----
    def resume(self) -> Path | None:
        """Load the newest complete checkpoint of the run, if any (collective); returns its path."""
        path = latest_checkpoint(self.run_dir)
        if path is None:
            if self.config.train.init_from:
                self._warm_start()
            return None
        meta = self.checkpointer.load(path)
        self.weights_from_step = meta.get("weights_from_step")  # an early-stopped run's last checkpoint
        if self.rank == 0:
            saved = meta.get("world_size", self.world_size)
            note = "" if saved == self.world_size else f", written by {saved} workers, now {self.world_size}"
            print(f"resuming from {path} (step {self.state.step}{note})", flush=True)
        return path

    def _warm_start(self) -> None:
        """A new run begins from ``train.init_from``'s newest checkpoint (``bigrank.train.warm_start``; collective)."""
        from bigrank.train.checkpoint import read_trainer_state
        from bigrank.train.warm_start import load_grown

        source = latest_checkpoint(self.config.train.init_from)
        identity = read_trainer_state(source).get("model") or {}
        now = {"users": self.manifest.num_users, "items": self.manifest.num_items}
        vocabulary = {what: (int(identity.get(f"dataset {what}", size)), size) for what, size in now.items()}
        meta = load_grown(source, self.training.parts, vocabulary, self.group)
        self.warm_started_from = source
        if self.rank == 0:
            grown = ", ".join(f"{what} {old:,} -> {new:,}" for what, (old, new) in vocabulary.items())
            print(f"warm start from {source} (step {meta.get('step')}; {grown})", flush=True)

    def save_checkpoint(self) -> Path:
        return self.checkpointer.save(self.state.step, self._checkpoint_meta())

    def _checkpoint_meta(self) -> dict[str, Any]:
        from bigrank.data.ingest.vocab import dataset_id

        meta = {"epoch": self.stream.epoch, "last_loss": self.state.last_loss, "first_loss": self.state.first_loss}
        meta["dataset_id"] = dataset_id(dict(self.manifest.raw))  # what a warm start checks descent against
        if self.weights_from_step is not None:
            meta["weights_from_step"] = self.weights_from_step
        return meta

    # ----- early stopping -----
    def _record_stop_metric(self, results: dict) -> bool:
        """``train.early_stopping``: record an evaluation of the validation split; the best one's checkpoint is kept
        beyond ``train.keep_checkpoints`` (``Checkpointer.pinned``)."""
        stop = self.early_stopping.record(self.state.step, results)  # sets state.stopped: the loop ends here
        best = self.early_stopping.best()
        self.checkpointer.pinned = {best[0]}
        if self.rank == 0:
            print(self.early_stopping.describe(), flush=True)
        return stop

    def _catch_up_evaluation(self) -> None:
        """A run resumed from an epoch-end checkpoint whose evaluation is not recorded (the checkpoint is written
        before the evaluation: a run killed between the two) evaluates it now, so the stop rule sees every one."""
        if self.early_stopping is None:
            return
        best = self.early_stopping.best()
        if best is not None:
            self.checkpointer.pinned = {best[0]}
        at_epoch_end = self.state.step > 0 and self.stream.steps_left_in_epoch() == self.stream.steps_per_epoch()
        due = self.evaluator.due(self.stream.epoch, epoch_end=True, last=False) or self.finished()
        if at_epoch_end and due and not self.state.stopped and not self.early_stopping.evaluated(self.state.step):
            self._evaluate_during_training()

    def _keep_best(self) -> None:
        """End the run with the best evaluation's weights: load its checkpoint's model parts and write them as the
        last checkpoint (``Checkpointer.replace``; ``weights_from_step`` in its ``trainer.json``)."""
        best = self.early_stopping.best()
        if best is None or best[0] in (self.state.step, self.weights_from_step):
            return
        from bigrank.train.checkpoint import checkpoint_path

        self.checkpointer.load(checkpoint_path(self.run_dir, best[0]), parts=self.training.parts)
        self.weights_from_step = best[0]
        path = self.checkpointer.replace(self.state.step, self._checkpoint_meta())
        if self.rank == 0:
            print(f"{self.early_stopping.describe()}: the run ends with those weights ({path})", flush=True)

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
            temperature=self.training.temperature,
        )
        self.log.write(record, "train")
        progress.set_postfix(loss=f"{record.loss:.4f}", ex_s=f"{record.examples_per_s:.0f}")

    def _evaluate_during_training(self) -> None:
        split = self.config.eval.splits[0]
        results = self.evaluator.evaluate(split)
        record = EvalRecord.from_results(split, self.state.step, self.stream.epoch, results)
        self.log.write(record, f"eval_{split}")
        self.eval_history.append(record.to_json())
        if self.early_stopping is not None:
            self._record_stop_metric(results)

    def _final_evaluation(self, examples: int) -> dict[str, dict]:
        final: dict[str, dict] = {}
        if not self.config.eval.at_end or not (examples or not (self.run_dir / EVAL).exists()):
            return final
        for split in self.config.eval.splits:
            results = self.evaluator.evaluate(split)
            final[split] = dict(results, step=self.state.step, epoch=self.epochs_done())
            if self.weights_from_step is not None:
                final[split]["weights_from_step"] = self.weights_from_step
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
            "init_from": str(self.warm_started_from) if self.warm_started_from else None,
            "early_stopping": self.early_stopping.describe() if self.early_stopping is not None else None,
            "eval": final_eval or None,
            "eval_history": self.eval_history,
        }


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
