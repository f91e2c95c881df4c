"""Ray Jobs with a real local Ray head (`ray start --head` on 127.0.0.1, token authentication as Ray 2.60
sets it up): `bigrank submit configs/demo.yaml --wait` succeeds and the run's eval.json holds the valid and
test sections (equal to a brute-force ranking of its checkpoint); status/logs/stop work on the job; the token is
found in ~/.ray/auth_token, RAY_AUTH_TOKEN or RAY_AUTH_TOKEN_PATH; `bigrank train --address` joins the head; a
missing token and an address where nothing listens give errors that say what to do."""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from bigrank.train.launcher import free_port, free_ports
from tests.conftest import TINY_ITEMS, brute_force_metrics, checkpoint_parameters
from tests.helpers import assert_ends, kill_group, start_command, wait_for_line

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


# The head and the clients share a HOME of their own, where `ray get-auth-token --generate` writes the token
# (HOME/.ray/auth_token): `ray start` then turns token authentication on, and bigrank must find the token
# there. The user's real ~/.ray is never touched.
HOME = Path(tempfile.gettempdir()) / f"bigrank-home-{os.getpid()}"  # made and removed by the ray_head fixture


def _env(**extra) -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"  # the job's `python` is this venv's
    env["HOME"] = str(HOME)
    for name in ("RAY_ADDRESS", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        env.pop(name, None)
    env.update(extra)
    return env


def _bigrank(*args, env=None, timeout=600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(BIN / "bigrank"), *args],
        cwd=REPO,
        env=env or _env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _submit_args(head, data, run_dir, *options: str) -> list[str]:
    """The arguments of ``bigrank submit configs/demo.yaml`` to ``head`` for ``data`` into ``run_dir``; each of
    ``options`` is ``--wait`` or a ``KEY=VALUE`` to ``--set``."""
    sets = [arg for option in options for arg in ([option] if option.startswith("--") else ["--set", option])]
    return ["submit", "configs/demo.yaml", "--address", head.dashboard, "--set", f"data.root={data}",
            "--set", f"run_dir={run_dir}", *sets]  # fmt: skip


def _submit(head, data, run_dir, *options: str) -> subprocess.CompletedProcess:
    return _bigrank(*_submit_args(head, data, run_dir, *options))


@dataclass
class Head:
    dashboard: str  # http://127.0.0.1:PORT, for the Jobs API (submit, status, logs, stop)
    gcs: str  # 127.0.0.1:PORT, for `bigrank train --address` (a driver joining the cluster)


@pytest.fixture(scope="module")
def ray_head():
    """A real Ray head on loopback (`ray start --head --block`); its process group is ended in teardown,
    whatever the tests did. Yields its addresses (``Head``)."""
    temp_dir = tempfile.mkdtemp(prefix="bigrank-ray-", dir="/tmp")  # short: Ray's socket paths are limited
    # Drawn together so that no two components get the same port (Ray refuses to start then).
    dashboard_port, gcs_port, *ports = free_ports(9)
    command = [
        str(BIN / "ray"),
        "start",
        "--head",
        "--block",
        "--node-ip-address=127.0.0.1",
        "--dashboard-host=127.0.0.1",
        f"--port={gcs_port}",
        f"--dashboard-port={dashboard_port}",
        # Fixed default ports (52365, 8076, ...) clash with any other Ray on the machine: the head would
        # then run without a job agent ("No available agent to submit job").
        *(
            f"--{name}={port}"
            for name, port in zip(
                (
                    "ray-client-server-port",
                    "dashboard-agent-listen-port",
                    "dashboard-agent-grpc-port",
                    "runtime-env-agent-port",
                    "metrics-export-port",
                    "node-manager-port",
                    "object-manager-port",
                ),
                ports,
                strict=True,
            )
        ),
        f"--temp-dir={temp_dir}",
        "--num-cpus=2",
        "--include-dashboard=true",
        "--disable-usage-stats",
    ]
    log = open(Path(temp_dir) / "ray-start.log", "w")  # noqa: SIM115 - closed in the finally below
    HOME.mkdir(exist_ok=True)
    env = _env()
    subprocess.run([str(BIN / "ray"), "get-auth-token", "--generate"], env=env, check=True, capture_output=True)
    assert (HOME / ".ray" / "auth_token").is_file()
    head = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    address = f"http://127.0.0.1:{dashboard_port}"
    try:
        _wait_for_dashboard(address, head, Path(temp_dir) / "ray-start.log")
        yield Head(address, f"127.0.0.1:{gcs_port}")
    finally:
        _stop_head(head)
        log.close()
        shutil.rmtree(temp_dir, ignore_errors=True)
        shutil.rmtree(HOME, ignore_errors=True)


def _wait_for_dashboard(address: str, head: subprocess.Popen, log: Path, timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if head.poll() is not None:
            pytest.fail(f"ray start exited with {head.returncode}:\n{log.read_text()[-3000:]}")
        try:
            socket.create_connection(("127.0.0.1", int(address.rsplit(":", 1)[1])), timeout=2).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                pytest.fail(f"the Ray dashboard at {address} did not come up:\n{log.read_text()[-3000:]}")
            time.sleep(1.0)


def _stop_head(head: subprocess.Popen) -> None:
    """End the head's process group (`ray start --block` and every Ray process it started): SIGTERM, then
    SIGKILL for what is left (a plain SIGTERM to `ray start` would first drain the node for 30 s)."""
    for sig, grace in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(head.pid, sig)
        except ProcessLookupError:
            break
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and (head.poll() is None or _group_alive(head.pid)):
            time.sleep(0.5)  # head.poll() reaps `ray start`, whose zombie would keep the group alive
    head.wait()


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def test_submit_the_demo_config_waits_for_success_and_the_run_is_evaluated(ray_head, demo_data, tmp_path):
    run_dir = tmp_path / "run"
    done = _submit(ray_head, demo_data, run_dir, "--wait", "train.max_steps=12", "train.progress=false",
                   "eval.sample_users=200")  # fmt: skip
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    job_line = next(line for line in done.stdout.splitlines() if line.startswith("submitted job "))
    job_id = job_line.split()[2]
    assert f"job {job_id} SUCCEEDED" in done.stdout
    results = json.loads((run_dir / "eval.json").read_text())
    # The job's evaluation equals a numpy ranking of its checkpoint's tables for the same 200 sampled users.
    from bigrank.train.evaluate import evaluation_users

    checkpoint = run_dir / "checkpoints" / "step-00000012"
    catalog, user_table = checkpoint_parameters(checkpoint)[:2]
    for split in ("valid", "test"):
        assert results[split]["users"] == 200 and results[split]["step"] == 12
        users = evaluation_users(demo_data, split, 200, seed=0)  # configs/demo.yaml: seed 0
        expected = brute_force_metrics(
            demo_data, split, user_table.double().numpy(), catalog.double().numpy(), [10, 100], users=users
        )
        for key in ("recall@10", "recall@100", "ap@10", "accuracy"):
            assert results[split][key] == pytest.approx(expected[key], abs=1e-6), (split, key)

    # The job ran the code shipped as its working directory (subpackages such as bigrank/data included).
    code_line = next(line for line in done.stdout.splitlines() if line.startswith("bigrank code: "))
    shipped = Path(code_line.split(": ", 1)[1])
    assert shipped != REPO / "bigrank" and (shipped / "data" / "stream.py").is_file(), code_line

    status = _bigrank("status", job_id, "--address", ray_head.dashboard)
    assert status.returncode == 0 and "SUCCEEDED" in status.stdout and str(run_dir) in status.stdout
    logs = _bigrank("logs", job_id, "--address", ray_head.dashboard)
    assert logs.returncode == 0 and f"run dir        {run_dir}" in logs.stdout


def test_stop_a_running_job(ray_head, demo_data, tmp_path, monkeypatch):
    """`bigrank stop` once the job trains: Ray Jobs SIGTERMs the entrypoint, whose workers stop at a step boundary
    with a final checkpoint (the job's RAY_JOB_STOP_WAIT_TIME_S gives them the time), and the job ends STOPPED."""
    from bigrank.train.checkpoint import latest_checkpoint

    run_dir = tmp_path / "run"
    done = _submit(ray_head, demo_data, run_dir, "train.epochs=50")
    assert done.returncode == 0, done.stderr
    job_id = done.stdout.split()[2]
    deadline = time.monotonic() + 180
    while (periodic := latest_checkpoint(run_dir)) is None:
        assert time.monotonic() < deadline, _bigrank("logs", job_id, "--address", ray_head.dashboard).stdout
        time.sleep(0.5)
    stopped = _bigrank("stop", job_id, "--address", ray_head.dashboard)
    assert stopped.returncode == 0 and "stop requested" in stopped.stdout, stopped.stdout + stopped.stderr
    deadline = time.monotonic() + 120
    while (status := _bigrank("status", job_id, "--address", ray_head.dashboard)).returncode == 0:
        if "STOPPED" in status.stdout or time.monotonic() > deadline:
            break
        time.sleep(1.0)
    assert "status      STOPPED" in status.stdout, status.stdout + status.stderr
    logs = _bigrank("logs", job_id, "--address", ray_head.dashboard).stdout
    found = re.search(r"stopped by SIGTERM at step (\d+): checkpoint (\S+)", logs)
    assert found and int(found[1]) > int(periodic.name.split("-")[1]), logs[-3000:]
    assert latest_checkpoint(run_dir).name == f"step-{int(found[1]):08d}", logs[-3000:]
    # A final checkpoint of a large model takes longer than Ray's 3 s before its SIGKILL: the job asks for more.
    from bigrank.launch.jobs import connect
    from bigrank.signals import STOP_GRACE_SECONDS

    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(HOME / ".ray" / "auth_token"))  # the head's token
    env_vars = connect(ray_head.dashboard).get_job_info(job_id).runtime_env["env_vars"]
    assert int(env_vars["RAY_JOB_STOP_WAIT_TIME_S"]) > STOP_GRACE_SECONDS, env_vars


def test_a_signal_while_follow_logs_builds_its_loop_comes_out_once_the_loop_is_built(ray_head, monkeypatch):
    """`submit --wait` printed a traceback in CI when a signal cut the set-up of its asyncio loop in half (the loop
    left behind complained in its finaliser): follow_logs builds the loop with the stop signals held, so a
    signal that comes meanwhile raises its exception once the loop is built, and the loop is closed."""
    import asyncio
    import io

    from bigrank.errors import Terminated
    from bigrank.launch import jobs
    from bigrank.signals import graceful_stop, raise_for

    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(HOME / ".ray" / "auth_token"))  # the head's token
    job_id = jobs.connect(ray_head.dashboard).submit_job(entrypoint="echo followed")
    new_event_loop, built = asyncio.events.new_event_loop, []

    def signalled_during_set_up():
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.2)  # the handler runs between two bytecodes: here, were the signal not held
        built.append(new_event_loop())
        return built[-1]

    monkeypatch.setattr(asyncio.events, "new_event_loop", signalled_during_set_up)  # asyncio.Runner's factory
    with pytest.raises(Terminated):
        with graceful_stop(raise_for):
            jobs.follow_logs(ray_head.dashboard, job_id, io.StringIO())
    assert len(built) == 1 and built[0].is_closed()


