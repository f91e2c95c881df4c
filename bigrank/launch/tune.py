"""``bigrank tune``: hyper-parameter search on Ray Tune, each trial a normal bigrank training run.

    bigrank tune CONFIG --space SPACE.yaml [--trials N] [--out DIR] [--address HOST:6379] [--set key=value]

The space file names config keys with the values to try::

    metric: ap@10                 # validation metric to maximise (eval.ks decide which exist); default ap@10
    trials: 8                     # samples of the space (each grid point is run that many times); default 1
    scheduler: {grace_period: 2, reduction_factor: 3}    # ASHA over evaluated epochs (optional)
    space:
      optim.user_lr: {loguniform: [0.01, 0.5]}
      model.dim: {choice: [32, 64]}
      loss.params.k: {grid: [1, 5]}
      train.epochs: 10            # a plain value: fixed for every trial

Domains: ``grid`` (every value, Tune's grid search), ``choice`` (one at random), ``uniform``/``loguniform``
([low, high] floats), ``randint`` ([low, high] integers, both included). Every key and every value is checked
against the config schema before Ray starts: a key that does not exist, a value the key refuses, or two values
of two keys that cannot go together (``model.history: false`` and ``model.history_dropout: 0.5``), is an error
naming the key or keys.

How a trial runs. Tune runs :func:`bigrank_trial` in an actor holding ``workers * ray.cpus_per_worker`` CPUs
(one placement-group bundle, so one node); the trial starts the run's ``workers`` gloo processes there with the
local launcher (``bigrank.train.launcher.launch_local``: the same ``train_worker`` as ``bigrank train``) in
``DIR/runs/TRIAL_ID``, evaluating the validation split every ``eval.every_epochs`` epochs (1 when unset). The
trial follows the run's ``metrics.jsonl`` and reports each validation evaluation to Tune (``valid/<metric>``,
``epoch``) as soon as training has moved past it, then the final valid and test evaluation with
``finished = 1``. ASHA (``AsyncHyperBandScheduler`` on ``epoch``) stops poor trials early. The first trial runs
the base config's own values of the sampled keys when they lie in the space (:func:`base_point`;
``--no-base-trial`` samples it too). The trainer is a
black box here: anything ``bigrank train`` accepts can be tuned.

Resuming. The search state lives in ``DIR`` (Tune's experiment directory). Running the same command again
restores it (``Tuner.restore``): finished trials are kept, interrupted ones continue — Tune restarts their
function with the last reported step (a tiny Tune checkpoint), and the trainer resumes from the newest
checkpoint of the trial's run directory, so no finished epoch is trained twice. A changed config or space is
refused (Tune cannot change a search half-way): use a new ``--out``.

Outputs (``DIR``): ``trials.csv`` and ``trials.txt`` (one row per trial: status, the tuned values, epochs,
validation and test metrics), ``best.yaml`` (the resolved config of the best *finished* trial by the last
validation metric, ``run_dir`` set back to the base config's: ``bigrank train DIR/best.yaml`` reproduces it).
When no trial finished, no ``best.yaml`` is written and ``bigrank tune`` exits with status 1, saying how many
trials ended how (and, when every trial failed, the first trial's error).

Where Ray runs: no ``--address`` (nor ``ray.address`` / ``RAY_ADDRESS``): an embedded local runtime with the
machine's CPUs; otherwise the cluster at that address (``DIR`` must then be on storage every node sees, and
the data too, as for ``bigrank train --address``).
"""

from __future__ import annotations

import argparse
import copy
import csv
import io
import json
import math
import os
import re
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from bigrank.atomic import write_json_atomic, write_text_atomic
from bigrank.config import Config, ConfigError, add_override_argument, config_from_dict, dump_config, load_config

__all__ = [
    "DOMAINS",
    "SearchSpace",
    "SpaceError",
    "bigrank_trial",
    "load_space",
    "register",
    "run_search",
    "search_base",
    "validate_space",
]

DOMAINS = ("grid", "choice", "uniform", "loguniform", "randint")
_SPACE_KEYS = ("space", "metric", "trials", "scheduler", "max_concurrent")
_SCHEDULER_KEYS = ("grace_period", "reduction_factor")
# Keys the search itself sets for every trial.
_RESERVED_KEYS = ("run_dir", "eval.splits", "eval.at_end", "train.progress")
_CONTEXT = "_tune"  # param_space key of what every trial needs besides its config
_POLL_SECONDS = 1.0
_METRIC_NAME = re.compile(r"accuracy|recall@\d+|ap@\d+")


