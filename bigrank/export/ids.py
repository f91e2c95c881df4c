"""Original ids (the source's user and item ids, int64 or string) of an export: parsing and an index.

``OriginalIdIndex`` maps original ids to dense ids for the servers and ``bigrank recommend``. It is built once at
load from the export's ``original_id`` column (dense order, any order of the original ids) and answers a batch
of lookups with ``np.searchsorted``, without Python objects per id:

* int64 ids: the sorted ids (int64) and the dense id of each (int32): 12 bytes an id.
* string ids: the UTF-8 bytes of each id plus a terminator byte ``0x01``, zero-padded to a fixed width and kept as
  numpy ``S<width>`` arrays, one per width class (16, 32, 64, … bytes) so that one long id does not widen them
  all; sorted, with the dense id of each (int32). 12-character ids cost 16 + 4 bytes each. The terminator keeps
  ids that differ only by trailing NUL bytes apart (numpy's ``S`` comparison ignores trailing NULs).

Measured at ML-1B's scale (2.2M users of 12-character string ids, 849K items) by ``benchmarks/bench_ids.py``.
numpy's ``StringDType`` was tried first and dropped: its ``searchsorted`` takes time linear in the table
(40 ms a lookup at 2.2M ids, numpy 2.4), and a ``sorter`` argument costs the same for every dtype.

This module imports nothing else of ``bigrank.export`` (only ``format`` may be below it).
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import numpy as np

ID_KINDS = ("int64", "string")
# String ids are padded to the smallest of these widths (bytes, terminator included) that holds them; longer ids
# go to the next power of two.
_FIRST_WIDTH = 16
_INT64 = (-(1 << 63), (1 << 63) - 1)
_INTEGER_TEXT = re.compile(r"[+-]?[0-9]+")


def id_kind(arrow_type) -> str:
    """``"int64"`` or ``"string"`` for the Arrow type of an ``original_id`` column (any integer or string type);
    ValueError for any other type."""
    import pyarrow as pa

    if pa.types.is_integer(arrow_type):
        return "int64"
    if pa.types.is_string(arrow_type) or pa.types.is_large_string(arrow_type) or pa.types.is_string_view(arrow_type):
        return "string"
    if pa.types.is_dictionary(arrow_type):
        return id_kind(arrow_type.value_type)
    raise ValueError(f"original ids must be integers or strings, got Arrow type {arrow_type}")


def as_id_array(values, what: str = "original_id"):
    """``values`` (a pyarrow Array or ChunkedArray of integers or strings) as one ``pa.int64()`` or
    ``pa.large_string()`` array (64-bit offsets: the ids of a catalog may hold more than 2 GiB of text); ValueError
    for another type, nulls, or integers outside int64."""
    import pyarrow as pa

    if isinstance(values, pa.ChunkedArray):
        if pa.types.is_string(values.type):
            values = values.cast(pa.large_string())  # before the chunks are joined: more than 2 GiB of text
        values = values.combine_chunks() if values.num_chunks else pa.array([], values.type)
    if not isinstance(values, pa.Array):
        values = pa.array(values)
    kind = id_kind(values.type)
    if values.null_count:
        raise ValueError(f"{what} holds {values.null_count} null ids; every user and item needs an original id")
    if pa.types.is_dictionary(values.type):
        values = values.dictionary_decode()
    target = pa.int64() if kind == "int64" else pa.large_string()
    try:
        return values.cast(target)
    except (pa.ArrowInvalid, OverflowError) as error:
        raise ValueError(f"{what} cannot be read as {kind}: {error}") from None


def parse_original_id(value, kind: str, what: str):
    """One original id given by a client as ``kind`` (``"int64"``: an int, or text of an integer; ``"string"``:
    text, taken as is) -> an ``int`` or ``str``. ValueError naming ``what`` when it has the wrong type.

    Integers beyond int64 are returned as they are (a lookup then reports them unknown)."""
    if kind == "string":
        if not isinstance(value, str):
            raise ValueError(f"{what} ids of this export are strings: give {json_text(value)} as a JSON string")
        return value
    if kind != "int64":
        raise ValueError(f"unknown id kind {kind!r}; one of {ID_KINDS}")
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise ValueError(f"{what} ids of this export are integers, got {json_text(value)}")
    if isinstance(value, str):
        text = value.strip()
        if not _INTEGER_TEXT.fullmatch(text):  # not int(): it takes "1_0", "١" and other digits
            raise ValueError(f"{what} ids of this export are integers, got {value!r}")
        return int(text)
    return int(value)


def shown(value, limit: int = 60) -> str:
    """``repr(value)`` cut to ``limit`` characters: an id named in an error message (one line: repr escapes
    newlines)."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def json_text(value, limit: int = 40) -> str:
    """``value`` as short JSON-like text for an error message (one line, at most ``limit`` characters)."""
    import json

    try:
        text = json.dumps(value, ensure_ascii=True)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= limit else text[: limit - 1] + "…"


