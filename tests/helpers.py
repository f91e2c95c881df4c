"""Helpers shared by several test modules (fixtures are in ``tests/conftest.py``): the processes of a command
started in a session of its own and how they end, the listening sockets of processes, small Parquet datasets,
random exports and a stdlib server over one, and a CLI with a command that ends as a stopped one does.

``benchmarks/bench_stop.py`` starts and signals the commands with the same helpers, to time what the tests only
check the outcome of."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]

# ---------------------------------------------------------------------------------------------- processes
# How long a test waits for a signalled command, and then for each process it started, to end before it calls
# them hung. A guard against a hang on a loaded machine (2 cores shared by several test runs), not a speed claim:
# what a test checks is that they end, with the right status and no orphan; benchmarks/bench_stop.py prints how
# promptly they do.
HANG_GUARD_S = 180.0


def start_command(
    log: Path, *args: str, env: Mapping[str, str] | None = None, runner: tuple[str, ...] = ("-m", "bigrank.cli")
) -> subprocess.Popen:
    """``python -m bigrank.cli ARGS…`` (this checkout first on the path) in a new session, so its own process
    group, with SIGINT as a terminal gives it; stdout and stderr to ``log``. ``runner``: what Python runs instead
    of ``-m bigrank.cli`` (a script that wraps it)."""
    env = dict(env or os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    command = [sys.executable, *runner, *args]
    with open(log, "w") as out:
        return subprocess.Popen(
            command,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=REPO,
            start_new_session=True,
            preexec_fn=as_from_a_terminal,
        )


def as_from_a_terminal() -> None:
    """In the child before exec: SIGINT as a command typed at a terminal has it. A shell runs background jobs
    (`make test &`, CI scripts) with SIGINT ignored, which their children inherit; Python then installs no
    KeyboardInterrupt handler, and a Ctrl+C test would test the shell instead of bigrank."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def group_processes(pgid: int, field: int = 2) -> list[int]:
    """The live (not zombie) processes of process group ``pgid``, read from /proc (``field`` 3: of session
    ``pgid`` instead, which also holds processes that made a group of their own, as Ray's workers do)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # gone meanwhile
            continue
        fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) ": state ppid pgrp session ...
        if fields[0] != "Z" and int(fields[field]) == pgid:
            found.append(int(entry.name))
    return found


def command_line(pid: int) -> str:
    """The command line of a live process ("" once it is gone or a zombie)."""
    try:
        if (Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split() or ["Z"])[0] == "Z":
            return ""
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def kill_group(pgid: int) -> None:
    """Test hygiene: SIGKILL whatever is left of a process group, and of the session it leads (Ray's workers and
    the HAProxy they start make groups of their own); nothing, when the code under test works."""
    for pid in [*group_processes(pgid), *group_processes(pgid, field=3)]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def wait_for_line(proc: subprocess.Popen, log: Path, text: str, timeout: float = HANG_GUARD_S) -> None:
    """Wait until ``text`` appears in the command's output (fails when the command ends before)."""
    deadline = time.monotonic() + timeout
    while text not in log.read_text():
        if proc.poll() is not None or time.monotonic() > deadline:
            pytest.fail(f"no {text!r} in the output (exit status {proc.returncode}):\n{log.read_text()}")
        time.sleep(0.05)


def _outlives_its_command(pid: int) -> bool:
    """Whether ``pid``, seen alive after its command ended, still runs (not ended since: its command line is
    still there) and is not multiprocessing's resource tracker, which ends only once the last process sharing its
    pipe has closed it, so right after the command."""
    line = command_line(pid)
    return bool(line) and "multiprocessing.resource_tracker" not in line


