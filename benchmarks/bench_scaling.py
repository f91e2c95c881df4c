"""A scaling projection for clusters: bytes, collectives and per-worker compute of each layout, projected to
8, 64 and 256 workers under a stated network model.

For W = 1, 2, 4, 8 local gloo processes (oversubscribed is fine: nothing here is a wall time of the whole job)
it measures, at demo, ML-20M-preset and ML-1B sizes:

* the bytes and collectives one worker sends in one step of the item-parallel (sharded) catalog under a
  full-catalog loss (Rankmax) and sampled softmax — bigrank's own collectives, counted by
  ``bigrank.distributed.collectives.count_bytes`` on real gloo processes — beside what the cost model
  (``bigrank.model.layout.predict_step``) says for the same step, so the model's bytes are checked;
* the per-worker compute of one step (score GEMM, loss, backward; one thread, a worker's core) at the shapes
  each layout gives a worker.

Then it projects examples/s under weak scaling (a fixed batch per worker) for 8, 64 and 256 workers with the
network model below, for the one-dimensional layouts (catalog row-sharded over all W workers; catalog
replicated) and a two-dimensional one (item-parallel groups of G workers x W/G data-parallel replicas, the
best G). The user table is row-sharded in every case (2.2M users at ML-1B).

Network model (state it beside every figure): a ring collective over W workers costs ``(W - 1) * alpha`` of
latency (all-gather, reduce-scatter, all-to-all; ``2 (W - 1) alpha`` for an all-reduce) plus the bytes one
worker sends over ``beta`` (Thakur, Rabenseifner & Gropp 2005); one worker per node, alpha = 10 µs,
beta = 12.5 GB/s (100 Gb/s Ethernet or InfiniBand EDR per node). Compute and communication do not overlap.

    .venv/bin/python -m benchmarks.bench_scaling [--scales demo,ml20m,ml1b] [--measure-workers 1,2,4,8]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from dataclasses import dataclass

import torch
import torch.multiprocessing as mp

ALPHA_S = 10e-6
BETA_BYTES_S = 12.5e9
FLOAT = 4


@dataclass(frozen=True)
class Scale:
    name: str
    num_items: int
    num_users: int
    dim: int
    rankmax_rows: int  # batch rows per worker under Rankmax (full catalog)
    sampled_rows: int  # batch rows per worker under sampled softmax
    negatives: int  # sampled negatives per step over the whole catalog


SCALES = {
    "demo": Scale("demo", 1_500, 2_000, 32, 256, 256, 1_024),
    "ml20m": Scale("ml20m", 26_744, 138_493, 64, 256, 2_048, 8_192),
    "ml1b": Scale("ml1b", 855_808, 2_197_225, 64, 128, 2_048, 8_192),
}


# ------------------------------------------------------------------------------- measured: bytes on the wire
def _count_worker(rank, world, port, scale, loss, queue):
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, init_method=f"tcp://127.0.0.1:{port}")
    from bigrank.config import LossConfig
    from bigrank.distributed.collectives import all_gather_rows, count_bytes
    from bigrank.losses.scores import replicated_inputs
    from bigrank.model.catalog import CatalogShard
    from bigrank.train.losses import StepLoss

    group = dist.group.WORLD
    dim = scale.dim
    shard = CatalogShard(scale.num_items, dim, group)
    rows = scale.rankmax_rows if loss == "rankmax" else scale.sampled_rows
    config = LossConfig(name=loss) if loss == "rankmax" else LossConfig(name=loss, num_negatives=scale.negatives)
    if loss != "rankmax":
        config.candidates = "sampled"
    step_loss = StepLoss(config, num_items=scale.num_items, shard_start=shard.start, shard_stop=shard.stop, rank=rank)
    users = (torch.randn(rows, dim) * 0.1).requires_grad_(True)
    target = torch.randint(0, scale.num_items, (rows * world,), generator=torch.Generator().manual_seed(0))
    with count_bytes() as counter:
        gathered = all_gather_rows(users, group)
        with replicated_inputs():
            loss_value = step_loss(gathered, target, shard.weight, group=group, chunk_size="auto")
        loss_value.backward()
    queue.put((rank, counter.total, sum(counter.calls.values())))
    dist.destroy_process_group()


def measured_catalog_traffic(scale: Scale, loss: str, world: int) -> tuple[float, int]:
    """(bytes one worker sends, collectives) in one sharded-catalog step on ``world`` gloo processes."""
    from bigrank.train.launcher import free_port

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_count_worker, args=(r, world, port, scale, loss, queue)) for r in range(world)]
    for p in procs:
        p.start()
    results = [queue.get(timeout=600) for _ in procs]
    for p in procs:
        p.join()
    return max(r[1] for r in results), max(r[2] for r in results)


# ------------------------------------------------------------------------------- measured: per-worker compute
def compute_seconds(rows: int, cols: int, dim: int, loss: str, repeats: int = 3) -> float:
    """One thread: scores [rows, cols] = U V^T, the loss, backward to U and V — timed on one block of every row
    (up to 4,096) and at most 2^22 scores, as the trainer's ``chunk_size: auto`` splits the columns, and scaled
    linearly to rows x cols (every part of the step is linear in the scores)."""
    from bigrank.losses import rankmax_loss

    torch.set_num_threads(1)
    block_rows = min(rows, 4096)
    block_cols = max(1, min(cols, (1 << 22) // block_rows))
    users = (torch.randn(block_rows, dim) * 0.1).requires_grad_(True)
    items = (torch.randn(block_cols, dim) * 0.1).requires_grad_(True)
    target = torch.randint(0, block_cols, (block_rows,))
    times = []
    for _ in range(repeats + 1):
        started = time.perf_counter()
        scores = users @ items.T
        value = rankmax_loss(scores, target) if loss == "rankmax" else torch.nn.functional.cross_entropy(scores, target)
        value.backward()
        times.append(time.perf_counter() - started)
        users.grad = items.grad = None
    return statistics.median(times[1:]) * (rows * cols) / (block_rows * block_cols)


# ------------------------------------------------------------------------------------------------ projection
def _ring(world: int, payload: float, all_reduce: bool = False) -> float:
    """Seconds of a ring collective over ``world`` workers moving ``payload`` bytes in total (per worker sent:
    (W-1)/W of it, twice for an all-reduce)."""
    if world <= 1:
        return 0.0
    factor = 2 if all_reduce else 1
    return factor * ((world - 1) * ALPHA_S + (world - 1) / world * payload / BETA_BYTES_S)


def project(scale: Scale, loss: str, world: int, group: int, compute) -> tuple[float, float]:
    """``(compute s, communication s)`` of one step: the catalog in item-parallel groups of ``group`` workers
    (group = world: 1-D sharded; group = 1: replicated), ``world // group`` data-parallel replicas."""
    replicas = world // group
    rows = scale.rankmax_rows if loss == "rankmax" else scale.sampled_rows
    dim = scale.dim
    cols = scale.num_items if loss == "rankmax" else scale.negatives
    seconds = compute(rows * group, -(-cols // group))
    comm = 0.0
    if group > 1:  # user vectors + targets gathered in the group, their gradients back; per-row statistics
        comm += 2 * _ring(group, rows * group * (dim * FLOAT + 8))
        comm += 3 * _ring(group, rows * group * 4 * 8)
    if replicas > 1:
        if loss == "rankmax":  # the group's catalog rows: a dense gradient all-reduced over the replicas
            comm += _ring(replicas, scale.num_items / group * dim * FLOAT, all_reduce=True)
        else:  # the touched rows (positives + negatives) all-gathered over the replicas
            comm += _ring(replicas, replicas * (rows + scale.negatives / group) * (dim + 1) * FLOAT)
    comm += 4 * _ring(world, rows * world * (8 + 2 * dim * FLOAT))  # row-wise sharded user table (all-to-all)
    return seconds, comm


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scales", default="demo,ml20m,ml1b")
    parser.add_argument("--measure-workers", default="1,2,4,8", help="local gloo processes for the byte counts")
    parser.add_argument("--project-workers", default="8,64,256")
    parser.add_argument("--no-count", action="store_true", help="skip the byte counts (section 1)")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from bigrank.model.layout import StepShape, predict_step

    print(f"machine load (1/5/15 min): {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(f"network model: ring collectives, alpha {ALPHA_S * 1e6:.0f} µs a hop, beta {BETA_BYTES_S / 1e9:.1f} GB/s")
    scales = [SCALES[s] for s in args.scales.split(",")]
    measure = [int(w) for w in args.measure_workers.split(",")]
    print("\n1. One worker's payload in one sharded-catalog step: the tensors it hands to bigrank's collectives")
    print("   (counted on gloo processes; a ring moves (W-1)/W of an all-gathered payload, 2(W-1)/W of an")
    print("   all-reduced one), and the collectives; the cost model's collective count beside it")
    print(f"{'scale':<7}{'loss':<17}{'W':>3}{'payload MB':>12}{'collectives':>12}{'model':>7}")
    for scale in scales if not args.no_count else []:
        for loss in ("rankmax", "sampled_softmax"):
            for world in measure:
                if world == 1:
                    continue
                sent, calls = measured_catalog_traffic(scale, loss, world)
                rows = scale.rankmax_rows if loss == "rankmax" else scale.sampled_rows
                shape = StepShape(world, rows * world, scale.dim, scale.num_items, scale.num_users,
                                  full_catalog=loss == "rankmax", num_negatives=scale.negatives)  # fmt: skip
                # The model's count without the tower (a replicated user table adds 1 collective here).
                model = predict_step(shape, {"catalog": "sharded", "user_table": "replicated"}).collectives - 1
                print(f"{scale.name:<7}{loss:<17}{world:>3}{sent / 1e6:>12.3f}{calls:>12}{model:>7}")
    print("\n2. Per-worker compute of one step (1 thread), measured, by layout")
    cache: dict = {}

    def compute_for(scale, loss):
        def compute(rows, cols):
            key = (scale.name, loss, rows, cols)
            if key not in cache:
                cache[key] = compute_seconds(rows, cols, scale.dim, loss)
            return cache[key]

        return compute

    print(f"{'scale':<7}{'loss':<17}{'W':>3}{'sharded ms':>12}{'replicated ms':>15}")
    for scale in scales:
        for loss in ("rankmax", "sampled_softmax"):
            compute = compute_for(scale, loss)
            for world in measure:
                sharded = project(scale, loss, world, world, compute)[0]
                replicated = project(scale, loss, world, 1, compute)[0]
                print(f"{scale.name:<7}{loss:<17}{world:>3}{sharded * 1e3:>12.2f}{replicated * 1e3:>15.2f}")
    print("\n3. Projected examples/s (weak scaling: a fixed batch per worker), compute + communication, no overlap")
    header = f"{'scale':<7}{'loss':<17}{'W':>4}{'1-D sharded':>14}{'replicated':>14}{'2-D best (G)':>20}"
    print(header + f"{'2-D / 1-D':>11}")
    for scale in scales:
        for loss in ("rankmax", "sampled_softmax"):
            compute = compute_for(scale, loss)
            rows = scale.rankmax_rows if loss == "rankmax" else scale.sampled_rows
            for world in (int(w) for w in args.project_workers.split(",")):
                rate = {}
                for group in (g for g in (2**i for i in range(world.bit_length())) if world % g == 0):
                    seconds = sum(project(scale, loss, world, group, compute))
                    rate[group] = rows * world / seconds
                best = max(rate, key=rate.get)
                print(
                    f"{scale.name:<7}{loss:<17}{world:>4}{rate[world]:>14,.0f}{rate[1]:>14,.0f}"
                    f"{f'{rate[best]:,.0f} ({best})':>20}{rate[best] / rate[world]:>11.2f}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
