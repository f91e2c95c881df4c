"""The ingest driver: the steps over the row stores, what is reduced between them, and the dataset it writes.

Steps (``run``), each counted in the manifest's ``ingest`` entry:

1. **load** — scan the inputs into the stores (``u, i, t, v``); count rows read, null or empty ids, times and
   values that do not parse (an error naming the file and row);
2. **encode** — integer codes for the ids; items are coded by the driver from every store's distinct items, in
   the order of their original ids (the ``last`` split breaks ties in time by it, as format 1 did);
3. **dedup** — one row per (user, item) pair; then ``--min-rating`` on the pair's merged rating;
4. **k-core** — drop users with fewer than ``--min-user-items`` pairs and items with fewer than
   ``--min-item-users`` users, again until nothing changes (item counts summed over the stores each round);
5. **vocabularies** — dense ids by ``(xxh64, id)`` (``bigrank.data.ingest.hashing``): a store ranks its users,
   the driver offsets them by the stores before it (stores hold contiguous ranges of user hashes) and ranks the
   items;
6. **split** — random (exact sizes: the cut points are found from the stores' histograms of their rows' keys;
   with ``--vocab-from``, a pair the parent holds keeps the parent's split and the new pairs are cut among
   themselves), per user by time, or at a global time;
7. **write** — each store writes its rows of each split sorted by ``(user_id, item_id)``; the driver names the
   parts in order, writes ``users.parquet`` / ``items.parquet`` (with the items file's attributes), and the
   manifest, which builds the per-user indexes first (``bigrank.data.manifest.write_manifest``).

The stores are reached through an engine (:class:`LocalEngine` here, ``bigrank.data.ingest.cluster.RayEngine``
on a cluster) whose ``map(method, *args)`` calls a :class:`~bigrank.data.ingest.store.RowStore` method on every
store and returns their results in store order. Whatever the engine, the same input and options give the same
dataset.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import threading
import time
from pathlib import Path

import numpy as np

from bigrank.data import manifest as layout
from bigrank.data.ingest.hashing import id_array, rank_ids
from bigrank.data.ingest.options import EPOCH_UNIT_NAMES, IngestOptions, epoch_unit_of, parse_time
from bigrank.data.ingest.sources import Source, duckdb_error, open_source, quote_identifier
from bigrank.data.ingest.store import KEY_BINS_SHIFT, Columns, RowStore
from bigrank.data.ingest.vocab import ParentVocabulary, extend_ids, merged_firsts
from bigrank.errors import CommandError

__all__ = ["Interrupted", "LocalEngine", "Progress", "SideConnections", "clear", "prepare_out", "run"]

WORK_DIR = ".ingest"  # under --out: the stores' spill files (default); its presence marks an unfinished ingest
BATCH_ROWS = 1 << 17
VOCAB_COLUMNS = ("original_id", "count", "first_seen")


class Progress:
    """Lines about the ingest's progress on stderr, with the seconds since it started (silent when off)."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.started = time.monotonic()

    def __call__(self, line: str) -> None:
        if self.enabled:
            print(f"[{time.monotonic() - self.started:7.1f}s] {line}", file=sys.stderr, flush=True)


class Interrupted(CommandError):
    """The engine was asked to stop (a signal reached the command): the ingest's work ends with this."""


class SideConnections:
    """The DuckDB connections an ingest opens beside its stores (the time unit's sample, the search for a row that
    does not parse, the items file): :meth:`interrupt` stops every query running on them, as the engine's
    interrupt stops the stores', and no connection opens after it."""

    def __init__(self):
        self._open: set = set()
        self._lock = threading.Lock()
        self.stopped = False

    @contextlib.contextmanager
    def connect(self, config: dict | None = None):
        """A new in-memory DuckDB connection (``config``: its settings), closed when the block ends; Interrupted
        once :meth:`interrupt` was called."""
        import duckdb

        with self._lock:
            if self.stopped:
                raise Interrupted("stopped")
            con = duckdb.connect(config=config or {})
            self._open.add(con)
        try:
            yield con
        finally:
            with self._lock:
                self._open.discard(con)
            con.close()

    def interrupt(self) -> None:
        """Stop the query running on every open connection (from another thread: it raises in the thread that
        runs it)."""
        with self._lock:
            self.stopped = True
            for con in self._open:
                con.interrupt()

    def check(self) -> None:
        """Interrupted once :meth:`interrupt` was called: between the batches of a streamed result, which DuckDB's
        interrupt does not reach."""
        if self.stopped:
            raise Interrupted("stopped")


