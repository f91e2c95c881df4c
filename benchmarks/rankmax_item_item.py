"""Rankmax with a full-rank item-item model against EASE on a dense MovieLens file (issue 25's lead).

bigrank's shipped models are low-rank (a user vector of dimension d against item vectors); on MovieLens-1M they
trail EASE (Steck 2019, a closed-form full-rank item-item model) by ~0.003 AP@10. EASE's matrix truncated to
rank 256 scores about as the shipped Rankmax model does, so the gap is the rank. This benchmark trains, with
the Rankmax loss (k = 1, eq. 15), the hybrid a helper's prototype found to close it:

    z_u = s_u * (x_u W + x_u P Q^T - x_u * diag(P Q^T)),    s_u = |x_u|^-1/2,  diag(W) = 0

``x_u`` the user's train items (multi-hot), ``W`` [n, n] full rank, ``P, Q`` [n, r] (r = 256): an item's own
input never scores it (both terms lose their diagonal, as EASE's does), so every train item ``y`` of ``u`` is a
row ``(z_u, y)`` of the loss and all of them share ``z_u`` (``bigrank.losses.rankmax_shared_loss``: one sort per
user). Objective per batch of users: the mean row loss + (λ / N) (||W||² + ||P||² + ||Q||²), N the train rows
(λ in EASE's sum-over-data units); Adam, learning rate decayed linearly to 0 over the run.

For each split seed the file is ingested as ``benchmarks.reproduce_table2`` ingests it (random 80/10/10 split
per user); EASE's λ is picked on validation; the hybrid trains a fixed number of epochs (no pick on
validation: its figures are those of the last epoch) and both are scored on the test split with the
baselines' metric code (all items ranked, train items left out), with a 95 % paired bootstrap interval over
users pooled across the seeds. The model is ``bigrank.model.item_item`` and trains in bigrank as ``model.kind:
item_item`` (``configs/ml-1m-item_item-rankmax.yaml``); this script is the standalone loop it was found with.

    python -m benchmarks.rankmax_item_item --data ../shared/datasets/ml-1m --seeds 0 1 2
    python -m benchmarks.rankmax_item_item --data ../shared/datasets/ml-1m --ease-ranks 64 128 256 512 1024 4000

About 8 s per epoch on 2 quiet cores at ML-1M (6,040 users x 3,706 items), ~8 min for 3 seeds. Measured
2026-11-26 (test, seeds 0-2): hybrid - EASE +0.0032 [+0.0020, +0.0043] AP@10, -0.0016 [-0.0072, +0.0041]
Accuracy, +0.0154 [+0.0136, +0.0171] R@100.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import numpy as np
import torch

from benchmarks.baselines import ease_matrix, paired_difference, per_user_metrics, split_matrix, tune_ease
from benchmarks.reproduce_table2 import DATASETS, METRICS, ingest
from bigrank.losses import rankmax_shared_loss
from bigrank.model.item_item import ItemItemModel


def train_hybrid(train: np.ndarray, args, seed: int, valid: np.ndarray | None = None) -> ItemItemModel:
    """The hybrid trained on the binary matrix ``train`` [U, n]; prints validation figures after each epoch."""
    torch.manual_seed(seed)
    history = torch.from_numpy(train.astype(np.float32))
    users, items = history.shape
    model = ItemItemModel(items, args.rank, seed=seed)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    steps = args.epochs * -(-users // args.batch)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: max(0.0, 1.0 - step / steps))
    weight = args.l2 / float(history.sum())
    for epoch in range(1, args.epochs + 1):
        started, total, rows = time.perf_counter(), 0.0, 0
        for batch in torch.randperm(users).split(args.batch):
            x = history[batch]
            positives = x > 0
            loss = rankmax_shared_loss(model(x), positives, args.margin, reduction="sum")
            count = int(positives.sum())
            optimizer.zero_grad()
            (loss / max(count, 1) + weight * model.squared_norm()).backward()
            model.full.grad.diagonal().zero_()
            optimizer.step()
            schedule.step()
            model.zero_diagonal()
            total, rows = total + float(loss.detach()), rows + count
        line = {"seed": seed, "epoch": epoch, "loss": round(total / max(rows, 1), 4)}
        line["seconds"] = round(time.perf_counter() - started, 1)
        if valid is not None:
            figures = per_user_metrics(scores(model, history), train, valid, (10, 100))
            line.update({name: round(float(figures[name].mean()), 4) for name, _ in METRICS})
        print(json.dumps(line), flush=True)
    return model


def scores(model: ItemItemModel, history: torch.Tensor, block: int = 1024) -> np.ndarray:
    """float32[U, n] scores of every user from its train items ``history`` float32[U, n] (multi-hot)."""
    with torch.no_grad():
        return torch.cat([model(history[start : start + block]) for start in range(0, len(history), block)]).numpy()


def truncated_ease(train: np.ndarray, valid: np.ndarray, lam: float, ranks) -> list[tuple]:
    """Validation figures of EASE's matrix B (λ ``lam``) truncated to each rank of ``ranks`` by an SVD (a rank r
    that exceeds the items keeps B whole): ``[(r, AP@10, Accuracy, R@100), ...]``. How much of EASE a model of
    rank r can reach at best, in the bilinear form ``x_u B_r``."""
    x = torch.from_numpy(train.astype(np.float32))
    left, values, right = torch.linalg.svd(ease_matrix(train, lam))
    rows = []
    for rank in ranks:
        truncated = (left[:, :rank] * values[:rank]) @ right[:rank]
        figures = per_user_metrics((x @ truncated).numpy(), train, valid, (10, 100))
        rows.append((min(rank, len(values)), *(float(figures[name].mean()) for name, _ in METRICS)))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", required=True, help="a MovieLens directory (ratings.dat or ratings.csv)")
    parser.add_argument("--work", default="runs/item-item", help="ingested splits (runs/ is not tracked)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--dataset", default="ml-1m", choices=sorted(DATASETS), help="EASE's λ grid")
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--batch", type=int, default=256, help="users per step")
    parser.add_argument("--rank", type=int, default=256)
    parser.add_argument("--lr", type=float, default=3e-2)
    parser.add_argument("--l2", type=float, default=1.0, help="λ of W, P and Q in sum-over-data units")
    parser.add_argument("--margin", type=float, default=1.0)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument(
        "--ease-ranks",
        type=int,
        nargs="*",
        default=[],
        help="first: EASE (λ 1,000) truncated to these ranks on validation of the first seed, then exit",
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    load = os.getloadavg()
    print(f"load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}, {torch.get_num_threads()} threads", flush=True)
    if args.ease_ranks:
        root = ingest(args.data, work, args.seeds[0])
        train, valid = split_matrix(root, "train"), split_matrix(root, "valid")
        print(f"EASE λ 1,000 truncated, validation of seed {args.seeds[0]}:")
        print(f"{'rank':<8}" + "".join(f"{label:>10}" for _, label in METRICS))
        for rank, *values in truncated_ease(train, valid, 1000.0, args.ease_ranks):
            print(f"{rank:<8}" + "".join(f"{value:>10.4f}" for value in values))
        return
    hybrid, ease = {name: [] for name, _ in METRICS}, {name: [] for name, _ in METRICS}
    rows = []
    for seed in args.seeds:
        root = ingest(args.data, work, seed)
        train, valid, test = (split_matrix(root, split) for split in ("train", "valid", "test"))
        lam, ease_test_scores, _ = tune_ease(train, valid, DATASETS[args.dataset].lambdas)
        model = train_hybrid(train, args, seed, valid)
        hybrid_scores = scores(model, torch.from_numpy(train.astype(np.float32)))
        for name, figures in (
            ("hybrid", per_user_metrics(hybrid_scores, train, test, (10, 100))),
            (f"EASE λ={lam:g}", per_user_metrics(ease_test_scores, train, test, (10, 100))),
        ):
            for metric, _ in METRICS:
                (hybrid if name == "hybrid" else ease)[metric].append(figures[metric])
            rows.append((seed, name, *(float(figures[metric].mean()) for metric, _ in METRICS)))
    print(f"\ntest split, {args.data}, seeds {args.seeds}")
    print(f"{'seed':<6}{'model':<16}" + "".join(f"{label:>10}" for _, label in METRICS))
    for seed, name, *values in rows:
        print(f"{seed:<6}{name:<16}" + "".join(f"{value:>10.4f}" for value in values))
    print("\nhybrid - EASE, paired over users (mean over seeds, 95 % bootstrap interval):")
    for metric, label in METRICS:
        difference, low, high = paired_difference(hybrid[metric], ease[metric])
        print(f"  {label:<9} {difference:+.4f} [{low:+.4f}, {high:+.4f}]")


if __name__ == "__main__":
    main()
