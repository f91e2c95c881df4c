"""A new export served without downtime (``bigrank.export.reload``): real ``bigrank serve`` processes, real HTTP,
real SIGHUP. A SIGHUP swaps to the export the served path points to now, a watched directory's newest export is
picked up, a damaged export is refused while the old one keeps answering, and every request made through the
swaps is answered, each with the exact top-k of the export that answered it."""

from __future__ import annotations

import json
import shutil
import signal
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from bigrank.export import reload
from bigrank.export.format import MANIFEST_NAME, export_id
from bigrank.export.reload import ExportSource, Reloader, first_export, read_candidate, watched_exports
from tests.helpers import (
    HANG_GUARD_S,
    assert_ends,
    kill_group,
    random_tables,
    start_command,
    wait_for_line,
    write_export,
)

ITEMS, USERS, K = 300, 40, 5


def make_export(out: Path, seed: int) -> dict:
    """An export of random tables drawn with ``seed`` (no dataset: dense ids); returns the tables and its id."""
    tables = random_tables(ITEMS, USERS, seed=seed)
    manifest = write_export(out, tables, history=False)
    return {"path": out, "id": export_id(manifest), "items": tables["items"].numpy(), "users": tables["users"].numpy()}


def top_k(export: dict, user: int) -> list[int]:
    """Numpy brute force: the top-K item ids of ``user`` in ``export``."""
    scores = export["items"] @ export["users"][user]
    return np.argsort(-scores, kind="stable")[:K].tolist()


def damaged_copy(export: dict, out: Path) -> Path:
    """A copy of ``export`` at ``out`` with one byte of its items part flipped (same size: only the sha256
    tells)."""
    shutil.copytree(export["path"], out)
    part = out / json.loads((out / MANIFEST_NAME).read_text())["tables"]["items"]["parts"][0]["file"]
    data = bytearray(part.read_bytes())
    data[len(data) // 2] ^= 0xFF
    part.write_bytes(bytes(data))
    return out


def get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=30) as response:
        assert response.status == 200
        return json.loads(response.read())


def wait_until(condition, what: str, proc, log: Path) -> None:
    deadline = time.monotonic() + HANG_GUARD_S
    while not condition():
        if proc.poll() is not None or time.monotonic() > deadline:
            pytest.fail(f"{what} (exit status {proc.returncode}):\n{log.read_text()}")
        time.sleep(0.05)


class Clients:
    """Threads that ask for the top-K of every user in turn until stopped, recording ``(user, reply or error)``."""

    def __init__(self, url: str, count: int = 3):
        self.url, self.answers, self._stop = url, [], threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(offset,)) for offset in range(count)]

    def _run(self, offset: int) -> None:
        user = offset
        while not self._stop.is_set():
            try:
                reply = get(f"{self.url}/recommend?user={user % USERS}&k={K}")
            except Exception as error:  # noqa: BLE001 - every failure is recorded, and the test fails on it
                reply = f"{type(error).__name__}: {error}"
            self.answers.append((user % USERS, reply))
            user += 1

    def __enter__(self) -> Clients:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=60)

    def check(self, exports: list[dict]) -> None:
        """Every request was answered with the exact top-K of one of ``exports``."""
        failed = [reply for _, reply in self.answers if isinstance(reply, str)]
        assert not failed, failed[:5]
        for user, reply in self.answers:
            assert [row["item_id"] for row in reply["items"]] in [top_k(export, user) for export in exports]


def served_port(proc, log: Path) -> int:
    wait_for_line(proc, log, "/recommend?user=0")
    line = next(line for line in log.read_text().splitlines() if "/recommend?user=0" in line)
    return int(line.split("http://127.0.0.1:", 1)[1].split("/", 1)[0])


def point_and_hangup(proc, current: Path, target) -> None:
    """Move the served symlink ``current`` to ``target`` and send SIGHUP (the reload of ``bigrank serve``)."""
    current.unlink()
    current.symlink_to(target)
    proc.send_signal(signal.SIGHUP)