class LocalEngine:
    """One :class:`RowStore` in this process holding every row (DuckDB spills what does not fit to disk)."""

    def __init__(self, work: Path, options: IngestOptions):
        self.stores = [RowStore(work / "store-00000", options.memory_bytes(), options.thread_count())]
        self.name = "duckdb"
        self.stopped = False
        self.side = SideConnections()

    def load(self, source: Source, columns: Columns) -> list[dict]:
        """Scan every input file into the store."""
        return self.map_each("load", [(source.scan(), columns)])

    def map(self, method: str, *args) -> list:
        """``store.method(*args)`` of every store, in store order."""
        return self.map_each(method, [args] * len(self.stores))

    def fold(self, method: str, add, *args) -> None:
        """``add(store.method(*args))`` for every store, as each result comes (``add`` must not depend on their
        order)."""
        for result in self.map(method, *args):
            add(result)

    def map_each(self, method: str, args: list[tuple]) -> list:
        """``store_k.method(*args[k])`` of every store k, in store order."""
        import duckdb

        results = []
        for store, given in zip(self.stores, args, strict=True):
            if self.stopped:
                raise Interrupted("stopped")
            try:
                results.append(getattr(store, method)(*given))
            except (duckdb.Error, OSError) as error:
                if self.stopped:
                    raise Interrupted("stopped") from None
                raise engine_error(error, store.directory) from None
        return results

    def interrupt(self) -> None:
        """Stop: the running query raises, and no other starts (from another thread, e.g. a signal handler's), on
        the stores and on the side connections."""
        self.stopped = True
        self.side.interrupt()
        for store in self.stores:
            store.interrupt()

    def close(self) -> None:
        for store in self.stores:
            store.close()


def engine_error(error: BaseException, work: Path) -> CommandError:
    """A user's error for what the engine raised: a full disk or memory names the setting to change; otherwise
    DuckDB's message (it names the file of a corrupt or truncated input)."""
    text = duckdb_error(error) if not isinstance(error, OSError) else str(error)
    lowered = text.lower()
    # DuckDB caps its spill at the free space of the disk, and says "failed to offload" when the cap is reached.
    full = ("no space left", "disk is full", "failed to offload")
    if any(marker in lowered for marker in full) or getattr(error, "errno", None) == 28:
        return CommandError(
            f"no space left on the disk of {work} (the engine's database and spill files) or of --out: free space, "
            f"or give --temp-dir a larger disk ({text})"
        )
    if "out of memory" in lowered:
        return CommandError(f"the engine ran out of memory: raise --memory-limit or give --temp-dir more disk ({text})")
    return CommandError(text)


# ------------------------------------------------------------------------------------------------ the output
def prepare_out(out: Path) -> None:
    """Make ``out`` ready: new, empty, or left by an ingest that did not finish (its ``.ingest`` directory is there
    and no manifest): its files are deleted. CommandError for any other non-empty directory."""
    if out.exists() and not out.is_dir():
        raise CommandError(f"--out {out} is a file; give a new or empty directory")
    if out.is_dir() and any(out.iterdir()):
        if (out / WORK_DIR).is_dir() and not (out / layout.MANIFEST_NAME).exists():
            clear(out)
        else:
            raise CommandError(f"--out {out} is not empty; give a new or empty directory")
    out.mkdir(parents=True, exist_ok=True)
    (out / WORK_DIR).mkdir()


def clear(out: Path) -> None:
    """Delete what an ingest writes in ``out`` (it leaves ``out`` itself)."""
    for child in out.iterdir():
        if child.is_dir() and not child.is_symlink():
            shutil.rmtree(child, ignore_errors=True)
        else:
            child.unlink(missing_ok=True)


# ------------------------------------------------------------------------------------------------- the steps
def _columns(source: Source, options: IngestOptions, say, side: SideConnections) -> Columns:
    user = source.column(options.user, "--user")
    item = source.column(options.item, "--item")
    time_column = source.column(options.time, "--time") if options.time else None
    value_option = "--rating" if options.rating else "--weight"
    value = source.column(options.value, value_option) if options.value else None
    unit = options.time_unit
    if time_column is not None and unit == "auto":
        sample = _time_sample_max(source, time_column, side)
        unit = "s" if sample is None else epoch_unit_of(sample)
        if sample is not None:
            say(f"times are numbers up to {sample:.0f} in the first rows: epoch {EPOCH_UNIT_NAMES[unit]} (--time-unit)")
    return Columns(source, user, item, time_column, value, "s" if unit == "auto" else unit)


