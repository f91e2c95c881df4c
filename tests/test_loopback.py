"""An embedded Ray runtime listens on loopback only (real Ray, no mocks).

Starts the runtime through bigrank's own entry points (``init_ray`` of ``bigrank train --launcher ray`` and
``bigrank tune``; ``deploy`` of ``bigrank serve --ray`` calls the same ``init_local_ray``), then lists every
listening TCP socket of the test process and its descendants (GCS, raylet, agents, dashboard head, workers)
from /proc and asserts each is bound to 127.0.0.1 / ::1 (or the IPv4-mapped ::ffff:127.0.0.1).

One moment is not enough: a listener may live for part of a run only (Ray Train's process-group store on
``*:PORT`` did, for about a third of a training run). So whole runs of ``bigrank train`` (Ray launcher),
``bigrank tune`` and ``bigrank serve --ray`` run as subprocesses while a thread samples the listeners of the
command and every process below it every 0.5 s, as ``ss -ltnup`` would show them, from start to exit.
"""

from __future__ import annotations

import os
import sys
import time

import pytest

from bigrank.config import config_from_dict
from tests.helpers import HANG_GUARD_S, LOOPBACK, listeners_of

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc"),
    pytest.mark.filterwarnings("ignore:Using extra keyword arguments on `Field`"),
]


def _parent(pid: int) -> int:
    try:
        stat = open(f"/proc/{pid}/stat").read()
    except OSError:
        return 0
    return int(stat.rsplit(")", 1)[1].split()[1])


def _ray_processes(session_dir: str) -> list[int]:
    """This process, its descendants, and any process whose command line names the Ray session."""
    me, pids = os.getpid(), []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        pid = int(entry)
        try:
            cmdline = open(f"/proc/{pid}/cmdline", "rb").read()
        except OSError:
            continue
        ancestor = pid
        while ancestor > 1 and ancestor != me:
            ancestor = _parent(ancestor)
        if ancestor == me or session_dir.encode() in cmdline:
            pids.append(pid)
    return pids


def _assert_loopback_only(ray, minimum: int) -> None:
    """Every listening socket of the Ray processes is on loopback, once at least ``minimum`` are seen (the agents
    open their ports after ray.init returns: the scan waits for them, up to a hang guard)."""
    session_dir = ray._private.worker._global_node.get_session_dir_path()
    deadline = time.monotonic() + HANG_GUARD_S
    while len(listeners := listeners_of(_ray_processes(session_dir))) < minimum and time.monotonic() < deadline:
        time.sleep(0.5)
    assert len(listeners) >= minimum, listeners  # the scan sees Ray's processes at all
    exposed = [entry for entry in listeners if entry[0] not in LOOPBACK]
    assert not exposed, "listening outside loopback:\n" + "\n".join(map(str, exposed))


def test_the_training_and_tuning_runtime_listens_on_loopback_only_and_writes_nothing_home(
    tiny_dataset, tmp_path, monkeypatch
):
    """Also: the runtime keeps its files in the suite's directory (conftest's
    ``ray_keeps_its_files_in_a_directory_of_the_suite``). Started with an empty home, it writes nothing there (a new
    runtime that finds no token writes one to ``~/.ray/auth_token``), and its session lies outside ``/tmp/ray``."""
    import tempfile
    from pathlib import Path

    import ray

    from bigrank.launch.ray_train import init_ray

    if ray.is_initialized():
        ray.shutdown()
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    config = config_from_dict({"data": {"root": str(tiny_dataset)}, "run_dir": str(tmp_path), "workers": 1})
    assert init_ray(config)
    try:
        assert sorted(home.rglob("*")) == [], sorted(home.rglob("*"))
        session = Path(ray._private.worker._global_node.get_session_dir_path())
        assert not session.is_relative_to(Path(tempfile.gettempdir()) / "ray"), session
        assert session.is_relative_to(os.environ.get("RAY_TMPDIR", "/nowhere")), session

        @ray.remote(num_cpus=0)
        class Probe:  # one more worker process with its own gRPC server
            def ping(self) -> int:
                return os.getpid()

        probe = Probe.remote()
        assert ray.get(probe.ping.remote(), timeout=60) > 0
        # GCS, raylet (node manager + object manager), driver, dashboard agent, runtime-env agent, the actor
        _assert_loopback_only(ray, minimum=8)
    finally:
        ray.shutdown()


