"""Local multi-process launcher: N gloo processes on 127.0.0.1 running one worker function.

``launch_local(fn, world_size, args)`` spawns ``world_size`` processes (``torch.multiprocessing``, spawn),
initialises a gloo process group in each (free TCP port on 127.0.0.1), runs ``fn(*args)`` and returns the
per-rank results. When any rank raises or dies (even by ``os._exit``), the others are killed at once (they
would otherwise wait forever in a collective) and :class:`WorkerError` is raised with that rank's traceback.
Ray Train replaces this module on clusters; the worker functions (``bigrank.train.workers``) are the same.

Stopping, as torchrun and Kubernetes do it. SIGINT (Ctrl+C) or SIGTERM (``kill``, a pod's deletion) to the
launching process while the workers run: it sends SIGTERM to every worker, waits up to ``stop_grace`` seconds
for them to exit, SIGKILLs what is left, then raises KeyboardInterrupt (SIGINT) or
:class:`~bigrank.errors.Terminated` (SIGTERM); a second signal during that wait kills them at once. The workers
ignore SIGINT (a terminal's Ctrl+C reaches them too) and do not catch SIGTERM: a worker stops where it is, and
the run resumes from its last complete checkpoint
(checkpoints are renamed into place only once complete). A launching process that dies without running any
handler (SIGKILL, the OOM killer) takes its workers with it: on Linux each worker asks the kernel for SIGTERM when
its parent dies (``prctl(PR_SET_PDEATHSIG)``).
"""

from __future__ import annotations

import datetime
import os
import pickle
import queue as queue_module
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from bigrank.errors import Terminated

__all__ = ["STOP_GRACE_SECONDS", "WorkerError", "free_port", "launch_local"]

# Seconds the workers get to exit after SIGTERM before they are SIGKILLed: shorter than the 30 s a Kubernetes pod
# gets before its own SIGKILL (terminationGracePeriodSeconds), so the launcher finishes its clean-up in time.
STOP_GRACE_SECONDS = 10.0
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


