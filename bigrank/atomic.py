"""Atomic file writes: write a hidden temporary sibling, then rename it into place (``os.replace``).

A crash or a kill mid-write therefore never leaves a file that looks complete; leftovers are ``.NAME.tmp-PID``
files (``bigrank.data.manifest.remove_stale_temporaries`` deletes them). A file that several processes update
(read, change, write back: ``eval.json``) is updated under :func:`update_lock`, so that none drops another's
change.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

__all__ = ["temporary_path", "update_lock", "write_atomic", "write_json_atomic", "write_text_atomic"]


def temporary_path(path: str | os.PathLike) -> Path:
    """A sibling name for writing ``path`` before the atomic rename (hidden, tagged with the pid)."""
    path = Path(path)
    return path.with_name(f".{path.name}.tmp-{os.getpid()}")


def write_atomic(path: str | os.PathLike, write: Callable[[Path], object]) -> Path:
    """Call ``write(tmp)`` to produce the file at a temporary path, then rename it to ``path``; returns ``path``.
    The temporary file is removed when ``write`` fails."""
    path = Path(path)
    tmp = temporary_path(path)
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def write_text_atomic(path: str | os.PathLike, text: str) -> Path:
    """Write ``text`` to ``path`` atomically."""
    return write_atomic(path, lambda tmp: tmp.write_text(text))


def write_json_atomic(path: str | os.PathLike, payload: Mapping, indent: int = 1) -> Path:
    """Write ``payload`` as indented JSON (with a final newline) to ``path`` atomically."""
    return write_text_atomic(path, json.dumps(payload, indent=indent) + "\n")


@contextlib.contextmanager
def update_lock(path: str | os.PathLike) -> Iterator[None]:
    """Hold an exclusive OS lock (``flock``, waiting for it) for a read-change-write of ``path``, so that
    concurrent updaters take turns. The lock is on the sibling ``.NAME.lock`` (``path`` itself is replaced by
    each write), which stays; the kernel releases the lock when the holder ends, however it ends."""
    path = Path(path)
    fd = os.open(path.with_name(f".{path.name}.lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)