def refuse_damaged(proc, log: Path, current: Path, damaged: Path, clients) -> None:
    """Point ``current`` at ``damaged`` after 20 answers, SIGHUP, and wait for the refusal in the log."""
    wait_until(lambda: len(clients.answers) >= 20, "no answers", proc, log)
    point_and_hangup(proc, current, damaged)
    wait_until(lambda: "refused" in log.read_text(), "no refusal of the damaged export", proc, log)
    assert "does not match its sha256" in log.read_text()


def test_sighup_swaps_to_the_new_export_refuses_a_damaged_one_and_drops_no_request(tmp_path):
    """``bigrank serve exports/current`` (a symlink): the link moved to a damaged export and SIGHUP: refused, the
    old export keeps answering; moved to a good one and SIGHUP: swapped in, /health names it and the answers are
    its brute-force top-K. Clients ask all along, and every one of their requests is answered."""
    old, new = make_export(tmp_path / "day1", seed=1), make_export(tmp_path / "day2", seed=2)
    damaged = damaged_copy(new, tmp_path / "day2-damaged")
    current = tmp_path / "current"
    current.symlink_to(old["path"])
    log = tmp_path / "serve.log"
    proc = start_command(log, "serve", str(current), "--port", "0", "--quiet")
    try:
        url = f"http://127.0.0.1:{served_port(proc, log)}"
        assert get(f"{url}/health")["export_id"] == old["id"]
        with Clients(url) as clients:
            refuse_damaged(proc, log, current, damaged, clients)
            assert "still serving" in log.read_text()
            assert get(f"{url}/health")["export_id"] == old["id"]
            refused_at = len(clients.answers)
            wait_until(lambda: len(clients.answers) >= refused_at + 20, "no answers after the refusal", proc, log)

            point_and_hangup(proc, current, new["path"])
            wait_until(lambda: get(f"{url}/health")["export_id"] == new["id"], "no swap", proc, log)
            swapped_at = len(clients.answers)
            wait_until(lambda: len(clients.answers) >= swapped_at + 20, "no answers after the swap", proc, log)
        clients.check([old, new])
        # A request that starts after the swap is answered from the new export, for every user.
        for user in range(USERS):
            assert [row["item_id"] for row in get(f"{url}/recommend?user={user}&k={K}")["items"]] == top_k(new, user)
        assert f"now serving {new['path']} (export id {new['id']})" in log.read_text()  # the link, resolved
        proc.send_signal(signal.SIGTERM)  # the stop signals still drain and exit 0
        assert_ends(proc, log, 0, reaps_children=True)
    finally:
        kill_group(proc.pid)


def test_a_watched_directory_serves_its_newest_export_and_skips_a_damaged_one(tmp_path):
    """``bigrank serve --watch DIR``: it starts on the newest of two exports, swaps to a newer one moved in, refuses
    a still newer damaged one (the newer good one keeps serving), and rolls back when the served one is deleted."""
    watched = tmp_path / "exports"
    watched.mkdir()
    first, second = make_export(watched / "a", seed=1), make_export(watched / "b", seed=2)
    log = tmp_path / "serve.log"
    proc = start_command(log, "serve", "--watch", str(watched), "--watch-interval", "0.2", "--port", "0", "--quiet")
    try:
        url = f"http://127.0.0.1:{served_port(proc, log)}"
        assert get(f"{url}/health")["export_id"] == second["id"]  # b: written after a
        with Clients(url) as clients:
            third = make_export(tmp_path / "c", seed=3)  # written elsewhere, then moved in whole
            (tmp_path / "c").rename(watched / "c")
            third["path"] = watched / "c"
            wait_until(lambda: get(f"{url}/health")["export_id"] == third["id"], "no swap to c", proc, log)
            damaged_copy(make_export(tmp_path / "d-source", seed=4), tmp_path / "d").rename(watched / "d")
            wait_until(lambda: "refused" in log.read_text(), "no refusal of d", proc, log)
            assert f"refused {watched / 'd'}" in log.read_text()
            time.sleep(1.0)  # several scans: d is not tried again, c keeps serving
            assert log.read_text().count("refused") == 1 and get(f"{url}/health")["export_id"] == third["id"]
            shutil.rmtree(watched / "c")  # rolled back: b is the newest export that loads
            wait_until(lambda: get(f"{url}/health")["export_id"] == second["id"], "no roll back to b", proc, log)
        clients.check([first, second, third])
        proc.send_signal(signal.SIGTERM)
        assert_ends(proc, log, 0, reaps_children=True)
    finally:
        kill_group(proc.pid)


