"""What ``bigrank ingest`` reads (issue 48): file names DuckDB would take for globs, numeric times in any epoch unit,
unsigned 64-bit ids, items files and logs in any delimiter, id text beyond 32-bit Arrow offsets.

Each test ingests real files with the real engine (DuckDB; the cluster engine's read-task body without Ray) and
checks the dataset's rows, or the one error line a user gets.
"""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

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
    columns = Columns(source, "user", "item", None, None, "s")
    work = tmp_path / "out[x]" / ".ingest"
    done = read_into_buckets(columns, list(source.files), 2, str(work), 0, 1 << 28)
    assert done["rows"] == sum(len(p) for p in pairs.values())
    options = IngestOptions(user="user", item="item", progress=False)
    users = set()
    for bucket in range(2):
        store = StoreActor(str(work / f"store-{bucket}"), options, 2, 1, str(tmp_path))
        counts = store.load_pieces([str(piece_path(work, 0, bucket))], False, False)
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


# ----------------------------------------------------------------------------------- times in any unit (item 5)
SECONDS = [1_700_000_000, 1_700_000_100, 1_700_086_400, 1_700_172_800]


@pytest.mark.parametrize(("unit", "scale"), [("s", 1), ("ms", 10**3), ("us", 10**6), ("ns", 10**9)])
def test_numeric_times_in_any_epoch_unit_are_read_as_that_unit(tmp_path, unit, scale):
    """Parquet int64 times and CSV text times, by size (auto) and named (--time-unit): the dataset's timestamps
    and first_seen are the same epoch seconds whatever the unit (µs read as ms once gave first_seen 1.7e12)."""
    users, items = ["a", "a", "b", "c"], ["x", "y", "x", "y"]
    times = [s * scale + (scale - 1 if scale > 1 else 0) for s in SECONDS]  # sub-second digits: floored
    pq.write_table(pa.table({"user": users, "item": items, "ts": times}), tmp_path / "log.parquet")
    lines = "".join(f"{u},{i},{t}\n" for u, i, t in zip(users, items, times, strict=True))
    (tmp_path / "log.csv").write_text("user,item,ts\n" + lines)
    for log in ("log.parquet", "log.csv"):
        for given in ("auto", unit):
            out = tmp_path / f"{log}-{given}"
            options = IngestOptions(
                user="user", item="item", time="ts", time_unit=given, fractions=(1.0, 0.0, 0.0), progress=False
            )
            manifest = ingest([tmp_path / log], out, options)
            assert manifest["ingest"]["time_unit"] == unit, (log, given)
            got = read_dataset(out)
            assert sorted(row[2] for row in got["splits"]["train"]) == SECONDS, (log, given)
            first = dict(
                zip(
                    got["users"].column("original_id").to_pylist(),
                    got["users"].column("first_seen").to_pylist(),
                    strict=True,
                )
            )
            assert first == {"a": SECONDS[0], "b": SECONDS[2], "c": SECONDS[3]}, (log, given)


def test_a_column_whose_numbers_change_unit_after_the_first_rows_is_one_error(tmp_path, capsys):
    """Auto reads the unit from the first rows; a column of seconds that holds microseconds further on is
    refused, naming --time-unit, instead of being read as dates thousands of years away."""
    rows = [f"u{k % 50},i{k % 30},{1_700_000_000 + k}\n" for k in range(12_000)]
    rows += [f"late{k},i{k},{1_700_000_000_000_000 + k}\n" for k in range(5)]
    log = tmp_path / "log.csv"
    log.write_text("user,item,ts\n" + "".join(rows))
    code, err = _ingest_cli(capsys, log, "--user", "user", "--item", "item", "--time", "ts", "--out", tmp_path / "o")
    line = _one_error(err)
    assert code == 2 and "epoch microseconds" in line and "--time-unit" in line, line
    assert not (tmp_path / "o" / layout.MANIFEST_NAME).exists()
    # a unit named for numbers too large for it (dates after the year 5138) is refused too
    code, err = _ingest_cli(
        capsys, log, "--user", "user", "--item", "item", "--time", "ts", "--time-unit", "ms", "--out", tmp_path / "o"
    )
    line = _one_error(err)
    assert code == 2 and "epoch microseconds" in line and "--time-unit ms" in line, line


