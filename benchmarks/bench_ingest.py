"""Ingest benchmark: ``bigrank ingest`` against the same job as one bare DuckDB SQL script and as pandas.

    .venv/bin/python -m benchmarks.bench_ingest [--rows 10M,100M] [--pandas-rows 10M] [--memory-limit 4GB]
        [--threads 2] [--workdir /work/bench-ingest] [--keep] [--no-duckdb]

    # the billion-row run (issue 48): bigrank alone, 8 GB limit; checks the disk first (~112 GB at 1B, below)
    .venv/bin/python -m benchmarks.bench_ingest --rows 1B --memory-limit 8GB --no-duckdb --pandas-rows ""

The input is a synthetic click log written by the benchmark (cached in ``--workdir``): Parquet parts of string user
ids (``user-000012345``), string item ids (``item-678``), epoch-second timestamps over two years and ratings 1-5;
user activity and item popularity are skewed: 90% of the rows have user ``U * x^2.5`` and 95% item ``I * x^3`` (x
uniform; 100 rows a user and 1,000 an item), the rest a user among rows/5 and an item among rows/20 others (a long
tail of ids seen once or twice), so there are repeated pairs and a k-core that takes several rounds. The job, as
the issue states it: dedup (the latest row of a pair), k-core 5 (users and items, to the fixed point), a global
time split (valid from 80% of the time range, test from 90%), dense ids, the splits written as Parquet.

Each job runs in its own child process (its peak RSS is its own, from ``wait4``):

* ``bigrank``: ``bigrank ingest`` (everything it does: counts, the vocabularies with original ids and counts, parts
  sorted by (user, item) with page checksums, the per-user indexes, the manifest's CRC-32s);
* ``duckdb``: the engine's floor: the job as plain SQL statements (a Python loop only to repeat the k-core pass
  until nothing changes), the splits and vocabularies written with ``COPY``;
* ``pandas``: what in-memory tools do (RecBole-style): ``read_parquet``, ``sort_values`` + ``drop_duplicates``,
  ``groupby().transform("size")`` in a loop, ``factorize``, ``to_parquet``.

The three must agree on the rows of each split (checked). Targets (issue 38): bigrank >= 0.7x the DuckDB script's
throughput at 100M rows and >= 5x pandas at 10M; peak RSS <= the memory limit + 1 GB; time per row at 100M <=
1.2x that at 10M; issue 48: 1B rows done, peak RSS <= the limit + 1 GB, <= 1,500 s. The machine's load (1-minute
average before and after each job, and the highest seen while it ran) is printed with every figure: a figure
taken beside other work is not one; compare ratios measured in one run.

Disk. Before it writes anything the benchmark checks that the workdir's disk holds what the sizes asked for need:
the log (cached, ``LOG_BYTES_PER_ROW``), the dataset and the engine's spill files (``RUN_BYTES_PER_ROW``), and
names the largest size that fits when one does not. Each job's peak disk use (the bytes of the files under its
output directory, where the engine's database and spill files live too, sampled every second) is printed, so the
figures can be checked.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BASE_TIME = 1_600_000_000
SPAN = 2 * 365 * 86_400
VALID_FROM, TEST_FROM = BASE_TIME + int(0.8 * SPAN), BASE_TIME + int(0.9 * SPAN)
PART_ROWS = 8_000_000
ROWS_PER_USER, ROWS_PER_ITEM = 100, 1_000
# Disk a size needs, bytes per row of the log: the cached log (zstd Parquet: 11.6 B/row at 100M rows), and a
# bigrank ingest's peak while it runs (its spill under --memory-limit, the splits and the per-user indexes): 9.8 GB
# at 100M rows with a 1 GB limit (measured 2026-11-28), where nearly everything spills, as it would at 1B rows
# with 8 GB; 1.7 GB with 8 GB, where little does.
LOG_BYTES_PER_ROW = 12
RUN_BYTES_PER_ROW = 100
SAMPLE_SECONDS = 1.0

GENERATE = r"""
import duckdb, sys
out, start, stop, users, items, base, span = sys.argv[1], *map(int, sys.argv[2:8])
con = duckdb.connect(config={"preserve_insertion_order": False})
con.execute("SET enable_progress_bar = false").fetchall()
uniform = lambda salt: f"((hash(range, {salt}) % 1000003) / 1000003.0)"
con.execute(f'''COPY (
  SELECT 'user-' || lpad(CAST(u AS VARCHAR), 9, '0') AS user, 'item-' || CAST(i AS VARCHAR) AS item, ts, rating FROM (
    SELECT CASE WHEN {uniform(5)} < 0.9 THEN CAST(floor(pow({uniform(1)}, 2.5) * {users}) AS BIGINT)
                ELSE {users} + CAST(floor({uniform(6)} * {stop - start} / 5) AS BIGINT) + {start} // 5 END AS u,
           CASE WHEN {uniform(7)} < 0.95 THEN CAST(floor(pow({uniform(2)}, 3.0) * {items}) AS BIGINT)
                ELSE {items} + CAST(floor({uniform(8)} * {max(1, (stop - start) // 20)}) AS BIGINT)
                     + {start} // 20 END AS i,
           {base} + CAST(hash(range, 3) % {span} AS BIGINT) AS ts,
           CAST(1 + hash(range, 4) % 5 AS DOUBLE) AS rating
    FROM range({start}, {stop}))
) TO '{out}' (FORMAT parquet, COMPRESSION zstd, ROW_GROUP_SIZE 1048576)''').fetchall()
"""

DUCKDB_SCRIPT = r"""
import duckdb, json, sys
source, out, memory, threads, temp, valid_from, test_from = sys.argv[1:8]
con = duckdb.connect(config={"memory_limit": memory, "threads": int(threads), "temp_directory": temp,
                             "preserve_insertion_order": False})
