"""The user-major Rankmax's one pass over every score (``bigrank.losses.buckets``): the native bucket kernel beside
the torch path (``torch.searchsorted`` + ``scatter_add_``), on one block of a users step.

    .venv/bin/python -m benchmarks.bench_buckets [--users 256] [--columns 65536] [--positives 363] [--threads 1]

Scores and thresholds are standard normal (float32 and bf16 blocks); ns per score, best of 3, and the ratio.
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from bigrank.losses import buckets


def best_seconds(fn, repeats: int = 3) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--users", type=int, default=256)
    parser.add_argument("--columns", type=int, default=65536)
    parser.add_argument("--positives", type=int, default=363, help="thresholds a user (ML-1B: ~361 train items)")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    generator = torch.Generator().manual_seed(0)
    lengths = torch.full((args.users,), args.positives)
    table, _, m = buckets.threshold_table(torch.randn(int(lengths.sum()), generator=generator), lengths)
    counts = torch.zeros(args.users, 1 << m, dtype=torch.float64)
    sums = torch.zeros_like(counts)
    index = torch.empty(args.users, args.columns, dtype=buckets.index_dtype(1 << m))
    prefix = torch.randn(args.users, 1 << m, generator=generator)
    scores = args.users * args.columns
    built = buckets.native_available()  # before BIGRANK_NATIVE is switched below
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        block = torch.randn(args.users, args.columns, generator=generator).to(dtype)
        timing = {}
        for native in ("1", "0"):
            os.environ["BIGRANK_NATIVE"] = native
            stats = best_seconds(lambda: buckets.bucket_stats(block, table, m, counts, sums, index))  # noqa: B023
            gather = best_seconds(lambda: buckets.bucket_gather(index, prefix, m))
            timing[native] = (stats, gather)
        os.environ.pop("BIGRANK_NATIVE")
        rows.append((str(dtype).removeprefix("torch."), timing))
    print(f"{args.users} users x {args.columns:,} scores, {args.positives} thresholds a user, "
          f"{args.threads} thread(s); native kernel built: {built}")  # fmt: skip
    print(f"machine load (1/5/15 min): {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(f"{'block':<10}{'pass':<8}{'native ns/score':>17}{'torch ns/score':>16}{'torch / native':>16}")
    for name, timing in rows:
        for column, label in ((0, "stats"), (1, "gather")):
            native, torch_path = timing["1"][column], timing["0"][column]
            print(f"{name:<10}{label:<8}{native / scores * 1e9:>17.2f}{torch_path / scores * 1e9:>16.2f}"
                  f"{torch_path / native:>16.1f}")  # fmt: skip


if __name__ == "__main__":
    main()
