"""MovieLens as a preset of the one ingest path: the files are recognised and their columns mapped.

``bigrank ingest ml-1m/`` (a directory holding ``ratings.csv``, ``ratings.dat`` or ``u.data``, or one of those
files) with no ``--user``/``--item`` reads the ratings file as

    ratings.csv   ml-latest(-small), ML-20M, ML-25M   userId,movieId,rating,timestamp (header)
    ratings.dat   ML-1M, ML-10M                        UserID::MovieID::Rating::Timestamp
    u.data        ML-100K                              user, item, rating, timestamp (tab-separated)

with user, item, rating and time (epoch seconds) in that order, and the movies file beside it (``movies.csv``,
``movies.dat`` or ``u.item``; Latin-1 for the older two) as the items file: ``title`` and ``genres`` travel to the
export. Duplicates keep a pair's latest rating (``--dedup last``), the split is random 80/10/10 unless given.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from bigrank.data.ingest.options import IngestOptions

__all__ = ["RATING_FILES", "apply_preset", "find_ratings_file"]

RATING_FILES = ("ratings.csv", "ratings.dat", "u.data")
# ratings file -> (delimiter, header, movies file, its delimiter, header, encoding, {column: attribute})
FORMATS = {
    "ratings.csv": (",", True, "movies.csv", ",", True, "utf-8", {"1": "title", "2": "genres"}),
    "ratings.dat": ("::", False, "movies.dat", "::", False, "latin-1", {"1": "title", "2": "genres"}),
    "u.data": ("\t", False, "u.item", "|", False, "latin-1", {"1": "title"}),
}


def find_ratings_file(path: str | Path) -> Path | None:
    """The MovieLens ratings file at ``path`` (one of ``RATING_FILES``, or a directory holding one), else None."""
    path = Path(path)
    if path.is_dir():
        return next((path / name for name in RATING_FILES if (path / name).is_file()), None)
    return path if path.name in RATING_FILES and path.is_file() else None


def apply_preset(paths: list, options: IngestOptions) -> tuple[list, IngestOptions]:
    """``(paths, options)`` for MovieLens input: one path holding a MovieLens ratings file and no ``--user`` /
    ``--item`` given; anything else is returned as it is."""
    if len(paths) != 1 or options.user or options.item:
        return paths, options
    ratings = find_ratings_file(paths[0])
    if ratings is None:
        return paths, options
    delimiter, header, movies, movie_delimiter, movie_header, encoding, attributes = FORMATS[ratings.name]
    changes = {
        "user": "0",
        "item": "1",
        "rating": "2",
        "time": "3",
        "time_unit": "s" if options.time_unit == "auto" else options.time_unit,
        "format": "csv",
        "delimiter": delimiter,
        "header": header,
        "preset": "movielens",
    }
    movies_path = ratings.with_name(movies)
    if options.items_file is None and movies_path.is_file():
        from bigrank.data.ingest.sources import open_source

        items = open_source([movies_path], "csv", movie_delimiter, movie_header, encoding, typed_text=True)
        names = list(items.columns)
        changes.update(
            items_file=str(movies_path),
            item_key=names[0],
            extra={
                **options.extra,
                "items_source": {
                    "format": "csv",
                    "delimiter": movie_delimiter,
                    "header": movie_header,
                    "encoding": encoding,
                    "columns": {names[int(p)]: name for p, name in attributes.items() if int(p) < len(names)},
                },
            },
        )
    return [ratings], replace(options, **changes)
