"""A new export swapped in under load: ``bigrank serve`` (stdlib) and ``bigrank serve --ray``, each a real process.

Writes two exports of a ``--items x --dim`` catalog (different rows: the answers change with the swap), starts
the server on ``DIR/current``, a symlink to the first, and runs ``bench_serve``'s load generator (``--clients``
keep-alive clients of ``GET /recommend?user=U&k=10``) for ``--before`` seconds; then points the symlink at the
second export and sends SIGHUP, as a daily job would, and keeps the load on until ``--after`` seconds past the
server's ``now serving`` line. Prints, per server and phase (before the SIGHUP; during: from the SIGHUP to the
``now serving`` line, the new export loaded and verified beside the old one, and for Ray the rolling update;
after), the requests, failed requests (any status but 200, or a cut connection), p50 / p99 latency, and the
machine's load average (``os.getloadavg``) at the end of the phase. Target: 0 failed requests for both.

    .venv/bin/python -m benchmarks.bench_swap [--items 200000] [--users 20000] [--dim 64] [--clients 8]
        [--before 10] [--after 10] [--servers stdlib,ray] [--replicas 1]

Bounded: the servers bind 127.0.0.1, are stopped by SIGTERM at the end (killed if they hang), and the exports
live in a temporary directory that is removed.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from benchmarks.bench_serve import load_run, make_export, wait_healthy
from bigrank.train.launcher import free_port

PHASES = ("before", "during", "after")


def start_server(current: Path, server: str, args, log: Path) -> tuple[subprocess.Popen, str]:
    """``bigrank serve current`` (``server``: ``stdlib`` or ``ray``) on a free loopback port; ``(process, URL)``
    once it answers."""
    port = free_port()
    command = [sys.executable, "-m", "bigrank.cli", "serve", str(current), "--port", str(port), "--dense-ids"]
    command += ["--quiet"] if server == "stdlib" else ["--ray", "--replicas", str(args.replicas)]
    with open(log, "w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, seconds=600)
    return process, url


def wait_for(log: Path, text: str, process: subprocess.Popen, timeout: float = 600) -> float:
    """Wait until ``text`` is in ``log``; returns the ``time.perf_counter()`` when it was seen."""
    deadline = time.monotonic() + timeout
    while text not in log.read_text():
        if process.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"no {text!r} in the server's output:\n{log.read_text()}")
        time.sleep(0.02)
    return time.perf_counter()


def stop(process: subprocess.Popen) -> None:
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def swap_under_load(server: str, root: Path, exports: list[Path], users: int, args) -> dict:
    """Serve ``exports[0]``, load it, swap to ``exports[1]`` by SIGHUP; per phase: requests and load average."""
    current = root / "current"
    current.unlink(missing_ok=True)
    current.symlink_to(exports[0])
    log = root / f"{server}.log"
    process, url = start_server(current, server, args, log)
    try:
        load_run(url, users, args.clients, 1.0)  # warm-up: connections, lazy imports
        record: list = []
        marks: dict = {"load": {}}
        finished = threading.Event()  # ends the generator; ``seconds`` below is only a bound
        generator = threading.Thread(
            target=load_run, args=(url, users, args.clients, 3600.0), kwargs={"record": record, "until": finished}
        )
        started = time.perf_counter()
        generator.start()
        time.sleep(args.before)
        marks["load"]["before"] = os.getloadavg()[0]
        current.unlink()
        current.symlink_to(exports[1])
        marks["sighup"] = time.perf_counter()
        process.send_signal(signal.SIGHUP)
        marks["swapped"] = wait_for(log, "now serving", process)
        marks["load"]["during"] = os.getloadavg()[0]
        time.sleep(args.after)
        marks["end"] = time.perf_counter()
        marks["load"]["after"] = os.getloadavg()[0]
        finished.set()
        generator.join(timeout=120)
    finally:
        finished.set()
        stop(process)
    if "refused" in log.read_text():
        raise RuntimeError(f"the server refused the new export:\n{log.read_text()}")
    bounds = {
        "before": (started, marks["sighup"]),
        "during": (marks["sighup"], marks["swapped"]),
        "after": (marks["swapped"], marks["end"]),
    }
    phases = {}
    for phase, (low, high) in bounds.items():
        rows = [(latency, status) for begun, latency, status in record if low <= begun < high]
        ok = np.asarray([latency for latency, status in rows if status == 200]) * 1000
        phases[phase] = {
            "seconds": high - low,
            "requests": len(rows),
            "failed": sum(status != 200 for _, status in rows),
            "p50": float(np.percentile(ok, 50)) if len(ok) else float("nan"),
            "p99": float(np.percentile(ok, 99)) if len(ok) else float("nan"),
            "load": marks["load"][phase],
        }
    return phases


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--items", type=int, default=200_000)
    parser.add_argument("--users", type=int, default=20_000)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--catalog", choices=("clustered", "random"), default="clustered")
    parser.add_argument("--clients", type=int, default=8, help="concurrent keep-alive clients (default 8)")
    parser.add_argument("--before", type=float, default=10.0, help="seconds of load before the SIGHUP")
    parser.add_argument("--after", type=float, default=10.0, help="seconds of load after the swap")
    parser.add_argument("--servers", default="stdlib,ray", help="stdlib, ray (comma-separated)")
    parser.add_argument("--replicas", type=int, default=1, help="replicas of serve --ray (default 1)")
    args = parser.parse_args()
    args.indexes = []  # the exact index, built when a server loads the export
    root = Path(tempfile.mkdtemp(prefix="bench-swap-"))
    try:
        started = time.perf_counter()
        exports = []
        for seed in (0, 1):
            make_export(root / f"export-{seed}", args, seed=seed)
            exports.append(root / f"export-{seed}")
        print(
            f"2 exports of {args.items:,} x {args.dim} items, {args.users:,} users: "
            f"{time.perf_counter() - started:.1f}s; {os.cpu_count()} cores; {args.clients} clients; "
            f"load average at start {os.getloadavg()[0]:.2f}",
            flush=True,
        )
        print(f"{'server':8} {'phase':7} {'seconds':>7} {'requests':>8} {'failed':>6} {'p50 ms':>8} {'p99 ms':>8} load")
        for server in [s for s in args.servers.split(",") if s]:
            phases = swap_under_load(server, root, exports, args.users, args)
            for phase in PHASES:
                row = phases[phase]
                print(
                    f"{server:8} {phase:7} {row['seconds']:7.1f} {row['requests']:8d} {row['failed']:6d} "
                    f"{row['p50']:8.1f} {row['p99']:8.1f} {row['load']:.2f}",
                    flush=True,
                )
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
