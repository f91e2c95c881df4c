"""The daily refresh, measured: yesterday's model as is, a warm start, and a retrain from nothing (issue 41).

    .venv/bin/python -m benchmarks.bench_refresh [--dataset ml-latest-small|ml-1m] [--t0 0.8] [--t1 0.9]
        [--epochs 8] [--warm-epochs 2] [--dim 128] [--workdir /tmp/bench-refresh]

On real timestamps (``../shared/datasets/<dataset>/ratings.csv``; nothing is copied into the repository, the
filtered logs and runs live in ``--workdir``): global time is cut at the quantiles ``T0 < T1`` of the ratings'
times. Ratings before T0 are *yesterday*, [T0, T1) *today*, from T1 on the test.

1. ``bigrank ingest`` of the ratings before T0 -> ``yesterday/`` (every pair in train);
2. ``bigrank ingest`` of the ratings before T1 ``--vocab-from yesterday/`` -> ``today/`` (old ids kept; items first
   seen in [T0, T1) are exactly the item ids from yesterday's size on);
3. three models: (a) *stale*: trained on yesterday, ``--epochs``, used as is; (b) *warm*: ``bigrank train
   --init-from`` (a), ``--warm-epochs`` on today; (c) *retrain*: from nothing on today, ``--epochs``.

Each model ranks today's catalog (the stale one: yesterday's; it cannot recommend an item it has never seen) for
the users that yesterday's model knows and that rate, from T1 on, an item today's vocabulary has and they had not
rated before T1; the items rated before T1 are excluded from the ranking. Metrics (``bigrank.train.metrics``):
AP@10, Accuracy, R@100, and R@100 over the test items first seen in [T0, T1) (users with such items). Paired over
the users: the mean difference (b - c) and (a - c) with a 95% interval (normal, 1.96 standard errors). Wall time:
each ``bigrank train`` command (``--launcher local``, one worker), start-up included.

Targets: (b) within the paired 95% interval of (c) or above, at <= 30% of its wall time; (a) measurably worse
than (c). The machine's load is printed with the table.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared" / "datasets"
# ml-latest-small-rankmax.yaml's settings, without the history tower (a user is its row: the benchmark scores
# U @ V^T itself) and without evaluation while training.
BASE_CONFIG = {
    "seed": 0,
    "workers": 1,
    "model": {"history": False},
    "loss": {"name": "rankmax", "params": {"k": 1, "margin": 1.49}},
    "optim": {
        "user_optimizer": "rowwise_adagrad",
        "user_lr": 0.071,
        "item_optimizer": "adagrad",
        "item_lr": 0.141,
        "lr_decay": "cosine",
        "user_l2": 0.03,
        "weight_decay": 1.0e-4,
    },
    "train": {"batch_size": 512, "log_every": 50, "keep_checkpoints": 1, "progress": False},
    "eval": {"every_epochs": None, "at_end": False},
}
KS = (10, 100)


def bigrank(*args: str) -> float:
    """Run ``bigrank ARGS`` (this interpreter); its wall seconds. Raises when it fails."""
    started = time.perf_counter()
    subprocess.run([sys.executable, "-m", "bigrank.cli", *args], check=True, cwd=REPO)
    return time.perf_counter() - started


def cut_logs(ratings: Path, work: Path, q0: float, q1: float):
    """Write the ratings before T0 and before T1 as Parquet under ``work``; returns ``(T0, T1, the test rows)``."""
    import duckdb

    con = duckdb.connect()
    con.execute(f"CREATE TABLE r AS SELECT * FROM read_csv_auto('{ratings}')")
    t0, t1 = con.execute(f"SELECT quantile_disc(timestamp, {q0}), quantile_disc(timestamp, {q1}) FROM r").fetchone()
    for name, bound in (("yesterday", t0), ("today", t1)):
        con.execute(f"COPY (SELECT * FROM r WHERE timestamp < {bound}) TO '{work / name}.parquet' (FORMAT parquet)")
    test = con.execute(f"SELECT userId, movieId FROM r WHERE timestamp >= {t1}").fetchnumpy()
    con.close()
    return int(t0), int(t1), test


def train(work: Path, name: str, data: Path, epochs: int, dim: int, init_from: Path | None = None) -> float:
    """``bigrank train`` of the run ``work/runs/name``; its wall seconds."""
    import yaml

    config = dict(BASE_CONFIG, data={"root": str(data)}, run_dir=str(work / "runs" / name))
    config["model"] = dict(BASE_CONFIG["model"], dim=dim)
    config["train"] = dict(BASE_CONFIG["train"], epochs=epochs)
    path = work / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    extra = ["--init-from", str(init_from)] if init_from else []
    return bigrank("train", str(path), "--launcher", "local", *extra)


def tables(run_dir: Path) -> tuple[np.ndarray, np.ndarray]:
    """(user table, catalog) of the run's newest checkpoint, read whole in this process."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from bigrank.train.checkpoint import latest_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        dcp_to_torch_save(latest_checkpoint(run_dir), f"{tmp}/state.pt")
        state = torch.load(f"{tmp}/state.pt", weights_only=False)
    users = state["tower"]["model"]["tables.embedding_bags.user_table.weight"]
    return users.float().numpy(), state["catalog"]["weight"].float().numpy()


