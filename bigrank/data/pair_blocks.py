"""A dataset's (user, item) pairs of a user range as per-user CSR blocks, in bounded memory (streaming).

The one builder behind the export's seen-items table (``bigrank.export.seen.write_seen_part``: every split, a
bit per split) and the evaluation's user index (``bigrank.data.user_index``: one split). The split files are in
generator block order, so a user's ratings are spread over many files: the pairs are read row group by row
group as one int64 key each (``((user - start) * num_items + item) * 8 + split bit``), spilled to bucket files of
whole row groups of users when they exceed ``block_ratings``, and each bucket (or block of a bucket) is sorted
and reduced alone (:func:`csr_block`). Memory: ~20 bytes a key of one block; disk: 8 bytes a rating of spill.

    plan = plan_row_groups([(path, bit), ...], start, stop)        # the row groups that may hold the users
    for lo, hi, read_keys in blocks(plan, start, stop, num_items, block_ratings, group_users, spill_dir):
        indptr, items, bits = csr_block(read_keys, lo, hi, num_items)   # users start + [lo, hi)
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from bigrank import integrity
from bigrank.data import manifest as layout

__all__ = ["BLOCK_RATINGS", "blocks", "check_key_range", "csr_block", "plan_row_groups"]

# Ratings sorted at once: ~13 bytes each at the peak, 20 where pairs repeat (``csr_block``), so 210-320 MB;
# ML-1B's export rank of 1.1M users writes ~60 such blocks.
BLOCK_RATINGS = 16_000_000
SPILL_CHUNK_KEYS = 4_000_000  # keys read at once from a spill file when a bucket is cut into blocks
MAX_OPEN_SPILL_FILES = 128  # well below the 256 open files a macOS process gets by default


def check_key_range(num_users: int, num_items: int) -> None:
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


def plan_row_groups(files: Sequence[tuple[Path, int]], start: int, stop: int) -> list[tuple[Path, int, list, int]]:
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


def blocks(plan, start: int, stop: int, num_items: int, block_ratings: int, group_users: int, spill: Path | None):
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


def csr_block(read_keys, lo: int, hi: int, num_items: int):
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
