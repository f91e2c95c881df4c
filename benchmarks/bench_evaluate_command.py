"""`bigrank evaluate` as a user runs it, process start to exit, in units of the same machine's training step.

Issue 28's yardstick: ``bigrank evaluate RUN --split test --sample-users 10000`` on an ML-1B run should take no
longer than 150 sampled-softmax training steps (global batch 4096, 8,192 negatives, 2 workers) measured in the
same run of this script, so that the figure does not depend on how busy the machine is.

1. Trains a short run on ``--data`` (default ``/work/data/ml1b``: ``bigrank generate --preset ml1b``) with those
   settings, ``--steps`` steps, one checkpoint at the end; the step time is the median of the logged windows
   after the first (start-up and warm-up excluded).
2. Times ``bigrank evaluate`` on that run's checkpoint (loading, the train-pair exclusion, the scoring, writing
   ``eval.json``: everything between the process start and its exit), once with the certified bf16 ranking
   (``eval.certified_bf16: true``, the default), once in fp32 and once certified with ``--no-index`` (the split
   files read instead of the dataset's user indexes, which are built first, apart), and checks that all report
   the same metrics (the certified top-K is the fp32 top-K, so every metric must agree to the last digit).

    .venv/bin/python -m benchmarks.bench_evaluate_command [--data /work/data/ml1b] [--steps 24] [--keep RUN]

Measured 2026-11-25 (2 cores, load 2): step 0.158 s; evaluate 48.2 s certified bf16 (305 steps), 48.6 s fp32
(308 steps), identical metrics: above the 150-step target (the issue's first figure: 92 s = 444 steps).

Profiled 2026-11-26 (py-spy ``record --subprocesses --idle`` of the command on a kept run, an AMD EPYC VM, 2 cores
shared with other jobs): each worker spent ~40 % of its time reading the dataset (every rank read all of train's
~800M rows to find the 10K users' train items, and numpy 2.4's ``np.unique`` of the pairs found cost an eighth of
that), ~45 % ranking (the fp32 GEMM and candidate selection; the "certified bf16" run ran the fp32 path too:
``rescoring_is_exact`` was False on this CPU, whose MKL ``bmm`` differs from its GEMM in the last bit), ~7 %
imports (torch, torchrec), ~4 % building the model and loading the checkpoint. Since then the ranks read
disjoint shares of the files and exchange the pairs (``bigrank.train.evaluate``), and the candidates are rescored
by the GEMM itself where ``bmm`` differs (``bigrank.model.topk``). Same kept run, same metrics to the last digit,
main's code and this version's alternated from the same working directory (same CPU share) on that VM at load 4-9
(absolute times are not comparable with the figures above): main 159.6 s and 67.1 s wall, 99.6 s and 103.2 s CPU
(user + sys of the process tree); this version 45.9 s and 38.7 s wall, 73.9 s and 66.2 s CPU. The step times of
this script's own runs at that load (0.175 s, then 2.8 s) were too unsteady for a figure in steps.

Measured 2026-11-26 on a quiet machine (load 1.2-1.9, the AMD EPYC VM, this version): step 0.144 s; evaluate
34.4 s certified bf16 (238 steps), 38.2 s fp32 (265 steps), identical metrics: still above the 150-step target.

Since then evaluation reads the users' items from a per-user index of each split cached beside the dataset
(``bigrank.data.user_index``; built before the timings, its time printed apart), and a third row times
``--no-index``, the files read as before. Measured 2026-11-26 (the AMD EPYC VM, 2 cores shared with another
job, load 3.4-3.7; one run, so noisy): step 0.176 s; evaluate 27.1 s certified bf16 (154 steps), 52.8 s fp32
(299 steps), 61.7 s certified with ``--no-index`` (350 steps), identical metrics. The read phase alone (10K users,
one process) went from 12.0-18.4 s to 0.4 s (page cache warm) / 1.4 s (cold); the whole command with 2 workers on
a kept ML-1B run, alternated at load 2-5: 69.0 s -> 58.6 s wall, 62.6 s -> 49.2 s CPU (user + sys of the tree).

Measured again 2026-11-26 on a quieter machine (load 1.4-1.8, the evaluate workers with ``OMP_WAIT_POLICY=PASSIVE``,
``bigrank.run.INFERENCE_ENV``): step 0.150 s; evaluate 25.7 s certified bf16 (172 steps), 30.1 s fp32 (201),
35.5 s certified with ``--no-index`` (236), identical metrics. On a kept run, ``--workers 1`` 24.6 and 25.0 s
wall (35 s CPU) against ``--workers 2`` 25.8 s (45 s CPU): still above the 150-step target (22.5 s here).

Measured 2026-11-26 at the end of the day (quiet, load 1.8-2.7), after a loaded model stopped drawing initial rows,
bf16 chunks doubled and the ranks' merge became one top-k: step 0.168 / 0.171 s; evaluate 21.9 / 21.6 s certified
bf16 (130 / 126 steps: the target is met), 27.2 / 26.3 s fp32, 30.3 / 28.9 s with ``--no-index``, identical metrics.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from bigrank.records import EVAL, TrainRecord, read_metrics

ROOT = Path(__file__).resolve().parents[1]
TARGET_STEPS = 150  # issue 28: evaluation of 10K ML-1B users within this many training steps


def _bigrank(*args: str) -> float:
    """Run ``bigrank ARGS`` (stdout discarded); seconds from process start to exit."""
    started = time.perf_counter()
    subprocess.run([sys.executable, "-m", "bigrank.cli", *args], cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - started


def train_short_run(data: str, run_dir: Path, steps: int, batch: int, negatives: int, dim: int) -> float:
    """Train ``steps`` sampled-softmax steps into ``run_dir`` (2 local workers); the median seconds per step."""
    config = {
        "data": {"root": data},
        "run_dir": str(run_dir),
        "workers": 2,
        "model": {"dim": dim},
        "loss": {"name": "sampled_softmax", "candidates": "sampled", "num_negatives": negatives},
        "optim": {"user_optimizer": "rowwise_adagrad", "item_optimizer": "rowwise_adagrad"},
        # fp32 steps, as the issue measured its yardstick (0.21 s)
        "train": {
            "batch_size": batch,
            "max_steps": steps,
            "log_every": max(1, steps // 8),
            "progress": False,
            "precision": "fp32",
        },  # fmt: skip
        "eval": {"every_epochs": None, "at_end": False, "ks": [10, 100, 1000]},
    }
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir.parent / f"{run_dir.name}.yaml"
    path.write_text(yaml.safe_dump(config))
    _bigrank("train", str(path), "--launcher", "local")
    records = [r for r in read_metrics(run_dir) if isinstance(r, TrainRecord)]
    return statistics.median(batch / r.examples_per_s for r in records[1:])


def set_certified(run_dir: Path, certified: bool) -> None:
    """Switch ``eval.certified_bf16`` in the run's config (an evaluation key: changing it is allowed)."""
    path = run_dir / "config.yaml"
    config = yaml.safe_load(path.read_text())
    config.setdefault("eval", {})["certified_bf16"] = certified
    path.write_text(yaml.safe_dump(config))


