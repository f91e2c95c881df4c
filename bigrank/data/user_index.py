"""A per-user index of one split's pairs, cached beside the dataset: a user's items without decoding the split.

Evaluating a sample of users needs their held-out items and their train items (to exclude). The split files are
in generator block order, so every row group holds some users of any sample and reading them means decoding the
whole split: ~7.6 s of Parquet decode for ~900M rows at ML-1B, for 10K users. The index stores the split once
as CSR arrays in a plain file, so reading the users' items is a read of their slices, not a decode of the split::

    <root>/user_index/<split>-<key>.csr
        header  4096 bytes: b"BRUIDX01", uint64 length, a JSON object (split, key_sha256, num_users, nnz,
                indptr_crc32)
        indptr  int64[num_users + 1]     user u's items are items[indptr[u]:indptr[u + 1]]
        items   int32[nnz]               sorted and distinct per user

``<key>`` is a hash of what the index was built from (:func:`index_key`): the split's name, the dataset's
``num_users`` / ``num_items``, and per file its name, size, modification time and the CRC-32 the manifest
records. A dataset whose files or manifest changed therefore names another file: a stale index is never read, it
is deleted when the new one is built. The file is written to a temporary name and renamed into place, under a
lock (``.<split>.lock``): of two processes building at once one builds, the other waits and opens its file.

Reading checks the header, the file's exact size, the CRC-32 of ``indptr`` and that it is monotone (~30 ms at
ML-1B), and the item ids of the slices read lie in ``[0, num_items)``; a file that fails is a CorruptFileError
naming it (:func:`ensure_index` deletes and rebuilds it). A flipped byte inside ``items`` that keeps the id in
range is not caught: checking 3.2 GB of items would cost what the index saves (``bigrank verify`` checks the
dataset itself, not this cache).

Building streams the split through the builder of the export's seen-items table (``bigrank.data.pair_blocks``:
row groups -> int64 keys, spilled to bucket files of users when they exceed a block, each block sorted alone), so
its memory is bounded by the block (~320 MB), not by the dataset; it needs 8 bytes a rating of temporary disk
beside the index.

Measured 2026-11-26 at ML-1B (2 shared cores, load 1-3): building test (100M ratings) 16.6 s, train (800M) 162 s,
valid 16.5 s, peak RSS 459 MB; on disk 3.22 GB for train and 0.42 GB for each other split (6.4 GB of spill files
while train is built). Reading what evaluating 10K sampled users of test needs (their test items, their train
items, the users with a test item): 12.0-18.4 s from the files (one process), 0.41 s from the index with its
pages cached, 1.40 s with them evicted first (same arrays).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import struct
import tempfile
import time
import zlib
from collections.abc import Callable
from pathlib import Path

import numpy as np

from bigrank import integrity
from bigrank.atomic import temporary_path
from bigrank.data import manifest as layout
from bigrank.data import pair_blocks
from bigrank.errors import CorruptFileError

__all__ = [
    "INDEX_DIR",
    "UserItemsIndex",
    "build_index",
    "ensure_index",
    "index_key",
    "index_path",
    "open_index",
    "write_manifest_with_indexes",
]

INDEX_DIR = "user_index"
FORMAT = 1
MAGIC = b"BRUIDX01"
HEADER_BYTES = 4096
READ_GAP_ITEMS = 4096  # slices closer than 16 KB are read as one range (one system call instead of two)
READ_RUN_ITEMS = 1 << 24  # at most 64 MB read at once
BLOCK_USERS = 512  # the builder's blocks start at multiples of this many users (the seen table's row groups)
Progress = Callable[[str], None] | None


def index_key(dataset: layout.DatasetManifest, split: str) -> dict:
    """What the index of ``split`` is built from: a change to any of it (a file rewritten, the manifest
    regenerated) gives another key, so another file name (``stat`` of the split's files; no byte is read)."""
    recorded = (dataset.raw.get("integrity") or {}).get("files", {})
    files = []
    for name, path in zip(dataset.split(split)["files"], dataset.files(split), strict=True):
        stat = path.stat()
        files.append([name, stat.st_size, stat.st_mtime_ns, recorded.get(name, {}).get("crc32")])
    return {
        "format": FORMAT,
        "split": split,
        "num_users": dataset.num_users,
        "num_items": dataset.num_items,
        "rows": dataset.rows(split),
        "files": files,
    }


def _digest(key: dict) -> str:
    """The full SHA-256 of ``key`` (the header holds it; the file name its first 16 digits)."""
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()


def index_path(dataset: layout.DatasetManifest, split: str, key: dict | None = None) -> Path:
    """Where the index of ``split`` of ``dataset`` as its files are now lives (whether or not it exists)."""
    key = index_key(dataset, split) if key is None else key
    return dataset.root / INDEX_DIR / f"{split}-{_digest(key)[:16]}.csr"


class UserItemsIndex:
    """A split's CSR index: ``indptr`` int64[num_users + 1] in memory (read whole: 18 MB at ML-1B), the items
    int32[nnz] read from the file where asked for (``items_of``: only the users' slices, not the file)."""

    def __init__(self, path: Path, num_users: int, num_items: int, nnz: int, indptr: np.ndarray):
        self.path, self.num_users, self.num_items, self.nnz, self.indptr = path, num_users, num_items, nnz, indptr

    def users_with_items(self) -> np.ndarray:
        """Sorted int64 ids of the users with at least one item."""
        return np.flatnonzero(np.diff(self.indptr)).astype(np.int64)

    def items_of(self, users: np.ndarray, item_range: tuple[int, int] | None = None) -> tuple[np.ndarray, np.ndarray]:
        """CSR ``(indptr int64[len(users) + 1], items int64)`` of ``users`` (ascending; row i = ``users[i]``),
        restricted to ``item_range = (start, stop)`` when given; items sorted and distinct per row.
        CorruptFileError when an item read lies outside ``[0, num_items)``."""
        users = np.asarray(users, dtype=np.int64)
        if len(users) and (np.any(users[1:] <= users[:-1]) or users[0] < 0 or users[-1] >= self.num_users):
            raise ValueError(f"users must be distinct ids in [0, {self.num_users}), ascending")
        starts = self.indptr[users]
        counts = self.indptr[users + 1] - starts
        offsets = np.zeros(len(users) + 1, dtype=np.int64)
        np.cumsum(counts, out=offsets[1:])
        items = self._read(starts, counts, offsets).astype(np.int64)
        if len(items) and (int(items.min()) < 0 or int(items.max()) >= self.num_items):
            raise CorruptFileError(f"{_corrupt(self.path)}: item ids outside [0, {self.num_items})", self.path)
        if item_range is None:
            return offsets, items
        keep = (items >= item_range[0]) & (items < item_range[1])
        rows = np.repeat(np.arange(len(users), dtype=np.int64), counts)
        indptr = np.zeros(len(users) + 1, dtype=np.int64)
        np.cumsum(np.bincount(rows[keep], minlength=len(users)), out=indptr[1:])
        return indptr, items[keep]

    def _read(self, starts: np.ndarray, counts: np.ndarray, offsets: np.ndarray) -> np.ndarray:
        """The items ``[starts[i], starts[i] + counts[i])`` of every row i, concatenated (int32[offsets[-1]]).

        Rows whose slices lie close together (``READ_GAP_ITEMS``) are read as one range of at most
        ``READ_RUN_ITEMS`` (``os.preadv``): 10K sampled users of ML-1B are ~10K small reads, all users a few
        hundred large ones. Plain reads, not a memory map: a map's fault-around made the process's resident size
        grow by hundreds of MB to GBs of cached pages for 10K users (measured at ML-1B)."""
        out = np.empty(int(offsets[-1]), dtype=np.int32)
        rows = np.flatnonzero(counts)
        base = HEADER_BYTES + 8 * (self.num_users + 1)
        with open(self.path, "rb", buffering=0) as handle:
            first = 0
            while first < len(rows):
                low = int(starts[rows[first]])
                last, high = first + 1, low + int(counts[rows[first]])
                while last < len(rows):  # extend the range while the next slice is near and the range small
                    start = int(starts[rows[last]])
                    if start - high > READ_GAP_ITEMS or start + int(counts[rows[last]]) - low > READ_RUN_ITEMS:
                        break
                    high = start + int(counts[rows[last]])
                    last += 1
                buffer = np.empty(high - low, dtype=np.int32)
                if os.preadv(handle.fileno(), [buffer], base + 4 * low) != buffer.nbytes:
                    raise CorruptFileError(f"{_corrupt(self.path)}: shorter than its offsets say", self.path)
                run = rows[first:last]
                # Item p of the output (row r) is item starts[r] - low + (p - offsets[r]) of the buffer.
                positions = np.arange(offsets[run[0]], offsets[run[-1] + 1], dtype=np.int64)
                positions += np.repeat(starts[run] - low - offsets[run], counts[run])
                out[offsets[run[0]] : offsets[run[-1] + 1]] = buffer[positions]
                first = last
        return out


def _corrupt(path: Path) -> str:
    return f"the user index {path} is damaged (delete it; `bigrank evaluate` builds it again)"


def open_index(dataset: layout.DatasetManifest, split: str, key: dict | None = None) -> UserItemsIndex | None:
    """The index of ``split`` when one matching the dataset's files exists, else None (never built, or built from
    files that have changed since). CorruptFileError when the file exists but is damaged (truncated, overwritten)."""
    key = index_key(dataset, split) if key is None else key
    path = index_path(dataset, split, key)
    try:
        handle = open(path, "rb")  # noqa: SIM115 - closed below
    except FileNotFoundError:
        return None
    with handle:
        head = handle.read(HEADER_BYTES)
        try:
            if len(head) < HEADER_BYTES or head[:8] != MAGIC:
                raise ValueError("no index header")
            (length,) = struct.unpack("<Q", head[8:16])
            header = json.loads(head[16 : 16 + length])
            num_users, nnz = int(header["num_users"]), int(header["nnz"])
        except (ValueError, KeyError, TypeError, struct.error) as error:
            raise CorruptFileError(f"{_corrupt(path)}: unreadable header ({error})", path) from error
        if header.get("key_sha256") != _digest(key) or header.get("split") != split:
            raise CorruptFileError(f"{_corrupt(path)}: its header describes other files than its name", path)
        expected = HEADER_BYTES + 8 * (num_users + 1) + 4 * nnz
        size = os.fstat(handle.fileno()).st_size
        if size != expected:
            raise CorruptFileError(f"{_corrupt(path)}: {size} bytes, {expected} expected (truncated?)", path)
        handle.seek(HEADER_BYTES)
        indptr = np.fromfile(handle, dtype=np.int64, count=num_users + 1)
    index = UserItemsIndex(path, num_users, dataset.num_items, nnz, indptr)
    if zlib.crc32(indptr.data) != header.get("indptr_crc32") or indptr[0] != 0 or indptr[-1] != nnz:
        raise CorruptFileError(f"{_corrupt(path)}: its user offsets do not match their checksum", path)
    if num_users and np.any(indptr[1:] < indptr[:-1]):
        raise CorruptFileError(f"{_corrupt(path)}: its user offsets decrease", path)
    return index


def build_index(
    dataset: layout.DatasetManifest, split: str, progress: Progress = None, block_ratings: int | None = None
) -> Path:
    """Write the index of ``split`` (atomically: a temporary file renamed into place) and return its path.

    Reads every row group of the split once (pages verified, ids checked against the manifest) through the
    seen-items table's streaming CSR builder (``bigrank.data.pair_blocks``; ``block_ratings`` keys sorted at once,
    default its ``BLOCK_RATINGS``). ``progress``: called with a line now and then (e.g. ``print``). Not locked: call
    :func:`ensure_index` to build only when needed and once among concurrent processes. Its cost at ML-1B: see
    the module's notes (train: 162 s, 3.2 GB)."""
    block_ratings = pair_blocks.BLOCK_RATINGS if block_ratings is None else int(block_ratings)
    dataset.validate([split])
    key = index_key(dataset, split)
    path = index_path(dataset, split, key)
    path.parent.mkdir(parents=True, exist_ok=True)
    num_users, num_items = dataset.num_users, dataset.num_items
    pair_blocks.check_key_range(num_users, num_items)
    plan = pair_blocks.plan_row_groups([(p, 1) for p in dataset.files(split)], 0, num_users)
    for file, _, groups, _ in plan:
        # The builder drops the users of a row group outside [0, num_users) (its range filter): check the groups
        # whose statistics do not put them all inside (none in a bigrank dataset with ids in range).
        unknown = [group for group, inside in groups if not inside]
        handle = integrity.open_parquet(file) if unknown else None
        for group in unknown:
            users = layout.read_row_group(handle, file, group, ("user_id",), dataset.root).column(0).to_numpy()
            if len(users) and (int(users.min()) < 0 or int(users.max()) >= num_users):
                raise ValueError(
                    f"split {split!r} of {dataset.root} has user_id values outside [0, {num_users}) (manifest)"
                )
    bound = sum(rows for *_, rows in plan)
    started = time.monotonic()
    if progress:
        progress(f"building the user index of split {split!r} of {dataset.root} ({bound:,} ratings) in {path.parent}")
    tmp = temporary_path(path)
    spill = Path(tempfile.mkdtemp(prefix=f".spill-{split}-", dir=path.parent)) if bound > block_ratings else None
    indptr = np.zeros(num_users + 1, dtype=np.int64)
    try:
        with open(tmp, "wb") as out:
            out.seek(HEADER_BYTES + 8 * (num_users + 1))  # the items first; header and offsets once known
            nnz, reported = 0, started
            blocks = pair_blocks.blocks(plan, 0, num_users, num_items, block_ratings, BLOCK_USERS, spill)
            for lo, hi, read_keys in blocks:
                block_indptr, items, _ = pair_blocks.csr_block(read_keys, lo, hi, num_items)
                indptr[lo + 1 : hi + 1] = block_indptr[1:] + nnz
                out.write(memoryview(items))
                nnz += len(items)
                del block_indptr, items
                if progress and time.monotonic() - reported > 10:
                    reported = time.monotonic()
                    progress(f"  users {hi:,} of {num_users:,}, {reported - started:.0f} s")
            header = {"split": split, "key_sha256": _digest(key), "num_users": num_users, "nnz": nnz}
            header["indptr_crc32"] = zlib.crc32(indptr.data)
            text = json.dumps(header).encode()
            if 16 + len(text) > HEADER_BYTES:
                raise ValueError(f"the index header of split {split!r} needs {len(text)} bytes; it has {HEADER_BYTES}")
            out.seek(0)
            out.write(MAGIC + struct.pack("<Q", len(text)) + text.ljust(HEADER_BYTES - 16, b"\0"))
            out.write(memoryview(indptr))
            out.flush()
            os.fsync(out.fileno())  # the rename below must never publish a file whose bytes are not yet on disk
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
        if spill is not None:
            shutil.rmtree(spill, ignore_errors=True)
    if progress:
        size = path.stat().st_size
        progress(f"  built {path.name}: {nnz:,} items, {size / 1e9:.2f} GB, {time.monotonic() - started:.0f} s")
    return path


def write_manifest_with_indexes(root: str | Path, progress: Progress = None, **fields) -> dict:
    """Write a dataset's manifest (``bigrank.data.manifest.write_manifest``, ``fields`` its arguments) after the
    per-user index of each split with rows, which it lists under ``user_index``: what ``bigrank ingest`` and
    ``bigrank generate`` call, so that a dataset comes with what evaluation reads (streamed, :func:`build_index`).
    ``progress`` gets a line now and then. Returns the manifest."""
    root = Path(root)
    manifest = layout.describe_dataset(root, **fields)
    dataset = layout.DatasetManifest(
        root, int(manifest["num_users"]), int(manifest["num_items"]), manifest["splits"], manifest
    )
    manifest["user_index"] = {
        name: build_index(dataset, name, progress).relative_to(root).as_posix()
        for name, split in manifest["splits"].items()
        if split["rows"]
    }
    layout.write_json_atomic(root / layout.MANIFEST_NAME, manifest)
    return manifest


def ensure_index(
    dataset: layout.DatasetManifest, split: str, progress: Progress = None, block_ratings: int | None = None
) -> UserItemsIndex | None:
    """The index of ``split``, built first when absent, stale or damaged (a damaged one is reported, deleted and
    rebuilt; stale ones of the split are deleted). Of concurrent callers one builds, the others wait for it and
    open its file. None, with a line to ``progress``, when the dataset's directory cannot hold the index
    (read-only, full): the caller then reads the split's files. A killed builder's temporary files are deleted."""
    directory = dataset.root / INDEX_DIR
    try:
        directory.mkdir(exist_ok=True)
        lock = os.open(directory / f".{split}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as error:
        if progress:
            progress(f"no user index for split {split!r}: cannot write in {directory} ({error})")
        return None
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)  # concurrent builders take turns; the kernel drops it if a holder dies
        for leftover in [*directory.glob(f".{split}-*.csr.tmp-*"), *directory.glob(f".spill-{split}-*")]:
            if leftover.is_dir():  # a killed builder's (none runs now: it would hold the lock)
                shutil.rmtree(leftover)
            else:
                leftover.unlink()
        key = index_key(dataset, split)
        try:
            index = open_index(dataset, split, key)
        except CorruptFileError as error:
            if progress:
                progress(f"{error}; rebuilding it")
            index_path(dataset, split, key).unlink(missing_ok=True)
            index = None
        if index is None:
            try:
                path = build_index(dataset, split, progress, block_ratings)
            except OSError as error:  # no space left, a file missing (the read of the files then names it)
                if progress:
                    progress(f"could not build the user index of split {split!r} ({error}); reading its files")
                return None
            for stale in directory.glob(f"{split}-*.csr"):
                if stale != path:
                    stale.unlink(missing_ok=True)
            index = open_index(dataset, split, key)
        return index
    finally:
        os.close(lock)
