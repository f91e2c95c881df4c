"""The streamed seen-items writer (``bigrank.export.seen.write_seen_part``) against a brute-force reference.

Real Parquet datasets with several part files and row groups per split, pairs repeated within and across
splits, ratings ordered by user block (row groups the writer skips by their statistics) or shuffled, and a
split written without statistics. Every way the writer can take — one block read straight from the dataset,
spilled buckets sorted whole, dense buckets cut into blocks — must write the same bytes.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from bigrank.data import manifest as layout
from bigrank.data import pair_blocks
from bigrank.export.seen import SPLIT_BITS, SeenItemsFile, write_seen_part
from bigrank.export.writer import _seen_entry
from tests import helpers
from tests.distributed_utils import run_distributed

NUM_USERS, NUM_ITEMS = 97, 41
GROUP_USERS = 2  # users per row group of the seen part
RANK_BOUNDS = [0, 31, 31, NUM_USERS]  # three ranks, the middle one with no users
# Direct read (all ratings fit), spilled buckets sorted whole, and dense buckets cut into several blocks.
BLOCK_RATINGS = {"direct": 10**9, "buckets": 1500, "cut buckets": 600}
SPLIT_SIZES = {"train": 3000, "valid": 600, "test": 600}


def _skewed_users(rng, n: int) -> np.ndarray:
    """Users in [0, NUM_USERS), denser near 0 (a few heavy users make some buckets dense), int32[n]."""
    return np.minimum(rng.power(0.6, n) * NUM_USERS, NUM_USERS - 1).astype(np.int32)


def _split_columns(kind: str, rng) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """``{split: (users, items)}`` for a dataset ``kind``.

    ``repeats``: many pairs repeat within a split, users 40-43 rate 300 times more each, and 150 train pairs
    are copied into valid and test too.
    ``distinct``: every (user, item) pair at most once over all splits (no pair to merge).
    """
    if kind == "distinct":
        pairs = rng.choice(NUM_USERS * NUM_ITEMS, 3000, replace=False)  # 3,000 of the 3,977 pairs
        users, items = (pairs // NUM_ITEMS).astype(np.int32), (pairs % NUM_ITEMS).astype(np.int32)
        cuts = [0, 2200, 2600, 3000]
        return {s: (users[a:b], items[a:b]) for s, a, b in zip(SPLIT_SIZES, cuts[:-1], cuts[1:], strict=True)}
    columns = {
        s: (_skewed_users(rng, n), rng.integers(0, NUM_ITEMS, n).astype(np.int32)) for s, n in SPLIT_SIZES.items()
    }
    heavy = np.repeat(np.arange(40, 44, dtype=np.int32), 300)  # 4 heavy users: their bucket is cut into blocks
    columns["train"] = (
        np.concatenate([columns["train"][0], heavy]),
        np.concatenate([columns["train"][1], rng.integers(0, NUM_ITEMS, len(heavy)).astype(np.int32)]),
    )
    train_users, train_items = columns["train"]
    for split in ("valid", "test"):
        users, items = columns[split]
        columns[split] = (np.concatenate([users, train_users[:150]]), np.concatenate([items, train_items[:150]]))
    return columns


def write_dataset(root, kind: str, order: str, seed: int = 0) -> dict:
    """A dataset of ``kind`` (``_split_columns``) in the ``bigrank.data`` layout: 600 rows a part file, row
    groups of 150. ``order="user blocks"`` sorts each split by blocks of 20 users (as ``bigrank generate``
    writes per user block); ``"shuffled"`` leaves the ratings in random order. The test split is written
    without Parquet statistics (its row groups cannot be skipped)."""
    rng = np.random.default_rng(seed)
    splits = _split_columns(kind, rng)
    if order == "user blocks":
        for split, (users, items) in splits.items():
            permutation = np.argsort(users // 20, kind="stable")
            splits[split] = (users[permutation], items[permutation])
    test = {"test": _write_without_statistics(root, "test", *splits.pop("test"))}
    return helpers.write_dataset(root, splits, NUM_USERS, NUM_ITEMS, written=test, seed=seed, rows_per_file=600,
                                 row_group_size=150)  # fmt: skip


def _write_without_statistics(root, split: str, users: np.ndarray, items: np.ndarray) -> list[str]:
    names = []
    for part, start in enumerate(range(0, len(users), 400)):
        name = layout.part_name(split, part)
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        table = pa.table({"user_id": users[start : start + 400], "item_id": items[start : start + 400]})
        pq.write_table(table, root / name, row_group_size=100, write_statistics=False)
        names.append(name)
    return names


def brute_force(root) -> dict[int, dict[int, int]]:
    """``{user: {item: split bits}}`` of every rating of the dataset at ``root``, one pair at a time."""
    manifest = layout.load_manifest(root)
    seen: dict[int, dict[int, int]] = defaultdict(dict)
    for split, info in manifest["splits"].items():
        for name in info["files"]:
            table = pq.read_table(root / name)
            for user, item in zip(table["user_id"].to_pylist(), table["item_id"].to_pylist(), strict=True):
                seen[user][item] = seen[user].get(item, 0) | SPLIT_BITS[split]
    return seen


def assert_part_equals(path, start: int, stop: int, reference: dict[int, dict[int, int]]) -> None:
    """The part at ``path`` holds users ``[start, stop)`` in row groups of ``GROUP_USERS``, each user's items
    ascending with the split bits of ``reference``."""
    handle = pq.ParquetFile(path)
    sizes = [handle.metadata.row_group(g).num_rows for g in range(handle.metadata.num_row_groups)]
    expected_sizes = [min(GROUP_USERS, stop - s) for s in range(start, stop, GROUP_USERS)]
    assert sizes == expected_sizes, "user u must be in row group (u - start) // GROUP_USERS"
    table = handle.read()
    assert table["user_id"].to_pylist() == list(range(start, stop))
    for user, items, bits in zip(
        range(start, stop), table["items"].to_pylist(), table["splits"].to_pylist(), strict=True
    ):
        assert items == sorted(reference.get(user, {})), f"user {user}"
        assert bits == [reference[user][item] for item in items], f"user {user}"


@pytest.mark.parametrize(
    ("kind", "order"), [("repeats", "user blocks"), ("repeats", "shuffled"), ("distinct", "user blocks")]
)
def test_every_path_writes_the_brute_force_seen_items_byte_for_byte_alike(tmp_path, kind, order):
    root = tmp_path / "data"
    write_dataset(root, kind, order)
    reference = brute_force(root)
    files = {}
    for way, block_ratings in BLOCK_RATINGS.items():
        out = tmp_path / way.replace(" ", "-")
        for rank in range(3):
            start, stop = RANK_BOUNDS[rank], RANK_BOUNDS[rank + 1]
            entry = write_seen_part(out, rank, root, start, stop, block_ratings=block_ratings, group_users=GROUP_USERS)
            assert_part_equals(out / entry["file"], start, stop, reference)
            assert entry["nnz"] == sum(len(reference.get(u, {})) for u in range(start, stop))
            files[way, rank] = (out / entry["file"]).read_bytes()
        assert not list((out / "seen").glob(".seen-spill-*")), "spill files are removed"
    for way in BLOCK_RATINGS:
        for rank in range(3):
            assert files[way, rank] == files["direct", rank], f"{way}, rank {rank}: the bytes depend on the path"


def test_spill_files_reopened_past_the_open_file_limit_write_the_same_bytes(tmp_path, monkeypatch):
    root = tmp_path / "data"
    write_dataset(root, "repeats", "shuffled")  # every row group holds users of every bucket
    sizes = {"block_ratings": BLOCK_RATINGS["cut buckets"], "group_users": GROUP_USERS}
    expected = write_seen_part(tmp_path / "a", 0, root, 0, NUM_USERS, **sizes)
    monkeypatch.setattr(pair_blocks, "MAX_OPEN_SPILL_FILES", 2)
    entry = write_seen_part(tmp_path / "b", 0, root, 0, NUM_USERS, **sizes)
    assert entry["sha256"] == expected["sha256"]
    assert_part_equals(tmp_path / "b" / entry["file"], 0, NUM_USERS, brute_force(root))


@pytest.mark.parametrize("order", ["user blocks", "shuffled"])
def test_blocks_tile_the_users_in_whole_row_groups_within_the_ratings_budget(tmp_path, order):
    """``_blocks`` cuts a rank's users into blocks of whole row groups of at most ``block_ratings`` ratings (a
    row group is never split), and the blocks' keys are exactly the rank's ratings."""
    root = tmp_path / "data"
    manifest = write_dataset(root, "repeats", order)
    files = [(root / f, SPLIT_BITS[s]) for s in manifest["splits"] for f in manifest["splits"][s]["files"]]
    start, stop, block_ratings = 3, NUM_USERS, BLOCK_RATINGS["cut buckets"]
    plan = pair_blocks.plan_row_groups(files, start, stop)
    spill = tmp_path / "spill"
    spill.mkdir()
    reference = brute_force(root)
    ratings = defaultdict(int)
    for info in manifest["splits"].values():
        for name in info["files"]:
            for user in pq.read_table(root / name)["user_id"].to_pylist():
                ratings[user] += 1

    edges = [0]
    # A block's keys are read before the next block is asked for (a spent bucket's file is deleted).
    for lo, hi, read_keys in pair_blocks.blocks(plan, start, stop, NUM_ITEMS, block_ratings, GROUP_USERS, spill):
        assert lo == edges[-1] and lo % GROUP_USERS == 0 and hi > lo
        edges.append(hi)
        keys = read_keys()
        assert len(keys) <= block_ratings or hi - lo <= GROUP_USERS, "only a single row group may exceed it"
        assert len(keys) == sum(ratings[start + u] for u in range(lo, hi))
        indptr, items, bits = pair_blocks.csr_block(lambda keys=keys: keys, lo, hi, NUM_ITEMS)
        for row in range(hi - lo):
            expected = reference.get(start + lo + row, {})
            span = slice(indptr[row], indptr[row + 1])
            assert items[span].tolist() == sorted(expected)
            assert bits[span].tolist() == [expected[item] for item in sorted(expected)]
    assert edges[-1] == stop - start
    assert not list(spill.iterdir()), "each bucket's file is deleted once its blocks are read"
    # The budget is small enough that dense buckets were cut into several blocks.
    buckets = pair_blocks._bucket_bounds(stop - start, sum(rows for *_, rows in plan), block_ratings, GROUP_USERS)
    assert len(edges) - 1 > len(buckets) - 1


def _write_rank_part(rank, world_size, group, out, root, bounds, block_ratings):
    """One rank's seen part, written while the other rank writes its own beside it."""
    import torch.distributed as dist

    dist.barrier(group)  # both ranks spill into seen/ at the same time
    return write_seen_part(
        out, rank, root, bounds[rank], bounds[rank + 1], block_ratings=block_ratings, group_users=GROUP_USERS
    )


