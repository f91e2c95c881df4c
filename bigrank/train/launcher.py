"""Local multi-process launcher on torch elastic: N processes on this machine running one worker function.

``launch_local(fn, world_size, args)`` runs ``fn(*args)`` in ``world_size`` processes started by torch elastic's
agent (``torch.distributed.launcher.api.elastic_launch``, what ``torchrun --standalone`` runs: spawned
processes, a c10d rendezvous on a free port of 127.0.0.1, ``max_restarts`` restarts of the whole group). Its
rendezvous store and the workers' group store listen on 127.0.0.1 only (torch's TCPStore server would listen on
every interface: :func:`_loopback_rendezvous`, ``bigrank.train.bootstrap.loopback_store``). Each
process is set up by ``bigrank.train.bootstrap.start_local_process`` (process group, threads, signals) before
``fn`` runs, and the per-rank results come back. When any rank raises or dies (even by ``os._exit``), the
agent stops the others at once (they would otherwise wait forever in a collective) and, once the restarts are
spent, :class:`WorkerError` is raised naming the rank that caused it, with its traceback. Ray Train replaces
this module on clusters; the worker functions (``bigrank.train.workers``) are the same.

Stopping, as torchrun and Kubernetes do it. SIGINT (Ctrl+C) or SIGTERM (``kill``, a pod's deletion) to the
launching process: the launcher forwards the signal to every worker, SIGKILLs those still running ``stop_grace``
seconds later, and raises KeyboardInterrupt (SIGINT) or :class:`~bigrank.errors.Terminated` (SIGTERM) once the
workers are gone. A training worker stops at its next step boundary, all ranks at the same step, after writing a
final checkpoint (``bigrank.signals.step_boundaries``); any other job ends at once. A second signal SIGKILLs the
workers at once. The launcher, not torch elastic's agent, takes the signals (the agent is given none): the
agent would wait its whole ``shutdown_timeout`` after a second signal, and only the launching process sees each
signal once (a terminal's Ctrl+C, systemd's SIGTERM reach the workers directly too, so the workers cannot count
them). Workers the agent starts after the signal (a restart) end at once, before their job. A launching process
that dies without running any handler (SIGKILL, the OOM killer) takes its workers with it: on Linux each worker
asks the kernel for SIGKILL when its parent dies (``prctl(PR_SET_PDEATHSIG)``). Signal handlers are those of the
caller again when :func:`launch_local` returns or raises. Off the main thread (a tune trial's training thread)
Python takes no signals: the caller's own shutdown (the end of its process) stops the workers.

torch elastic's own log lines (its agent's start-up, "closing process" and failure reports) are kept quiet:
bigrank reports a failure once, as :class:`WorkerError`. Set ``LOGLEVEL`` (torch elastic's variable) to see them.
"""

from __future__ import annotations

import contextlib
import datetime
import gc
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
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from bigrank.atomic import write_text_atomic
from bigrank.signals import STOP_GRACE_SECONDS, STOP_SIGNALS, StopFile, Stopped, restore_handlers, stop_exception

__all__ = ["STOP_GRACE_SECONDS", "WorkerError", "free_port", "launch_local"]

# Worker files in the launch's reports directory: the stop request (the signal's number), each worker's pid.
_STOP_FILE = "stop"
_PID_FILES = "pid-*"
_ELASTIC_LOGGERS = ("torch.distributed.elastic", "torch.distributed.launcher", "torch.multiprocessing")
_SIGNALS_ENV = "TORCHELASTIC_SIGNALS_TO_HANDLE"
# The agent keeps no store of its own for the workers (it would listen on every interface): rank 0 hosts the
# group's store on the loopback (bigrank.train.bootstrap.start_local_process), a fresh one each attempt.
_ELASTIC_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
_RENDEZVOUS = "bigrank-loopback"


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
    return free_ports(1)[0]


