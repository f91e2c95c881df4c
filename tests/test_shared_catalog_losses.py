"""User-major shared losses (``bigrank.losses.shared``): equal to the single-process shared losses (a [U, n] mask,
one sort per user) and to the row-wise losses summed over the same rows, on 1, 2 and 3 ranks with uneven shards;
and their bucket kernel (``bigrank.losses.buckets``) equal to ``torch.searchsorted``."""

from __future__ import annotations

import pytest
import torch

from bigrank.losses import buckets, rankmax_loss, rankmax_shared_loss, softmax_loss, softmax_shared_loss
from bigrank.losses.scores import ChunkedScores
from bigrank.losses.shared import rankmax_shared_catalog_loss, softmax_shared_catalog_loss
from tests.distributed_utils import run_distributed
from tests.test_distributed_catalog import uneven_bounds

SHARED = {
    "rankmax": (
        lambda s, p, i, **kw: rankmax_shared_catalog_loss(s, p, i, 0.7, "sum", **kw),
        lambda s, mask: rankmax_shared_loss(s, mask, 0.7, reduction="sum"),
        lambda s, y: rankmax_loss(s, y, k=1, margin=0.7, reduction="sum"),
    ),
    "softmax": (
        lambda s, p, i, **kw: softmax_shared_catalog_loss(s, p, i, "sum", temperature=0.5, **kw),
        lambda s, mask: softmax_shared_loss(s, mask, "sum", temperature=0.5),
        lambda s, y: softmax_loss(s / 0.5, y, reduction="sum"),
    ),
}


def user_positives(users: int, n: int, seed: int = 0):
    """``(mask bool[U, n], indptr, items)``: ~20% positives a user, user 2 without any, user 0 with all but one
    item; the CSR lists each user's items out of order (the losses must not rely on an order)."""
    generator = torch.Generator().manual_seed(seed)
    mask = torch.rand(users, n, generator=generator) < 0.2
    mask[2] = False
    mask[0] = True
    mask[0, 3] = False
    lists = [torch.flip(row.nonzero().squeeze(1), [0]) for row in mask]
    indptr = torch.tensor([0] + [len(x) for x in lists]).cumsum(0)
    return mask, indptr, torch.cat(lists)


def factors(users: int, n: int, d: int, dtype, seed: int = 1):
    generator = torch.Generator().manual_seed(seed)
    u = torch.randn(users, d, generator=generator, dtype=torch.float64).to(dtype)
    v = torch.randn(n, d, generator=generator, dtype=torch.float64).to(dtype)
    v[7] = v[5]  # two items with equal scores for every user: ties between thresholds and scores
    return u, v


def loss_and_grads(fn, u, v):
    u, v = u.clone().requires_grad_(), v.clone().requires_grad_()
    loss = fn(u, v)
    grad_u, grad_v = torch.autograd.grad(loss, (u, v))
    return loss.detach(), grad_u, grad_v


@pytest.mark.parametrize("name", SHARED)
@pytest.mark.parametrize("chunk_size", [None, 6])
def test_shared_catalog_loss_equals_the_mask_loss_and_the_row_wise_sum(name, chunk_size):
    shared, mask_loss, row_loss = SHARED[name]
    users, n = 6, 40
    mask, indptr, items = user_positives(users, n)
    u, v = factors(users, n, 5, torch.float64)

    def scores(u, v):
        return u @ v.T if chunk_size is None else ChunkedScores(u, v, chunk_size)

    got = loss_and_grads(lambda u, v: shared(scores(u, v), indptr, items), u, v)
    by_mask = loss_and_grads(lambda u, v: mask_loss(u @ v.T, mask), u, v)
    rows, targets = mask.nonzero().unbind(1)
    by_rows = loss_and_grads(lambda u, v: row_loss((u @ v.T)[rows], targets), u, v)
    for reference in (by_mask, by_rows):
        for a, b in zip(got, reference, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("name", SHARED)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("native", ["1", "0"])
def test_low_precision_scores_match_float64_within_rounding(name, dtype, native, monkeypatch):
    """float32 and bf16 GEMMs (the native bucket kernel, then the torch one): the float64 result within the
    scores' rounding."""
    monkeypatch.setenv("BIGRANK_NATIVE", native)
    shared = SHARED[name][0]
    users, n = 5, 300
    _, indptr, items = user_positives(users, n, seed=3)
    u, v = factors(users, n, 8, torch.float32, seed=4)
    exact = loss_and_grads(lambda u, v: shared(u.double() @ v.double().T, indptr, items), u, v)
    got = loss_and_grads(lambda u, v: shared(ChunkedScores(u, v, 64, dtype), indptr, items), u, v)
    tolerance = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got[0].double(), exact[0].double(), rtol=tolerance, atol=0)
    for a, b in zip(got[1:], exact[1:], strict=True):
        scale = b.abs().max()
        assert float((a.double() - b.double()).abs().max()) <= tolerance * 10 * float(scale)


