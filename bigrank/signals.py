"""Graceful stops of the long-running commands that wait on something else (a Tune search, a server, a Ray job).

``graceful_stop(on_signal)`` turns the first SIGINT (Ctrl+C) or SIGTERM (``kill``, a Kubernetes pod's deletion,
systemd) into a call of ``on_signal(signum)`` that starts an orderly stop (Tune checkpoints its state and ends
its trials; a server drains its requests) and records the signal; the command then finishes that stop and
reports it. A second signal while the stop runs raises at once (:func:`raise_for`: KeyboardInterrupt for
SIGINT, :class:`~bigrank.errors.Terminated` for SIGTERM), as torchrun and Ray Tune do on a second Ctrl+C.

``bigrank.cli`` turns those exceptions into exit status 130 / 143 and a line saying how to resume.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterator

from bigrank.errors import Terminated

__all__ = ["STOP_SIGNALS", "StopRequest", "graceful_stop", "raise_for", "signal_name"]

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def signal_name(signum: int) -> str:
    """``"SIGINT"`` / ``"SIGTERM"`` / … of a signal number."""
    return signal.Signals(signum).name


def raise_for(signum: int) -> None:
    """Raise what a stop by ``signum`` raises in bigrank: KeyboardInterrupt (SIGINT) or Terminated (others)."""
    if signum == signal.SIGINT:
        raise KeyboardInterrupt
    raise Terminated(signum)


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

    def raise_if_stopped(self) -> None:
        """:func:`raise_for` the signal that came, if one did."""
        if self.signum is not None:
            raise_for(self.signum)


@contextlib.contextmanager
def graceful_stop(on_signal: Callable[[int], None] | None = None) -> Iterator[StopRequest]:
    """While the block runs, the first SIGINT/SIGTERM records itself in the yielded StopRequest, sets its event
    and calls ``on_signal(signum)`` (in the main thread, between two Python bytecodes: it must only start the
    stop, never wait for it); a second one raises (:func:`raise_for`). The previous handlers come back on exit.

    Off the main thread (where Python cannot take signals) it installs nothing.
    """
    request = StopRequest()

    def handle(signum, frame) -> None:
        if request.signum is not None:
            raise_for(signum)  # a second signal: stop now
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
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