def dense_ids(root: Path, name: str, originals: np.ndarray) -> np.ndarray:
    """The dense ids of ``originals`` in the dataset ``root`` (-1 where it has none)."""
    import pyarrow.parquet as pq

    table = pq.read_table(root / f"{name}.parquet", columns=[f"{name[:-1]}_id", "original_id"])
    lookup = dict(
        zip(table.column("original_id").to_pylist(), table.column(f"{name[:-1]}_id").to_pylist(), strict=True)
    )
    return np.array([lookup.get(int(x), -1) for x in originals], dtype=np.int64)


def seen_items(root: Path, num_users: int) -> list[set]:
    """Each user's items in the dataset's train split."""
    import pyarrow.parquet as pq

    seen = [set() for _ in range(num_users)]
    for part in sorted((root / "train").glob("part-*.parquet")):
        table = pq.read_table(part, columns=["user_id", "item_id"])
        for user, item in zip(table.column("user_id").to_numpy(), table.column("item_id").to_numpy(), strict=True):
            seen[user].add(int(item))
    return seen


def per_user(users_vec, items_vec, users, relevant, seen, width, allowed_items) -> dict[str, np.ndarray]:
    """Per-user AP@10, Accuracy, R@100 of the ranking of ``items_vec[:allowed_items]`` for ``users``."""
    from bigrank.train.metrics import ranking_metrics

    scores = users_vec[users] @ items_vec[:allowed_items].T
    out = {name: np.empty(len(users)) for name in ("ap@10", "accuracy", "recall@100")}
    for row, user in enumerate(users):
        excluded = [i for i in seen[user] if i < allowed_items]
        scores[row, excluded] = -np.inf
        top = np.argsort(-scores[row], kind="stable")[:width]
        top = np.where(np.isfinite(scores[row, top]), top, -1)
        result = ranking_metrics(top[None, :], [sorted(relevant[row])], KS)
        for name in out:
            out[name][row] = result[name]
    return out


