"""``bigrank ingest`` at the scale it is for (issue 48): the limits of a container, the Ray driver's memory, the
hashing of ids, the cluster's reads of large files.

cgroup trees are real files in a temporary directory laid out as the kernel's (``/proc/self/cgroup`` and the
``/sys/fs/cgroup`` mounts of v1 and v2), read by the real code with its two paths pointed there.
"""

from __future__ import annotations

import os

from bigrank.data.ingest import resources
from bigrank.data.ingest.options import IngestOptions
from bigrank.data.ingest.pipeline import LocalEngine

GIB = 1 << 30


def _machine_cpus() -> int:
    return len(os.sched_getaffinity(0))


def _cgroups(monkeypatch, tmp_path, proc: str, files: dict[str, str]) -> None:
    """A cgroup tree under ``tmp_path/cgroup`` holding ``files`` (path -> text) and this process's cgroup file
    ``proc``; the reader is pointed at them."""
    root = tmp_path / "cgroup"
    for relative, text in files.items():
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text + "\n")
    root.mkdir(exist_ok=True)
    (tmp_path / "proc-self-cgroup").write_text(proc)
    monkeypatch.setattr(resources, "CGROUP_ROOT", root)
    monkeypatch.setattr(resources, "PROC_CGROUP", tmp_path / "proc-self-cgroup")


def test_a_cgroup_v2_pods_limits_set_the_defaults(monkeypatch, tmp_path):
    """A Kubernetes pod (cgroup v2): 2 GiB on the pod, none on the container, 0.5 CPU on the container. The
    ingest's DuckDB gets half of 2 GiB and one thread, and the plan line names the files."""
    _cgroups(
        monkeypatch,
        tmp_path,
        "0::/kubepods/pod-1/container-1\n",
        {
            "kubepods/pod-1/memory.max": str(2 * GIB),
            "kubepods/pod-1/container-1/memory.max": "max",
            "kubepods/pod-1/container-1/cpu.max": "50000 100000",
            "kubepods/pod-1/cpu.max": "max 100000",
        },
    )
    options = IngestOptions(user="u", item="i")
    assert options.memory_bytes() == GIB and options.thread_count() == 1
    plan = options.plan()
    assert "0.5 of 2.0 GB, cgroup v2" in plan and "kubepods/pod-1/memory.max" in plan, plan
    assert "container-1/cpu.max" in plan, plan
    engine = LocalEngine(tmp_path / "work", options)  # the store's DuckDB takes them
    con = engine.stores[0].con
    assert con.execute("SELECT current_setting('memory_limit'), current_setting('threads')").fetchall() == [
        ("1.0 GiB", 1)
    ]
    engine.close()
    # a fraction is of the pod's memory too; explicit settings win
    assert IngestOptions(memory_limit="0.25").memory_bytes() == GIB // 2
    assert IngestOptions(memory_limit="3GB", threads=4).plan().startswith("memory limit 3.0 GB (--memory-limit 3GB)")


def test_cgroup_v1_limits_and_a_namespaced_path(monkeypatch, tmp_path):
    _cgroups(
        monkeypatch,
        tmp_path,
        "5:memory:/docker/abc\n4:cpu,cpuacct:/docker/abc\n1:name=systemd:/\n",
        {
            "memory/docker/abc/memory.limit_in_bytes": str(3 * GIB),
            "memory/memory.limit_in_bytes": "9223372036854771712",  # v1's "no limit"
            "cpu,cpuacct/docker/abc/cpu.cfs_quota_us": "150000",
            "cpu,cpuacct/docker/abc/cpu.cfs_period_us": "100000",
        },
    )
    options = IngestOptions()
    assert options.memory_bytes() == 3 * GIB // 2
    assert options.thread_count() == min(1, _machine_cpus())  # 1.5 CPUs: 1 thread
    assert "cgroup v1" in options.plan() and "docker/abc/memory.limit_in_bytes" in options.plan()

    # A cgroup namespace: /proc/self/cgroup names a path the mount does not hold; the mount's root is the cgroup.
    _cgroups(monkeypatch, tmp_path / "ns", "0::/host/path/of/the/pod\n", {"memory.max": str(GIB)})
    assert IngestOptions().memory_bytes() == GIB // 2


