"""An embedded Ray runtime listens on loopback only (real Ray, no mocks).

Starts the runtime through bigrank's own entry points (``init_ray`` of ``bigrank train --launcher ray`` and
``bigrank tune``; ``deploy`` of ``bigrank serve --ray`` calls the same ``init_local_ray``), then lists every
listening TCP socket of the test process and its descendants (GCS, raylet, agents, dashboard head, workers)
from /proc and asserts each is bound to 127.0.0.1 / ::1 (or the IPv4-mapped ::ffff:127.0.0.1).
"""

from __future__ import annotations

import os
import socket
import sys
import time

import pytest

from bigrank.config import config_from_dict

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc"),
    pytest.mark.filterwarnings("ignore:Using extra keyword arguments on `Field`"),
]
LOOPBACK = {"127.0.0.1", "::1", "::ffff:127.0.0.1"}


def _listening() -> dict[int, tuple[str, int]]:
    """Socket inode -> (address, port) of every listening TCP socket in this network namespace."""
    found = {}
    for path, family in (("/proc/net/tcp", socket.AF_INET), ("/proc/net/tcp6", socket.AF_INET6)):
        try:
            lines = open(path).read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[3] != "0A":  # TCP_LISTEN
                continue
            address, port = fields[1].split(":")
            raw = bytes.fromhex(address)
            # /proc prints each 32-bit word in host (little-endian) order
            raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
            found[int(fields[9])] = (socket.inet_ntop(family, raw), int(port, 16))
    return found


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


def _listeners(session_dir: str) -> list[tuple[str, int, str]]:
    """(address, port, process title) of each listening socket of the Ray processes."""
    return listeners_of(_ray_processes(session_dir))


def listeners_of(pids) -> list[tuple[str, int, str]]:
    """(address, port, process title) of each listening TCP socket of the processes ``pids``."""
    sockets, result = _listening(), set()
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
            title = open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:[") and int(target[8:-1]) in sockets:
                result.add((*sockets[int(target[8:-1])], f"{pid} {title[:100]}"))
    return sorted(result)


def _assert_loopback_only(ray, minimum: int) -> None:
    session_dir = ray._private.worker._global_node.get_session_dir_path()
    listeners = _listeners(session_dir)
    assert len(listeners) >= minimum, listeners  # the scan sees Ray's processes at all
    exposed = [entry for entry in listeners if entry[0] not in LOOPBACK]
    assert not exposed, "listening outside loopback:\n" + "\n".join(map(str, exposed))


def _start_or_skip(start):
    try:
        return start()
    except Exception as error:
        import ray

        if ray.is_initialized():  # Ray runs: a failure after its start is a test failure
            raise
        pytest.skip(f"Ray cannot start here: {error}")  # sandbox, no shared memory, ...


def test_the_training_and_tuning_runtime_listens_on_loopback_only(tiny_dataset, tmp_path):
    ray = pytest.importorskip("ray")
    from bigrank.launch.ray_train import init_ray

    if ray.is_initialized():
        ray.shutdown()
    config = config_from_dict({"data": {"root": str(tiny_dataset)}, "run_dir": str(tmp_path), "workers": 1})
    assert _start_or_skip(lambda: init_ray(config))
    try:

        @ray.remote(num_cpus=0)
        class Probe:  # one more worker process with its own gRPC server
            def ping(self) -> int:
                return os.getpid()

        probe = Probe.remote()
        assert ray.get(probe.ping.remote(), timeout=60) > 0
        time.sleep(2)  # the agents open their ports shortly after ray.init returns
        # GCS, raylet (node manager + object manager), driver, dashboard agent, runtime-env agent, the actor
        _assert_loopback_only(ray, minimum=8)
    finally:
        ray.shutdown()
