"""Loss and evaluation metrics over epochs for several runs, on one figure (``bigrank plot``: ``bigrank.cli.plot``).

One figure, like the Rankmax paper's Figure 2 (metrics as a function of the number of epochs): a panel with the
training loss, then one panel per evaluation metric found in the runs (``ap@K``, ``accuracy``, ``recall@K``,
``ndcg@K``), one line per run (and per split: valid solid, test dashed). Runs are labelled
``<run dir name> (<loss name>)``, the loss name read from ``RUN_DIR/config.yaml`` (``loss: {name: ...}``) when
present.

The records are those of ``RUN_DIR/metrics.jsonl`` (``bigrank.records``: their schema, and what a bad or cut-
short line does): the training loss against ``epoch`` (epochs done, fractional), and every evaluation metric
(``accuracy``, ``<name>@<K>``). When a step appears twice (a run resumed from a checkpoint redid it), the later
line wins.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from pathlib import Path

import yaml

from bigrank.records import METRICS as METRICS_NAME
from bigrank.records import TrainRecord, read_metrics

CONFIG_NAME = "config.yaml"
SPLIT_STYLES = {"valid": "-", "test": "--"}


def read_run(run_dir: str | Path) -> dict:
    """The records of one run: ``{"name", "label", "train": [records by step], "eval": [records]}``.

    ``train`` holds the training records sorted by step; ``eval`` the evaluation records sorted by (split, epoch).
    Raises FileNotFoundError when the run directory or its metrics.jsonl is missing, ValueError on a bad line.
    """
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise FileNotFoundError(f"run directory does not exist: {run_dir}")
    train: dict[int, dict] = {}
    evals: dict[tuple[str, int], dict] = {}
    for record in read_metrics(run_dir):  # later lines win: a resumed run redid those steps
        if isinstance(record, TrainRecord):
            train[record.step] = record.to_json()
        else:
            evals[(record.split, record.step)] = record.to_json()
    return {
        "name": run_dir.resolve().name,
        "label": run_label(run_dir),
        "train": [train[step] for step in sorted(train)],
        "eval": sorted(evals.values(), key=lambda r: (str(r["split"]), float(r["epoch"]))),
    }


def run_label(run_dir: str | Path) -> str:
    """``<run dir name> (<loss name>)``, or the bare name when ``config.yaml`` is missing, names no loss or the
    loss name is the run dir's name."""
    run_dir = Path(run_dir)
    name = run_dir.resolve().name
    path = run_dir / CONFIG_NAME
    if not path.is_file():
        return name
    try:
        config = yaml.safe_load(path.read_text())
    except yaml.YAMLError:
        return name
    loss = config.get("loss") if isinstance(config, dict) else None
    loss_name = loss.get("name") if isinstance(loss, dict) else loss
    if not isinstance(loss_name, str) or not loss_name or loss_name == name:
        return name
    return f"{name} ({loss_name})"


def metric_keys(eval_records: Sequence[dict]) -> list[str]:
    """The metric keys of evaluation records, in panel order: ``ap@K`` (K ascending), ``accuracy``, ``recall@K``,
    ``ndcg@K``, then any other ``<name>@<K>``."""
    keys = set()
    for record in eval_records:
        for key, value in record.items():
            if (key == "accuracy" or "@" in key) and _is_number(value):
                keys.add(key)

    def order(key: str):
        name, _, k = key.partition("@")
        rank = {"ap": 0, "accuracy": 1, "recall": 2, "ndcg": 3}.get(name, 4)
        return (rank, name, int(k) if k.isdigit() else math.inf, key)

    return sorted(keys, key=order)


def panel_title(key: str) -> str:
    """The title of a metric's panel: ``ap@10`` -> ``AP@10``, ``recall@20`` -> ``R@20``, ``ndcg@20`` -> ``NDCG@20``,
    ``accuracy`` -> ``Accuracy``; any other key as is."""
    name, at, k = key.partition("@")
    titles = {"ap": "AP", "recall": "R", "ndcg": "NDCG", "accuracy": "Accuracy"}
    return f"{titles.get(name, name)}{at}{k}"


def _is_number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _smoothed(values: list[float], window: int) -> list[float]:
    """Trailing moving average (the first points average what exists so far)."""
    out, total = [], 0.0
    for i, value in enumerate(values):
        total += value
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def plot_runs(run_dirs: Sequence[str | Path], out: str | Path, *, title: str | None = None) -> Path:
    """Draw the loss and evaluation metrics over epochs of ``run_dirs`` on one figure saved to ``out``.

    Returns the path written. The image is written to a temporary file and renamed into place.
    Raises FileNotFoundError/ValueError (naming the run) when a run has no or a bad ``metrics.jsonl`` or nothing
    to plot.
    """
    import matplotlib  # optional and slow to import: only for this command

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not run_dirs:
        raise ValueError("give at least one run directory")
    runs = [read_run(run_dir) for run_dir in run_dirs]
    for run_dir, run in zip(run_dirs, runs, strict=True):
        if not run["train"] and not run["eval"]:
            raise ValueError(f"{Path(run_dir) / METRICS_NAME} holds no training or evaluation records")
    keys = metric_keys([record for run in runs for record in run["eval"]])
    panels = ["loss"] + keys
    columns = 2 if len(panels) == 4 else min(len(panels), 3)
    rows = math.ceil(len(panels) / columns)
    figure, axes = plt.subplots(rows, columns, figsize=(5.2 * columns, 3.8 * rows), squeeze=False)
    axes = axes.ravel()
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    splits = sorted({str(r["split"]) for run in runs for r in run["eval"]}, key=lambda s: (s != "valid", s))

    for index, run in enumerate(runs):
        color = colors[index % len(colors)]
        train = run["train"]
        if train:
            window = max(1, len(train) // 50)
            epochs = [float(r["epoch"]) for r in train]
            losses = [float(r["loss"]) for r in train]
            axes[0].plot(epochs, _smoothed(losses, window), color=color, label=run["label"], linewidth=1.2)
        for key_index, key in enumerate(keys, start=1):
            for split in splits:
                points = [
                    (float(r["epoch"]), float(r[key]))
                    for r in run["eval"]
                    if r["split"] == split and _is_number(r.get(key))
                ]
                if points:
                    x, y = zip(*points, strict=True)
                    axes[key_index].plot(
                        x,
                        y,
                        SPLIT_STYLES.get(split, ":"),
                        color=color,
                        marker="o",
                        markersize=3,
                        label=f"{run['label']} · {split}",
                    )

    axes[0].set_title("training loss")
    for axis, panel in zip(axes, panels, strict=False):
        if panel != "loss":
            axis.set_title(panel_title(panel))
        axis.set_xlabel("epoch")
        axis.grid(True, alpha=0.3)
    axes[0].set_ylabel("loss")
    for axis in axes[len(panels) :]:
        axis.set_visible(False)
    axes[0].legend(fontsize="small")
    if keys:
        axes[1].legend(fontsize="small")
    if title:
        figure.suptitle(title)
    figure.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.stem}.tmp-{os.getpid()}{out.suffix}")
    figure.savefig(tmp, dpi=110)
    plt.close(figure)
    os.replace(tmp, out)
    return out
