"""MovieLens ingest: ratings file -> dense ids -> 80/10/10 splits in the bigrank Parquet layout.

Reads ``ratings.csv`` (ml-latest-small, ML-20M, ML-25M: ``userId,movieId,rating,timestamp``),
``ratings.dat`` (ML-1M / ML-10M: ``UserID::MovieID::Rating::Timestamp``) or ``u.data`` (ML-100K:
tab-separated). Users and items are remapped to dense 0-based ids in ascending order of their original ids
(only items that have a rating get an id); the mappings are kept in ``<root>/users.parquet``
(``user_id, original_id``) and ``<root>/items.parquet`` (``item_id, original_id`` and ``title``,
``genres`` when ``movies.csv`` / ``movies.dat`` / ``u.item`` sits beside the ratings).

Splits (``split=``):

* ``"random"`` — 80/10/10 at random over the (user, item) pairs, exact sizes (the Rankmax paper's protocol);
* ``"last"`` — per user by time: the latest 10% of a user's ratings (at least one when the user has three
  or more) go to test, the 10% before them to valid, the rest to train.

A repeated (user, item) pair keeps its latest rating (the count dropped is recorded in the manifest).
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.csv as csv

from bigrank.data import manifest as layout

RATING_FILES = ("ratings.csv", "ratings.dat", "u.data")
MOVIE_FILES = {"ratings.csv": "movies.csv", "ratings.dat": "movies.dat", "u.data": "u.item"}
SPLIT_MODES = ("random", "last")


def find_ratings_file(path: str | Path) -> Path:
    """The ratings file at ``path`` (a file, or a directory holding one of ``RATING_FILES``)."""
    path = Path(path)
    if path.is_dir():
        for name in RATING_FILES:
            if (path / name).is_file():
                return path / name
        raise FileNotFoundError(f"{path} holds none of {', '.join(RATING_FILES)}")
    if not path.is_file():
        raise FileNotFoundError(f"ratings file does not exist: {path}")
    return path


def read_ratings(path: str | Path) -> dict[str, np.ndarray]:
    """Parse a MovieLens ratings file into numpy columns with original ids.

    Returns ``{"user": int64, "item": int64, "rating": float32, "timestamp": int64}``, each (N,).
    """
    path = find_ratings_file(path)
    names = ["user", "item", "rating", "timestamp"]
    types = {"user": pa.int64(), "item": pa.int64(), "rating": pa.float32(), "timestamp": pa.int64()}
    convert = csv.ConvertOptions(column_types=types)
    try:
        if path.name.endswith(".dat"):
            # "::" separators: pyarrow's reader takes one character, so fold them first (numbers only).
            data = path.read_bytes().replace(b"::", b",")
            table = csv.read_csv(
                io.BytesIO(data), read_options=csv.ReadOptions(column_names=names), convert_options=convert
            )
        elif path.name == "u.data":
            table = csv.read_csv(
                path,
                read_options=csv.ReadOptions(column_names=names),
                parse_options=csv.ParseOptions(delimiter="\t"),
                convert_options=convert,
            )
        else:
            table = csv.read_csv(path, convert_options=csv.ConvertOptions())
            if table.num_columns < 3:
                raise ValueError(f"expected userId,movieId,rating[,timestamp] columns, got {table.column_names}")
            columns = table.column_names[: len(names)]
            table = table.select(columns).rename_columns(names[: len(columns)])
            table = table.cast(pa.schema([(n, types[n]) for n in table.column_names]))
    except (pa.ArrowInvalid, OSError) as error:
        raise ValueError(f"cannot parse MovieLens ratings file {path}: {error}") from error
    out = {name: table.column(name).to_numpy() for name in table.column_names}
    if "timestamp" not in out:
        out["timestamp"] = np.zeros(len(out["user"]), dtype=np.int64)
    return out


def read_movies(ratings_path: Path) -> dict[str, np.ndarray] | None:
    """Titles and genres from the movies file beside ``ratings_path``, or None when there is none.

    Returns ``{"original_id": int64, "title": str, "genres": str}`` arrays.
    """
    path = ratings_path.with_name(MOVIE_FILES.get(ratings_path.name, "movies.csv"))
    if not path.is_file():
        return None
    if path.name == "movies.csv":
        table = csv.read_csv(path)  # the first header field may read "movieId" or "Id"
        ids = table.column(0).to_numpy().astype(np.int64)
        titles = np.asarray(table.column(1).to_pylist(), dtype=object)
        genres = np.asarray(table.column(2).to_pylist() if table.num_columns > 2 else [""] * len(ids), dtype=object)
        return {"original_id": ids, "title": titles, "genres": genres}
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        text = raw.decode("latin-1")  # ML-100K and ML-1M movie files are Latin-1
    separator = "::" if path.name == "movies.dat" else "|"
    ids, titles, genres = [], [], []
    for line in text.splitlines():
        fields = line.split(separator)
        if len(fields) < 2 or not fields[0].strip().isdigit():
            continue
        ids.append(int(fields[0]))
        titles.append(fields[1])
        genres.append(fields[2] if separator == "::" and len(fields) > 2 else "")
    return {
        "original_id": np.asarray(ids, dtype=np.int64),
        "title": np.asarray(titles, dtype=object),
        "genres": np.asarray(genres, dtype=object),
    }


def _drop_repeats(ratings: dict[str, np.ndarray]) -> tuple[dict[str, np.ndarray], int]:
    """Keep the latest rating of each (user, item) pair; returns the columns and the count dropped."""
    order = np.lexsort((ratings["timestamp"], ratings["item"], ratings["user"]))
    users, items = ratings["user"][order], ratings["item"][order]
    last = np.ones(len(order), dtype=bool)
    last[:-1] = (users[1:] != users[:-1]) | (items[1:] != items[:-1])
    keep = order[last]
    return {name: values[keep] for name, values in ratings.items()}, int(len(order) - len(keep))


def last_split_labels(users: np.ndarray, items: np.ndarray, timestamps: np.ndarray) -> np.ndarray:
    """Per-user temporal 80/10/10 labels (0 train, 1 valid, 2 test); see the module docstring."""
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


def ingest(path: str | Path, out: str | Path, split: str = "random", seed: int = 0) -> dict:
    """Ingest the MovieLens ratings at ``path`` into the dataset ``out``; returns the manifest.

    ``split`` is ``"random"`` (80/10/10 over pairs) or ``"last"`` (per-user temporal); ``seed`` drives the
    random split. ``out`` must be new or empty.
    """
    if split not in SPLIT_MODES:
        raise ValueError(f"unknown split {split!r}; choose one of {SPLIT_MODES}")
    ratings_path = find_ratings_file(path)
    out = Path(out)
    if (out / layout.MANIFEST_NAME).exists() or (out.exists() and any(out.iterdir())):
        raise ValueError(f"{out} is not empty; choose a new --out")
    ratings, repeats = _drop_repeats(read_ratings(ratings_path))
    if len(ratings["user"]) == 0:
        raise ValueError(f"{ratings_path} holds no ratings")
    user_ids, users = np.unique(ratings["user"], return_inverse=True)
    item_ids, items = np.unique(ratings["item"], return_inverse=True)
    users, items = users.astype(np.int32), items.astype(np.int32)
    if split == "random":
        labels = layout.random_split_labels(np.random.default_rng([seed, 0x5B17]), len(users))
    else:
        labels = last_split_labels(users, items, ratings["timestamp"])

    out.mkdir(parents=True, exist_ok=True)
    split_files = {}
    for label, name in enumerate(layout.SPLITS):
        mask = labels == label
        order = np.lexsort((items[mask], users[mask]))
        columns = {
            "user_id": users[mask][order],
            "item_id": items[mask][order],
            "rating": ratings["rating"][mask][order],
            "timestamp": ratings["timestamp"][mask][order],
        }
        split_files[name] = layout.write_split_parts(out, name, columns)
    layout.write_parquet_atomic(
        out / "users.parquet", {"user_id": np.arange(len(user_ids), dtype=np.int32), "original_id": user_ids}
    )
    item_columns = {"item_id": np.arange(len(item_ids), dtype=np.int32), "original_id": item_ids}
    movies = read_movies(ratings_path)
    if movies is not None:
        position = {int(movie): index for index, movie in enumerate(movies["original_id"])}
        found = [position.get(int(movie)) for movie in item_ids]
        item_columns["title"] = np.asarray([movies["title"][i] if i is not None else None for i in found], object)
        item_columns["genres"] = np.asarray([movies["genres"][i] if i is not None else None for i in found], object)
    layout.write_parquet_atomic(out / "items.parquet", item_columns)
    return layout.write_manifest(
        out,
        num_users=len(user_ids),
        num_items=len(item_ids),
        split_files=split_files,
        seed=seed,
        source=f"movielens:{ratings_path.resolve()}",
        generator={
            "ingest": ratings_path.name,
            "split": split,
            "fractions": list(layout.SPLIT_FRACTIONS),
            "repeats_dropped": repeats,
            "titles": movies is not None,
        },
        extra={"num_rated_users": len(user_ids), "num_rated_items": len(item_ids), "truth": None},
    )
