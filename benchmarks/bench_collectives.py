"""What one small gloo collective costs inside a training step, against what the layout cost model measures.

``bigrank.model.layout.measure_link`` times back-to-back all-reduces on idle workers (the plan's "collective
latency"). A training step instead calls its collectives between bursts of compute, and on a virtual machine
whose idle vCPUs halt, a worker that waits for its peer has to be woken again: the wait then costs far more.
This benchmark runs W local gloo workers (1 thread each, as the local launcher gives them on 2 cores) and times
one all-reduce of each payload size in three patterns, side by side in one run:

* ``idle``: back to back, as ``measure_link`` does;
* ``between compute``: a 256 x 256 matmul on every worker before each collective (a step's pattern), the
  calling thread blocking in gloo as torch does;
* ``between compute, spin-wait``: the same, but the collective is started with ``async_op=True`` and the
  calling thread polls ``work.is_completed()`` with ``sched_yield`` (as MPI libraries wait) instead of sleeping.

    .venv/bin/python -m benchmarks.bench_collectives [--workers 2] [--iterations 400]

Mean and tail matter more than the median: a step waits in 8-11 collectives (see plan.txt), each one's mean.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from bigrank.train.launcher import free_port

SIZES = (8, 4096, 131072)  # bytes: a flag, a row statistic of 512 rows, a 512 x 64 float32 gradient
PATTERNS = ("idle", "between compute", "between compute, spin-wait")


def _time_one(x: torch.Tensor, pattern: str, work_matrix: torch.Tensor) -> float:
    if pattern != "idle":
        (work_matrix @ work_matrix).sum()
    started = time.perf_counter()
    if pattern.endswith("spin-wait"):
        work = dist.all_reduce(x, async_op=True)
        while not work.is_completed():
            os.sched_yield()
        work.wait()
    else:
        dist.all_reduce(x)
    return time.perf_counter() - started


def _worker(rank: int, world: int, port: int, iterations: int, results) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    work_matrix = torch.randn(256, 256)
    for size in SIZES:
        x = torch.zeros(max(size // 8, 1), dtype=torch.float64)
        for pattern in PATTERNS:
            seconds = [_time_one(x, pattern, work_matrix) for _ in range(iterations)][iterations // 8 :]
            if rank == 0:
                seconds.sort()
                results[(size, pattern)] = (
                    statistics.median(seconds),
                    statistics.mean(seconds),
                    seconds[int(0.9 * (len(seconds) - 1))],
                )
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--iterations", type=int, default=400)
    args = parser.parse_args()
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_worker, args=(args.workers, free_port(), args.iterations, results), nprocs=args.workers)
        results = dict(results)
    print(f"gloo all-reduce, {args.workers} local workers of 1 thread, {args.iterations} calls per cell")
    print(f"machine load (1/5/15 min): {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(f"{'bytes':>8}  {'pattern':<28}{'median µs':>11}{'mean µs':>10}{'p90 µs':>9}{'mean / idle median':>20}")
    for size in SIZES:
        idle_median = results[(size, "idle")][0]
        for pattern in PATTERNS:
            median, mean, p90 = results[(size, pattern)]
            print(
                f"{size:>8}  {pattern:<28}{median * 1e6:>11.0f}{mean * 1e6:>10.0f}{p90 * 1e6:>9.0f}"
                f"{mean / idle_median:>20.1f}"
            )


if __name__ == "__main__":
    main()