# ------------------------------------------------------------------------------ whole runs, sampled over time
def _on_loopback(address: str) -> bool:
    """Whether a listening address lies in 127.0.0.0/8 or is ::1 (IPv4-mapped forms included)."""
    return address.removeprefix("::ffff:").startswith("127.") or address == "::1"


def _descendants(root: int) -> list[int]:
    """``root`` and every process below it (Ray's GCS, raylet, agents and workers are children of the driver)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            children.setdefault(_parent(int(entry)), []).append(int(entry))
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo.extend(children.get(pid, ()))
    return found


class ListenerSampler:
    """Every ``interval`` seconds, in a thread, the listening TCP sockets of a process and its descendants (what
    ``ss -ltnup`` shows of them), for as long as the process lives; :meth:`exposed` lists every one seen outside
    127.0.0.0/8 and ::1, with the process that held it."""

    def __init__(self, pid: int, interval: float = 0.5):
        import threading

        self.pid, self.interval, self.samples = pid, interval, 0
        self.seen: set[tuple[str, int, str]] = set()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._done.is_set() and os.path.exists(f"/proc/{self.pid}"):
            self.seen.update(listeners_of(_descendants(self.pid)))
            self.samples += 1
            self._done.wait(self.interval)

    def stop(self) -> None:
        self._done.set()
        self._thread.join(timeout=30)

    def exposed(self) -> list[tuple[str, int, str]]:
        return sorted(entry for entry in self.seen if not _on_loopback(entry[0]))

    def titles(self) -> str:
        return " ".join(entry[2] for entry in self.seen)

    def summary(self) -> str:
        """How many samples, and the listening processes by name with their count of distinct sockets."""
        names: dict[str, set] = {}
        for address, port, title in self.seen:
            name = title.split()[1] if len(title.split()) > 1 else title
            names.setdefault(name.split("/")[-1], set()).add((address, port))
        counts = ", ".join(f"{name} {len(sockets)}" for name, sockets in sorted(names.items()))
        return f"{self.samples} samples; listeners by process: {counts}"


def _run_sampled(args: list[str], tmp_path, timeout: float = 600, until=None) -> tuple[ListenerSampler, str]:
    """``bigrank ARGS`` in a subprocess, its listeners sampled every 0.5 s from start to exit; ``until(proc)``: wait
    for it, then stop the command with SIGINT (a server). Returns the sampler and the command's output."""
    import signal
    import subprocess

    log = tmp_path / "command.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "bigrank.cli", *args], stdout=out, stderr=subprocess.STDOUT)
        sampler = ListenerSampler(proc.pid)
        try:
            if until is not None:
                until(proc)
                proc.send_signal(signal.SIGINT)
            proc.wait(timeout=timeout)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            sampler.stop()
    return sampler, log.read_text()


def _small_config(tmp_path, root, **train) -> str:
    import yaml

    raw = {
        "data": {"root": str(root)},
        "run_dir": str(tmp_path / "run"),
        "workers": 2,
        "model": {"dim": 8},
        "loss": {"name": "rankmax"},
        "train": {"batch_size": 200, "epochs": 2, "log_every": 1, "progress": False, **train},
        "eval": {"every_epochs": 1, "ks": [10]},
    }
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(raw))
    return str(path)


