"""MovieLens ingest: the real ml-latest-small (skipped when absent) and tiny files in the other formats."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from bigrank.data import manifest as layout
from bigrank.data.movielens import ingest, read_ratings
from bigrank.data.stream import iter_row_groups

ML_SMALL = Path(__file__).resolve().parents[1].parent / "shared" / "datasets" / "ml-latest-small"
needs_ml_small = pytest.mark.skipif(not (ML_SMALL / "ratings.csv").is_file(), reason="ml-latest-small absent")


def split_frame(root, split):
    parts = list(iter_row_groups(root, split, columns=("user_id", "item_id", "rating", "timestamp")))
    return {key: np.concatenate([p[key] for p in parts]) for key in parts[0]}


@needs_ml_small
def test_ml_latest_small_random_split(tmp_path):
    manifest = ingest(ML_SMALL, tmp_path / "mls")
    root = tmp_path / "mls"
    assert (manifest["num_users"], manifest["num_items"], manifest["num_ratings"]) == (610, 9724, 100_836)
    assert [manifest["splits"][s]["rows"] for s in layout.SPLITS] == [80_669, 10_084, 10_083]
    layout.validate_dataset(root, deep=True)
    assert manifest["schema"] == {"user_id": "int32", "item_id": "int32", "rating": "float", "timestamp": "int64"}
    # the mapping back to MovieLens ids and the titles are kept
    items = pq.read_table(root / "items.parquet").to_pydict()
    assert items["item_id"][:2] == [0, 1] and items["original_id"][0] == 1
    assert items["title"][0] == "Toy Story (1995)" and all(t is not None for t in items["title"])
    users = pq.read_table(root / "users.parquet").to_pydict()
    assert len(users["user_id"]) == 610 and users["original_id"][-1] == 610
    # every original rating is present exactly once, with its rating and timestamp
    original = read_ratings(ML_SMALL / "ratings.csv")
    frames = [split_frame(root, s) for s in layout.SPLITS]
    users_orig = np.asarray(users["original_id"])
    items_orig = np.asarray(items["original_id"])
    ingested = np.concatenate([users_orig[f["user_id"]] * 10**7 + items_orig[f["item_id"]] for f in frames])
    assert np.array_equal(np.sort(ingested), np.sort(original["user"] * 10**7 + original["item"]))
    rating_sum = sum(float(f["rating"].sum()) for f in frames)
    assert rating_sum == pytest.approx(float(original["rating"].sum()))


@needs_ml_small
def test_ml_latest_small_last_split_is_temporal(tmp_path):
    manifest = ingest(ML_SMALL / "ratings.csv", tmp_path / "last", split="last")
    assert manifest["num_ratings"] == 100_836
    train, test = split_frame(tmp_path / "last", "train"), split_frame(tmp_path / "last", "test")
    last_train = np.full(610, -1)
    np.maximum.at(last_train, train["user_id"], train["timestamp"])
    assert np.all(test["timestamp"] >= last_train[test["user_id"]])
    assert len(np.unique(test["user_id"])) == 610  # every user (all have >= 20 ratings) has a test rating


def test_dat_and_u_data_formats_and_repeats(tmp_path):
    dat = tmp_path / "ml1m"
    dat.mkdir()
    (dat / "ratings.dat").write_text("10::500::4::100\n10::700::3::101\n30::500::5::99\n10::500::2::200\n")
    (dat / "movies.dat").write_bytes("500::Caf\xe9 (1999)::Drama\n700::Other (2000)::Comedy\n".encode("latin-1"))
    manifest = ingest(dat, tmp_path / "out1m")
    assert (manifest["num_users"], manifest["num_items"], manifest["num_ratings"]) == (2, 2, 3)
    assert manifest["generator"]["repeats_dropped"] == 1
    rows = np.concatenate(
        [split_frame(tmp_path / "out1m", s)["rating"] for s in layout.SPLITS if manifest["splits"][s]["rows"]]
    )
    assert sorted(rows.tolist()) == [2.0, 3.0, 5.0]  # the latest rating of (10, 500) is kept
    assert pq.read_table(tmp_path / "out1m" / "items.parquet").column("title").to_pylist() == [
        "Café (1999)",
        "Other (2000)",
    ]

    u100 = tmp_path / "ml100k"
    u100.mkdir()
    (u100 / "u.data").write_text("1\t5\t3\t881250949\n2\t5\t4\t881250950\n2\t9\t1\t881250951\n")
    manifest = ingest(u100 / "u.data", tmp_path / "out100k")
    assert (manifest["num_users"], manifest["num_items"], manifest["num_ratings"]) == (2, 2, 3)


def test_bad_input_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="holds none of"):
        ingest(tmp_path, tmp_path / "out")
    bad = tmp_path / "ratings.csv"
    bad.write_text("userId,movieId,rating,timestamp\n1,2,x,3\n")
    with pytest.raises(ValueError, match="ratings.csv"):
        ingest(bad, tmp_path / "out")
    with pytest.raises(ValueError, match="unknown split"):
        ingest(bad, tmp_path / "out", split="time")
