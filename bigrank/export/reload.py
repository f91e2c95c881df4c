"""Serving a new export without downtime: which export to serve, and the reload that swaps a new one in.

Both servers (``bigrank serve`` and ``bigrank serve --ray``) serve from an :class:`ExportSource`:

* one export directory (``bigrank serve EXPORT``): SIGHUP reloads it as it is now. A daily job writes each
  export into a new directory, points a symlink at it (``ln -sfn exports/2024-06-02 exports/current``, with
  ``bigrank serve exports/current``) and sends SIGHUP;
* a watched directory of exports (``bigrank serve --watch DIR``): every ``--watch-interval`` seconds, and on
  SIGHUP, the server looks for the newest export in it and serves it. An export is a subdirectory whose
  ``manifest.json`` is a bigrank export's (``bigrank export`` writes the manifest last, so an export still being
  written is not one yet). *Newest* is the largest ``created_unix`` of the manifest (when ``bigrank export``
  finished; copying a directory keeps it, unlike a file's mtime), then the largest name. Deleting the newest
  export rolls back to the one before it.

A reload (:class:`Reloader`) runs in a thread of its own while the old export keeps answering: it loads the new
export beside the old one and checks every file against the manifest's sha256 checksums (unless
``--no-verify``), then the server swaps it in (``install``). An export that fails to load is refused with one
log line naming it and the error, and the old one keeps serving; a watched directory does not try a refused
export again until its manifest changes (a new export written into the same directory), and then tries the
newest export it has not refused. The export served is known by its id (``bigrank.export.format.export_id``:
a fingerprint of its manifest), which ``/health`` reports. While a reload runs, the server holds both exports
in memory.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from bigrank.export.format import MANIFEST_NAME, export_id, read_export_manifest

# How often a watched directory is scanned: a few small JSON reads, cheap next to a day between exports.
WATCH_INTERVAL_S = 5.0


@dataclass(frozen=True)
class Candidate:
    """An export that could be served: its directory, id (``export_id``) and ``created_unix``."""

    path: Path
    export_id: str
    created_unix: float


def read_candidate(path: Path) -> Candidate:
    """The :class:`Candidate` of the export directory ``path``; FileNotFoundError / ValueError when it has no
    readable bigrank export manifest (``read_export_manifest``)."""
    manifest = read_export_manifest(path)
    return Candidate(Path(path), export_id(manifest), float(manifest.get("created_unix") or 0.0))


def watched_exports(watch_dir: Path) -> list[Candidate]:
    """The complete exports in ``watch_dir`` (subdirectories with a bigrank export manifest), newest first:
    by ``created_unix``, then by name. Directories without one (an export being written, anything else) are
    skipped."""
    found = []
    for path in Path(watch_dir).iterdir():
        if not (path / MANIFEST_NAME).is_file():
            continue
        try:
            found.append(read_candidate(path))
        except (OSError, ValueError):  # another kind of manifest, or one being replaced right now
            continue
    return sorted(found, key=lambda c: (c.created_unix, c.path.name), reverse=True)


class ExportSource:
    """Where the served export comes from: one directory (``export``) or the newest export in ``watch``."""

    def __init__(self, export: str | Path | None = None, watch: str | Path | None = None):
        if (export is None) == (watch is None):
            raise ValueError("give an export directory or --watch DIR (a directory of exports), not both")
        self.export = Path(export) if export is not None else None
        self.watch = Path(watch) if watch is not None else None
        if self.watch is not None and not self.watch.is_dir():
            raise FileNotFoundError(f"--watch: no directory {self.watch}")

    def __str__(self) -> str:
        return str(self.export) if self.export is not None else f"the newest export in {self.watch}"

    def candidates(self, refused: set[str] = frozenset()) -> list[Candidate]:
        """The exports to try, best first, leaving out the ids in ``refused`` (watched directory). One export
        directory: that directory as it is now (FileNotFoundError / ValueError without a readable manifest)."""
        if self.export is not None:
            return [read_candidate(self.export)]
        return [c for c in watched_exports(self.watch) if c.export_id not in refused]


def log(message: str) -> None:
    """One line on stderr, prefixed as every line of ``bigrank serve``."""
    print(f"bigrank serve: {message}", file=sys.stderr, flush=True)


def first_export(source: ExportSource, load: Callable[[Path], object]) -> tuple[Candidate, object]:
    """At start: ``(candidate, load(candidate.path))`` of the first candidate of ``source`` that loads (a watched
    directory: newest first, each refusal logged). Raises the error of the export given, or FileNotFoundError
    when a watched directory holds no export that loads."""
    if source.export is not None:
        candidate = source.candidates()[0]
        return candidate, load(candidate.path)
    for candidate in source.candidates():
        try:
            return candidate, load(candidate.path)
        except (OSError, ValueError) as error:
            log(f"refused {candidate.path} (export id {candidate.export_id}): {error}")
    raise FileNotFoundError(f"--watch: no complete export that loads in {source.watch}")


class Reloader:
    """Reloads the served export on request (SIGHUP) or when a watched directory has a newer one.

    ``install(path)`` loads and verifies the export at ``path`` beside the served one and swaps it in, returning
    the id of the export now served, or raises (OSError / ValueError / RuntimeError) to refuse it; the old
    export then keeps serving. ``live`` is the candidate served now. Call :meth:`poll` from the serving loop;
    it starts at most one reload thread at a time (a SIGHUP during a reload is kept for the next one).
    """

    def __init__(
        self,
        source: ExportSource,
        install: Callable[[Path], str],
        live: Candidate,
        interval: float = WATCH_INTERVAL_S,
    ):
        self.source = source
        self.install = install
        self.live = live
        self.interval = float(interval)
        self.refused: set[str] = set()
        self.reloads = 0  # swaps done: for the serving loop's tests and logs
        self._thread: threading.Thread | None = None
        self._next_scan = time.monotonic() + self.interval

    def poll(self, hangup: threading.Event) -> None:
        """Start a reload when ``hangup`` is set (and clear it) or the watch interval is over, unless one runs."""
        if self._thread is not None and self._thread.is_alive():
            return
        asked = hangup.is_set()
        due = self.source.watch is not None and time.monotonic() >= self._next_scan
        if not (asked or due):
            return
        hangup.clear()
        self._next_scan = time.monotonic() + self.interval
        self._thread = threading.Thread(
            target=self.reload, args=("SIGHUP" if asked else "watch",), name="bigrank-reload", daemon=True
        )
        self._thread.start()

    def join(self, timeout: float | None = None) -> None:
        """Wait for the reload in progress, if any."""
        if self._thread is not None:
            self._thread.join(timeout)

    def reload(self, reason: str) -> bool:
        """Serve the export the source points to now, if it is another one: True when it was swapped in."""
        try:
            candidates = self.source.candidates(self.refused)
        except (OSError, ValueError) as error:
            log(f"{reason}: refused {self.source}: {error}; still serving {self._live_text()}")
            return False
        for candidate in candidates:
            if candidate.export_id == self.live.export_id:
                if reason == "SIGHUP":
                    log(f"SIGHUP: {candidate.path} is the export served (id {candidate.export_id}); nothing to do")
                return False
            if self._swap(reason, candidate):
                return True
        return False

    def _swap(self, reason: str, candidate: Candidate) -> bool:
        log(f"{reason}: loading {candidate.path} (export id {candidate.export_id}) beside {self._live_text()}")
        started = time.monotonic()
        try:
            served_id = self.install(candidate.path)
        except (OSError, ValueError, RuntimeError) as error:
            self.refused.add(candidate.export_id)
            still = self._live_text()
            log(f"refused {candidate.path} (export id {candidate.export_id}): {error}; still serving {still}")
            return False
        retired = self._live_text()
        self.live = Candidate(candidate.path, served_id, candidate.created_unix)
        self.reloads += 1
        log(f"now serving {self._live_text()} (loaded in {time.monotonic() - started:.1f} s) instead of {retired}")
        return True

    def _live_text(self) -> str:
        return f"{self.live.path} (export id {self.live.export_id})"