def test_a_job_whose_dataset_is_missing_on_the_cluster_fails_naming_it(ray_head, tmp_path):
    missing = tmp_path / "no-such-dataset"
    done = _submit(ray_head, missing, tmp_path / "run", "--wait")
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    assert "bigrank job: error:" in done.stdout and str(missing) in done.stdout
    assert "FAILED" in done.stdout.splitlines()[-1]


def test_a_missing_token_says_where_to_put_it(ray_head, tmp_path):
    no_token = _env(HOME=str(tmp_path))  # no ~/.ray here
    done = _bigrank("status", "any-job", "--address", ray_head.dashboard, env=no_token)
    assert done.returncode == 2
    assert f"the Ray cluster at {ray_head.dashboard} requires token authentication" in done.stderr
    assert "~/.ray/auth_token" in done.stderr and "RAY_AUTH_TOKEN" in done.stderr


def test_the_token_is_read_from_the_environment(ray_head, tmp_path):
    """No ~/.ray in HOME: the token comes from RAY_AUTH_TOKEN, or from the file RAY_AUTH_TOKEN_PATH names. The
    cluster then answers (an unknown job), where without a token it refuses; a wrong token is named as such."""
    token = (HOME / ".ray" / "auth_token").read_text().strip()
    (tmp_path / "token.txt").write_text(token + "\n")
    for extra in ({"RAY_AUTH_TOKEN": token}, {"RAY_AUTH_TOKEN_PATH": str(tmp_path / "token.txt")}):
        done = _bigrank("status", "no-such-job", "--address", ray_head.dashboard, env=_env(HOME=str(tmp_path), **extra))
        assert done.returncode == 2 and "no such job" in done.stderr, (extra, done.stderr)
    wrong = _env(HOME=str(tmp_path), RAY_AUTH_TOKEN="0" * len(token))
    done = _bigrank("status", "no-such-job", "--address", ray_head.dashboard, env=wrong)
    assert done.returncode == 2 and "the token was rejected" in done.stderr, done.stderr


