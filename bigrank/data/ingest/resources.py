"""The memory and CPUs an ingest may use on this machine: the machine's, or less where a cgroup limits them.

Inside a container — a Kubernetes pod, where KubeRay runs the Ray engine; ``docker run --memory --cpus`` — the
kernel enforces the cgroup's limits, not the machine's: a DuckDB sized by the machine's memory grows past the
pod's limit and is killed (OOM) instead of spilling, and threads beyond the CPU quota are throttled. So the
defaults of ``--memory-limit`` and ``--threads`` start from the smallest of:

* memory: the machine's (``SC_PHYS_PAGES``); cgroup v2 ``memory.max``; cgroup v1 ``memory.limit_in_bytes``;
* CPUs: the CPUs this process may run on (``sched_getaffinity``); cgroup v2 ``cpu.max`` (``quota period``);
  cgroup v1 ``cpu.cfs_quota_us / cpu.cfs_period_us`` — a quota of 2.5 CPUs gives 2 threads (as Go's
  ``automaxprocs`` rounds), at least 1.

The cgroup is this process's (``/proc/self/cgroup``) and every cgroup above it (a limit set on a pod holds for
its containers), read under ``/sys/fs/cgroup`` (v2: the unified tree; v1: one tree per controller). Where the
process's path is not under the mount (a cgroup namespace shows the container's own cgroup as the root), the
mount's root is read. No limit found, or a file that cannot be read: the machine's figure.

Each figure comes with where it was taken from (:class:`Resource`), which the ingest's plan line prints.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

__all__ = ["CGROUP_ROOT", "PROC_CGROUP", "Resource", "available_cpus", "available_memory"]

CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_CGROUP = Path("/proc/self/cgroup")
# cgroup v1 writes "no limit" as the largest page-aligned int64 (9223372036854771712); anything this large is none.
UNLIMITED = 1 << 60


@dataclass(frozen=True)
class Resource:
    """An amount (bytes or CPUs) and where it was taken from (``"the machine"``, or the cgroup file)."""

    amount: float
    source: str


def _cgroup_paths() -> dict[str, str]:
    """This process's cgroup path per controller (``"memory"``, ``"cpu"``; ``""``: the v2 unified tree)."""
    paths: dict[str, str] = {}
    try:
        lines = PROC_CGROUP.read_text().splitlines()
    except OSError:
        return paths
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        for controller in parts[1].split(",") if parts[1] else [""]:
            paths[controller] = parts[2]
    return paths


def _chain(mount: Path, path: str) -> list[Path]:
    """The cgroup directories whose limits hold for this process: its own under ``mount`` and every one above it
    up to the mount's root; the root alone when its own is not there (a cgroup namespace)."""
    own = mount / path.lstrip("/")
    if not own.is_dir():
        return [mount] if mount.is_dir() else []
    chain = [own]
    while chain[-1] != mount and mount in chain[-1].parents:
        chain.append(chain[-1].parent)
    return chain


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _v1_mount(controller: str) -> Path | None:
    """The v1 tree of ``controller`` (``cpu`` may be mounted as ``cpu,cpuacct``)."""
    for name in (controller, f"{controller},cpuacct", f"cpuacct,{controller}"):
        if (CGROUP_ROOT / name).is_dir():
            return CGROUP_ROOT / name
    return None


def _number(text: str | None) -> int | None:
    """A limit file's number; None for "max", a number this large (v1's "no limit") or an unreadable file."""
    return int(text) if text and text.isdigit() and int(text) < UNLIMITED else None


def _ratio(quota: str | None, period: str | None) -> float | None:
    """CPUs of a quota and its period (microseconds); None without a quota."""
    quota, period = _number(quota), _number(period)
    return quota / period if quota is not None and period else None


def _limits(controller: str, v2_file: str, v2_amount, v1_file: str, v1_amount) -> list[Resource]:
    """Every limit of ``controller`` on this process's cgroups: ``v2_amount(directory)`` in the unified tree,
    ``v1_amount(directory)`` in the controller's v1 tree (None where a cgroup sets none), each with the file it
    came from."""
    found = []
    paths = _cgroup_paths()
    trees = [("v2", CGROUP_ROOT, paths.get(""), v2_file, v2_amount)]
    trees.append(("v1", _v1_mount(controller), paths.get(controller), v1_file, v1_amount))
    for version, mount, path, file, amount in trees:
        if mount is None or path is None:
            continue
        for directory in _chain(mount, path):
            value = amount(directory)
            if value is not None:
                found.append(Resource(value, f"cgroup {version} {directory / file}"))
    return found


def _memory_limits() -> list[Resource]:
    """Every memory limit of this process's cgroups (v2 ``memory.max``, v1 ``memory.limit_in_bytes``), bytes."""
    return _limits(
        "memory",
        "memory.max",
        lambda directory: _number(_read(directory / "memory.max")),
        "memory.limit_in_bytes",
        lambda directory: _number(_read(directory / "memory.limit_in_bytes")),
    )


def _cpu_limits() -> list[Resource]:
    """Every CPU quota of this process's cgroups (v2 ``cpu.max``, v1 ``cpu.cfs_quota_us / cpu.cfs_period_us``), in
    CPUs."""

    def v2(directory: Path) -> float | None:
        parts = (_read(directory / "cpu.max") or "").split()
        return _ratio(*parts) if len(parts) == 2 else None

    def v1(directory: Path) -> float | None:
        return _ratio(_read(directory / "cpu.cfs_quota_us"), _read(directory / "cpu.cfs_period_us"))

    return _limits("cpu", "cpu.max", v2, "cpu.cfs_quota_us", v1)


def _machine_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 8 << 30


def _machine_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def available_memory() -> Resource:
    """The memory this process may use: the smallest of the machine's and its cgroups' limits (bytes)."""
    return min([Resource(_machine_memory(), "the machine's memory"), *_memory_limits()], key=lambda r: r.amount)


def available_cpus() -> Resource:
    """The CPUs this process may use: the CPUs it may run on, or fewer under a cgroup's quota (rounded down, at
    least 1)."""
    machine = Resource(_machine_cpus(), "the CPUs this process may run on")
    smallest = min([machine, *_cpu_limits()], key=lambda r: r.amount)
    return Resource(max(1, math.floor(smallest.amount)), smallest.source)
