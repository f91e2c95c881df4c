"""Original id -> dense id lookup at ML-1B's scale: ``OriginalIdIndex`` against the linear scan it replaced and a
Python dict (issue 38).

The servers and ``bigrank recommend`` build one index per table when they load an export and look every request's
ids up in it. This builds the tables an ML-1B export of string ids would hold (2,197,225 users with 12-character
ids such as ``u0000004211a``, 849K items with int64 ids, and the same items with SKU-like string ids of 8-20
characters), each in a shuffled dense order (as a later ingest that appends ids leaves them), and prints for each:
build seconds, bytes held (the index's arrays, and the RSS growth of the build), the median time of one lookup,
of a batch of 1,000, and the old linear scan's time for one lookup.

    .venv/bin/python -m benchmarks.bench_ids [--users 2197225] [--items 849000] [--repeat 2000]
"""

from __future__ import annotations

import argparse
import gc
import resource
import statistics
import time

import numpy as np


def rss_mb() -> float:
    """Resident set size now, MB (from /proc: ru_maxrss is the peak only)."""
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * resource.getpagesize() / 2**20


def string_ids(count: int, rng, prefix: str = "u", width: int = 12) -> list[str]:
    """``count`` distinct ids of ``width`` characters, in random order."""
    numbers = rng.choice(36 ** (width - len(prefix) - 1), size=count, replace=False)
    digits = np.base_repr  # base 36: letters and digits, as real ids mix them
    return [f"{prefix}{digits(int(n), 36).lower().rjust(width - len(prefix) - 1, '0')}x" for n in numbers]


def sku_ids(count: int, rng) -> list[str]:
    """``count`` distinct SKU-like ids of 8-20 characters ("sku-<n>-<variant>"), in random order."""
    numbers = rng.permutation(count)
    variants = rng.integers(0, 26**3, size=count)
    return [
        f"sku-{n}-" + "".join(chr(65 + (v // 26**j) % 26) for j in range(1 + n % 3))
        for n, v in zip(numbers.tolist(), variants.tolist(), strict=True)
    ]


def median_seconds(function, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        function()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(name: str, values: list, rng, repeat: int) -> None:
    import pyarrow as pa

    from bigrank.export.ids import OriginalIdIndex

    array = pa.array(values)
    gc.collect()
    before = rss_mb()
    start = time.perf_counter()
    index = OriginalIdIndex(array)
    build = time.perf_counter() - start
    grown = rss_mb() - before
    probes = [values[int(i)] for i in rng.integers(0, len(values), size=repeat)]
    batch = [values[int(i)] for i in rng.integers(0, len(values), size=1000)]
    position = iter(range(10**9))
    one = median_seconds(lambda: index.lookup([probes[next(position) % repeat]]), repeat)
    many = median_seconds(lambda: index.lookup(batch), 20)
    check = index.lookup(batch)
    assert all(values[d] == v for d, v in zip(check.tolist(), batch, strict=True)), "a lookup is wrong"
    assert index.lookup(["no such id" if index.kind == "string" else -12345])[0] == -1
    column = array.to_numpy(zero_copy_only=False)  # what the old scan compared against
    scan = median_seconds(lambda: np.flatnonzero(column == probes[0]), 5)
    print(
        f"{name:<34} {len(values):>9,}  build {build:6.2f} s  held {index.nbytes / 2**20:6.1f} MB "
        f"(RSS +{grown:6.1f} MB)  one {one * 1e6:6.1f} us  1,000 {many * 1e3:6.2f} ms  "
        f"old scan one {scan * 1e3:7.1f} ms"
    )


def measure_dict(name: str, values: list) -> None:
    gc.collect()
    before = rss_mb()
    start = time.perf_counter()
    table = {value: dense for dense, value in enumerate(values)}
    build = time.perf_counter() - start
    print(f"{name:<34} {len(table):>9,}  build {build:6.2f} s  RSS +{rss_mb() - before:6.1f} MB (ids already in RAM)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--users", type=int, default=2_197_225, help="string user ids (default ML-1B's 2,197,225)")
    parser.add_argument("--items", type=int, default=849_000, help="items (default ~ML-1B's 849K rated)")
    parser.add_argument("--repeat", type=int, default=2000, help="single lookups timed (median)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = np.random.default_rng(args.seed)

    users = string_ids(args.users, rng)
    measure("users: 12-character string ids", users, rng, args.repeat)
    item_numbers = rng.choice(2**40, size=args.items, replace=False).tolist()
    measure("items: int64 ids", item_numbers, rng, args.repeat)
    skus = sku_ids(args.items, rng)
    measure("items: SKU-like string ids", skus, rng, args.repeat)
    measure_dict("users: a Python dict, for scale", users)


if __name__ == "__main__":
    main()