def test_train_joins_the_live_cluster_with_address(ray_head, tiny_dataset, tmp_path):
    """`bigrank train --address HOST:PORT`: a driver joins the running head (token from ~/.ray/auth_token) and
    its 2 Ray Train workers train and evaluate the run there."""
    run_dir = tmp_path / "run"
    config = tmp_path / "tiny.yaml"
    config.write_text(
        f"data: {{root: {tiny_dataset}, shuffle_buffer: 256}}\nrun_dir: {run_dir}\nworkers: 2\nmodel: {{dim: 8}}\n"
        "loss: {name: softmax}\noptim: {user_lr: 0.1, item_lr: 0.1}\n"
        "train: {batch_size: 128, epochs: 4, progress: false}\neval: {every_epochs: null, ks: [10]}\n"
    )
    done = _bigrank("train", str(config), "--address", ray_head.gcs)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert f"training {run_dir} on the Ray cluster at {ray_head.gcs}: 2 workers" in done.stdout
    results = json.loads((run_dir / "eval.json").read_text())
    assert results["valid"]["recall@10"] > 3 * 10 / TINY_ITEMS, results  # it trained


def test_an_unknown_job_is_named(ray_head):
    done = _bigrank("status", "no-such-job", "--address", ray_head.dashboard)
    assert done.returncode == 2 and "no such job" in done.stderr and "no-such-job" in done.stderr