def test_two_processes_write_their_parts_side_by_side(tmp_path):
    root = tmp_path / "data"
    write_dataset(root, "repeats", "user blocks")
    out, bounds = tmp_path / "export", [0, 48, NUM_USERS]
    args = (str(out), str(root), bounds, BLOCK_RATINGS["cut buckets"])
    parts = run_distributed(_write_rank_part, 2, args=args, timeout=120)
    assert not list((out / "seen").glob(".seen-spill-*")), "spill files are removed"
    manifest = {"num_items": NUM_ITEMS, "tables": {"seen": _seen_entry(parts, root)}}
    reference = brute_force(root)
    for splits in [("train",), ("valid", "test"), ("train", "valid", "test")]:
        mask = sum(SPLIT_BITS[s] for s in splits)
        reader = SeenItemsFile(out, manifest, splits, preload_max_ratings=0)
        for user in range(NUM_USERS):
            expected = sorted(i for i, bits in reference.get(user, {}).items() if bits & mask)
            assert reader.items_of(user).tolist() == expected, f"user {user} {splits}"


def test_keys_that_would_overflow_int64_are_refused():
    pair_blocks.check_key_range(2_215_888, 855_808)  # ML-1B: far from the limit
    with pytest.raises(ValueError, match="overflow"):
        pair_blocks.check_key_range(2**31, 2**31)
