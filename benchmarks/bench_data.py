"""Data-layer benchmark: generation rate and peak memory, stream throughput vs a bare pyarrow scan.

    .venv/bin/python -m benchmarks.bench_data [--workdir DIR] [--blocks 32] [--keep]
    .venv/bin/python -m benchmarks.bench_data --stream-root data/ml1b --max-rows 6000000   # stream section only
    .venv/bin/python -m benchmarks.bench_data --checksums /tmp/demo /tmp/ml20m               # integrity section only

1. ``ml20m`` preset: seconds, ratings/s, peak RSS (each generation runs in its own child process so its
   peak RSS is its own).
2. ``ml1b``: the first ``--blocks`` of the 512 expansion blocks (seed + SVD + blocks), then the full run's
   time projected as seed_and_svd + 512 / blocks x block_time. Targets: <= 15 min, peak RSS <= 4 GB.
3. ``ParquetStream`` rows/s of rank 0 (of 1 and 2 ranks; shuffled and not) against bare ``pyarrow`` reads of
   the same rank's row groups, in the stream's window order (the same rows, columns and, for the reference,
   the same output: int64 torch batches of ``--batch-size`` rows, without the stream's shuffle, prefetch and
   state) and as zero-copy numpy views (the raw read), on the ml20m train split (or ``--stream-root``). The
   passes run interleaved for ``--repeats`` rounds after a warm-up round; medians of rows per wall second
   and per process CPU second (load-robust on a shared machine). Target: stream >= 0.5x the int64 scan.
4. Integrity costs (``--checksums ROOT…``, datasets written with page checksums): the train split read with and
   without Parquet page-checksum verification, by a bare row-group scan and by the ``ParquetStream`` (the
   training input path; verification off by swapping ``bigrank.integrity.open_parquet`` for the benchmark
   only), interleaved rounds, medians; the CRC-32 of every file (what ``bigrank verify`` and the manifest
   write pay); a part written with and without page checksums. Target (issue 27): <= 5% slower reads. The
   machine's load (``uptime``) is printed with the table: compare ratios, not absolute rates.

All figures come from one run on the same machine; compare the ratios, not the absolute numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CHILD = r"""
import json, resource, sys, time
from pathlib import Path
mode, out, blocks = sys.argv[1], sys.argv[2], int(sys.argv[3])
started = time.perf_counter()
if mode == "ml20m":
    from bigrank.data.synthetic import generate
    manifest = generate("ml20m", out, progress=False)
    result = {"ratings": manifest["num_ratings"]}
else:
    from bigrank.data import expansion
    from bigrank.data.synthetic import PRESETS, make_seed
    preset = PRESETS["ml1b"]
    seed = make_seed(preset["seed"], 0)
    t_seed = time.perf_counter()
    reduced = expansion.reduced_matrix(seed.users, seed.items, seed.num_users, seed.num_items, preset["expand"],
                                       target_ratings=preset["target_ratings"])
    t_svd = time.perf_counter()
    status = expansion.expand_ratings(seed.users, seed.items, seed.num_users, seed.num_items, out,
                                      multiplier=preset["expand"], progress=False, max_blocks=blocks,
                                      target_ratings=preset["target_ratings"])
    result = {"ratings": status["rows_written"], "seed_s": t_seed - started, "svd_s": t_svd - t_seed,
              "expected_total": expansion.expected_ratings(reduced, len(seed.users)),
              "blocks_s": time.perf_counter() - t_svd}
