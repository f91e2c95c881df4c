"""What ``bigrank ingest`` reads (issue 48): file names DuckDB would take for globs, numeric times in any epoch unit,
unsigned 64-bit ids, items files and logs in any delimiter, id text beyond 32-bit Arrow offsets.

Each test ingests real files with the real engine (DuckDB; the cluster engine's read-task body without Ray) and
checks the dataset's rows, or the one error line a user gets.
"""

from __future__ import annotations

import pyarrow.parquet as pq

from bigrank.data import manifest as layout
from bigrank.data.ingest import IngestOptions, ingest
from bigrank.data.ingest.cluster import StoreActor, piece_path, read_into_buckets
from bigrank.data.ingest.sources import open_source
from bigrank.data.ingest.store import Columns
from tests.test_ingest import _ingest_cli, _one_error, read_dataset


def _original_pairs(root) -> set[tuple]:
    """Every (original user, original item) pair of every split of the dataset ``root``."""
    got = read_dataset(root)
    users = got["users"].column("original_id").to_pylist()
    items = got["items"].column("original_id").to_pylist()
    return {(users[u], items[i]) for rows in got["splits"].values() for u, i, *_ in rows}


# ------------------------------------------------------------------------------------- glob characters (item 1)
GLOB_NAMES = ["a[1].csv", "a1.csv", "b*.csv", "bx.csv", "c?.csv", "cz.csv", "d[!1].csv", "e]f.csv"]


def _glob_named_files(directory) -> dict[str, set]:
    """One CSV per name of ``GLOB_NAMES`` in ``directory`` (itself named with brackets), each with its own users:
    read as globs, ``a[1].csv`` would read ``a1.csv``, ``b*.csv`` both b files, and so on."""
    directory.mkdir(parents=True)
    pairs = {}
    for k, name in enumerate(GLOB_NAMES):
        rows = [(f"user-{k}-{j}", f"item-{j}") for j in range(6)]
        (directory / name).write_text("user,item\n" + "".join(f"{u},{i}\n" for u, i in rows))
        pairs[name] = set(rows)
    return pairs


def test_file_names_with_glob_characters_are_read_as_the_files_they_name(tmp_path):
    pairs = _glob_named_files(tmp_path / "logs")
    every = set().union(*pairs.values())
    options = IngestOptions(user="user", item="item", fractions=(0.5, 0.25, 0.25), progress=False)

    ingest([tmp_path / "logs"], tmp_path / "all", options)
    assert _original_pairs(tmp_path / "all") == every
    assert layout.load_manifest(tmp_path / "all")["ingest"]["counts"]["rows_read"] == len(every)

    ingest([tmp_path / "logs" / "a[1].csv"], tmp_path / "one", options)  # one file, named exactly
    assert _original_pairs(tmp_path / "one") == pairs["a[1].csv"]

    (tmp_path / "logs").rename(tmp_path / "logs[2024]")  # a directory whose own name holds brackets
    ingest([tmp_path / "logs[2024]"], tmp_path / "bracketed", options)
    assert _original_pairs(tmp_path / "bracketed") == every


def test_the_cluster_read_tasks_and_stores_read_glob_named_files_as_named(tmp_path):
    """The read tasks' body (run here, without Ray) and a store's load of its pieces, under a work directory
    whose name holds brackets."""
    pairs = _glob_named_files(tmp_path / "in")
    source = open_source([tmp_path / "in"])
    columns = Columns(source, "user", "item", None, None, 1000)
    work = tmp_path / "out[x]" / ".ingest"
    done = read_into_buckets(columns, list(source.files), 2, str(work), 0, 1 << 28)
    assert done["rows"] == sum(len(p) for p in pairs.values())
    options = IngestOptions(user="user", item="item", progress=False)
    users = set()
    for bucket in range(2):
        store = StoreActor(str(work / f"store-{bucket}"), options, 2, 1, str(tmp_path))
        counts = store.load_pieces([str(piece_path(work, 0, bucket))], False, False, None)
        users |= {u for (u,) in store.store.con.execute("SELECT u FROM raw").fetchall()}
        store.close()
        assert counts["rows_read"] == pq.read_table(piece_path(work, 0, bucket)).num_rows
    assert users == {u for p in pairs.values() for u, _ in p}


def test_a_glob_matches_files_and_a_path_duckdb_cannot_name_is_one_error(tmp_path, capsys):
    pairs = _glob_named_files(tmp_path / "logs")
    options = IngestOptions(user="user", item="item", fractions=(0.5, 0.25, 0.25), progress=False)
    ingest([str(tmp_path / "logs" / "c*.csv")], tmp_path / "globbed", options)  # not a file: a glob
    assert _original_pairs(tmp_path / "globbed") == pairs["c?.csv"] | pairs["cz.csv"]

    odd = tmp_path / "back\\slash[1].csv"
    odd.write_text("user,item\nu,i\n")
    code, err = _ingest_cli(capsys, odd, "--user", "user", "--item", "item", "--out", tmp_path / "out")
    assert code == 2 and "backslash" in _one_error(err) and "rename" in err
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())
