"""Serving a new export without downtime: which export to serve, and the reload that swaps a new one in.

Both servers (``bigrank serve`` and ``bigrank serve --ray``) serve from an :class:`ExportSource`:

* one export directory (``bigrank serve EXPORT``): SIGHUP reloads it as it is now. A daily job writes each
  export into a new directory, points a symlink at it (``ln -sfn exports/2024-06-02 exports/current``, with
  ``bigrank serve exports/current``) and sends SIGHUP. The path is resolved once a reload (at start too): the
  export served is the directory the link named then, by its real path, and everything that loads it later
  (``serve --ray``'s replicas, started by an autoscaler or after a crash) loads that directory, not whatever the
  link names by then;
* a watched directory of exports (``bigrank serve --watch DIR``): every ``--watch-interval`` seconds, and on
  SIGHUP, the server looks for the newest export in it and serves it. An export is a subdirectory whose
  ``manifest.json`` is a bigrank export's (``bigrank export`` writes the manifest last, so an export still being
  written is not one yet). *Newest* is the largest ``created_unix`` of the manifest (when ``bigrank export``
  finished; copying a directory keeps it, unlike a file's mtime), then the largest name. Deleting the newest
  export rolls back to the one before it.

A reload (:class:`Reloader`) runs in a thread of its own while the old export keeps answering: it loads the new
export beside the old one and checks every file against the manifest's sha256 checksums (unless
``--no-verify``), then the server swaps it in (``install``). An export that fails to load is refused with one
log line naming it and the error, and the old one keeps serving. A verification or format error (a checksum, a
manifest, a file it lists missing or malformed: ValueError, FileNotFoundError) refuses it for good: a watched
directory does not try it again until its manifest changes (a new export written into the same directory), and
then tries the newest export it has not refused. Any other failure (out of memory, a Ray Serve deployment that
timed out, a read error) is taken as transient: the export is tried again after ``RETRY_FIRST_S`` seconds, the
wait doubling on each failure up to ``RETRY_MAX_S``, and SIGHUP tries it at once. The export served is known
by its id (``bigrank.export.format.export_id``: a fingerprint of its manifest), which ``/health`` reports. While
a reload runs, the server holds both exports in memory.
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
# After a transient failure an export is tried again after RETRY_FIRST_S seconds, then twice as long after each
# further failure, RETRY_MAX_S at most (a full load and verification of an ML-1B export takes minutes).
RETRY_FIRST_S = 5.0
RETRY_MAX_S = 300.0
# Errors that say the export itself is bad (a checksum, the manifest, a listed file missing or malformed): it is
# refused for good. Anything else may pass (memory, a deployment timeout) and is tried again later.
REFUSED_FOR_GOOD = (ValueError, FileNotFoundError)


@dataclass(frozen=True)
class Candidate:
    """An export that could be served: its directory, id (``export_id``) and ``created_unix``."""

    path: Path
    export_id: str
    created_unix: float


def read_candidate(path: Path) -> Candidate:
    """The :class:`Candidate` of the export directory ``path``, by its real path (symlinks resolved once, here:
    the id read and the directory loaded are the same export whatever the links name later); FileNotFoundError /
    ValueError when it has no readable bigrank export manifest (``read_export_manifest``)."""
    path = Path(path).resolve()
    manifest = read_export_manifest(path)
    return Candidate(path, export_id(manifest), float(manifest.get("created_unix") or 0.0))


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
    the id of the export now served, or raises to refuse it; the old export then keeps serving. ``live`` is the
    candidate served now. Call :meth:`poll` from the serving loop; it starts at most one reload thread at a time
    (a SIGHUP during a reload is kept for the next one). A refusal is for good on ``REFUSED_FOR_GOOD`` errors;
    after any other the export is tried again, ``retry_first`` seconds later (default ``RETRY_FIRST_S``), the
    wait doubling up to ``retry_max`` (``RETRY_MAX_S``; module docstring).
    """

    def __init__(
        self,
        source: ExportSource,
        install: Callable[[Path], str],
        live: Candidate,
        interval: float = WATCH_INTERVAL_S,
        retry_first: float | None = None,
        retry_max: float | None = None,
    ):
        self.source = source
        self.install = install
        self.live = live
        self.interval = float(interval)
        self.retry_first = float(RETRY_FIRST_S if retry_first is None else retry_first)
        self.retry_max = float(RETRY_MAX_S if retry_max is None else retry_max)
        self.refused: set[str] = set()
        self.backoff: dict[str, tuple[int, float]] = {}  # export id -> (transient failures, when to try again)
        self.reloads = 0  # swaps done: for the serving loop's tests and logs
        self._thread: threading.Thread | None = None
        self._next_scan = time.monotonic() + self.interval

    def poll(self, hangup: threading.Event) -> None:
        """Start a reload when ``hangup`` is set (and clear it), the watch interval is over or a retry is due,
        unless one runs."""
        if self._thread is not None and self._thread.is_alive():
            return
        now = time.monotonic()
        asked = hangup.is_set()
        due = self.source.watch is not None and now >= self._next_scan
        retry = any(when <= now for _, when in self.backoff.values())
        if not (asked or due or retry):
            return
        hangup.clear()
        if due:
            self._next_scan = now + self.interval
        reason = "SIGHUP" if asked else "watch" if due else "retry"
        self._thread = threading.Thread(target=self.reload, args=(reason,), name="bigrank-reload", daemon=True)
        self._thread.start()

    def join(self, timeout: float | None = None) -> None:
        """Wait for the reload in progress, if any."""
        if self._thread is not None:
            self._thread.join(timeout)

    def reload(self, reason: str) -> bool:
        """Serve the export the source points to now, if it is another one: True when it was swapped in. An
        export waiting for its retry is passed over, except on SIGHUP."""
        try:
            candidates = self.source.candidates(self.refused)
        except (OSError, ValueError) as error:
            log(f"{reason}: refused {self.source}: {error}; still serving {self._live_text()}")
            return False
        ahead = []  # the candidates better than the export served: the ones to try
        for candidate in candidates:
            if candidate.export_id == self.live.export_id:
                break
            ahead.append(candidate)
        # Retries only for exports still ahead (not deleted, not passed by the link or by the export served).
        self.backoff = {c.export_id: self.backoff[c.export_id] for c in ahead if c.export_id in self.backoff}
        if not ahead and candidates and reason == "SIGHUP":
            served = candidates[0]
            log(f"SIGHUP: {served.path} is the export served (id {served.export_id}); nothing to do")
        for candidate in ahead:
            _, when = self.backoff.get(candidate.export_id, (0, 0.0))
            if reason != "SIGHUP" and time.monotonic() < when:
                continue
            if self._swap(reason, candidate):
                return True
        return False

    def _swap(self, reason: str, candidate: Candidate) -> bool:
        log(f"{reason}: loading {candidate.path} (export id {candidate.export_id}) beside {self._live_text()}")
        started = time.monotonic()
        try:
            served_id = self.install(candidate.path)
        except Exception as error:  # noqa: BLE001 - every failure is logged; the served export keeps serving
            still = self._live_text()
            name = f"{candidate.path} (export id {candidate.export_id})"
            if isinstance(error, REFUSED_FOR_GOOD):
                self.backoff.pop(candidate.export_id, None)
                self.refused.add(candidate.export_id)
                log(f"refused {name}: {error}; still serving {still}")
                return False
            failures = self.backoff.get(candidate.export_id, (0, 0.0))[0] + 1
            wait = min(self.retry_first * 2 ** (failures - 1), self.retry_max)
            self.backoff[candidate.export_id] = (failures, time.monotonic() + wait)
            log(
                f"could not load {name} ({type(error).__name__}: {error}; failure {failures}, taken as transient): "
                f"trying again in {wait:g} s; still serving {still}"
            )
            return False
        retired = self._live_text()
        self.backoff.pop(candidate.export_id, None)
        self.live = Candidate(candidate.path, served_id, candidate.created_unix)
        self.reloads += 1
        log(f"now serving {self._live_text()} (loaded in {time.monotonic() - started:.1f} s) instead of {retired}")
        return True

    def _live_text(self) -> str:
        return f"{self.live.path} (export id {self.live.export_id})"