def _shared_body(rank, world_size, group, name, u, v, indptr, items, bounds, chunk_size):
    shared = SHARED[name][0]
    start, stop = bounds[rank]
    u, local_v = u.clone().requires_grad_(), v[start:stop].clone().requires_grad_()
    scores = ChunkedScores(u, local_v, chunk_size) if chunk_size else u @ local_v.T
    loss = shared(scores, indptr, items, group=group, offset=start)
    grad_u, grad_v = torch.autograd.grad(loss, (u, local_v))
    return loss.detach(), grad_u, grad_v


@pytest.mark.parametrize("world_size", [1, 2, 3])
@pytest.mark.parametrize("name", SHARED)
def test_item_parallel_shared_loss_equals_single_process(world_size, name):
    """Uneven shards (the last rank holds most); every rank gets the full loss, its own rows' gradient and its
    shard's part of the user gradient (the trainer's all-gather sums the parts in backward)."""
    users, n = 6, 41
    mask, indptr, items = user_positives(users, n, seed=5)
    u, v = factors(users, n, 4, torch.float64, seed=6)
    bounds = uneven_bounds(n, world_size)
    results = run_distributed(
        _shared_body, world_size, (name, u, v, indptr, items, bounds, 5 if world_size > 1 else None)
    )
    loss, grad_u, grad_v = loss_and_grads(lambda u, v: SHARED[name][1](u @ v.T, mask), u, v)
    for rank, (got_loss, _, got_v) in enumerate(results):
        start, stop = bounds[rank]
        torch.testing.assert_close(got_loss, loss, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(got_v, grad_v[start:stop], rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(sum(result[1] for result in results), grad_u, rtol=1e-10, atol=1e-10)


def _bad_body(rank, world_size, group, case):
    u = torch.randn(3, 4, dtype=torch.float64)
    v = torch.randn(10, 4, dtype=torch.float64)
    indptr, items = torch.tensor([0, 2, 2, 3]), torch.tensor([1, 9, 4])
    if case == "outside":
        items = torch.tensor([1, 25, 4])
    if case == "nan" and rank == 1:
        v[2, 0] = float("nan")
    try:
        rankmax_shared_catalog_loss(u @ v.T, indptr, items, group=group, offset=10 * rank)
    except ValueError as error:
        return str(error)
    return None


@pytest.mark.parametrize(
    ("case", "message"),
    [("outside", "held by no rank"), ("nan", "NaN or infinite")],
)
def test_bad_positives_and_scores_raise_on_every_rank_without_hanging(case, message):
    results = run_distributed(_bad_body, 2, (case,))
    assert all(result is not None and message in result for result in results), results


def test_bad_csr_is_refused():
    scores = torch.randn(2, 5)
    with pytest.raises(ValueError, match="indptr must be an integer tensor of shape"):
        rankmax_shared_catalog_loss(scores, torch.tensor([0, 1]), torch.tensor([1]))
    with pytest.raises(ValueError, match="indptr must rise"):
        rankmax_shared_catalog_loss(scores, torch.tensor([0, 2, 1]), torch.tensor([1]))
    with pytest.raises(ValueError, match=">= 0"):
        softmax_shared_catalog_loss(scores, torch.tensor([0, 1, 1]), torch.tensor([-1]))


def native_and_torch(fn):
    """``[fn() with the native kernel, fn() with the torch path]``."""
    results = []
    for native in ("1", "0"):
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("BIGRANK_NATIVE", native)
            results.append(fn())
    return results


def needs_native() -> None:
    if not buckets.native_available():
        pytest.skip("no C compiler here: the torch path is the only one")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("longest", [5, 40_000])
def test_native_buckets_equal_searchsorted(dtype, longest):
    """The native kernel's buckets, counts and sums equal ``torch.searchsorted``'s and ``scatter_add_``'s bit for
    bit, ties included (scores equal to a threshold are not above it), infinite scores too; past 32,767
    thresholds a row the index is int32."""
    needs_native()
    generator = torch.Generator().manual_seed(7)
    rows, cols = 4, 1000 + 13  # a tail that is not a multiple of 16
    block = torch.randn(rows, cols, generator=generator).to(dtype)
    block[0, 5], block[3, 6] = float("inf"), float("-inf")
    lengths = torch.tensor([longest, 0, min(longest, 3), 17])
    thresholds = torch.randn(int(lengths.sum()), generator=generator).to(dtype).float()
    thresholds[:2] = block[0, :2].float()  # exact ties
    table = buckets.threshold_table(thresholds, lengths)

    def run():
        counts, sums = table.zeros(), table.zeros()
        index = torch.empty(rows, cols + 4, dtype=table.index_dtype)[:, 2 : 2 + cols]  # a slice
        for start in (0, 500):  # two blocks into the same sums
            part = slice(start, 500 if start == 0 else cols)
            buckets.bucket_stats(block[:, part], table, counts, sums, index[:, part])
        prefix = torch.randn(table.values.numel(), generator=torch.Generator().manual_seed(1))
        return counts, sums, index.to(torch.int64), buckets.bucket_gather(index, table, prefix)

    native, by_torch = native_and_torch(run)
    assert table.index_dtype == (torch.int16 if longest < 1 << 15 else torch.int32)
    for got, expected in zip(native, by_torch, strict=True):
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
    assert int(native[2][1].max()) == 0  # a row without thresholds: every score in bucket 0
    assert int(native[2][0, 5]) == longest and int(native[2][3, 6]) == 0  # +inf above every threshold, -inf below


def test_the_cell_tables_edge_cases_equal_searchsorted():
    """The kernel without AVX-512 places a score by its row's cell table (cells of equal width over the row's
    thresholds): rows whose thresholds are all equal (no width), crowded in one cell beside a far one, one
    threshold, none; scores on a threshold, between two equal ones, at +-inf and at the float32 extremes: the same
    buckets, counts and sums as torch.searchsorted, bit for bit."""
    needs_native()
    far = torch.finfo(torch.float32).max
    rows = [
        [0.5] * 7,  # all equal
        [0.0] * 5 + [0.001, 0.002, 1000.0],  # crowded at 0, one far away: most cells empty
        [-2.0],
        [],
        [-far, far],
    ]
    lengths = torch.tensor([len(row) for row in rows])
    thresholds = torch.tensor([value for row in rows for value in row], dtype=torch.float32)
    table = buckets.threshold_table(thresholds, lengths)
    generator = torch.Generator().manual_seed(11)
    block = torch.randn(len(rows), 300, generator=generator) * 3
    specials = torch.tensor([0.5, 0.0, 0.001, 0.0015, 1000.0, -2.0, float("inf"), float("-inf"), far, -far])
    block[:, : specials.numel()] = specials

    def run():
        counts, sums = table.zeros(), table.zeros()
        index = torch.empty(block.shape, dtype=table.index_dtype)
        buckets.bucket_stats(block, table, counts, sums, index)
        return counts, sums, index.to(torch.int64)

    native, by_torch = native_and_torch(run)
    for got, expected in zip(native, by_torch, strict=True):  # -inf meets a finite score: NaN-free sums
        torch.testing.assert_close(got, expected, rtol=0, atol=0, equal_nan=True)
    index = native[2]
    assert index[0, 0] == 0 and index[0, 4] == 7 and index[0, 6] == 7  # on the equal thresholds: above none
    assert index[1, :5].tolist() == [7, 0, 5, 6, 7]  # 0.5; on the crowded 0.0s; on 0.001; between; on 1000
    assert index[3].max() == 0 and index[4, 8] == 1 and index[4, 6] == 2  # no thresholds; on far; +inf


def test_each_row_is_searched_at_its_own_depth_in_buffers_of_its_own_size():
    """One user with 20,000 thresholds among light ones: every row gets 2^m entries for its own length (not the
    heaviest row's), the table's sorted rows and the order of its thresholds are right, and the per-row suffix and
    prefix sums equal a loop over the rows."""
    generator = torch.Generator().manual_seed(3)
    lengths = torch.tensor([3, 20_000, 0, 300, 1, 4])
    thresholds = torch.randn(int(lengths.sum()), generator=generator)
    table = buckets.threshold_table(thresholds, lengths)
    assert table.depth.tolist() == [2, 15, 0, 9, 1, 3]
    assert table.values.numel() == 4 + 2**15 + 1 + 512 + 2 + 8  # against 6 x 2^15 for one depth a batch
    assert table.zeros().numel() == table.values.numel() and table.index_dtype == torch.int16
    offsets = (torch.cumsum(lengths, 0) - lengths).tolist()
    per_bucket = table.zeros()  # a score can fall in buckets 0..lengths[r] of row r only
    per_bucket[table.buckets_at] = torch.randn(table.buckets_at.numel(), generator=generator, dtype=torch.float64)
    per_threshold = torch.randn(int(lengths.sum()), generator=generator, dtype=torch.float64)
    above, below = table.above(per_bucket), table.below(per_threshold)
    for row, (offset, length) in enumerate(zip(offsets, lengths.tolist(), strict=True)):
        start, width = int(table.start[row]), 1 << int(table.depth[row])
        mine = thresholds[offset : offset + length]
        row_values = table.values[start : start + width]
        assert torch.equal(row_values[:length], torch.sort(mine).values)
        assert bool(torch.isinf(row_values[length:]).all())
        assert torch.equal(thresholds[table.order[offset : offset + length]], row_values[:length])
        buckets_of_row = per_bucket[start : start + length + 1]
        for j in range(length):
            torch.testing.assert_close(above[offset + j], buckets_of_row[j + 1 :].sum(), rtol=1e-12, atol=1e-12)
        for k in range(length + 1):
            expected = per_threshold[offset : offset + k].sum()
            torch.testing.assert_close(below[start + k], expected, rtol=1e-12, atol=1e-12)
    assert sorted(table.buckets_at.tolist()) == sorted(
        int(table.start[row]) + k for row in range(len(lengths)) for k in range(int(lengths[row]) + 1)
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_and_torch_paths_give_bit_equal_losses_and_gradients(dtype):
    """The user-major Rankmax over chunked float32 / bf16 scores (several blocks), one user holding most of the
    positives: the native kernel and the torch path give the same loss and gradients, bit for bit."""
    needs_native()
    users, n = 6, 700
    mask, _, _ = user_positives(users, n, seed=9)
    mask[4] = torch.rand(n, generator=torch.Generator().manual_seed(2)) < 0.9  # the heavy user
    lists = [row.nonzero().squeeze(1) for row in mask]
    indptr, items = torch.tensor([0] + [len(x) for x in lists]).cumsum(0), torch.cat(lists)
    u, v = factors(users, n, 8, torch.float32, seed=8)
    native, by_torch = native_and_torch(
        lambda: loss_and_grads(
            lambda u, v: rankmax_shared_catalog_loss(ChunkedScores(u, v, 128, dtype), indptr, items, 0.7), u, v
        )
    )
    for got, expected in zip(native, by_torch, strict=True):
        torch.testing.assert_close(got, expected, rtol=0, atol=0)


@pytest.mark.parametrize("native", ["1", "0"])
def test_a_nan_score_or_threshold_raises_the_same_error_on_both_paths(native, monkeypatch):
    """A NaN score has no bucket: the native kernel (which would otherwise put it in bucket 0) and the torch path
    (whose searchsorted puts it past the last bucket) raise the same ValueError; a NaN threshold is refused when the
    table is made."""
    monkeypatch.setenv("BIGRANK_NATIVE", native)
    if native == "1":
        needs_native()
    lengths = torch.tensor([3, 1])
    table = buckets.threshold_table(torch.tensor([0.1, -0.2, 0.3, 0.0]), lengths)
    for dtype in (torch.float32, torch.bfloat16):
        for nan_at in ((1, 33), (0, 3)):  # past the 16-wide part of a row, and inside it
            block = torch.zeros(2, 40, dtype=dtype)
            block[nan_at] = float("nan")
            counts, sums = table.zeros(), table.zeros()
            index = torch.empty(2, 40, dtype=table.index_dtype)
            with pytest.raises(ValueError, match="the scores hold NaN, which has no bucket"):
                buckets.bucket_stats(block, table, counts, sums, index)
        # +inf and -inf in one bucket (a row without thresholds) make its sum NaN, but no score is NaN: no error.
        empty = buckets.threshold_table(torch.tensor([0.5]), torch.tensor([1, 0]))
        block = torch.zeros(2, 40, dtype=dtype)
        block[1, 0], block[1, 39] = float("inf"), float("-inf")
        counts, sums = empty.zeros(), empty.zeros()
        buckets.bucket_stats(block, empty, counts, sums, torch.empty(2, 40, dtype=empty.index_dtype))
        row = int(empty.start[1])
        assert counts[row] == 40 and bool(torch.isnan(sums[row]))
    with pytest.raises(ValueError, match="thresholds hold NaN"):
        buckets.threshold_table(torch.tensor([0.1, float("nan"), 0.3, 0.0]), lengths)