def free_ports(count: int) -> list[int]:
    """``count`` distinct TCP ports free on 127.0.0.1 right now. Every socket stays bound until all are drawn:
    ports drawn one at a time may repeat, since the kernel hands a just-closed port out again."""
    sockets = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


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
    env: Mapping[str, str] | None = None,
) -> list[Any]:
    """Run ``fn(*args)`` in ``world_size`` local processes; return the results indexed by rank.

    ``backend``: the process-group backend; workers on GPUs use ``"cpu:gloo,cuda:nccl"``
    (``bigrank.devices.process_group_backend``), each on ``cuda:LOCAL_RANK`` (``bigrank.devices.worker_device``).
    ``threads``: torch threads per process (None: ``cpu_count // world_size``, at least 1). ``max_restarts``:
    how many times the whole group is started again after a failure (torch elastic's ``max_restarts``; a
    training worker resumes from the run's last checkpoint). ``stop_grace``: seconds the workers get after the
    forwarded signal before SIGKILL. ``env``: environment variables the workers start with, each unless the
    launching process has it set already (it is read before ``fn`` runs: e.g. OpenMP's ``OMP_WAIT_POLICY``,
    read when torch loads); the launching process's environment is as it was afterwards.

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
    stop = _StopForwarder(reports, stop_grace)
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=world_size,
        run_id=f"bigrank-{uuid.uuid4().hex[:12]}",
        rdzv_backend=_register_loopback_rendezvous(),
        rdzv_endpoint=f"127.0.0.1:{free_port()}",
        local_addr="127.0.0.1",
        max_restarts=max_restarts,
        monitor_interval=0.1,
        start_method="spawn",
        logs_specs=DefaultLogsSpecs(log_dir=str(workdir / "elastic")),
        signals_to_handle="",  # the launcher takes them (_StopForwarder); the agent logs that it got none
        shutdown_timeout=int(stop_grace),
    )
    entry = (fn, tuple(args), backend, threads, os.getpid(), str(reports))
    before = set(multiprocessing.active_children())
    try:
        with _caller_signals(main_thread, timeout, stop), _quiet_elastic_logs(), _worker_environment(env or {}):
            results = elastic_launch(config, _run_rank)(*entry)
    except ChildFailedError as failed:
        if stop.signum is not None:  # workers ended by the signal (or SIGKILLed after the grace period)
            raise stop_exception(stop.signum) from None
        raise _cause(failed, reports, world_size) from None
    except SignalException as signalled:  # not handled by the agent (signals_to_handle); kept for safety
        raise stop_exception(int(signalled.sigval)) from None
    finally:
        stop.cancel()
        _reap(before)
        shutil.rmtree(workdir, ignore_errors=True)
    stopped = [result.signum for result in results.values() if isinstance(result, _StoppedResult)]
    if stop.signum is not None or stopped:  # a signal to the launcher, or to the workers alone
        raise stop_exception(stop.signum if stop.signum is not None else stopped[0])
    return [results[rank] for rank in range(world_size)]


# ------------------------------------------------------------------------------------------ in each worker
class _StoppedResult:
    """A worker's result when a signal stopped its job (:class:`~bigrank.signals.Stopped`) or came before it."""

    def __init__(self, signum: int):
        self.signum = signum


def _run_rank(fn, args: tuple, backend: str, threads: int, parent_pid: int, reports: str):
    """What each process runs (under torch elastic's ``record`` wrapper): the bootstrap, then ``fn(*args)``.

    A failure is written to ``reports`` (type, message, traceback) before the process group is torn down (the
    teardown makes the peers fail with connection errors; the launcher must find the cause first), then the
    process exits with status 1. A job stopped by a signal (:class:`~bigrank.signals.Stopped`), or a process
    started after the launcher got one (a restart), returns a :class:`_StoppedResult`.
    """
    import torch.distributed as dist

    from bigrank.train.bootstrap import start_local_process

    failed = False
    try:
        start_local_process(backend, threads, parent_pid)
        # The pid first, the stop request then (the launcher writes them the other way round): a worker either is
        # signalled by the launcher or finds the request here.
        rank = os.environ["RANK"]
        (Path(reports) / f"pid-{rank}-{os.getpid()}").touch()
        requested = StopFile(Path(reports) / _STOP_FILE).signum
        result = _StoppedResult(requested) if requested is not None else fn(*args)
    except Stopped as stopped:
        result = _StoppedResult(stopped.signum)
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
    # The process ends once the launcher has read the result: the collection of its whole heap at interpreter exit
    # would only delay that (seconds for a trainer's heap on a busy machine: the stop's deadline). Frozen
    # objects are left to the OS; files are closed by their owners and by module teardown as before.
    gc.freeze()
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