UNIT_MS = {"s": 1e-3, "ms": 1.0, "us": 1e3, "ns": 1e6}  # an epoch number of each unit per millisecond


def _check_time_unit(columns: Columns, options: IngestOptions, largest_ms: int) -> None:
    """CommandError when the column's largest time (``largest_ms``, epoch ms as read) is a number too large for
    the unit it was read in (a date after the year 5138): with ``--time-unit auto``, a column whose first rows are
    seconds and later rows microseconds; with a unit given, one too coarse for the numbers. Either would give dates
    thousands of years away without an error."""
    if columns.time is None or columns.time_is_timestamp():
        return
    largest = largest_ms * UNIT_MS[columns.time_unit]  # the largest number, in the unit it was read in
    unit = epoch_unit_of(largest)
    if list(UNIT_MS).index(unit) > list(UNIT_MS).index(columns.time_unit):
        read_as = (
            f"its first rows read as epoch {EPOCH_UNIT_NAMES[columns.time_unit]}; one column holds one unit"
            if options.time_unit == "auto"
            else f"--time-unit {columns.time_unit} reads them as dates after the year 5138"
        )
        raise CommandError(
            f"the time column {columns.time!r} holds numbers up to {largest:.0f}, epoch {EPOCH_UNIT_NAMES[unit]} by "
            f"their size, but {read_as}: pass --time-unit s|ms|us|ns"
        )


def _time_sample_max(source: Source, column: str, side: SideConnections) -> float | None:
    import duckdb

    with side.connect() as con:
        try:
            value = con.sql(
                f"SELECT max(abs(TRY_CAST({quote_identifier(column)} AS DOUBLE))) FROM "
                f"(SELECT {quote_identifier(column)} FROM {source.scan(source.files[:1])} LIMIT 10000)"
            ).fetchall()[0][0]
        except duckdb.InterruptException:
            raise
        except Exception:  # noqa: BLE001 - a column of timestamps, or text: no number to size
            value = None
    return None if value is None else float(value)


def locate_bad_row(source: Source, columns: Columns, what: str, side: SideConnections) -> str:
    """Where the first value of ``what`` ("time" or "value") that does not parse is: ``FILE row N: …``.

    Reads the files in order, one at a time, in their row order (the error path only), on a connection of
    ``side`` (a stop interrupts it)."""
    name = columns.time if what == "time" else columns.value
    parsed = columns.time_sql() if what == "time" else columns.value_sql()
    bad = "parsed IS NULL" if what == "time" else "parsed IS NULL OR NOT isfinite(parsed)"
    ids = f"{columns.id_sql(columns.user)} IS NOT NULL AND {columns.id_sql(columns.item)} IS NOT NULL"
    with side.connect({"preserve_insertion_order": True, "threads": 1}) as con:
        con.execute("SET TimeZone = 'UTC'").fetchall()
        for file in source.files:
            reader = con.sql(
                f"SELECT CAST({quote_identifier(name)} AS VARCHAR) AS raw, ({bad}) AND {ids} AS bad FROM "
                f"(SELECT *, {parsed} AS parsed FROM {source.scan([file])})"
            ).to_arrow_reader(BATCH_ROWS)
            seen = 0
            for batch in reader:
                side.check()
                flags = batch.column(1).to_numpy(zero_copy_only=False)
                hits = np.flatnonzero(flags == True)  # noqa: E712 - nulls (a null id) are not hits
                if len(hits):
                    row = seen + int(hits[0])
                    raw = batch.column(0)[int(hits[0])].as_py()
                    line = f" (line {row + 1 + int(source.header)})" if source.format == "csv" else ""
                    unit = f"epoch {EPOCH_UNIT_NAMES[columns.time_unit]} (--time-unit)"
                    kind = f"a time ({unit}, or ISO-8601)" if what == "time" else "a finite number"
                    return f"{file} row {row + 1}{line}: column {name!r} holds {raw!r}, which is not {kind}"
                seen += batch.num_rows
    return f"a {what} value that does not parse (column {name!r}; not located)"


class _Distinct:
    """The union of the stores' distinct ids (pyarrow arrays), kept distinct as each store's arrive, so that the
    driver holds about two copies of the catalog at once, not one per store."""

    def __init__(self):
        self.ids = None

    def add(self, ids) -> None:
        import pyarrow as pa
        import pyarrow.compute as pc

        ids = id_array(ids)  # text as large_string: the catalog's ids may pass 2 GiB
        if self.ids is None:
            self.ids = ids
        elif len(ids):
            self.ids = id_array(pc.unique(pa.chunked_array([self.ids, ids.cast(self.ids.type)])))