def paired(a: np.ndarray, b: np.ndarray) -> str:
    """``mean(a - b) [95% interval]`` over paired users."""
    diff = a - b
    half = 1.96 * diff.std(ddof=1) / np.sqrt(len(diff)) if len(diff) > 1 else float("nan")
    return f"{diff.mean():+.4f} [{diff.mean() - half:+.4f}, {diff.mean() + half:+.4f}]"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dataset", default="ml-latest-small", choices=["ml-latest-small", "ml-1m"])
    parser.add_argument("--t0", type=float, default=0.8, help="T0 as a quantile of the ratings' times")
    parser.add_argument("--t1", type=float, default=0.9, help="T1 as a quantile of the ratings' times")
    parser.add_argument("--epochs", type=int, default=8, help="epochs of (a) and (c)")
    parser.add_argument("--warm-epochs", type=int, default=2, help="epochs of (b)")
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--workdir", default=None, help="default: a new temporary directory")
    args = parser.parse_args(argv)
    ratings = SHARED / args.dataset / "ratings.csv"
    if not ratings.is_file():
        print(f"skipped: {ratings} is absent", file=sys.stderr)
        return 0
    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench-refresh-"))
    work.mkdir(parents=True, exist_ok=True)

    t0, t1, test = cut_logs(ratings, work, args.t0, args.t1)
    columns = ["--user", "userId", "--item", "movieId", "--time", "timestamp", "--rating", "rating"]
    common = [*columns, "--split", "random", "--fractions", "1,0,0", "--no-progress"]
    yesterday, today = work / "yesterday", work / "today"
    for out in (yesterday, today):
        if out.exists():
            import shutil

            shutil.rmtree(out)
    bigrank("ingest", str(work / "yesterday.parquet"), "--out", str(yesterday), *common)
    bigrank("ingest", str(work / "today.parquet"), "--out", str(today), "--vocab-from", str(yesterday), *common)

    import shutil

    shutil.rmtree(work / "runs", ignore_errors=True)
    seconds = {
        "a": train(work, "stale", yesterday, args.epochs, args.dim),
        "c": train(work, "retrain", today, args.epochs, args.dim),
    }
    seconds["b"] = train(work, "warm", today, args.warm_epochs, args.dim, init_from=work / "runs" / "stale")

    from bigrank.data.manifest import load_manifest

    old, new = load_manifest(yesterday), load_manifest(today)
    old_users, old_items = old["num_users"], old["num_items"]
    users = dense_ids(today, "users", test["userId"])
    items = dense_ids(today, "items", test["movieId"])
    seen = seen_items(today, new["num_users"])
    relevant: dict[int, set] = {}
    for user, item in zip(users, items, strict=True):
        if 0 <= user < old_users and item >= 0 and item not in seen[user]:
            relevant.setdefault(int(user), set()).add(int(item))
    evaluated = np.array(sorted(relevant), dtype=np.int64)
    rel = [relevant[u] for u in evaluated]
    models = {
        "a": (*tables(work / "runs" / "stale"), old_items),
        "b": (*tables(work / "runs" / "warm"), new["num_items"]),
        "c": (*tables(work / "runs" / "retrain"), new["num_items"]),
    }
    results, fresh = {}, {}
    with_new = np.array([any(i >= old_items for i in r) for r in rel])
    new_rel = [{i for i in r if i >= old_items} for r, keep in zip(rel, with_new, strict=True) if keep]
    for name, (user_vec, item_vec, allowed) in models.items():
        results[name] = per_user(user_vec, item_vec, evaluated, rel, seen, max(KS), allowed)
        fresh[name] = per_user(user_vec, item_vec, evaluated[with_new], new_rel, seen, max(KS), allowed)["recall@100"]

    names = {"a": "(a) stale", "b": "(b) warm start", "c": "(c) retrain"}
    print(f"\n{args.dataset}: T0 {t0} ({args.t0:g}), T1 {t1} ({args.t1:g}); yesterday {old_users:,} users "
          f"{old_items:,} items, today {new['num_users']:,} users {new['num_items']:,} items "
          f"({new['num_items'] - old_items:,} new); {len(evaluated):,} test users ({int(with_new.sum()):,} with new "
          f"items); dim {args.dim}, epochs a/c {args.epochs}, b {args.warm_epochs}")  # fmt: skip
    print(f"machine load (1/5/15 min): {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    header = f"{'model':<16}{'AP@10':>9}{'Accuracy':>10}{'R@100':>9}{'R@100 new':>11}{'wall s':>9}"
    print(header)
    for key in ("a", "b", "c"):
        r = results[key]
        print(f"{names[key]:<16}{r['ap@10'].mean():>9.4f}{r['accuracy'].mean():>10.4f}{r['recall@100'].mean():>9.4f}"
              f"{fresh[key].mean():>11.4f}{seconds[key]:>9.1f}")  # fmt: skip
    for key in ("b", "a"):
        print(f"paired {key} - c:   AP@10 {paired(results[key]['ap@10'], results['c']['ap@10'])}   "
              f"Accuracy {paired(results[key]['accuracy'], results['c']['accuracy'])}   "
              f"R@100 {paired(results[key]['recall@100'], results['c']['recall@100'])}   "
              f"R@100 new {paired(fresh[key], fresh['c'])}")  # fmt: skip
    print(f"wall time b / c: {seconds['b'] / seconds['c']:.2f} (target <= 0.30)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