def assert_ends(
    proc: subprocess.Popen, log: Path, status: int, *, session: bool = False, reaps_children: bool = False
) -> None:
    """Wait for the signalled command ``proc`` (started by :func:`start_command`) to exit, assert its exit
    ``status``, then wait for every process of its process group (``session``: of its session, Ray's processes
    included) to end. Each wait is bounded by ``HANG_GUARD_S`` only.

    ``reaps_children``: the command waits for the processes it started before it exits (the local launcher,
    ``bigrank evaluate`` and ``export`` do), so any of them still alive once it has exited is an orphan, whether
    or not it would end later on its own; only multiprocessing's resource tracker may outlive it."""
    try:
        code = proc.wait(timeout=HANG_GUARD_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the command still runs {HANG_GUARD_S:.0f} s after the signal (a hang):\n{log.read_text()}")
    assert code == status, f"exit status {code}, expected {status}:\n{log.read_text()}"
    field = 3 if session else 2
    if reaps_children:
        orphans = [pid for pid in group_processes(proc.pid, field) if _outlives_its_command(pid)]
        assert not orphans, f"processes that outlived the command: {_described(orphans)}\n{log.read_text()}"
    assert_group_ends(proc.pid, field)


def assert_group_ends(pgid: int, field: int = 2) -> None:
    """Wait for every process of group ``pgid`` (``field`` 3: of that session) to end, up to ``HANG_GUARD_S``."""
    deadline = time.monotonic() + HANG_GUARD_S
    while (left := group_processes(pgid, field)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not left, f"processes still alive {HANG_GUARD_S:.0f} s after the command ended: {_described(left)}"


def _described(pids: list[int]) -> list[str]:
    return [f"{pid} {command_line(pid)[:160]}" for pid in pids]


# ------------------------------------------------------------------------------------------------- sockets
LOOPBACK = {"127.0.0.1", "::1", "::ffff:127.0.0.1"}


def _listening() -> dict[int, tuple[str, int]]:
    """Socket inode -> (address, port) of every listening TCP socket in this network namespace."""
    found = {}
    for path, family in (("/proc/net/tcp", socket.AF_INET), ("/proc/net/tcp6", socket.AF_INET6)):
        try:
            lines = Path(path).read_text().splitlines()[1:]
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


def listeners_of(pids) -> list[tuple[str, int, str]]:
    """(address, port, process title) of each listening TCP socket of the processes ``pids``."""
    sockets, result = _listening(), set()
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
            title = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
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


# ------------------------------------------------------------------------------------------------ datasets
def random_split(rng: np.random.Generator, users: np.ndarray, items: np.ndarray) -> dict[str, tuple]:
    """``{split: (users, items)}``: the pairs split 80/10/10 at random, as bigrank's generator splits them."""
    from bigrank.data import manifest as layout

    labels = layout.random_split_labels(rng, len(users))
    return {split: (users[labels == label], items[labels == label]) for label, split in enumerate(layout.SPLITS)}


def write_dataset(
    root: Path,
    splits: Mapping[str, tuple[np.ndarray, np.ndarray]],
    num_users: int,
    num_items: int,
    *,
    written: Mapping[str, list[str]] | None = None,
    seed: int = 0,
    generator: Mapping | None = None,
    **parts,
) -> dict:
    """A dataset in bigrank's layout: each split's ``(users, items)`` as part files (``parts``: the
    ``rows_per_file`` and ``row_group_size`` of ``manifest.write_split_parts``), then the manifest over them and
    the files of the splits in ``written``, already in place. Returns the manifest."""
    from bigrank.data import manifest as layout

    files = dict(written or {})
    for split, (users, items) in splits.items():
        files[split] = layout.write_split_parts(root, split, {"user_id": users, "item_id": items}, **parts)
    return layout.write_manifest(
        root,
        num_users=num_users,
        num_items=num_items,
        split_files=files,
        seed=seed,
        source="test",
        generator=generator or {},
    )


SMALL_USERS, SMALL_ITEMS = 60, 37


def write_small_dataset(root: Path, seed: int = 0) -> dict:
    """60 users x 37 items, 80/10/10 random split of distinct pairs, several files and row groups per split."""
    rng = np.random.default_rng(seed)
    users, items = [], []
    for user in range(SMALL_USERS):
        chosen = rng.choice(SMALL_ITEMS, size=int(rng.integers(3, 20)), replace=False)
        users += [user] * len(chosen)
        items += list(chosen)
    users, items = np.array(users, dtype=np.int32), np.array(items, dtype=np.int32)
    splits = random_split(rng, users, items)
    return write_dataset(root, splits, SMALL_USERS, SMALL_ITEMS, seed=seed, generator={"test": "tiny"},
                         rows_per_file=150, row_group_size=40)  # fmt: skip


def write_bad_dataset(root: Path) -> None:
    """The small dataset with an item id out of range in the first row group of train (read by rank 0 of 2)."""
    from bigrank.data import manifest as layout

    write_small_dataset(root)
    manifest = layout.load_manifest(root)
    name = manifest["splits"]["train"]["files"][0]
    bad_pair = {"user_id": np.array([0], np.int32), "item_id": np.array([99], np.int32)}
    layout.write_parquet_atomic(root / name, bad_pair)
    # A well-formed file whose ids the manifest does not allow (written, then described, by a buggy tool):
    # the manifest records the new file, so only the id check can catch it.
    split_files = {split: manifest["splits"][split]["files"] for split in layout.SPLITS}
    write_dataset(root, {}, SMALL_USERS, SMALL_ITEMS, written=split_files, generator={"test": "tiny"})


def write_ingested_dataset(root: Path, num_users: int, num_items: int) -> dict:
    """A train split in the layout of an ingested MovieLens set (original ids + titles), 3 ratings a user: user u
    is ``10 u + 7``, item i is movie ``1000 + 3 i`` titled ``Movie i (1999)``."""
    from bigrank.data import manifest as layout

    rng = np.random.default_rng(1)
    users = np.repeat(np.arange(num_users, dtype=np.int32), 3)
    items = rng.integers(0, num_items, size=len(users)).astype(np.int32)
    layout.write_parquet_atomic(
        root / "users.parquet",
        {"user_id": np.arange(num_users, dtype=np.int32), "original_id": 10 * np.arange(num_users) + 7},
    )
    layout.write_parquet_atomic(
        root / "items.parquet",
        {
            "item_id": np.arange(num_items, dtype=np.int32),
            "original_id": 1000 + 3 * np.arange(num_items),
            "title": np.asarray([f"Movie {i} (1999)" for i in range(num_items)], dtype=object),
        },
    )
    return write_dataset(root, {"train": (users, items)}, num_users, num_items)


# ------------------------------------------------------------------------------------------------- exports
def random_tables(num_items: int, num_users: int, dim: int = 8, seed: int = 0) -> dict:
    """Random float32 ``items``, ``users`` and ``history`` tables (drawn in that order from one generator)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    rows = {"items": num_items, "users": num_users, "history": num_items}
    return {name: torch.randn(count, dim, generator=gen) for name, count in rows.items()}


def write_export(out: Path, tables: dict, dataset_root=None, history=True, user_vectors="full", **kwargs) -> dict:
    """What `bigrank export` writes for ``tables`` from one rank (``history``: with the history table;
    ``user_vectors`` None: the users' rows are the table's, to which serving adds the mean history row)."""
    from bigrank.export.writer import export_embeddings

    return export_embeddings(
        out,
        rank=0,
        world_size=1,
        group=None,
        item_rows=(0, len(tables["items"]), tables["items"]),
        user_rows=(0, len(tables["users"]), tables["users"]),
        history_rows=(0, len(tables["history"]), tables["history"]) if history else None,
        dataset_root=dataset_root,
        model_info={
            "loss": "softmax",
            "dim": tables["items"].shape[1],
            "has_history": history,
            "user_vectors": user_vectors,
        },
        **kwargs,
    )


@contextlib.contextmanager
def stdlib_server(recommender, seen=None) -> Iterator[str]:
    """``bigrank serve``'s stdlib server of ``recommender`` on an ephemeral loopback port, in a thread; yields
    its URL; stops it after the block."""
    from bigrank.export.serve import make_server

    server = make_server(recommender, "127.0.0.1", 0, seen=seen, quiet=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield "http://{}:{}".format(*server.server_address[:2])
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


# ---------------------------------------------------------------------------------------------------- CLI
def with_stopped_command(build_parser, on_stop=None):
    """``cli.build_parser`` plus a command ``stopped`` that ends as a command stopped by SIGTERM does (after
    calling ``on_stop``)."""
    import argparse

    from bigrank.errors import Terminated

    def stopped(args):
        if on_stop is not None:
            on_stop()
        raise Terminated(signal.SIGTERM)

    def build():
        parser = build_parser()
        commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        commands.add_parser("stopped").set_defaults(func=stopped)
        return parser

    return build
