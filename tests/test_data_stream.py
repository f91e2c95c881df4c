"""ParquetStream: every row exactly once per epoch over all ranks (with a restart in the middle), the same
steps on every rank, determinism, and read errors naming the file."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch
import torch.distributed as dist

from bigrank.data import manifest as layout
from bigrank.data.stream import ParquetStream, read_user_items, shuffle_order
from tests.distributed_utils import run_distributed

NUM_USERS, NUM_ITEMS = 97, 1009


def make_dataset(root, rows=1237, row_group_size=50, rows_per_file=333):
    """Uneven files and row groups; every (user, item) pair distinct so rows can be identified."""
    rng = np.random.default_rng(1)
    keys = rng.choice(NUM_USERS * NUM_ITEMS, size=rows, replace=False)
    columns = {"user_id": keys // NUM_ITEMS, "item_id": keys % NUM_ITEMS}
    files = {
        "train": layout.write_split_parts(
            root, "train", columns, rows_per_file=rows_per_file, row_group_size=row_group_size
        )
    }
    layout.write_manifest(
        root, num_users=NUM_USERS, num_items=NUM_ITEMS, split_files=files, seed=0, source="test", generator={}
    )
    return np.sort(keys)


def keys_of(batch) -> np.ndarray:
    return batch["user_id"].numpy() * NUM_ITEMS + batch["item_id"].numpy()


def run_epoch(root, world_size, batch_size, restart_after=None, epoch=0, **options):
    """Per-rank lists of batch keys for one epoch; optionally stop every rank after ``restart_after``
    batches, rebuild the streams from their state dicts and finish the epoch."""
    streams = [
        ParquetStream(root, "train", batch_size, rank=r, world_size=world_size, **options) for r in range(world_size)
    ]
    for stream in streams:
        stream.set_epoch(epoch)
    out = []
    for rank, stream in enumerate(streams):
        batches = []
        iterator = iter(stream)
        if restart_after is not None:
            batches += [keys_of(b) for b in itertools.islice(iterator, restart_after)]
            iterator.close()
            state = stream.state_dict()
            stream = ParquetStream(root, "train", batch_size, rank=rank, world_size=world_size, **options)
            stream.load_state_dict(state)
            iterator = iter(stream)
        batches += [keys_of(b) for b in iterator]
        assert stream.epoch == epoch + 1  # the state moved on once the last batch was handed out
        out.append(batches)
    return out


@pytest.mark.parametrize("world_size", [1, 2, 3])
@pytest.mark.parametrize("restart_after", [None, 5])
@pytest.mark.parametrize("prefetch", [0, 3])
def test_every_row_exactly_once_per_epoch(tmp_path, world_size, restart_after, prefetch):
    all_keys = make_dataset(tmp_path)
    batch_size = 37
    per_rank = run_epoch(tmp_path, world_size, batch_size, restart_after, shuffle_buffer=120, prefetch=prefetch)
    steps = {len(batches) for batches in per_rank}
    expected_steps = math.ceil(math.ceil(len(all_keys) / world_size) / batch_size)
    assert steps == {expected_steps}  # lock-step: every rank runs the same number of steps
    seen = np.concatenate([np.concatenate(batches) for batches in per_rank])
    assert len(seen) == len(all_keys)
    assert np.array_equal(np.sort(seen), all_keys)
    for batches in per_rank:
        assert all(len(b) == batch_size for b in batches[:-1]) and 0 <= len(batches[-1]) <= batch_size


def test_restart_gives_the_same_batches_as_an_uninterrupted_run(tmp_path):
    make_dataset(tmp_path)
    plain = run_epoch(tmp_path, 3, 29, None, epoch=2, shuffle_buffer=100)
    resumed = run_epoch(tmp_path, 3, 29, 4, epoch=2, shuffle_buffer=100)
    for a, b in zip(plain, resumed, strict=True):
        assert len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))


def test_deterministic_and_reshuffled_each_epoch(tmp_path):
    make_dataset(tmp_path)
    first = np.concatenate(run_epoch(tmp_path, 2, 64, epoch=0)[0])
    again = np.concatenate(run_epoch(tmp_path, 2, 64, epoch=0)[0])
    other_epoch = np.concatenate(run_epoch(tmp_path, 2, 64, epoch=1)[0])
    other_seed = np.concatenate(run_epoch(tmp_path, 2, 64, epoch=0, seed=5)[0])
    assert np.array_equal(first, again)
    assert not np.array_equal(first, other_epoch) and not np.array_equal(first, other_seed)
    unshuffled = np.concatenate(run_epoch(tmp_path, 1, 64, shuffle=False)[0])
    assert not np.array_equal(np.sort(first), first[: len(first)])  # shuffled output is not sorted
    assert len(unshuffled) == 1237


def test_iterating_continues_into_the_next_epoch(tmp_path):
    make_dataset(tmp_path)
    stream = ParquetStream(tmp_path, "train", 100, prefetch=0)
    first = np.concatenate([keys_of(b) for b in stream])
    second = np.concatenate([keys_of(b) for b in stream])
    assert stream.epoch == 2 and len(first) == len(second) == 1237
    assert not np.array_equal(first, second) and np.array_equal(np.sort(first), np.sort(second))
    stream.set_epoch(1)
    assert np.array_equal(np.concatenate([keys_of(b) for b in stream]), second)


def test_empty_final_batch_keeps_ranks_in_lock_step(tmp_path):
    # 1237 rows over 2 ranks: shares 618 / 619; with batch 103, 618 = 6 * 103 and rank 0's step 7 is empty.
    make_dataset(tmp_path)
    per_rank = run_epoch(tmp_path, 2, 103)
    assert [len(b) for b in per_rank] == [7, 7]
    assert len(per_rank[0][-1]) == 0 and len(per_rank[1][-1]) == 1


def test_drop_last_gives_full_batches_and_equal_steps(tmp_path):
    all_keys = make_dataset(tmp_path)
    per_rank = run_epoch(tmp_path, 3, 50, drop_last=True)
    assert {len(b) for b in per_rank} == {(1237 // 3) // 50}
    seen = np.concatenate([np.concatenate(b) for b in per_rank])
    assert all(len(x) == 50 for b in per_rank for x in b)
    assert len(np.unique(seen)) == len(seen) == 3 * 8 * 50 and np.isin(seen, all_keys).all()


def test_state_from_another_configuration_is_refused(tmp_path):
    make_dataset(tmp_path)
    state = ParquetStream(tmp_path, "train", 10, rank=0, world_size=2).state_dict()
    with pytest.raises(ValueError, match="seed"):
        ParquetStream(tmp_path, "train", 10, rank=0, world_size=2, seed=1).load_state_dict(state)
    with pytest.raises(ValueError, match="shuffle_buffer"):
        ParquetStream(tmp_path, "train", 10, rank=0, world_size=2, shuffle_buffer=7).load_state_dict(state)


def _run_segment(root, world_size, batch_size, state, steps=None, **options):
    """Every rank of a ``world_size`` stream restored from ``state`` runs ``steps`` batches (None: to the end of
    the epoch); returns (keys seen, the common state after, steps run)."""
    seen, states, counts = [], [], []
    for rank in range(world_size):
        stream = ParquetStream(root, "train", batch_size, rank=rank, world_size=world_size, **options)
        if state is not None:
            stream.load_state_dict(state)
        batches = [keys_of(b) for b in itertools.islice(iter(stream), steps)]
        seen += batches
        counts.append(len(batches))
        states.append(stream.state_dict())
    assert all(s == states[0] for s in states), "the stream state must be the same on every rank"
    assert len(set(counts)) == 1, f"ranks ran different step counts {counts}"
    return (np.concatenate(seen) if seen else np.empty(0, np.int64)), states[0], counts[0]


@pytest.mark.parametrize("drop_last", [False, True])
def test_resume_on_another_world_size_loses_and_repeats_no_row(tmp_path, drop_last):
    """2 ranks (batch 10) -> 3 ranks (batch 7) -> 1 rank (batch 20) within one epoch: every row of the epoch once
    (drop_last: no row twice, and only the tail of the last segment skipped); the next epoch is whole again."""
    all_keys = make_dataset(tmp_path)
    options = {"shuffle_buffer": 120, "drop_last": drop_last, "prefetch": 0}
    first, state, _ = _run_segment(tmp_path, 2, 10, None, steps=23, **options)
    second, state, _ = _run_segment(tmp_path, 3, 7, state, steps=11, **options)
    third, state, steps = _run_segment(tmp_path, 1, 20, state, **options)
    seen = np.concatenate([first, second, third])
    assert len(first) == 2 * 23 * 10 and len(second) == 3 * 11 * 7
    assert len(np.unique(seen)) == len(seen), "a row was repeated within the epoch"
    if drop_last:
        assert len(all_keys) - len(seen) < 20 and steps == (len(all_keys) - len(first) - len(second)) // 20
    else:
        np.testing.assert_array_equal(np.sort(seen), all_keys)
    assert state["epoch"] == 1 and state["remaining"] is None and state["step"] == 0
    following, _, _ = _run_segment(tmp_path, 1, 20, state, **options)
    assert len(np.unique(following)) == len(following) and len(following) >= len(all_keys) - 19


def test_resume_on_the_same_world_size_after_a_reshard_continues_exactly(tmp_path):
    """After 2 -> 3 ranks, a 3-rank checkpoint resumed on 3 ranks yields the batches of the uninterrupted 3 ranks."""
    make_dataset(tmp_path)
    options = {"shuffle_buffer": 120, "prefetch": 0}
    _, state, _ = _run_segment(tmp_path, 2, 10, None, steps=9, **options)
    straight, _, _ = _run_segment(tmp_path, 3, 7, state, **options)
    _, middle, _ = _run_segment(tmp_path, 3, 7, state, steps=4, **options)
    rest, _, _ = _run_segment(tmp_path, 3, 7, middle, **options)
    head = []
    for rank in range(3):  # the first 4 batches of each rank, in rank order, as _run_segment concatenates them
        stream = ParquetStream(tmp_path, "train", 7, rank=rank, world_size=3, **options)
        stream.load_state_dict(state)
        head += [keys_of(b) for b in itertools.islice(iter(stream), 4)]
    assert sorted(np.concatenate(head + [rest]).tolist()) == sorted(straight.tolist())
    assert len(rest) + 3 * 4 * 7 == len(straight)


def test_rating_columns_and_missing_columns(tmp_path):
    make_dataset(tmp_path)
    with pytest.raises(ValueError, match="rating"):
        ParquetStream(tmp_path, "train", 10, columns=("user_id", "item_id", "rating"))
    batch = next(iter(ParquetStream(tmp_path, "train", 10)))
    assert batch["user_id"].dtype == batch["item_id"].dtype == torch.int64


def test_missing_or_corrupt_file_fails_before_training(tmp_path):
    make_dataset(tmp_path)
    victim = tmp_path / "train" / "part-00002.parquet"
    data = victim.read_bytes()
    victim.write_bytes(data[:-100])
    with pytest.raises(ValueError, match="part-00002"):
        ParquetStream(tmp_path, "train", 10)
    victim.unlink()
    with pytest.raises(FileNotFoundError, match="part-00002"):
        ParquetStream(tmp_path, "train", 10)


def test_corrupt_row_group_while_streaming_names_the_file(tmp_path):
    make_dataset(tmp_path)
    victim = tmp_path / "train" / "part-00001.parquet"
    data = bytearray(victim.read_bytes())
    data[4:600] = b"\x07" * 596
    victim.write_bytes(bytes(data))
    stream = ParquetStream(tmp_path, "train", 1000, shuffle=False, prefetch=2)  # footer still fine
    with pytest.raises(ValueError, match="part-00001"):
        for _ in stream:
            pass


def test_read_user_items_matches_brute_force(tmp_path):
    all_keys = make_dataset(tmp_path)
    indptr, items = read_user_items(tmp_path, "train")
    assert indptr.shape == (NUM_USERS + 1,) and items.dtype == np.int32
    for user in range(NUM_USERS):
        expected = np.sort(all_keys[all_keys // NUM_ITEMS == user] % NUM_ITEMS)
        assert np.array_equal(items[indptr[user] : indptr[user + 1]], expected)


def _lock_step_body(rank, world_size, group, root):
    """Each rank streams its share, sums its rows with an all_reduce every step, restarts midway."""
    stream = ParquetStream(root, "train", 41, rank=rank, world_size=world_size, shuffle_buffer=90)
    seen, steps = [], 0
    for batch in itertools.islice(iter(stream), 3):
        seen.append(keys_of(batch))
        dist.all_reduce(torch.tensor([len(batch["user_id"])]), group=group)
        steps += 1
    restarted = ParquetStream(root, "train", 41, rank=rank, world_size=world_size, shuffle_buffer=90)
    restarted.load_state_dict(stream.state_dict())
    total = 0
    for batch in restarted:
        seen.append(keys_of(batch))
        count = torch.tensor([len(batch["user_id"])])
        dist.all_reduce(count, group=group)
        total += int(count)
        steps += 1
    return {"steps": steps, "keys": np.concatenate(seen), "len": len(stream)}


@pytest.mark.parametrize("world_size", [2, 3])
def test_gloo_ranks_run_in_lock_step_and_cover_the_split(tmp_path, world_size):
    all_keys = make_dataset(tmp_path)
    results = run_distributed(_lock_step_body, world_size=world_size, args=(str(tmp_path),), timeout=90)
    assert {r["steps"] for r in results} == {results[0]["len"]}
    seen = np.concatenate([r["keys"] for r in results])
    assert np.array_equal(np.sort(seen), all_keys)


def test_shuffle_order_is_a_uniform_permutation():
    """Rao-Sandelius: with one bucket per row on average (4 buckets for 4 rows), every one of the 24 orders of 4
    rows comes out equally often over seeds (chi-square, 23 degrees of freedom, p < 1e-6 rejects); a bucketing
    that kept the rows of a bucket in their input order, or biased buckets, would fail."""
    counts: dict[tuple, int] = {}
    trials = 24 * 400
    for seed in range(trials):
        grouping, order = shuffle_order(4, [seed, 7], bucket_rows=1)
        permutation = tuple(grouping[order].tolist())
        counts[permutation] = counts.get(permutation, 0) + 1
    assert sorted(counts) == sorted(itertools.permutations(range(4)))
    expected = trials / 24
    chi_square = sum((observed - expected) ** 2 / expected for observed in counts.values())
    assert chi_square < 70.0, chi_square  # the 1 - 1e-6 quantile of chi-square(23) is ~ 67.4


@pytest.mark.parametrize("rows", [0, 1, 5, 255, 1000, 70_001])
@pytest.mark.parametrize("bucket_rows", [1, 64, 1 << 14])
def test_shuffle_order_is_a_deterministic_permutation(rows, bucket_rows):
    grouping, order = shuffle_order(rows, [3, 1, 4], bucket_rows=bucket_rows)
    assert grouping.shape == order.shape == (rows,) and order.dtype == np.int32
    permutation = grouping[order]
    np.testing.assert_array_equal(np.sort(permutation), np.arange(rows))
    again, again_order = shuffle_order(rows, [3, 1, 4], bucket_rows=bucket_rows)
    np.testing.assert_array_equal(again[again_order], permutation)
    if rows >= 255:
        other, other_order = shuffle_order(rows, [3, 1, 5], bucket_rows=bucket_rows)
        assert not np.array_equal(other[other_order], permutation)


@pytest.mark.parametrize("restart_after", [None, 4])
def test_prefetch_thread_yields_the_same_batches_as_reading_inline(tmp_path, restart_after):
    """The background thread hands over whole windows; the batches (order, sizes, dtypes) must be those of the
    inline reader, also across a restart and windows that end inside a batch."""
    make_dataset(tmp_path)
    inline = run_epoch(tmp_path, 2, 37, restart_after, epoch=1, shuffle_buffer=120, prefetch=0)
    threaded = run_epoch(tmp_path, 2, 37, restart_after, epoch=1, shuffle_buffer=120, prefetch=2)
    for a, b in zip(inline, threaded, strict=True):
        assert len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))


def test_batches_own_their_memory(tmp_path):
    """A batch kept by the caller (and even modified) does not change with later batches or other batches."""
    make_dataset(tmp_path)
    stream = ParquetStream(tmp_path, "train", 50, shuffle_buffer=120, prefetch=2)
    kept = list(stream)
    snapshot = [keys_of(b).copy() for b in kept]
    for batch in kept:
        assert batch["user_id"].dtype == batch["item_id"].dtype == torch.int64
        assert batch["user_id"].is_contiguous()
        batch["user_id"].fill_(-1)
    stream.set_epoch(0)
    again = [keys_of(b) for b in stream]
    assert all(np.array_equal(x, y) for x, y in zip(snapshot, again, strict=True))


def test_packed_user_item_rows_unpack_exactly():
    """A shuffled window of two int32 columns moves as one int64 (first << 32 | second): every int32 pair,
    negative and extreme ones included, comes back unchanged and as int64, across part boundaries."""
    from bigrank.data.stream import _Chunk, _pack

    rng = np.random.default_rng(0)
    first = np.concatenate([[0, -1, 2**31 - 1, -(2**31)], rng.integers(-(2**31), 2**31, 500)]).astype(np.int32)
    second = np.concatenate([[-(2**31), 2**31 - 1, -1, 0], rng.integers(-(2**31), 2**31, 500)]).astype(np.int32)
    parts = [{"u": first[:3], "i": second[:3]}, {"u": first[3:], "i": second[3:]}]
    order = rng.permutation(len(first)).astype(np.int32)
    rows = _Chunk({}, order, 0, len(first), _pack(parts, ("u", "i")), ("u", "i")).take(0, len(first))
    assert rows["u"].dtype == rows["i"].dtype == np.int64
    np.testing.assert_array_equal(rows["u"], first[order])
    np.testing.assert_array_equal(rows["i"], second[order])


def test_state_from_another_window_shuffle_resumes_only_at_an_epoch_boundary(tmp_path):
    """Positions inside an epoch index the shuffled sequence: a state written by another window permutation
    (an older bigrank: no ``window_shuffle``) is refused mid-epoch, naming the problem, and accepted at an
    epoch boundary."""
    make_dataset(tmp_path)
    stream = ParquetStream(tmp_path, "train", 100, prefetch=0)
    next(iter(stream))
    old = {key: value for key, value in stream.state_dict().items() if key != "window_shuffle"}
    with pytest.raises(ValueError, match="shuffled by 'an older bigrank'"):
        ParquetStream(tmp_path, "train", 100).load_state_dict(old)
    boundary = dict(old, epoch=3, step=0, remaining=None)
    resumed = ParquetStream(tmp_path, "train", 100)
    resumed.load_state_dict(boundary)
    assert resumed.epoch == 3 and resumed.state_dict()["window_shuffle"] == stream.state_dict()["window_shuffle"]