class SpaceError(ConfigError):
    """A problem in a search-space file; the message names the file and the key."""


# --------------------------------------------------------------------------------------------- the space
@dataclass
class Domain:
    """One tuned key: ``kind`` (a DOMAINS entry, or "fixed") and its ``values`` (the list, or [low, high])."""

    kind: str
    values: list

    def candidates(self) -> list:
        """Values that stand for the domain when checking it against the config schema."""
        return list(self.values)

    def contains(self, value) -> bool:
        """Whether ``value`` is one this domain can produce (a listed value, or inside ``[low, high]``)."""
        if self.kind in ("fixed", "grid", "choice"):
            return value in self.values
        if not _number(value):
            return False
        low, high = self.values
        return low <= value <= high

    def to_tune(self):
        from ray import tune

        if self.kind == "fixed":
            return self.values[0]
        if self.kind == "grid":
            return tune.grid_search(list(self.values))
        if self.kind == "choice":
            return tune.choice(list(self.values))
        low, high = self.values
        if self.kind == "uniform":
            return tune.uniform(low, high)
        if self.kind == "loguniform":
            return tune.loguniform(low, high)
        return tune.randint(low, high + 1)  # Tune's upper bound is exclusive


@dataclass
class SearchSpace:
    """A parsed space file (see the module docstring)."""

    params: dict[str, Domain]
    metric: str = "ap@10"
    trials: int = 1
    grace_period: int | None = None
    reduction_factor: float = 3.0
    max_concurrent: int | None = None
    raw: dict = field(default_factory=dict)


def _number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _parse_domain(key: str, spec, where: str) -> Domain:
    if not isinstance(spec, dict):
        return Domain("fixed", [spec])
    if len(spec) != 1 or next(iter(spec)) not in DOMAINS:
        raise SpaceError(f"{where}: space key {key!r} must be a plain value or one of {{{', '.join(DOMAINS)}: ...}}")
    kind, values = next(iter(spec.items()))
    if kind in ("grid", "choice"):
        if not isinstance(values, list) or not values:
            raise SpaceError(f"{where}: space key {key!r}: {kind} needs a non-empty list of values")
        return Domain(kind, list(values))
    if not isinstance(values, list) or len(values) != 2 or not all(_number(v) for v in values):
        raise SpaceError(f"{where}: space key {key!r}: {kind} needs [low, high] numbers, got {values!r}")
    low, high = values
    if not low < high:
        raise SpaceError(f"{where}: space key {key!r}: {kind} needs low < high, got {values!r}")
    if kind == "loguniform" and low <= 0:
        raise SpaceError(f"{where}: space key {key!r}: loguniform needs low > 0, got {low}")
    if kind == "randint" and not all(isinstance(v, int) for v in values):
        raise SpaceError(f"{where}: space key {key!r}: randint needs integers, got {values!r}")
    if kind != "randint":
        low, high = float(low), float(high)
    return Domain(kind, [low, high])


