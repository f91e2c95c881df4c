"""Exact recommendation per query batch: the certified bf16 top-K against FAISS ``IndexFlatIP`` (issue 28).

``bigrank recommend`` and the exact index of ``bigrank serve`` answer a batch of known users with
``Recommender.search_batch``: each user's vector, its seen items excluded, the top k of the whole catalog. On a
CPU with bf16 units the float32 exact index is ``CertifiedExactIndex`` (bf16 scores, certified candidates
rescored in fp32: the items and order of fp32 brute force); elsewhere, and before it, FAISS's ``IndexFlatIP``
(fp32 scores, asked for ``k + |seen|`` items, the seen ones dropped afterwards). This loads one export twice,
once with each, and for each batch size and k times the same batches of random users in turn (``--repeat``
rounds, the two taking turns; the median per batch), counts the users whose item ids differ between the two
(FAISS sums in another order, so a near-tie may swap; the certified answer is fp32 brute force's, checked by the
tests), and prints the ratio.

    .venv/bin/python -m benchmarks.bench_recommend --export EXPORT_DIR [--batches 1 16 64 256] [--ks 10 100]

The export is what ``bigrank export RUN --out EXPORT_DIR`` writes (with its seen-items table, so the known
users' train items are excluded as ``bigrank recommend`` does). Threads: torch's and FAISS's default (the cores).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np


def machine_load() -> str:
    one, five, _ = os.getloadavg()
    return f"load {one:.1f} / {five:.1f} (1 / 5 min), {os.cpu_count()} cores"


def run_round(recommender, batches, k: int):
    """One pass over ``batches``: seconds per batch, and the answers."""
    start = time.perf_counter()
    found = []
    for users, excluded in batches:
        vectors = np.stack([recommender.user_vector(int(u)) for u in users])
        found.append(recommender.search_batch(vectors, [k] * len(users), excluded))
    return (time.perf_counter() - start) / len(batches), found


def main() -> None:
    from bigrank.export.index import CertifiedExactIndex
    from bigrank.export.recommend import Recommender

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--export", required=True, help="an export directory (bigrank export)")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64, 256], help="users per query batch")
    parser.add_argument("--ks", type=int, nargs="+", default=[10, 100])
    parser.add_argument("--users", type=int, default=256, help="users per batch size and round (default 256)")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    certified = Recommender(args.export, index="exact", verify=False, certified_bf16=True)
    faiss_flat = Recommender(args.export, index="exact", verify=False, certified_bf16=False)
    if not isinstance(certified.index, CertifiedExactIndex):
        raise SystemExit("this CPU has no bf16 units: the exact index is FAISS's either way, nothing to compare")
    if certified.seen is None:
        print("note: the export has no seen-items table: nothing is excluded")
    rng = np.random.default_rng(args.seed)
    print(
        f"export {args.export}: {certified.num_items:,} items x {certified.dim}, {certified.num_users:,} users; "
        f"{machine_load()}"
    )
    print(f"{'batch':>6}{'k':>6}{'FAISS s/batch':>15}{'certified s/batch':>19}{'speed-up':>10}{'rows differing':>16}")
    for size in args.batches:
        batches = []
        for _ in range(max(1, args.users // size)):
            users = rng.integers(0, certified.num_users, size)
            seen = [certified.seen.train_items_of(int(u)) if certified.seen else np.empty(0, np.int64) for u in users]
            batches.append((users, seen))
        for k in args.ks:
            timings = {"faiss": [], "certified": []}
            answers = {}
            for round_index in range(args.repeat):  # in turn, the first alternating: neither always finds caches warm
                order = [("faiss", faiss_flat), ("certified", certified)]
                for name, recommender in order if round_index % 2 == 0 else order[::-1]:
                    seconds, found = run_round(recommender, batches, k)
                    timings[name].append(seconds)
                    answers.setdefault(name, found)
            flat_median, cert_median = statistics.median(timings["faiss"]), statistics.median(timings["certified"])
            rows = [
                (a_ids, b_ids)
                for a, b in zip(answers["faiss"], answers["certified"], strict=True)
                for (a_ids, _), (b_ids, _) in zip(a, b, strict=True)
            ]
            differ = sum(not np.array_equal(a_ids, b_ids) for a_ids, b_ids in rows)
            print(
                f"{size:>6}{k:>6}{flat_median:>15.4f}{cert_median:>19.4f}{flat_median / cert_median:>9.2f}x"
                f"{f'{differ} of {len(rows)}':>16}"
            )
    print(machine_load())


if __name__ == "__main__":
    main()
