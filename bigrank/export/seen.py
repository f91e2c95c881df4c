"""Per-user seen items: the dataset reader (``SeenItems``) and the compact file an export carries (``SeenItemsFile``).

Serving excludes the items a user has already rated, and the history tower needs a user's train items to
build the user's vector. Reading the training dataset for that at query time ties the serving nodes to the
training data, so an export also writes the table ``seen`` (``seen/part-rNNNNN.parquet``), one row per
user, CSR-like (a Parquet list column is an offsets array plus a values array)::

    user_id: int32          every user in [row_start, row_stop) of the part, in order (no gaps)
    items:   list<int32>    the user's distinct items in any split, ascending
    splits:  list<int8>     per item, a bit mask of the splits holding the pair: 1 train, 2 valid, 4 test

so ``items_of(u, splits)`` is ``items[splits & mask(splits) != 0]``: exactly the distinct items of ``u``
in those splits of the dataset. Rows are written in row groups of ``SEEN_ROW_GROUP_USERS`` users; a reader
that does not load the whole file finds a user's row group from the part's row range alone.

Writing streams: a rank reads only the row groups that may hold its users, and when they hold more than
``block_ratings`` ratings it spills them once, an int64 key a rating, into bucket files of whole row groups
of users, then sorts and writes one bucket (or block of a bucket) at a time. Its memory is set by
``block_ratings``, not by the dataset (ML-1B: 1B ratings, 2.2M users).
"""

from __future__ import annotations

import shutil
import tempfile
import threading
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from bigrank import integrity
from bigrank.data import manifest as layout
from bigrank.export.format import SEEN_TABLE, part_file, read_export_parquet, sha256_file

SPLIT_BITS = {"train": 1, "valid": 2, "test": 4}
SEEN_ROW_GROUP_USERS = 512
# Ratings sorted at once by the seen-items writer: ~13 bytes each at the peak, 20 where pairs repeat
# (``_csr_block``), so 210-320 MB; ML-1B's rank of 1.1M users writes ~60 such blocks.
BLOCK_RATINGS = 16_000_000
SPILL_CHUNK_KEYS = 4_000_000  # keys read at once from a spill file when a bucket is cut into blocks
MAX_OPEN_SPILL_FILES = 128  # well below the 256 open files a macOS process gets by default
PRELOAD_MAX_RATINGS = 50_000_000
CACHED_ROW_GROUPS = 256


def split_mask(splits: Sequence[str]) -> int:
    """Bit mask of ``splits`` (``SPLIT_BITS``); ValueError for an unknown split or none."""
    unknown = [s for s in splits if s not in SPLIT_BITS]
    if unknown or not splits:
        raise ValueError(f"splits must be a non-empty subset of {tuple(SPLIT_BITS)}, got {list(splits)}")
    mask = 0
    for split in splits:
        mask |= SPLIT_BITS[split]
    return mask