def test_submitting_where_nothing_listens_fails_on_one_connect_naming_the_address(tmp_path):
    """Nothing listens: the error is bigrank's own check, one connect with a 5 s timeout made before Ray's job
    client is built, naming the address and why (Ray's client says only that it failed to connect); so it fails
    within seconds, which benchmarks/bench_stop.py times."""
    address = f"http://127.0.0.1:{free_port()}"
    done = _bigrank("submit", "configs/demo.yaml", "--address", address, "--wait", timeout=300)  # a hang guard
    assert done.returncode == 2, done.stdout + done.stderr
    assert f"cannot reach the Ray dashboard at {address}: Connection refused" in done.stderr, done.stderr


def test_the_shipped_working_dir_has_the_code_and_configs_but_not_venv_data_or_runs(tmp_path):
    """What `bigrank submit` uploads, packed by Ray's own packaging with our excludes."""
    import zipfile

    from ray._private.runtime_env.packaging import create_package

    from bigrank.launch.jobs import WORKING_DIR_EXCLUDES, project_dir

    package = tmp_path / "working_dir.zip"
    create_package(str(project_dir()), package, include_gitignore=True, excludes=WORKING_DIR_EXCLUDES)
    names = set(zipfile.ZipFile(package).namelist())
    for needed in ("bigrank/data/stream.py", "bigrank/launch/jobs.py", "bigrank/cli/__init__.py", "configs/demo.yaml"):
        assert needed in names, needed
    for name in names:
        assert not name.startswith((".venv/", "data/", "runs/", ".git/")) and "__pycache__" not in name, name


