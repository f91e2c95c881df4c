"""Benchmark files of one line per user, ``uid item item …``: read into (user, item) pairs for the ingest.

The layout the graph collaborative-filtering benchmarks ship (NGCF, Wang et al. SIGIR 2019; LightGCN, He et al.
SIGIR 2020: ``train.txt`` and ``test.txt`` of Gowalla, Yelp2018, Amazon-Book): each line holds a user id followed by
the ids of that user's items, separated by white space::

    0 0 1 2 3
    1 4 5

``bigrank ingest --format user-lines`` reads such files (``--split given --train train.txt --test test.txt`` keeps
the benchmark's own split; ``bigrank.data.ingest.given``). Each file is turned into a Parquet file of the pairs,
columns ``user`` and ``item``, which the ingest then reads as any log: a line's repeated item is one pair (the
dedup), a line without items holds no pair, and a user on several lines has the items of all of them. Ids are
int64 when every id of the file is an integer written canonically (``42``, not ``042``), else text, as the ingest
types CSV ids.

Memory is bounded by ``chunk_pairs`` pairs (the file is read twice: once to type the ids, once to write them).
"""

from __future__ import annotations

import gzip
import re
from collections.abc import Iterator
from pathlib import Path

from bigrank.errors import CommandError

__all__ = ["ITEM", "USER", "user_lines_to_parquet"]

USER, ITEM = "user", "item"
CHUNK_PAIRS = 1 << 20
_INTEGER = re.compile(r"-?(?:0|[1-9][0-9]{0,18})")
_INT64 = (-(1 << 63), (1 << 63) - 1)


def _lines(path: Path) -> Iterator[tuple[int, list[str]]]:
    """``(line number, tokens)`` of each line of ``path`` holding a token (plain or .gz text, UTF-8)."""
    opener = gzip.open if path.name.endswith(".gz") else open
    try:
        with opener(path, "rt", encoding="utf-8") as handle:
            for number, line in enumerate(handle, 1):
                tokens = line.split()
                if tokens:
                    yield number, tokens
    except (OSError, UnicodeDecodeError, EOFError) as error:
        raise CommandError(f"cannot read {path} (one line per user: uid item item …): {error}") from None


def _integer(token: str) -> bool:
    return bool(_INTEGER.fullmatch(token)) and _INT64[0] <= int(token) <= _INT64[1]


def user_lines_to_parquet(path: str | Path, out: str | Path, chunk_pairs: int = CHUNK_PAIRS) -> tuple[int, int]:
    """Write the pairs of the one-line-per-user file ``path`` to the Parquet file ``out`` (columns ``user`` and
    ``item``, int64 when every id is an integer, else string); returns ``(lines with a user, pairs)``.

    CommandError when the file cannot be read or holds no pair."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path, out = Path(path), Path(out)
    integers = all(_integer(token) for _, tokens in _lines(path) for token in tokens)
    kind = pa.int64() if integers else pa.string()
    schema = pa.schema([(USER, kind), (ITEM, kind)])
    users: list = []
    items: list = []
    lines = pairs = 0
    with pq.ParquetWriter(out, schema) as writer:

        def flush() -> None:
            if items:
                convert = int if integers else str
                writer.write_table(
                    pa.table({USER: pa.array(map(convert, users), kind), ITEM: pa.array(map(convert, items), kind)})
                )
                users.clear()
                items.clear()

        for _, tokens in _lines(path):
            lines += 1
            users.extend([tokens[0]] * (len(tokens) - 1))
            items.extend(tokens[1:])
            pairs += len(tokens) - 1
            if len(items) >= chunk_pairs:
                flush()
        flush()
    if pairs == 0:
        raise CommandError(f"{path} holds no pair: one line per user, 'uid item item …', is expected")
    return lines, pairs