# --------------------------------------------------------------------------- unsigned 64-bit ids (item 7)
def _hashed_ids(count: int, seed: int) -> list[int]:
    """``count`` distinct unsigned 64-bit ids, most of them from 2^63 on (as hashed ids are), a few small."""
    import numpy as np

    rng = np.random.default_rng(seed)
    ids = {int(x) for x in rng.integers(0, 2**64 - 1, size=count, dtype=np.uint64, endpoint=True)}
    ids |= {2**63, 2**64 - 1, 7}
    return sorted(ids)[:count]


def test_unsigned_64_bit_ids_are_kept_to_recommend(tmp_path, capsys):
    """A uint64 id column with ids from 2^63 on (exit 2 before: Arrow could not parse them as int64): the ids are
    kept as their decimal text, the same from Parquet and from CSV, the items file's uint64 key finds its items,
    and an export of the dataset answers ``bigrank recommend --user 9223372036854775808``."""
    from bigrank.cli import main
    from bigrank.export.recommend import Recommender
    from tests.id_datasets import export_random

    users, items = _hashed_ids(40, 1), _hashed_ids(25, 2)
    rows = [(users[k % 40], items[(k * 7) % 25]) for k in range(600)]
    table = pa.table(
        {"user": pa.array([u for u, _ in rows], pa.uint64()), "item": pa.array([i for _, i in rows], pa.uint64())}
    )
    pq.write_table(table, tmp_path / "log.parquet")
    (tmp_path / "log.csv").write_text("user,item\n" + "".join(f"{u},{i}\n" for u, i in rows))
    titles = pa.table({"id": pa.array(items, pa.uint64()), "title": [f"title {i}" for i in items]})
    pq.write_table(titles, tmp_path / "items.parquet")
    options = IngestOptions(user="user", item="item", items_file=str(tmp_path / "items.parquet"), item_key="id")
    options = IngestOptions(**{**options.__dict__, "progress": False})
    parquet = ingest([tmp_path / "log.parquet"], tmp_path / "from-parquet", options)
    ingest([tmp_path / "log.csv"], tmp_path / "from-csv", options)

    assert parquet["ingest"]["id_types"] == {"user": "string", "item": "string"}
    got = read_dataset(tmp_path / "from-parquet")
    assert sorted(got["users"].column("original_id").to_pylist()) == sorted(str(u) for u in users)
    assert got["items"].column("title").to_pylist() == [
        f"title {i}" for i in got["items"].column("original_id").to_pylist()
    ]
    assert _original_pairs(tmp_path / "from-parquet") == {(str(u), str(i)) for u, i in rows}
    for name in ("users.parquet", "items.parquet"):
        assert pq.read_table(tmp_path / "from-csv" / name).equals(pq.read_table(tmp_path / "from-parquet" / name))

    export_random(tmp_path / "export", tmp_path / "from-parquet", parquet["num_users"], parquet["num_items"])
    dense = Recommender(tmp_path / "export").user_from_original(str(2**63))
    assert got["users"].column("original_id")[dense].as_py() == str(2**63)
    assert main(["recommend", str(tmp_path / "export"), "--user", str(2**63), "-k", "3", "--json"]) == 0
    answer = json.loads(capsys.readouterr().out)
    assert len(answer) == 3 and all(int(row["original_id"]) in items for row in answer)


# ------------------------------------------------------------------ items files and logs in any delimiter (item 10)
LASTFM = Path(__file__).resolve().parents[1].parent / "shared" / "datasets" / "lastfm-2k"


def test_tab_separated_dat_files_and_an_items_file_are_read_as_the_log_is(tmp_path, capsys):
    """A tab-separated ``.dat`` log and items file (Last.fm's layout; ``.dat`` suggests ``::``): the delimiter is
    found in the file; a ``;`` items file with ``--items-delimiter``; the log's columns and every item's
    attributes arrive."""
    (tmp_path / "plays.dat").write_text(
        "userID\tartistID\tweight\r\n" + "".join(f"{u}\t{a}\t{u * a}\r\n" for u in range(2, 12) for a in range(1, 9))
    )
    (tmp_path / "artists.dat").write_text(
        "id\tname\turl\n" + "".join(f"{a}\tBand, {a}\thttp://x/{a}\n" for a in range(1, 9))
    )
    common = ["--user", "userID", "--item", "artistID", "--weight", "weight", "--item-key", "id", "--no-progress"]
    from bigrank.cli import main

    assert main(["ingest", str(tmp_path / "plays.dat"), "--items-file", str(tmp_path / "artists.dat"),
                 "--out", str(tmp_path / "tabs"), *common]) == 0  # fmt: skip
    got = read_dataset(tmp_path / "tabs")
    names = dict(
        zip(got["items"].column("original_id").to_pylist(), got["items"].column("name").to_pylist(), strict=True)
    )
    assert names == {a: f"Band, {a}" for a in range(1, 9)}
    assert sum(len(rows) for rows in got["splits"].values()) == 80

    (tmp_path / "artists.txt").write_text("id;name\n" + "".join(f"{a};Band {a}\n" for a in range(1, 9)))
    assert main(["ingest", str(tmp_path / "plays.dat"), "--items-file", str(tmp_path / "artists.txt"),
                 "--items-delimiter", ";", "--out", str(tmp_path / "semicolons"), *common]) == 0  # fmt: skip
    got = read_dataset(tmp_path / "semicolons")
    assert got["items"].column("name").to_pylist() == [
        f"Band {a}" for a in got["items"].column("original_id").to_pylist()
    ]
    capsys.readouterr()