class _Sums:
    """Per-code sums (and minima) of the stores' sparse ``(codes, values…)`` results, added as each arrives:
    int64[size] arrays, whatever the number of stores."""

    def __init__(self, size: int, minimum: bool = False):
        self.sums = np.zeros(size, dtype=np.int64)
        self.minima = np.full(size, np.iinfo(np.int64).max, dtype=np.int64) if minimum else None
        self.rest: list = []  # the results' other fields, summed

    def add(self, result) -> None:
        """Add ``(codes, values[, minima], scalars…)`` of one store."""
        codes, values, *rest = result
        self.sums[codes] += values  # a store lists each code once
        if self.minima is not None:
            self.minima[codes] = np.minimum(self.minima[codes], rest.pop(0))
        self.rest = [a + b for a, b in zip(self.rest, rest, strict=True)] if self.rest else list(rest)


def _item_codes(distinct, integer_ids: bool):
    """The stores' distinct items (one pyarrow array) -> ``(ids, codes table)``: ids in the order of their
    original values (numeric when ``integer_ids``), coded 0, 1, … in that order."""
    import pyarrow as pa
    import pyarrow.compute as pc

    ids = distinct
    ordered = ids.cast(pa.int64()) if integer_ids and not pa.types.is_integer(ids.type) else ids
    order = pc.sort_indices(ordered)
    return ordered.take(order), pa.table({"id": ids.take(order), "ic": pa.array(np.arange(len(ids)), type=pa.int32())})


def _all_integers(ids) -> bool:
    """Whether every text id of the pyarrow array ``ids`` is a canonically written int64."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if pa.types.is_integer(ids.type):
        return True
    try:
        numbers = pc.cast(ids, pa.int64())
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        return False
    return pc.all(pc.equal(pc.cast(numbers, pa.large_string()), ids.cast(pa.large_string()))).as_py() is not False


def _random_cuts(engine, total: int, fractions) -> list:
    """The ``(key, user_id, item_id)`` cut points that give the random split its exact sizes
    (``round(f * total)`` train and valid rows), from the stores' key histograms and the rows of the bins a cut
    falls in. Rows are ranked by key (a seeded hash of the pair), ties by the pair."""
    import pyarrow as pa

    histogram = _Sums(1 << (64 - KEY_BINS_SHIFT))
    engine.fold("key_histogram", histogram.add)
    histogram = histogram.sums
    before = np.concatenate([[0], np.cumsum(histogram)])
    sizes = [int(round(fractions[0] * total)), int(round(fractions[1] * total))]
    cuts = []
    for rank in (sizes[0], sizes[0] + sizes[1]):  # the first row of valid, the first row of test
        if rank >= total:
            cuts.append(None)
            continue
        bin_ = int(np.searchsorted(before, rank, side="right") - 1)
        rows = pa.concat_tables(engine.map("keys_in_bin", bin_)).sort_by(
            [("key", "ascending"), ("user_id", "ascending"), ("item_id", "ascending")]
        )
        row = rows.slice(rank - int(before[bin_]), 1).to_pylist()[0]
        cuts.append((row["key"], row["user_id"], row["item_id"]))
    return cuts


def _vocabulary_table(id_name: str, count: int, originals, counts, first_seen, extra=None):
    """``users.parquet`` / ``items.parquet``: dense ids ``0..count-1``, their ``originals``, ``counts`` and
    ``first_seen`` (a pyarrow array of epoch seconds, or None), and the ``extra`` columns."""
    import pyarrow as pa

    columns = {
        id_name: pa.array(np.arange(count, dtype=np.int32)),
        "original_id": originals,
        "count": pa.array(np.asarray(counts, dtype=np.int64)),
    }
    if first_seen is not None:
        columns["first_seen"] = first_seen
    table = pa.table(columns)
    for name, column in (extra or {}).items():
        table = table.append_column(name, column)
    return table


def _seconds(firsts_ms):
    """Epoch milliseconds (int64[n] or None) as a pyarrow array of epoch seconds (or None)."""
    import pyarrow as pa

    return None if firsts_ms is None else pa.array(np.floor_divide(np.asarray(firsts_ms, dtype=np.int64), 1000))


def _scattered(values, dense: np.ndarray, size: int) -> np.ndarray:
    """int64[size]: ``values[k]`` at ``dense[k]``, 0 elsewhere (the reserved ids of a parent without rows here)."""
    out = np.zeros(size, dtype=np.int64)
    out[dense] = np.asarray(values, dtype=np.int64)
    return out


def _write_vocabulary(path: Path, table) -> None:
    """Write ``users.parquet`` / ``items.parquet``: original ids held as ``large_string`` (they may pass 2 GiB)
    are written as ``string`` when they fit, the type the vocabularies always had."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from bigrank import integrity

    ids = table.column("original_id")
    if pa.types.is_large_string(ids.type) and ids.nbytes < 2**31:
        table = table.set_column(table.schema.get_field_index("original_id"), "original_id", ids.cast(pa.string()))

    layout.write_atomic(
        path, lambda tmp: pq.write_table(table, tmp, compression=layout.COMPRESSION, **integrity.PARQUET_WRITE_OPTIONS)
    )