def test_an_embedded_training_run_listens_on_loopback_only_at_every_sample(tiny_dataset, tmp_path):
    """`bigrank train` on the Ray launcher (embedded runtime, 2 workers, 2 epochs of the tiny data): no process of
    the run — driver, GCS, raylet, agents, the Ray Train controller and workers with their process group's store
    and gloo pairs — listens outside 127.0.0.0/8 at any sample, from start to exit. (Before the workers started
    their own group, rank 0's TCPStore of Ray Train's TorchConfig listened on *:PORT.)"""
    sampler, output = _run_sampled(["train", _small_config(tmp_path, tiny_dataset), "--launcher", "ray"], tmp_path)
    assert "examples/s" in output, output[-3000:]  # the run finished (its summary)
    print(sampler.summary())
    assert "RayTrainWorker" in sampler.titles(), sorted(sampler.seen)  # the samples saw the training workers
    assert sampler.samples >= 10, sampler.samples
    assert not sampler.exposed(), "listening outside loopback:\n" + "\n".join(map(str, sampler.exposed()))


def test_an_embedded_search_listens_on_loopback_only_at_every_sample(tiny_dataset, tmp_path):
    """`bigrank tune` (embedded runtime, one trial of 1 epoch on 2 local workers): the same check over the whole
    search — Ray Tune's controller and trial actor, and the trial's local launcher with its workers."""
    space = tmp_path / "space.yaml"
    space.write_text("metric: recall@10\ntrials: 1\nspace:\n  optim.item_lr: {choice: [0.05]}\n")
    config = _small_config(tmp_path, tiny_dataset, epochs=1)
    sampler, output = _run_sampled(["tune", config, "--space", str(space), "--out", str(tmp_path / "tune")], tmp_path)
    assert (tmp_path / "tune" / "best.yaml").is_file(), output[-3000:]
    print(sampler.summary())
    assert "ImplicitFunc" in sampler.titles(), sorted(sampler.seen)  # the samples saw the trial (Tune's actor)
    assert sampler.samples >= 10, sampler.samples
    assert not sampler.exposed(), "listening outside loopback:\n" + "\n".join(map(str, sampler.exposed()))


def test_an_embedded_ray_server_listens_on_loopback_only_at_every_sample(tiny_dataset, tmp_path):
    """`bigrank serve --ray` (embedded runtime, HAProxy ingress, one replica) from start, through an answered
    request, to its stop by SIGINT: the same check."""
    import json
    import urllib.request

    import torch

    from bigrank.export.writer import export_embeddings
    from bigrank.train.launcher import free_port
    from tests.conftest import TINY_ITEMS, TINY_USERS

    export = tmp_path / "export"
    generator = torch.Generator().manual_seed(0)
    export_embeddings(
        export,
        rank=0,
        world_size=1,
        group=None,
        item_rows=(0, TINY_ITEMS, torch.randn(TINY_ITEMS, 8, generator=generator)),
        user_rows=(0, TINY_USERS, torch.randn(TINY_USERS, 8, generator=generator)),
        dataset_root=tiny_dataset,
        model_info={"dim": 8},
    )
    port = free_port()
    answered = {}

    def until_answered(proc) -> None:
        deadline = time.monotonic() + 300
        while proc.poll() is None and time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/recommend?user=3&k=5", timeout=10) as reply:
                    answered["items"] = len(json.loads(reply.read())["items"])
                    return
            except OSError:
                time.sleep(1)

    args = ["serve", str(export), "--ray", "--port", str(port), "--replicas", "1", "--quiet"]
    sampler, output = _run_sampled(args, tmp_path, timeout=120, until=until_answered)
    assert answered.get("items") == 5, output[-3000:]
    print(sampler.summary())
    assert "haproxy" in sampler.titles(), sorted(sampler.seen)  # the samples saw the ingress
    assert sampler.samples >= 10, sampler.samples
    assert not sampler.exposed(), "listening outside loopback:\n" + "\n".join(map(str, sampler.exposed()))
