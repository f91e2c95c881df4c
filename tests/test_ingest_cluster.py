"""The cluster engine of `bigrank ingest` (``bigrank.data.ingest.cluster``) on a real local 2-node Ray cluster
(`cluster/local_cluster.sh start --worker`: a head and a worker node on 127.0.0.1 with token authentication, one CPU
each): for the same input and options it writes the dataset one machine writes (identical users.parquet,
items.parquet, and the rows of every split in order) with string ids, integer ids read as text, duplicates, null
and empty ids, a k-core of several rounds and each split mode; SIGINT/SIGTERM stop it (actors gone, no manifest,
the same command then works); a file that cannot be read is the one-line error naming it. Without Ray: the read
step's bucketing, the placement of the buckets and the grouping of the files. No wall-clock asserts."""

from __future__ import annotations

import gzip
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from bigrank.cli import main
from bigrank.data.ingest.cluster import default_buckets, file_groups, piece_path, place, read_into_buckets
from bigrank.data.ingest.hashing import bucket_of, id_hashes
from bigrank.data.ingest.sources import open_source
from bigrank.data.ingest.store import Columns
from bigrank.train.launcher import free_ports

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
SCRIPT = REPO / "cluster" / "local_cluster.sh"
COLUMNS = ["--user", "user", "--item", "item", "--time", "ts", "--rating", "rating"]