def test_watched_exports_are_newest_first_and_skip_incomplete_ones(tmp_path):
    """Newest by the manifest's created_unix (not the name), then the name; a directory without a manifest (an
    export being written) or with another kind of manifest is no export."""
    write = {"x-old": 100.0, "a-new": 300.0, "b-tie": 200.0, "c-tie": 200.0}
    for name, created in write.items():
        make_export(tmp_path / name, seed=0)
        path = tmp_path / name / MANIFEST_NAME
        path.write_text(json.dumps(json.loads(path.read_text()) | {"created_unix": created}))
    (tmp_path / "being-written").mkdir()
    (tmp_path / "dataset").mkdir()
    (tmp_path / "dataset" / MANIFEST_NAME).write_text(json.dumps({"kind": "dataset"}))
    assert [c.path.name for c in watched_exports(tmp_path)] == ["a-new", "c-tie", "b-tie", "x-old"]


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:Using extra keyword arguments on `Field`")
def test_serve_ray_rolls_to_the_new_export_on_sighup_and_refuses_a_damaged_one(tmp_path):
    """`bigrank serve --ray` (embedded Ray, HAProxy): SIGHUP with a damaged export is refused before any replica is
    replaced; with a good one, a rolling update (new replica up before the old one stops) moves /health and the
    answers to it, and no request of the clients streaming meanwhile fails."""
    from bigrank.train.launcher import free_port

    old, new = make_export(tmp_path / "day1", seed=1), make_export(tmp_path / "day2", seed=2)
    damaged = damaged_copy(new, tmp_path / "day2-damaged")
    current = tmp_path / "current"
    current.symlink_to(old["path"])
    log, port = tmp_path / "serve-ray.log", free_port()
    proc = start_command(log, "serve", str(current), "--ray", "--port", str(port), "--replica-cpus", "0.5")
    try:
        wait_for_line(proc, log, "/recommend?user=0", timeout=300)
        url = f"http://127.0.0.1:{port}"
        assert get(f"{url}/health")["export_id"] == old["id"]
        with Clients(url) as clients:
            refuse_damaged(proc, log, current, damaged, clients)
            point_and_hangup(proc, current, new["path"])
            wait_until(lambda: "now serving" in log.read_text(), "no rolling update", proc, log)
            assert get(f"{url}/health")["export_id"] == new["id"]
            swapped_at = len(clients.answers)
            wait_until(lambda: len(clients.answers) >= swapped_at + 20, "no answers after the update", proc, log)
        clients.check([old, new])
        for user in range(0, USERS, 7):
            assert [row["item_id"] for row in get(f"{url}/recommend?user={user}&k={K}")["items"]] == top_k(new, user)
        proc.send_signal(signal.SIGTERM)
        assert_ends(proc, log, 0, session=True)
    finally:
        kill_group(proc.pid)


# ----------------------------------------------------------------------------- the first load, held open
# ``bigrank serve`` whose first export load waits until the file GATE exists (it touches GATE.loading when it
# starts waiting): a real process and real signals, with the load held open as a large export's checksums hold it.
SLOW_FIRST_LOAD = """
import pathlib, sys, time
import bigrank.cli.export as commands
from bigrank.cli import main

gate, real = pathlib.Path(sys.argv[1]), commands._recommender

def first_load_waits(args, export=None):
    if not gate.exists():
        pathlib.Path(str(gate) + ".loading").touch()
        while not gate.exists():
            time.sleep(0.02)
    return real(args, export)

commands._recommender = first_load_waits
sys.argv = ["bigrank", *sys.argv[2:]]
sys.exit(main())
"""


