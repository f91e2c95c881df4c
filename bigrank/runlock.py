"""One writer per run directory: an OS file lock (``flock``) on ``DIR/.lock``, held by the process that launches
the run (``bigrank train``, ``bigrank tune``) for as long as it runs.

The kernel releases the lock when that process ends, however it ends (SIGKILL and the OOM killer included), so
there is never a stale lock to remove by hand. Once it holds the lock, the process writes its host, pid and
command into the file; a second process that finds the directory in use fails at once with
:class:`RunDirectoryInUse` naming them. The file stays when the run ends (deleting a lock file races with a
process about to lock it): its content means something only while it is locked.

The lock is taken with ``O_CLOEXEC``, so the worker processes do not inherit it: it is the launcher's, and the
workers end with it (``bigrank.train.launcher``). On shared storage it needs a file system with working
``flock`` (Linux NFS clients map it to NFS byte-range locks).
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import json
import os
import socket
from collections.abc import Iterator
from pathlib import Path

from bigrank.errors import CommandError

__all__ = ["LOCK_FILE", "RunDirectoryInUse", "hold_run_dir"]

LOCK_FILE = ".lock"


class RunDirectoryInUse(CommandError):
    """Another process holds the run directory's lock; the message names its host, pid and command."""


@contextlib.contextmanager
def hold_run_dir(directory: str | os.PathLike, command: str) -> Iterator[Path]:
    """Hold the lock of ``directory`` (created if missing) while the ``with`` block runs; yields the lock file.

    ``command`` (e.g. ``"bigrank train"``) is written into the lock file with this host and pid, for the error
    of the next process. Raises RunDirectoryInUse at once when another process holds the lock.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / LOCK_FILE
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise RunDirectoryInUse(
                f"{directory} is in use by {_describe(_read_holder(fd))}: one process at a time may write a run "
                f"directory; wait for it to end or stop it (lock file {path})"
            ) from None
        holder = {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "command": command,
            "since": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        }
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(holder) + "\n").encode(), 0)
        yield path
    finally:
        os.close(fd)  # releases the lock


def _read_holder(fd: int) -> dict:
    """What the holder wrote into the lock file; {} while it has not written yet (it writes right after
    locking) or when the content is not ours."""
    try:
        holder = json.loads(os.pread(fd, 4096, 0).decode() or "{}")
    except (ValueError, UnicodeDecodeError):
        return {}
    return holder if isinstance(holder, dict) else {}


def _describe(holder: dict) -> str:
    if not holder.get("pid"):
        return "another process (it has not written its name into the lock file yet)"
    command = holder.get("command") or "a process"
    since = f", since {holder['since']}" if holder.get("since") else ""
    return f"{command} (pid {holder['pid']} on host {holder.get('host', '?')}{since})"