class SeenItems:
    """The items each user has rated in a dataset (``bigrank.data`` layout), for excluding them.

    ``splits`` (default all three) are the interactions counted as seen. Datasets of at most
    ``PRELOAD_MAX_RATINGS`` ratings are loaded once into a CSR array (user -> sorted items); larger ones are
    scanned per user with a Parquet filter on ``user_id`` (row groups are skipped by their statistics).
    ``data_root``: the dataset's ``DatasetManifest``, or its directory.
    """

    def __init__(
        self, data_root: layout.DatasetManifest | str | Path, splits: Sequence[str] = ("train", "valid", "test")
    ):
        dataset = layout.as_manifest(data_root).validate(splits)
        self.root = dataset.root
        self.manifest = dataset.raw
        self.splits = tuple(splits)
        self.files = [path for s in self.splits for path in dataset.files(s)]
        self.num_users = dataset.num_users
        self.num_items = dataset.num_items
        rows = sum(dataset.rows(s) for s in self.splits)
        self._indptr = self._items = None
        if rows <= PRELOAD_MAX_RATINGS:
            self._preload()

    def _preload(self) -> None:
        users, items = [np.empty(0, np.int32)], [np.empty(0, np.int32)]
        for path in self.files:
            table = self._read(path, columns=["user_id", "item_id"])
            users.append(table.column("user_id").to_numpy())
            items.append(table.column("item_id").to_numpy())
        users, items = np.concatenate(users), np.concatenate(items)
        order = np.lexsort((items, users))
        self._items = items[order]
        self._indptr = np.concatenate([[0], np.cumsum(np.bincount(users, minlength=self.num_users))])

    def items_of(self, user_id: int) -> np.ndarray:
        """Sorted unique item ids (int32) that ``user_id`` rated in the chosen splits."""
        if not 0 <= int(user_id) < self.num_users:
            raise ValueError(f"user id {user_id} is outside [0, {self.num_users}) of the dataset {self.root}")
        if self._indptr is not None:
            return np.unique(self._items[self._indptr[user_id] : self._indptr[user_id + 1]])
        found = [np.empty(0, np.int32)]
        for path in self.files:
            table = self._read(path, columns=["item_id"], filters=[("user_id", "==", int(user_id))])
            found.append(table.column("item_id").to_numpy())
        return np.unique(np.concatenate(found))

    def _read(self, path: Path, **options):
        """``read_table`` of one dataset file with its pages verified; CorruptFileError naming a damaged one."""
        try:
            return integrity.read_parquet(path, **options)
        except Exception as error:  # pyarrow raises OSError / ArrowInvalid for a bad page
            raise integrity.damaged_parquet("dataset file", path, error, layout.repair_advice(self.root)) from error


def _check_key_range(num_users: int, num_items: int) -> None:
    """ValueError when the keys of ``num_users`` users x ``num_items`` items (``_rating_keys``) overflow int64."""
    if num_users * num_items * 8 >= 2**63:
        raise ValueError(f"{num_users} users x {num_items} items overflow the int64 keys of the seen-items writer")


def _rating_keys(users: np.ndarray, items: np.ndarray, bit: int, start: int, num_items: int) -> np.ndarray:
    """One int64 key per rating: ``((user - start) * num_items + item) * 8 + bit``; int64[n] from int32[n] x 2.

    Sorting the keys orders the ratings by (user, item) and puts the split bits of one pair next to each other
    (``bit < 8``, ``SPLIT_BITS``). The key is also the whole spill record: 8 bytes a rating, not 4 + 4 + 1.
    """
    keys = users.astype(np.int64)
    keys -= start  # in place: one int64 array, not one temporary per operation
    keys *= num_items
    keys += items
    keys <<= 3
    keys |= bit
    return keys


def _plan_row_groups(files: Sequence[tuple[Path, int]], start: int, stop: int) -> list[tuple[Path, int, list, int]]:
    """The row groups of the dataset ``files`` that may hold users in ``[start, stop)``.

    Returns ``[(path, bit, [(group, inside), …], rows)]``: ``inside`` is True when the group's ``user_id``
    statistics put all its rows in the range (no filter needed), ``rows`` sums the groups' rows, an upper bound
    on the ratings of the range. Groups whose statistics lie outside the range are skipped unread: on a dataset
    written per user block (``bigrank generate``), each rank then reads its own share of the ratings instead
    of all of them. A group without statistics is read and filtered.
    """
    import pyarrow.parquet as pq

    if stop <= start:
        return []  # a rank without users reads nothing
    plan = []
    for path, bit in files:
        metadata = pq.read_metadata(path)
        column = metadata.schema.names.index("user_id")
        groups, rows = [], 0
        for g in range(metadata.num_row_groups):
            group = metadata.row_group(g)
            stats = group.column(column).statistics
            known = stats is not None and stats.has_min_max
            if known and (stats.max < start or stats.min >= stop):
                continue
            groups.append((g, known and start <= stats.min and stats.max < stop))
            rows += group.num_rows
        if groups:
            plan.append((path, bit, groups, rows))
    return plan


