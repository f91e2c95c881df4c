"""Training throughput: bigrank (sharded user table, item-parallel catalog) vs a plain loop.

Both train the same model (user-id embeddings x item embeddings, d from the config) with the same loss and
global batch on the same Parquet data for ``--steps`` steps: bigrank through ``bigrank train --launcher local``
(examples/s from its metrics.jsonl, the first logging window dropped; with the config's workers and with one
worker), the plain loop as one process with an ``nn.Embedding`` user table, a dense item matrix, Adagrad and
``bigrank.losses`` (the same loss function).

    .venv/bin/python -m benchmarks.bench_train [--config configs/demo.yaml] [--steps 200] [--data data/demo]

ML-1B mode (``--loss``, one or several losses, comma-separated, measured one after the other in one run)::

    .venv/bin/python -m benchmarks.bench_train --data /work/data/ml1b --loss sampled_softmax \
        --negatives 8192 --batch 4096 --steps 30
    .venv/bin/python -m benchmarks.bench_train --data /work/data/ml1b \
        --loss sampled_softmax,smooth_ap,recall_at_quantile,pauc_at_budget --negatives 8192 --batch 4096
    .venv/bin/python -m benchmarks.bench_train --data /work/data/ml1b --loss rankmax --batch 256 --steps 12
    .venv/bin/python -m benchmarks.bench_train --data /work/data/ml1b --loss sampled_softmax --bf16   # + bf16 GEMMs
    .venv/bin/python -m benchmarks.bench_train --data /work/data/ml1b --loss rankmax --batching users \
        --batch 256 --steps 220 --layouts sharded      # user by user (train.batching: users) beside row by row

Product mode (``--product CONFIG``): the shipped config itself, ``bigrank train CONFIG --launcher local`` with its
own workers, model and settings (only ``data.root``, ``train.max_steps``, the logging cadence and no evaluation
are set), beside the 3-GEMM floor of one of its steps, the epoch it projects and the workers' peak RSS::

    .venv/bin/python -m benchmarks.bench_train --product configs/ml1b.yaml --data /work/data/ml1b --steps 200

For each loss: bigrank (2 workers, ``--launcher local``, row-wise Adagrad on users and items, d = 64) against
a plain single-process loop (2 threads) doing the same work the lean way — gather the touched user and item
rows, one GEMM against the shared negatives plus each row's positive (a dot product), the loss, backward,
row-wise Adagrad on the touched rows only (full-catalog losses: every item) — plus the GEMM floor of the step
(its 3 GEMMs, B x C x d, timed alone with 2 threads), the peak RSS of each bigrank worker, and the projected
time of one epoch of the train split at bigrank's rate. Sampled candidate losses take ``--negatives`` per
step over the whole catalog (bigrank splits them over the workers).
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
import pyarrow.parquet as pq
import torch

from bigrank.config import load_config
from bigrank.data.manifest import load_manifest
from bigrank.losses import rankmax_loss, softmax_loss, sparsemax_loss
from bigrank.records import PLAN_TEXT, TrainRecord, read_metrics

ROOT = Path(__file__).resolve().parents[1]
FULL_CATALOG = {"rankmax": rankmax_loss, "softmax": softmax_loss, "sparsemax": sparsemax_loss}


def chosen_layout(run_dir) -> str:
    """The layout a run used, from its plan.txt ("catalog repl, user_table shar" …; "one shard" for 1 worker)."""
    for line in (Path(run_dir) / PLAN_TEXT).read_text().splitlines():
        if line.rstrip().endswith("<- chosen"):
            return " ".join(line.split()[:-6]).replace(",", "")  # the assignment, without the cost columns
    return "one shard"


def bigrank_examples_per_s(
    config_path: str, data: str, steps: int, log_every: int, workers: int, layout: str = "auto"
) -> tuple[float, str]:
    """``(examples/s without the first logging window, the layout the run used)``."""
    with tempfile.TemporaryDirectory() as run_dir:
        command = [
            sys.executable, "-m", "bigrank.cli", "train", config_path, "--launcher", "local",
            "--set", f"workers={workers}", "--set", f"data.root={data}", "--set", f"run_dir={run_dir}",
            "--set", f"train.max_steps={steps}", "--set", f"model.layout={layout}",
            "--set", f"train.log_every={log_every}", "--set", "eval.every_epochs=0", "--set", "eval.at_end=false",
            "--set", "train.progress=false", "--set", f"train.checkpoint_every={steps}",
            "--set", "train.precision=fp32",  # like the plain loop (the default, auto, may be bf16)
        ]  # fmt: skip
        subprocess.run(command, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
        records = read_metrics(run_dir)
        chosen = chosen_layout(run_dir)
    rates = [r.examples_per_s for r in records if isinstance(r, TrainRecord)][1:]  # drop the warm-up window
    return float(np.median(rates)), chosen


def plain_examples_per_s(config, data: str, steps: int) -> float:
    manifest = load_manifest(data)
    table = pq.read_table(Path(data) / "train", columns=["user_id", "item_id"])
    users = torch.from_numpy(table["user_id"].to_numpy().astype(np.int64))
    items = torch.from_numpy(table["item_id"].to_numpy().astype(np.int64))
    dim, batch = config.model.dim, config.train.batch_size
    generator = torch.Generator().manual_seed(0)
    user_table = torch.nn.Embedding(manifest["num_users"], dim)
    item_matrix = torch.nn.Parameter(torch.randn(manifest["num_items"], dim, generator=generator) * 0.1)
    parameters = [*user_table.parameters(), item_matrix]
    history = None
    if config.model.history:  # the same history tower: the mean of the user's train items' rows
        order_by_user = torch.argsort(users, stable=True)
        bag_items = items[order_by_user]
        counts = torch.bincount(users, minlength=manifest["num_users"])
        starts = torch.cumsum(counts, 0) - counts
        history_table = torch.nn.EmbeddingBag(manifest["num_items"], dim, mode="mean")
        parameters += list(history_table.parameters())
        history = (history_table, bag_items, starts, counts)
    optimizer = torch.optim.Adagrad(parameters, lr=config.optim.item_lr)
    loss_fn = FULL_CATALOG[config.loss.name]
    # per-row k (k_fraction) needs the users' train counts: the trainer's job, not the plain loop's
    params = {k: v for k, v in dict(config.loss.params or {}).items() if k != "k_fraction"}
    order = torch.randperm(users.numel(), generator=generator)
    started = None
    for step in range(steps):
        if step == steps // 10:  # warm-up steps are not timed
            started = time.perf_counter()
        rows = order[(step * batch) % users.numel() :][:batch]
        vectors = user_table(users[rows])
        if history is not None:
            history_table, bag_items, starts, counts = history
            lengths = counts[users[rows]]
            offsets = torch.cumsum(lengths, 0) - lengths
            # every bag's positions in bag_items: its user's start plus 0 … length - 1
            within = torch.arange(int(lengths.sum())) - torch.repeat_interleave(offsets, lengths)
            bags = bag_items[torch.repeat_interleave(starts[users[rows]], lengths) + within]
            vectors = vectors + history_table(bags, offsets)
        scores = vectors @ item_matrix.T
        loss = loss_fn(scores, items[rows], **params)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    return (steps - steps // 10) * batch / (time.perf_counter() - started)


# --------------------------------------------------------------------------------------------- ML-1B mode
SAMPLED_LOSSES = ("sampled_softmax", "smooth_ap", "recall_at_quantile", "pauc_at_budget", "softrank_ndcg")


def _read_train_rows(data: str, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``rows`` (user, item) pairs of the train split, row group by row group (never the whole split)."""
    from bigrank.data.stream import iter_row_groups

    users, items, total = [], [], 0
    for group in iter_row_groups(data, "train"):
        users.append(group["user_id"].astype(np.int64))
        items.append(group["item_id"].astype(np.int64))
        total += len(users[-1])
        if total >= rows:
            break
    return torch.from_numpy(np.concatenate(users)[:rows]), torch.from_numpy(np.concatenate(items)[:rows])