def item_attributes(items, options: IngestOptions, integer_ids: bool, say, side: SideConnections):
    """The attribute columns of the items file for ``items`` (original ids in dense order): ``{name: array}``,
    null for items the file does not list. CommandError for a missing key column, a key that is not unique,
    or an attribute named like a vocabulary column. Read on a connection of ``side`` (a stop interrupts it)."""
    import duckdb
    import pyarrow as pa

    spec = options.extra.get("items_source") or {}
    source = open_source(
        [options.items_file],
        spec.get("format", options.items_format),
        spec.get("delimiter", options.items_delimiter),
        spec.get("header"),
        spec.get("encoding", "utf-8"),
        typed_text=True,
    )
    key = source.column(options.item_key, "--item-key")
    renames = spec.get("columns") or {name: name for name in source.columns if name != key}
    clash = sorted(set(renames.values()) & {"item_id", *VOCAB_COLUMNS})
    if clash:
        raise CommandError(
            f"--items-file {options.items_file}: the columns {clash} clash with the vocabulary's; rename them"
        )
    with side.connect() as con:
        try:
            key_type = "BIGINT" if integer_ids else "VARCHAR"
            selected = ", ".join(f"{quote_identifier(src)} AS {quote_identifier(dst)}" for src, dst in renames.items())
            con.execute(
                f"CREATE TABLE attributes AS SELECT TRY_CAST({quote_identifier(key)} AS {key_type}) AS item_key"
                f"{', ' + selected if selected else ''} FROM {source.scan()}"
            ).fetchall()
            duplicate = con.sql(
                "SELECT item_key, count(*) FROM attributes WHERE item_key IS NOT NULL GROUP BY item_key "
                "HAVING count(*) > 1 ORDER BY item_key LIMIT 1"
            ).fetchall()
            if duplicate:
                duplicate = duplicate[0]
                raise CommandError(
                    f"--items-file {options.items_file}: the key {duplicate[0]!r} of column {key!r} appears "
                    f"{duplicate[1]} times; each item must appear once"
                )
            con.register("vocabulary", pa.table({"item_key": items, "position": np.arange(len(items))}))
            joined = con.sql(
                "SELECT attributes.* EXCLUDE (item_key) FROM vocabulary LEFT JOIN attributes USING (item_key) "
                "ORDER BY position"
            ).to_arrow_table()
            listed = int(
                con.sql("SELECT count(*) FROM vocabulary SEMI JOIN attributes USING (item_key)").fetchall()[0][0]
            )
        except (CommandError, duckdb.InterruptException):
            raise
        except Exception as error:  # DuckDB's IO/conversion errors name the file
            raise CommandError(f"cannot read --items-file {options.items_file}: {duckdb_error(error)}") from None
    say(f"items file: {listed:,} of {len(items):,} items have attributes ({', '.join(joined.column_names)})")
    return {name: joined.column(name) for name in joined.column_names}


def _load(source: Source, columns: Columns, options: IngestOptions, engine, say) -> dict[str, int]:
    """Step 1: scan the inputs into the stores; the counts. CommandError for a value that does not parse (the
    first one located) or when no row has both ids."""
    delimiter = f", delimiter {source.delimiter!r}" if source.format == "csv" else ""
    say(f"reading {len(source.files)} {source.format} file(s) ({_size(source.files)}{delimiter}) with {engine.name}")
    loaded = engine.load(source, columns)
    counts = {name: int(sum(part[name] for part in loaded)) for name in loaded[0]}
    say(f"read {counts['rows_read']:,} rows")
    for what, key in (("time", "bad_time"), ("value", "bad_value")):
        if counts[key]:
            where = locate_bad_row(source, columns, what, engine.side)
            raise CommandError(f"{counts[key]:,} row(s) hold a {what} that does not parse; the first: {where}")
    _check_time_unit(columns, options, max(part["largest_time"] for part in loaded))
    if counts["rows_read"] == counts["null_user"] + counts["null_item"]:
        raise CommandError(
            f"nothing left: all {counts['rows_read']:,} rows have a null or empty user or item id "
            f"(columns {columns.user!r}, {columns.item!r})"
        )
    return counts


