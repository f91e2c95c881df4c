"""The records of a run directory: one owner for their names, their schema, writing them and reading them.

::

    RUN_DIR/metrics.jsonl   one JSON object a line, appended while the run trains:
                              TrainRecord  {"type": "train", "step", "epoch", "loss", "examples_per_s", "lr", …}
                              EvalRecord   {"type": "eval", "split", "step", "epoch", "accuracy", "ap@10", …}
    RUN_DIR/eval.json       {split: {metric: value, "step", "epoch", …}}: the last evaluation of each split
    RUN_DIR/plan.txt        the layout the cost model chose and the torchrec sharding plan (plan.json: the plan)
    RUN_DIR/config.yaml     the resolved config (``bigrank.config.save_config``)

Every writer and reader of these files goes through this module: the trainer, evaluation, ``bigrank plot``,
``bigrank tune``, the benchmarks and the tests. ``epoch`` in a train record is the number of epochs done,
fractional. A record's metrics are every key ``accuracy`` or ``<name>@<K>`` with a number.

Reading tolerates what a kill leaves: a last line cut short is skipped (a line being written, or a run killed
mid-write); any other line that is not a JSON object is an error naming the file and the line. ``"kind"`` is
accepted in place of ``"type"`` (older runs); a line without either is a train record when it has a ``loss``.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bigrank.atomic import update_lock, write_json_atomic, write_text_atomic

__all__ = [
    "CONFIG",
    "EVAL",
    "METRICS",
    "PLAN_JSON",
    "PLAN_TEXT",
    "EvalRecord",
    "TrainRecord",
    "append_record",
    "read_eval_json",
    "read_metrics",
    "truncate_metrics",
    "write_eval_json",
]

METRICS = "metrics.jsonl"
EVAL = "eval.json"
PLAN_TEXT = "plan.txt"
PLAN_JSON = "plan.json"
CONFIG = "config.yaml"
METRIC_NAME = re.compile(r"accuracy|[a-z_]+@\d+")


@dataclass(frozen=True)
class TrainRecord:
    """One logging window of training: the mean loss of its steps, at ``step`` (global), ``epoch`` done."""

    step: int
    epoch: float
    loss: float
    examples_per_s: float | None = None
    lr: float | None = None
    user_lr: float | None = None
    temperature: float | None = None  # candidate losses with a warm-up schedule

    def to_json(self) -> dict[str, Any]:
        values = {key: value for key, value in self.__dict__.items() if value is not None}
        return {"type": "train", **values}


@dataclass(frozen=True)
class EvalRecord:
    """One evaluation of ``split`` at ``step``: ``metrics`` {``accuracy`` | ``<name>@<K>``: value}, plus any other
    keys the evaluation reported (``extra``: users evaluated…)."""

    split: str
    step: int
    epoch: float
    metrics: dict[str, float]
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"type": "eval", "split": self.split, "step": self.step, "epoch": self.epoch, **self.extra,
                **self.metrics}  # fmt: skip

    @classmethod
    def from_results(cls, split: str, step: int, epoch: float, results: Mapping[str, Any]) -> EvalRecord:
        """From an evaluation's result mapping (``evaluate_model``): its metric keys and the rest."""
        metrics = {key: value for key, value in results.items() if _is_metric(key, value)}
        extra = {key: value for key, value in results.items() if key not in metrics}
        return cls(split, int(step), float(epoch), metrics, extra)


def _is_metric(key: str, value) -> bool:
    return bool(METRIC_NAME.fullmatch(key)) and isinstance(value, int | float) and not isinstance(value, bool)


# ---------------------------------------------------------------------------------------------- metrics.jsonl
def append_record(run_dir: str | Path, record: TrainRecord | EvalRecord) -> None:
    """Append one record (a line) to ``RUN_DIR/metrics.jsonl``."""
    with open(Path(run_dir) / METRICS, "a") as handle:
        handle.write(json.dumps(record.to_json()) + "\n")