def serve_with_a_held_first_load(tmp_path: Path):
    """``bigrank serve current`` (a link to day1; day2 beside it) whose first load has begun and waits for
    ``gate`` to exist: ``(old, new, current, proc, log, gate)``."""
    old, new = make_export(tmp_path / "day1", seed=1), make_export(tmp_path / "day2", seed=2)
    current = tmp_path / "current"
    current.symlink_to(old["path"])
    script, gate, log = tmp_path / "slow_first_load.py", tmp_path / "gate", tmp_path / "serve.log"
    script.write_text(SLOW_FIRST_LOAD)
    args = (str(gate), "serve", str(current), "--port", "0", "--quiet")
    proc = start_command(log, *args, runner=(str(script),))
    wait_until(lambda: Path(f"{gate}.loading").exists(), "the first load did not start", proc, log)
    return old, new, current, proc, log, gate


def test_a_sighup_during_the_first_load_is_kept_and_reloads_once_serving(tmp_path):
    """The link moves while the first export loads, and SIGHUP comes: the process lives on, serves the export the
    link named when the load began (resolved once), then honours the SIGHUP and swaps to the new one."""
    old, new, current, proc, log, gate = serve_with_a_held_first_load(tmp_path)
    try:
        point_and_hangup(proc, current, new["path"])
        time.sleep(0.5)  # the signal has landed: the process must still run
        assert proc.poll() is None, f"SIGHUP during the first load ended the process:\n{log.read_text()}"
        gate.touch()
        url = f"http://127.0.0.1:{served_port(proc, log)}"
        assert f"serving {old['path']} (" in log.read_text()  # what the link named when the load began
        wait_until(lambda: get(f"{url}/health")["export_id"] == new["id"], "the kept SIGHUP did not reload", proc, log)
        assert f"SIGHUP: loading {new['path']} (export id {new['id']})" in log.read_text()
        proc.send_signal(signal.SIGTERM)
        assert_ends(proc, log, 0, reaps_children=True)
    finally:
        kill_group(proc.pid)


def test_the_export_served_is_the_one_the_link_named_when_its_load_began(tmp_path):
    """No SIGHUP: the link moves while the first export loads. The server serves the export whose id it read (the
    link's target then), and names it; a later SIGHUP then swaps to the new target."""
    old, new, current, proc, log, gate = serve_with_a_held_first_load(tmp_path)
    try:
        current.unlink()
        current.symlink_to(new["path"])
        gate.touch()
        url = f"http://127.0.0.1:{served_port(proc, log)}"
        assert get(f"{url}/health")["export_id"] == old["id"]
        assert f"export id {old['id']}; SIGHUP reloads" in log.read_text()
        proc.send_signal(signal.SIGHUP)
        wait_until(lambda: get(f"{url}/health")["export_id"] == new["id"], "no swap on SIGHUP", proc, log)
        proc.send_signal(signal.SIGTERM)
        assert_ends(proc, log, 0, reaps_children=True)
    finally:
        kill_group(proc.pid)


# ---------------------------------------------------------------------- the Reloader: paths, refusals, retries
class Installs:
    """An ``install`` for a :class:`Reloader` that reads the export's manifest (its id, as the servers return it)
    and records each path it was given; ``failures`` lists errors to raise first, one a call."""

    def __init__(self, *failures: BaseException):
        self.paths: list[Path] = []
        self.failures = list(failures)

    def __call__(self, path: Path) -> str:
        self.paths.append(Path(path))
        if self.failures:
            raise self.failures.pop(0)
        return read_candidate(path).export_id


def poll_until(reloader: Reloader, condition, hangup: threading.Event | None = None, seconds: float = 30) -> bool:
    """Drive ``reloader`` as a serving loop does until ``condition()`` or ``seconds`` (a hang guard) pass."""
    hangup = hangup if hangup is not None else threading.Event()
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        reloader.poll(hangup)
        reloader.join()
        time.sleep(0.01)
    return condition()