run = lambda sql: con.execute(sql).fetchall()
run("SET enable_progress_bar = false")
run(f"CREATE TABLE r AS SELECT user AS u, item AS i, ts AS t, rating AS v FROM read_parquet('{source}/*.parquet') "
    "WHERE user IS NOT NULL AND item IS NOT NULL")
run("CREATE TABLE p AS SELECT u, i, m.t AS t, m.v AS v FROM "
    "(SELECT u, i, max(struct_pack(t := t, v := v)) AS m FROM r GROUP BY u, i)")
run("DROP TABLE r")
rows, rounds = run("SELECT count(*) FROM p")[0][0], 0
while True:
    run("CREATE OR REPLACE TABLE q AS SELECT * FROM p WHERE u IN (SELECT u FROM p GROUP BY u HAVING count(*) >= 5) "
        "AND i IN (SELECT i FROM p GROUP BY i HAVING count(*) >= 5)")
    kept = run("SELECT count(*) FROM q")[0][0]
    run("DROP TABLE p"); run("ALTER TABLE q RENAME TO p")
    if kept == rows:
        break
    rows, rounds = kept, rounds + 1
run("CREATE TABLE users AS SELECT u AS original_id, (row_number() OVER (ORDER BY u) - 1)::INTEGER AS user_id "
    "FROM (SELECT DISTINCT u FROM p)")
run("CREATE TABLE items AS SELECT i AS original_id, (row_number() OVER (ORDER BY i) - 1)::INTEGER AS item_id "
    "FROM (SELECT DISTINCT i FROM p)")
counts = {}
for name, where in (("train", f"t < {valid_from}"), ("valid", f"t >= {valid_from} AND t < {test_from}"),
                    ("test", f"t >= {test_from}")):
    run(f"COPY (SELECT user_id, item_id, v::FLOAT AS rating, t AS timestamp FROM p "
        "JOIN users ON p.u = users.original_id JOIN items ON p.i = items.original_id "
        f"WHERE {where}) TO '{out}/{name}.parquet' (FORMAT parquet, COMPRESSION zstd)")
    counts[name] = run(f"SELECT count(*) FROM p WHERE {where}")[0][0]
run(f"COPY users TO '{out}/users.parquet' (FORMAT parquet)")
run(f"COPY items TO '{out}/items.parquet' (FORMAT parquet)")
print(json.dumps({"splits": counts, "rounds": rounds}))
"""

PANDAS_SCRIPT = r"""
import json, sys
import pandas as pd
source, out, valid_from, test_from = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
df = pd.read_parquet(source).dropna(subset=["user", "item"])
df = df.sort_values("ts", kind="stable").drop_duplicates(["user", "item"], keep="last")
rounds = 0
while True:
    users = df.groupby("user")["item"].transform("size")
    items = df.groupby("item")["user"].transform("size")
    keep = (users >= 5) & (items >= 5)
    if keep.all():
        break
    df, rounds = df[keep], rounds + 1
