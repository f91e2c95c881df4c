"""One trial of ``bigrank tune``: a normal bigrank training run (the run layer's pre-flight, the local launcher
with the process-group backend of the trial's devices) that reports each validation evaluation to Tune."""

from __future__ import annotations

import copy
import json
import os
import tempfile
import threading
import time
from pathlib import Path

from bigrank.config import Config, config_from_dict
from bigrank.tune.space import (
    _CONTEXT,
    _METRIC_NAME,
    _POLL_SECONDS,
    _number,
)


def _train_rank(config: Config, log_path: str | None, manifest=None) -> dict:
    """One training process of a trial: ``train_worker`` with its output in the run's log (``manifest``: the
    dataset's, read by the trial's pre-flight). The local launcher set the process up
    (``bigrank.train.bootstrap``: the trial's threads, the process group). It ends with the trial's actor (Tune
    ends stopped trials' actors, a kill skipping any clean-up there): the local launcher's workers get SIGTERM
    when their parent dies."""
    if log_path:
        log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
    from bigrank.train.workers import train_worker

    return train_worker(config, manifest)


class _Training(threading.Thread):
    """The trial's training run (local launcher) in a thread, so the trial can report while it runs."""

    def __init__(self, config: Config, threads: int, log_path: Path, device_type: str, manifest=None):
        super().__init__(name="bigrank-training", daemon=True)
        self.config, self.threads, self.log_path, self.device_type = config, threads, log_path, device_type
        self.manifest = manifest
        self.summary: dict | None = None
        self.error: BaseException | None = None

    def run(self) -> None:
        from bigrank.devices import process_group_backend
        from bigrank.train.launcher import launch_local

        try:
            args = (self.config, str(self.log_path), self.manifest)
            backend = process_group_backend(self.device_type)  # as bigrank train's local launcher chooses it
            restarts = self.config.train.max_restarts
            summary = launch_local(
                _train_rank, self.config.workers, args, backend=backend, threads=self.threads, max_restarts=restarts
            )
            self.summary = summary[0]
        except BaseException as error:  # noqa: BLE001 - re-raised in the trial's thread
            self.error = error


def _read_records(run_dir: Path) -> list:
    """The run's records so far (``bigrank.records``; a line being written is skipped), none before the first."""
    from bigrank.records import METRICS, read_metrics

    return read_metrics(run_dir) if (run_dir / METRICS).is_file() else []


def completed_evaluations(records: list, split: str = "valid") -> list:
    """The ``split`` evaluations (``EvalRecord``) of a run's ``metrics.jsonl`` records that training has moved
    past (a train record follows them): the periodic ones. The evaluations at the end of a run are read from
    eval.json."""
    from bigrank.records import EvalRecord, TrainRecord

    done, pending = [], []
    for record in records:
        if isinstance(record, EvalRecord) and record.split == split:
            pending.append(record)
        elif isinstance(record, TrainRecord):
            done += pending
            pending = []
    return done


def _metrics_of(section: dict, prefix: str) -> dict[str, float]:
    """The ranking metrics (accuracy, recall@K, ndcg@K, ap@K) of an evaluation record, keys prefixed ``prefix/``."""
    return {
        f"{prefix}/{key}": float(value)
        for key, value in section.items()
        if _METRIC_NAME.fullmatch(key) and _number(value)
    }


def _report(metrics: dict, step: int, metric: str) -> None:
    """``tune.report`` with a tiny checkpoint holding the reported step (a restarted trial skips what was sent)."""
    from ray import tune

    trial = tune.get_context().get_trial_id()
    shown = " ".join(f"{key} {metrics[key]:.4f}" for key in (f"valid/{metric}", f"test/{metric}") if key in metrics)
    print(f"trial {trial}: epoch {metrics['epoch']:g} {shown}", flush=True)
    with tempfile.TemporaryDirectory() as directory:
        (Path(directory) / "reported.json").write_text(json.dumps({"step": step}))
        tune.report(metrics, checkpoint=tune.Checkpoint.from_directory(directory))


def _reported_step() -> int:
    from ray import tune

    checkpoint = tune.get_checkpoint()
    if checkpoint is None:
        return 0
    with checkpoint.as_directory() as directory:
        path = Path(directory) / "reported.json"
        return int(json.loads(path.read_text())["step"]) if path.is_file() else 0


def bigrank_trial(params: dict) -> None:
    """The Tune trainable: train the trial's config in ``runs_root/TRIAL_ID`` and report its evaluations."""
    from ray import tune

    context = params[_CONTEXT]
    raw = copy.deepcopy({key: value for key, value in params.items() if key != _CONTEXT})
    run_dir = Path(context["runs_root"]) / tune.get_context().get_trial_id()
    run_dir.mkdir(parents=True, exist_ok=True)
    raw["run_dir"] = str(run_dir)
    config = config_from_dict(raw)
    # The run layer's pre-flight, as for `bigrank train`: devices, the loss built once, the dataset's manifest.
    from bigrank.devices import check_devices
    from bigrank.run import prepare_run

    manifest = prepare_run(config, "local")
    reported = _reported_step()
    threads = max(1, int(config.ray.cpus_per_worker))
    training = _Training(config, threads, run_dir / "train.log", check_devices(config, "local"), manifest)
    training.start()
    while True:
        finished = not training.is_alive()
        for record in completed_evaluations(_read_records(run_dir)):
            if record.step > reported:
                metrics = {"epoch": record.epoch, "step": record.step}
                metrics.update(_metrics_of(record.metrics, "valid"))
                _report(metrics, record.step, context["metric"])
                reported = record.step
        if finished:
            break
        time.sleep(_POLL_SECONDS)
    training.join()
    if training.error is not None:
        raise training.error
    from bigrank.records import read_eval_json

    final = read_eval_json(run_dir)
    step = int(final["valid"]["step"])
    if step > reported:
        metrics = {"epoch": float(final["valid"]["epoch"]), "step": step, "finished": 1}
        for split in ("valid", "test"):
            metrics.update(_metrics_of(final.get(split, {}), split))
        _report(metrics, step, context["metric"])