def load_space(path: str | os.PathLike) -> SearchSpace:
    """Read and parse a space file (the values are checked against a config by :func:`validate_space`)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"space file not found: {path}")
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as error:
        raise SpaceError(f"{path} is not valid YAML: {error}") from None
    if not isinstance(raw, dict):
        raise SpaceError(f"{path} must hold a mapping with a 'space' section")
    for key in raw:
        if key not in _SPACE_KEYS:
            raise SpaceError(f"{path}: unknown key {key!r}; a space file accepts {', '.join(_SPACE_KEYS)}")
    params_raw = raw.get("space")
    if not isinstance(params_raw, dict) or not params_raw:
        raise SpaceError(f"{path}: 'space' must map config keys (e.g. optim.user_lr) to values or domains")
    params = {}
    for key, spec in params_raw.items():
        if not isinstance(key, str) or not key or any(not part for part in key.split(".")):
            raise SpaceError(f"{path}: space key {key!r} must be a dotted config key such as optim.user_lr")
        if key in _RESERVED_KEYS:
            raise SpaceError(f"{path}: space key {key!r} is set by the search itself and cannot be tuned")
        params[key] = _parse_domain(key, spec, str(path))
    space = SearchSpace(params=params, raw=raw)
    metric = raw.get("metric", space.metric)
    if not isinstance(metric, str):
        raise SpaceError(f"{path}: metric must be a metric name such as ap@10, got {metric!r}")
    space.metric = metric
    trials = raw.get("trials", 1)
    if isinstance(trials, bool) or not isinstance(trials, int) or trials < 1:
        raise SpaceError(f"{path}: trials must be an integer >= 1, got {trials!r}")
    space.trials = trials
    scheduler = raw.get("scheduler") or {}
    if not isinstance(scheduler, dict):
        raise SpaceError(f"{path}: scheduler must be a mapping ({', '.join(_SCHEDULER_KEYS)})")
    for key, value in scheduler.items():
        if key not in _SCHEDULER_KEYS:
            raise SpaceError(f"{path}: unknown key 'scheduler.{key}'; scheduler accepts {', '.join(_SCHEDULER_KEYS)}")
        if not _number(value):
            raise SpaceError(f"{path}: scheduler.{key} must be a number, got {value!r}")
    if "grace_period" in scheduler:
        if not isinstance(scheduler["grace_period"], int) or scheduler["grace_period"] < 1:
            raise SpaceError(f"{path}: scheduler.grace_period must be an integer >= 1 (epochs)")
        space.grace_period = scheduler["grace_period"]
    if "reduction_factor" in scheduler:
        if not scheduler["reduction_factor"] > 1:
            raise SpaceError(f"{path}: scheduler.reduction_factor must be > 1")
        space.reduction_factor = float(scheduler["reduction_factor"])
    max_concurrent = raw.get("max_concurrent")
    if max_concurrent is not None and (not isinstance(max_concurrent, int) or max_concurrent < 1):
        raise SpaceError(f"{path}: max_concurrent must be an integer >= 1 or null")
    space.max_concurrent = max_concurrent
    return space


def _set_path(raw: dict, key: str, value) -> dict:
    """``raw`` with the dotted ``key`` set to ``value`` (sections created as needed; in place)."""
    node = raw
    parts = key.split(".")
    for depth, part in enumerate(parts[:-1]):
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        elif not isinstance(child, dict):
            raise SpaceError(f"space key {key!r}: {'.'.join(parts[: depth + 1])} is not a section")
        node = child
    node[parts[-1]] = value
    return raw


def _get_path(raw: dict, key: str):
    node = raw
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def _check_trial_config(raw: dict) -> Config:
    """The Config of a trial's raw dict, loss parameters checked too (ConfigError naming the key)."""
    from bigrank.losses.build import check_loss_config

    config = config_from_dict(copy.deepcopy(raw))
    check_loss_config(config.loss)
    return config


def search_base(config: Config) -> dict:
    """The raw config every trial starts from: ``config`` with what the search needs — validation every
    ``eval.every_epochs`` epochs (1 when unset), valid and test evaluated at the end, no progress bar."""
    raw = config.to_dict()
    raw["eval"]["every_epochs"] = raw["eval"]["every_epochs"] or 1
    raw["eval"]["splits"] = ["valid", "test"]
    raw["eval"]["at_end"] = True
    raw["train"]["progress"] = False
    return raw


def validate_space(space: SearchSpace, base: dict, where: str = "space") -> None:
    """Check ``space`` against the config schema, starting from ``base`` with the space's fixed keys (one
    candidate) set: every candidate value of the other keys alone, then every pair of candidate values of two
    keys (the schema's cross-key rules, e.g. ``model.history_dropout`` needs ``model.history: true``, would
    otherwise fail trials half-way through a search), then one trial with the first value of every key. Raises
    SpaceError naming the key or keys."""
    from bigrank.train.metrics import metric_names

    fixed = {key: domain for key, domain in space.params.items() if len(domain.candidates()) == 1}
    start = copy.deepcopy(base)
    for key, domain in fixed.items():
        _set_path(start, key, domain.candidates()[0])
    try:
        _check_trial_config(start)
    except (ConfigError, ValueError) as error:
        raise SpaceError(f"{where}: the fixed values of {', '.join(fixed)}: {error}") from None
    varied = [key for key in space.params if key not in fixed]
    for key in varied:
        for value in space.params[key].candidates():
            try:
                _check_trial_config(_set_path(copy.deepcopy(start), key, value))
            except (ConfigError, ValueError) as error:
                raise SpaceError(f"{where}: space key {key!r} = {value!r}: {error}") from None
    for i, first in enumerate(varied):
        for second in varied[i + 1 :]:
            for first_value in space.params[first].candidates():
                with_first = _set_path(copy.deepcopy(start), first, first_value)
                for second_value in space.params[second].candidates():
                    try:  # each value of `second` overwrites the last in with_first; the check works on a copy
                        _check_trial_config(_set_path(with_first, second, second_value))
                    except (ConfigError, ValueError) as error:
                        raise SpaceError(
                            f"{where}: space keys {first!r} = {first_value!r} and {second!r} = {second_value!r} "
                            f"cannot go together: {error}"
                        ) from None
    combined = copy.deepcopy(base)
    for key, domain in space.params.items():
        _set_path(combined, key, domain.candidates()[0])
    try:
        config = _check_trial_config(combined)
    except (ConfigError, ValueError) as error:
        raise SpaceError(f"{where}: the first value of every key together: {error}") from None
    names = metric_names(config.eval.ks)
    if space.metric not in names:
        raise SpaceError(f"{where}: metric {space.metric!r} is not evaluated; with eval.ks {config.eval.ks}: {names}")