def test_no_cgroup_limit_leaves_the_machines_figures(monkeypatch, tmp_path):
    _cgroups(
        monkeypatch, tmp_path, "0::/user.slice\n", {"user.slice/memory.max": "max", "user.slice/cpu.max": "max 100000"}
    )
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    options = IngestOptions()
    assert options.memory_bytes() == memory // 2 and options.thread_count() == _machine_cpus()
    assert "the machine's memory" in options.plan()


# ---------------------------------------------------------------------------------- the driver's memory (item 12)
def test_the_kcore_reduction_holds_one_catalog_array_whatever_the_number_of_stores(tmp_path):
    """16 stores (as 16 buckets of the cluster engine) over a catalog of 4M item codes: the driver sums the
    stores' sparse counts as they come, so the k-core's peak memory is a few catalog-sized arrays (32 MB each),
    not one per store (16 x 32 MB, then stacked again: over 1 GB before)."""
    import tracemalloc

    import pyarrow as pa
    import pyarrow.parquet as pq

    from bigrank.data.ingest.pipeline import _kcore
    from bigrank.data.ingest.sources import open_source
    from bigrank.data.ingest.store import Columns, RowStore

    num_codes, stores = 4_000_000, 16
    items = pa.table({"id": [f"i{k}" for k in range(50)], "ic": pa.array(range(50), pa.int32())})
    engine = LocalEngine(tmp_path / "work", IngestOptions(user="u", item="i", memory_limit="256MB", threads=1))
    engine.stores = []
    pairs = 0
    for store in range(stores):
        log = tmp_path / f"part-{store}.parquet"
        rows = [(f"u{store}-{k % 40}", f"i{(k * 7 + store) % 50}") for k in range(400)]
        pq.write_table(pa.table({"u": [u for u, _ in rows], "i": [i for _, i in rows]}), log)
        columns = Columns(open_source([log]), "u", "i", None, None, "s")
        engine.stores.append(RowStore(tmp_path / f"store-{store}", 256 << 20, 1))
        engine.stores[-1].load(columns.source.scan(), columns)
        pairs += engine.stores[-1].encode(items, None, "first")["merged"]
    counts: dict = {}
    options = IngestOptions(user="u", item="i", min_user_items=3, min_item_users=3)
    tracemalloc.start()
    try:
        left = _kcore(options, engine, num_codes, pairs, counts, lambda line: None)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
        engine.close()
    assert 0 < left <= pairs and counts["k_core_items_start"] == 50
    assert peak < 4 * num_codes * 8, f"{peak / 2**20:.0f} MB"


# ------------------------------------------------------------------------------------------ hashing ids (item 13)
def test_the_vectorised_xxh64_equals_xxhash_on_every_length_and_type():
    """Strings of every length 0-300 (stripes, lanes, the 4-byte and single-byte tails), non-ASCII text, one
    length or many in a chunk, string and large_string arrays, sliced ones, integers over the int64 range (their
    decimal text), and chunked arrays: the ``xxhash`` package's XXH64, id for id."""
    import random

    import numpy as np
    import pyarrow as pa
    import xxhash

    from bigrank.data.ingest.hashing import id_hashes, xxh64_texts

    def expected(texts) -> list[int]:
        return [xxhash.xxh64_intdigest(str(t).encode()) for t in texts]

    rng = random.Random(0)
    alphabet = "abcXYZ0123456789-_ üß用户é"
    texts = ["".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 300))) for _ in range(3000)]
    texts += ["q" * length for length in range(80)]
    assert xxh64_texts(pa.array(texts)).tolist() == expected(texts)
    assert xxh64_texts(pa.array(texts, pa.large_string()).slice(7, 500)).tolist() == expected(texts[7:507])
    padded = [f"user-{k:09d}" for k in range(5000)]  # one length, back to back
    assert xxh64_texts(pa.array(padded)).tolist() == expected(padded)
    ints = [0, -1, 42, 2**63 - 1, -(2**63)] + [rng.randrange(-(2**63), 2**63) for _ in range(2000)]
    assert id_hashes(np.array(ints, dtype=np.int64)).tolist() == expected(ints)
    chunked = pa.chunked_array([pa.array(texts[:100]), pa.array(texts[100:250])])
    assert id_hashes(chunked).tolist() == expected(texts[:250])


