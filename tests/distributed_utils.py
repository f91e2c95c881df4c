"""Run a function in N real gloo processes and collect what each rank returns.

Usage::

    def body(rank, world_size, group, x):      # must be a module-level function (it is pickled)
        ...
        return {"loss": loss.item()}

    results = run_distributed(body, world_size=2, args=(x,))   # list indexed by rank

Failures in any rank re-raise in the test with the rank's traceback; a hang fails after ``timeout`` seconds
instead of blocking the suite.
"""

from __future__ import annotations

import os
import pickle
import socket
import traceback

import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _worker(rank, world_size, port, fn, args, queue):
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        GLOO_SOCKET_IFNAME=os.environ.get("GLOO_SOCKET_IFNAME", "lo"),
    )
    try:
        import torch

        torch.set_num_threads(1)
        dist.init_process_group("gloo", rank=rank, world_size=world_size, init_method=f"tcp://127.0.0.1:{port}")
        try:
            result = fn(rank, world_size, dist.group.WORLD, *args)
        finally:
            dist.destroy_process_group()
        # Plain pickle copies tensor data: torch's queue would pass shared-memory handles, which die with
        # this process before the parent reads them.
        queue.put((rank, "ok", pickle.dumps(result)))
    except BaseException:  # noqa: BLE001 - report anything, including SystemExit, to the parent
        queue.put((rank, "error", traceback.format_exc()))


def run_distributed(fn, world_size: int, args: tuple = (), timeout: float = 120.0) -> list:
    """Spawn ``world_size`` gloo processes running ``fn(rank, world_size, group, *args)``; return their results."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, fn, args, queue)) for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, object] = {}
    errors: list[str] = []
    try:
        for _ in range(world_size):
            rank, status, payload = queue.get(timeout=timeout)
            if status == "ok":
                results[rank] = pickle.loads(payload)
            else:
                errors.append(f"rank {rank} failed:\n{payload}")
                break
    except Exception as error:  # queue.Empty: a rank hung or died without reporting
        errors.append(f"distributed run timed out or died after {timeout}s: {error!r}")
    finally:
        for p in procs:
            p.join(timeout=5 if not errors else 0.1)
            if p.is_alive():
                p.kill()
                p.join()
    if errors:
        raise AssertionError("\n".join(errors))
    return [results[r] for r in range(world_size)]
