"""Item-parallel full-catalog losses equal their single-process twins (real gloo groups, 2 and 3 ranks)."""

from __future__ import annotations

import pytest
import torch

from bigrank.distributed.catalog import CatalogShard, distributed_topk, shard_range
from bigrank.distributed.collectives import all_gather_rows, count_bytes
from bigrank.losses import rankmax_loss, softmax_loss, sparsemax_loss
from tests.distributed_utils import run_distributed

LOSSES = {
    "rankmax1": lambda s, y, **kw: rankmax_loss(s, y, k=1, **kw),
    "rankmax5": lambda s, y, **kw: rankmax_loss(s, y, k=5, **kw),
    "softmax": lambda s, y, **kw: softmax_loss(s, y, **kw),
    "sparsemax": lambda s, y, **kw: sparsemax_loss(s, y, support_guess=2, **kw),
}


def uneven_bounds(n: int, world_size: int) -> list[tuple[int, int]]:
    """Deliberately uneven contiguous shards (the last rank gets the most)."""
    cuts = [0] + [n * (r + 1) // (world_size + 2) for r in range(world_size - 1)] + [n]
    return list(zip(cuts[:-1], cuts[1:], strict=True))


def scores_with_ties(batch: int, n: int, k: int, dtype, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    scores = (torch.randn(batch, n, generator=generator, dtype=torch.float64) * 1.5).to(dtype)
    target = torch.randint(0, n, (batch,), generator=generator)
    order = torch.argsort(scores, dim=1, descending=True)
    # Row 0: positive at the top and a tie at the k-th value between the first and the last columns.
    scores[0, 0] = scores[0].max() + 1
    target[0] = 0
    scores[0, n - 1] = scores[0, order[0, k]]
    scores[0, 1] = scores[0, order[0, k]]
    # Row 1: positive inside the top k; row 2: positive held by the last column (last rank).
    target[1] = order[1, k // 2]
    target[2] = n - 1
    return scores, target


def _loss_body(rank, world_size, group, scores, target, bounds):
    """Every loss on this rank's columns: {name: (loss, grad of the local scores)}."""
    start, stop = bounds[rank]
    results = {}
    for name, loss_fn in LOSSES.items():
        local = scores[:, start:stop].clone().requires_grad_(True)
        loss = loss_fn(local, target, group=group, offset=start)
        loss.backward()
        results[name] = (loss.detach(), local.grad)
    return results


def assert_matches_single_process(scores, target, bounds, tolerance):
    results = run_distributed(_loss_body, len(bounds), args=(scores, target, bounds))
    for name, loss_fn in LOSSES.items():
        full = scores.clone().requires_grad_(True)
        expected = loss_fn(full, target)
        expected.backward()
        for per_rank in results:
            torch.testing.assert_close(per_rank[name][0], expected.detach(), atol=tolerance, rtol=tolerance, msg=name)
        grad = torch.cat([per_rank[name][1] for per_rank in results], dim=1)
        torch.testing.assert_close(grad, full.grad, atol=tolerance, rtol=tolerance, msg=name)


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_distributed_losses_equal_single_process(world_size, dtype):
    scores, target = scores_with_ties(batch=6, n=41, k=5, dtype=dtype)
    tolerance = 1e-9 if dtype == torch.float64 else 1e-5
    assert_matches_single_process(scores, target, uneven_bounds(41, world_size), tolerance)


def _shard_body(rank, world_size, group, users, items, target, user_splits, chunk_size):
    start, stop = shard_range(items.shape[0], rank, world_size)
    results = {}
    for name, loss_fn in LOSSES.items():
        shard = CatalogShard(items.shape[0], items.shape[1], group, dtype=items.dtype)
        with torch.no_grad():
            shard.weight.copy_(items[start:stop])
        local_users = users[user_splits[rank] : user_splits[rank + 1]].clone().requires_grad_(True)
        gathered = all_gather_rows(local_users, group)
        loss = loss_fn(shard.scores(gathered, chunk_size=chunk_size), target, group=group, offset=shard.start)
        loss.backward()
        results[name] = (loss.detach(), local_users.grad, shard.weight.grad)
    return results


@pytest.mark.parametrize("chunk_size", [None, 4])
def test_catalog_shard_gradients_reach_users_and_items(chunk_size):
    generator = torch.Generator().manual_seed(3)
    users = torch.randn(7, 4, generator=generator, dtype=torch.float64)
    items = torch.randn(23, 4, generator=generator, dtype=torch.float64)
    target = torch.randint(0, 23, (7,), generator=generator)
    user_splits = [0, 2, 4, 7]  # each rank contributes a different number of rows to the global batch
    results = run_distributed(_shard_body, 3, args=(users, items, target, user_splits, chunk_size))
    for name, loss_fn in LOSSES.items():
        full_users, full_items = users.clone().requires_grad_(True), items.clone().requires_grad_(True)
        expected = loss_fn(full_users @ full_items.T, target)
        expected.backward()
        torch.testing.assert_close(results[0][name][0], expected.detach(), atol=1e-9, rtol=1e-9)
        torch.testing.assert_close(torch.cat([r[name][1] for r in results]), full_users.grad, atol=1e-9, rtol=1e-9)
        torch.testing.assert_close(torch.cat([r[name][2] for r in results]), full_items.grad, atol=1e-9, rtol=1e-9)


def _bytes_body(rank, world_size, group, batch, n, k):
    generator = torch.Generator().manual_seed(rank)
    start, stop = shard_range(n, rank, world_size)
    local = torch.randn(batch, stop - start, generator=generator, requires_grad=True)
    target = torch.arange(batch) * 7 % n
    with count_bytes() as counter:
        rankmax_loss(local, target, k=k, group=group, offset=start).backward()
    return counter.total


def test_rankmax_bytes_per_call_do_not_depend_on_the_catalog_size():
    batch, k, world_size = 16, 5, 2
    small = run_distributed(_bytes_body, world_size, args=(batch, 1_000, k))
    large = run_distributed(_bytes_body, world_size, args=(batch, 200_000, k))
    assert small == large
    # O(B (k W + c)): top-k and two sums per row and rank, the positive's score, at most 3 more sums per row,
    # plus a fixed-size layout check; 8-byte floats.
    bound = 8 * batch * (k * world_size + 2 + 1 + 3) * world_size + 64 * world_size
    assert max(large) <= bound, (large, bound)


def _bad_input_body(rank, world_size, group, case):
    n = 20
    start, stop = shard_range(n, rank, world_size)
    local = torch.randn(4, stop - start, dtype=torch.float64)
    target = torch.tensor([0, 5, 10, 19])
    offset = start
    if case == "target_out_of_range":
        target = torch.tensor([0, 5, 10, 20])
    elif case == "bad_offsets":
        offset = 0  # every rank claims to start at column 0
    elif case == "different_targets":
        target = target + rank
    elif case == "nan_on_one_rank" and rank == world_size - 1:
        local[2, 0] = float("nan")
    try:
        rankmax_loss(local, target, k=2, group=group, offset=offset)
    except ValueError as error:
        return str(error)
    return None


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("target_out_of_range", "outside \\[0, 20\\)"),
        ("bad_offsets", "contiguous and in rank order"),
        ("different_targets", "same target"),
        ("nan_on_one_rank", "NaN or infinite"),
    ],
)
def test_bad_input_raises_on_every_rank_without_hanging(case, message):
    import re

    errors = run_distributed(_bad_input_body, 2, args=(case,), timeout=60)
    assert all(error is not None and re.search(message, error) for error in errors), errors


def test_a_rank_with_an_empty_shard_gives_the_right_answer():
    scores, target = scores_with_ties(batch=5, n=17, k=5, dtype=torch.float64, seed=4)
    assert_matches_single_process(scores, target, [(0, 9), (9, 9), (9, 17)], 1e-9)


def _topk_body(rank, world_size, group, scores, exclude, bounds, k):
    start, stop = bounds[rank]
    with torch.no_grad():
        return distributed_topk(scores[:, start:stop], k, group=group, offset=start, exclude=exclude[:, start:stop])


def test_distributed_topk_equals_full_topk_with_exclusions():
    generator = torch.Generator().manual_seed(9)
    scores = torch.randn(6, 50, generator=generator)
    scores[0, 10] = scores[0, 40]  # a tie across ranks: the lower id comes first
    exclude = torch.rand(6, 50, generator=generator) < 0.3
    bounds = uneven_bounds(50, 3)
    results = run_distributed(_topk_body, 3, args=(scores, exclude, bounds, 8))
    masked = scores.masked_fill(exclude, float("-inf"))
    for values, ids in results:
        torch.testing.assert_close(values, masked.topk(8, dim=1).values)
        assert (masked.gather(1, ids) == values).all()
        assert not exclude.gather(1, ids).any()
    values, ids = distributed_topk(scores, 3, exclude=exclude)
    torch.testing.assert_close(values, masked.topk(3, dim=1).values)


def test_shard_range_covers_the_catalog_and_init_does_not_depend_on_the_split():
    for world_size in (1, 2, 3, 7):
        ranges = [shard_range(100, r, world_size) for r in range(world_size)]
        assert ranges[0][0] == 0 and ranges[-1][1] == 100
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:], strict=False))
    whole = CatalogShard(100_000, 3, seed=5).weight
    part = CatalogShard(100_000, 3, seed=5, bounds=(60_000, 70_001)).weight
    torch.testing.assert_close(part, whole[60_000:70_001])
