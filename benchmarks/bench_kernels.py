"""Eager against compiled row kernels (``bigrank.losses.kernels``) for one full-catalog step, by block size:
the measurement behind ``kernels.COMPILE_MIN_ELEMENTS``.

A step is ``scores = U @ V.T`` ([B, d] x [n, d], one block), the loss, backward to U and V, as a worker runs it.
Each cell runs in its own process (``BIGRANK_COMPILE=0`` or ``1``, ``torch.set_num_threads(T)``), times the
first call (what torch.compile costs a process, with inductor's on-disk cache as it stands) and the median of
the later steps. The ratio column is eager / compiled (above 1: compiling pays per step); "steps to repay" is
the compile time over the per-step saving.

    .venv/bin/python -m benchmarks.bench_kernels                       # rankmax, softmax; 1 and 2 threads
    .venv/bin/python -m benchmarks.bench_kernels --losses rankmax --threads 1 --blocks 256x1000,256x9742
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

DEFAULT_BLOCKS = "64x1000,128x1000,256x1000,256x1500,256x4000,256x9742,512x9742"


def cell(loss: str, rows: int, items: int, dim: int, threads: int) -> dict:
    """One process's timing (run by ``--cell``): first call and median step, in seconds."""
    import torch

    from benchmarks.bench_losses import loss_step
    from benchmarks.bench_train import FULL_CATALOG

    torch.set_num_threads(threads)
    step = loss_step(FULL_CATALOG[loss])
    generator = torch.Generator().manual_seed(0)
    users = torch.randn(rows, dim, generator=generator)
    catalog = torch.randn(items, dim, generator=generator) * 0.1
    target = torch.randint(0, items, (rows,), generator=generator)

    def timed() -> float:
        start = time.perf_counter()
        step(users, catalog, target, None, None)  # one block: chunk_size None, the scores' own dtype
        return time.perf_counter() - start

    first = timed()
    for _ in range(3):
        timed()
    repeats = max(7, min(200, int(3e8 / (rows * items))))
    times = sorted(timed() for _ in range(repeats))
    return {"first_s": first, "step_s": times[len(times) // 2]}


def measure(mode: str, loss: str, rows: int, items: int, dim: int, threads: int) -> dict:
    command = [
        sys.executable,
        "-m",
        "benchmarks.bench_kernels",
        "--cell",
        json.dumps([loss, rows, items, dim, threads]),
    ]
    env = dict(os.environ, BIGRANK_COMPILE=mode, OMP_NUM_THREADS=str(threads))
    out = subprocess.run(command, env=env, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--losses", default="rankmax,softmax")
    parser.add_argument("--blocks", default=DEFAULT_BLOCKS, help="ROWSxITEMS, comma-separated")
    parser.add_argument("--threads", default="1,2", help="intra-op threads, comma-separated")
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--cell", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.cell:
        print(json.dumps(cell(*json.loads(args.cell))))
        return
    from bigrank.losses.kernels import COMPILE_MIN_ELEMENTS

    print(f"machine load (1/5/15 min): {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(f"d={args.dim}; kernels.COMPILE_MIN_ELEMENTS = {COMPILE_MIN_ELEMENTS:,}")
    header = f"{'loss':<9} {'threads':>7} {'block':>11} {'entries':>10} {'eager ms':>9} {'compiled ms':>11} "
    print(header + f"{'ratio':>6} {'compile s':>9} {'steps to repay':>14}")
    for loss in args.losses.split(","):
        for threads in (int(t) for t in args.threads.split(",")):
            for block in args.blocks.split(","):
                rows, items = (int(x) for x in block.split("x"))
                eager = measure("0", loss, rows, items, args.dim, threads)
                compiled = measure("1", loss, rows, items, args.dim, threads)
                saving = eager["step_s"] - compiled["step_s"]
                compile_s = max(compiled["first_s"] - eager["first_s"], 0.0)
                repay = f"{compile_s / saving:,.0f}" if saving > 0 else "never"
                print(
                    f"{loss:<9} {threads:>7} {block:>11} {rows * items:>10,} {eager['step_s'] * 1e3:>9.2f} "
                    f"{compiled['step_s'] * 1e3:>11.2f} {eager['step_s'] / compiled['step_s']:>6.2f} "
                    f"{compile_s:>9.1f} {repay:>14}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