def _rowwise_adagrad(weight, accumulator, ids, grad, lr, eps=1e-8):
    """fbgemm's row-wise Adagrad on rows ``ids`` only."""
    acc = accumulator.index_select(0, ids).add_(grad.square().mean(dim=1))
    accumulator.index_copy_(0, ids, acc)
    rows = weight.index_select(0, ids).addcdiv_(grad, acc.sqrt().add_(eps).unsqueeze(1), value=-lr)
    weight.index_copy_(0, ids, rows)


def plain_ml1b_seconds_per_step(data, loss_name, batch, negatives, dim, steps, lr=0.05) -> float:
    """A lean single-process step: touched rows only, shared uniform negatives, row-wise Adagrad."""
    import torch.nn.functional as F

    from bigrank.losses import pauc_at_budget_loss, rankmax_loss, recall_at_quantile_loss, smooth_ap_loss

    manifest = load_manifest(data)
    num_users, num_items = int(manifest["num_users"]), int(manifest["num_items"])
    users, items = _read_train_rows(data, steps * batch)
    generator = torch.Generator().manual_seed(0)
    user_w = torch.randn(num_users, dim, generator=generator) * 0.1
    item_w = torch.randn(num_items, dim, generator=generator) * 0.1
    user_acc, item_acc = torch.zeros(num_users), torch.zeros(num_items)
    soft_rank = {
        "smooth_ap": lambda s, lab: smooth_ap_loss(s, lab),
        "recall_at_quantile": lambda s, lab: recall_at_quantile_loss(s, lab),
        "pauc_at_budget": lambda s, lab: pauc_at_budget_loss(s, lab),
    }
    started = None
    for step in range(steps):
        if step == min(2, steps - 1):
            started = time.perf_counter()
        u_ids, pos = users[step * batch : (step + 1) * batch], items[step * batch : (step + 1) * batch]
        user_ids, user_index = torch.unique(u_ids, return_inverse=True)
        user_rows = user_w.index_select(0, user_ids).requires_grad_()
        vectors = user_rows[user_index]
        if loss_name == "rankmax":
            item_rows = item_w.clone().requires_grad_()
            chunked = torch.cat([vectors @ item_rows[k : k + 65536].T for k in range(0, num_items, 65536)], dim=1)
            loss = rankmax_loss(chunked, pos)
            item_ids = None
        else:
            negs = torch.randint(num_items, (negatives,), generator=generator)
            item_ids, item_index = torch.unique(torch.cat([pos, negs]), return_inverse=True)
            item_rows = item_w.index_select(0, item_ids).requires_grad_()
            positive, negative = item_rows[item_index[:batch]], item_rows[item_index[batch:]]
            scores = torch.cat([(vectors * positive).sum(dim=1, keepdim=True), vectors @ negative.T], dim=1)
            if loss_name == "sampled_softmax":  # uniform logQ is one constant: it cancels
                loss = F.cross_entropy(scores, torch.zeros(batch, dtype=torch.int64))
            else:
                labels = torch.zeros_like(scores, dtype=torch.bool)
                labels[:, 0] = True
                loss = soft_rank[loss_name](scores, labels)
        loss.backward()
        with torch.no_grad():
            _rowwise_adagrad(user_w, user_acc, user_ids, user_rows.grad, lr)
            ids = torch.arange(num_items) if item_ids is None else item_ids
            _rowwise_adagrad(item_w, item_acc, ids, item_rows.grad, lr)
    return (time.perf_counter() - started) / (steps - min(2, steps - 1))