# ------------------------------------------------------------------------------------------------ the input
def _interactions(seed: int, chain: int) -> dict[str, list]:
    """A log of ~3,000 rows: 150 users and 120 items drawn with skew, every fourth row repeated at another time
    and rating (duplicates), 25 rows without a user and 25 with an empty item, and a chain
    item - user - item - … whose end joins the popular items: a k-core of 2 peels it one user or item a round, so it
    takes about ``2 * chain`` rounds."""
    rng = np.random.default_rng(seed)
    n = 2400
    users = [f"user-{k}" for k in rng.zipf(1.3, n) % 150]
    items = [f"sku-{j:03d}" for j in rng.zipf(1.5, n) % 120]
    times = (1_600_000_000 + rng.integers(0, 30_000_000, n)).tolist()
    ratings = rng.integers(1, 6, n).astype(float).tolist()  # integers: a sum is the same in any order
    again = rng.choice(n, n // 4, replace=False)
    users += [users[k] for k in again]
    items += [items[k] for k in again]
    times += (1_600_000_000 + rng.integers(0, 30_000_000, len(again))).tolist()
    ratings += rng.integers(1, 6, len(again)).astype(float).tolist()
    for k in range(chain):
        users += [f"chain-user-{k}", f"chain-user-{k}"]
        items += [f"chain-item-{k}", f"chain-item-{k + 1}" if k + 1 < chain else "sku-000"]
        times += [1_600_000_000 + 1000 * k, 1_600_000_500 + 1000 * k]
        ratings += [3.0, 4.0]
    for k in range(25):
        users += [None, f"user-{k}"]
        items += [f"sku-{k:03d}", ""]
        times += [1_610_000_000 + k, 1_610_000_100 + k]
        ratings += [5.0, 5.0]
    order = rng.permutation(len(users))
    return {
        "user": [users[k] for k in order],
        "item": [items[k] for k in order],
        "ts": [times[k] for k in order],
        "rating": [ratings[k] for k in order],
    }


def _numeric(ids: list, base: int) -> list:
    """String ids as integers (``user-17`` -> base + 17; chain ids above the others), None and "" kept."""
    out = []
    for value in ids:
        if not value:
            out.append(value)
            continue
        number = int(re.sub(r"\D", "", value))
        out.append(base + (100_000 if value.startswith("chain") else 0) + number)
    return out


def write_log(root: Path, fmt: str, chain: int = 3, seed: int = 0, parts: int = 5) -> Path:
    """The log of :func:`_interactions` in ``parts`` files under ``root``: Parquet with string ids, or gzip CSV with
    integer ids (read as text, so the engines hash their text and rank them as integers)."""
    log = _interactions(seed, chain)
    root.mkdir(parents=True)
    n = len(log["user"])
    for part in range(parts):
        rows = slice(part * n // parts, (part + 1) * n // parts)
        if fmt == "parquet":
            table = pa.table({name: values[rows] for name, values in log.items()})
            pq.write_table(table, root / f"part-{part}.parquet")
            continue
        users, items = _numeric(log["user"][rows], 1000), _numeric(log["item"][rows], 70_000)
        lines = ["user,item,ts,rating"]
        for user, item, ts, rating in zip(users, items, log["ts"][rows], log["rating"][rows], strict=True):
            lines.append(f"{'' if user is None else user},{item},{ts},{rating:g}")
        with gzip.open(root / f"part-{part}.csv.gz", "wt") as handle:
            handle.write("\n".join(lines) + "\n")
    return root


# -------------------------------------------------------------------------------------------- the cluster
@dataclass
class Cluster:
    gcs: str  # 127.0.0.1:PORT, for --address
    dashboard: str  # http://127.0.0.1:PORT, for the State API
    env: dict  # HOME holds the head's token (bigrank reads ~/.ray/auth_token)


def _env(home: Path, **extra) -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    env["HOME"] = str(home)
    for name in ("RAY_ADDRESS", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        env.pop(name, None)
    env.update(extra)
    return env


def _active_nodes(gcs: str, env: dict) -> int:
    done = subprocess.run(
        [str(BIN / "ray"), "status", "--address", gcs],
        env={**env, "RAY_AUTH_MODE": "token"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    active = done.stdout.split("Active:", 1)[-1].split("Pending:", 1)[0]
    return len(re.findall(r"^\s*\d+ node_", active, flags=re.M))


@pytest.fixture(scope="module")
def cluster():
    """`cluster/local_cluster.sh start --worker` (head + worker node on loopback, 1 CPU each) in a state directory
    and a HOME of its own (the token); `stop` in teardown ends both nodes' process groups, whatever happened."""
    state = Path(tempfile.mkdtemp(prefix="bigrank-ingest-", dir="/tmp"))  # short: Ray's socket paths are limited
    gcs_port, dashboard_port = free_ports(2)
    (state / "home").mkdir()
    env = _env(
        state / "home",
        BIGRANK_RAY_DIR=str(state / "ray"),
        RAY_PORT=str(gcs_port),
        DASHBOARD_PORT=str(dashboard_port),
        HEAD_CPUS="1",
        WORKER_CPUS="1",
    )
    try:
        started = subprocess.run(
            ["bash", str(SCRIPT), "start", "--worker"], env=env, capture_output=True, text=True, timeout=300
        )
        assert started.returncode == 0, started.stdout + started.stderr
        gcs = f"127.0.0.1:{gcs_port}"
        deadline = time.monotonic() + 180
        while _active_nodes(gcs, env) < 2:  # the worker registers with the head some seconds after it starts
            if time.monotonic() > deadline:
                log = (state / "ray" / "worker.log").read_text()[-3000:]
                pytest.fail(f"the worker node did not join the head:\n{started.stdout}{started.stderr}\n{log}")
            time.sleep(2)
        yield Cluster(gcs, f"http://127.0.0.1:{dashboard_port}", env)
    finally:
        subprocess.run(["bash", str(SCRIPT), "stop"], env=env, capture_output=True, timeout=120)
        shutil.rmtree(state, ignore_errors=True)


def _ray_ingest(cluster: Cluster, args: list[str], cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(BIN / "bigrank"), "ingest", *args, "--address", cluster.gcs],
        cwd=cwd,
        env=cluster.env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def _store_actors(cluster: Cluster) -> list[dict]:
    done = subprocess.run(
        [str(BIN / "ray"), "list", "actors", "--address", cluster.dashboard, "--format", "json", "--limit", "10000"],
        env={**cluster.env, "RAY_AUTH_MODE": "token"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return [actor for actor in json.loads(done.stdout) if actor["class_name"] == "StoreActor"]


# ------------------------------------------------------------------------------------------- the comparison
def _rows(root: Path, manifest: dict, split: str) -> pa.Table:
    return pa.concat_tables([pq.read_table(root / name) for name in manifest["splits"][split]["files"]])


def assert_same_dataset(local: Path, cluster_out: Path) -> dict:
    """The two datasets hold the same vocabularies, the same rows of every split in order and the same counts;
    returns the cluster's manifest."""
    want = json.loads((local / "manifest.json").read_text())
    got = json.loads((cluster_out / "manifest.json").read_text())
    for name in ("users.parquet", "items.parquet"):
        expected, actual = pq.read_table(local / name), pq.read_table(cluster_out / name)
        assert actual.equals(expected), (name, actual.slice(0, 5).to_pylist(), expected.slice(0, 5).to_pylist())
    for split in ("train", "valid", "test"):
        expected, actual = _rows(local, want, split), _rows(cluster_out, got, split)
        assert actual.num_rows == expected.num_rows > 0, split
        assert actual.equals(expected), split
    for key in ("num_users", "num_items", "num_ratings"):
        assert got[key] == want[key], key
    for key in ("counts", "split", "id_types", "columns", "options"):
        assert got["ingest"][key] == want["ingest"][key], key
    assert (want["ingest"]["engine"], got["ingest"]["engine"]) == ("duckdb", "ray")
    return got


# ------------------------------------------------------------------------------------------------- the tests
SPLITS = {
    # split mode: (input format, options, --buckets)
    "random": ("parquet", ["--split", "random", "--seed", "7", "--min-rating", "2"], 3),
    "last": ("csv", ["--split", "last", "--fractions", "0.7,0.15,0.15"], None),
    "time": (
        "parquet",
        ["--split", "time", "--valid-from", "1618000000", "--test-from", "1624000000", "--dedup", "sum"],
        5,
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("split", sorted(SPLITS))
def test_the_cluster_writes_the_dataset_one_machine_writes(cluster, tmp_path, split, capsys):
    fmt, options, buckets = SPLITS[split]
    log = write_log(tmp_path / "log", fmt)
    args = [str(log), *COLUMNS, "--min-user-items", "2", "--min-item-users", "2", *options, "--no-progress"]
    assert main(["ingest", *args, "--out", str(tmp_path / "local")]) == 0
    capsys.readouterr()
    # --out relative to the driver's directory: the stores on the other node write the same place.
    more = ["--buckets", str(buckets)] if buckets else []
    done = _ray_ingest(cluster, [*args[:-1], "--out", "ray", *more], cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-4000:]
    manifest = assert_same_dataset(tmp_path / "local", tmp_path / "ray")
    counts = manifest["ingest"]["counts"]
    # The input exercises what it should: duplicates, null ids, a k-core of several rounds.
    assert counts["merged_duplicates"] > 500 and counts["dropped_null_user"] == 25, counts
    assert counts["dropped_null_item"] == 25 and counts["k_core_rounds"] >= 4, counts
    assert manifest["ingest"]["id_types"] == (
        {"user": "int64", "item": "int64"} if fmt == "csv" else {"user": "string", "item": "string"}
    )
    # It ran on both nodes, with the buckets asked for (default: the cluster's 2 CPUs).
    said = [line for line in done.stderr.splitlines() if "node(s)" in line]
    assert f"{buckets or 2} bucket(s) of users" in said[0], said
    assert f"{buckets or 2} store(s) on 2 node(s)" in done.stderr, said
    assert re.search(r"read tasks done: [\d,]+ rows from 5 file\(s\) in 2 task\(s\)", done.stderr), done.stderr
    assert not (tmp_path / "ray" / ".ingest").exists()


def _until(process: subprocess.Popen, pattern: str, seen: list[str]) -> None:
    """Read the process's stderr lines into ``seen`` until one matches ``pattern``."""
    for line in process.stderr:
        seen.append(line)
        if re.search(pattern, line):
            return
    pytest.fail(f"the ingest ended before printing {pattern!r}:\n{''.join(seen)[-4000:]}")


@pytest.mark.slow
def test_sigint_or_sigterm_stops_a_cluster_ingest_and_the_same_command_then_works(cluster, tmp_path):
    """A chain of 60 users makes a k-core of ~120 rounds, each a few calls on every store: a signal after the
    3rd round (SIGINT) or as soon as the read starts (SIGTERM: actors starting, read tasks running) finds work
    left. The ingest stops at once: no line of the steps after the k-core, exit status 130/143 with one line, no
    manifest, nothing left in --out, every store actor of the run dead; then the same command writes the
    dataset one machine writes."""
    log = write_log(tmp_path / "log", "parquet", chain=60)
    out = tmp_path / "out"
    args = [str(log), *COLUMNS, "--min-user-items", "2", "--min-item-users", "2", "--out", str(out)]
    args += ["--address", cluster.gcs, "--buckets", "3"]
    for signum, after, status, said in (
        (signal.SIGINT, r"k-core round 3:", 130, "bigrank ingest: interrupted"),
        (signal.SIGTERM, r"reading 5 parquet file", 143, "bigrank ingest: stopped by SIGTERM"),
    ):
        before = {actor["actor_id"] for actor in _store_actors(cluster)}
        process = subprocess.Popen(
            [str(BIN / "bigrank"), "ingest", *args], env=cluster.env, stderr=subprocess.PIPE, text=True
        )
        seen: list[str] = []
        try:
            _until(process, after, seen)
            process.send_signal(signum)
            rest = process.communicate(timeout=300)[1]
        finally:
            process.kill()
        printed = "".join(seen) + rest
        assert process.returncode == status, printed[-4000:]
        assert rest.strip().splitlines()[-1] == said, rest[-4000:]
        assert "Traceback" not in printed and "vocabularies:" not in printed, printed[-4000:]
        assert not (out / "manifest.json").exists() and list(out.iterdir()) == [], list(out.iterdir())
        ours = [actor for actor in _store_actors(cluster) if actor["actor_id"] not in before]
        assert all(actor["state"] == "DEAD" for actor in ours), ours
        assert len(ours) == 3 or signum == signal.SIGTERM, ours  # SIGTERM may come before they are created
        for actor in ours:  # the processes too (none for an actor killed before its process started: pid 0)
            if int(actor["pid"]):
                with pytest.raises(ProcessLookupError):
                    os.kill(int(actor["pid"]), 0)

    done = subprocess.run(
        [str(BIN / "bigrank"), "ingest", *args, "--no-progress"], env=cluster.env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-4000:]
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["ingest"]["counts"]["k_core_rounds"] > 100, manifest["ingest"]["counts"]
    assert main(["ingest", *args[: args.index("--out") + 1], str(tmp_path / "local"), "--no-progress"]) == 0
    assert_same_dataset(tmp_path / "local", out)


@pytest.mark.slow
def test_a_file_a_read_task_cannot_read_is_one_line_naming_it(cluster, tmp_path):
    """A Parquet part whose footer is fine (the driver reads every footer first) but whose pages are not: the
    read task that meets it fails, and the user sees the local reader's one line naming the file, exit status 2,
    no Ray traceback, no manifest."""
    log = write_log(tmp_path / "log", "parquet")
    bad = log / "part-3.parquet"
    data = bytearray(bad.read_bytes())
    data[100:600] = b"Z" * 500  # inside the first column chunk's pages
    bad.write_bytes(bytes(data))
    open_source([str(log)])  # the footers still read
    done = _ray_ingest(cluster, [str(log), *COLUMNS, "--out", str(tmp_path / "out")])
    assert done.returncode == 2, done.stderr[-4000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith(f"bigrank ingest: error: cannot read {bad}: "), done.stderr[-4000:]
    assert "Traceback" not in done.stderr and "RayTaskError" not in done.stderr, done.stderr[-4000:]
    assert not (tmp_path / "out" / "manifest.json").exists()


@pytest.mark.slow
def test_one_large_parquet_file_is_read_by_both_nodes_with_the_same_result(cluster, tmp_path, capsys):
    """A single Parquet file of many row groups (one task read it all before, on one core): cut into ranges of
    row groups, read by a task on each node, and the dataset is the one one machine writes."""
    log = write_log(tmp_path / "parts", "parquet", chain=3)
    table = pa.concat_tables([pq.read_table(part) for part in sorted(log.glob("*.parquet"))])
    (tmp_path / "one").mkdir()
    pq.write_table(table, tmp_path / "one" / "log.parquet", row_group_size=300)
    args = [str(tmp_path / "one" / "log.parquet"), *COLUMNS, "--min-user-items", "2", "--split", "random"]
    assert main(["ingest", *args, "--out", str(tmp_path / "local"), "--no-progress"]) == 0
    capsys.readouterr()
    done = _ray_ingest(cluster, [*args, "--out", str(tmp_path / "ray")])
    assert done.returncode == 0, done.stderr[-4000:]
    cut = r"from 1 file\(s\) \(large Parquet files cut into 2 ranges of row groups\) in 2 task\(s\) on 2 node"
    assert re.search(cut, done.stderr), done.stderr
    assert_same_dataset(tmp_path / "local", tmp_path / "ray")


# ------------------------------------------------------------------------------------------------ no Ray
def test_a_read_puts_every_user_in_the_bucket_of_its_hash(tmp_path):
    """read_into_buckets (the read tasks' body, run here): every row lands in exactly one piece, a user's rows all
    in bucket ``bucket_of(xxh64(id), B)``, the null user's in bucket 0; a bucket without rows still gets a piece."""
    log = write_log(tmp_path / "log", "parquet", parts=2)
    source = open_source([str(log)])
    columns = Columns(source, "user", "item", "ts", "rating", "s")
    buckets = 40  # more buckets than some pieces have users: empty pieces
    done = read_into_buckets(columns, list(source.files), buckets, str(tmp_path / "work"), 0, 1 << 28)
    assert done["rows"] == pq.read_table(log).num_rows and done["node"] is None
    seen = 0
    empty = 0
    for bucket in range(buckets):
        piece = pq.read_table(piece_path(tmp_path / "work", 0, bucket))
        assert piece.column_names == ["u", "i", "t", "v", "bad"]
        seen += piece.num_rows
        empty += piece.num_rows == 0
        users = piece.column("u")
        known = users.drop_null()
        assert (bucket_of(id_hashes(known), buckets) == bucket).all(), bucket
        assert users.null_count == (25 if bucket == 0 else 0)
    assert seen == done["rows"] and empty > 0


def test_buckets_follow_the_nodes_cpus():
    cpus = {"node-a": 3, "node-b": 1}
    assert default_buckets(cpus) == 4
    assert sorted(place(cpus, 4)) == ["node-a"] * 3 + ["node-b"]
    eight = place(cpus, 8)
    assert eight.count("node-a") == 6 and eight.count("node-b") == 2
    assert place({"only": 2}, 3) == ["only"] * 3


def test_files_are_grouped_by_bytes():
    groups = file_groups(["a", "b", "c", "d", "e"], [100, 10, 60, 50, 5], 2)
    assert groups == [["a", "b", "e"], ["c", "d"]]  # 115 and 110 bytes, each in input order
    assert file_groups(["a", "b"], [1, 1], 8) == [["a"], ["b"]]  # no more groups than files
