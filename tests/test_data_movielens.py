"""MovieLens through the ingest's preset: the real ml-latest-small (skipped when absent) and tiny files in the other
formats (ratings.dat with movies.dat in Latin-1, u.data with u.item)."""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from bigrank.data import manifest as layout
from bigrank.data.ingest import ingest
from bigrank.data.stream import iter_row_groups

ML_SMALL = Path(__file__).resolve().parents[1].parent / "shared" / "datasets" / "ml-latest-small"
needs_ml_small = pytest.mark.skipif(not (ML_SMALL / "ratings.csv").is_file(), reason="ml-latest-small absent")


def split_frame(root, split):
    parts = list(iter_row_groups(root, split, columns=("user_id", "item_id", "rating", "timestamp")))
    return {key: np.concatenate([p[key] for p in parts]) for key in parts[0]}


def original_rows(root) -> dict[str, set]:
    """``{split: {(original user, original item, rating, timestamp)}}`` of a dataset."""
    users = pq.read_table(root / "users.parquet").to_pydict()
    items = pq.read_table(root / "items.parquet").to_pydict()
    user_of = dict(zip(users["user_id"], users["original_id"], strict=True))
    item_of = dict(zip(items["item_id"], items["original_id"], strict=True))
    out = {}
    for split in layout.SPLITS:
        f = split_frame(root, split)
        out[split] = {
            (user_of[u], item_of[i], float(r), int(t))
            for u, i, r, t in zip(f["user_id"], f["item_id"], f["rating"], f["timestamp"], strict=True)
        }
    return out


def read_ratings_csv(path) -> list[tuple]:
    with open(path) as handle:
        rows = list(csv.reader(handle))[1:]
    return [(int(u), int(i), float(r), int(t)) for u, i, r, t in rows]


def format1_last_labels(users: np.ndarray, items: np.ndarray, timestamps: np.ndarray) -> np.ndarray:
    """The per-user temporal split of format 1 (bigrank before the ingest engine), kept as the reference: the latest
    10% of a user's ratings (at least one when the user has three or more) to test, the 10% before them to valid;
    ties in time by item id. ``items`` must be numbered in the order of the original ids."""
    order = np.lexsort((items, timestamps, users))
    sorted_users = users[order]
    counts = np.bincount(sorted_users)
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    from_end = counts[sorted_users] - 1 - (np.arange(len(order)) - starts[sorted_users])
    held = np.where(counts >= 3, np.maximum(1, np.round(0.1 * counts)), 0).astype(np.int64)
    labels_sorted = np.zeros(len(order), dtype=np.int8)
    labels_sorted[from_end < 2 * held[sorted_users]] = 1
    labels_sorted[from_end < held[sorted_users]] = 2
    labels = np.empty_like(labels_sorted)
    labels[order] = labels_sorted
    return labels


@needs_ml_small
def test_ml_latest_small_random_split(tmp_path):
    manifest = ingest(ML_SMALL, tmp_path / "mls", progress=False)
    root = tmp_path / "mls"
    assert (manifest["num_users"], manifest["num_items"], manifest["num_ratings"]) == (610, 9724, 100_836)
    assert [manifest["splits"][s]["rows"] for s in layout.SPLITS] == [80_669, 10_084, 10_083]  # exact sizes
    assert manifest["format_version"] == 2 and manifest["ingest"]["id_types"] == {"user": "int64", "item": "int64"}
    layout.validate_dataset(root, deep=True)
    assert manifest["schema"] == {"user_id": "int32", "item_id": "int32", "rating": "float", "timestamp": "int64"}
    # the mapping back to MovieLens ids and the titles are kept
    items = pq.read_table(root / "items.parquet").to_pydict()
    title = dict(zip(items["original_id"], items["title"], strict=True))
    assert title[1] == "Toy Story (1995)" and all(t is not None for t in items["title"])
    assert (
        dict(zip(items["original_id"], items["genres"], strict=True))[1]
        == "Adventure|Animation|Children|Comedy|Fantasy"
    )
    users = pq.read_table(root / "users.parquet").to_pydict()
    assert sorted(users["original_id"]) == list(range(1, 611))
    # every original rating is present exactly once, with its rating and timestamp
    rows = original_rows(root)
    assert set().union(*rows.values()) == set(read_ratings_csv(ML_SMALL / "ratings.csv"))
    assert sum(len(r) for r in rows.values()) == 100_836