def _scan_keys(plan, start: int, stop: int, num_items: int):
    """Yield the keys (``_rating_keys``) of the ratings of users ``[start, stop)``, one int64 array per row group
    (pages verified: a damaged one names its file and row group; an item id outside ``[0, num_items)``, which
    would make its key another user's, is a ValueError naming the file)."""
    for path, bit, groups, _ in plan:
        handle = integrity.open_parquet(path)
        root = Path(path).parents[1]  # the dataset: its parts are ROOT/<split>/part-*.parquet
        for group, inside in groups:
            # One thread: the ranks already use the cores, and Arrow's reader threads keep ~100 MB of pool
            # memory each rank (measured on ML-1B); a row group read alone is no slower on 2 busy cores.
            table = layout.read_row_group(handle, path, group, ("user_id", "item_id"), root, use_threads=False)
            users = table.column("user_id").to_numpy()
            items = table.column("item_id").to_numpy()
            if not inside:
                keep = (users >= start) & (users < stop)
                users, items = users[keep], items[keep]
            if len(items) and (int(items.min()) < 0 or int(items.max()) >= num_items):
                raise ValueError(f"{path} has item_id values outside [0, {num_items}) (manifest)")
            yield _rating_keys(users, items, bit, start, num_items)


def _read_all_keys(plan, start: int, stop: int, num_items: int, bound: int) -> np.ndarray:
    """All keys of users ``[start, stop)`` in one int64 array (at most ``bound`` long), filled in place."""
    keys = np.empty(bound, np.int64)  # preallocated: concatenating the chunks would hold every key twice
    filled = 0
    for chunk in _scan_keys(plan, start, stop, num_items):
        keys[filled : filled + len(chunk)] = chunk
        filled += len(chunk)
    return keys[:filled]


