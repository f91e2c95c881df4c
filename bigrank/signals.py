"""Graceful stops of the long-running commands that wait on something else (a Tune search, a server, a Ray job).

``graceful_stop(on_signal)`` turns the first SIGINT (Ctrl+C) or SIGTERM (``kill``, a Kubernetes pod's deletion,
systemd) into a call of ``on_signal(signum)`` that starts an orderly stop (Tune checkpoints its state and ends
its trials; a server drains its requests) and records the signal; the command then finishes that stop and
reports it. A second signal while the stop runs raises at once (KeyboardInterrupt for SIGINT,
:class:`~bigrank.errors.Terminated` for SIGTERM: :func:`stop_exception`), as torchrun and Ray Tune do on a
second Ctrl+C.

A loop that runs until it is stopped (following a job's log, serving, ingesting, training) looks at the request's
``event`` between its waits; none relies on an exception raised from the handler for its first signal. A handler
runs between two bytecodes of whatever the main thread executes, a finaliser included (garbage collection runs
them anywhere: urllib3's connection pools are finalised so), and an exception raised there is swallowed: Python
prints "Exception ignored in: <finalize object>" and goes on (``bigrank submit --wait`` once followed a job to its
end after a SIGTERM so).

Stopping at once inside Ray. While ``ray.get`` waits (inside ``ray.init``, ``serve.start``, ``serve.run``,
``TorchTrainer.fit``, ``Tuner.fit``), Ray runs the Python signal handlers from its ``check_signals`` and lets only
KeyboardInterrupt and SystemExit through: it swallows any other exception, so a Terminated raised there waits
until the call returns. So every stop at once (the second signal; :func:`raise_in_ray` as or inside
``on_signal`` for the first) raises KeyboardInterrupt, and :func:`graceful_stop` turns a KeyboardInterrupt that
leaves its block back into the exception of the signal that raised it. Every command that blocks in Ray (``train``
with the Ray launcher, ``serve --ray``, ``tune``) stops this way.

``bigrank.cli`` turns those exceptions into exit status 130 / 143 and a line saying how to resume.

Workers of the local launcher stop at a step boundary instead (:func:`defer_stop_signals`, :func:`step_boundaries`):
there a signal only records itself while a training loop runs; the loop agrees with its peers on the step to stop
at, writes a checkpoint and raises :class:`Stopped`. The launcher, which sees each signal once, enforces the
deadline and makes a second signal stop the workers at once (``bigrank.train.launcher``). Ray Train's workers
never see the command's signals: the Ray launcher writes the stop request into a file they watch
(:func:`watch_stop_file`) and enforces the same deadline (``bigrank.launch.ray_train``).
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from bigrank.errors import Terminated

__all__ = [
    "STOP_GRACE_SECONDS",
    "STOP_SIGNALS",
    "StopFile",
    "StopRequest",
    "Stopped",
    "defer_stop_signals",
    "graceful_stop",
    "hangup_requests",
    "held_stop_signals",
    "raise_for",
    "raise_in_ray",
    "restore_handlers",
    "signal_name",
    "step_boundaries",
    "stop_exception",
    "watch_stop_file",
]

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
# Seconds the workers get to reach a step boundary and exit after SIGTERM before a launcher ends them at once:
# shorter than the 30 s a Kubernetes pod gets before its own SIGKILL (terminationGracePeriodSeconds), so the
# launcher finishes its clean-up in time.
STOP_GRACE_SECONDS = 10


def signal_name(signum: int) -> str:
    """``"SIGINT"`` / ``"SIGTERM"`` / … of a signal number."""
    return signal.Signals(signum).name


def stop_exception(signum: int) -> BaseException:
    """What a stop by ``signum`` raises in bigrank: KeyboardInterrupt (SIGINT) or Terminated (others)."""
    return KeyboardInterrupt() if signum == signal.SIGINT else Terminated(signum)


def raise_for(signum: int) -> None:
    """Raise :func:`stop_exception` of ``signum``."""
    raise stop_exception(signum)


def raise_in_ray(signum: int) -> None:
    """Stop at once from a :func:`graceful_stop` handler, also inside a blocking Ray call: raise KeyboardInterrupt
    (the module docstring says why), which :func:`graceful_stop` turns into :func:`stop_exception` of ``signum``
    when it leaves the block."""
    raise KeyboardInterrupt


class StopRequest:
    """The signal that asked for a stop (``signum``, None until one came); ``event`` is set when one came."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self.event = threading.Event()
        self._handler: Callable | None = None

    def reinstall(self) -> None:
        """Take the signals back after a library replaced their handlers (``ray.init`` installs its own SIGTERM
        handler, which exits at once or aborts the process)."""
        if self._handler is not None:
            for signum in STOP_SIGNALS:
                signal.signal(signum, self._handler)


def restore_handlers(previous: dict[int, Callable | int | None]) -> None:
    """Put back the handlers ``previous`` maps each signal to (what ``signal.signal`` returned when they were
    replaced); None, a handler installed from C that Python cannot reinstall, becomes the default action."""
    for signum, handler in previous.items():
        signal.signal(signum, handler if handler is not None else signal.SIG_DFL)