df["user_id"], user_ids = pd.factorize(df["user"], sort=True)
df["item_id"], item_ids = pd.factorize(df["item"], sort=True)
counts = {}
for name, mask in (("train", df.ts < valid_from), ("valid", (df.ts >= valid_from) & (df.ts < test_from)),
                   ("test", df.ts >= test_from)):
    part = df.loc[mask, ["user_id", "item_id", "rating", "ts"]]
    part.to_parquet(f"{out}/{name}.parquet", index=False)
    counts[name] = len(part)
pd.DataFrame({"original_id": user_ids}).to_parquet(f"{out}/users.parquet")
pd.DataFrame({"original_id": item_ids}).to_parquet(f"{out}/items.parquet")
print(json.dumps({"splits": counts, "rounds": rounds}))
"""


def parse_count(text: str) -> int:
    text = text.strip().upper()
    scale = {"K": 10**3, "M": 10**6, "B": 10**9}.get(text[-1], 1)
    return int(float(text[:-1] if text[-1] in "KMB" else text) * scale)


def machine_load() -> str:
    one, five, fifteen = os.getloadavg()
    return f"load average {one:.2f} {five:.2f} {fifteen:.2f} ({os.cpu_count()} CPUs)"


def disk_needed(sizes: list[int], workdir: Path) -> int:
    """Bytes of disk the ``sizes`` still need in ``workdir``: the logs not cached yet, and the largest run."""
    logs = sum(LOG_BYTES_PER_ROW * rows for rows in sizes if not (workdir / f"log-{rows}" / "_DONE").exists())
    return logs + RUN_BYTES_PER_ROW * max(sizes)


def check_disk(sizes: list[int], workdir: Path) -> None:
    """SystemExit naming the disk, its free space and the largest size that fits when ``sizes`` need more."""
    free = shutil.disk_usage(workdir).free
    need = disk_needed(sizes, workdir)
    if need <= free:
        print(f"disk: {free / 1e9:,.0f} GB free on {workdir}, the sizes need ~{need / 1e9:,.0f} GB", flush=True)
        return
    fits = max(1, int(0.9 * free / (LOG_BYTES_PER_ROW + RUN_BYTES_PER_ROW) // 10**8)) * 10**8  # a 10% margin
    raise SystemExit(
        f"{', '.join(f'{r:,}' for r in sizes)} rows need ~{need / 1e9:,.0f} GB of disk in {workdir} (the log "
        f"{LOG_BYTES_PER_ROW} B/row, the run {RUN_BYTES_PER_ROW} B/row) and it has {free / 1e9:,.0f} GB free: free "
        f"space, give --workdir another disk, or run --rows {fits // 10**6}M (the most that fits)"
    )


def tree_bytes(root: Path) -> int:
    """Bytes of the files under ``root`` (0 when it is not there; files that go meanwhile are skipped)."""
    total = 0
    for directory, _, files in os.walk(root):
        for name in files:
            try:
                total += os.stat(os.path.join(directory, name)).st_blocks * 512  # on the disk: sparse files too
            except OSError:
                pass
    return total


class Sampler:
    """Samples the machine's 1-minute load and the bytes under a job's directory while it runs (a thread)."""

    def __init__(self, directory: Path):
        import threading

        self.directory = directory
        self.start = self.most = tree_bytes(directory)  # what the jobs before it left there
        self.load_before = os.getloadavg()[0]
        self.highest_load = self.load_before
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.wait(SAMPLE_SECONDS):
            self.most = max(self.most, tree_bytes(self.directory))
            self.highest_load = max(self.highest_load, os.getloadavg()[0])

    def finish(self) -> dict:
        self.stop.set()
        self.thread.join()
        return {
            "disk_gb": (self.most - self.start) / 1e9,
            "load": (self.load_before, self.highest_load, os.getloadavg()[0]),
        }


def run_child(command: list[str], env=None, directory: Path | None = None) -> tuple[float, float, str, str]:
    """``(seconds, peak RSS GB, stdout, stderr)`` of a child process (its own peak RSS, from ``wait4``); with
    ``directory`` (where it writes), its peak disk use there and the machine's load are sampled meanwhile
    (``run_child.last``)."""
    import threading

    sampler = Sampler(directory) if directory is not None else None
    started = time.perf_counter()
    child = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    output = {}
    readers = [
        threading.Thread(target=lambda name=name, stream=stream: output.__setitem__(name, stream.read()))
        for name, stream in (("out", child.stdout), ("err", child.stderr))
    ]
    for reader in readers:
        reader.start()
    _, status, usage = os.wait4(child.pid, 0)
    seconds = time.perf_counter() - started
    run_child.last = sampler.finish() if sampler is not None else {}
    for reader in readers:
        reader.join()
    code = os.waitstatus_to_exitcode(status)
    child.returncode = code
    if code:
        raise SystemExit(f"{' '.join(command[:5])} … failed ({code}):\n{output['err'][-3000:]}")
    return seconds, usage.ru_maxrss / 2**20, output["out"], output["err"]


def generate(workdir: Path, rows: int) -> Path:
    """The log of ``rows`` rows (cached): Parquet parts of ``PART_ROWS`` rows."""
    directory = workdir / f"log-{rows}"
    done = directory / "_DONE"
    if done.exists():
        return directory
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(parents=True)
    users, items = max(rows // ROWS_PER_USER, 10), max(rows // ROWS_PER_ITEM, 10)
    started = time.perf_counter()
    for part, start in enumerate(range(0, rows, PART_ROWS)):
        stop = min(rows, start + PART_ROWS)
        target = directory / f"part-{part:05d}.parquet"
        args = [str(target), str(start), str(stop), str(users), str(items), str(BASE_TIME), str(SPAN)]
        subprocess.run([sys.executable, "-c", GENERATE, *args], check=True)
    done.write_text("")
    size = sum(p.stat().st_size for p in directory.glob("*.parquet")) / 1e9
    print(
        f"generated {rows:,} rows ({size:.2f} GB, {users:,} users, {items:,} items) in "
        f"{time.perf_counter() - started:.0f} s",
        flush=True,
    )
    return directory


def describe(rows: int, job: dict, limit: str) -> str:
    """One job's figures: time, rate, peak RSS against the limit, peak disk, the load around it."""
    before, highest, after = job["load"]
    return (
        f"{job['seconds']:,.1f} s ({rows / job['seconds']:,.0f} rows/s), peak RSS {job['rss']:.2f} GB "
        f"(--memory-limit {limit}), peak disk {job['disk_gb']:.1f} GB; 1-minute load {before:.2f} before, "
        f"{highest:.2f} at most, {after:.2f} after ({os.cpu_count()} CPUs)"
    )


