"""Load test of ``bigrank serve``: the stdlib server against Ray Serve (1 and 2 replicas), exact and IVF.

Writes an export of a ``--items x --dim`` catalog (default 849,000 x 64, the ML-1B catalog size; rows from
``--catalog clustered``, a Gaussian mixture like trained embeddings, or i.i.d. ``random``) with exact and
IVF indexes, then for each server and index runs ``--clients`` concurrent clients (one asyncio process,
aiohttp, keep-alive) for ``--seconds`` seconds of ``GET /recommend?user=U&k=10`` over random users, and
prints queries/s, p50 / p99 latency, errors, and the recall@10 of the served answers against the exact
top-10 (numpy brute force on ``--recall-users`` users). Ratios are to the stdlib server on the same index.
``--overload-clients`` adds a run against one replica with a small queue (``max_ongoing 8 + max_queued 8``)
to show 503s instead of an unbounded queue; ``--post-batch B`` adds runs of ``POST /recommend`` with ``B``
users per request (queries/s then counts users).

Bounded: every server binds 127.0.0.1 only, each run lasts ``--seconds``, and the Ray runtime, the stdlib
server process and the export (under a temporary directory) are removed at the end. The client shares the
machine's cores with the servers, so absolute figures are a floor; compare the columns of one run.

    .venv/bin/python -m benchmarks.bench_serve [--items 849000] [--users 100000] [--dim 64] [--clients 32]
        [--seconds 10] [--servers stdlib,ray1,ray2] [--indexes exact,ivf] [--overload-clients 64]
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import numpy as np
import torch

from benchmarks.bench_export import clustered_rows


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def make_export(out: Path, args) -> dict:
    """Export random or clustered tables with the exact and IVF indexes; returns the manifest."""
    from bigrank.export.writer import export_embeddings

    if args.catalog == "clustered":
        items, users = clustered_rows(0, args.items, args.dim), clustered_rows(1, args.users, args.dim)
    else:
        rng = np.random.default_rng(0)
        items = rng.standard_normal((args.items, args.dim), dtype=np.float32)
        users = rng.standard_normal((args.users, args.dim), dtype=np.float32)
    return export_embeddings(
        out,
        rank=0,
        world_size=1,
        group=None,
        item_rows=(0, args.items, torch.from_numpy(items)),
        user_rows=(0, args.users, torch.from_numpy(users)),
        model_info={"dim": args.dim, "loss": "bench"},
        index=tuple(args.indexes),
    )


async def load(url: str, users: int, clients: int, seconds: float, post: int = 0) -> dict:
    """``clients`` concurrent keep-alive clients for ``seconds``: counts, latencies and status codes.

    ``post > 0``: each request is a ``POST /recommend`` of ``post`` users; queries/s counts users.
    """
    import aiohttp

    latencies: list[float] = []
    statuses: dict[int | str, int] = {}
    deadline = time.perf_counter() + seconds
    timeout = aiohttp.ClientTimeout(total=60)

    async def client(seed: int, session) -> None:
        rng = random.Random(seed)
        while time.perf_counter() < deadline:
            started = time.perf_counter()
            try:
                if post:
                    body = {"users": [rng.randrange(users) for _ in range(post)], "k": 10}
                    request = session.post(f"{url}/recommend", json=body)
                else:
                    request = session.get(f"{url}/recommend?user={rng.randrange(users)}&k=10")
                async with request as response:
                    await response.read()
                    status = response.status
            except (TimeoutError, aiohttp.ClientError) as error:
                status = type(error).__name__
            statuses[status] = statuses.get(status, 0) + 1
            if status == 200:
                latencies.append(time.perf_counter() - started)

    connector = aiohttp.TCPConnector(limit=clients)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        started = time.perf_counter()
        await asyncio.gather(*(client(seed, session) for seed in range(clients)))
        elapsed = time.perf_counter() - started
    lat = np.asarray(latencies) * 1000 if latencies else np.full(1, np.nan)
    return {
        "qps": len(latencies) * max(1, post) / elapsed,
        "p50": float(np.percentile(lat, 50)),
        "p99": float(np.percentile(lat, 99)),
        "ok": len(latencies),
        "errors": {k: v for k, v in statuses.items() if k != 200},
    }


def served_recall(url: str, items: np.ndarray, user_vectors: np.ndarray, users: list[int]) -> float:
    """Recall@10 of the server's answers for ``users`` against the numpy exact top-10."""
    import json

    from bigrank.export.index import brute_force_top_k, recall_at_k

    got = []
    for user in users:
        with urllib.request.urlopen(f"{url}/recommend?user={user}&k=10", timeout=60) as response:
            got.append([row["item_id"] for row in json.loads(response.read())["items"]])
    _, exact = brute_force_top_k(items, user_vectors[users], 10)
    return recall_at_k(np.asarray(got), exact)


def wait_healthy(url: str, seconds: float = 300) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5) as response:
                if response.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise RuntimeError(f"{url} did not become healthy in {seconds} s")