def test_hashing_ids_holds_no_python_object_per_id():
    """2M distinct ids hashed in bounded chunks of numpy arrays: the Python heap's peak stays far below what one
    str per id takes (~140 MB here; every id was a Python object before, outside DuckDB's memory limit)."""
    import tracemalloc

    import pyarrow as pa
    import pyarrow.compute as pc

    from bigrank.data.ingest.hashing import id_hashes

    ids = pc.binary_join_element_wise("user-", pc.cast(pa.array(range(2_000_000)), pa.string()), "")
    tracemalloc.start()
    try:
        hashes = id_hashes(ids)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert len(set(hashes[:100_000].tolist())) == 100_000
    assert peak < 64 << 20, f"{peak / 2**20:.0f} MB"


# ------------------------------------------------------------------------ one large file, many read tasks (item 14)
def test_a_large_parquet_file_is_read_by_every_cpu_in_ranges_of_row_groups(tmp_path):
    """One Parquet file of 8 row groups on a cluster of 4 CPUs: 4 read tasks each read a range of whole row groups
    (the read tasks' body, run here without Ray), and together they read every row once; a CSV file of the same
    size stays one unit (a text file is read whole)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from bigrank.data.ingest.cluster import file_groups, piece_path, read_into_buckets, read_units
    from bigrank.data.ingest.sources import open_source
    from bigrank.data.ingest.store import Columns

    rows = 80_000
    table = pa.table(
        {"user": [f"u{(k * 7919) % 5000}" for k in range(rows)], "item": [f"i{k % 300}" for k in range(rows)]}
    )
    small = tmp_path / "small.parquet"
    pq.write_table(table.slice(0, 500), small)
    large = tmp_path / "large.parquet"
    pq.write_table(table, large, row_group_size=rows // 8)
    units, sizes = read_units([str(large), str(small)], "parquet", 4)
    ranges = [unit for unit in units if isinstance(unit, tuple)]
    assert len(ranges) >= 4 and str(small) in units
    assert [(first, end) for _, first, end in ranges] == [
        (first, end)
        for first, end in zip([0] + [end for _, _, end in ranges[:-1]], [end for *_, end in ranges], strict=True)
    ]  # back to back
    assert ranges[-1][2] == rows and all(first % (rows // 8) == 0 for _, first, _ in ranges)
    groups = file_groups(units, sizes, 4)
    assert len(groups) == 4

    source = open_source([large, small])
    columns = Columns(source, "user", "item", None, None, "s")
    work = tmp_path / "work"
    read = [read_into_buckets(columns, group, 3, str(work), task, 1 << 28)["rows"] for task, group in enumerate(groups)]
    assert sum(read) == rows + 500 and min(read) > 0
    pieces = pa.concat_tables(
        [pq.read_table(piece_path(work, task, bucket)) for task in range(len(groups)) for bucket in range(3)]
    )
    got = sorted(zip(pieces.column("u").to_pylist(), pieces.column("i").to_pylist(), strict=True))
    whole = pa.concat_tables([table, table.slice(0, 500)])
    assert got == sorted(zip(whole.column("user").to_pylist(), whole.column("item").to_pylist(), strict=True))

    csv = tmp_path / "large.csv"
    csv.write_text("user,item\n" + "".join(f"u{k},i{k}\n" for k in range(rows)))
    assert read_units([str(csv)], "csv", 4) == ([str(csv)], [csv.stat().st_size])
