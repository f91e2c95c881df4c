"""An embedded Ray runtime listens on loopback only (real Ray, no mocks).

Starts the runtime through bigrank's own entry points (``init_ray`` of ``bigrank train --launcher ray`` and
``bigrank tune``; ``deploy`` of ``bigrank serve --ray`` calls the same ``init_local_ray``), then lists every
listening TCP socket of the test process and its descendants (GCS, raylet, agents, dashboard head, workers)
from /proc and asserts each is bound to 127.0.0.1 / ::1 (or the IPv4-mapped ::ffff:127.0.0.1).
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


def test_the_training_and_tuning_runtime_listens_on_loopback_only(tiny_dataset, tmp_path):
    import ray

    from bigrank.launch.ray_train import init_ray

    if ray.is_initialized():
        ray.shutdown()
    config = config_from_dict({"data": {"root": str(tiny_dataset)}, "run_dir": str(tmp_path), "workers": 1})
    assert init_ray(config)
    try:

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
