"""Load test of ``bigrank serve``: the stdlib server against Ray Serve (1 and 2 replicas), exact and IVF.

Writes an export of a ``--items x --dim`` catalog (default 849,000 x 64, the ML-1B catalog size; rows from
``--catalog clustered``, a Gaussian mixture like trained embeddings, or i.i.d. ``random``) with exact and
IVF indexes (or takes one with ``--export DIR``), then for each server and index runs ``--clients``
concurrent keep-alive clients for ``--seconds`` seconds of ``GET /recommend?user=U&k=10`` over random users,
and prints queries/s, p50 / p99 latency, errors, the recall@10 of the served answers against the exact
top-10 (numpy brute force on ``--recall-users`` users), and the CPU milliseconds per answered query of
the load generator and of each server process (stdlib server; Ray replicas, Serve's Python proxy,
HAProxy, the rest of Ray) read from ``/proc``. Ratios are to the stdlib server on the same index with
the same kind of request. ``--overload-clients`` adds a run against one replica with a small queue
(``max_ongoing 8 + max_queued 8``) to show 503s instead of an unbounded queue; ``--post-batch B`` adds runs
of ``POST /recommend`` with ``B`` users per request (queries/s then counts users).

The load generator is raw asyncio streams (on uvloop when installed) writing pre-formatted requests and
reading only the status line and the body length: ~0.1-0.4 ms of CPU per request, the same code for
every server (it shares the cores with them). Ray Serve's ingress is ``--ray-ingress haproxy`` (HAProxy
+ direct ingress, ``bigrank serve --ray``'s default) or ``proxy`` (Serve's Python proxy actor).

Bounded: every server binds 127.0.0.1 only, each run lasts ``--seconds``, and the Ray runtime, the stdlib
server process and the export (under a temporary directory) are removed at the end. The client shares the
machine's cores with the servers, so absolute figures are a floor; compare the columns of one run.

    .venv/bin/python -m benchmarks.bench_serve [--items 849000] [--users 100000] [--dim 64] [--clients 32]
        [--seconds 10] [--servers stdlib,ray1,ray2] [--indexes exact,ivf] [--overload-clients 64]
        [--ray-ingress haproxy|proxy] [--export DIR] [--post-batch 64]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from urllib.parse import urlsplit

import numpy as np
import torch

from benchmarks.bench_export import clustered_rows
from bigrank.train.launcher import free_port


def make_export(out: Path, args, seed: int = 0) -> dict:
    """Export random or clustered tables (drawn from ``seed``) with the indexes ``args.indexes``; returns the
    manifest."""
    from bigrank.export.writer import export_embeddings

    if args.catalog == "clustered":
        items, users = (
            clustered_rows(2 * seed, args.items, args.dim),
            clustered_rows(2 * seed + 1, args.users, args.dim),
        )
    else:
        rng = np.random.default_rng(seed)
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


async def _read_response(reader: asyncio.StreamReader) -> tuple[int, bool]:
    """Read one HTTP/1.x response off ``reader``: ``(status, the server closes the connection)``."""
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    status = int(lines[0].split(b" ", 2)[1])
    length, chunked, close = None, False, lines[0].startswith(b"HTTP/1.0")  # 1.0: one request per connection
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        name, value = name.strip().lower(), value.strip().lower()
        if name == b"content-length":
            length = int(value)
        elif name == b"transfer-encoding":
            chunked = b"chunked" in value
        elif name == b"connection":
            close = value == b"close" or (close and value != b"keep-alive")
    if chunked:
        while True:
            size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
            await reader.readexactly(size + 2)
            if size == 0:
                return status, close
    if length is None:
        await reader.read()
        return status, True
    await reader.readexactly(length)
    return status, close


async def load(
    url: str, users: int, clients: int, seconds: float, post: int = 0, record: list | None = None, until=None
) -> dict:
    """``clients`` concurrent keep-alive clients for ``seconds``: counts, latencies and status codes.

    Each client is a raw asyncio connection that writes a request and reads the response's status and
    body length only, so the generator, which shares the cores with the server, costs ~0.1-0.2 ms of
    CPU per request (aiohttp cost ~0.5 ms) and is the same for every server. ``post > 0``: each request
    is a ``POST /recommend`` of ``post`` users; queries/s then counts users. ``record``: a list that gets
    ``(start time.perf_counter(), seconds, status)`` of every request (``bench_swap`` cuts it into phases);
    ``until``: a ``threading.Event`` that ends the run early when set.
    """
    host, port = urlsplit(url).hostname, urlsplit(url).port
    latencies: list[float] = []
    statuses: dict[int | str, int] = {}
    deadline = time.perf_counter() + seconds

    async def client(seed: int) -> None:
        rng = random.Random(seed)
        reader = writer = None
        while time.perf_counter() < deadline and not (until is not None and until.is_set()):
            if post:
                body = b'{"users": [%s], "k": 10}' % b",".join(b"%d" % rng.randrange(users) for _ in range(post))
                request = (
                    b"POST /recommend HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
                    b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
                )
            else:
                request = b"GET /recommend?user=%d&k=10 HTTP/1.1\r\nHost: bench\r\n\r\n" % rng.randrange(users)
            started = time.perf_counter()
            try:
                if writer is None:
                    reader, writer = await asyncio.open_connection(host, port)
                writer.write(request)
                status, close = await asyncio.wait_for(_read_response(reader), 60)
            except (OSError, TimeoutError, asyncio.IncompleteReadError, ValueError) as error:
                status, close = type(error).__name__, True
            statuses[status] = statuses.get(status, 0) + 1
            if record is not None:
                record.append((started, time.perf_counter() - started, status))
            if status == 200:
                latencies.append(time.perf_counter() - started)
            if close and writer is not None:
                writer.close()
                reader = writer = None
        if writer is not None:
            writer.close()

    started = time.perf_counter()
    await asyncio.gather(*(client(seed) for seed in range(clients)))
    elapsed = time.perf_counter() - started
    lat = np.asarray(latencies) * 1000 if latencies else np.full(1, np.nan)
    return {
        "qps": len(latencies) * max(1, post) / elapsed,
        "p50": float(np.percentile(lat, 50)),
        "p99": float(np.percentile(lat, 99)),
        "ok": len(latencies),
        "errors": {k: v for k, v in statuses.items() if k != 200},
    }


def cpu_seconds(groups: dict) -> dict[str, float]:
    """CPU seconds (user + system) used so far by the processes of each group, from ``/proc``.

    ``groups``: label -> predicate ``(pid, command line) -> bool``; a process counts in its first group.
    """
    tick = os.sysconf("SC_CLK_TCK")
    used: dict[str, float] = dict.fromkeys(groups, 0.0)
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # the process ended meanwhile
        for label, belongs in groups.items():
            if belongs(int(pid), command):
                used[label] += (int(fields[11]) + int(fields[12])) / tick
                break
    return used


def measured_load(url: str, users: int, clients: int, seconds: float, groups: dict, post: int = 0) -> dict:
    """``load`` plus the CPU milliseconds per answered query of the client and of each server process group."""
    before, client_before = cpu_seconds(groups), time.process_time()
    result = load_run(url, users, clients, seconds, post)
    after, client_after = cpu_seconds(groups), time.process_time()
    queries = max(1, result["ok"] * max(1, post))
    cpu = {"client": client_after - client_before, **{k: after[k] - before[k] for k in groups}}
    result["cpu_ms"] = {k: 1000 * v / queries for k, v in cpu.items() if v > 0}
    return result


def ray_process_groups() -> dict:
    """CPU accounting groups of a local Ray Serve: replicas, the Python proxy, HAProxy, the rest of Ray."""
    me = os.getpid()
    return {
        "replica": lambda pid, cmd: "ServeReplica" in cmd,
        "proxy": lambda pid, cmd: "ProxyActor" in cmd,
        "haproxy": lambda pid, cmd: "haproxy" in cmd.split(" ")[0],
        "ray": lambda pid, cmd: pid != me and ("ray::" in cmd or "/ray/" in cmd or "raylet" in cmd),
    }


def served_recall(url: str, items: np.ndarray, user_vectors: np.ndarray, users: list[int]) -> float:
    """Recall@10 of the server's answers for ``users`` against the numpy exact top-10."""
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
    # --dense-ids: the load draws random dense users, whatever ids the export's dataset had
    process = subprocess.Popen([*command, "--quiet", "--no-verify", "--dense-ids"], stderr=subprocess.DEVNULL)
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
    parser.add_argument("--batch-wait-ms", type=float, default=2.0, help="Serve's batch wait (default 2 ms)")
    parser.add_argument("--search-threads", type=int, default=0, help="FAISS threads per replica (0: cores / replicas)")
    parser.add_argument(
        "--ray-ingress",
        choices=("haproxy", "proxy"),
        default="haproxy",
        help="Ray Serve's HTTP ingress: HAProxy + direct ingress (default) or Serve's Python proxy",
    )
    parser.add_argument("--keep", metavar="DIR", help="write the export here and keep it (default: a temp dir)")
    parser.add_argument("--export", metavar="DIR", help="use this export (with exact and IVF indexes) as it is")
    args = parser.parse_args()
    if any(s.startswith("ray") for s in args.servers.split(",")):
        from bigrank.export.ray_serve import set_ingress_environment

        set_ingress_environment(args.ray_ingress)  # before Ray starts: its processes read it at start
    args.indexes = [i for i in args.indexes.split(",") if i]
    servers = [s for s in args.servers.split(",") if s]
    cores = os.cpu_count() or 1

    if args.export:
        export = Path(args.export)
        tmp = None
        manifest = json.loads((export / "manifest.json").read_text())
    else:
        tmp = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="bench-serve-"))
        export = tmp / "export"
        started = time.perf_counter()
        manifest = make_export(export, args)
        print(f"export {args.items:,} x {args.dim} items, {args.users:,} users: {time.perf_counter() - started:.1f}s")
    for name, entry in manifest["indexes"].items():
        print(f"  {name}: params {entry['params']}, recall@10 vs exact {entry.get('recall_at_10_vs_exact', 1.0)}")
    print(f"ray ingress: {args.ray_ingress}; load average at start: {os.getloadavg()[0]:.1f}", flush=True)

    from bigrank.export.format import read_table

    items = read_table(export, manifest, "items")["embedding"]
    user_vectors = read_table(export, manifest, "users")["embedding"]
    users = int(manifest["num_users"])
    recall_users = sorted(random.Random(7).sample(range(users), min(args.recall_users, users)))
    rows: list[tuple] = []
    processes: list[subprocess.Popen] = []

    def run(index: str, label: str, url: str, groups: dict, clients: int, post: int, recall: float) -> None:
        load_run(url, users, clients, 1.0, post)  # warm-up: connections, first batches, lazy imports
        result = measured_load(url, users, clients, args.seconds, groups, post)
        rows.append((index, label, post, result))
        base = None if label.startswith("overload") else _base(rows, index, post)
        print_row(index, label, result, recall, base=base)

    try:
        for index in args.indexes:
            for server in servers:
                if server == "stdlib":
                    process, url = start_stdlib(export, index)
                    processes.append(process)
                    groups = {"server": lambda pid, cmd, server_pid=process.pid: pid == server_pid}
                    label = "stdlib (threaded, one search at a time)"
                else:
                    replicas = int(server.removeprefix("ray"))
                    url = deploy_ray(export, index, replicas, cores, args)
                    groups = ray_process_groups()
                    label = f"Ray Serve, {replicas} replica(s), batch <= {args.max_batch_size}"
                recall = served_recall(url, items, user_vectors, recall_users)
                run(index, label, url, groups, args.clients, 0, recall)
                if args.post_batch:
                    run(index, f"{label} [POST x{args.post_batch}]", url, groups, args.clients, args.post_batch, recall)
                if server == "stdlib":
                    processes.pop().terminate()
        if args.overload_clients and any(s.startswith("ray") for s in servers):
            url = deploy_ray(export, args.indexes[0], 1, cores, args, ongoing=8, queued=8)
            label = f"overload: Ray 1 replica, 8 ongoing + 8 queued, {args.overload_clients} clients"
            run(args.indexes[0], label, url, ray_process_groups(), args.overload_clients, 0, float("nan"))
    finally:
        for process in processes:
            process.terminate()
        stop_ray()
        if tmp is not None and not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)
    print(f"load average at the end: {os.getloadavg()[0]:.1f}")


def load_run(
    url: str, users: int, clients: int, seconds: float, post: int = 0, record: list | None = None, until=None
) -> dict:
    """``load`` on uvloop when it is installed (a cheaper event loop for the generator), else asyncio."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(load(url, users, clients, seconds, post, record, until))
    return uvloop.run(load(url, users, clients, seconds, post, record, until))


def _base(rows, index: str, post: int):
    """Queries/s of the stdlib server on ``index`` with the same request kind (GET, or POST of ``post``)."""
    for row_index, label, row_post, result in rows:
        if row_index == index and row_post == post and label.startswith("stdlib"):
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
    cpu = result.get("cpu_ms", {})
    print(f"{'':6}   CPU ms per query: " + ", ".join(f"{k} {v:.3f}" for k, v in cpu.items()), flush=True)


def deploy_ray(export: Path, index: str, replicas: int, cores: int, args, ongoing=128, queued=256) -> str:
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
        max_batch_size=args.max_batch_size,
        batch_wait_ms=args.batch_wait_ms,
        max_ongoing_requests=ongoing,
        max_queued_requests=queued,
        replica_cpus=1.0,
        search_threads=args.search_threads or max(1, cores // replicas),
        verify=False,
        dense_ids=True,
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
