"""Stopping an ingest (issue 48 item 9): one interrupt reaches every DuckDB connection of the ingest, and a second
Ctrl+C cleans ``--out`` only once the steps' thread has ended.

Real DuckDB connections and queries, real signals sent to this process (pytest runs tests in the main thread,
where Python takes them).
"""

from __future__ import annotations

import os
import signal
import threading
import time

import duckdb
import pytest

from bigrank.data.ingest import _Steps
from bigrank.data.ingest.options import IngestOptions
from bigrank.data.ingest.pipeline import Interrupted, LocalEngine, locate_bad_row
from bigrank.data.ingest.sources import open_source
from bigrank.data.ingest.store import Columns

# A query that runs for minutes unless interrupted.
ENDLESS = "SELECT sum(hash(range)) FROM range(1000000000000)"


def _until(condition, what: str, seconds: float = 60.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.01)


def _in_thread(function) -> tuple[threading.Thread, dict]:
    outcome: dict = {}

    def target() -> None:
        try:
            outcome["value"] = function()
        except BaseException as error:  # noqa: BLE001 - checked by the test
            outcome["error"] = error

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread, outcome


def test_one_interrupt_reaches_the_side_connections_and_no_new_one_opens(tmp_path):
    """locate_bad_row (the error path's scan of the files, on its own connection) stops at the engine's interrupt,
    as the stores' queries do; a connection asked for afterwards is refused."""
    engine = LocalEngine(tmp_path / "work", IngestOptions(user="user", item="item"))
    log = tmp_path / "log.csv"
    with log.open("w") as handle:  # 4M good rows, then one whose rating does not parse
        handle.write("user,item,rating\n")
        for block in range(40):
            handle.write("".join(f"u{k},i{k % 977},4\n" for k in range(block * 100_000, (block + 1) * 100_000)))
        handle.write("late,i1,not-a-number\n")
    columns = Columns(open_source([log]), "user", "item", None, "rating", "s")
    thread, outcome = _in_thread(lambda: locate_bad_row(columns.source, columns, "value", engine.side))
    _until(lambda: engine.side._open or not thread.is_alive(), "the side connection")
    engine.interrupt()
    thread.join(60)
    assert not thread.is_alive()
    assert isinstance(outcome.get("error"), duckdb.InterruptException | Interrupted), outcome  # not the row
    with pytest.raises(Interrupted), engine.side.connect():
        pass
    engine.close()


def test_a_second_signal_raises_only_once_the_steps_thread_has_ended(tmp_path):
    """The steps run a query on the engine's store; the first SIGINT interrupts it and the steps then take a
    moment to finish writing (as a part being written would); a second SIGINT comes meanwhile. Its
    KeyboardInterrupt reaches the caller (who then deletes --out) only after the steps wrote their last byte."""
    engine = LocalEngine(tmp_path / "work", IngestOptions(user="user", item="item"))
    written = tmp_path / "written"
    started = threading.Event()

    def steps():
        started.set()
        try:
            engine.stores[0].con.execute(ENDLESS).fetchall()
        finally:
            time.sleep(0.5)  # what a writer does after the stop: finish its file
            written.write_text("the last part")

    def signals() -> None:
        started.wait(60)
        time.sleep(0.2)  # the query is running
        os.kill(os.getpid(), signal.SIGINT)
        _until(lambda: engine.stopped, "the first signal's interrupt")
        os.kill(os.getpid(), signal.SIGINT)

    sender = threading.Thread(target=signals, daemon=True)
    sender.start()
    runner = _Steps()
    with pytest.raises(KeyboardInterrupt):
        runner.run(steps, engine)
    assert written.read_text() == "the last part" and not runner.running()
    sender.join(60)
    engine.close()
