"""Local multi-process launcher on torch elastic: N processes on this machine running one worker function.

``launch_local(fn, world_size, args)`` runs ``fn(*args)`` in ``world_size`` processes started by torch elastic's
agent (``torch.distributed.launcher.api.elastic_launch``, what ``torchrun --standalone`` runs: spawned
processes, a c10d rendezvous on a free port of 127.0.0.1, ``max_restarts`` restarts of the whole group). Each
process is set up by ``bigrank.train.bootstrap.start_local_process`` (process group, threads, signals) before
``fn`` runs, and the per-rank results come back. When any rank raises or dies (even by ``os._exit``), the
agent stops the others at once (they would otherwise wait forever in a collective) and, once the restarts are
spent, :class:`WorkerError` is raised naming the rank that caused it, with its traceback. Ray Train replaces
this module on clusters; the worker functions (``bigrank.train.workers``) are the same.

Stopping, as torchrun and Kubernetes do it. SIGINT (Ctrl+C) or SIGTERM (``kill``, a pod's deletion) to the
launching process: the agent forwards the signal to every worker, waits up to ``stop_grace`` seconds for them
to exit and SIGKILLs what is left; then :func:`launch_local` raises KeyboardInterrupt (SIGINT) or
:class:`~bigrank.errors.Terminated` (SIGTERM). The workers end at the signal where they are (the bootstrap keeps
its default action), and the run resumes from its last complete checkpoint. A launching process that dies
without running any handler (SIGKILL, the OOM killer) takes its workers with it: on Linux each worker asks the
kernel for SIGTERM when its parent dies (``prctl(PR_SET_PDEATHSIG)``). Signal handlers are those of the caller
again when :func:`launch_local` returns or raises. Off the main thread (a tune trial's training thread) Python
takes no signals: the caller's own shutdown (the end of its process) stops the workers.

torch elastic's own log lines (its agent's start-up, "closing process" and failure reports) are kept quiet:
bigrank reports a failure once, as :class:`WorkerError`. Set ``LOGLEVEL`` (torch elastic's variable) to see them.
"""

from __future__ import annotations

import contextlib
import json
import logging
import multiprocessing
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
import traceback
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from bigrank.errors import Terminated

__all__ = ["STOP_GRACE_SECONDS", "WorkerError", "free_port", "launch_local"]

# Seconds the workers get to exit after SIGTERM before they are SIGKILLed: shorter than the 30 s a Kubernetes pod
# gets before its own SIGKILL (terminationGracePeriodSeconds), so the launcher finishes its clean-up in time.
STOP_GRACE_SECONDS = 10
# The signals torch elastic's agent forwards to the workers (others keep the caller's handling), unless the
# caller ignores them (a shell's background job ignores SIGINT).
_FORWARDED = (signal.SIGTERM, signal.SIGINT)
_ELASTIC_LOGGERS = ("torch.distributed.elastic", "torch.distributed.launcher", "torch.multiprocessing")


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


