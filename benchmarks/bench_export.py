"""Export time, and queries/s + recall@10 of the exact and approximate item indexes, side by side in one run.

Part 1 writes an export of a random ``items x dim`` catalog and ``users x dim`` user table with
``export_embeddings`` — one process, then two gloo ranks each writing its half — and times loading it back
(checksum verification, reading the parts). Part 2 builds the FAISS inner-product indexes over the catalog
(exact ``IndexFlatIP``, IVF-Flat, HNSW-Flat) and measures, on the same random queries, queries/s in
batches and one query at a time, and recall@10 against the exact top-10. Ratios are to the exact index.
``--catalog clustered`` replaces the i.i.d. Gaussian rows (no structure: the worst case for IVF and HNSW) by a
Gaussian mixture with log-normal norms, closer to trained embeddings.

``--seen DATA_ROOT`` times the seen-items table of that dataset (``bigrank.export.seen.write_seen_part``) as
``bigrank export`` writes it: ``--seen-ranks`` processes at once, each an even share of the users, and reports
each rank's seconds and peak RSS (VmHWM of a process that holds only the build, not a model), with the load
average. ``--seen-compare FILE`` first runs the same with another revision's module (``git show
REV:bigrank/export/seen.py > FILE``) and checks that both wrote the same bytes.

    .venv/bin/python -m benchmarks.bench_export [--items 849000] [--dim 64] [--users 200000] [--queries 1000]
        [--hnsw-m 16 --ef-construction 40] [--catalog random|clustered] [--skip-export] [--skip-index]
        [--seen DATA_ROOT [--seen-ranks 2] [--seen-compare FILE]]
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch


def random_rows(seed: int, rows: int, dim: int, start: int = 0, stop: int | None = None) -> torch.Tensor:
    """Rows ``[start, stop)`` of a seeded random table (the same values whichever rank asks)."""
    import torch  # imported where used: the seen-items workers must start without it

    values = np.random.default_rng(seed).standard_normal((rows, dim), dtype=np.float32)
    return torch.from_numpy(values[start : rows if stop is None else stop].copy())


def export_once(out: Path, rank: int, world_size: int, group, items: int, users: int, dim: int, quantize) -> float:
    from bigrank.export.writer import export_embeddings

    def share(rows):
        return rank * rows // world_size, (rank + 1) * rows // world_size

    import torch

    (i0, i1), (u0, u1) = share(items), share(users)
    item_rows = random_rows(1, items, dim, i0, i1)
    user_rows = random_rows(2, users, dim, u0, u1)
    if group is not None:
        torch.distributed.barrier(group)
    started = time.perf_counter()
    export_embeddings(
        out,
        rank=rank,
        world_size=world_size,
        group=group,
        item_rows=(i0, i1, item_rows),
        user_rows=(u0, u1, user_rows),
        model_info={"dim": dim, "loss": "benchmark"},
        quantize=quantize,
    )
    return time.perf_counter() - started


def _rank_main(rank, world_size, port, out, items, users, dim, quantize, queue):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, init_method=f"tcp://127.0.0.1:{port}")
    try:
        seconds = export_once(Path(out), rank, world_size, dist.group.WORLD, items, users, dim, quantize)
    finally:
        dist.destroy_process_group()
    queue.put((rank, seconds))


def export_two_ranks(out: Path, items: int, users: int, dim: int, quantize) -> float:
    import torch.multiprocessing as mp

    from bigrank.train.launcher import free_port

    port = free_port()
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    args = (2, port, str(out), items, users, dim, quantize, queue)
    procs = [ctx.Process(target=_rank_main, args=(rank, *args)) for rank in range(2)]
    for proc in procs:
        proc.start()
    seconds = max(queue.get(timeout=600)[1] for _ in procs)
    for proc in procs:
        proc.join()
    return seconds


def directory_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def bench_export(args, tmp: Path) -> None:
    from bigrank.export.recommend import load_export, read_table

    print(f"\n## Export: {args.items:,} items + {args.users:,} users, d={args.dim} (float32 parts)\n")
    print("| export | seconds | MB written | MB/s |")
    print("|---|---:|---:|---:|")
    runs = [
        ("1 process", 1, ()),
        ("2 gloo ranks", 2, ()),
        ("1 process + float16 + int8 copies", 1, ("float16", "int8")),
    ]
    for name, world, quantize in runs:
        out = tmp / f"export-{world}-{len(quantize)}"
        if world == 1:
            seconds = export_once(out, 0, 1, None, args.items, args.users, args.dim, quantize)
        else:
            seconds = export_two_ranks(out, args.items, args.users, args.dim, quantize)
        megabytes = directory_bytes(out) / 1e6
        print(f"| {name} | {seconds:.2f} | {megabytes:,.0f} | {megabytes / seconds:,.0f} |")
    out = tmp / "export-1-0"
    started = time.perf_counter()
    manifest = load_export(out, verify=True)
    verify = time.perf_counter() - started
    started = time.perf_counter()
    read_table(out, manifest, "items")
    read = time.perf_counter() - started
    print(f"\nload_export (sha256 + footers of all parts): {verify:.2f} s; read the item table: {read:.2f} s")


def _status_mb(field: str) -> float:
    """``field`` (e.g. ``VmHWM``, the peak RSS) of this process from /proc/self/status, in MB."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1000
    return float("nan")


