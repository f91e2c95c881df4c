"""One full-catalog training step per loss, as ratios to softmax and to the bare-GEMM floor.

A step is: scores = U @ V.T ([B, d] x [n, d]), the loss, backward to U and V. The floor is the three GEMMs
every step needs (scores, dU = G @ V, dV = G.T @ U) with no loss at all. Losses are timed round-robin (one
step of each per round, best of several rounds) so that they share the machine's state side by side.

    .venv/bin/python -m benchmarks.bench_losses [--items 849000] [--dim 64] [--batch 256] [--rounds 5]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from bigrank.losses import rankmax_loss, softmax_loss, sparsemax_loss


def gemm_floor(users, items, _target):
    scores = users @ items.T
    grad = torch.ones_like(scores)  # stands in for dL/dscores
    return grad @ items, grad.T @ users


def loss_step(loss_fn):
    def step(users, items, target):
        users = users.detach().requires_grad_(True)
        items = items.detach().requires_grad_(True)
        loss = loss_fn(users @ items.T, target)
        loss.backward()
        return users.grad, items.grad

    return step


STEPS = {
    "GEMM floor (3 GEMMs)": gemm_floor,
    "softmax (bigrank)": loss_step(softmax_loss),
    "softmax (F.cross_entropy)": loss_step(F.cross_entropy),
    "rankmax k=1": loss_step(lambda s, y: rankmax_loss(s, y, k=1)),
    "rankmax k=10": loss_step(lambda s, y: rankmax_loss(s, y, k=10)),
    "sparsemax": loss_step(sparsemax_loss),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--items", type=int, default=849_000)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()

    generator = torch.Generator().manual_seed(0)
    users = torch.randn(args.batch, args.dim, generator=generator) * 0.1
    items = torch.randn(args.items, args.dim, generator=generator) * 0.1
    target = torch.randint(0, args.items, (args.batch,), generator=generator)
    times: dict[str, list[float]] = {name: [] for name in STEPS}
    for _ in range(args.rounds + 1):  # the first round warms up allocator and caches, and is dropped
        for name, step in STEPS.items():
            start = time.perf_counter()
            step(users, items, target)
            times[name].append(time.perf_counter() - start)
    best = {name: min(values[1:]) for name, values in times.items()}
    floor, softmax = best["GEMM floor (3 GEMMs)"], best["softmax (bigrank)"]
    print(f"n={args.items:,} d={args.dim} B={args.batch} threads={torch.get_num_threads()} rounds={args.rounds}")
    print(f"{'step':<28}{'best s':>9}{'median s':>10}{'x softmax':>11}{'x floor':>9}")
    for name, values in times.items():
        median = sorted(values[1:])[len(values[1:]) // 2]
        print(f"{name:<28}{best[name]:>9.3f}{median:>10.3f}{best[name] / softmax:>11.2f}{best[name] / floor:>9.2f}")


if __name__ == "__main__":
    main()