class OriginalIdIndex:
    """Original id -> dense id for one table (users or items) of an export.

    Args:
        original_ids: the table's ``original_id`` column in dense order (row ``i`` is dense id ``i``), a pyarrow
            array of integers or strings (``as_id_array``), unique, in any order.

    ``kind`` is ``"int64"`` or ``"string"``; ``lookup(ids)`` -> int64[n] dense ids (-1 for an unknown id);
    ``dense_id(id, what)`` one id or ValueError; ``nbytes`` the memory the index holds.
    """

    def __init__(self, original_ids):
        values = as_id_array(original_ids)
        self.size = len(values)
        self.kind = id_kind(values.type)
        if self.kind == "int64":
            ids = values.to_numpy()
            order = np.argsort(ids, kind="stable")
            self._tables = [(ids[order], order.astype(np.int32))]
            self._widths = [None]
        else:
            self._tables, self._widths = _string_tables(values)
        for keys, order in self._tables:
            same = np.flatnonzero(keys[1:] == keys[:-1])
            if len(same):
                duplicate = values[int(order[same[0]])].as_py()
                raise ValueError(f"original_id {duplicate!r} is given to two dense ids; original ids must be unique")

    def __len__(self) -> int:
        return self.size

    @property
    def nbytes(self) -> int:
        """Bytes of the index's arrays."""
        return sum(keys.nbytes + order.nbytes for keys, order in self._tables)

    def lookup(self, ids: Sequence) -> np.ndarray:
        """Dense ids int64[n] of the original ``ids`` (ints for an int64 index, strs for a string one; already
        typed, see ``parse_original_id``); -1 where an id is not in the table."""
        out = np.full(len(ids), -1, dtype=np.int64)
        if not len(ids) or not self.size:
            return out
        if self.kind == "int64":
            inside = [i for i, v in enumerate(ids) if _INT64[0] <= v <= _INT64[1]]
            if inside:
                keys = np.asarray([ids[i] for i in inside], dtype=np.int64)
                out[inside] = self._find(0, keys)
            return out
        encoded = [value.encode("utf-8", "surrogatepass") + b"\x01" for value in ids]
        for table, width in enumerate(self._widths):
            lower = 0 if table == 0 else self._widths[table - 1]
            chosen = [i for i, e in enumerate(encoded) if lower < len(e) <= width]
            if chosen:
                out[chosen] = self._find(table, np.asarray([encoded[i] for i in chosen], dtype=f"S{width}"))
        return out

    def _find(self, table: int, keys: np.ndarray) -> np.ndarray:
        sorted_keys, order = self._tables[table]
        if not len(sorted_keys):
            return np.full(len(keys), -1, dtype=np.int64)
        position = np.minimum(np.searchsorted(sorted_keys, keys), len(sorted_keys) - 1)
        return np.where(sorted_keys[position] == keys, order[position], -1).astype(np.int64)

    def dense_id(self, original_id, what: str) -> int:
        """The dense id of one original id; ValueError naming ``what`` (``"user"``, ``"item"``) when unknown."""
        (dense,) = self.lookup([original_id])
        if dense < 0:
            raise ValueError(f"unknown {what} id {shown(original_id)}: the export has no such original {what} id")
        return int(dense)

    def dense_ids(self, original_ids: Sequence, what: str) -> np.ndarray:
        """Dense ids int64[n] of ``original_ids``; ValueError naming the first unknown ones."""
        dense = self.lookup(original_ids)
        missing = np.flatnonzero(dense < 0)
        if len(missing):
            names = ", ".join(shown(original_ids[i]) for i in missing[:5])
            more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
            raise ValueError(f"unknown {what} ids {names}{more}: the export has no such original {what} ids")
        return dense


def _string_tables(values) -> tuple[list[tuple[np.ndarray, np.ndarray]], list[int]]:
    """Sorted fixed-width keys and their dense ids, one table per width class, of a string array."""
    import pyarrow as pa

    values = values.cast(pa.large_string())  # int64 offsets: one code path for any total size
    offsets = np.frombuffer(values.buffers()[1], dtype=np.int64, count=len(values) + 1, offset=8 * values.offset)
    data = values.buffers()[2]
    data = np.frombuffer(data, dtype=np.uint8) if data is not None else np.empty(0, np.uint8)
    lengths = np.diff(offsets) + 1  # with the terminator
    widths, tables = [], []
    width, lower = _FIRST_WIDTH, 0
    longest = int(lengths.max(initial=1))
    while lower < longest:
        chosen = np.flatnonzero((lengths > lower) & (lengths <= width)).astype(np.int32)
        if len(chosen):
            keys = _padded(data, offsets[chosen], lengths[chosen] - 1, width)
            order = np.argsort(keys, kind="stable")
            tables.append((keys[order], chosen[order]))
            widths.append(width)
        lower, width = width, 2 * width
    if not tables:  # an empty table
        tables, widths = [(np.empty(0, dtype=f"S{_FIRST_WIDTH}"), np.empty(0, np.int32))], [_FIRST_WIDTH]
    return tables, widths


def _padded(data: np.ndarray, starts: np.ndarray, lengths: np.ndarray, width: int) -> np.ndarray:
    """``S<width>`` keys: the bytes ``data[start:start+length]`` of each id, then ``0x01``, then zeros.

    Filled one byte position at a time over all ids (``width`` vectorised passes) so that no per-byte index
    array of the whole table is ever built."""
    block = np.zeros((len(starts), width), dtype=np.uint8)
    for column in range(width):
        inside = np.flatnonzero(lengths > column)
        if not len(inside) and column > int(lengths.max(initial=0)):
            break
        block[inside, column] = data[starts[inside] + column]
        block[lengths == column, column] = 1
    return block.view(f"S{width}").reshape(-1)
