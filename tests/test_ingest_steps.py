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