class WorkerError(RuntimeError):
    """A worker process failed: ``rank``, the exception's ``error_type`` and ``message``, its ``traceback``."""

    def __init__(self, rank: int, error_type: str, message: str, traceback_text: str):
        self.rank, self.error_type, self.message, self.traceback = rank, error_type, message, traceback_text
        super().__init__(f"rank {rank} failed: {error_type}: {message}")

    def __reduce__(self):
        # Ray Tune copies and pickles a trial's exception; the default (type, args) would call __init__ with the
        # formatted message alone and replace the worker's error by a TypeError.
        return type(self), (self.rank, self.error_type, self.message, self.traceback), self.__dict__


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _exit_with_parent(parent_pid: int) -> None:
    """Have the kernel send this process SIGTERM when its parent dies (Linux ``prctl(PR_SET_PDEATHSIG)``), so
    the workers of a launcher killed without clean-up (SIGKILL, the OOM killer) do not train on as orphans.
    Exits at once when the parent is already gone. Elsewhere than on Linux: nothing."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
    except (OSError, AttributeError):  # no prctl in this libc: the launcher's own clean-up still applies
        return
    if os.getppid() != parent_pid:  # the parent died before the request took effect
        os._exit(1)


def _worker(
    rank: int, world_size: int, port: int, threads: int, fn, args, results, backend: str = "gloo", parent_pid=None
) -> None:
    if parent_pid is not None:
        _exit_with_parent(parent_pid)
    # Ctrl+C reaches the whole foreground process group; the launcher alone handles it (and stops the workers
    # with SIGTERM), so that a worker's KeyboardInterrupt cannot overtake it as a "failed rank".
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        GLOO_SOCKET_IFNAME=os.environ.get("GLOO_SOCKET_IFNAME", "lo"),
    )
    try:
        torch.set_num_threads(threads)
        dist.init_process_group(
            backend,
            rank=rank,
            world_size=world_size,
            init_method=f"tcp://127.0.0.1:{port}",
            timeout=datetime.timedelta(minutes=30),
        )
        result = fn(*args)
        report = (rank, "ok", pickle.dumps(result))
    except BaseException as error:  # noqa: BLE001 - report anything (SystemExit included) to the parent
        message = str(error) or repr(error)
        report = (rank, "error", pickle.dumps((type(error).__name__, message, traceback.format_exc())))
    # Report before tearing the group down: the teardown makes the peers fail with connection errors, and
    # the parent must hear the cause first.
    results.put(report)
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - peers may be gone already
            pass


def launch_local(
    fn,
    world_size: int,
    args: tuple = (),
    *,
    timeout: float | None = None,
    backend: str = "gloo",
    stop_grace: float = STOP_GRACE_SECONDS,
) -> list[Any]:
    """Run ``fn(*args)`` in ``world_size`` gloo processes; return the results indexed by rank.

    ``backend``: the process-group backend; workers on GPUs use ``"cpu:gloo,cuda:nccl"``
    (``bigrank.devices.process_group_backend``), each on ``cuda:LOCAL_RANK`` (``bigrank.devices.worker_device``).

    ``fn`` must be a module-level function (it is pickled). Each process gets ``cpu_count // world_size``
    torch threads (at least 1). Raises :class:`WorkerError` for the first rank that fails, TimeoutError after
    ``timeout`` seconds (None: no limit); never leaves a process behind.

    SIGINT / SIGTERM while the workers run (called from the main thread: only it can take signals) stop them
    as the module's docstring says (SIGTERM, ``stop_grace`` seconds, SIGKILL), then raise KeyboardInterrupt /
    :class:`~bigrank.errors.Terminated`.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    threads = max(1, (os.cpu_count() or 1) // world_size)
    parent = os.getpid()
    procs = [
        ctx.Process(
            target=_worker, args=(rank, world_size, port, threads, fn, args, results, backend, parent), daemon=False
        )
        for rank in range(world_size)
    ]
    collected: dict[int, Any] = {}
    failure: BaseException | None = None
    deadline = None if timeout is None else time.monotonic() + timeout
    previous = _on_signals(signal.SIGTERM, _raise_terminated)  # SIGINT already raises KeyboardInterrupt
    try:
        for proc in procs:
            proc.start()
        while len(collected) < world_size and failure is None:
            try:
                rank, status, payload = results.get(timeout=0.2)
            except queue_module.Empty:
                dead = _dead_rank(procs, collected)
                if dead is None:
                    if deadline is not None and time.monotonic() > deadline:
                        failure = TimeoutError(f"workers did not finish within {timeout} s")
                    continue
                try:  # it may have reported just before exiting
                    rank, status, payload = results.get(timeout=2.0)
                except queue_module.Empty:
                    code = procs[dead].exitcode
                    message = f"process exited with code {code} without reporting a result"
                    failure = WorkerError(dead, "WorkerDied", message, "")
                    continue
            if status == "ok":
                collected[rank] = pickle.loads(payload)
            else:
                failure = _root_cause(WorkerError(rank, *pickle.loads(payload)), procs, results, collected, rank)
    except (KeyboardInterrupt, Terminated) as stop:
        failure = stop
    finally:
        _restore_signals(previous)
        if isinstance(failure, KeyboardInterrupt | Terminated):
            _stop_workers(procs, stop_grace)
        for proc in procs:
            if failure is not None and proc.is_alive():
                proc.kill()
            if proc.pid is not None:
                proc.join(timeout=None if failure is None else 10)
            if proc.is_alive():
                proc.kill()
                proc.join()
        results.close()
    if failure is not None:
        raise failure
    return [collected[rank] for rank in range(world_size)]


# ------------------------------------------------------------------------------------------------ signals
def _raise_terminated(signum, frame) -> None:
    raise Terminated(signum)


def _on_signals(signals, handler: Callable) -> dict | None:
    """Install ``handler`` for ``signals`` (one or a tuple); returns the previous handlers for
    :func:`_restore_signals`, or None off the main thread (where Python cannot take signals)."""
    if threading.current_thread() is not threading.main_thread():
        return None
    signals = signals if isinstance(signals, tuple) else (signals,)
    return {signum: signal.signal(signum, handler) for signum in signals}


def _restore_signals(previous: dict | None) -> None:
    for signum, handler in (previous or {}).items():
        signal.signal(signum, handler if handler is not None else signal.SIG_DFL)


def _stop_workers(procs, grace: float) -> None:
    """SIGTERM every live worker, wait up to ``grace`` seconds for all of them to exit, SIGKILL the rest.
    A further SIGINT/SIGTERM meanwhile (a second Ctrl+C) cuts the wait short instead of interrupting the
    clean-up half-way."""
    hurry = threading.Event()
    previous = _on_signals((signal.SIGINT, signal.SIGTERM), lambda signum, frame: hurry.set())
    try:
        for proc in procs:
            if proc.is_alive():
                proc.terminate()
        deadline = time.monotonic() + grace
        while any(proc.is_alive() for proc in procs) and time.monotonic() < deadline and not hurry.is_set():
            time.sleep(0.05)
        for proc in procs:
            if proc.is_alive():
                proc.kill()
            if proc.pid is not None:
                proc.join()
    finally:
        _restore_signals(previous)


def _is_connection_error(error: WorkerError) -> bool:
    """gloo's errors when a peer went away: a consequence, not a cause."""
    text = error.message.lower()
    return "connection" in text or "gloo/transport" in text or "broken pipe" in text


def _root_cause(error: WorkerError, procs, results, collected, reporter: int) -> WorkerError:
    """The likely cause among the failures of the next second: a rank that died silently, or a rank's own
    error, rather than the connection errors its peers get when it goes away."""
    deadline = time.monotonic() + 1.0
    while _is_connection_error(error) and time.monotonic() < deadline:
        try:
            rank, status, payload = results.get(timeout=0.1)
        except queue_module.Empty:
            continue
        if status == "ok":
            collected[rank] = pickle.loads(payload)
        else:
            other = WorkerError(rank, *pickle.loads(payload))
            if not _is_connection_error(other):
                return other
    if not _is_connection_error(error):
        return error
    for rank, proc in enumerate(procs):
        if rank != reporter and rank not in collected and not proc.is_alive() and proc.exitcode:
            message = (
                f"process exited with code {proc.exitcode} without reporting a result "
                f"(rank {reporter} then failed with {error.error_type}: {error.message})"
            )
            return WorkerError(rank, "WorkerDied", message, error.traceback)
    return error


def _dead_rank(procs, collected) -> int | None:
    """The first rank whose process has exited without its result being collected, or None."""
    for rank, proc in enumerate(procs):
        if rank not in collected and not proc.is_alive() and proc.exitcode is not None:
            return rank
    return None