class _StopForwarder:
    """The launcher's SIGINT/SIGTERM handler while the workers run: the first signal is recorded (``signum``),
    written to the reports directory (a worker that starts later stops at once) and forwarded to every worker,
    whose pids are in that directory; the workers still alive ``grace`` seconds later are SIGKILLed. A second
    signal SIGKILLs them at once and raises (:func:`~bigrank.signals.stop_exception` of the first)."""

    def __init__(self, reports: Path, grace: float):
        self.reports, self.grace = reports, grace
        self.signum: int | None = None
        self._timer: threading.Timer | None = None

    def handle(self, signum, frame) -> None:
        if self.signum is not None:
            self.kill()
            raise stop_exception(self.signum)
        self.signum = signum
        write_text_atomic(self.reports / _STOP_FILE, str(int(signum)))  # a worker reads it whole or not at all
        self._send(signum)
        self._timer = threading.Timer(self.grace, self.kill)
        self._timer.daemon = True
        self._timer.start()

    def kill(self) -> None:
        self._send(signal.SIGKILL)

    def cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()

    def _send(self, signum: int) -> None:
        for path in self.reports.glob(_PID_FILES):
            try:
                os.kill(int(path.name.rsplit("-", 1)[1]), signum)
            except (ProcessLookupError, PermissionError):  # ended meanwhile
                pass


@contextlib.contextmanager
def _worker_environment(env: Mapping[str, str]) -> Iterator[None]:
    """The variables of ``env`` that this process does not set, set while the workers are started (spawned
    processes inherit this process's environment, torch elastic's restarts included), then removed again."""
    added = [name for name in env if name not in os.environ]
    for name in added:
        os.environ[name] = str(env[name])
    try:
        yield
    finally:
        for name in added:
            os.environ.pop(name, None)


@contextlib.contextmanager
def _caller_signals(main_thread: bool, timeout: float | None, stop: _StopForwarder) -> Iterator[None]:
    """While the workers run (on the main thread; off it Python takes no signals): SIGINT and SIGTERM go to
    ``stop`` (unless the caller ignores them: a shell's background job ignores SIGINT); SIGALRM after ``timeout``
    seconds raises TimeoutError; torch elastic's agent reads ``_ELASTIC_ENV``. Afterwards the caller's handlers
    and environment (``TORCHELASTIC_SIGNALS_TO_HANDLE`` too, which torch elastic sets for the whole process)
    are back."""
    saved = {name: os.environ.get(name) for name in (*_ELASTIC_ENV, _SIGNALS_ENV)}
    os.environ.update(_ELASTIC_ENV)
    signums = (*STOP_SIGNALS, signal.SIGALRM) if main_thread else ()
    previous = {signum: signal.getsignal(signum) for signum in signums}

    def alarm(signum, frame):
        raise TimeoutError(f"workers did not finish within {timeout} s")

    for signum in STOP_SIGNALS if main_thread else ():
        if previous[signum] is not signal.SIG_IGN:
            signal.signal(signum, stop.handle)
    if main_thread and timeout is not None:
        signal.signal(signal.SIGALRM, alarm)
        signal.setitimer(signal.ITIMER_REAL, timeout)
    try:
        yield
    finally:
        if main_thread and timeout is not None:
            signal.setitimer(signal.ITIMER_REAL, 0)
        restore_handlers(previous)
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _loopback_rendezvous(params):
    """torch elastic's c10d rendezvous (``torchrun --standalone``'s) on a store that listens on the endpoint's
    loopback address only: torch's own c10d backend creates a TCPStore server, which listens on every interface."""
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler
    from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

    from bigrank.train.bootstrap import loopback_store

    class LoopbackBackend(C10dRendezvousBackend):
        @property
        def name(self) -> str:  # the registry checks that the handler's backend has the requested name
            return _RENDEZVOUS

    host, port = parse_rendezvous_endpoint(params.endpoint, default_port=0)
    store = loopback_store(port, datetime.timedelta(seconds=params.get_as_int("read_timeout", 60)), host)
    return create_handler(store, LoopbackBackend(store, params.run_id), params)


def _register_loopback_rendezvous() -> str:
    """The name of :func:`_loopback_rendezvous` in torch elastic's rendezvous registry (registered once)."""
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry

    rendezvous_handler_registry.register(_RENDEZVOUS, _loopback_rendezvous)  # the same creator again: no-op
    return _RENDEZVOUS


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