result["seconds"] = time.perf_counter() - started
result["peak_rss_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6
print(json.dumps(result))
"""


def run_child(mode: str, out: Path, blocks: int = 0) -> dict:
    completed = subprocess.run(
        [sys.executable, "-c", CHILD, mode, str(out), str(blocks)], capture_output=True, text=True, check=False
    )
    if completed.returncode != 0:
        raise RuntimeError(f"{mode} child failed:\n{completed.stderr}")
    return json.loads(completed.stdout.strip().splitlines()[-1])


def bare_scan(stream, batch_size: int | None = None, max_rows: int | None = None) -> tuple[int, float]:
    """Read the row groups of ``stream``'s share with pyarrow, in file order, no shuffle; (rows, seconds).

    ``batch_size=None``: zero-copy numpy views of each row group (the raw read). Otherwise the same output
    as the stream — batches of int64 torch tensors — without shuffling, prefetching or resumable state.
    """
    import numpy as np
    import pyarrow.parquet as pq
    import torch

    started = time.perf_counter()
    rows = 0
    handles = {}
    for pieces in stream._windows(0):
        for group, lo, hi in pieces:
            file_index = int(stream._group_file[group])
            handle = handles.setdefault(file_index, pq.ParquetFile(stream._files[file_index]))
            table = handle.read_row_group(int(stream._group_index[group]), columns=["user_id", "item_id"])
            users = table.column("user_id").to_numpy()[lo:hi]
            items = table.column("item_id").to_numpy()[lo:hi]
            if batch_size is None:
                rows += min(len(users), len(items))
                if max_rows is not None and rows >= max_rows:
                    return rows, time.perf_counter() - started
                continue
            for start in range(0, len(users), batch_size):
                batch = {
                    "user_id": torch.from_numpy(users[start : start + batch_size].astype(np.int64)),
                    "item_id": torch.from_numpy(items[start : start + batch_size].astype(np.int64)),
                }
                rows += len(batch["user_id"])
            if max_rows is not None and rows >= max_rows:
                return rows, time.perf_counter() - started
    return rows, time.perf_counter() - started


def stream_rates(
    root: Path, world_size: int, batch_size: int, max_rows: int | None = None, repeats: int = 5
) -> dict[str, dict[str, float]]:
    """Rank 0 of ``world_size`` on the train split: the stream (shuffled and not) and the bare scans.

    The four passes run interleaved, ``repeats`` rounds after one warm-up round (page cache, allocator pools), so
    a load change on a shared machine hits them alike. Per pass: rows / wall second and rows / CPU second of
    the process (``time.process_time``: all its threads, so the stream's prefetch thread and pyarrow's decode
    threads count). Returns the medians, and the medians of the per-round ratios stream / bare int64 scan.
    """
    import statistics

    import torch  # noqa: F401  (imported before timing: the stream imports it on first use)

    from bigrank.data.stream import ParquetStream

    def timed(read) -> tuple[int, float, float]:
        started, started_cpu = time.perf_counter(), time.process_time()
        rows = read()
        return rows, time.perf_counter() - started, time.process_time() - started_cpu

    def timed_stream(shuffle: bool) -> tuple[int, float, float]:
        # Built (and its files checked against the manifest) before the clock starts, as a trainer does once.
        stream = ParquetStream(root, "train", batch_size, rank=0, world_size=world_size, shuffle=shuffle)

        def read() -> int:
            rows = 0
            for batch in stream:
                rows += len(batch["user_id"])
                if max_rows is not None and rows >= max_rows:
                    break
            return rows

        return timed(read)

    probe = ParquetStream(root, "train", batch_size, rank=0, world_size=world_size)
    runs = {
        "stream": lambda: timed_stream(True),
        "stream, no shuffle": lambda: timed_stream(False),
        "bare scan, int64 batches": lambda: timed(lambda: bare_scan(probe, batch_size, max_rows)[0]),
        "bare scan, zero-copy": lambda: timed(lambda: bare_scan(probe, None, max_rows)[0]),
    }
    wall = {name: [] for name in runs}
    cpu = {name: [] for name in runs}
    for round_index in range(repeats + 1):
        for name, run in runs.items():
            rows, seconds, cpu_seconds = run()
            assert max_rows is not None or rows == probe.rows_per_epoch(), (name, rows)
            if round_index:  # round 0 warms up
                wall[name].append(rows / seconds)
                cpu[name].append(rows / cpu_seconds)
    reference = "bare scan, int64 batches"
    return {
        "wall": {name: statistics.median(values) for name, values in wall.items()},
        "cpu": {name: statistics.median(values) for name, values in cpu.items()},
        "wall ratio": statistics.median(s / r for s, r in zip(wall["stream"], wall[reference], strict=True)),
        "cpu ratio": statistics.median(s / r for s, r in zip(cpu["stream"], cpu[reference], strict=True)),
    }


def print_stream_table(root: Path, batch_size: int, max_rows: int | None = None, repeats: int = 5) -> None:
    print(
        f"\n## Stream vs bare pyarrow scan ({root} train, batch {batch_size}, rank 0, "
        f"median of {repeats} interleaved rounds)"
    )
    names = ["stream", "stream, no shuffle", "bare scan, int64 batches", "bare scan, zero-copy"]
    print(f"{'ranks':>6} {'per':<11}" + "".join(f"{name:>26}" for name in names) + f"{'stream / int64 scan':>21}")
    for world_size in (1, 2):
        rates = stream_rates(root, world_size, batch_size, max_rows, repeats)
        for kind, label in (("wall", "rows/s"), ("cpu", "rows/CPU-s")):
            print(
                f"{world_size:>6} {label:<11}"
                + "".join(f"{rates[kind][name]:>26,.0f}" for name in names)
                + f"{rates[kind + ' ratio']:>21.2f}"
            )
    print(
        "target: stream >= 0.5 x the bare int64 scan (same rows, columns and output: int64 torch batches; the"
        " stream also shuffles ~shuffle_buffer-row windows with a full permutation and keeps a resumable state)"
    )


def _read_scan(root: Path, verify: bool, max_rows: int | None) -> int:
    """Rows of the train split read row group by row group (user_id, item_id; zero-copy numpy views), pages
    verified or not; stops after ``max_rows`` (None: all)."""
    import pyarrow.parquet as pq

    from bigrank.data import manifest as layout

    rows = 0
    for name in layout.load_manifest(root)["splits"]["train"]["files"]:
        handle = pq.ParquetFile(root / name, page_checksum_verification=verify)
        for group in range(handle.num_row_groups):
            table = handle.read_row_group(group, columns=["user_id", "item_id"])
            rows += len(table.column("user_id").to_numpy())
            if max_rows is not None and rows >= max_rows:
                return rows
    return rows


def _read_stream(root: Path, verify: bool, batch_size: int, max_rows: int | None) -> int:
    """Rows of a shuffled epoch of the train split through ``ParquetStream`` (rank 0 of 1; stops after
    ``max_rows``), pages verified or not: the stream opens its files with ``bigrank.integrity.open_parquet``,
    swapped here for a plain open for the unverified passes."""
    import pyarrow.parquet as pq

    from bigrank import integrity
    from bigrank.data.stream import ParquetStream

    verified = integrity.open_parquet
    if not verify:
        integrity.open_parquet = lambda path: pq.ParquetFile(path, page_checksum_verification=False)
    try:
        rows = 0
        for batch in ParquetStream(root, "train", batch_size, validate=False):
            rows += len(batch["user_id"])
            if max_rows is not None and rows >= max_rows:
                break
        return rows
    finally:
        integrity.open_parquet = verified


def _write_part(table, path: Path, checksums: bool) -> int:
    import pyarrow.parquet as pq

    from bigrank.data import manifest as layout

    pq.write_table(
        table,
        path,
        row_group_size=layout.ROW_GROUP_SIZE,
        compression=layout.COMPRESSION,
        write_page_checksum=checksums,
    )
    return table.num_rows


def checksum_costs(
    root: Path, batch_size: int, repeats: int, max_rows: int | None = None, min_seconds: float = 0.5
) -> dict:
    """Per pass kind (bare scan, stream, write of the largest train part), with and without page checksums:
    rows per wall second and per process CPU second, interleaved for ``repeats`` rounds after a warm-up round,
    each pass repeated for at least ``min_seconds``. Returns ``{(kind, "wall"|"cpu"): (unverified median,
    verified median, median of the per-round ratios)}``, the CPU seconds per row of each pass (medians), and
    ``"crc"``: (files, bytes, seconds) of the CRC-32 of every file of the dataset."""
    import statistics

    import pyarrow.parquet as pq

    from bigrank import integrity
    from bigrank.data import manifest as layout

    manifest = layout.load_manifest(root)
    parts = manifest["splits"]["train"]["files"]
    largest = max(parts, key=lambda name: (root / name).stat().st_size)
    table = pq.read_table(root / largest)
    scratch = Path(tempfile.mkdtemp(prefix="bench_checksums_"))
    passes = {
        ("scan", True): lambda: _read_scan(root, True, max_rows),
        ("scan", False): lambda: _read_scan(root, False, max_rows),
        ("stream", True): lambda: _read_stream(root, True, batch_size, max_rows),
        ("stream", False): lambda: _read_stream(root, False, batch_size, max_rows),
        ("write", True): lambda: _write_part(table, scratch / "on.parquet", True),
        ("write", False): lambda: _write_part(table, scratch / "off.parquet", False),
    }
    wall = {key: [] for key in passes}
    cpu = {key: [] for key in passes}
    rows_read = 0
    try:
        for round_index in range(repeats + 1):
            for key, run in passes.items():
                started, started_cpu = time.perf_counter(), time.process_time()
                rows = run()
                if key == ("scan", True):
                    rows_read = rows
                while time.perf_counter() - started < min_seconds:  # small datasets: enough work to time
                    rows += run()
                if round_index:  # round 0 warms up (page cache, allocator)
                    wall[key].append(rows / (time.perf_counter() - started))
                    cpu[key].append(rows / (time.process_time() - started_cpu))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    names = list((manifest.get("integrity") or {}).get("files") or parts)
    started = time.perf_counter()
    integrity.describe_files(root, names)
    crc_seconds = time.perf_counter() - started
    total_bytes = sum((root / name).stat().st_size for name in names)
    result = {"rows": rows_read, "part_rows": table.num_rows}
    for kind in ("scan", "stream", "write"):
        for label, rates in (("wall", wall), ("cpu", cpu)):
            on, off = statistics.median(rates[kind, True]), statistics.median(rates[kind, False])
            ratios = [a / b for a, b in zip(rates[kind, True], rates[kind, False], strict=True)]
            result[kind, label] = (off, on, statistics.median(ratios))
    # The verification's own CPU per row (verified minus unverified bare scan, paired by round) against the CPU
    # per row of the verified stream: what verification adds to the training input path, robust to the noise
    # of the stream's threads on a loaded machine.
    extra = [1 / a - 1 / b for a, b in zip(cpu["scan", True], cpu["scan", False], strict=True)]
    result["share of stream CPU"] = statistics.median(extra) * statistics.median(cpu["stream", True])
    result["crc"] = (len(names), total_bytes, crc_seconds)
    return result


def print_checksum_table(roots: list[Path], batch_size: int, repeats: int, max_rows: int | None = None) -> None:
    cap = f", at most {max_rows:,} rows a read pass" if max_rows else ""
    print(f"\n## Integrity costs (median of {repeats} interleaved rounds{cap}; rows/s, higher is better)")
    print(f"uptime before: {_uptime()}")
    header = f"{'dataset':<14}{'pass':<44}{'per':<11}{'unverified':>14}{'verified':>14}{'verified/unverified':>21}"
    print(header)
    notes = []
    for root in roots:
        result = checksum_costs(root, batch_size, repeats, max_rows)
        labels = {
            "scan": f"read train ({result['rows']:,} rows), bare scan",
            "stream": "read train, ParquetStream (shuffled)",
            "write": f"write a part ({result['part_rows']:,} rows)",
        }
        for kind, label in labels.items():
            for per, unit in (("wall", "rows/s"), ("cpu", "rows/CPU-s")):
                off, on, ratio = result[kind, per]
                print(f"{root.name:<14}{label:<44}{unit:<11}{off:>14,.0f}{on:>14,.0f}{ratio:>21.3f}")
        files, size, seconds = result["crc"]
        notes.append(
            f"{root.name}: page verification's CPU (bare scan, verified - unverified) = "
            f"{100 * result['share of stream CPU']:.1f}% of the verified stream's CPU per row; "
            f"crc32 of {files} files, {size / 1e6:,.1f} MB in {seconds:.2f}s "
            f"({size / 1e9 / seconds:.2f} GB/s, {min(8, os.cpu_count() or 1)} threads)"
        )
    print("\n".join(notes))
    print(f"uptime after: {_uptime()}")
    print("target (issue 27): reads with page-checksum verification <= 5% slower (verified/unverified >= 0.95)")


def _uptime() -> str:
    """The machine's load as ``uptime`` prints it."""
    done = subprocess.run(["uptime"], capture_output=True, text=True, check=False)
    load = os.getloadavg()
    return done.stdout.strip() or f"load average: {load[0]:.2f}, {load[1]:.2f}, {load[2]:.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", default=None, help="scratch directory (default: a temporary one)")
    parser.add_argument("--blocks", type=int, default=32, help="ml1b blocks to generate (of 512)")
    parser.add_argument("--batch-size", type=int, default=8192)
    parser.add_argument("--keep", action="store_true", help="keep the generated data")
    parser.add_argument(
        "--stream-root", default=None, help="only the stream section, on this existing dataset (no generation)"
    )
    parser.add_argument(
        "--max-rows", type=int, default=None, help="stream and integrity sections: rows read per pass (default all)"
    )
    parser.add_argument("--repeats", type=int, default=5, help="stream section: interleaved timed rounds")
    parser.add_argument(
        "--checksums",
        nargs="+",
        metavar="ROOT",
        default=None,
        help="only the integrity-cost section, on these datasets",
    )
    args = parser.parse_args()
    if args.checksums:
        print_checksum_table([Path(root) for root in args.checksums], args.batch_size, args.repeats, args.max_rows)
        return
    if args.stream_root:
        print_stream_table(Path(args.stream_root), args.batch_size, args.max_rows, args.repeats)
        return
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="bench_data_"))
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        ml20m = run_child("ml20m", workdir / "ml20m")
        ml1b = run_child("ml1b", workdir / "ml1b_subset", args.blocks)
        per_block = ml1b["blocks_s"] / args.blocks
        projected = ml1b["seed_s"] + ml1b["svd_s"] + 512 * per_block
        print("\n## Generation (each in its own process)")
        print(f"{'run':<28}{'ratings':>15}{'seconds':>10}{'ratings/s':>14}{'peak RSS GB':>13}")
        for name, result in (("ml20m (seed + write)", ml20m), (f"ml1b, {args.blocks}/512 blocks", ml1b)):
            rate = result["ratings"] / result["seconds"]
            print(
                f"{name:<28}{result['ratings']:>15,}{result['seconds']:>10.1f}{rate:>14,.0f}"
                f"{result['peak_rss_gb']:>13.2f}"
            )
        print(
            f"ml1b breakdown: seed {ml1b['seed_s']:.1f}s, SVD + reduced matrix {ml1b['svd_s']:.1f}s, "
            f"{per_block:.2f}s per block ({ml1b['ratings'] / ml1b['blocks_s']:,.0f} ratings/s in blocks)"
        )
        print(
            f"projected full ml1b: {projected / 60:.1f} min for ~{ml1b['expected_total'] / 1e9:.2f}B ratings "
            f"(target <= 15 min, peak RSS <= 4 GB)"
        )

        print_stream_table(workdir / "ml20m", args.batch_size, repeats=args.repeats)
    finally:
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
