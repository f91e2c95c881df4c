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
``block_ratings``, not by the dataset (ML-1B: 1B ratings, 2.2M users). That builder is
``bigrank.data.pair_blocks``, shared with the evaluation's per-user index (``bigrank.data.user_index``).
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
from bigrank.data import pair_blocks
from bigrank.data.pair_blocks import BLOCK_RATINGS
from bigrank.export.format import SEEN_TABLE, part_file, read_export_parquet, sha256_file

SPLIT_BITS = {"train": 1, "valid": 2, "test": 4}
SEEN_ROW_GROUP_USERS = 512
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
    pair_blocks.check_key_range(user_stop - user_start, num_items)
    files = [(path, SPLIT_BITS[s]) for s in dataset.splits for path in dataset.files(s)]
    plan = pair_blocks.plan_row_groups(files, user_start, user_stop)
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
            blocks = pair_blocks.blocks(plan, user_start, user_stop, num_items, block_ratings, group_users, spill)
            for lo, hi, read_keys in blocks:
                indptr, items, bits = pair_blocks.csr_block(read_keys, lo, hi, num_items)
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