def seen_worker() -> None:
    """``python -c "…; seen_worker()" MODULE_FILE RANK WORLD_SIZE DATA OUT``: write one rank's part of the seen
    table with MODULE_FILE (empty: this tree's ``bigrank.export.seen``) and print a JSON line ``{seconds,
    peak_mb, start_mb, entry}``. A process of its own that imports no torch, so its peak RSS is the build's."""
    import importlib.util
    import json
    import sys

    from bigrank.data import manifest as layout

    module_file, rank, world_size, data, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), *sys.argv[4:6]
    if module_file:
        spec = importlib.util.spec_from_file_location("seen_compared", module_file)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    else:
        from bigrank.export import seen as module
    users = int(layout.load_manifest(data)["num_users"])
    start, stop = rank * users // world_size, (rank + 1) * users // world_size
    before = _status_mb("VmRSS")
    started = time.perf_counter()
    entry = module.write_seen_part(out, rank, data, start, stop)
    seconds = time.perf_counter() - started
    print(json.dumps({"seconds": seconds, "peak_mb": _status_mb("VmHWM"), "start_mb": before, "entry": entry}))


def run_seen(module_file: str | None, data: str, out: Path, world_size: int) -> tuple[float, list[dict]]:
    """Wall seconds and the ranks' results (``seen_worker``) of writing the seen table in ``world_size``
    processes at once."""
    import json
    import subprocess
    import sys

    code = "from benchmarks.bench_export import seen_worker; seen_worker()"
    started = time.perf_counter()
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, module_file or "", str(rank), str(world_size), data, str(out)],
            stdout=subprocess.PIPE,
            text=True,
        )
        for rank in range(world_size)
    ]
    outputs = [proc.communicate()[0] for proc in procs]
    wall = time.perf_counter() - started
    if any(proc.returncode for proc in procs):
        raise RuntimeError(f"a seen-items worker failed: return codes {[proc.returncode for proc in procs]}")
    return wall, [json.loads(text.strip().splitlines()[-1]) for text in outputs]


def bench_seen(args, tmp: Path) -> None:
    from bigrank.data import manifest as layout

    manifest = layout.load_manifest(args.seen)
    print(
        f"\n## Seen-items table: {args.seen} ({manifest['num_ratings']:,} ratings, {manifest['num_users']:,} users), "
        f"{args.seen_ranks} processes at once\n"
    )
    print("| build | load before | wall s | rank seconds | rank peak RSS MB (start) | nnz | MB written | same bytes |")
    print("|---|---:|---:|---|---|---:|---:|---|")
    runs = ([("compared: " + Path(args.seen_compare).name, args.seen_compare)] if args.seen_compare else []) + [
        ("this tree", None)
    ]
    first_checksums = None
    for name, module_file in runs:
        load = os.getloadavg()[0]
        out = tmp / f"seen-{len(runs)}-{module_file is None}"
        wall, results = run_seen(module_file, args.seen, out, args.seen_ranks)
        checksums = [r["entry"]["sha256"] for r in results]
        first_checksums = first_checksums or checksums
        seconds = " / ".join(f"{r['seconds']:.1f}" for r in results)
        peaks = " / ".join(f"{r['peak_mb']:,.0f} ({r['start_mb']:,.0f})" for r in results)
        nnz = sum(r["entry"]["nnz"] for r in results)
        megabytes = sum(r["entry"]["bytes"] for r in results) / 1e6
        same = "yes" if checksums == first_checksums else "NO"
        print(f"| {name} | {load:.2f} | {wall:.1f} | {seconds} | {peaks} | {nnz:,} | {megabytes:,.0f} | {same} |")
        shutil.rmtree(out, ignore_errors=True)
    print(f"\nload average after: {os.getloadavg()[0]:.2f} ({os.cpu_count()} CPUs)")


def clustered_rows(seed: int, rows: int, dim: int, clusters: int = 1000) -> np.ndarray:
    """A stand-in for trained embeddings: a mixture of ``clusters`` Gaussians with log-normal norms.

    Row = (center[c] + 0.5 · noise) · LogNormal(0, 0.3); centers are fixed by a seed shared by items and queries.
    """
    centers = np.random.default_rng(12345).standard_normal((clusters, dim), dtype=np.float32)
    rng = np.random.default_rng(seed)
    rows_ = centers[rng.integers(0, clusters, rows)] + 0.5 * rng.standard_normal((rows, dim), dtype=np.float32)
    return (rows_ * rng.lognormal(0.0, 0.3, (rows, 1))).astype(np.float32)


