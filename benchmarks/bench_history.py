"""History tower at ML-1B bag sizes: what a step's bags cost with the whole bag, ``model.history_dropout`` and
``model.history_sample_size``.

One process, the unsharded ``UserTower`` with a history table of ``--items`` rows (row-wise Adagrad fused into
the backward, as in training): per step, build the bags of a batch of users (``history_bags``, the target left
out), look them up, backward a dummy loss. The users' bag lengths are drawn log-normal with mean ``--mean-bag`` before
clipping to [20, 20000] (ML-1B: ~1B ratings over ~2.2M users, about 455 per user), a heavy tail; the table
prints the mean ids per step actually looked up. Reported:
best step time of the bag building and of the tower, ids looked up per step, and the ratios to the whole bag.

    .venv/bin/python -m benchmarks.bench_history [--items 849000] [--batch 4096] [--dim 64] [--steps 3]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from bigrank.model.sharding import quiet_torchrec


def history_csr(num_users: int, num_items: int, mean_bag: float, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """``(indptr, items)`` of synthetic train bags: log-normal lengths (sigma 1) with mean ``mean_bag``."""
    rng = np.random.default_rng(seed)
    sigma = 1.0
    lengths = rng.lognormal(np.log(mean_bag) - sigma**2 / 2, sigma, num_users).astype(np.int64).clip(20, 20_000)
    indptr = np.concatenate([[0], np.cumsum(lengths)])
    return indptr, rng.integers(0, num_items, int(indptr[-1]), dtype=np.int64)


def time_steps(args, history, variant: dict) -> tuple[float, float, float]:
    """Best (bag seconds, tower seconds) of ``args.steps`` steps and the mean ids per step."""
    from bigrank.model.sharding import shard_row_wise
    from bigrank.model.towers import UserTower
    from bigrank.train.model import history_bags

    num_users = len(history[0]) - 1
    tower = UserTower(num_users, args.dim, num_items=args.items, history=True, device="meta")
    dmp, _ = shard_row_wise(tower, optimizer="rowwise_adagrad", lr=0.05, process_group=None)
    bag_times, tower_times, ids = [], [], []
    for step in range(args.steps + 1):
        rng = np.random.default_rng([0, step])
        users = torch.from_numpy(rng.choice(num_users, args.batch, replace=False))
        positives = torch.from_numpy(history[1][history[0][users.numpy()]])  # each user's first item
        start = time.perf_counter()
        bags = history_bags(history, users, positives, rng=rng, **variant)
        middle = time.perf_counter()
        vectors = dmp(dmp.module.features(users, bags))
        vectors.square().sum().backward()
        bag_times.append(middle - start)
        tower_times.append(time.perf_counter() - middle)
        ids.append(int(bags[1].sum()))
    return min(bag_times[1:]), min(tower_times[1:]), float(np.mean(ids[1:]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--items", type=int, default=849_000)
    parser.add_argument("--users", type=int, default=50_000, help="users in the synthetic bags (a sample)")
    parser.add_argument("--mean-bag", type=float, default=455.0)
    parser.add_argument("--batch", type=int, default=4096)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    if args.steps < 1:
        parser.error(f"--steps must be >= 1 (timed steps after one warm-up), got {args.steps}")
    if not 1 <= args.batch <= args.users:
        parser.error(f"--batch must lie in [1, --users={args.users}] (a batch draws distinct users), got {args.batch}")
    with quiet_torchrec():
        import torchrec  # noqa: F401 - the first import prints fbgemm notices
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    history = history_csr(args.users, args.items, args.mean_bag)
    variants = {
        "whole bag": {},
        "history_dropout 0.5": {"dropout": 0.5},
        "history_sample_size 64": {"sample_size": 64},
        "history_sample_size 16": {"sample_size": 16},
    }
    print(
        f"history tower: {args.items:,} items, dim {args.dim}, batch {args.batch}, "
        f"mean bag {np.diff(history[0]).mean():.0f} (max {np.diff(history[0]).max()})"
    )
    print(f"{'variant':<24}{'ids/step':>12}{'bags s':>10}{'tower s':>10}{'step vs whole':>15}")
    base = None
    for name, variant in variants.items():
        bag_s, tower_s, ids = time_steps(args, history, variant)
        base = base or bag_s + tower_s
        print(f"{name:<24}{ids:>12,.0f}{bag_s:>10.3f}{tower_s:>10.3f}{(bag_s + tower_s) / base:>15.2f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