@pytest.mark.skipif(not LASTFM.is_dir(), reason="../shared/datasets/lastfm-2k is absent")
def test_lastfm_ingests_with_its_artists_file(tmp_path):
    manifest = ingest(
        [LASTFM / "user_artists.dat"],
        tmp_path / "lastfm",
        IngestOptions(user="userID", item="artistID", weight="weight", items_file=str(LASTFM / "artists.dat"),
                      item_key="id", progress=False),
    )  # fmt: skip
    assert manifest["num_ratings"] == 92_834 and manifest["num_users"] == 1_892 and manifest["num_items"] == 17_632
    items = pq.read_table(tmp_path / "lastfm" / "items.parquet")
    assert items.column("name").null_count == 0 and "url" in items.column_names


# --------------------------------------------------------------- more than 2 GiB of id text (item 8)
def _ids_beyond_two_gib(tmp_path):
    """65,536 distinct ids — id k is k+1 NUL bytes — in two chunks of under 2 GiB whose text passes 2^31 bytes in
    all: the text lies in a sparse memory-mapped file, so the test holds page cache, not 2 GiB of its own."""
    import numpy as np

    lengths = np.arange(1, 65_537, dtype=np.int64)
    half = len(lengths) // 2
    path = tmp_path / "zeros"
    with path.open("wb") as handle:
        handle.truncate(int(lengths.sum()))
    data = pa.memory_map(str(path)).read_buffer()
    chunks, start = [], 0
    for part in (lengths[:half], lengths[half:]):
        offsets = np.concatenate([[0], np.cumsum(part)]).astype(np.int32)
        size = int(offsets[-1])
        chunks.append(pa.StringArray.from_buffers(len(part), pa.py_buffer(offsets), data.slice(start, size)))
        start += size
    ids = pa.chunked_array(chunks)
    assert ids.nbytes > 2**31 and all(chunk.nbytes < 2**31 for chunk in ids.chunks)
    return ids, lengths


def test_more_than_2_gib_of_id_text_is_hashed_ranked_and_kept(tmp_path):
    """Past 32-bit string offsets: the ids' hashes (xxhash's, spot-checked), their dense-id order, a child's ids
    kept against a parent holding them all (--vocab-from) and the export's id column; joining the chunks of a
    ``string`` column failed here ("offset overflow")."""
    import xxhash

    from bigrank.data.ingest.hashing import id_hashes, rank_ids
    from bigrank.data.ingest.vocab import extend_ids
    from bigrank.export.ids import as_id_array

    ids, lengths = _ids_beyond_two_gib(tmp_path)
    order = rank_ids(ids)
    assert sorted(order.tolist()) == list(range(len(lengths)))
    hashes = id_hashes(ids, distinct=True)
    for k in (0, 1, 254, 255, 256, 40_000, len(lengths) - 1):
        assert int(hashes[k]) == xxhash.xxh64_intdigest(b"\0" * int(lengths[k])), k
    assert (hashes[order][1:] >= hashes[order][:-1]).all()

    new = pa.array(["\0" * 3, "fresh", "\0" * 65_536])  # two of the parent's ids and one new
    dense, vocabulary = extend_ids(ids, new)
    assert dense.tolist() == [2, len(lengths), 65_535]
    assert len(vocabulary) == len(lengths) + 1 and vocabulary[len(lengths)].as_py() == "fresh"
    del vocabulary

    column = as_id_array(ids)  # the export's original ids: one array, 64-bit offsets
    assert len(column) == len(lengths) and column[65_535].as_py() == "\0" * 65_536