def launch_local(
    fn,
    world_size: int,
    args: tuple = (),
    *,
    timeout: float | None = None,
    backend: str = "gloo",
    threads: int | None = None,
    max_restarts: int = 0,
    stop_grace: int = STOP_GRACE_SECONDS,
) -> list[Any]:
    """Run ``fn(*args)`` in ``world_size`` local processes; return the results indexed by rank.

    ``backend``: the process-group backend; workers on GPUs use ``"cpu:gloo,cuda:nccl"``
    (``bigrank.devices.process_group_backend``), each on ``cuda:LOCAL_RANK`` (``bigrank.devices.worker_device``).
    ``threads``: torch threads per process (None: ``cpu_count // world_size``, at least 1). ``max_restarts``:
    how many times the whole group is started again after a failure (torch elastic's ``max_restarts``; a
    training worker resumes from the run's last checkpoint). ``stop_grace``: seconds the workers get after the
    forwarded signal before SIGKILL.

    ``fn`` must be a module-level function (it is pickled). Raises :class:`WorkerError` for the rank that
    caused the last attempt's failure, TimeoutError after ``timeout`` seconds (None: no limit; on the main
    thread only); never leaves a process behind. SIGINT / SIGTERM stop the workers as the module docstring
    says, then raise KeyboardInterrupt / :class:`~bigrank.errors.Terminated`.
    """
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if max_restarts < 0:
        raise ValueError(f"max_restarts must be >= 0, got {max_restarts}")
    main_thread = threading.current_thread() is threading.main_thread()
    if timeout is not None and not main_thread:
        raise ValueError("launch_local's timeout needs the main thread (it uses SIGALRM)")
    threads = threads or max(1, (os.cpu_count() or 1) // world_size)
    workdir = Path(tempfile.mkdtemp(prefix="bigrank-launch-"))
    reports = workdir / "reports"
    reports.mkdir()
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=world_size,
        run_id=f"bigrank-{uuid.uuid4().hex[:12]}",
        rdzv_backend="c10d",
        rdzv_endpoint=f"127.0.0.1:{free_port()}",
        local_addr="127.0.0.1",
        max_restarts=max_restarts,
        monitor_interval=0.1,
        start_method="spawn",
        logs_specs=DefaultLogsSpecs(log_dir=str(workdir / "elastic")),
        signals_to_handle=",".join(sig.name for sig in _forwarded(main_thread)),
        shutdown_timeout=int(stop_grace),
    )
    entry = (fn, tuple(args), backend, threads, os.getpid(), str(reports))
    before = set(multiprocessing.active_children())
    try:
        with _caller_signals(main_thread, timeout), _quiet_elastic_logs():
            results = elastic_launch(config, _run_rank)(*entry)
        return [results[rank] for rank in range(world_size)]
    except ChildFailedError as failed:
        raise _cause(failed, reports, world_size) from None
    except SignalException as stop:
        raise (KeyboardInterrupt() if stop.sigval == signal.SIGINT else Terminated(int(stop.sigval))) from None
    finally:
        _reap(before)
        shutil.rmtree(workdir, ignore_errors=True)


# ------------------------------------------------------------------------------------------ in each worker
def _run_rank(fn, args: tuple, backend: str, threads: int, parent_pid: int, reports: str):
    """What each process runs (under torch elastic's ``record`` wrapper): the bootstrap, then ``fn(*args)``.

    A failure is written to ``reports`` (type, message, traceback) before the process group is torn down (the
    teardown makes the peers fail with connection errors; the launcher must find the cause first), then the
    process exits with status 1.
    """
    import torch.distributed as dist

    from bigrank.train.bootstrap import start_local_process

    failed = False
    try:
        start_local_process(backend, threads, parent_pid)
        result = fn(*args)
    except BaseException as error:  # noqa: BLE001 - report anything (SystemExit included) to the launcher
        _write_report(Path(reports), error)
        failed = True
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - peers may be gone already
            pass
    if failed:
        sys.exit(1)
    return result


def _report_path(reports: Path, rank: int, attempt: int) -> Path:
    return reports / f"rank-{rank}-attempt-{attempt}.json"


def _write_report(reports: Path, error: BaseException) -> None:
    report = {
        "error_type": type(error).__name__,
        "message": str(error) or repr(error),
        "traceback": traceback.format_exc(),
    }
    rank, attempt = int(os.environ["RANK"]), int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    path = _report_path(reports, rank, attempt)
    path.with_suffix(".tmp").write_text(json.dumps(report))
    path.with_suffix(".tmp").replace(path)


