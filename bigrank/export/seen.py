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

Writing is bounded in memory: the rank's ratings are bucketed by user block into spill files when they
exceed ``block_ratings``, then each block is sorted on its own.
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
BLOCK_RATINGS = 50_000_000
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
    """

    def __init__(self, data_root: str | Path, splits: Sequence[str] = ("train", "valid", "test")):
        self.root = Path(data_root)
        self.manifest = layout.validate_dataset(self.root, splits)
        self.splits = tuple(splits)
        self.files = [self.root / f for s in self.splits for f in layout.split_info(self.manifest, s)["files"]]
        self.num_users = int(self.manifest["num_users"])
        self.num_items = int(self.manifest["num_items"])
        rows = sum(layout.split_info(self.manifest, s)["rows"] for s in self.splits)
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


def _csr_block(users: np.ndarray, items: np.ndarray, bits: np.ndarray, start: int, stop: int, num_items: int):
    """Distinct (user, item) pairs of users ``[start, stop)`` with OR-ed split bits, as CSR arrays.

    Returns ``(indptr int64[stop - start + 1], items int32[nnz], bits int8[nnz])``, items ascending per user.
    Each rating becomes one int64 ``((user - start) * num_items + item) * 8 + bits``, so a single
    (unstable, vectorised) sort orders the pairs and places a pair's split bits next to each other: about
    3x faster than a stable argsort of the pair keys followed by gathers (``bits < 8``, ``SPLIT_BITS``).
    """
    pair = (users.astype(np.int64) - start) * num_items + items
    keys = np.sort(pair * 8 + bits)
    pair = keys >> 3
    starts = np.flatnonzero(np.concatenate([[True], pair[1:] != pair[:-1]])) if len(keys) else np.empty(0, np.int64)
    merged = np.bitwise_or.reduceat((keys & 7).astype(np.int8), starts) if len(starts) else np.empty(0, np.int8)
    unique = pair[starts]
    # The rows are sorted, so a row's pairs start at the first key >= row * num_items.
    indptr = np.searchsorted(unique, np.arange(stop - start + 1, dtype=np.int64) * num_items).astype(np.int64)
    row_base = np.repeat(np.arange(stop - start, dtype=np.int64) * num_items, np.diff(indptr))
    return indptr, (unique - row_base).astype(np.int32), merged


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


def _scan_ratings(root: Path, files: Sequence[tuple[Path, int]], start: int, stop: int):
    """Yield ``(users, items, bits)`` of users in ``[start, stop)`` per row group of the dataset ``files``
    (parts of the dataset at ``root``; pages verified)."""
    for path, bit in files:
        handle = integrity.open_parquet(path)
        for group in range(handle.metadata.num_row_groups):
            table = layout.read_row_group(handle, path, group, ("user_id", "item_id"), root)
            users = table.column("user_id").to_numpy()
            keep = (users >= start) & (users < stop)
            if keep.any():
                items = table.column("item_id").to_numpy()[keep]
                yield users[keep], items, np.full(int(keep.sum()), bit, dtype=np.int8)


def write_seen_part(
    out_dir: str | Path,
    rank: int,
    dataset_root: str | Path,
    user_start: int,
    user_stop: int,
    block_ratings: int = BLOCK_RATINGS,
    group_users: int = SEEN_ROW_GROUP_USERS,
) -> dict:
    """Write ``seen/part-r{rank}.parquet`` for users ``[user_start, user_stop)`` of the dataset at ``dataset_root``.

    Every split the dataset has is read. Users are processed in blocks of about ``block_ratings`` ratings
    (the rank's ratings are spilled to per-block files first when they exceed it), so memory stays bounded
    on ML-1B-sized data. Blocks start on row-group boundaries (``group_users`` users per row group), so a
    reader finds user ``u`` in row group ``(u - row_start) // group_users`` of the part. Returns the part's
    manifest entry ``{file, row_start, row_stop, rows, nnz, row_group_users, bytes, sha256}``.
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    root = Path(dataset_root)
    manifest = layout.validate_dataset(root)
    num_items = int(manifest["num_items"])
    files = [(root / f, SPLIT_BITS[s]) for s in manifest["splits"] for f in layout.split_info(manifest, s)["files"]]
    total = sum(layout.split_info(manifest, s)["rows"] for s in manifest["splits"])
    share = (user_stop - user_start) / max(1, int(manifest["num_users"]))
    blocks = max(1, int(np.ceil(total * share / max(1, block_ratings))))
    groups = -(-(user_stop - user_start) // group_users)
    bounds = user_start + np.minimum(
        np.linspace(0, groups, min(blocks, max(1, groups)) + 1).round().astype(np.int64) * group_users,
        user_stop - user_start,
    )
    blocks = len(bounds) - 1

    relative = part_file(SEEN_TABLE, rank)
    path = Path(out_dir) / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = layout.temporary_path(path)
    schema = pa.schema([("user_id", pa.int32()), ("items", pa.list_(pa.int32())), ("splits", pa.list_(pa.int8()))])
    spill = Path(tempfile.mkdtemp(prefix=".seen-spill-", dir=path.parent)) if blocks > 1 else None
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
            if spill is not None:
                _spill(root, files, bounds, spill)
            for b in range(blocks):
                lo, hi = int(bounds[b]), int(bounds[b + 1])
                ratings = _read_spill(spill, b) if spill is not None else _concat(_scan_ratings(root, files, lo, hi))
                indptr, items, bits = _csr_block(*ratings, lo, hi, num_items)
                _write_block(writer, lo, indptr, items, bits, group_users)
                nnz += len(items)
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


def _concat(chunks) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    chunks = list(chunks)
    empty = (np.empty(0, np.int32), np.empty(0, np.int32), np.empty(0, np.int8))
    return tuple(np.concatenate([empty[j], *(c[j] for c in chunks)]) for j in range(3))


def _spill(root: Path, files, bounds: np.ndarray, spill: Path) -> None:
    """Append each rating of users ``[bounds[0], bounds[-1])`` to the raw files of its user block."""
    handles = {}
    try:
        for users, items, bits in _scan_ratings(root, files, int(bounds[0]), int(bounds[-1])):
            block = np.searchsorted(bounds, users, side="right") - 1
            order = np.argsort(block, kind="stable")  # one pass groups the row group's ratings by block
            counts = np.bincount(block, minlength=len(bounds) - 1)
            ends = np.cumsum(counts)
            for b in np.flatnonzero(counts):
                rows = order[ends[b] - counts[b] : ends[b]]
                for name, values in (("users", users), ("items", items), ("bits", bits)):
                    key = (int(b), name)
                    if key not in handles:
                        handles[key] = open(spill / f"{b}.{name}", "ab")  # noqa: SIM115 - closed below
                    values[rows].tofile(handles[key])
    finally:
        for handle in handles.values():
            handle.close()


def _read_spill(spill: Path, block: int):
    def read(name, dtype):
        path = spill / f"{block}.{name}"
        return np.fromfile(path, dtype=dtype) if path.is_file() else np.empty(0, dtype)

    return read("users", np.int32), read("items", np.int32), read("bits", np.int8)


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