def split_rows_of_dataset(root: Path) -> dict:
    manifest = json.loads((root / "manifest.json").read_text())
    return {name: manifest["splits"][name]["rows"] for name in ("train", "valid", "test")}, manifest


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="10M,100M", help="log sizes, comma-separated (e.g. 1M,10M,100M)")
    parser.add_argument("--pandas-rows", default="10M", help="sizes pandas runs at (it holds everything in memory)")
    parser.add_argument("--no-duckdb", action="store_true", help="skip the bare DuckDB script (bigrank alone)")
    parser.add_argument(
        "--memory-limit", default="4GB", help="DuckDB's memory limit (a size in GB), for bigrank and the script"
    )
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--workdir", default="/work/bench-ingest", help="logs (kept) and outputs (deleted)")
    parser.add_argument("--keep", action="store_true", help="keep the outputs")
    args = parser.parse_args()
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    sizes = [parse_count(s) for s in args.rows.split(",")]
    check_disk(sizes, workdir)
    pandas_sizes = {parse_count(s) for s in args.pandas_rows.split(",") if s}
    env = dict(os.environ, PYTHONPATH=str(REPO))
    limit_gb = (
        float(args.memory_limit.upper().rstrip("B").rstrip("G")) if args.memory_limit.upper().endswith("GB") else None
    )
    results = []
    for rows in sizes:
        log = generate(workdir, rows)
        print(f"\n{rows:,} rows; {machine_load()}", flush=True)
        out = workdir / f"out-{rows}"
        jobs = {}
        shutil.rmtree(out, ignore_errors=True)
        command = [
            sys.executable, "-m", "bigrank.cli", "ingest", str(log), "--out", str(out / "bigrank"),
            "--user", "user", "--item", "item", "--time", "ts", "--rating", "rating", "--dedup", "last",
            "--min-user-items", "5", "--min-item-users", "5", "--split", "time", "--valid-from", str(VALID_FROM),
            "--test-from", str(TEST_FROM), "--memory-limit", args.memory_limit, "--threads", str(args.threads),
        ]  # fmt: skip
        seconds, rss, _, err = run_child(command, env, out)
        splits, manifest = split_rows_of_dataset(out / "bigrank")
        steps = [line for line in err.splitlines() if line.startswith("[")]
        jobs["bigrank"] = {
            "seconds": seconds,
            "rss": rss,
            "splits": splits,
            "rounds": manifest["ingest"]["counts"]["k_core_rounds"],
            **run_child.last,
        }
        print("  bigrank steps:\n" + "\n".join(f"    {line}" for line in steps), flush=True)
        print(f"  bigrank: {describe(rows, jobs['bigrank'], args.memory_limit)}", flush=True)
        if not args.no_duckdb:
            (out / "duckdb").mkdir(parents=True)
            temp = out / "duckdb-spill"
            script = [sys.executable, "-c", DUCKDB_SCRIPT, str(log), str(out / "duckdb"), args.memory_limit,
                      str(args.threads), str(temp), str(VALID_FROM), str(TEST_FROM)]  # fmt: skip
            seconds, rss, stdout, _ = run_child(script, env, out)
            jobs["duckdb"] = {"seconds": seconds, "rss": rss, **json.loads(stdout), **run_child.last}
        if rows in pandas_sizes:
            (out / "pandas").mkdir(parents=True)
            script = [
                sys.executable,
                "-c",
                PANDAS_SCRIPT,
                str(log),
                str(out / "pandas"),
                str(VALID_FROM),
                str(TEST_FROM),
            ]
            seconds, rss, stdout, _ = run_child(script, env, out)
            jobs["pandas"] = {"seconds": seconds, "rss": rss, **json.loads(stdout), **run_child.last}
        for name, job in jobs.items():
            if job["splits"] != jobs["bigrank"]["splits"]:
                raise SystemExit(
                    f"{name} disagrees with bigrank on the splits: {job['splits']} vs {jobs['bigrank']['splits']}"
                )
        results.append((rows, jobs))
        if not args.keep:
            shutil.rmtree(out, ignore_errors=True)
        print(f"  splits {jobs['bigrank']['splits']}, k-core rounds {jobs['bigrank']['rounds']}", flush=True)

    print(
        f"\nbigrank ingest vs the same job (dedup, k-core 5, time split); memory limit {args.memory_limit}, "
        f"{args.threads} threads; {machine_load()}"
    )
    print(
        f"{'rows':>13}  {'job':<8} {'seconds':>9} {'rows/s':>12} {'peak RSS GB':>12} {'peak disk GB':>13} "
        f"{'load before/max/after':>22} {'bigrank speed x':>16}"
    )
    for rows, jobs in results:
        for name, job in jobs.items():
            ratio = job["seconds"] / jobs["bigrank"]["seconds"]
            load = "/".join(f"{x:.1f}" for x in job["load"])
            print(
                f"{rows:>13,}  {name:<8} {job['seconds']:>9.1f} {rows / job['seconds']:>12,.0f} {job['rss']:>12.2f} "
                f"{job['disk_gb']:>13.1f} {load:>22} {ratio:>15.2f}x"
            )
    largest, jobs = results[-1]
    if limit_gb:
        rss, seconds = jobs["bigrank"]["rss"], jobs["bigrank"]["seconds"]
        print(
            f"bigrank at {largest:,} rows: peak RSS {rss:.2f} GB against --memory-limit {args.memory_limit} + 1 GB "
            f"({'within' if rss <= limit_gb + 1 else 'OVER'}), {seconds:,.0f} s"
            + (f" ({'within' if seconds <= 1500 else 'over'} the 1,500 s target)" if largest >= 10**9 else "")
        )
    if len(results) >= 2:
        (small, a), (large, b) = results[0], results[-1]
        per_row = (b["bigrank"]["seconds"] / large) / (a["bigrank"]["seconds"] / small)
        print(f"time per row at {large:,} / at {small:,}: {per_row:.2f} (target <= 1.2)")
        slope = (b["bigrank"]["seconds"] - a["bigrank"]["seconds"]) / (large - small)
        print(
            f"projected 1B rows: {b['bigrank']['seconds'] + slope * (10**9 - large):,.0f} s "
            f"(from the {small:,}-{large:,} slope); peak RSS {max(j['bigrank']['rss'] for _, j in results):.2f} GB"
            + (f" against a limit of {limit_gb:g} GB + 1" if limit_gb else "")
        )


if __name__ == "__main__":
    main()
