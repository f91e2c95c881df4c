"""The cleaning and split steps of ``bigrank ingest`` where they once gave wrong data without an error (issue 48):
``--min-rating`` against a pair's merged rating, a split key that does not depend on DuckDB's version.

Real CSV and Parquet files through the real engine; rows checked by their original ids.
"""

from __future__ import annotations

import pytest

from bigrank.data import manifest as layout
from bigrank.data.ingest import IngestOptions, ingest
from tests.test_ingest import _write_csv, read_dataset


def _rated_pairs(root) -> dict[tuple, float]:
    """(original user, original item) -> rating, over every split of the dataset ``root``."""
    got = read_dataset(root)
    users = got["users"].column("original_id").to_pylist()
    items = got["items"].column("original_id").to_pylist()
    return {(users[u], items[i]): rating for rows in got["splits"].values() for u, i, rating, *_ in rows}


def _opinions_log() -> list[dict]:
    """Users who changed their minds: ``late`` rated 5 then 1, ``early`` 1 then 5, ``twice`` 2 and 2; and twenty
    pairs rated 4 once, so that every split has rows."""
    log = [
        {"user": "late", "item": "film", "ts": 100, "rating": 5.0},
        {"user": "late", "item": "film", "ts": 200, "rating": 1.0},
        {"user": "early", "item": "film", "ts": 100, "rating": 1.0},
        {"user": "early", "item": "film", "ts": 200, "rating": 5.0},
        {"user": "twice", "item": "film", "ts": 100, "rating": 2.0},
        {"user": "twice", "item": "film", "ts": 200, "rating": 2.0},
    ]
    return log + [{"user": f"fan-{k}", "item": f"film-{k % 7}", "ts": 300 + k, "rating": 4.0} for k in range(20)]


@pytest.mark.parametrize(
    ("dedup", "kept"),
    [
        ("last", {("early", "film"): 5.0}),  # the latest opinion decides: late's 1 drops the pair
        ("first", {("late", "film"): 5.0}),
        ("max", {("late", "film"): 5.0, ("early", "film"): 5.0}),
        ("sum", {("late", "film"): 6.0, ("early", "film"): 6.0, ("twice", "film"): 4.0}),
    ],
)
def test_min_rating_tests_the_rating_a_pair_keeps_after_the_merge(tmp_path, dedup, kept):
    log = _write_csv(tmp_path / "log.csv", _opinions_log())
    options = IngestOptions(
        user="user", item="item", time="ts", rating="rating", dedup=dedup, min_rating=3,
        fractions=(0.5, 0.25, 0.25), progress=False,
    )  # fmt: skip
    ingest([log], tmp_path / "out", options)
    pairs = _rated_pairs(tmp_path / "out")
    changed = {pair: rating for pair, rating in pairs.items() if not pair[0].startswith("fan-")}
    assert changed == kept
    assert len(pairs) == 20 + len(kept)
    counts = layout.load_manifest(tmp_path / "out")["ingest"]["counts"]
    assert counts["merged_duplicates"] == 3  # three pairs had two rows each
    assert counts["dropped_below_min_rating"] == 3 - len(kept)  # pairs, after the merge


# ------------------------------------------------------------------------------------ the split key (item 4)
def test_the_split_key_is_xxh64s_avalanche_in_sql_numpy_and_its_definition():
    """The key the stores compute in SQL, the numpy one and the definition (Python integers) agree on pairs over
    the whole id range and on seeds of any sign; distinct pairs of one seed have distinct keys; and a few values
    are pinned, so that a change of the key (of a dataset's split) cannot pass unnoticed."""
    import duckdb
    import numpy as np
    import pyarrow as pa

    from bigrank.data.ingest.hashing import split_keys
    from bigrank.data.ingest.store import with_split_key
    from tests.test_ingest import split_key

    rng = np.random.default_rng(0)
    users = np.concatenate([[0, 0, 2**31 - 1], rng.integers(0, 2**31, 5000)]).astype(np.int32)
    items = np.concatenate([[0, 1, 2**31 - 1], rng.integers(0, 2**31, 5000)]).astype(np.int32)
    con = duckdb.connect()
    con.register("pairs", pa.table({"user_id": users, "item_id": items}))
    for seed in (0, 1, -7, 2**62):
        expected = [split_key(int(u), int(i), seed) for u, i in zip(users, items, strict=True)]
        assert split_keys(users, items, seed).tolist() == expected, seed
        assert con.execute(with_split_key("SELECT * FROM pairs", seed)).fetchnumpy()["key"].tolist() == expected
    assert len(set(split_keys(users, items, 3).tolist())) == len(set(zip(users.tolist(), items.tolist(), strict=True)))
    pinned = [split_key(0, 0, 0), split_key(1, 2, 3), split_key(2**31 - 1, 5, 0)]
    assert pinned == [0, 12037647265038629212, 11686327851173885195]


def test_the_random_split_follows_the_fixed_key_not_duckdbs_hash(tmp_path):
    """Pairs ranked by the key of their dense ids fill train, then valid, then test, exactly: the split a
    dataset gets is a function of its input and options only (DuckDB's hash(), not pinned, decided it before)."""
    from tests.test_ingest import split_key

    rows = [{"user": f"u{k % 97}", "item": f"i{(k * 31) % 89}", "ts": k, "rating": 1} for k in range(4000)]
    log = _write_csv(tmp_path / "log.csv", rows)
    ingest([log], tmp_path / "out", IngestOptions(user="user", item="item", seed=11, progress=False))
    got = read_dataset(tmp_path / "out")
    labelled = [(split_key(u, i, 11), u, i, name) for name, pairs in got["splits"].items() for u, i, *_ in pairs]
    ranked = [name for *_, name in sorted(labelled)]
    n = len(ranked)
    train, valid = round(0.8 * n), round(0.1 * n)
    assert ranked == ["train"] * train + ["valid"] * valid + ["test"] * (n - train - valid)
