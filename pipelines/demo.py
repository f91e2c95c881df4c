"""The end-to-end demo (`make demo`): generate → train on Ray → evaluate → export → recommend.

    python -m pipelines.demo [--set KEY=VALUE ...] [--user ID] [--fresh]

1. generates the synthetic ``demo`` dataset into ``data/demo`` (skipped when it is already there);
2. trains ``configs/demo.yaml`` with 2 workers on an embedded local Ray runtime (Ray Train + gloo), which
   evaluates Recall@K / AP@K / Accuracy over the full catalog on valid and test into ``runs/demo/eval.json``;
3. prints that evaluation table;
4. exports the user and item embeddings to ``runs/demo/export`` (``bigrank export``);
5. prints one user's top-10 unseen items (``bigrank.export.Recommender``), marking the user's held-out items.

Each step prints the ``bigrank`` command it is equivalent to. Running it again resumes the finished run
(nothing is retrained) unless ``--fresh`` is given. Paths are relative to the repository root.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

from bigrank import cli, run
from bigrank.config import add_override_argument, load_config
from bigrank.errors import CommandError
from bigrank.export.recommend import Recommender, SeenItems
from bigrank.train.evaluate import format_eval_table

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "configs" / "demo.yaml"


def _step(title: str, command: str) -> float:
    print(f"\n== {title}\n$ {command}", flush=True)
    return time.perf_counter()


def _relative(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(REPO))
    except ValueError:
        return str(path)


def generate(data_root: Path) -> None:
    """The ``demo`` preset into ``data_root`` unless a finished dataset (manifest.json) is there."""
    if (data_root / "manifest.json").is_file():
        print(f"\n== data: {_relative(data_root)} already exists (delete it to regenerate)")
        return
    started = _step("generate the demo dataset", f"bigrank generate --preset demo --out {_relative(data_root)}")
    if cli.main(["generate", "--preset", "demo", "--out", str(data_root)]) != 0:
        raise SystemExit("generating the demo dataset failed")
    print(f"({time.perf_counter() - started:.0f} s)")


def train(config) -> dict:
    """Train ``config`` on an embedded Ray runtime (Ray Train TorchTrainer, gloo); returns the summary."""
    started = _step(
        f"train {config.loss.name} with {config.workers} workers on an embedded Ray runtime",
        f"bigrank train {_relative(CONFIG)} --launcher ray",
    )
    summary = run.train(config, launcher="ray")  # the pre-flight, then Ray Train
    print(run.format_summary(summary))
    print(f"(training {time.perf_counter() - started:.0f} s, of which Ray start {summary['ray_start_seconds']:.0f} s)")
    return summary


def show_evaluation(run_dir: Path) -> dict:
    path = run_dir / "eval.json"
    _step("evaluation (full catalog, held-out splits)", f"cat {_relative(path)}   # or: bigrank evaluate ...")
    if not path.is_file():
        raise SystemExit(f"{path} is missing: the run did not evaluate (eval.at_end: false?)")
    results = json.loads(path.read_text())
    print(format_eval_table(results))
    return results


def export(run_dir: Path, out: Path) -> None:
    started = _step("export the embeddings", f"bigrank export {_relative(run_dir)} --out {_relative(out)}")
    if cli.main(["export", str(run_dir), "--out", str(out)]) != 0:
        raise SystemExit("export failed")
    print(f"({time.perf_counter() - started:.0f} s)")


def recommend(out: Path, data_root: Path, user: int, k: int = 10) -> list[dict]:
    """Top-``k`` items of ``user`` it did not rate in train; marks the items it rated in valid/test."""
    _step(
        f"top {k} recommendations of user {user}",
        f"bigrank recommend {_relative(out)} --user {user} -k {k} --exclude-seen {_relative(data_root)} "
        "--seen-splits train",
    )
    recommender = Recommender(out)
    train_items = SeenItems(data_root, ("train",)).items_of(user)
    held_out = set(SeenItems(data_root, ("valid", "test")).items_of(user).tolist())
    rows = recommender.recommend(user, k, train_items)
    print(f"{'rank':>4}  {'item_id':>7}  {'score':>7}  held out (valid/test)")
    for rank, row in enumerate(rows, 1):
        mark = "yes" if row["item_id"] in held_out else ""
        print(f"{rank:>4}  {row['item_id']:>7}  {row['score']:>7.4f}  {mark}")
    hits = sum(1 for row in rows if row["item_id"] in held_out)
    print(f"{hits} of the top {k} are items user {user} rated in valid/test ({len(held_out)} such items)")
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pipelines.demo", description=__doc__.splitlines()[0])
    add_override_argument(parser)
    parser.add_argument("--user", type=int, default=0, help="user whose recommendations are shown (default 0)")
    parser.add_argument("--fresh", action="store_true", help="delete the run directory first (train from scratch)")
    args = parser.parse_args(argv)
    os.chdir(REPO)  # configs/demo.yaml's paths (data/demo, runs/demo) are relative to the repository root
    started = time.perf_counter()
    try:
        config = load_config(CONFIG, args.overrides)
        data_root, run_dir = Path(config.data.root), Path(config.run_dir)
        if args.fresh and run_dir.exists():
            shutil.rmtree(run_dir)
        generate(data_root)
        train(config)
        show_evaluation(run_dir)
        out = run_dir / "export"
        export(run_dir, out)
        recommend(out, data_root, args.user)
    except (CommandError, FileNotFoundError, ValueError) as error:
        print(f"demo: error: {error}", file=sys.stderr)
        return 2
    print(
        f"\n== done in {time.perf_counter() - started:.0f} s\n"
        f"run (config, checkpoints, metrics.jsonl, eval.json, TensorBoard): {_relative(run_dir)}\n"
        f"exported embeddings (Parquet parts + manifest.json):              {_relative(out)}\n"
        f"try: bigrank recommend {_relative(out)} --user 7 -k 10    |    bigrank serve {_relative(out)}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
