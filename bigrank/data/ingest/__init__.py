"""``bigrank ingest``: interaction logs (Parquet, CSV/TSV, JSON Lines; MovieLens as a preset) -> a bigrank dataset.

::

    bigrank ingest PATH… --out DIR --user COL --item COL [--time COL [--time-unit auto|s|ms|us|ns]]
                   [--rating COL | --weight COL] [--dedup last|first|sum|max] [--min-rating X]
                   [--min-user-items N] [--min-item-users M]
                   [--split random|last|time] [--fractions 0.8,0.1,0.1] [--valid-from T --test-from T] [--seed S]
                   [--items-file PATH --item-key COL [--items-format F] [--items-delimiter C]]
                   [--vocab-from OLD] [--memory-limit 8GB] [--threads N] [--address RAY]

What it reads: ``bigrank.data.ingest.sources``; the steps: ``bigrank.data.ingest.pipeline``; one machine's engine
is DuckDB (``bigrank.data.ingest.store``: spills to disk under ``--memory-limit``), a cluster's is Ray tasks each
running DuckDB on a bucket of users (``bigrank.data.ingest.cluster``), with the same result.

The dataset (``bigrank.data.manifest``, format 2): ``{train,valid,test}/part-*.parquet`` sorted by
``(user_id, item_id)``; ``users.parquet`` / ``items.parquet`` with ``original_id`` in the source's type (int64 or
string), ``count`` and ``first_seen`` (epoch seconds, when there is a time), the items with the items file's
attributes; the per-user index of each split; ``manifest.json`` last, with an ``ingest`` entry counting what
each step did (``bigrank data-info DIR``). Dense ids are the ranks of the original ids by ``(xxh64, id)``
(``bigrank.data.ingest.hashing``): the same input and options always give the same dataset.

Bad input is a :class:`~bigrank.errors.CommandError` naming the problem (``bigrank`` prints one line, exit status
2) and no manifest is written; SIGINT/SIGTERM stop the engine at once (its stores and every other DuckDB query of
the ingest) and delete what was written (exit status 130/143), once the steps' thread has ended. An ingest killed
outright leaves its ``.ingest`` directory: the same command then starts over; so does one stopped by a third
signal before its steps' thread ended (it may still be writing: nothing is deleted under it).
"""

from __future__ import annotations

import os
import secrets
import shutil
import threading
from pathlib import Path

from bigrank.data.ingest import movielens
from bigrank.data.ingest.options import IngestOptions
from bigrank.data.ingest.pipeline import WORK_DIR, LocalEngine, Progress, clear, prepare_out, run
from bigrank.data.ingest.sources import open_source
from bigrank.data.user_index import write_manifest_with_indexes

__all__ = ["IngestOptions", "ingest"]


def ingest(paths, out, options: IngestOptions | None = None, **settings) -> dict:
    """Ingest the interaction logs at ``paths`` (files, directories, globs; or a MovieLens directory) into the new
    dataset ``out``; returns its manifest. ``options`` (or ``settings``, its fields by name) say what to read and
    how to clean and split it (:class:`IngestOptions`)."""
    options = options or IngestOptions(**settings)
    paths = [paths] if isinstance(paths, str | Path) else list(paths)
    paths, options = movielens.apply_preset(paths, options)
    options = options.check()
    say = Progress(options.progress)
    source = open_source(paths, options.format, options.delimiter, options.header, options.encoding)
    out = Path(out)
    prepare_out(out)
    work = out / WORK_DIR
    if options.temp_dir is not None:  # the stores' databases and spill files elsewhere (a larger or faster disk)
        work = Path(options.temp_dir) / f"bigrank-ingest-{os.getpid()}-{secrets.token_hex(4)}"
    engine = None
    steps = _Steps()
    try:
        work.mkdir(parents=True, exist_ok=True)
        engine = _engine(work, options, say)
        record, split_files, num_users, num_items = steps.run(lambda: run(source, out, options, engine, say), engine)
        engine.close()
        engine = None
        from bigrank.signals import graceful_stop, raise_for

        with graceful_stop(raise_for):  # a signal while the indexes are written stops at once, cleaned up below
            manifest = write_manifest_with_indexes(
                out,
                num_users=num_users,
                num_items=num_items,
                split_files=split_files,
                seed=options.seed,
                source=f"{options.preset or 'ingest'}:{_where(source.files)}",
                generator={
                    "ingest": options.preset or "interactions",
                    "split": options.split,
                    "fractions": list(options.fractions),
                },
                extra={
                    "num_rated_users": num_users,
                    "num_rated_items": num_items,
                    "truth": None,
                    **record.pop("stable_ids", {}),  # parent, lineage, vocabulary (--vocab-from)
                    "ingest": record,
                },
                progress=say,
            )
    except BaseException:
        if steps.running():  # a third signal: the steps may still write; left for the next run to start over
            raise
        if engine is not None:
            engine.close()
        shutil.rmtree(work, ignore_errors=True)
        clear(out)
        raise
    shutil.rmtree(work, ignore_errors=True)
    shutil.rmtree(out / WORK_DIR, ignore_errors=True)
    say(f"done: {out} ({manifest['num_ratings']:,} ratings)")
    return manifest


def _where(files) -> str:
    """The manifest's ``source``: the one input file, or the directory of the first of several."""
    return files[0] if len(files) == 1 else str(Path(files[0]).parent)


def _engine(work: Path, options: IngestOptions, say):
    if options.address is None:
        say(f"DuckDB on this machine: {options.plan()}")
        return LocalEngine(work, options)
    from bigrank.data.ingest.cluster import RayEngine

    return RayEngine(work, options, say)


class _Steps:
    """The ingest's steps in a thread while this (main) thread takes SIGINT/SIGTERM (:meth:`run`)."""

    def __init__(self):
        # Set when the steps' thread ends. Not Thread.join/is_alive: a signal's exception raised inside join() makes
        # CPython 3.11 mark the thread stopped while it still runs (threading._wait_for_tstate_lock, bpo-45274).
        self.done = threading.Event()
        self.started = False

    def running(self) -> bool:
        """Whether the steps' thread is still running (after :meth:`run` raised on a third signal)."""
        return self.started and not self.done.is_set()

    def run(self, work, engine):
        """``work()``, run in a thread: the first signal interrupts the engine (every query of the ingest) and the
        thread ends; then the signal's exception (KeyboardInterrupt / Terminated) is raised here. A second signal
        stops at once, but its exception too is raised only once the thread has ended, so that the caller never
        deletes ``--out`` under a thread still writing there; a third one while it ends raises at once, the thread
        still running (:meth:`running`)."""
        from bigrank.signals import graceful_stop, raise_for

        if threading.current_thread() is not threading.main_thread():
            return work()
        outcome: dict = {}

        def target() -> None:
            try:
                outcome["value"] = work()
            except BaseException as error:  # noqa: BLE001 - handed to the main thread
                outcome["error"] = error
            finally:
                self.done.set()

        thread = threading.Thread(target=target, name="bigrank-ingest", daemon=True)
        with graceful_stop(lambda signum: engine.interrupt()) as stop:
            self.started = True
            thread.start()
            try:
                while not self.done.wait(0.2):
                    pass
            except BaseException:  # the second signal: wait for the thread, then the caller cleans up
                engine.interrupt()
                while not self.done.wait(0.2):
                    pass
                raise
        if stop.signum is not None:
            raise_for(stop.signum)
        if "error" in outcome:
            raise outcome["error"]
        return outcome["value"]