def _max_epochs(space: SearchSpace, base: dict) -> int:
    domain = space.params.get("train.epochs")
    if domain is None:
        return int(base["train"]["epochs"])
    return int(max(domain.candidates()))


# ------------------------------------------------------------------------------------------------ a trial
def _train_rank(config: Config, threads: int, log_path: str | None) -> dict:
    """One training process of a trial: ``train_worker`` with the trial's thread budget, output to the run's log.
    It ends with the trial's actor (Tune ends stopped trials' actors, a kill skipping any clean-up there): the
    local launcher's workers get SIGTERM when their parent dies (``bigrank.train.launcher``)."""
    import torch

    torch.set_num_threads(max(1, threads))
    if log_path:
        log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
    import torchrec  # noqa: F401 - registers fbgemm/torchrec operators before the trainer uses them

    from bigrank.train.workers import train_worker

    return train_worker(config)


class _Training(threading.Thread):
    """The trial's training run (local launcher) in a thread, so the trial can report while it runs."""

    def __init__(self, config: Config, threads: int, log_path: Path):
        super().__init__(name="bigrank-training", daemon=True)
        self.config, self.threads, self.log_path = config, threads, log_path
        self.summary: dict | None = None
        self.error: BaseException | None = None

    def run(self) -> None:
        from bigrank.train.launcher import launch_local

        try:
            args = (self.config, self.threads, str(self.log_path))
            self.summary = launch_local(_train_rank, self.config.workers, args)[0]
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
    """The ranking metrics (accuracy, recall@K, ap@K) of an evaluation record, keys prefixed ``prefix/``."""
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
    config = _check_trial_config(raw)
    reported = _reported_step()
    threads = max(1, int(config.ray.cpus_per_worker))
    training = _Training(config, threads, run_dir / "train.log")
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


# ------------------------------------------------------------------------------------------------ search
def base_point(space: SearchSpace, base: dict) -> dict | None:
    """The base config's own values of the sampled keys, as a point for Tune's first trial; None when one of
    them lies outside its domain (the base is not in the space) or nothing is sampled.

    A search that starts from the given settings can only confirm or beat them on the validation metric (once
    that trial finishes: ASHA or the time budget may still stop it), instead of depending on the draws to come
    near them. Grid keys stay out of the point (Tune runs every grid value with it); fixed keys are the same
    for every trial anyway.
    """
    point: dict = {}
    for key, domain in space.params.items():
        if domain.kind in ("fixed", "grid"):
            continue
        value = _get_path(base, key)
        if not domain.contains(value):
            return None
        _set_path(point, key, value)
    return point or None


def param_space(space: SearchSpace, base: dict, runs_root: Path) -> dict:
    """Tune's ``param_space``: the base config with a Tune domain at every tuned key, plus the trial context."""
    tuned = copy.deepcopy(base)
    for key, domain in space.params.items():
        _set_path(tuned, key, domain.to_tune())
    tuned[_CONTEXT] = {"runs_root": str(runs_root), "metric": space.metric}
    return tuned


@dataclass
class SearchResult:
    """What :func:`run_search` returns: the table rows (best first), the best config's path and the directory."""

    rows: list[dict]
    best_config: Path | None
    out: Path
    table: str