def _bucket_bounds(num_users: int, ratings: int, block_ratings: int, group_users: int) -> np.ndarray:
    """Rank-relative user offsets ``[0, …, num_users]`` of the spill buckets, int64[buckets + 1].

    A bucket is whole row groups (``group_users`` users each) expected to hold about ``block_ratings / 2`` of
    the ``ratings`` (spread evenly over the users), so that most buckets are sorted in one piece and a bucket
    twice as dense as the average still is; a denser one is cut further (``_bucket_blocks``).
    """
    per_user = max(ratings, 1) / max(num_users, 1)
    groups = max(1, int(block_ratings / 2 / per_user) // group_users)
    bounds = np.arange(0, num_users, groups * group_users, dtype=np.int64)
    return np.append(bounds, np.int64(num_users))


def _spill(chunks, bucket_keys: np.ndarray, spill: Path) -> np.ndarray:
    """Append each chunk's keys to the file ``spill/{b}.keys`` of their bucket ``b``; returns keys per bucket.

    ``bucket_keys``: int64[buckets + 1], bucket ``b`` holds the keys in ``[bucket_keys[b], bucket_keys[b + 1])``.
    Each chunk (a row group) is sorted first, so its keys of one bucket are one slice: cheaper than a stable
    argsort by bucket and a gather of every key. At most ``MAX_OPEN_SPILL_FILES`` files are open at once (ML-1B
    in one process: ~125 buckets); the one opened first is closed to open another, and reopened to append.
    """
    counts = np.zeros(len(bucket_keys) - 1, np.int64)
    handles = {}
    try:
        for keys in chunks:
            keys.sort()
            cuts = np.searchsorted(keys, bucket_keys)
            for b in np.flatnonzero(np.diff(cuts)):
                if b not in handles:
                    if len(handles) >= MAX_OPEN_SPILL_FILES:
                        handles.pop(next(iter(handles))).close()
                    handles[b] = open(spill / f"{b}.keys", "ab")  # noqa: SIM115 - closed below
                handles[b].write(memoryview(keys[cuts[b] : cuts[b + 1]]))
                counts[b] += cuts[b + 1] - cuts[b]
    finally:
        for handle in handles.values():
            handle.close()
    return counts


def _file_chunks(path: Path, chunk_keys: int = SPILL_CHUNK_KEYS):
    """Yield the int64 keys of a spill file in arrays of at most ``chunk_keys``."""
    with open(path, "rb") as handle:
        while True:
            chunk = np.fromfile(handle, np.int64, count=chunk_keys)
            if not len(chunk):
                return
            yield chunk


def _greedy_cuts(counts: np.ndarray, limit: int) -> list[int]:
    """Cut ``counts`` (ratings per row group) into runs of at most ``limit`` ratings (a group alone may exceed
    it); returns the run boundaries ``[0, …, len(counts)]``."""
    cuts, total = [0], 0
    for index, count in enumerate(counts.tolist()):
        if total and total + count > limit:
            cuts.append(index)
            total = 0
        total += count
    cuts.append(len(counts))
    return cuts


def _bucket_blocks(path: Path, count: int, lo: int, hi: int, num_items: int, block_ratings: int, group_users: int):
    """Yield ``(block_lo, block_hi, read)`` for the users ``[lo, hi)`` (rank-relative) of one spill bucket.

    ``read()`` returns the block's keys, unsorted. A bucket of at most ``block_ratings`` keys is one block, read
    whole; a denser one is cut into runs of whole row groups of at most ``block_ratings`` ratings (counted in a
    first pass over the file), each gathered by its own pass, so memory stays at ``block_ratings`` keys.
    """
    if count <= block_ratings:
        yield lo, hi, lambda: np.fromfile(path, np.int64) if path.is_file() else np.empty(0, np.int64)
        return
    group_key = group_users * num_items * 8  # the key span of one row group of users
    per_group = np.zeros(-(-(hi - lo) // group_users), np.int64)
    for chunk in _file_chunks(path):
        per_group += np.bincount((chunk - lo * num_items * 8) // group_key, minlength=len(per_group))
    cuts = _greedy_cuts(per_group, block_ratings)
    for first, last in zip(cuts[:-1], cuts[1:], strict=True):
        block_lo, block_hi = lo + first * group_users, min(lo + last * group_users, hi)
        size = int(per_group[first:last].sum())
        yield block_lo, block_hi, lambda a=block_lo, b=block_hi, n=size: _gather_keys(path, a, b, n, num_items)


def _gather_keys(path: Path, lo: int, hi: int, size: int, num_items: int) -> np.ndarray:
    """The ``size`` keys of users ``[lo, hi)`` (rank-relative) in the spill file ``path``, int64[size]."""
    key_lo, key_hi = lo * num_items * 8, hi * num_items * 8
    keys = np.empty(size, np.int64)
    filled = 0
    for chunk in _file_chunks(path):
        inside = chunk[(chunk >= key_lo) & (chunk < key_hi)]
        keys[filled : filled + len(inside)] = inside
        filled += len(inside)
    return keys


def _blocks(plan, start: int, stop: int, num_items: int, block_ratings: int, group_users: int, spill: Path | None):
    """Yield ``(block_lo, block_hi, read)``: rank-relative user blocks of whole row groups, in order, covering
    ``[0, stop - start)``, and a function reading the block's keys (``_rating_keys``, unsorted).

    Without ``spill`` (the ratings' upper bound fits ``block_ratings``), one block read from the dataset;
    with it, one pass over the dataset spills the keys into buckets of users, then each bucket gives its blocks.
    """
    users = stop - start
    bound = sum(rows for *_, rows in plan)
    if spill is None:
        yield 0, users, lambda: _read_all_keys(plan, start, stop, num_items, bound)
        return
    bounds = _bucket_bounds(users, bound, block_ratings, group_users)
    counts = _spill(_scan_keys(plan, start, stop, num_items), bounds * num_items * 8, spill)
    for b, count in enumerate(counts.tolist()):
        path = spill / f"{b}.keys"
        yield from _bucket_blocks(
            path, count, int(bounds[b]), int(bounds[b + 1]), num_items, block_ratings, group_users
        )
        path.unlink(missing_ok=True)  # the bucket is written: free its disk (or page cache) now


def _csr_block(read_keys, lo: int, hi: int, num_items: int):
    """Distinct (user, item) pairs of the rank-relative users ``[lo, hi)`` with OR-ed split bits, as CSR arrays.

    ``read_keys()`` gives the block's keys (``_rating_keys``, any order). Returns ``(indptr int64[hi - lo + 1],
    items int32[nnz], bits int8[nnz])``, items ascending per user. The keys are sorted in place (one unstable,
    vectorised sort) and reduced in place: about 13 bytes a key are live at the peak (keys 8, split bits 1,
    items 4), 20 when the block repeats a pair (the distinct pairs are then a copy).
    """
    keys = read_keys()  # the only reference: deleting it below frees the largest array before the items exist
    keys.sort()
    bits = keys.astype(np.int8)  # the low byte; its 3 low bits are the split bits
    bits &= 7
    keys >>= 3
    keys -= lo * num_items  # the pair ids (user - lo) * num_items + item of the block
    first = np.empty(len(keys), bool)  # the first rating of each distinct pair
    first[:1] = True
    np.not_equal(keys[1:], keys[:-1], out=first[1:])
    if first.all():
        unique, merged = keys, bits  # no repeated pair: nothing to merge (the usual case)
    else:
        repeats = np.flatnonzero(~first)
        merged = bits[first]
        # The k-th repeat (0-based) at position p belongs to distinct pair p - k - 1.
        np.bitwise_or.at(merged, repeats - np.arange(1, len(repeats) + 1), bits[repeats])
        unique = keys[first]
    del keys, bits, first
    # The users are sorted, so user r's pairs start at the first pair id >= r * num_items.
    indptr = np.searchsorted(unique, np.arange(hi - lo + 1, dtype=np.int64) * num_items).astype(np.int64)
    np.remainder(unique, num_items, out=unique)
    return indptr, unique.astype(np.int32), merged


def _write_block(writer, start: int, indptr: np.ndarray, items: np.ndarray, bits: np.ndarray, group_users: int):
    """Append users ``start …`` of one CSR block to ``writer`` in row groups of ``group_users`` users.

    One table per block; the writer cuts it into row groups (a row is a user), which is several times
    cheaper than building and writing a table per row group.
    """
    import pyarrow as pa

    num_users = len(indptr) - 1
    if num_users == 0:
        return
    if indptr[-1] - indptr[0] >= 2**31:
        size = int(indptr[-1] - indptr[0])
        raise ValueError(f"a seen-items block of {size} items overflows int32 list offsets; lower block_ratings")
    offsets = pa.array((indptr - indptr[0]).astype(np.int32))
    span = slice(int(indptr[0]), int(indptr[-1]))
    table = pa.Table.from_arrays(
        [
            pa.array(np.arange(start, start + num_users, dtype=np.int32)),
            pa.ListArray.from_arrays(offsets, pa.array(items[span], type=pa.int32())),
            pa.ListArray.from_arrays(offsets, pa.array(bits[span], type=pa.int8())),
        ],
        names=["user_id", "items", "splits"],
    )
    writer.write_table(table, row_group_size=group_users)


def write_seen_part(
    out_dir: str | Path,
    rank: int,
    dataset_root: layout.DatasetManifest | str | Path,
    user_start: int,
    user_stop: int,
    block_ratings: int = BLOCK_RATINGS,
    group_users: int = SEEN_ROW_GROUP_USERS,
) -> dict:
    """Write ``seen/part-r{rank}.parquet`` for users ``[user_start, user_stop)`` of the dataset ``dataset_root`` (its
    ``DatasetManifest``, or its directory).

    Every split the dataset has is read, only the row groups whose ``user_id`` statistics overlap the range.
    When those hold more than ``block_ratings`` ratings, one pass spills them (one int64 key each) to bucket
    files of whole row groups of users, then each bucket is sorted and written on its own, cut further when it
    holds more than ``block_ratings``: the memory for the ratings stays at most about ``20 * block_ratings``
    bytes whatever the dataset's size (``_csr_block``; unless one row group of users alone holds more), and
    the spill takes 8 bytes a rating on disk beside the part, each bucket deleted once written.

    Blocks start on row-group boundaries (``group_users`` users per row group), so a reader finds user ``u``
    in row group ``(u - row_start) // group_users`` of the part; the file does not depend on
    ``block_ratings``. Returns the part's manifest entry
    ``{file, row_start, row_stop, rows, nnz, row_group_users, bytes, sha256}``.
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    dataset = layout.as_manifest(dataset_root).validate()
    num_items = dataset.num_items
    _check_key_range(user_stop - user_start, num_items)
    files = [(path, SPLIT_BITS[s]) for s in dataset.splits for path in dataset.files(s)]
    plan = _plan_row_groups(files, user_start, user_stop)
    bound = sum(rows for *_, rows in plan)

    relative = part_file(SEEN_TABLE, rank)
    path = Path(out_dir) / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = layout.temporary_path(path)
    schema = pa.schema([("user_id", pa.int32()), ("items", pa.list_(pa.int32())), ("splits", pa.list_(pa.int8()))])
    spill = Path(tempfile.mkdtemp(prefix=".seen-spill-", dir=path.parent)) if bound > block_ratings else None
    nnz = 0
    try:
        # Items ascend within a user: delta encoding + zstd stores them in ~2 bytes each instead of ~3.6.
        encoding = {"user_id": "DELTA_BINARY_PACKED", "items.list.element": "DELTA_BINARY_PACKED"}
        with pq.ParquetWriter(
            tmp,
            schema,
            compression="zstd",
            use_dictionary=["splits.list.element"],
            column_encoding=encoding,
            **integrity.PARQUET_WRITE_OPTIONS,
        ) as writer:
            blocks = _blocks(plan, user_start, user_stop, num_items, block_ratings, group_users, spill)
            for lo, hi, read_keys in blocks:
                indptr, items, bits = _csr_block(read_keys, lo, hi, num_items)
                _write_block(writer, user_start + lo, indptr, items, bits, group_users)
                nnz += len(items)
                del indptr, items, bits  # before the next block is read
        entry = {"bytes": int(tmp.stat().st_size), "sha256": sha256_file(tmp)}
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)
        if spill is not None:
            shutil.rmtree(spill, ignore_errors=True)
    rows = user_stop - user_start
    return {
        "file": relative,
        "row_start": user_start,
        "row_stop": user_stop,
        "rows": rows,
        "nnz": nnz,
        "row_group_users": group_users,
        **entry,
    }


class SeenItemsFile:
    """Reader of an export's ``seen`` table: ``items_of(user)`` without the training dataset.

    Args:
        export_dir, manifest: the export (``bigrank.export.format.load_export``); it must have the table.
        splits: the splits counted by ``items_of`` (default all three).
        preload_max_ratings: files of at most this many stored items are loaded at once into CSR arrays;
            larger ones are read one row group (``row_group_users`` users of the part) at a time, the last
            ``CACHED_ROW_GROUPS`` kept in memory.

    ``train_items_of(user)`` gives the user's train items (the history-tower bag).
    """

    def __init__(
        self,
        export_dir: str | Path,
        manifest: dict,
        splits: Sequence[str] = ("train", "valid", "test"),
        preload_max_ratings: int = PRELOAD_MAX_RATINGS,
    ):
        if SEEN_TABLE not in manifest["tables"]:
            raise ValueError(
                f"the export {export_dir} has no seen-items table (exported without a dataset): pass the "
                "dataset with --exclude-seen DATA_ROOT instead"
            )
        self.root = Path(export_dir)
        self.splits = tuple(splits)
        self.mask = split_mask(self.splits)
        entry = manifest["tables"][SEEN_TABLE]
        self.parts = sorted(entry["parts"], key=lambda p: p["row_start"])
        self.num_users = int(entry["rows"])
        self.num_items = int(manifest["num_items"])
        self._starts = np.asarray([p["row_start"] for p in self.parts], dtype=np.int64)
        self._cache: OrderedDict = OrderedDict()
        self._files: dict[int, object] = {}  # open ParquetFile per part: the footer is parsed once
        self._lock = threading.Lock()
        self._whole = None
        if int(entry.get("nnz", 0)) <= preload_max_ratings:
            self._whole = self._read_rows(None)

    def _read_rows(self, key):
        """CSR arrays ``(first_user, indptr, items, bits)`` of one row group ``key = (part, group)`` or all."""
        import pyarrow as pa

        if key is None:
            tables = [read_export_parquet(self.root, p["file"]) for p in self.parts if p["rows"]]
            table = pa.concat_tables(tables) if tables else None
            first = 0
        else:
            part, group = key
            if part not in self._files:
                self._files[part] = integrity.open_parquet(self.root / self.parts[part]["file"])
            table = read_export_parquet(self.root, self.parts[part]["file"], self._files[part], group)
            first = int(self.parts[part]["row_start"]) + group * int(self.parts[part]["row_group_users"])
        if table is None or table.num_rows == 0:
            return first, np.zeros(1, np.int64), np.empty(0, np.int32), np.empty(0, np.int8)
        items = table.column("items").combine_chunks()
        bits = table.column("splits").combine_chunks()
        indptr = items.offsets.to_numpy().astype(np.int64) - int(items.offsets[0].as_py())
        return first, indptr, items.flatten().to_numpy(), bits.flatten().to_numpy()

    def _row_group_of(self, user: int):
        part = int(np.searchsorted(self._starts, user, side="right") - 1)
        while self.parts[part]["rows"] == 0 or user >= self.parts[part]["row_stop"]:
            part += 1  # skip the empty parts that share a start
        key = (part, (user - int(self.parts[part]["row_start"])) // int(self.parts[part]["row_group_users"]))
        with self._lock:  # the threaded stdlib server calls this from many threads
            if key in self._cache:
                self._cache.move_to_end(key)
            else:
                self._cache[key] = self._read_rows(key)
                if len(self._cache) > CACHED_ROW_GROUPS:
                    self._cache.popitem(last=False)
            return self._cache[key]

    def _row(self, user_id: int) -> tuple[np.ndarray, np.ndarray]:
        user = int(user_id)
        if not 0 <= user < self.num_users:
            raise ValueError(f"user id {user_id} is outside [0, {self.num_users}) of the export's seen items")
        first, indptr, items, bits = self._whole if self._whole is not None else self._row_group_of(user)
        span = slice(int(indptr[user - first]), int(indptr[user - first + 1]))
        return items[span], bits[span]

    def items_of(self, user_id: int) -> np.ndarray:
        """Sorted distinct item ids (int32) that ``user_id`` rated in the chosen splits."""
        items, bits = self._row(user_id)
        return items[(bits & self.mask) != 0]

    def train_items_of(self, user_id: int) -> np.ndarray:
        """Sorted distinct item ids (int32) of ``user_id`` in the train split (the history-tower bag)."""
        items, bits = self._row(user_id)
        return items[(bits & SPLIT_BITS["train"]) != 0]