# ---------------------------------------------------------------------------------------- in the launcher
def _cause(failed, reports: Path, world_size: int) -> WorkerError:
    """The likely cause of a failed attempt: a rank's own error, or a rank that died without reporting, rather
    than the connection errors its peers get when it goes away. ``failed``: torch elastic's ChildFailedError
    (it names the first process found dead)."""
    rank, failure = failed.get_first_failure()
    attempts = [int(path.stem.rsplit("-", 1)[1]) for path in reports.glob("rank-*-attempt-*.json")]
    attempt = max(attempts, default=0)
    found = {}
    for path in reports.glob(f"rank-*-attempt-{attempt}.json"):
        found[int(path.stem.split("-")[1])] = json.loads(path.read_text())
    if rank in found:
        error = WorkerError(rank, found[rank]["error_type"], found[rank]["message"], found[rank]["traceback"])
    else:
        how = f"signal {failure.signal_name()}" if failure.exitcode < 0 else f"code {failure.exitcode}"
        error = WorkerError(rank, "WorkerDied", f"process exited with {how} without reporting a result", "")
    if not _is_connection_error(error):
        return error
    for other, report in sorted(found.items()):
        candidate = WorkerError(other, report["error_type"], report["message"], report["traceback"])
        if not _is_connection_error(candidate):
            return candidate
    silent = sorted(set(range(world_size)) - set(found))
    if silent:  # a peer's connection broke because this rank died without a word (os._exit, a crash)
        message = (
            "process exited without reporting a result "
            f"(rank {error.rank} then failed with {error.error_type}: {error.message})"
        )
        return WorkerError(silent[0], "WorkerDied", message, error.traceback)
    return error


def _is_connection_error(error: WorkerError) -> bool:
    """gloo's errors when a peer went away: a consequence, not a cause."""
    text = error.message.lower()
    return "connection" in text or "gloo/transport" in text or "broken pipe" in text


def _forwarded(main_thread: bool) -> list[signal.Signals]:
    """The signals torch elastic's agent takes and forwards: SIGTERM and SIGINT, less those the caller ignores."""
    if not main_thread:
        return list(_FORWARDED)  # no handlers off the main thread: torch elastic installs none either
    return [signum for signum in _FORWARDED if signal.getsignal(signum) is not signal.SIG_IGN]


@contextlib.contextmanager
def _caller_signals(main_thread: bool, timeout: float | None) -> Iterator[None]:
    """While the workers run (on the main thread; off it Python takes no signals): SIGTERM raises Terminated
    until torch elastic's agent installs its own handlers (it forwards SIGINT/SIGTERM to the workers once they
    exist); SIGALRM after ``timeout`` seconds raises TimeoutError. Afterwards the caller's handlers (and
    ``TORCHELASTIC_SIGNALS_TO_HANDLE``) are back."""
    variable = os.environ.get("TORCHELASTIC_SIGNALS_TO_HANDLE")  # launch_agent sets it for the whole process
    signums = (signal.SIGINT, signal.SIGTERM, signal.SIGALRM) if main_thread else ()
    previous = {signum: signal.getsignal(signum) for signum in signums}

    def alarm(signum, frame):
        raise TimeoutError(f"workers did not finish within {timeout} s")

    def terminated(signum, frame):
        raise Terminated(signum)

    if main_thread and previous[signal.SIGTERM] is not signal.SIG_IGN:
        signal.signal(signal.SIGTERM, terminated)
    if main_thread and timeout is not None:
        signal.signal(signal.SIGALRM, alarm)
        signal.setitimer(signal.ITIMER_REAL, timeout)
    try:
        yield
    finally:
        if main_thread and timeout is not None:
            signal.setitimer(signal.ITIMER_REAL, 0)
        for signum, handler in previous.items():
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
        if variable is None:
            os.environ.pop("TORCHELASTIC_SIGNALS_TO_HANDLE", None)
        else:
            os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"] = variable


@contextlib.contextmanager
def _quiet_elastic_logs() -> Iterator[None]:
    """torch elastic's loggers (each has its own level) above CRITICAL while the workers run, unless the user
    set ``LOGLEVEL``."""
    if "LOGLEVEL" in os.environ:
        yield
        return
    import torch.distributed.elastic.agent.server.local_elastic_agent  # noqa: F401 - creates its loggers
    import torch.distributed.elastic.rendezvous.c10d_rendezvous_backend  # noqa: F401

    loggers = [
        logger
        for name, logger in logging.root.manager.loggerDict.items()
        if name.startswith(_ELASTIC_LOGGERS) and isinstance(logger, logging.Logger)
    ]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.CRITICAL + 1)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)


def _reap(before: set) -> None:
    """SIGKILL and join the processes this launch started that are still alive: none, unless a signal cut
    torch elastic's start or shutdown short (a second Ctrl+C during the stop)."""
    for proc in set(multiprocessing.active_children()) - before:
        if proc.is_alive():
            proc.kill()
        proc.join(timeout=10)
