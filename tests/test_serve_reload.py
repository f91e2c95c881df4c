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

from bigrank.export.format import MANIFEST_NAME, export_id
from bigrank.export.reload import watched_exports
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
        assert f"now serving {current} (export id {new['id']})" in log.read_text()
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