def gemm_floor_seconds(batch, columns, dim, repeats=3) -> float:
    """The step's 3 GEMMs alone (scores, dL/dU, dL/dV: B x C x d each), in blocks of <= 2^22 scores."""
    users, block = torch.randn(batch, dim), max(1, (1 << 22) // batch)
    items = torch.randn(min(columns, block), dim)
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        for start in range(0, columns, block):
            rows = items[: min(block, columns - start)]
            scores = users @ rows.T
            scores @ rows
            scores.T @ users
        best = min(best, time.perf_counter() - started)
    return best


def _descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _peak_rss_gb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1e6
    except OSError:
        return None
    return None


def bigrank_ml1b(
    data, loss_name, batch, negatives, dim, steps, precision="fp32", layout="auto", batching="rows"
) -> tuple[float, list[float], str]:
    """bigrank train with 2 local workers: (examples/s without the first logging window, peak RSS per worker GB,
    the layout the run used)."""
    import yaml

    log_every = max(1, steps // 6)
    with tempfile.TemporaryDirectory() as run_dir:
        loss = {"name": loss_name}
        if loss_name in SAMPLED_LOSSES:
            loss.update(candidates="sampled", num_negatives=negatives)
        config = {
            "data": {"root": data},
            "run_dir": run_dir,
            "workers": 2,
            "model": {"dim": dim, "layout": layout},
            "loss": loss,
            "optim": {"user_optimizer": "rowwise_adagrad", "item_optimizer": "rowwise_adagrad"},
            "train": {"batch_size": batch, "max_steps": steps, "log_every": log_every, "progress": False,
                      "checkpoint_every": None, "chunk_size": "auto", "precision": precision,
                      "batching": batching},
            "eval": {"every_epochs": None, "at_end": False},
        }  # fmt: skip
        path = Path(run_dir) / "bench.yaml"
        path.write_text(yaml.safe_dump(config))
        command = [sys.executable, "-m", "bigrank.cli", "train", str(path), "--launcher", "local"]
        try:
            workers = _run_watching_rss(command)
        except RuntimeError:
            raise RuntimeError(f"bigrank train failed for {loss_name}") from None
        records = read_metrics(run_dir)
        chosen = chosen_layout(run_dir)
    rates = [r.examples_per_s for r in records if isinstance(r, TrainRecord)][1:]
    return float(np.median(rates)), workers, chosen


def run_ml1b(args) -> None:
    data = str(Path(args.data).resolve())
    manifest = load_manifest(data)
    train_rows = int(manifest["splits"]["train"]["rows"])
    num_items = int(manifest["num_items"])
    steps = args.steps or 30
    rows = []
    if args.batching == "users":
        run_ml1b_users(args, data, train_rows, num_items, manifest)
        return
    for loss_name in args.loss.split(","):
        columns = num_items if loss_name not in SAMPLED_LOSSES else args.negatives
        floor = gemm_floor_seconds(args.batch, columns, args.dim)
        plain = plain_ml1b_seconds_per_step(data, loss_name, args.batch, args.negatives, args.dim, min(steps, 12))
        for layout in args.layouts.split(","):
            ours, peaks, chosen = bigrank_ml1b(
                data, loss_name, args.batch, args.negatives, args.dim, steps, layout=layout
            )
            bf16 = None
            if args.bf16:
                bf16 = bigrank_ml1b(data, loss_name, args.batch, args.negatives, args.dim, steps, "bf16", layout)[0]
            label = f"{layout} ({chosen})" if layout == "auto" else layout
            rows.append((loss_name, label, args.batch / floor, args.batch / plain, ours, peaks, bf16))
            rates = f"floor {args.batch / floor:,.0f}, plain {args.batch / plain:,.0f}, bigrank {ours:,.0f}"
            rates += f", bigrank bf16 {bf16:,.0f}" if bf16 else ""
            print(f"  {loss_name}, layout {label}: {rates} examples/s", flush=True)
    print(f"\nML-1B ({data}): {num_items:,} items, d={args.dim}, global batch {args.batch}, "
          f"{args.negatives:,} sampled negatives, {steps} bigrank steps; machine load shared: ratios only")  # fmt: skip
    print(f"machine load (1/5/15 min): {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    header = (f"{'loss':<20}{'layout':<46}{'GEMM floor ex/s':>16}{'plain ex/s':>12}{'bigrank ex/s':>14}"
              f"{'vs plain':>10}{'floor/bigrank':>15}{'peak RSS GB/worker':>20}{'epoch h':>9}")  # fmt: skip
    print(header + (f"{'bf16 ex/s':>11}{'bf16 vs plain':>15}" if args.bf16 else ""))
    for loss_name, label, floor, plain, ours, peaks, bf16 in rows:
        epoch = f"{train_rows / ours / 3600:9.1f}" if train_rows else f"{'?':>9}"
        rss = "/".join(f"{p:.2f}" for p in peaks) or "?"
        extra = f"{bf16:>11,.0f}{bf16 / plain:>15.2f}" if bf16 else ""
        print(f"{loss_name:<20}{label:<46}{floor:>16,.0f}{plain:>12,.0f}{ours:>14,.0f}{ours / plain:>10.2f}"
              f"{floor / ours:>15.2f}{rss:>20}{epoch}{extra}")  # fmt: skip


def run_product(args) -> None:
    """``--product CONFIG``: seconds a step of ``bigrank train CONFIG`` (median of the logging windows after the
    first; a users step's rows vary, so seconds a step are the step's mean rows over examples/s) beside the floor
    of the step's 3 GEMMs (``train.batch_size`` x n x d, 2 threads: what the 2 workers' shards add up to)."""
    import yaml

    config = load_config(ROOT / args.product)
    data = str(Path(args.data).resolve())
    manifest = load_manifest(data)
    train_rows, users = int(manifest["splits"]["train"]["rows"]), int(manifest["num_users"])
    num_items, batch, dim = int(manifest["num_items"]), config.train.batch_size, config.model.dim
    steps = args.steps or 200
    log_every = max(1, steps // 8)
    with tempfile.TemporaryDirectory() as run_dir:
        overrides = {
            "data.root": data, "run_dir": run_dir, "train.max_steps": steps, "train.log_every": log_every,
            "train.progress": False, "train.checkpoint_every": None, "eval.every_epochs": 0, "eval.at_end": False,
        }  # fmt: skip
        command = [sys.executable, "-m", "bigrank.cli", "train", str(ROOT / args.product), "--launcher", "local"]
        for key, value in overrides.items():
            command += ["--set", f"{key}={yaml.safe_dump(value).strip().removesuffix('...').strip()}"]
        peaks = _run_watching_rss(command)
        records = read_metrics(run_dir)
        plan = (Path(run_dir) / PLAN_TEXT).read_text()
    rates = [r.examples_per_s for r in records if isinstance(r, TrainRecord)][1:]
    rate = float(np.median(rates))
    rows_per_step = batch * train_rows / users if "batching: users" in plan else batch  # users: mean rows a step
    seconds = rows_per_step / rate
    floor = gemm_floor_seconds(batch, num_items, dim)
    print(f"\n{args.product} on {data}: {num_items:,} items, {users:,} users, {train_rows:,} train rows, d={dim}, "
          f"batch {batch}, {config.workers} workers, {steps} steps (the first logging window dropped)")  # fmt: skip
    print("plan: " + " | ".join(line for line in plan.splitlines() if line.startswith(("model", "precision", "batch"))))
    print(f"machine load (1/5/15 min): {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    rss = "/".join(f"{p:.2f}" for p in peaks) or "?"
    print(f"{'s/step':>8}{'3-GEMM floor s':>16}{'step/floor':>12}{'examples/s':>12}{'epoch h':>9}"
          f"{'peak RSS GB/worker':>20}")  # fmt: skip
    print(f"{seconds:>8.2f}{floor:>16.2f}{seconds / floor:>12.2f}{rate:>12,.0f}{train_rows / rate / 3600:>9.1f}"
          f"{rss:>20}")  # fmt: skip


def _run_watching_rss(command: list[str]) -> list[float]:
    """Run ``command`` (check the exit status) and return the peak RSS in GB of its two largest descendants."""
    import threading

    process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL)
    peaks: dict[int, float] = {}

    def watch():
        while process.poll() is None:
            for pid in _descendants(process.pid):
                peak = _peak_rss_gb(pid)
                if peak is not None:
                    peaks[pid] = max(peaks.get(pid, 0.0), peak)
            time.sleep(0.5)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    if process.wait() != 0:
        raise RuntimeError(f"{' '.join(command[:6])} … failed (exit {process.returncode})")
    watcher.join()
    return sorted(peaks.values(), reverse=True)[:2]


def run_ml1b_users(args, data: str, train_rows: int, num_items: int, manifest: dict) -> None:
    """``--batching users``: the full-catalog losses user by user (``train.batching: users``, ``--batch`` users a
    step, ``--steps`` steps, the layout of ``--layouts``' first entry) beside the same loss row by row
    (``--row-steps`` steps of ``--row-batch`` rows), both with 2 workers in ``--precision``, and the GEMM floor of
    a users step (its 3 GEMMs, ``--batch`` x n x d, timed alone with 2 threads). Examples are (user, item) train
    rows in both, so the epoch projections compare."""
    rows_per_user = train_rows / max(int(manifest["num_users"]), 1)
    layout = args.layouts.split(",")[0]
    table = []
    for loss_name in args.loss.split(","):
        floor = args.batch * rows_per_user / gemm_floor_seconds(args.batch, num_items, args.dim)
        by_rows = bigrank_ml1b(
            data, loss_name, args.row_batch, 0, args.dim, args.row_steps, args.precision, layout, "rows"
        )
        by_users = bigrank_ml1b(data, loss_name, args.batch, 0, args.dim, args.steps, args.precision, layout, "users")
        table.append((loss_name, floor, by_rows, by_users))
        print(f"  {loss_name}: rows {by_rows[0]:,.0f}, users {by_users[0]:,.0f} examples/s", flush=True)
    print(f"\nML-1B ({data}): {num_items:,} items, {rows_per_user:.0f} train rows a user, d={args.dim}, "
          f"{args.precision}, 2 workers, layout {layout}; users: {args.batch} users a step, {args.steps} steps; "
          f"rows: {args.row_batch} rows a step, {args.row_steps} steps")  # fmt: skip
    print(f"machine load (1/5/15 min): {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(f"{'loss':<10}{'batching':<10}{'layout':<34}{'examples/s':>12}{'epoch h':>10}{'vs rows':>9}"
          f"{'floor/ours':>12}{'peak RSS GB/worker':>20}")  # fmt: skip
    for loss_name, floor, by_rows, by_users in table:
        for name, (rate, peaks, chosen) in (("rows", by_rows), ("users", by_users)):
            ratio = f"{rate / by_rows[0]:>9.1f}"
            versus = f"{floor / rate:>12.2f}" if name == "users" else f"{'':>12}"
            rss = "/".join(f"{p:.2f}" for p in peaks) or "?"
            print(f"{loss_name:<10}{name:<10}{chosen:<34}{rate:>12,.0f}{train_rows / rate / 3600:>10.1f}{ratio}"
                  f"{versus}{rss:>20}")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/demo.yaml")
    parser.add_argument("--data", default="data/demo", help="dataset root (generated with the demo preset if absent)")
    parser.add_argument("--steps", type=int, default=None, help="steps per trainer (default 200; ML-1B mode 30)")
    parser.add_argument("--loss", default=None, help="ML-1B mode: loss name(s), comma-separated")
    parser.add_argument("--negatives", type=int, default=8192, help="ML-1B mode: sampled negatives per step")
    parser.add_argument("--batch", type=int, default=4096, help="ML-1B mode: global batch")
    parser.add_argument("--dim", type=int, default=64, help="ML-1B mode: embedding dimension")
    parser.add_argument("--bf16", action="store_true", help="ML-1B mode: also run bigrank with train.precision=bf16")
    parser.add_argument(
        "--workers", type=int, default=None, help="workers of the multi-worker runs (default: config's)"
    )
    parser.add_argument(
        "--layouts",
        default="auto,replicated,sharded",
        help="model.layout values to run bigrank with on several workers, comma-separated (auto: the cost model)",
    )
    parser.add_argument("--batching", choices=("rows", "users"), default="rows", help="ML-1B mode: see run_ml1b_users")
    parser.add_argument("--precision", default="bf16", help="ML-1B users mode: train.precision of both runs")
    parser.add_argument("--row-batch", type=int, default=256, help="ML-1B users mode: the row-wise run's batch")
    parser.add_argument("--row-steps", type=int, default=12, help="ML-1B users mode: the row-wise run's steps")
    parser.add_argument("--product", default=None, help="product mode: a shipped config run as it is (run_product)")
    args = parser.parse_args()
    torch.set_num_threads(2)
    if args.product is not None:
        run_product(args)
        return
    if args.loss is not None:
        run_ml1b(args)
        return
    args.steps = args.steps or 200
    config = load_config(ROOT / args.config)
    if config.loss.name not in FULL_CATALOG:
        sys.exit(f"bench_train: the plain loop covers the full-catalog losses {list(FULL_CATALOG)}")
    data = str((ROOT / args.data).resolve())
    if not (Path(data) / "manifest.json").exists():
        subprocess.run([sys.executable, "-m", "bigrank.cli", "generate", "--preset", "demo", "--out", data], check=True)
    plain = plain_examples_per_s(config, data, args.steps)
    # The config's worker count in each layout (auto: the cost model's choice), and one worker.
    workers = args.workers or config.workers
    runs = [(workers, layout) for layout in args.layouts.split(",")] if workers > 1 else []
    runs.append((1, "auto"))
    log_every = max(args.steps // 10, 1)
    ours = {run: bigrank_examples_per_s(args.config, data, args.steps, log_every, *run) for run in runs}
    print(f"{config.loss.name} loss, d={config.model.dim}, global batch {config.train.batch_size}, {args.steps} steps")
    print(f"machine load (1/5/15 min): {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(f"{'trainer':<84}{'examples/s':>12}{'ratio':>8}")
    print(f"{'plain PyTorch loop (1 process, nn.Embedding)':<84}{plain:>12,.0f}{1.0:>8.2f}")
    for (workers, layout), (rate, chosen) in ours.items():
        label = f"bigrank, {workers} worker{'s' * (workers > 1)}, layout {layout}"
        label += f" ({chosen})" if workers > 1 and layout == "auto" else ""
        print(f"{label:<84}{rate:>12,.0f}{rate / plain:>8.2f}")


if __name__ == "__main__":
    main()
