"""Reproduce the "ML 100K" columns of Table 2 of the Rankmax paper on ml-latest-small.

Ingests ``../shared/datasets/ml-latest-small`` (80/10/10 random split over (user, item) pairs, as in the paper),
then for each loss (rankmax, softmax, sparsemax) trains ``configs/ml-latest-small-<loss>.yaml`` once per learning
rate of ``--lrs`` (user and item learning rates together), picks the rate with the best validation AP@10 and
prints the test AP@10 / Accuracy / R@100 of that run beside the paper's figures.

AP@K here is (1 / min(K, |relevant|)) * sum_{i <= K} precision@i * rel_i (``bigrank.train.metrics``); the paper
does not state its normalisation, so differences of this kind are expected on top of model differences.

    .venv/bin/python -m benchmarks.reproduce_table2 [--epochs 20] [--lrs 0.02 0.05 0.1] [--work runs/table2]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

PAPER = {  # Table 2, ML 100K: AP@10, Accuracy, R@100
    "rankmax": (0.154, 0.342, 0.387),
    "softmax": (0.147, 0.300, 0.401),
    "sparsemax": (0.147, 0.286, 0.384),
}
ROOT = Path(__file__).resolve().parents[1]


def bigrank(*args: str) -> None:
    command = [sys.executable, "-m", "bigrank.cli", *args]
    print("$", " ".join(command[2:]), flush=True)
    subprocess.run(command, check=True, cwd=ROOT)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", default=str(ROOT.parent / "shared" / "datasets" / "ml-latest-small"))
    parser.add_argument("--work", default="runs/table2")
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--lrs", type=float, nargs="+", default=[0.02, 0.05, 0.1])
    parser.add_argument("--losses", nargs="+", default=list(PAPER))
    args = parser.parse_args()

    work = ROOT / args.work
    data = work / "data"
    if not (data / "manifest.json").exists():
        if not Path(args.source).exists():
            sys.exit(f"reproduce_table2: {args.source} not found (ml-latest-small is needed)")
        bigrank("ingest", args.source, "--out", str(data), "--split", "random", "--seed", "0")
    results = {}
    for loss in args.losses:
        runs = []
        for lr in args.lrs:
            run_dir = work / f"{loss}-lr{lr:g}"
            started = time.perf_counter()
            if not (run_dir / "eval.json").exists():
                bigrank(
                    "train", f"configs/ml-latest-small-{loss}.yaml", "--launcher", "local",
                    "--set", f"data.root={data}", "--set", f"run_dir={run_dir}",
                    "--set", f"train.epochs={args.epochs}", "--set", f"optim.user_lr={lr}",
                    "--set", f"optim.item_lr={lr}", "--set", "train.progress=false",
                )  # fmt: skip
            evaluation = json.loads((run_dir / "eval.json").read_text())
            runs.append((evaluation["valid"]["ap@10"], lr, evaluation, time.perf_counter() - started))
            print(f"{loss} lr={lr:g}: valid ap@10={runs[-1][0]:.4f}", flush=True)
        results[loss] = max(runs, key=lambda run: run[0])

    print(f"\nml-latest-small, {args.epochs} epochs, learning rate tuned on valid AP@10 over {args.lrs}")
    print(f"{'loss':<10}{'lr':>7}{'AP@10':>8}{'paper':>7}{'Acc':>8}{'paper':>7}{'R@100':>8}{'paper':>7}")
    for loss, (_, lr, evaluation, _) in results.items():
        test = evaluation["test"]
        ap, acc, r100 = PAPER[loss]
        print(
            f"{loss:<10}{lr:>7g}{test['ap@10']:>8.3f}{ap:>7.3f}{test['accuracy']:>8.3f}{acc:>7.3f}"
            f"{test['recall@100']:>8.3f}{r100:>7.3f}"
        )


if __name__ == "__main__":
    main()