@contextlib.contextmanager
def graceful_stop(on_signal: Callable[[int], None] | None = None) -> Iterator[StopRequest]:
    """While the block runs, the first SIGINT/SIGTERM records itself in the yielded StopRequest, sets its event
    and calls ``on_signal(signum)`` (in the main thread, between two Python bytecodes: it must only start the
    stop, never wait for it, or stop at once with :func:`raise_in_ray`); a second one stops at once. A stop at
    once leaves the block as :func:`stop_exception` of its signal. The previous handlers come back on exit.

    Off the main thread (where Python cannot take signals) it installs nothing.
    """
    request = StopRequest()
    raised: list[int] = []  # the signal whose handler raised KeyboardInterrupt to stop at once

    def handle(signum, frame) -> None:
        if request.signum is not None:
            raised.append(signum)
            raise_in_ray(signum)  # a second signal: stop now
        request.signum = signum
        request.event.set()
        if on_signal is not None:
            on_signal(signum)

    if threading.current_thread() is not threading.main_thread():
        yield request
        return
    request._handler = handle
    previous = {signum: signal.signal(signum, handle) for signum in STOP_SIGNALS}
    try:
        yield request
    except KeyboardInterrupt:
        # Raised by the handler (see the module docstring): the exception of the signal it stands for.
        signum = raised[-1] if raised else request.signum
        if signum is None or signum == signal.SIGINT:
            raise
        raise stop_exception(signum) from None
    finally:
        restore_handlers(previous)


@contextlib.contextmanager
def hangup_requests() -> Iterator[threading.Event]:
    """While the block runs, each SIGHUP sets the yielded event instead of ending the process (its default
    action): a server reloads its export when it sees the event (``bigrank.export.reload``), as nginx and
    gunicorn reload on SIGHUP. The previous handler comes back on exit. Off the main thread it installs nothing
    (the event is never set)."""
    requested = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        yield requested
        return
    previous = {signal.SIGHUP: signal.signal(signal.SIGHUP, lambda signum, frame: requested.set())}
    try:
        yield requested
    finally:
        restore_handlers(previous)


@contextlib.contextmanager
def held_stop_signals() -> Iterator[None]:
    """Hold SIGINT/SIGTERM back while the block runs (a few lines that must not be cut in half, such as building an
    asyncio event loop: one interrupted half-way leaves an object whose finaliser prints a traceback); a signal that
    came meanwhile goes to the handler it would have met, once, when the block ends. The handlers are swapped
    rather than the signals masked: a mask is per thread, and another thread would take the signal. Main thread
    only; elsewhere it holds nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    came: list[int] = []
    previous = {signum: signal.signal(signum, lambda signum, frame: came.append(signum)) for signum in STOP_SIGNALS}
    try:
        yield
    finally:
        restore_handlers(previous)
        if came:
            signal.raise_signal(came[0])


# ------------------------------------------------------------------------------- workers: stop at a step boundary
class Stopped(BaseException):
    """A worker's job ended early at the request of signal ``signum``, at a point it resumes from (a training loop
    after its final checkpoint). A BaseException, as KeyboardInterrupt: no ``except Exception`` swallows it."""

    def __init__(self, signum: int = signal.SIGTERM):
        super().__init__(signum)
        self.signum = signum

    def __str__(self) -> str:
        return f"stopped by {signal_name(self.signum)}"


class _DeferredStop(StopRequest):
    """This process's stop request while :func:`step_boundaries` runs (``active``)."""

    def __init__(self) -> None:
        super().__init__()
        self.active = False


_deferred: _DeferredStop | None = None
_stop_file: Path | None = None


class StopFile:
    """A stop request that another process makes by writing a signal's number into ``path`` (atomically), read
    at most every ``interval`` seconds: ``signum`` is None until the file exists. Ray Train's workers never see
    the signals of the command that started them, so that command (the Ray launcher's driver) writes the file."""

    def __init__(self, path: Path, interval: float = 0.5):
        self.path = Path(path)
        self.interval = float(interval)
        self._signum: int | None = None
        self._next_read = 0.0

    @property
    def signum(self) -> int | None:
        if self._signum is None and time.monotonic() >= self._next_read:
            self._next_read = time.monotonic() + self.interval
            try:
                self._signum = int(self.path.read_text())
            except (FileNotFoundError, ValueError):
                pass
        return self._signum


def watch_stop_file(path: Path | None) -> None:
    """In a worker process whose launcher cannot signal it (a Ray Train worker): from now on a job that checks
    for a stop at its step boundaries (:func:`step_boundaries`) reads it from ``path`` (:class:`StopFile`); None
    stops watching."""
    global _stop_file
    _stop_file = None if path is None else Path(path)


def defer_stop_signals() -> None:
    """In a worker process whose launcher forwards SIGINT/SIGTERM to it and enforces a deadline: from now on, while
    a job that checks for them at its step boundaries runs (:func:`step_boundaries`), these signals only record
    themselves, every one of them (a terminal's Ctrl+C and systemd's SIGTERM reach the workers directly and again
    through the launcher: counting them here would take one stop for two). Outside such a job (start-up,
    evaluation, export) a signal ends the process at once by its default action, as before. A signal the process
    ignores stays ignored. Main thread only (Python takes signals there); elsewhere it does nothing."""
    global _deferred
    if threading.current_thread() is not threading.main_thread():
        return
    request = _DeferredStop()

    def handle(signum, frame) -> None:
        if not request.active:  # nothing would look at the request: the default action, now
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        if request.signum is None:
            request.signum = signum
            request.event.set()

    for signum in STOP_SIGNALS:
        if signal.getsignal(signum) is not signal.SIG_IGN:
            signal.signal(signum, handle)
    _deferred = request


@contextlib.contextmanager
def step_boundaries() -> Iterator[StopRequest | StopFile | None]:
    """While the block (a training loop) runs, SIGINT/SIGTERM wait for it in the yielded StopRequest, which the
    loop checks at each step boundary (``signum`` not None: stop). In a process that watches a stop file instead
    (:func:`watch_stop_file`: a Ray Train worker) it yields that :class:`StopFile`. Yields None in a process with
    neither (a test's process): there signals keep their own handling and the loop never stops early."""
    request = _deferred
    if request is None:
        yield None if _stop_file is None else StopFile(_stop_file)
        return
    request.active = True
    try:
        yield request
    finally:
        request.active = False