def _encode(source: Source, columns: Columns, options: IngestOptions, engine, counts: dict, say):
    """Steps 2-3: item codes from every store's items, then codes, dedup and --min-rating (on the merged rating)
    in the stores. Returns ``(item originals in code order, integer item ids?, pairs)``."""
    union = _Distinct()
    engine.fold("distinct_ids", union.add, "i")
    distinct = union.ids
    integer_items = not columns.item_is_text() or (
        columns.text_may_be_integer(columns.item) and (len(distinct) == 0 or _all_integers(distinct))
    )
    item_originals, item_codes = _item_codes(distinct, integer_items)
    kept = counts["rows_read"] - counts["null_user"] - counts["null_item"]
    encoded = engine.map("encode", item_codes, options.min_rating, options.dedup)
    merged = sum(part["merged"] for part in encoded)
    counts["duplicates"] = kept - merged
    counts["below_min_rating"] = sum(part["below_min_rating"] for part in encoded)
    pairs = merged - counts["below_min_rating"]
    say(f"{kept:,} rows with both ids; dedup ({options.dedup}): {counts['duplicates']:,} merged, {merged:,} pairs")
    if options.min_rating is not None:
        say(f"--min-rating {options.min_rating:g}: {counts['below_min_rating']:,} pairs rated below it dropped")
        if pairs == 0:
            raise CommandError(
                f"nothing left after --min-rating {options.min_rating:g}: every pair's rating (after --dedup "
                f"{options.dedup}) is below it"
            )
    return item_originals, integer_items, pairs


def _kcore(options: IngestOptions, engine, num_codes: int, pairs: int, counts: dict, say) -> int:
    """Step 4: the k-core, to its fixed point (item counts summed over the stores each round); fills the counts
    and returns the pairs left. CommandError when it leaves none."""
    rounds, before, users_start, items_start = 0, pairs, 0, 0
    while options.min_user_items > 1 or options.min_item_users > 1:
        reduced = _Sums(num_codes)
        engine.fold("kcore_counts", reduced.add, options.min_user_items)
        item_counts, (users_below, users) = reduced.sums, reduced.rest
        if rounds == 0:
            items_start, users_start = int(np.count_nonzero(item_counts)), users
        dropped_items = np.flatnonzero((item_counts > 0) & (item_counts < options.min_item_users)).astype(np.int32)
        if len(dropped_items) == 0 and users_below == 0:
            break
        rounds += 1
        previous = pairs
        pairs = sum(engine.map("drop", options.min_user_items, dropped_items))
        below = f"{users_below:,} users and {len(dropped_items):,} items below it"
        say(f"k-core round {rounds}: {below}, {pairs:,} pairs left")
        if pairs == 0:
            raise CommandError(
                f"nothing left after the k-core (--min-user-items {options.min_user_items} --min-item-users "
                f"{options.min_item_users}): round {rounds} removed the last {previous:,} pairs ({before:,} before it)"
            )
    # What the k-core dropped of users and items is counted against the vocabularies (step 5).
    counts.update(k_core_rounds=rounds, k_core_rows=before - pairs, k_core_users_start=users_start)
    counts["k_core_items_start"] = items_start
    return pairs


