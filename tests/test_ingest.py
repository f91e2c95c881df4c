"""``bigrank ingest`` of interaction logs on one machine (DuckDB), against a brute-force reference in plain Python.

The reference (:func:`reference_ingest`) does every step the slow obvious way — dicts of pairs, a k-core loop, ids
ranked by ``(xxh64(text), id)``, splits by sorting — and the tests compare whole datasets with it: vocabularies,
every row of every split and the manifest's counts. The random split's key is XXH64's avalanche of the pair's
dense ids and the seed (:func:`split_key`, written here from the specification with Python integers).
"""

from __future__ import annotations

import gzip
import json
import random
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import xxhash

from bigrank.cli import main
from bigrank.data import manifest as layout
from bigrank.data.ingest import IngestOptions, ingest
from bigrank.data.stream import iter_row_groups
from bigrank.data.user_index import open_index

START_MS = 1_700_000_000_000
PRIME64_1, PRIME64_2, PRIME64_3 = 0x9E3779B185EBCA87, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9  # XXH64's
MASK64 = (1 << 64) - 1


def split_key(user_id: int, item_id: int, seed: int) -> int:
    """The random split's key of a pair, from its definition: ``(user_id << 32 | item_id) XOR (seed * PRIME64_1)``
    through XXH64's avalanche, mod 2^64."""
    x = ((user_id << 32) | item_id) ^ ((seed * PRIME64_1) & MASK64)
    x ^= x >> 33
    x = (x * PRIME64_2) & MASK64
    x ^= x >> 29
    x = (x * PRIME64_3) & MASK64
    return x ^ (x >> 32)


def make_log(seed: int = 0, rows: int = 3000, users: int = 120, items: int = 80, nulls: bool = True) -> list[dict]:
    """A click log: string user ids, string item ids (some of them digits with leading zeros), epoch-ms times,
    ratings in 0.5 steps; repeated pairs, and rows with a null or empty id."""
    rng = random.Random(seed)
    user_ids = [f"u-{rng.randrange(10**6):06d}" for _ in range(users)]
    item_ids = [f"sku-{k}" if k % 3 else f"{k:04d}" for k in range(items)]
    popular = [rng.paretovariate(1.2) for _ in item_ids]
    log = []
    for _ in range(rows):
        user = rng.choice(user_ids[: rng.randint(1, users)])  # early users are more active
        item = rng.choices(item_ids, weights=popular)[0]
        log.append(
            {"user": user, "item": item, "ts": START_MS + rng.randrange(10**9), "rating": rng.randint(1, 10) / 2}
        )
    if nulls:
        log[5]["user"] = None
        log[17]["item"] = ""
        log[29]["user"] = ""
    return log


def write_parquet_parts(directory: Path, log: list[dict], parts: int = 3) -> Path:
    directory.mkdir(parents=True)
    for k in range(parts):
        pq.write_table(pa.Table.from_pylist(log[k::parts]), directory / f"part-{k:05d}.parquet")
    (directory / "_SUCCESS").write_text("")  # what Spark leaves: not a part
    return directory


