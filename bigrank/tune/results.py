"""The results of a search: one row per trial (status, tuned values, epochs, metrics), the tables written to
``DIR/trials.csv`` and ``DIR/trials.txt``, and ``DIR/best.yaml``."""

from __future__ import annotations

import csv
import io
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bigrank.atomic import write_text_atomic
from bigrank.config import (
    dump_config,
    get_key,
)
from bigrank.tune.space import (
    _CONTEXT,
    SearchSpace,
    _check_trial_config,
)


@dataclass
class SearchResult:
    """What :func:`run_search` returns: the table rows (best first), the best config's path and the directory;
    ``stopped_by``: the signal (SIGINT/SIGTERM number) that ended the search early, None when it ran out."""

    rows: list[dict]
    best_config: Path | None
    out: Path
    table: str
    stopped_by: int | None = None


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
            row[key] = get_key(config, key)
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