def _split(options: IngestOptions, engine, pairs: int, say, parent: ParentVocabulary | None = None):
    """Step 6: label the rows (the per-user split was labelled with the dense ids); ``(rows per split, rows per
    split kept from the parent or None)``. CommandError for a split that should have rows and has none.

    The random split of a child of ``parent`` (``--vocab-from``): a pair the parent holds keeps the parent's
    split, exactly (a model warm-started from the parent's run never sees one of its training pairs held out);
    the pairs new here are split among themselves with exact sizes (``round(f * new pairs)`` train and valid), so
    a split holds the parent's pairs of it that are still there plus its share of the new ones."""
    kept = None
    if options.split == "random":
        if parent is not None and options.keep_parent_split:
            kept = np.sum(engine.map("inherit_labels", parent.split_files()), axis=0).tolist()
            held = ", ".join(f"{n:,} {name}" for name, n in zip(layout.SPLITS, kept, strict=True))
            say(f"pairs of the parent keep its split: {held}")
        new = pairs - (sum(kept) if kept else 0)
        engine.map("label_random", _random_cuts(engine, new, options.fractions))
    elif options.split == "time":
        valid, test = parse_time(options.valid_from, "--valid-from"), parse_time(options.test_from, "--test-from")
        engine.map("label_time", valid, test)
    split_rows = np.sum(engine.map("split_counts"), axis=0).tolist()
    for label, name in enumerate(layout.SPLITS):
        expected = options.fractions[label] > 0 if options.split != "time" else True
        if expected and split_rows[label] == 0:
            raise CommandError(f"the {name} split has no rows ({_split_rule(options, name)}); {pairs:,} pairs in all")
    say("split " + ", ".join(f"{name} {rows:,}" for name, rows in zip(layout.SPLITS, split_rows, strict=True)))
    return split_rows, kept


def _write_splits(out: Path, options: IngestOptions, engine, stores: int) -> dict[str, list[str]]:
    """Step 7: every store writes its rows of each split (hidden names); the driver names the parts in store order,
    which is user-id order, so the parts of a split hold its rows sorted by ``(user_id, item_id)``."""
    split_files = {}
    for label, name in enumerate(layout.SPLITS):
        pieces = engine.map_each(
            "write_split", [(str(out), name, label, f".store-{k:05d}", options.value_name) for k in range(stores)]
        )
        split_files[name] = []
        for piece in pieces:
            for relative in piece:
                final = layout.part_name(name, len(split_files[name]))
                os.replace(out / relative, out / final)
                split_files[name].append(final)
    return split_files


