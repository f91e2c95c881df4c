"""The user-major Rankmax's one pass over every score (``bigrank.losses.buckets``): the native bucket kernel beside
the torch path (``torch.searchsorted`` + ``scatter_add_``), on one block of a users step.

    .venv/bin/python -m benchmarks.bench_buckets [--users 256] [--columns 65536] [--positives 363] [--heavy 20000]
                                                 [--threads 1]

Two batches: every user with ``--positives`` thresholds, and the same with one user holding ``--heavy`` instead
(issue 48: one heavy user made every row of the batch search at its depth). Each batch is run with each row at its
own depth (what ``threshold_table`` builds) and with every row at the deepest row's depth (one depth a batch: the
layout before rows had their own, same kernel), native and torch. Scores and thresholds are standard normal
(float32 and bf16 blocks); ns per score of CPU time (steady on a shared machine) and of wall time, best of 3;
the table's entries (the size of each per-bucket buffer: counts, sums, prefix) and the machine's load beside
them.
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from bigrank.losses import buckets


def best_seconds(fn, repeats: int = 3) -> tuple[float, float]:
    """``(CPU seconds, wall seconds)`` of ``fn()``, each the best of ``repeats`` after one warm-up call. CPU time
    (``time.process_time``: every thread of this process) holds steady on a machine others load, where wall time
    does not."""
    fn()
    cpu, wall = [], []
    for _ in range(repeats):
        cpu_start, wall_start = time.process_time(), time.perf_counter()
        fn()
        cpu.append(time.process_time() - cpu_start)
        wall.append(time.perf_counter() - wall_start)
    return min(cpu), min(wall)


def time_passes(block: torch.Tensor, table: buckets.ThresholdTable, native: str) -> tuple[float, float, float]:
    """CPU and wall seconds of one statistics pass, and CPU seconds of one gather, over ``block``
    (``BIGRANK_NATIVE=native``)."""
    os.environ["BIGRANK_NATIVE"] = native
    counts, sums = table.zeros(), table.zeros()
    index = torch.empty(block.shape, dtype=table.index_dtype)
    prefix = torch.randn(table.values.numel(), generator=torch.Generator().manual_seed(1))
    stats_cpu, stats_wall = best_seconds(lambda: buckets.bucket_stats(block, table, counts, sums, index))
    gather_cpu, _ = best_seconds(lambda: buckets.bucket_gather(index, table, prefix))
    os.environ.pop("BIGRANK_NATIVE")
    return stats_cpu, stats_wall, gather_cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--users", type=int, default=256)
    parser.add_argument("--columns", type=int, default=65536)
    parser.add_argument("--positives", type=int, default=363, help="thresholds a user (ML-1B: ~361 train items)")
    parser.add_argument("--heavy", type=int, default=20_000, help="thresholds of the one heavy user")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    generator = torch.Generator().manual_seed(0)
    built = buckets.native_available()
    scores = args.users * args.columns
    batches = {"even": torch.full((args.users,), args.positives)}
    batches["one heavy"] = batches["even"].clone()
    batches["one heavy"][args.users // 2] = args.heavy
    load_before = os.getloadavg()
    rows = []
    for batch, lengths in batches.items():
        thresholds = torch.randn(int(lengths.sum()), generator=generator)
        own = buckets.threshold_table(thresholds, lengths)
        one = buckets.threshold_table(thresholds, lengths, depth=torch.full_like(lengths, own.max_depth))
        for dtype in (torch.float32, torch.bfloat16):
            block = torch.randn(args.users, args.columns, generator=generator).to(dtype)
            for layout, table in (("own depth", own), ("one depth", one)):
                for path in ("native", "torch") if built else ("torch",):
                    seconds = time_passes(block, table, "1" if path == "native" else "0")
                    name = str(dtype).removeprefix("torch.")
                    rows.append((batch, name, layout, path, table.values.numel(), *seconds))
    print(
        f"{args.users} users x {args.columns:,} scores, {args.positives} thresholds a user (one heavy: one user "
        f"with {args.heavy:,}), {args.threads} thread(s); native kernel built: {built}"
    )
    load_after = os.getloadavg()
    print(f"machine load (1/5/15 min): before {' '.join(f'{x:.2f}' for x in load_before)}, "
          f"after {' '.join(f'{x:.2f}' for x in load_after)} on {os.cpu_count()} CPUs")  # fmt: skip
    header = f"{'batch':<11}{'block':<10}{'rows at':<11}{'path':<8}{'table entries':>14}"
    print(f"{header}{'stats ns/score: CPU':>21}{'wall':>7}{'gather CPU ns/score':>21}")
    for batch, name, layout, path, entries, stats_cpu, stats_wall, gather_cpu in rows:
        per_score = [seconds / scores * 1e9 for seconds in (stats_cpu, stats_wall, gather_cpu)]
        print(f"{batch:<11}{name:<10}{layout:<11}{path:<8}{entries:>14,}"
              f"{per_score[0]:>21.2f}{per_score[1]:>7.1f}{per_score[2]:>21.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