def test_sigterm_or_ctrl_c_while_waiting_stops_following_and_the_job_keeps_running(ray_head, demo_data, tmp_path):
    """`bigrank submit --wait` stopped by SIGTERM (143) or Ctrl+C (130), as `ray job submit` behaves: the command
    ends, leaving no process of its own, and says how to follow and stop the job, which keeps running."""
    for signum, status, why in ((signal.SIGTERM, 143, "stopped by SIGTERM"), (signal.SIGINT, 130, "interrupted")):
        log = tmp_path / f"submit-{signum}.log"
        run_dir = tmp_path / f"run-{signum}"
        proc = start_command(log, *_submit_args(ray_head, demo_data, run_dir, "--wait"), env=_env())
        try:
            wait_for_line(proc, log, "submitted job ")
            job_id = next(line for line in log.read_text().splitlines() if line.startswith("submitted job ")).split()[2]
            os.killpg(proc.pid, signum) if signum == signal.SIGINT else proc.send_signal(signum)
            assert_ends(proc, log, status)
        finally:
            kill_group(proc.pid)
        output = log.read_text()
        assert f"bigrank submit: {why}; stopped following job {job_id}, which keeps running" in output, output
        assert f"bigrank stop {job_id} --address {ray_head.dashboard}" in output, output
        assert "Traceback" not in output, output
        state = _bigrank("status", job_id, "--address", ray_head.dashboard)
        assert state.returncode == 0 and ("RUNNING" in state.stdout or "PENDING" in state.stdout), state.stdout
        assert _bigrank("stop", job_id, "--address", ray_head.dashboard).returncode == 0


def test_a_sigterm_inside_a_finaliser_still_stops_submit_wait(ray_head, demo_data, tmp_path, monkeypatch, capsys):
    """A signal handler that raises loses its exception when the signal lands while a finaliser runs (Python prints
    "Exception ignored in: <finalize object>" and goes on): CI once saw `submit --wait` ignore SIGTERM so, while
    urllib3's connection pools were finalised during garbage collection, and follow the job to its end. The handler
    only sets the stop event that the follow and the wait look at. Here the SIGTERM is raised inside a ``__del__``
    run from the first write of the job's log: the command stops following at once (143) and the job runs on."""
    from bigrank.cli import main
    from bigrank.launch import jobs

    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(HOME / ".ray" / "auth_token"))  # the head's token
    fired = []

    class Finaliser:
        def __del__(self):
            signal.raise_signal(signal.SIGTERM)  # the handler runs here, inside the finaliser

    class JobLog(io.StringIO):
        def write(self, text):
            so_far = self.getvalue()
            if "submitted job " in so_far and so_far.endswith("\n") and not fired:  # the job's log, being followed
                fired.append(text)
                Finaliser()  # dropped at once: its __del__ runs now
            return super().write(text)

    log = JobLog()
    monkeypatch.setattr(sys, "stdout", log)
    args = _submit_args(ray_head, demo_data, tmp_path / "run", "--wait", "train.max_steps=8", "eval.sample_users=100")
    args[1] = str(REPO / args[1])
    code = main(args)
    job_id = next(line for line in log.getvalue().splitlines() if line.startswith("submitted job ")).split()[2]
    try:
        assert fired and code == 143, log.getvalue()[-3000:]
        assert "stopped by SIGTERM; stopped following job" in capsys.readouterr().err
        assert jobs.job_status(ray_head.dashboard, job_id)["status"] in ("PENDING", "RUNNING")
    finally:
        jobs.stop_job(ray_head.dashboard, job_id)