def time_search(index, queries: np.ndarray, k: int, single: int) -> tuple[float, float, np.ndarray]:
    """(batched queries/s, one-at-a-time queries/s, ids of the batched search)."""
    started = time.perf_counter()
    _, ids = index.search(queries, k)
    batched = len(queries) / (time.perf_counter() - started)
    started = time.perf_counter()
    for row in range(single):
        index.search(queries[row : row + 1], k)
    one = single / (time.perf_counter() - started)
    return batched, one, ids


def bench_indexes(args) -> None:
    from bigrank.export.index import build_index, recall_at_k, set_search_params

    if args.catalog == "random":
        items = random_rows(1, args.items, args.dim).numpy()
        queries = np.random.default_rng(3).standard_normal((args.queries, args.dim), dtype=np.float32)
    else:
        items = clustered_rows(1, args.items, args.dim)
        queries = clustered_rows(3, args.queries, args.dim)
    ivf_params = {"nlist": args.nlist, "train_rows": 64 * args.nlist}
    hnsw_params = {"M": args.hnsw_m, "efConstruction": args.ef_construction}
    builds = {}
    for kind, params in (("exact", {}), ("ivf", ivf_params), ("hnsw", hnsw_params)):
        started = time.perf_counter()
        builds[kind] = build_index(items, kind, params)
        builds[f"{kind}_seconds"] = time.perf_counter() - started

    exact_batched, exact_one, exact_ids = time_search(builds["exact"], queries, 10, args.single)
    print(f"\n## Indexes: {args.items:,} x {args.dim} {args.catalog} catalog, {args.queries:,} queries, k=10\n")
    print(
        "| index | build s | batched q/s | x exact | single-query q/s | x exact | recall@10 vs exact |\n"
        "|---|---:|---:|---:|---:|---:|---:|"
    )
    print(
        f"| exact IndexFlatIP | {builds['exact_seconds']:.1f} | {exact_batched:,.0f} | 1.00 | "
        f"{exact_one:,.1f} | 1.00 | 1.000 |"
    )
    sweeps = [("ivf", "nprobe", args.nprobe), ("hnsw", "efSearch", args.ef_search)]
    for kind, knob, values in sweeps:
        for value in values:
            set_search_params(builds[kind], {knob: value})
            batched, one, ids = time_search(builds[kind], queries, 10, args.single)
            label = (
                f"IVF-Flat nlist={args.nlist} nprobe={value}"
                if kind == "ivf"
                else f"HNSW-Flat M={args.hnsw_m} efC={args.ef_construction} efSearch={value}"
            )
            print(
                f"| {label} | {builds[f'{kind}_seconds']:.1f} | {batched:,.0f} | {batched / exact_batched:.1f} | "
                f"{one:,.1f} | {one / exact_one:.1f} | {recall_at_k(ids, exact_ids):.3f} |"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--items", type=int, default=849_000)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--users", type=int, default=200_000)
    parser.add_argument("--queries", type=int, default=1000, help="batched queries (recall is measured on them)")
    parser.add_argument("--single", type=int, default=100, help="queries timed one at a time")
    parser.add_argument("--nlist", type=int, default=1024)
    parser.add_argument("--nprobe", type=int, nargs="+", default=[16, 64, 128])
    parser.add_argument("--hnsw-m", type=int, default=16)
    parser.add_argument("--ef-construction", type=int, default=40)
    parser.add_argument("--ef-search", type=int, nargs="+", default=[64, 256])
    parser.add_argument(
        "--catalog",
        choices=["random", "clustered"],
        default="random",
        help="index part: i.i.d. Gaussian rows (worst case for approximate search) or a Gaussian mixture",
    )
    parser.add_argument("--skip-export", action="store_true")
    parser.add_argument("--skip-index", action="store_true", help="skip the FAISS index part")
    parser.add_argument("--seen", metavar="DATA_ROOT", help="also time the seen-items table of this dataset")
    parser.add_argument("--seen-ranks", type=int, default=2, help="processes writing the seen table (default 2)")
    parser.add_argument("--seen-compare", metavar="FILE", help="seen.py of another revision, run first")
    parser.add_argument("--tmp", default=None, help="directory for the exports (default: a temporary one)")
    args = parser.parse_args()

    import faiss

    print(f"faiss {faiss.__version__}, {faiss.omp_get_max_threads()} OpenMP threads, {os.cpu_count()} CPUs")
    tmp = Path(tempfile.mkdtemp(prefix="bench_export-", dir=args.tmp))
    try:
        if not args.skip_export:
            bench_export(args, tmp)
        if args.seen:
            bench_seen(args, tmp)
        if not args.skip_index:
            bench_indexes(args)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