def test_a_link_is_resolved_once_a_reload_and_install_gets_the_real_directory(tmp_path):
    """What ``serve --ray`` deploys (``install``'s path: every replica, also one started later by an autoscaler or
    after a crash, loads it) is the directory the link named when the reload read its id, not the link."""
    old, new = make_export(tmp_path / "day1", seed=1), make_export(tmp_path / "day2", seed=2)
    current = tmp_path / "current"
    current.symlink_to(old["path"])
    source = ExportSource(current)
    live, loaded = first_export(source, lambda path: Path(path))
    assert live.path == loaded == old["path"].resolve() and live.export_id == old["id"]
    installs = Installs()
    reloader = Reloader(source, installs, live)
    current.unlink()
    current.symlink_to(new["path"])
    hangup = threading.Event()
    hangup.set()
    assert poll_until(reloader, lambda: reloader.reloads == 1, hangup)
    current.unlink()
    current.symlink_to(old["path"])  # moved on after the reload: what was deployed stays the real directory
    assert installs.paths == [new["path"].resolve()] and reloader.live.path == new["path"].resolve()


def watching_one_export(tmp_path: Path):
    """``(watched directory, its ExportSource, the Candidate served)``: a directory holding one export, served."""
    watched = tmp_path / "exports"
    watched.mkdir()
    make_export(watched / "a", seed=1)
    source = ExportSource(watch=watched)
    live, _ = first_export(source, lambda path: path)
    return watched, source, live


@pytest.mark.parametrize(
    "error", [MemoryError("out of memory"), RuntimeError("Deploying app 'bigrank' timed out"), TimeoutError()]
)
def test_a_transient_failure_is_tried_again_after_a_back_off(tmp_path, monkeypatch, capsys, error):
    """Out of memory, a deployment timeout: the newer export is not refused; it is tried again, after a wait that
    doubles, and served once it loads (watched directory, no new manifest, no SIGHUP)."""
    monkeypatch.setattr(reload, "RETRY_FIRST_S", 0.2, raising=False)
    watched, source, live = watching_one_export(tmp_path)
    newer = make_export(watched / "b", seed=2)
    installs = Installs(error, error)
    reloader = Reloader(source, installs, live, interval=0.05)
    assert poll_until(reloader, lambda: reloader.live.export_id == newer["id"]), installs.paths
    assert installs.paths == [newer["path"].resolve()] * 3 and newer["id"] not in reloader.refused
    log = capsys.readouterr().err
    assert "taken as transient): trying again in 0.2 s" in log and "trying again in 0.4 s" in log


def test_a_transient_failure_of_the_one_export_given_is_retried_without_another_sighup(tmp_path, monkeypatch):
    monkeypatch.setattr(reload, "RETRY_FIRST_S", 0.2, raising=False)
    old, new = make_export(tmp_path / "day1", seed=1), make_export(tmp_path / "day2", seed=2)
    current = tmp_path / "current"
    current.symlink_to(old["path"])
    source = ExportSource(current)
    live, _ = first_export(source, lambda path: path)
    installs = Installs(MemoryError("out of memory"))
    reloader = Reloader(source, installs, live)
    current.unlink()
    current.symlink_to(new["path"])
    hangup = threading.Event()
    hangup.set()  # one SIGHUP
    assert poll_until(reloader, lambda: reloader.live.export_id == new["id"], hangup), installs.paths
    assert len(installs.paths) == 2


def test_a_verification_or_format_error_refuses_the_export_for_good(tmp_path, monkeypatch):
    """A checksum mismatch (ValueError) or a listed file missing (FileNotFoundError): refused, not tried again while
    its manifest stays the same."""
    monkeypatch.setattr(reload, "RETRY_FIRST_S", 0.05, raising=False)
    watched, source, live = watching_one_export(tmp_path)
    for name, error in (("b", ValueError("does not match its sha256")), ("c", FileNotFoundError("missing"))):
        bad = make_export(watched / name, seed=ord(name))
        installs = Installs(error)
        reloader = Reloader(source, installs, live, interval=0.05)
        assert poll_until(reloader, lambda: bad["id"] in reloader.refused)  # noqa: B023
        poll_until(reloader, lambda: False, seconds=0.5)  # scans and retry periods go by
        assert installs.paths == [bad["path"].resolve()] and reloader.live.export_id == live.export_id
        shutil.rmtree(watched / name)