def start_stdlib(export: Path, index: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    command = [sys.executable, "-m", "bigrank.cli", "serve", str(export), "--index", index, "--port", str(port)]
    process = subprocess.Popen([*command, "--quiet", "--no-verify"], stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url)
    return process, url


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--items", type=int, default=849_000)
    parser.add_argument("--users", type=int, default=100_000)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--catalog", choices=("clustered", "random"), default="clustered")
    parser.add_argument("--clients", type=int, default=32, help="concurrent clients (default 32)")
    parser.add_argument("--seconds", type=float, default=10.0, help="length of each run (default 10)")
    parser.add_argument("--servers", default="stdlib,ray1,ray2", help="stdlib, ray1, ray2 (comma-separated)")
    parser.add_argument("--indexes", default="exact,ivf", help="exact, ivf (comma-separated)")
    parser.add_argument("--max-batch-size", type=int, default=64)
    parser.add_argument("--recall-users", type=int, default=200)
    parser.add_argument("--post-batch", type=int, default=0, help="also POST this many users per request")
    parser.add_argument("--overload-clients", type=int, default=64, help="0 skips the overload run")
    parser.add_argument("--keep", metavar="DIR", help="write the export here and keep it (default: a temp dir)")
    args = parser.parse_args()
    args.indexes = [i for i in args.indexes.split(",") if i]
    servers = [s for s in args.servers.split(",") if s]
    cores = os.cpu_count() or 1

    tmp = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="bench-serve-"))
    export = tmp / "export"
    started = time.perf_counter()
    manifest = make_export(export, args)
    print(f"export {args.items:,} x {args.dim} items, {args.users:,} users: {time.perf_counter() - started:.1f}s")
    for name, entry in manifest["indexes"].items():
        print(f"  {name}: params {entry['params']}, recall@10 vs exact {entry.get('recall_at_10_vs_exact', 1.0)}")

    from bigrank.export.format import read_table

    items = read_table(export, manifest, "items")["embedding"]
    user_vectors = read_table(export, manifest, "users")["embedding"]
    recall_users = sorted(random.Random(7).sample(range(args.users), min(args.recall_users, args.users)))
    rows: list[tuple] = []
    processes: list[subprocess.Popen] = []
    try:
        for index in args.indexes:
            for server in servers:
                if server == "stdlib":
                    process, url = start_stdlib(export, index)
                    processes.append(process)
                    label = "stdlib (threaded, one search at a time)"
                else:
                    replicas = int(server.removeprefix("ray"))
                    url = deploy_ray(export, index, replicas, cores, args.max_batch_size)
                    label = f"Ray Serve, {replicas} replica(s), batch <= {args.max_batch_size}"
                result = asyncio.run(load(url, args.users, args.clients, args.seconds))
                recall = served_recall(url, items, user_vectors, recall_users)
                rows.append((index, label, result, recall))
                print_row(*rows[-1], base=_base(rows, index))
                if args.post_batch:
                    result = asyncio.run(load(url, args.users, args.clients, args.seconds, post=args.post_batch))
                    print_row(index, f"{label} [POST x{args.post_batch}]", result, recall, base=_base(rows, index))
                if server == "stdlib":
                    processes.pop().terminate()
        if args.overload_clients and any(s.startswith("ray") for s in servers):
            url = deploy_ray(export, args.indexes[0], 1, cores, args.max_batch_size, ongoing=8, queued=8)
            result = asyncio.run(load(url, args.users, args.overload_clients, args.seconds))
            label = f"overload: Ray 1 replica, 8 ongoing + 8 queued, {args.overload_clients} clients"
            print_row(args.indexes[0], label, result, float("nan"), base=None)
    finally:
        for process in processes:
            process.terminate()
        stop_ray()
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)


def _base(rows, index):
    for row_index, label, result, _ in rows:
        if row_index == index and label.startswith("stdlib"):
            return result["qps"]
    return None


def print_row(index: str, label: str, result: dict, recall: float, base: float | None) -> None:
    ratio = f"{result['qps'] / base:5.1f}x" if base else "     "
    errors = ", ".join(f"{k}: {v}" for k, v in sorted(result["errors"].items(), key=str)) or "0"
    print(
        f"{index:6} {label:60} {result['qps']:8.1f} q/s {ratio}  p50 {result['p50']:7.1f} ms  "
        f"p99 {result['p99']:7.1f} ms  ok {result['ok']:6d}  errors {errors}  recall@10 {recall:.3f}",
        flush=True,
    )


def deploy_ray(export: Path, index: str, replicas: int, cores: int, batch: int, ongoing=128, queued=256) -> str:
    """(Re)deploy the application with ``replicas`` on a loopback-only local Ray; returns its URL."""
    import ray

    from bigrank.export.ray_serve import ServeSettings, deploy

    if not ray.is_initialized():
        ray.init(
            address="local",
            num_cpus=max(4, cores),
            include_dashboard=False,
            _node_ip_address="127.0.0.1",
            log_to_driver=False,
        )
        deploy_ray.port = free_port()
    settings = ServeSettings(
        str(export),
        index=index,
        replicas=replicas,
        max_batch_size=batch,
        max_ongoing_requests=ongoing,
        max_queued_requests=queued,
        replica_cpus=1.0,
        search_threads=max(1, cores // replicas),
        verify=False,
    )
    logging.getLogger("ray.serve").setLevel(logging.WARNING)  # Serve resets it; else INFO lines per deploy
    url = deploy(settings, port=deploy_ray.port)
    wait_healthy(url)
    return url


def stop_ray() -> None:
    import ray

    if ray.is_initialized():
        from ray import serve

        serve.shutdown()
        ray.shutdown()


if __name__ == "__main__":
    main()