def run(source: Source, out: Path, options: IngestOptions, engine, say) -> tuple[dict, dict, int, int]:
    """The steps (module docstring) over ``engine``'s stores; writes the splits and vocabularies in ``out``.
    Returns ``(the manifest's ingest entry, split files, num_users, num_items)``."""
    import pyarrow as pa

    started = time.monotonic()
    parent = ParentVocabulary.load(options.vocab_from) if options.vocab_from else None  # its errors come first
    columns = _columns(source, options, say, engine.side)
    counts = _load(source, columns, options, engine, say)
    item_originals, integer_items, pairs = _encode(source, columns, options, engine, counts, say)
    num_codes = len(item_originals)
    pairs = _kcore(options, engine, num_codes, pairs, counts, say)

    # Step 5, the vocabularies: items ranked here from every store's counts; users ranked by each store, offset by
    # the users of the stores before it (stores hold contiguous ranges of user hashes).
    stats = _Sums(num_codes, minimum=columns.time is not None)
    engine.fold("item_stats", stats.add)
    item_count, item_first = stats.sums, stats.minima
    present = np.flatnonzero(item_count > 0)
    order = rank_ids(item_originals.take(pa.array(present)))
    items = item_originals.take(pa.array(present[order]))
    integer_users = not columns.user_is_text() or (
        columns.text_may_be_integer(columns.user) and all(engine.map("users_are_integers"))
    )
    if parent is not None:
        parent.check_types(integer_users, integer_items)
    user_tables = engine.map("user_vocabulary", integer_users)
    users = pa.concat_tables(user_tables)
    item_firsts = None if item_first is None else item_first[present][order]
    user_firsts = users.column("first_seen_ms").to_numpy() if "first_seen_ms" in users.column_names else None
    item_dense = np.arange(len(present), dtype=np.int32)
    last = (options.fractions[1], options.fractions[2]) if options.split == "last" else None
    if parent is None:
        offsets = np.concatenate([[0], np.cumsum([t.num_rows for t in user_tables])]).astype(np.int64)
        finalize_args = [(int(o), last, None) for o in offsets[:-1]]
        user_vocabulary = _vocabulary_table(
            "user_id", users.num_rows, users.column("original_id"), users.column("count"), _seconds(user_firsts)
        )
        item_vocabulary = items
    else:  # ids kept from the parent (one store: options.check refuses the cluster engine)
        user_dense, user_originals = extend_ids(parent.users, users.column("original_id"))
        item_dense, item_vocabulary = extend_ids(parent.items, items)
        ranks = pa.table({"rank": pa.array(np.arange(users.num_rows, dtype=np.int32)), "user_id": user_dense})
        finalize_args = [(0, last, ranks)]
        user_vocabulary = _vocabulary_table(
            "user_id",
            len(user_originals),
            user_originals,
            _scattered(users.column("count").to_numpy(), user_dense, len(user_originals)),
            merged_firsts(parent.user_firsts, user_dense, user_firsts, len(user_originals)),
        )
    item_ids = np.empty(len(present), dtype=np.int32)
    item_ids[order] = item_dense
    item_table = pa.table({"ic": pa.array(present, type=pa.int32()), "item_id": item_ids})  # one object: sent once
    key_seed = options.seed if options.split == "random" else None  # the split key, computed once a pair
    engine.map_each("finalize", [(offset, item_table, rest, ranks, key_seed) for offset, rest, ranks in finalize_args])
    num_users, num_items = user_vocabulary.num_rows, len(item_vocabulary)
    kept = f" ({users.num_rows:,} and {len(present):,} with rows)" if parent is not None else ""
    say(f"vocabularies: {num_users:,} users, {num_items:,} items{kept}")

    split_rows, kept_from_parent = _split(options, engine, pairs, say, parent)
    split_files = _write_splits(out, options, engine, len(user_tables))
    _write_vocabulary(out / "users.parquet", user_vocabulary)
    attributes = (
        item_attributes(item_vocabulary, options, integer_items, say, engine.side) if options.items_file else None
    )
    if parent is None:
        item_counts, item_seen = item_count[present][order], _seconds(item_firsts)
    else:
        item_counts = _scattered(item_count[present][order], item_dense, num_items)
        item_seen = merged_firsts(parent.item_firsts, item_dense, item_firsts, num_items)
    _write_vocabulary(
        out / "items.parquet",
        _vocabulary_table("item_id", num_items, item_vocabulary, item_counts, item_seen, attributes),
    )
    record = {
        "engine": engine.name,
        "inputs": {
            "files": len(source.files),
            "format": source.format,
            "first": source.files[0],
            "bytes": _bytes(source.files),
        },  # fmt: skip
        "columns": {
            "user": columns.user,
            "item": columns.item,
            "time": columns.time,
            options.value_name or "value": columns.value,
        },  # fmt: skip
        "id_types": {"user": "int64" if integer_users else "string", "item": "int64" if integer_items else "string"},
        "options": options.record(),
        "time_unit": columns.time_unit,
        "counts": {
            "rows_read": counts["rows_read"],
            "dropped_null_user": counts["null_user"],
            "dropped_null_item": counts["null_item"],
            "dropped_below_min_rating": counts["below_min_rating"],
            "merged_duplicates": counts["duplicates"],
            "k_core_rounds": counts["k_core_rounds"],
            "k_core_dropped_rows": counts["k_core_rows"],
            "k_core_dropped_users": counts["k_core_users_start"] - users.num_rows if counts["k_core_rounds"] else 0,
            "k_core_dropped_items": counts["k_core_items_start"] - len(present) if counts["k_core_rounds"] else 0,
        },
        "split": {
            "mode": options.split,
            "fractions": list(options.fractions),
            "rows": dict(zip(layout.SPLITS, split_rows, strict=True)),
        },  # fmt: skip
        "duckdb": _duckdb_version(),
        "seconds": round(time.monotonic() - started, 1),
    }
    if options.split == "time":
        record["split"].update(valid_from=options.valid_from, test_from=options.test_from)
    if kept_from_parent is not None:
        record["split"]["kept_from_parent"] = dict(zip(layout.SPLITS, kept_from_parent, strict=True))
    if parent is not None:
        # Top-level manifest keys (the ingest moves them there); reserved ids have no rating.
        record["stable_ids"] = dict(
            parent.record(num_users, num_items), num_rated_users=users.num_rows, num_rated_items=len(present)
        )
    return record, split_files, num_users, num_items


def _split_rule(options: IngestOptions, name: str) -> str:
    if options.split == "time":
        rules = {
            "train": f"times before --valid-from {options.valid_from}",
            "valid": f"times in [--valid-from {options.valid_from}, --test-from {options.test_from})",
            "test": f"times from --test-from {options.test_from} on",
        }
        return rules[name]
    if options.split == "last":
        return (
            f"--split last: users need 3 pairs to hold any out; fraction {options.fractions[layout.SPLITS.index(name)]}"
        )
    return f"--split random, fraction {options.fractions[layout.SPLITS.index(name)]}"


def _duckdb_version() -> str:
    import duckdb

    return duckdb.__version__


def _bytes(files) -> int:
    return int(sum(os.path.getsize(f) for f in files))


def _size(files) -> str:
    return f"{_bytes(files) / 1e6:,.1f} MB"