def time_evaluate(run_dir: Path, users: int, certified: bool, index: bool = True) -> tuple[float, dict]:
    """Seconds of ``bigrank evaluate RUN --split test --sample-users USERS`` (``index=False``: ``--no-index``),
    and its test metrics."""
    set_certified(run_dir, certified)
    flags = () if index else ("--no-index",)
    seconds = _bigrank("evaluate", str(run_dir), "--split", "test", "--sample-users", str(users), *flags)
    return seconds, json.loads((run_dir / EVAL).read_text())["test"]


def build_indexes(data: str) -> float:
    """Seconds to make sure ``data`` has the user indexes of test and train (``bigrank.data.user_index``): the
    first ``bigrank evaluate`` of a dataset builds them, once; built here, they are not in its timings."""
    from bigrank.data.manifest import DatasetManifest
    from bigrank.data.user_index import ensure_index

    started = time.perf_counter()
    manifest = DatasetManifest.load(data)
    for split in ("test", "train"):
        ensure_index(manifest, split, progress=print)
    return time.perf_counter() - started


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default="/work/data/ml1b", help="dataset root (bigrank generate --preset ml1b)")
    parser.add_argument("--steps", type=int, default=24, help="training steps of the short run")
    parser.add_argument("--batch", type=int, default=4096)
    parser.add_argument("--negatives", type=int, default=8192)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--users", type=int, default=10_000, help="--sample-users of the evaluation")
    parser.add_argument("--keep", default=None, help="run directory to keep (default: a temporary one)")
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory() as scratch:
        run_dir = Path(args.keep) if args.keep else Path(scratch) / "run"
        step = train_short_run(args.data, run_dir, args.steps, args.batch, args.negatives, args.dim)
        index_seconds = build_indexes(args.data)
        timings = {
            "certified bf16": time_evaluate(run_dir, args.users, True),
            "fp32": time_evaluate(run_dir, args.users, False),
            "certified bf16, --no-index (reads the files)": time_evaluate(run_dir, args.users, True, index=False),
        }
    load = subprocess.run(["uptime"], capture_output=True, text=True, check=False).stdout.strip()
    print(f"\n{args.data}: sampled softmax, batch {args.batch}, {args.negatives} negatives, d {args.dim}, 2 workers")
    print(f"training step (median of {args.steps} steps' windows after the first): {step:.3f} s")
    print(f"{'bigrank evaluate --sample-users ' + str(args.users):<44}{'seconds':>10}{'steps':>10}{'target':>10}")
    for name, (seconds, _) in timings.items():
        print(f"{'  ' + name:<44}{seconds:>10.1f}{seconds / step:>10.0f}{TARGET_STEPS:>10}")
    print(f"user indexes of test and train (once per dataset, not timed above): {index_seconds:.1f} s")
    same = len({json.dumps(metrics, sort_keys=True) for _, metrics in timings.values()}) == 1
    print(f"metrics of every evaluation identical: {same}")
    print(f"load: {load}")
    if not same:
        first_name, (_, first) = next(iter(timings.items()))
        for name, (_, metrics) in timings.items():
            for key in sorted(set(first) | set(metrics)):
                if metrics.get(key) != first.get(key):
                    print(f"  {key}: {first_name} {first.get(key)!r}, {name} {metrics.get(key)!r}")
        raise SystemExit("the evaluations disagree")


if __name__ == "__main__":
    main()
