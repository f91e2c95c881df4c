"""The local launcher on torch elastic, with real processes and gloo groups: a failed group starts again up to
``max_restarts`` times, and the caller's signal handlers are its own again afterwards. (Failures naming their
rank: tests/test_train.py; signals and exit statuses of `bigrank train`: tests/test_operations.py.)"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path

import pytest

from bigrank.errors import Terminated
from bigrank.train.launcher import WorkerError, free_ports, launch_local


def _fail_once_on_rank_one():
    import torch.distributed as dist

    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    if attempt == 0 and dist.get_rank() == 1:
        raise ValueError("first attempt fails on purpose")
    dist.barrier()
    return attempt


def test_a_failed_group_restarts_up_to_max_restarts_and_the_signal_handlers_come_back():
    def handler(signum, frame):
        pass

    # Handlers of the caller's own (whatever the test run inherited: a background run ignores SIGINT).
    previous = {signum: signal.signal(signum, handler) for signum in (signal.SIGTERM, signal.SIGINT)}
    try:
        assert launch_local(_fail_once_on_rank_one, 2, max_restarts=1, timeout=180) == [1, 1]
        # torch elastic's agent installs its own SIGTERM/SIGINT handlers and leaves them: the launcher restores.
        assert signal.getsignal(signal.SIGTERM) is handler
        assert signal.getsignal(signal.SIGINT) is handler
        assert "TORCHELASTIC_SIGNALS_TO_HANDLE" not in os.environ
    finally:
        for signum, old in previous.items():
            signal.signal(signum, old)
    with pytest.raises(WorkerError, match="rank 1 failed: ValueError: first attempt fails on purpose"):
        launch_local(_fail_once_on_rank_one, 2, max_restarts=0, timeout=180)


# ------------------------------------------------------------------------------------ stopping at a step boundary
def _steps_until_stopped(flags: str, agree: bool):
    """A training loop in miniature: marks itself ready, then steps until a stop is requested. ``agree``: the
    ranks agree on the step in an all-reduce of their requests and stop there (as the Trainer does), else the
    loop ignores the request (a step that never ends)."""
    import time
    from pathlib import Path

    import torch
    import torch.distributed as dist

    from bigrank.signals import Stopped, step_boundaries

    rank = dist.get_rank()
    with step_boundaries() as stop:
        (Path(flags) / f"ready-{rank}").touch()
        while True:
            if stop.signum is not None:
                (Path(flags) / f"requested-{rank}").touch()
            if agree:
                requests = torch.tensor([float(stop.signum is not None)])
                dist.all_reduce(requests)
                if requests.item() > 0:
                    raise Stopped(stop.signum or signal.SIGTERM)
            time.sleep(0.01)


def _signal_when(flags, names: list[str], signum: int) -> threading.Thread:
    """A thread that sends ``signum`` to this process once every file of ``names`` exists in ``flags``."""

    def send():
        while not all((flags / name).exists() for name in names):
            time.sleep(0.02)
        os.kill(os.getpid(), signum)

    thread = threading.Thread(target=send, daemon=True)
    thread.start()
    return thread


def test_sigterm_is_forwarded_and_the_workers_stop_where_they_agree(tmp_path):
    """The launcher forwards SIGTERM; each worker records it, the workers stop at a step they agree on
    (:class:`~bigrank.signals.Stopped`) and the launcher raises Terminated; its handlers are the caller's again."""
    before = signal.getsignal(signal.SIGTERM)
    _signal_when(tmp_path, ["ready-0", "ready-1"], signal.SIGTERM)
    with pytest.raises(Terminated):
        launch_local(_steps_until_stopped, 2, (str(tmp_path), True), timeout=180, stop_grace=600)
    assert sorted(path.name for path in tmp_path.glob("requested-*")) == ["requested-0", "requested-1"]
    assert signal.getsignal(signal.SIGTERM) is before


def test_a_second_signal_stops_the_workers_at_once(tmp_path):
    """Workers that do not stop after the first SIGTERM (a step that does not end) are killed at the second, long
    before the grace period (600 s here; the launch's own timeout, 180 s, would raise TimeoutError instead).
    SIGTERM, not SIGINT: a test run in the background has SIGINT ignored."""
    _signal_when(tmp_path, ["ready-0"], signal.SIGTERM)
    _signal_when(tmp_path, ["requested-0"], signal.SIGTERM)
    with pytest.raises(Terminated):
        launch_local(_steps_until_stopped, 1, (str(tmp_path), False), timeout=180, stop_grace=600)


# ------------------------------------------------------------------------------------------------ loopback only
def _listening_addresses() -> list[str]:
    """The local addresses (hex, as /proc/net/tcp* write them) of the TCP sockets listening in this worker and in
    its parent (the launcher, which runs torch elastic's agent)."""
    import torch.distributed as dist

    dist.barrier()  # every store and peer is up
    inodes = set()
    for pid in (os.getpid(), os.getppid()):
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # LISTEN
                found.append(fields[1].split(":")[0])
    dist.barrier()  # no store goes away before every rank has looked
    return found


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_the_launcher_and_its_workers_listen_on_the_loopback_only():
    """torch's TCPStore server listens on every interface; the rendezvous store and the group's store must not."""
    loopback = {"0100007F", "00000000000000000000000001000000"}  # 127.0.0.1, ::1
    found = launch_local(_listening_addresses, 2, timeout=180)
    assert found[0], "rank 0 hosts the group's store and the launcher the rendezvous store: something listens"
    for rank, addresses in enumerate(found):
        assert set(addresses) <= loopback, f"rank {rank} or the launcher listens beyond the loopback: {addresses}"


def test_ports_drawn_together_are_distinct_and_free():
    """Ray refuses to start when two of its components get one port; one-at-a-time draws can repeat one."""
    import socket

    ports = free_ports(40)
    assert len(set(ports)) == 40
    for port in ports:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))  # free: nothing kept it


def _environment(names):
    return {name: os.environ.get(name) for name in names}


def test_the_workers_start_with_env_unless_the_caller_sets_it(monkeypatch):
    """`bigrank evaluate` / `export` workers start with OpenMP's passive wait policy (read when torch loads, so it
    must be in the environment they start with): with the default spin-wait, a 2-thread worker on cores shared
    with another torch job spent 291 s of CPU on an ML-1B evaluation that takes 37 s. A variable the caller set
    wins, and the caller's environment is left as it was."""
    from bigrank.run import INFERENCE_ENV

    assert INFERENCE_ENV["OMP_WAIT_POLICY"] == "PASSIVE"
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.setenv("BIGRANK_TEST_KEPT", "caller")
    env = {**INFERENCE_ENV, "BIGRANK_TEST_KEPT": "launcher"}
    seen = launch_local(_environment, 1, (["OMP_WAIT_POLICY", "BIGRANK_TEST_KEPT"],), env=env, timeout=120)[0]
    assert seen == {"OMP_WAIT_POLICY": "PASSIVE", "BIGRANK_TEST_KEPT": "caller"}
    assert "OMP_WAIT_POLICY" not in os.environ and os.environ["BIGRANK_TEST_KEPT"] == "caller"