def _trial_rows(results, space: SearchSpace) -> list[dict]:
    rows = []
    metric = space.metric
    for result in results:
        metrics = result.metrics or {}
        config = result.config or {}
        row: dict[str, Any] = {"trial": metrics.get("trial_id") or Path(result.path).name}
        if result.error is not None:
            row["status"] = "error"
        elif metrics.get("finished"):
            row["status"] = "finished"
        elif metrics.get("epoch") is None:
            row["status"] = "no result"  # never started, or stopped before its first evaluation
        else:
            row["status"] = "stopped"  # by ASHA, by the time budget or by an interruption
        for key in space.params:
            row[key] = _get_path(config, key)
        row["epochs"] = metrics.get("epoch")
        row[f"valid {metric}"] = metrics.get(f"valid/{metric}")
        frame = result.metrics_dataframe
        column = f"valid/{metric}"
        row[f"best valid {metric}"] = (
            float(frame[column].max()) if frame is not None and column in frame and len(frame) else None
        )
        for name in ("ap@10", "accuracy", "recall@100"):
            row[f"test {name}"] = metrics.get(f"test/{name}")
        row["seconds"] = metrics.get("time_total_s")
        row["error"] = _error_summary(result.error) if result.error is not None else ""
        row["_config"] = config
        rows.append(row)

    def order(row):
        value = row[f"valid {metric}"]
        return (row["status"] != "finished", -(value if value is not None else -math.inf))

    return sorted(rows, key=order)


def _error_summary(error: BaseException) -> str:
    """One line naming a trial's error, at most 300 characters: the innermost cause Ray kept (its
    ``RayTaskError`` wraps the trial's exception) and that exception's first line; when only Ray's or Tune's
    wrapper is left (a ``TuneError`` read back on resume), the last line of its text, which ends with the
    trial's exception (the first line is Ray's actor header)."""
    seen = set()
    while id(error) not in seen:
        seen.add(id(error))
        inner = getattr(error, "cause", None)
        inner = inner if isinstance(inner, BaseException) else error.__cause__
        if not isinstance(inner, BaseException):
            break
        error = inner
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    wrapper = type(error).__module__.split(".")[0] == "ray"
    text = (lines[-1] if wrapper else lines[0]) if lines else ""
    return f"{type(error).__name__}: {text}"[:300]


def _format_cell(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}" if abs(value) < 1e-3 or abs(value) >= 1e4 else f"{value:.4f}".rstrip("0").rstrip(".")
    return str(value)