@needs_ml_small
def test_ml_latest_small_last_split_is_format_1s(tmp_path):
    manifest = ingest(ML_SMALL / "ratings.csv", tmp_path / "last", split="last", progress=False)
    assert manifest["num_ratings"] == 100_836
    ratings = read_ratings_csv(ML_SMALL / "ratings.csv")
    users = np.unique([r[0] for r in ratings], return_inverse=True)[1]
    items = np.unique([r[1] for r in ratings], return_inverse=True)[1]
    labels = format1_last_labels(users, items, np.array([r[3] for r in ratings]))
    got = original_rows(tmp_path / "last")
    for label, split in enumerate(layout.SPLITS):
        assert got[split] == {r for r, k in zip(ratings, labels, strict=True) if k == label}, split
    assert len({r[0] for r in got["test"]}) == 610  # every user (all have >= 20 ratings) has a test rating


def test_dat_and_u_data_formats_and_repeats(tmp_path):
    dat = tmp_path / "ml1m"
    dat.mkdir()
    lines = [f"{u}::{i}::{(u + i) % 5 + 1}::{100 + u * 10 + i}" for u in (10, 30, 50) for i in (500, 700, 900, 300)]
    lines.append("10::500::2::999")  # a repeated pair: its latest rating is kept
    (dat / "ratings.dat").write_text("\n".join(lines) + "\n")
    (dat / "movies.dat").write_bytes(
        "500::Caf\xe9 (1999)::Drama\n700::Other (2000)::Comedy\n900::Third (2001)::Horror\n".encode("latin-1")
    )
    manifest = ingest(dat, tmp_path / "out1m", split="last", progress=False)
    assert (manifest["num_users"], manifest["num_items"], manifest["num_ratings"]) == (3, 4, 12)
    assert manifest["ingest"]["counts"]["merged_duplicates"] == 1
    rows = set().union(*original_rows(tmp_path / "out1m").values())
    assert (10, 500, 2.0, 999) in rows and not any(r[:2] == (10, 500) and r[3] != 999 for r in rows)
    items = pq.read_table(tmp_path / "out1m" / "items.parquet").to_pydict()
    titles = dict(zip(items["original_id"], items["title"], strict=True))
    assert titles == {500: "Café (1999)", 700: "Other (2000)", 900: "Third (2001)", 300: None}

    u100 = tmp_path / "ml100k"
    u100.mkdir()
    (u100 / "u.data").write_text(
        "".join(f"{u}\t{i}\t{(u * i) % 5 + 1}\t{881250949 + u + i}\n" for u in (1, 2, 3) for i in (5, 9, 11))
    )
    (u100 / "u.item").write_bytes("5|Copycat (1995)|01-Jan-1995||http://x|0|1\n9|Dead Man (1995)|x\n".encode("latin-1"))
    manifest = ingest(u100 / "u.data", tmp_path / "out100k", fractions=(0.6, 0.2, 0.2), progress=False)
    assert (manifest["num_users"], manifest["num_items"], manifest["num_ratings"]) == (3, 3, 9)
    titles = pq.read_table(tmp_path / "out100k" / "items.parquet").to_pydict()
    assert dict(zip(titles["original_id"], titles["title"], strict=True)) == {
        5: "Copycat (1995)",
        9: "Dead Man (1995)",
        11: None,
    }
    assert "genres" not in titles


def test_a_directory_without_ratings_is_read_as_a_log_and_needs_the_columns(tmp_path):
    from bigrank.errors import CommandError

    (tmp_path / "log").mkdir()
    (tmp_path / "log" / "clicks.csv").write_text("a,b\n1,2\n")
    with pytest.raises(CommandError, match="give the id columns: --user COL --item COL"):
        ingest(tmp_path / "log", tmp_path / "out")
    with pytest.raises(CommandError, match="holds no file"):
        ingest(
            tmp_path / "empty" if (tmp_path / "empty").mkdir() is None else None, tmp_path / "out", user="a", item="b"
        )
