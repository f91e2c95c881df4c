"""One DuckDB database holding interaction rows through the cleaning steps: the unit both engines run.

One machine runs one :class:`RowStore` over every row; the cluster engine runs one per bucket of users (a Ray actor
each, ``bigrank.data.ingest.cluster``). A store only does what needs its own rows; whatever needs every bucket
(item counts for the k-core, the item vocabulary, the random split's cut points) is reduced by the driver
(``bigrank.data.ingest.pipeline``) from what the stores return, and handed back. So the same steps, in the same
order, give the same rows whatever the number of stores.

Tables, in the order the steps create them (each replaces the one before, so one copy of the rows is kept):

    raw     u, i (ids as scanned), t (epoch ms), v (rating or weight), bad (bit 1: time, bit 2: value)
    pairs   uc, ic (integer codes of the ids), t, v     one row per pair (dedup) of the rows with both ids, then
                                                        the pairs whose merged value is below --min-rating
                                                        dropped; then the k-core
    final   user_id, item_id, ic, t, v[, label][, key]  dense ids; the split label (0/1/2) is a column for the
            [, parent_label]                            per-user split, else an expression (``label_sql``);
                                                        the parent dataset's label of a pair it holds
                                                        (``--vocab-from`` with the random split); the random
                                                        split's key (:func:`with_split_key`), computed once

The database is in memory, and DuckDB spills what does not fit its memory limit (tables included) to files in the
store's directory, so a store's memory is bounded by the limit, not by its rows. (A database file would instead
checkpoint, with an fsync, at every table a step makes.)
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from bigrank.data.ingest.hashing import MASK64, PRIME64_2, PRIME64_3, id_array, rank_ids, split_seed_term
from bigrank.data.ingest.sources import NUMBER_TYPES, TIME_TYPES, Source, file_list, quote_identifier

__all__ = ["Columns", "RowStore", "KEY_BINS_SHIFT"]

KEY_BINS_SHIFT = 48  # the random split's histogram bins are the top 16 bits of a row's 64-bit key
# Integer id columns every value of which is an int64; wider ones (UBIGINT: hashed 64-bit ids; HUGEINT) are read as
# their decimal text, and become int64 ids only when every one fits (``Columns.text_may_be_integer``).
INT64_TYPES = ("TINYINT", "SMALLINT", "INTEGER", "BIGINT", "UTINYINT", "USMALLINT", "UINTEGER")
WIDE_INTEGER_TYPES = ("UBIGINT", "HUGEINT", "UHUGEINT")
BAD_TIME, BAD_VALUE = 1, 2


def with_split_key(query: str, seed: int) -> str:
    """The rows of ``query`` (with ``user_id``, ``item_id``) and their random split's key as column ``key``: the
    one definition of the key in SQL, ``bigrank.data.ingest.hashing.split_keys`` (XXH64's avalanche; products
    taken mod 2^64 in 128-bit integers, as DuckDB refuses a 64-bit overflow). One subquery a step, so that each
    step is computed once a row."""

    def times(column: str, shift: int, prime: int) -> str:
        return f"((xor({column}, {column} >> {shift})::UHUGEINT * {prime}::UHUGEINT) & {MASK64}::UHUGEINT)::UBIGINT"

    return (
        "SELECT * EXCLUDE (k0, k1, k2), xor(k2, k2 >> 32) AS key FROM ("
        f"SELECT *, {times('k1', 29, PRIME64_3)} AS k2 FROM ("
        f"SELECT *, {times('k0', 33, PRIME64_2)} AS k1 FROM ("
        f"SELECT *, xor((user_id::UBIGINT << 32) | item_id::UBIGINT, {split_seed_term(seed)}::UBIGINT) AS k0 "
        f"FROM ({query}))))"
    )


class Columns:
    """The mapped columns of a source and the SQL that turns them into ``u, i, t, v``.

    ``time_unit`` is the epoch unit of numeric times (``s``, ``ms``, ``us`` or ``ns``); times given as timestamps
    or ISO-8601 text need none. Times are kept as epoch milliseconds: sub-millisecond digits are dropped (floor).
    """

    def __init__(self, source: Source, user: str, item: str, time: str | None, value: str | None, time_unit: str):
        self.source, self.user, self.item, self.time, self.value = source, user, item, time, value
        self.time_unit = time_unit

    def id_sql(self, name: str) -> str:
        kind = self.source.columns[name]
        column = quote_identifier(name)
        if kind in INT64_TYPES:
            return f"CAST({column} AS BIGINT)"
        return f"NULLIF(CAST({column} AS VARCHAR), '')"

    def time_sql(self) -> str:
        kind = self.source.columns[self.time]
        column = quote_identifier(self.time)
        # A number too large for its unit gives NULL (a time that does not parse: counted, located, refused).
        if self.time_unit in ("s", "ms"):  # fractions of a second or of a millisecond are rounded
            scale = 1000 if self.time_unit == "s" else 1
            number = f"TRY_CAST(round(TRY_CAST({column} AS DOUBLE) * {scale}) AS BIGINT)"
        else:  # integers divided exactly (19-digit nanoseconds are beyond a double's 53 bits), else as a double
            divisor = 1000 if self.time_unit == "us" else 1_000_000
            number = (
                f"COALESCE(TRY_CAST({column} AS BIGINT) // {divisor}, "
                f"TRY_CAST(floor(TRY_CAST({column} AS DOUBLE) / {divisor}) AS BIGINT))"
            )
        if self.time_is_timestamp():
            return f"epoch_ms(CAST({column} AS TIMESTAMPTZ))"
        if kind in NUMBER_TYPES:
            return number
        return f"COALESCE({number}, epoch_ms(TRY_CAST(CAST({column} AS VARCHAR) AS TIMESTAMPTZ)))"

    def time_is_timestamp(self) -> bool:
        """Whether the time column is a date or timestamp (not numbers or text)."""
        kind = self.source.columns[self.time]
        return kind in TIME_TYPES or kind.startswith("TIMESTAMP")

    def value_sql(self) -> str:
        return f"TRY_CAST({quote_identifier(self.value)} AS DOUBLE)"

    def select_sql(self) -> str:
        """``u, i[, t][, v], bad`` of each scanned row."""
        parts = [f"{self.id_sql(self.user)} AS u", f"{self.id_sql(self.item)} AS i"]
        bad = []
        if self.time:
            parts.append(f"{self.time_sql()} AS t")
            bad.append(f"(t IS NULL)::UTINYINT * {BAD_TIME}")
        if self.value:
            parts.append(f"{self.value_sql()} AS v")
            bad.append(f"(v IS NULL OR NOT isfinite(v))::UTINYINT * {BAD_VALUE}")
        return ", ".join(parts), (" + ".join(bad) if bad else "0::UTINYINT")

    def rows_sql(self, scan: str, where: str | None = None) -> str:
        """The query turning the rows of ``scan`` (a DuckDB table function) into ``u, i[, t][, v], bad``: what a
        store loads (:meth:`RowStore.load`), or the cluster engine's read tasks bucket (:meth:`RowStore.load_rows`);
        ``where`` keeps some of the scan's rows (a read task's range of row groups)."""
        selected, bad = self.select_sql()
        kept = f" WHERE {where}" if where else ""
        return f"SELECT *, {bad} AS bad FROM (SELECT {selected} FROM {scan}{kept})"

    def user_is_text(self) -> bool:
        """Whether the user ids are scanned as text (:meth:`id_sql`)."""
        return self.source.columns[self.user] not in INT64_TYPES

    def item_is_text(self) -> bool:
        """Whether the item ids are scanned as text (:meth:`id_sql`)."""
        return self.source.columns[self.item] not in INT64_TYPES

    def text_may_be_integer(self, name: str) -> bool:
        """Whether the ids of column ``name``, scanned as text, are int64 ids when every one is an int64 written
        canonically: text of a CSV (every column is text there) or an integer type wider than int64 (an unsigned
        64-bit column of hashed ids: ids from 2^63 on stay text, their decimal digits; the hash is the same)."""
        return self.source.format == "csv" or self.source.columns[name] in WIDE_INTEGER_TYPES


def _column(table, name: str, dtype) -> np.ndarray:
    """Column ``name`` of the pyarrow ``table`` as a numpy array of ``dtype`` (no nulls)."""
    return table.column(name).to_numpy().astype(dtype, copy=False)


class RowStore:
    """A DuckDB database holding one set of rows through the steps (see the module docstring).

    ``memory_bytes`` and ``threads`` bound DuckDB; what it spills goes to ``directory/spill``.
    """

    def __init__(self, directory: str | Path, memory_bytes: int, threads: int):
        import duckdb

        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        config = {
            "memory_limit": f"{max(int(memory_bytes) >> 20, 64)}MiB",  # MB would be 10^6 bytes to DuckDB
            "threads": int(threads),
            "temp_directory": str(self.directory / "spill"),
            "preserve_insertion_order": False,
        }
        self.con = duckdb.connect(":memory:", config=config)
        self._run("SET TimeZone = 'UTC'")
        self._run("SET enable_progress_bar = false")
        self.has_time = self.has_value = False
        self.label_sql = "0"  # the split label of a row of final: a column or an expression (the split step's)
        self.from_parent = False  # final has parent_label (inherit_labels)

    def close(self) -> None:
        """Close the database (its files stay for the caller to delete)."""
        self.con.close()

    def interrupt(self) -> None:
        """Stop the query running now (from another thread): it raises in the thread that runs it."""
        self.con.interrupt()

    def _run(self, sql: str) -> list:
        """Run ``sql`` to its end (DuckDB 2 wants every result consumed before the next) and return its rows."""
        return self.con.execute(sql).fetchall()

    def _scalar(self, sql: str):
        return self._run(sql)[0][0]

    def _arrow(self, sql: str):
        return self.con.sql(sql).to_arrow_table()

    # ------------------------------------------------------------------------------------------------ load
    def load(self, scan: str, columns: Columns) -> dict:
        """Scan the rows (``scan``: a DuckDB table function or a table name) into ``raw``; returns the counts
        ``rows_read, null_user, null_item, bad_time, bad_value``."""
        self.has_time, self.has_value = columns.time is not None, columns.value is not None
        self._run(f"CREATE OR REPLACE TABLE raw AS {columns.rows_sql(scan)}")
        return self._raw_counts()

    def load_rows(self, scan: str, has_time: bool, has_value: bool) -> dict:
        """Load rows already in ``raw``'s columns (``scan``: a DuckDB table function over the Parquet pieces that
        the cluster engine's read tasks wrote from :meth:`Columns.rows_sql`); returns the counts of :meth:`load`."""
        self.has_time, self.has_value = bool(has_time), bool(has_value)
        self._run(f"CREATE OR REPLACE TABLE raw AS SELECT * FROM {scan}")
        return self._raw_counts()

    def _raw_counts(self) -> dict:
        """The counts of :meth:`load`, and ``largest_time``: the largest absolute time (epoch ms; 0 without)."""
        both = "u IS NOT NULL AND i IS NOT NULL"
        largest = "coalesce(max(abs(t)), 0)" if self.has_time else "0"
        (row,) = self._run(
            f"SELECT count(*), count(*) FILTER (WHERE u IS NULL), count(*) FILTER (WHERE u IS NOT NULL AND i IS NULL), "
            f"count(*) FILTER (WHERE {both} AND bad & {BAD_TIME} > 0), "
            f"count(*) FILTER (WHERE {both} AND bad & {BAD_VALUE} > 0), {largest} FROM raw"
        )
        names = ("rows_read", "null_user", "null_item", "bad_time", "bad_value", "largest_time")
        return dict(zip(names, (int(x) for x in row), strict=True))

    def distinct_ids(self, column: str):
        """The distinct non-null ids of ``column`` ("u" or "i") among rows with both ids (a pyarrow array)."""
        return self._arrow(f"SELECT DISTINCT {column} AS id FROM raw WHERE u IS NOT NULL AND i IS NOT NULL").column(0)

    def encode(self, item_codes, min_rating: float | None, dedup: str) -> dict:
        """Replace the ids by integer codes (users: by this store, in id order; items: ``item_codes``, a pyarrow
        table ``(id, ic)`` from the driver), merge the rows of each (user, item) pair with both ids into one
        (``dedup``), then drop the pairs whose merged value is below ``min_rating``: ``raw`` becomes ``pairs``.
        Returns ``{"merged": pairs after the merge, "below_min_rating": pairs dropped by min_rating}``.

        ``last``/``first``: the row with the latest/earliest time (ties: the larger/smaller value); ``sum``/``max``:
        the sum/max of the values, at the latest time. Without a time or value column the pair is kept once.
        ``min_rating`` tests the value the pair keeps, so that the latest opinion (``last``) decides, not an older
        row that passed the filter on its own.
        """
        self._run(
            "CREATE OR REPLACE TABLE user_codes AS SELECT id, (row_number() OVER (ORDER BY id) - 1)::INTEGER AS uc "
            "FROM (SELECT DISTINCT u AS id FROM raw WHERE u IS NOT NULL AND i IS NOT NULL)"
        )
        self.con.register("item_codes_given", item_codes)
        self._run("CREATE OR REPLACE TABLE item_codes AS SELECT * FROM item_codes_given")
        self.con.unregister("item_codes_given")
        keep, values = [], []
        if self.has_time and self.has_value and dedup in ("last", "first"):
            keep = [f"{'max' if dedup == 'last' else 'min'}(struct_pack(t := t, v := v)) AS m"]
            values = ["m.t AS t", "m.v AS v"]
        else:
            if self.has_time:
                keep.append(f"{'min' if dedup == 'first' else 'max'}(t) AS t")
                values.append("t")
            if self.has_value:
                keep.append(f"{'sum' if dedup == 'sum' else 'max'}(v) AS v")
                values.append("v")
        where = "bad = 0"
        # One pass from the scanned rows to the pairs (the coded rows are never stored on their own), grouped by the
        # pair packed into one BIGINT: one 8-byte key hashes and compares faster than two columns (62 s against
        # 71 s for 100M rows of which 97M pairs, 4 GB limit, 2 threads).
        carried = "".join([", t"] * self.has_time + [", v"] * self.has_value)
        pairs = self._scalar(
            "CREATE OR REPLACE TABLE pairs AS SELECT (k >> 32)::INTEGER AS uc, (k & 4294967295)::INTEGER AS ic"
            f"{''.join(', ' + v for v in values)} FROM (SELECT {', '.join(['k', *keep])} FROM ("
            f"SELECT (user_codes.uc::BIGINT << 32) | item_codes.ic AS k{carried} FROM raw "
            "JOIN user_codes ON raw.u = user_codes.id JOIN item_codes ON raw.i = item_codes.id "
            f"WHERE {where}) GROUP BY k)"
        )  # CREATE TABLE … AS answers the rows it wrote
        self._run("DROP TABLE raw")
        below = 0
        if min_rating is not None:  # DELETE answers the rows it deleted
            below = self._scalar(f"DELETE FROM pairs WHERE v < {float(min_rating)!r}")
        return {"merged": int(pairs), "below_min_rating": int(below)}

    # ---------------------------------------------------------------------------------------------- k-core
    def kcore_counts(self, min_items: int) -> tuple[np.ndarray, np.ndarray, int, int]:
        """``(item codes int32[k], their pairs int64[k], users with fewer than min_items pairs, users)`` of
        ``pairs``, for the k items this store holds (sparse: a cluster's driver sums the buckets' counts as they
        arrive, never a bucket x catalog array); the users' counts are kept for :meth:`drop`."""
        users = self._scalar("CREATE OR REPLACE TABLE user_counts AS SELECT uc, count(*) AS c FROM pairs GROUP BY uc")
        below = int(self._scalar(f"SELECT count(*) FROM user_counts WHERE c < {int(min_items)}"))
        table = self._arrow("SELECT ic, count(*) AS c FROM pairs GROUP BY ic")
        return _column(table, "ic", np.int32), _column(table, "c", np.int64), below, int(users)

    def drop(self, min_items: int, dropped_items: np.ndarray) -> int:
        """One k-core pass: drop the pairs of users with fewer than ``min_items`` pairs (as :meth:`kcore_counts`
        counted them) and of the item codes ``dropped_items``; returns the pairs left."""
        import pyarrow as pa

        self.con.register("dropped_items", pa.table({"ic": pa.array(dropped_items, type=pa.int32())}))
        pairs = self._scalar(
            "CREATE OR REPLACE TABLE pairs_kept AS SELECT * FROM pairs "
            f"WHERE uc IN (SELECT uc FROM user_counts WHERE c >= {int(min_items)}) "
            "AND ic NOT IN (SELECT ic FROM dropped_items)"
        )
        self.con.unregister("dropped_items")
        self._run("DROP TABLE pairs")
        self._run("ALTER TABLE pairs_kept RENAME TO pairs")
        return int(pairs)

    # ------------------------------------------------------------------------------------------ vocabulary
    def item_stats(self) -> tuple[np.ndarray, ...]:
        """``(item codes int32[k], their pairs int64[k][, their first time in ms int64[k]])`` for the k items this
        store holds (sparse, as :meth:`kcore_counts`; the times when the rows have them)."""
        first = ", min(t) AS f" if self.has_time else ""
        table = self._arrow(f"SELECT ic, count(*) AS c{first} FROM pairs GROUP BY ic")
        stats = (_column(table, "ic", np.int32), _column(table, "c", np.int64))
        return (*stats, _column(table, "f", np.int64)) if self.has_time else stats

    def user_vocabulary(self, integer_ids: bool):
        """This store's users in dense-id order (by ``(xxh64, id)``, ``bigrank.data.ingest.hashing``) as a pyarrow
        table ``original_id, count[, first_seen_ms]``; ranks them (``user_ranks``) for :meth:`finalize`."""
        import pyarrow as pa

        first = ", min(t) AS first_seen_ms" if self.has_time else ""
        table = self._arrow(
            f"SELECT user_codes.uc AS uc, id AS original_id, count(*) AS count{first} FROM pairs "
            "JOIN user_codes ON pairs.uc = user_codes.uc GROUP BY user_codes.uc, id"
        )
        ids = table.column("original_id")
        if integer_ids and not pa.types.is_integer(ids.type):
            ids = ids.cast(pa.int64())
        ids = id_array(ids)  # text as large_string: this store's ids may pass 2 GiB
        order = rank_ids(ids)
        ranks = np.empty(len(order), dtype=np.int32)
        ranks[order] = np.arange(len(order), dtype=np.int32)
        self.con.register("user_ranks_given", pa.table({"uc": table.column("uc"), "rank": ranks}))
        self._run("CREATE OR REPLACE TABLE user_ranks AS SELECT * FROM user_ranks_given")
        self.con.unregister("user_ranks_given")
        table = table.set_column(1, "original_id", ids)
        return table.drop_columns(["uc"]).take(order)

    def users_are_integers(self) -> bool:
        """Whether every user id (text) is an integer written canonically ("42", not "042" or "4.2e1")."""
        return bool(
            self._scalar(
                "SELECT coalesce(bool_and(coalesce(CAST(TRY_CAST(id AS BIGINT) AS VARCHAR) = id, false)), true) "
                "FROM user_codes"
            )
        )

    def finalize(
        self, user_offset: int, item_ids, last: tuple[float, float] | None = None, user_ids=None, key_seed=None
    ) -> None:
        """Give the pairs their dense ids: user ``offset + rank`` (:meth:`user_vocabulary`), or ``user_ids`` (a
        pyarrow table ``rank, user_id``: ids kept from a parent dataset) when given; item from ``item_ids`` (a
        pyarrow table ``ic, item_id`` from the driver); ``pairs`` becomes ``final``. With ``last`` =
        ``(valid, test)`` fractions, label the per-user split by time in the same pass (:meth:`_last_label`); with
        ``key_seed`` (the random split), add each pair's split key (:func:`with_split_key`)."""
        self.con.register("item_ids_given", item_ids)
        columns = ["t"] * self.has_time + ["v"] * self.has_value
        rest = "".join(f", pairs.{c}" for c in columns)
        user_id, user_join = f"(user_ranks.rank + {int(user_offset)})", ""
        if user_ids is not None:
            self.con.register("user_ids_given", user_ids)
            user_id, user_join = (
                "user_ids_given.user_id",
                " JOIN user_ids_given ON user_ranks.rank = user_ids_given.rank",
            )
        joined = (
            f"SELECT {user_id}::INTEGER AS user_id, "
            f"item_ids_given.item_id::INTEGER AS item_id, pairs.ic AS ic{rest} FROM pairs "
            f"JOIN user_ranks ON pairs.uc = user_ranks.uc{user_join} "
            "JOIN item_ids_given ON pairs.ic = item_ids_given.ic"
        )
        if last is None:
            keyed = joined if key_seed is None else with_split_key(joined, key_seed)
            self._run(f"CREATE OR REPLACE TABLE final AS {keyed}")
            self.label_sql = "0"
        else:
            self._run(
                f"CREATE OR REPLACE TABLE final AS SELECT * EXCLUDE (from_end, n), {self._last_label(*last)} AS label "
                "FROM (SELECT *, row_number() OVER (PARTITION BY user_id ORDER BY t DESC, ic DESC) - 1 AS from_end, "
                f"count(*) OVER (PARTITION BY user_id) AS n FROM ({joined}))"
            )
            self.label_sql = "label"
        self.con.unregister("item_ids_given")
        if user_ids is not None:
            self.con.unregister("user_ids_given")
        self._run("DROP TABLE pairs")

    @staticmethod
    def _last_label(valid: float, test: float) -> str:
        """The per-user split by time, from a row's place ``from_end`` (0: its user's latest) among its user's ``n``
        pairs: its latest ``round(test * n)`` pairs (at least 1) to test, the ``round(valid * n)`` before them to
        valid (at least 1), for users with ``n >= 3`` pairs; ties in time go by item code (the order of the original
        item ids). Halves round to even, as numpy's ``round`` did before (format 1)."""

        def held(fraction: float) -> str:
            if fraction == 0:
                return "0"
            return f"(CASE WHEN n >= 3 THEN greatest(1, round_even({fraction!r}::DOUBLE * n, 0)) ELSE 0 END)"

        return (
            f"(CASE WHEN from_end < {held(test)} THEN 2 WHEN from_end < {held(test)} + {held(valid)} THEN 1 "
            "ELSE 0 END)::UTINYINT"
        )

    # ----------------------------------------------------------------------------------------------- split
    def inherit_labels(self, parent_files: list[list[str]]) -> list[int]:
        """Give every pair of ``final`` that the parent dataset holds the parent's split label (``parent_files``:
        the parent's part files of train, valid and test; its dense ids are ours, ``--vocab-from``), as
        ``parent_label`` (NULL for a pair new here); the random split then labels only the new pairs. Returns the
        pairs kept from the parent per label."""
        parents = " UNION ALL ".join(
            f"SELECT user_id, item_id, {label}::UTINYINT AS parent_label FROM read_parquet({file_list(files)})"
            for label, files in enumerate(parent_files)
            if files
        )
        if not parents:
            return [0, 0, 0]
        self._run(
            "CREATE OR REPLACE TABLE final AS SELECT final.*, parent.parent_label FROM final "
            f"LEFT JOIN ({parents}) AS parent USING (user_id, item_id)"
        )
        self.from_parent = True
        counts = [0, 0, 0]
        for label, count in self._run(
            "SELECT parent_label, count(*) FROM final WHERE parent_label IS NOT NULL GROUP BY ALL"
        ):
            counts[int(label)] = int(count)
        return counts

    def _unlabelled(self) -> str:
        """The rows of final the random split labels: all, or the pairs new here (:meth:`inherit_labels`)."""
        return "(SELECT * FROM final WHERE parent_label IS NULL)" if self.from_parent else "final"

    def key_histogram(self) -> tuple[np.ndarray, np.ndarray]:
        """``(bins int32[k], rows int64[k])``: rows per bin of their random-split key (its top 16 bits, of
        ``2**16`` bins), for the bins with rows (sparse, as :meth:`kcore_counts`)."""
        table = self._arrow(
            f"SELECT (key >> {KEY_BINS_SHIFT})::INTEGER AS b, count(*) AS c FROM {self._unlabelled()} GROUP BY b"
        )
        return _column(table, "b", np.int32), _column(table, "c", np.int64)

    def keys_in_bin(self, bin_: int):
        """``(key, user_id, item_id)`` of the rows whose key falls in ``bin_``, sorted (a pyarrow table)."""
        return self._arrow(
            f"SELECT * FROM (SELECT key, user_id, item_id FROM {self._unlabelled()}) "
            f"WHERE key >> {KEY_BINS_SHIFT} = {int(bin_)} ORDER BY key, user_id, item_id"
        )

    def label_random(self, cuts: list[tuple[int, int, int] | None]) -> None:
        """Label each row by where its ``(key, user_id, item_id)`` falls among the cut points (train below the
        first, valid below the second, test above; None: past every row); a pair the parent dataset holds keeps
        its label there (:meth:`inherit_labels`). The label stays an expression, evaluated where the rows are
        counted and written."""
        row = "(key, user_id, item_id)"
        cases = []
        for label, cut in enumerate(cuts):
            if cut is None:
                cases.append(f"WHEN true THEN {label}")
            else:
                key, user, item = cut
                cases.append(f"WHEN {row} < ({int(key)}::UBIGINT, {int(user)}, {int(item)}) THEN {label}")
        self.label_sql = f"(CASE {' '.join(cases)} ELSE {len(cuts)} END)"
        if self.from_parent:
            self.label_sql = f"coalesce(parent_label, {self.label_sql})"

    def label_time(self, valid_from_ms: int, test_from_ms: int) -> None:
        """A global cut: time < ``valid_from_ms`` is train, < ``test_from_ms`` valid, the rest test."""
        self.label_sql = f"(CASE WHEN t < {int(valid_from_ms)} THEN 0 WHEN t < {int(test_from_ms)} THEN 1 ELSE 2 END)"

    def split_counts(self) -> list[int]:
        """Rows per label (train, valid, test)."""
        counts = [0, 0, 0]
        for label, count in self._run(f"SELECT {self.label_sql} AS label, count(*) FROM final GROUP BY ALL"):
            counts[int(label)] = int(count)
        return counts

    # ----------------------------------------------------------------------------------------------- write
    def write_split(self, root: str, split: str, label: int, prefix: str, value_name: str | None) -> list[str]:
        """Write split ``label``'s rows under ``root/split/`` as hidden parts ``prefix-NNNNN.parquet`` (the driver
        names them in order) in the layout's columns (``user_id, item_id``, ``rating``/``weight``, ``timestamp``
        in epoch seconds), sorted by ``(user_id, item_id)``; returns their paths relative to ``root``."""
        from bigrank.data import manifest as layout

        columns = ["user_id", "item_id"]
        if self.has_value:
            columns.append(f"v::FLOAT AS {value_name}")
        if self.has_time:
            columns.append("floor(t / 1000)::BIGINT AS timestamp")
        reader = self.con.sql(
            f"SELECT {', '.join(columns)} FROM final WHERE {self.label_sql} = {int(label)} ORDER BY user_id, item_id"
        ).to_arrow_reader(layout.ROW_GROUP_SIZE)
        return layout.write_split_batches(root, split, reader, lambda k: f"{split}/{prefix}-{k:05d}.parquet")