def format_table(rows: list[dict]) -> str:
    """The trials as an aligned text table (one line per trial)."""
    if not rows:
        return "(no trials)"
    columns = [key for key in rows[0] if not key.startswith("_") and key != "error"]
    cells = [[_format_cell(row[c]) for c in columns] for row in rows]
    widths = [max(len(c), *(len(r[i]) for r in cells)) for i, c in enumerate(columns)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True))]
    lines += ["  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)) for r in cells]
    errors = [f"{row['trial']}: {row['error']}" for row in rows if row["error"]]
    return "\n".join(lines + (["", "errors:", *errors] if errors else []))


def _csv_text(rows: list[dict]) -> str:
    buffer = io.StringIO()
    columns = [key for key in rows[0] if not key.startswith("_")] if rows else []
    writer = csv.DictWriter(buffer, fieldnames=columns, extrasaction="ignore")
    writer.writeheader()
    writer.writerows(rows)
    return buffer.getvalue()


def write_best_config(row: dict, base_run_dir: str, path: Path, metric: str) -> Path:
    """Write the best trial's resolved config as a ``bigrank train``-ready YAML (``run_dir`` = the base's)."""
    raw = {key: value for key, value in row["_config"].items() if key != _CONTEXT}
    raw["run_dir"] = base_run_dir
    raw["train"]["progress"] = True
    config = _check_trial_config(raw)
    header = (
        f"# Best trial {row['trial']} of `bigrank tune` by validation {metric} "
        f"({_format_cell(row[f'valid {metric}'])}; test ap@10 {_format_cell(row['test ap@10'])}, "
        f"accuracy {_format_cell(row['test accuracy'])}, recall@100 {_format_cell(row['test recall@100'])}).\n"
        f"#   bigrank train {path}\n"
    )
    write_text_atomic(path, header + dump_config(config))
    return path


def _check_same_search(out: Path, identity: dict) -> None:
    path = out / "search.json"
    if path.is_file():
        saved = json.loads(path.read_text())
        if saved != identity:
            changed = sorted(key for key in identity if saved.get(key) != identity[key])
            raise ConfigError(
                f"{out} holds a search with another {' and '.join(changed)}: Ray Tune cannot change a search "
                "half-way; use another --out (or remove that directory to start over)"
            )


def run_search(
    config: Config,
    space: SearchSpace,
    out: str | os.PathLike,
    *,
    trials: int | None = None,
    address: str | None = None,
    max_concurrent: int | None = None,
    time_budget_s: float | None = None,
    callbacks: list | None = None,
    verbose: int = 0,
    base_trial: bool = True,
) -> SearchResult:
    """Run (or resume) the search of ``space`` around ``config``; write the trials table and the best config.

    Args:
        config: the base config (validated); every trial is this config with the space's values set.
        space: from :func:`load_space`; checked here with :func:`validate_space` before Ray starts.
        out: the experiment directory (Tune state, ``runs/``, ``trials.csv``, ``trials.txt``, ``best.yaml``).
        trials: samples of the space (default: the space file's ``trials``).
        address: a Ray cluster to join (default: ``ray.address``, ``RAY_ADDRESS``, else an embedded runtime).
        max_concurrent: at most this many trials at once (default: as many as the CPUs allow).
        time_budget_s: stop the search after this many seconds (running trials are stopped; a later run of
            the same search does not resume them).
        callbacks: extra Tune callbacks (tests).
        verbose: Tune's own progress output (0: none; each trial prints a line per evaluation).
        base_trial: run the base config's values of the sampled keys as the first trial (when they lie in the
            space; :func:`base_point`), so the search starts from the given settings.
    Returns a :class:`SearchResult`. Raises SpaceError/ConfigError naming the bad key before Ray starts, and
    RunDirectoryInUse when another process holds ``out`` (``bigrank.runlock``: one search at a time writes it).
    """
    from bigrank.runlock import hold_run_dir

    out = Path(out).resolve()
    base = search_base(config)
    validate_space(space, base)
    with hold_run_dir(out, "bigrank tune"):
        return _search(
            config, space, out, base, trials=trials, address=address, max_concurrent=max_concurrent,
            time_budget_s=time_budget_s, callbacks=callbacks, verbose=verbose, base_trial=base_trial,
        )  # fmt: skip


def _search(
    config: Config,
    space: SearchSpace,
    out: Path,
    base: dict,
    *,
    trials: int | None,
    address: str | None,
    max_concurrent: int | None,
    time_budget_s: float | None,
    callbacks: list | None,
    verbose: int,
    base_trial: bool,
) -> SearchResult:
    """:func:`run_search` once ``out`` is held: Tune's run, then the trials table and the best config."""
    import ray
    from ray import tune
    from ray.tune.schedulers import ASHAScheduler
    from ray.tune.search import BasicVariantGenerator

    from bigrank.launch.ray_train import init_ray, resolve_address

    trials = trials or space.trials
    identity = {"config": json.loads(json.dumps(base)), "space": json.loads(json.dumps(space.raw, default=str))}
    _check_same_search(out, identity)
    out.mkdir(parents=True, exist_ok=True)
    write_json_atomic(out / "search.json", identity)

    metric = f"valid/{space.metric}"
    max_t = _max_epochs(space, base)
    every = int(base["eval"]["every_epochs"])
    grace = space.grace_period or max(every, max_t // 4)
    scheduler = ASHAScheduler(
        time_attr="epoch",
        max_t=max_t,
        grace_period=min(grace, max_t),
        reduction_factor=space.reduction_factor,
    )
    resources = tune.PlacementGroupFactory([{"CPU": config.workers * config.ray.cpus_per_worker}])
    trainable = tune.with_resources(bigrank_trial, resources)
    address = resolve_address(config, address)
    owns_runtime = init_ray(config, address)
    try:
        if tune.Tuner.can_restore(str(out)):
            print(f"resuming the search in {out}", flush=True)
            tuner = tune.Tuner.restore(str(out), trainable=trainable, resume_unfinished=True, resume_errored=True)
        else:
            start = base_point(space, base) if base_trial else None
            if start is not None:
                print("the first trial runs the base config's values of the sampled keys", flush=True)
            tuner = tune.Tuner(
                trainable,
                param_space=param_space(space, base, out / "runs"),
                tune_config=tune.TuneConfig(
                    metric=metric,
                    mode="max",
                    scheduler=scheduler,
                    search_alg=BasicVariantGenerator(points_to_evaluate=[start] if start else None),
                    num_samples=trials,
                    max_concurrent_trials=max_concurrent or space.max_concurrent,
                    time_budget_s=time_budget_s,
                ),
                run_config=tune.RunConfig(
                    name=out.name,
                    storage_path=str(out.parent),
                    callbacks=callbacks,
                    verbose=verbose,
                    checkpoint_config=tune.CheckpointConfig(num_to_keep=1),
                ),
            )
        results = tuner.fit()
    finally:
        if owns_runtime:
            ray.shutdown()

    rows = _trial_rows(results, space)
    table = format_table(rows)
    if rows:
        write_text_atomic(out / "trials.csv", _csv_text(rows))
    write_text_atomic(out / "trials.txt", table + "\n")
    best_path = None
    finished = [row for row in rows if row["status"] == "finished" and row[f"valid {space.metric}"] is not None]
    if finished:
        best_path = write_best_config(finished[0], config.run_dir, out / "best.yaml", space.metric)
    return SearchResult(rows=rows, best_config=best_path, out=out, table=table)


# ----------------------------------------------------------------------------------------------------- CLI
def register(subparsers) -> None:
    """Add ``bigrank tune`` to the ``bigrank`` parser."""
    parser = subparsers.add_parser(
        "tune",
        help="hyper-parameter search on Ray Tune (ASHA); resumes when run again",
        description="Search the config keys of SPACE around CONFIG: every trial is a bigrank training run. Writes "
        "DIR/trials.csv, DIR/trials.txt and DIR/best.yaml (ready for `bigrank train`). Running the same command "
        "again resumes an interrupted search.",
    )
    parser.add_argument("config", metavar="CONFIG", help="base YAML config of every trial")
    parser.add_argument("--space", required=True, metavar="SPACE", help="search-space YAML file")
    parser.add_argument("--trials", type=int, default=None, help="samples of the space (default: the space file's)")
    parser.add_argument("--out", default=None, help="experiment directory (default: RUN_DIR-tune of CONFIG)")
    parser.add_argument(
        "--address",
        default=None,
        help="Ray cluster to join (HOST:6379 or ray://HOST:10001; default: ray.address, RAY_ADDRESS, else an "
        "embedded local runtime)",
    )
    parser.add_argument("--max-concurrent", type=int, default=None, help="trials at once (default: CPUs allow)")
    parser.add_argument("--time-budget", type=float, default=None, metavar="SECONDS", help="stop the search then")
    parser.add_argument(
        "--no-base-trial",
        dest="base_trial",
        action="store_false",
        help="sample every trial (default: the first trial runs CONFIG's own values of the sampled keys when they "
        "lie in the space)",
    )
    add_override_argument(parser)
    parser.set_defaults(func=run_tune, resumable=True)


def run_tune(args: argparse.Namespace) -> int:
    from bigrank.data.manifest import load_manifest

    if args.trials is not None and args.trials < 1:
        raise ConfigError(f"--trials must be >= 1, got {args.trials}")
    config = load_config(args.config, args.overrides)
    space = load_space(args.space)
    load_manifest(config.data.root)  # a missing dataset is reported before Ray starts
    out = Path(args.out) if args.out else Path(config.run_dir + "-tune")
    result = run_search(
        config,
        space,
        out,
        trials=args.trials,
        address=args.address,
        max_concurrent=args.max_concurrent,
        time_budget_s=args.time_budget,
        base_trial=args.base_trial,
    )
    print(result.table)
    print(f"\ntrials: {result.out / 'trials.csv'}")
    if result.best_config is not None:
        print(f"best config: {result.best_config}  (bigrank train {result.best_config})")
        return 0
    statuses = [row["status"] for row in result.rows]
    counts = ", ".join(f"{statuses.count(status)} {status}" for status in sorted(set(statuses))) or "none ran"
    print(f"no trial finished ({counts}): no best config written", file=sys.stderr)
    if statuses and set(statuses) == {"error"}:
        first = result.rows[0]
        print(f"every trial failed; trial {first['trial']}: {first['error']}", file=sys.stderr)
    else:
        print(f"see {result.out / 'trials.txt'}; an interrupted search resumes with the same command", file=sys.stderr)
    return 1  # no best config: a script that goes on to `bigrank train DIR/best.yaml` must not