def reference_ingest(log: list[dict], options: IngestOptions, text_ids: bool = True) -> dict:
    """Every step of an ingest, done the obvious way (see the module docstring)."""
    rows = [r for r in log if r["user"] not in (None, "") and r["item"] not in (None, "")]
    pairs: dict[tuple, list] = {}
    for r in rows:
        pairs.setdefault((r["user"], r["item"]), []).append((r["ts"], r["rating"]))
    merged = {}
    for key, values in pairs.items():
        if options.dedup == "last":
            merged[key] = max(values)
        elif options.dedup == "first":
            merged[key] = min(values)
        elif options.dedup == "sum":
            merged[key] = (max(t for t, _ in values), sum(v for _, v in values))
        else:
            merged[key] = (max(t for t, _ in values), max(v for _, v in values))
    num_merged = len(merged)
    if options.min_rating is not None:  # on the merged rating
        merged = {key: (t, v) for key, (t, v) in merged.items() if v >= options.min_rating}
    rounds, before = 0, dict(merged)
    while True:
        per_user: dict = {}
        per_item: dict = {}
        for u, i in merged:
            per_user[u] = per_user.get(u, 0) + 1
            per_item[i] = per_item.get(i, 0) + 1
        drop = {k for k in merged if per_user[k[0]] < options.min_user_items or per_item[k[1]] < options.min_item_users}
        if not drop:
            break
        rounds += 1
        merged = {k: v for k, v in merged.items() if k not in drop}

    def order(ids):
        return sorted(ids, key=lambda x: (xxhash.xxh64_intdigest(str(x).encode()), x))

    users, items = order({u for u, _ in merged}), order({i for _, i in merged})
    user_id = {u: k for k, u in enumerate(users)}
    item_id = {i: k for k, i in enumerate(items)}
    table = [(user_id[u], item_id[i], t, v, u, i) for (u, i), (t, v) in merged.items()]
    labels = {}
    if options.split == "random":
        keyed = [(r[0], r[1], split_key(r[0], r[1], options.seed)) for r in table]
        ranked = sorted(keyed, key=lambda x: (x[2], x[0], x[1]))
        n_train, n_valid = round(options.fractions[0] * len(table)), round(options.fractions[1] * len(table))
        for rank, (u, i, _) in enumerate(ranked):
            labels[(u, i)] = 0 if rank < n_train else 1 if rank < n_train + n_valid else 2
    elif options.split == "last":
        by_user: dict = {}
        for r in table:
            by_user.setdefault(r[0], []).append(r)
        for u, rs in by_user.items():
            rs.sort(key=lambda r: (r[2], r[5]))  # time, then the original item id
            n = len(rs)
            held = [int(np.round(f * n)) if f else 0 for f in options.fractions[1:]]
            held = [max(1, h) if f and n >= 3 else 0 for h, f in zip(held, options.fractions[1:], strict=True)]
            for from_end, r in enumerate(reversed(rs)):
                labels[(u, r[1])] = 2 if from_end < held[1] else 1 if from_end < held[1] + held[0] else 0
    else:
        from bigrank.data.ingest.options import parse_time

        valid, test = parse_time(options.valid_from, "v"), parse_time(options.test_from, "t")
        for r in table:
            labels[(r[0], r[1])] = 0 if r[2] < valid else 1 if r[2] < test else 2
    splits = {
        name: sorted((u, i, v, t // 1000) for u, i, t, v, *_ in table if labels[(u, i)] == label)
        for label, name in enumerate(layout.SPLITS)
    }
    counts = {u: 0 for u in users}
    first = {}
    for (u, _item), (t, _) in merged.items():
        counts[u] += 1
        first[u] = min(first.get(u, t), t)
    dropped = {
        "k_core_dropped_rows": len(before) - len(merged),
        "k_core_dropped_users": len({u for u, _ in before}) - len(users),
        "k_core_dropped_items": len({i for _, i in before}) - len(items),
        "merged_duplicates": len(rows) - num_merged,
        "dropped_below_min_rating": num_merged - len(before),
    }
    return {"users": users, "items": items, "splits": splits, "rounds": rounds, "user_counts": counts, "first": first,
            "dropped": dropped}  # fmt: skip


def read_dataset(root: Path) -> dict:
    """What the reference gives, read from the dataset ``root``."""
    splits = {}
    manifest = layout.load_manifest(root)
    columns = [c for c in ("user_id", "item_id", "rating", "timestamp") if c in manifest["schema"]]
    for name in layout.SPLITS:
        groups = list(iter_row_groups(root, name, columns=columns))
        rows = []
        for g in groups:
            rows.extend(zip(*(g[c].tolist() for c in columns), strict=True))
        assert rows == sorted(rows), f"split {name} is not sorted by (user_id, item_id)"
        splits[name] = rows
    users = pq.read_table(root / "users.parquet")
    items = pq.read_table(root / "items.parquet")
    assert users.column("user_id").to_pylist() == list(range(users.num_rows))
    assert items.column("item_id").to_pylist() == list(range(items.num_rows))
    return {"users": users, "items": items, "splits": splits, "manifest": layout.load_manifest(root)}


def check_against_reference(root: Path, log: list[dict], options: IngestOptions) -> dict:
    got, want = read_dataset(root), reference_ingest(log, options.check())
    assert got["users"].column("original_id").to_pylist() == want["users"]
    assert got["items"].column("original_id").to_pylist() == want["items"]
    for name in layout.SPLITS:
        assert got["splits"][name] == want["splits"][name], name
    counts = got["users"].column("count").to_pylist()
    assert counts == [want["user_counts"][u] for u in want["users"]]
    assert got["users"].column("first_seen").to_pylist() == [want["first"][u] // 1000 for u in want["users"]]
    assert got["manifest"]["ingest"]["counts"]["k_core_rounds"] == want["rounds"]
    for name, count in want["dropped"].items():
        assert got["manifest"]["ingest"]["counts"][name] == count, name
    return got


SPLIT_OPTIONS = [
    {"split": "random", "seed": 3},
    {"split": "last", "dedup": "first", "min_rating": 1.5},
    {
        "split": "time",
        "valid_from": str((START_MS + 6 * 10**8) // 1000),
        "test_from": "2023-11-25T15:00:00Z",
        "dedup": "sum",
    },
]


@pytest.mark.parametrize("settings", SPLIT_OPTIONS, ids=[s["split"] for s in SPLIT_OPTIONS])
def test_parquet_parts_with_string_ids_match_the_reference(tmp_path, settings):
    log = make_log()
    source = write_parquet_parts(tmp_path / "log", log)
    options = IngestOptions(
        user="user",
        item="item",
        time="ts",
        rating="rating",
        min_user_items=6,
        min_item_users=12,
        progress=False,
        **settings,
    )
    manifest = ingest([source], tmp_path / "data", options)
    got = check_against_reference(tmp_path / "data", log, options)
    counts = manifest["ingest"]["counts"]
    assert counts["rows_read"] == len(log)
    assert (counts["dropped_null_user"], counts["dropped_null_item"]) == (2, 1)
    assert manifest["ingest"]["id_types"] == {"user": "string", "item": "string"}  # "0003" stays a string
    assert "0003" in got["items"].column("original_id").to_pylist()
    assert manifest["ingest"]["counts"]["k_core_rounds"] >= 2, "the test data should need more than one round"
    assert manifest["ingest"]["time_unit"] == "ms"
    layout.validate_dataset(tmp_path / "data", deep=True)


def test_the_same_input_twice_gives_the_same_dataset_and_the_row_order_does_not_matter(tmp_path):
    log = make_log(seed=1)
    options = IngestOptions(user="user", item="item", time="ts", rating="rating", progress=False)
    ingest([write_parquet_parts(tmp_path / "a", log)], tmp_path / "one", options)
    ingest([write_parquet_parts(tmp_path / "b", log)], tmp_path / "two", options)
    shuffled = list(log)
    random.Random(7).shuffle(shuffled)
    ingest([write_parquet_parts(tmp_path / "c", shuffled, parts=5)], tmp_path / "three", options)
    first = read_dataset(tmp_path / "one")
    for other in ("two", "three"):
        again = read_dataset(tmp_path / other)
        assert again["splits"] == first["splits"]
        assert again["users"].equals(first["users"]) and again["items"].equals(first["items"])
    for name in [*layout.SPLITS, "users", "items"]:  # byte for byte, whatever the order of the input rows
        path = f"{name}/part-00000.parquet" if name in layout.SPLITS else f"{name}.parquet"
        assert (tmp_path / "one" / path).read_bytes() == (tmp_path / "two" / path).read_bytes()
        assert (tmp_path / "one" / path).read_bytes() == (tmp_path / "three" / path).read_bytes()


def _write_csv(path: Path, log: list[dict], delimiter=",", header=True, compress=None) -> Path:
    lines = [delimiter.join(["user", "item", "ts", "rating"])] if header else []
    for r in log:
        lines.append(delimiter.join("" if r[k] is None else str(r[k]) for k in ("user", "item", "ts", "rating")))
    data = ("\n".join(lines) + "\n").encode()
    if compress == "gz":
        path.write_bytes(gzip.compress(data))
    elif compress == "zst":
        with pa.CompressedOutputStream(str(path), "zstd") as stream:
            stream.write(data)
    else:
        path.write_bytes(data)
    return path


def _write_jsonl(path: Path, log: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in log))
    return path


def test_every_format_gives_the_same_dataset(tmp_path):
    log = make_log(seed=2, rows=1500)
    options = IngestOptions(user="user", item="item", time="ts", rating="rating", progress=False)
    base = tmp_path / "base"
    ingest([write_parquet_parts(tmp_path / "pq", log)], base, options)
    want = read_dataset(base)
    half = len(log) // 2
    (tmp_path / "csvdir").mkdir()
    variants = {
        "csv-parts": (
            [
                _write_csv(tmp_path / "csvdir" / "a.csv", log[:half]),
                _write_csv(tmp_path / "csvdir" / "b.csv", log[half:]),
            ],
            {},
        ),
        "tsv.gz": ([_write_csv(tmp_path / "log.tsv.gz", log, delimiter="\t", compress="gz")], {}),
        "csv.zst": ([_write_csv(tmp_path / "log.csv.zst", log, compress="zst")], {}),
        "headerless": (
            [_write_csv(tmp_path / "noheader.csv", log, header=False)],
            {"user": "0", "item": "1", "time": "2", "rating": "3", "header": False},
        ),
        "jsonl": ([_write_jsonl(tmp_path / "log.jsonl", log)], {}),
        "glob": ([str(tmp_path / "csvdir" / "*.csv")], {}),
    }
    for name, (paths, changes) in variants.items():
        settings = {"user": "user", "item": "item", "time": "ts", "rating": "rating", "progress": False, **changes}
        got = read_dataset(
            Path(ingest(paths, tmp_path / name, IngestOptions(**settings))["ingest"] and tmp_path / name)
        )
        assert got["splits"] == want["splits"], name
        assert got["users"].column("original_id").to_pylist() == want["users"].column("original_id").to_pylist(), name
        assert got["items"].column("original_id").to_pylist() == want["items"].column("original_id").to_pylist(), name


def test_integer_ids_times_in_seconds_and_iso_and_weights(tmp_path):
    # CSV ids that are all canonical integers become int64; "007" would not be.
    rows = [
        ("10", "500", "2024-01-05T10:00:00Z", "3"),
        ("10", "700", "2024-01-05T11:00:00+01:00", "1"),
        ("30", "500", "2024-01-04", "2"),
        ("10", "500", "2024-01-06T00:00:00Z", "4"),
    ]
    path = tmp_path / "plays.csv"
    path.write_text("user,item,when,plays\n" + "".join(",".join(r) + "\n" for r in rows))
    options = IngestOptions(
        user="user", item="item", time="when", weight="plays", dedup="sum", fractions=(1.0, 0.0, 0.0), progress=False
    )
    manifest = ingest([path], tmp_path / "data", options)
    assert manifest["ingest"]["id_types"] == {"user": "int64", "item": "int64"}
    users = pq.read_table(tmp_path / "data" / "users.parquet")
    assert users.schema.field("original_id").type == pa.int64()
    assert sorted(users.column("original_id").to_pylist()) == [10, 30]
    train = pq.read_table(tmp_path / "data" / "train" / "part-00000.parquet")
    assert train.column_names == ["user_id", "item_id", "weight", "timestamp"]
    originals = users.column("original_id").to_pylist()
    items = pq.read_table(tmp_path / "data" / "items.parquet").column("original_id").to_pylist()
    got = {
        (originals[u], items[i]): (w, t)
        for u, i, w, t in zip(*(train.column(c).to_pylist() for c in train.column_names), strict=True)
    }
    assert got == {(10, 500): (7.0, 1704499200), (10, 700): (1.0, 1704448800), (30, 500): (2.0, 1704326400)}
    first = dict(zip(originals, users.column("first_seen").to_pylist(), strict=True))
    assert first == {10: 1704448800, 30: 1704326400}

    # numbers as epoch seconds (auto) and as milliseconds
    seconds = tmp_path / "seconds.csv"
    seconds.write_text("u,i,t\n1,2,1700000000\n1,3,1700000100\n2,2,1700000200\n")
    for unit, scale in (("auto", 1), ("ms", 1000)):
        if unit == "ms":
            seconds.write_text("u,i,t\n1,2,1700000000000\n1,3,1700000100000\n2,2,1700000200000\n")
        manifest = ingest(
            [seconds], tmp_path / f"s-{unit}", user="u", item="i", time="t", fractions=(1.0, 0.0, 0.0), progress=False
        )
        stamps = pq.read_table(tmp_path / f"s-{unit}" / "train" / "part-00000.parquet").column("timestamp").to_pylist()
        assert sorted(stamps) == [1700000000, 1700000100, 1700000200], unit
        assert manifest["ingest"]["time_unit"] == ("s" if unit == "auto" else "ms")
        del scale


def test_items_file_attributes_travel_with_the_items(tmp_path):
    log = make_log(seed=4, rows=800, nulls=False)
    source = write_parquet_parts(tmp_path / "log", log)
    items = tmp_path / "items.csv"
    items.write_text(
        "sku,title,price\n"
        + "".join(f"sku-{k},Thing {k},{k * 1.5}\n" for k in range(1, 80) if k % 3)
        + "0003,Old thing,2.5\nnever-sold,Ghost,9\n"
    )
    manifest = ingest(
        [source],
        tmp_path / "data",
        user="user",
        item="item",
        time="ts",
        items_file=str(items),
        item_key="sku",
        progress=False,
    )
    table = pq.read_table(tmp_path / "data" / "items.parquet").to_pydict()
    assert manifest["num_items"] == len(table["item_id"])
    for original, title, price in zip(table["original_id"], table["title"], table["price"], strict=True):
        if original == "0003":
            assert (title, price) == ("Old thing", 2.5)
        elif original.startswith("sku-"):
            k = int(original[4:])
            assert (title, price) == (f"Thing {k}", k * 1.5)
        else:
            assert (title, price) == (None, None)  # listed nowhere in the items file
    assert "Ghost" not in table["title"]  # an item nobody interacted with is not in the catalog


def test_each_split_has_its_per_user_index(tmp_path):
    log = make_log(seed=5, rows=600, nulls=False)
    ingest(
        [write_parquet_parts(tmp_path / "log", log)],
        tmp_path / "data",
        user="user",
        item="item",
        time="ts",
        progress=False,
    )
    dataset = layout.DatasetManifest.load(tmp_path / "data")
    assert sorted(dataset.raw["user_index"]) == sorted(layout.SPLITS)
    for split in layout.SPLITS:
        index = open_index(dataset, split)
        assert index is not None, split
        rows = read_dataset(tmp_path / "data")["splits"][split]
        users = np.unique([u for u, *_ in rows])
        indptr, items = index.items_of(users)
        want = [i for _, i, *_ in rows]
        assert items.tolist() == want and indptr[-1] == len(want)


# --------------------------------------------------------------------------------------------------- bad input
def _ingest_cli(capsys, *args) -> tuple[int, str]:
    code = main(["ingest", *map(str, args), "--no-progress"])
    return code, capsys.readouterr().err


def _one_error(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("bigrank ingest: error: "), err
    return lines[0]


def test_bad_input_gets_one_clear_error_and_no_manifest(tmp_path, capsys):
    good = _write_csv(tmp_path / "good.csv", make_log(seed=6, rows=200, nulls=False))
    out = tmp_path / "out"

    def fails(*args, match: str) -> None:
        code, err = _ingest_cli(capsys, *args, "--out", out)
        line = _one_error(err)
        assert code == 2 and match in line, line
        assert not (out / layout.MANIFEST_NAME).exists()
        assert not out.exists() or not any(out.iterdir()), "a failed ingest leaves nothing behind"

    # a missing column names the columns there are
    fails(good, "--user", "customer", "--item", "item", match="no column 'customer'")
    fails(good, "--user", "user", "--item", "item", "--time", "when", match="its columns are: user, item, ts, rating")
    fails(good, "--user", "0", "--item", "9", "--no-header", match="positions 0-3")
    # a rating that is not a number, a time that does not parse: the file and row
    bad_rating = tmp_path / "bad_rating.csv"
    bad_rating.write_text("user,item,rating\na,b,4\nc,d,x\n")
    fails(
        bad_rating,
        "--user",
        "user",
        "--item",
        "item",
        "--rating",
        "rating",
        match="bad_rating.csv row 2 (line 3): column 'rating' holds 'x'",
    )
    bad_time = tmp_path / "bad_time.jsonl"
    bad_time.write_text('{"u": "a", "i": "b", "t": "2024-01-01"}\n{"u": "a", "i": "c", "t": "yesterday"}\n')
    fails(
        bad_time,
        "--user",
        "u",
        "--item",
        "i",
        "--time",
        "t",
        match="bad_time.jsonl row 2: column 't' holds 'yesterday'",
    )
    # nothing left after filtering: the rule that removed the last rows
    fails(good, "--user", "user", "--item", "item", "--rating", "rating", "--min-rating", "99", match="--min-rating 99")
    fails(good, "--user", "user", "--item", "item", "--min-user-items", "1000", match="k-core")
    nulls = tmp_path / "nulls.csv"
    nulls.write_text("user,item\n,b\na,\n")
    fails(nulls, "--user", "user", "--item", "item", match="null or empty user or item id")
    # a split with no rows
    fails(
        good,
        "--user",
        "user",
        "--item",
        "item",
        "--time",
        "ts",
        "--split",
        "time",
        "--valid-from",
        "2000-01-01",
        "--test-from",
        "2000-01-02",
        match="the train split has no rows",
    )
    # parts whose schemas disagree
    (tmp_path / "mixed").mkdir()
    pq.write_table(pa.table({"user": ["a"], "item": ["b"]}), tmp_path / "mixed" / "p0.parquet")
    pq.write_table(pa.table({"user": [1], "item": ["b"]}), tmp_path / "mixed" / "p1.parquet")
    fails(tmp_path / "mixed", "--user", "user", "--item", "item", match="schemas disagree")
    # a truncated Parquet part, a corrupt gzip part
    source = write_parquet_parts(tmp_path / "trunc", make_log(seed=8, rows=300))
    victim = source / "part-00001.parquet"
    victim.write_bytes(victim.read_bytes()[:-40])
    fails(source, "--user", "user", "--item", "item", match="part-00001.parquet")
    broken = _write_csv(tmp_path / "broken.csv.gz", make_log(seed=9, rows=20000), compress="gz")
    broken.write_bytes(broken.read_bytes()[: broken.stat().st_size // 2])
    fails(broken, "--user", "user", "--item", "item", match="broken.csv.gz")
    # a non-empty --out
    out.mkdir(exist_ok=True)
    (out / "keep.txt").write_text("mine")
    code, err = _ingest_cli(capsys, good, "--user", "user", "--item", "item", "--out", out)
    assert code == 2 and "is not empty" in _one_error(err) and (out / "keep.txt").read_text() == "mine"


def test_an_ingest_left_unfinished_is_started_over(tmp_path):
    log = make_log(seed=10, rows=400, nulls=False)
    source = write_parquet_parts(tmp_path / "log", log)
    out = tmp_path / "data"
    (out / ".ingest" / "store-00000").mkdir(parents=True)  # what a SIGKILLed ingest leaves
    (out / "train").mkdir()
    (out / "train" / ".store-00000-00000.parquet").write_bytes(b"half")
    ingest([source], out, user="user", item="item", progress=False)
    assert not (out / ".ingest").exists() and not (out / "train" / ".store-00000-00000.parquet").exists()
    layout.validate_dataset(out, deep=True)


def test_no_space_left_for_the_spill_is_named(tmp_path, capsys):
    small = tmp_path / "small"
    small.mkdir()
    mounted = __import__("subprocess").run(
        ["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(small)], capture_output=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here to fill: {mounted.stderr.decode().strip()}")
    try:
        rng = np.random.default_rng(0)
        users = pa.array([f"user-{x:09d}" for x in rng.integers(0, 10**6, 600_000)])
        pq.write_table(pa.table({"user": users, "item": rng.integers(0, 50_000, 600_000)}), tmp_path / "log.parquet")
        out = tmp_path / "out"
        code, err = _ingest_cli(
            capsys,
            tmp_path / "log.parquet",
            "--user",
            "user",
            "--item",
            "item",
            "--out",
            out,
            "--temp-dir",
            small,
            "--memory-limit",
            "64MB",
        )
        line = _one_error(err)
        assert code == 2 and "no space left" in line and "--temp-dir" in line, line
        assert not (out / layout.MANIFEST_NAME).exists() and not any(small.iterdir())
    finally:
        __import__("subprocess").run(["umount", str(small)], check=True)


# ----------------------------------------------------------------------------------------------------- signals
def _start_ingest(source: Path, out: Path):
    import os
    import subprocess
    import sys

    from tests.conftest import REPO

    env = dict(os.environ, PYTHONPATH=str(REPO))
    command = [
        sys.executable,
        "-m",
        "bigrank.cli",
        "ingest",
        str(source),
        "--user",
        "user",
        "--item",
        "item",
        "--out",
        str(out),
    ]
    return subprocess.Popen(command, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO)


def _wait_for_line(process, text: str) -> list[str]:
    lines = []
    for line in process.stderr:  # the hang guard is the test's: the child prints a line per step
        lines.append(line)
        if text in line:
            return lines
    pytest.fail(f"the ingest ended before printing {text!r}:\n{''.join(lines)}")


@pytest.fixture(scope="module")
def big_log(tmp_path_factory) -> Path:
    """A log long enough (1M rows) that a signal sent after its first progress line lands mid-ingest."""
    path = tmp_path_factory.mktemp("big") / "log.parquet"
    rng = np.random.default_rng(0)
    users = pa.array([f"user-{x:07d}" for x in rng.integers(0, 300_000, 1_000_000)])
    pq.write_table(pa.table({"user": users, "item": rng.integers(0, 40_000, 1_000_000)}), path)
    return path


@pytest.mark.parametrize(("signum", "status"), [(2, 130), (15, 143), (9, -9)], ids=["SIGINT", "SIGTERM", "SIGKILL"])
def test_a_stopped_ingest_leaves_no_manifest_and_runs_again(tmp_path, big_log, signum, status):
    out = tmp_path / "out"
    process = _start_ingest(big_log, out)
    _wait_for_line(process, "reading 1 parquet file")
    process.send_signal(signum)
    rest = process.stderr.read()
    assert process.wait(timeout=300) == status, rest  # the timeout is a hang guard, not a speed claim
    assert not (out / layout.MANIFEST_NAME).exists()
    if signum != 9:
        assert ("interrupted" if signum == 2 else "stopped by SIGTERM") in rest and "Traceback" not in rest, rest
        assert not any(out.iterdir()), "a stopped ingest deletes what it wrote"
    else:
        assert (out / ".ingest").is_dir()  # what the next run recognises as an unfinished ingest
    again = _start_ingest(big_log, out)
    rest = again.stderr.read()
    assert again.wait(timeout=600) == 0, rest
    layout.validate_dataset(out, deep=True)