def truncate_metrics(run_dir: str | Path, step: int) -> None:
    """Keep the records up to ``step`` (a run resuming from its checkpoint of ``step`` logs the rest again) and
    drop a line cut short by a kill; atomic."""
    path = Path(run_dir) / METRICS
    if not path.exists():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
            at = int(record.get("step", 0))
        except (ValueError, AttributeError):
            continue
        if at <= step:
            kept.append(line)
    write_text_atomic(path, "".join(line + "\n" for line in kept))


def read_metrics(run_dir: str | Path) -> list[TrainRecord | EvalRecord]:
    """The records of ``RUN_DIR/metrics.jsonl`` in file order (records of other types are skipped).

    Raises FileNotFoundError when the file is missing, ValueError (naming the file and line) on a line that is
    not a record — except a last line cut short, which is skipped."""
    path = Path(run_dir) / METRICS
    if not path.is_file():
        raise FileNotFoundError(f"no {METRICS} in {run_dir}: not a bigrank run directory, or nothing logged yet")
    lines = path.read_text().splitlines()
    records = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            raw = json.loads(line)
        except json.JSONDecodeError as error:
            if number == len(lines):  # the last write was cut short, or is being written
                break
            raise ValueError(f"{path}, line {number}: not valid JSON: {error}") from error
        record = _parse(raw, f"{path}, line {number}")
        if record is not None:
            records.append(record)
    return records


def _parse(raw, where: str) -> TrainRecord | EvalRecord | None:
    if not isinstance(raw, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(raw).__name__}")
    kind = raw.get("type", raw.get("kind", "train" if "loss" in raw else None))
    if kind not in ("train", "eval"):
        return None
    needed = ("step", "epoch") + (("loss",) if kind == "train" else ("split",))
    for key in needed:
        if key not in raw:
            raise ValueError(f"{where}: a {kind} record needs {key!r}; it has {sorted(raw)}")
    if kind == "train":
        optional = {key: raw.get(key) for key in ("examples_per_s", "lr", "user_lr", "temperature")}
        return TrainRecord(int(raw["step"]), float(raw["epoch"]), float(raw["loss"]), **optional)
    rest = {key: value for key, value in raw.items() if key not in ("type", "kind", "split", "step", "epoch")}
    return EvalRecord.from_results(str(raw["split"]), int(raw["step"]), float(raw["epoch"]), rest)


# ------------------------------------------------------------------------------------------------- eval.json
def write_eval_json(run_dir: str | Path, results_by_split: Mapping[str, Mapping]) -> Path:
    """Write ``RUN_DIR/eval.json`` atomically (temp file + ``os.replace``) with one section per split.

    ``results_by_split`` maps a split name (``"valid"``, ``"test"``) to its ``evaluate_model`` result (extra keys
    such as ``epoch``/``step`` are kept). Sections already in the file for other splits are kept, so valid and
    test may be written at different times, also by two processes at once (they take turns: ``update_lock``);
    NaN values are written as ``null``. Returns the path.
    """
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise FileNotFoundError(f"run directory does not exist: {run_dir}")
    # Two writers at once (`bigrank evaluate --splits valid` and `--splits test`, or an evaluate while the run
    # trains) must not drop each other's sections: each reads, merges and writes while holding the lock.
    with update_lock(run_dir / EVAL):
        sections = read_eval_json(run_dir) if (run_dir / EVAL).is_file() else {}
        for split, result in results_by_split.items():
            sections[split] = {key: _json_value(value) for key, value in result.items()}
        return write_json_atomic(run_dir / EVAL, sections)


def read_eval_json(run_dir: str | Path) -> dict[str, dict[str, Any]]:
    """``{split: section}`` of ``RUN_DIR/eval.json``; FileNotFoundError when missing, ValueError when not a JSON
    object."""
    path = Path(run_dir) / EVAL
    if not path.is_file():
        raise FileNotFoundError(f"no {EVAL} in {run_dir}: the run has not been evaluated (bigrank evaluate)")
    try:
        sections = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{path} is not valid JSON: {error}") from error
    if not isinstance(sections, dict):
        raise ValueError(f"{path} does not hold a JSON object")
    return sections


def _json_value(value):
    if hasattr(value, "item") and callable(value.item):  # numpy / torch scalars
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value
