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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("longest", [5, 40_000])
def test_native_buckets_equal_searchsorted(dtype, longest):
    """The native kernel's buckets, counts and sums equal ``torch.searchsorted``'s and ``scatter_add_``'s, ties
    included (scores equal to a threshold are not above it); past 32,767 thresholds a row the index is int32."""
    if not buckets.native_available():
        pytest.skip("no C compiler here: the torch path is the only one")
    generator = torch.Generator().manual_seed(7)
    rows, cols = 3, 1000 + 13  # a tail that is not a multiple of 16
    block = torch.randn(rows, cols, generator=generator).to(dtype)
    lengths = torch.tensor([longest, 0, min(longest, 3)])
    thresholds = torch.randn(int(lengths.sum()), generator=generator).to(dtype).float()
    thresholds[:2] = block[0, :2].float()  # exact ties
    table, _, m = buckets.threshold_table(thresholds, lengths)
    results = []
    for native in ("1", "0"):
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("BIGRANK_NATIVE", native)
            counts = torch.zeros(rows, 1 << m, dtype=torch.float64)
            sums = torch.zeros_like(counts)
            index = torch.empty(rows, cols + 4, dtype=buckets.index_dtype(1 << m))[:, 2 : 2 + cols]  # a slice
            buckets.bucket_stats(block, table, m, counts, sums, index)
            prefix = torch.randn(rows, 1 << m, generator=torch.Generator().manual_seed(1))
            results.append((counts, sums, index.to(torch.int64), buckets.bucket_gather(index, prefix, m)))
    assert results[0][2].dtype == torch.int64 and buckets.index_dtype(1 << m) == (
        torch.int16 if longest < 1 << 15 else torch.int32
    )
    torch.testing.assert_close(results[0][0], results[1][0], rtol=0, atol=0)
    torch.testing.assert_close(results[0][1], results[1][1], rtol=1e-12, atol=1e-9)
    torch.testing.assert_close(results[0][2], results[1][2], rtol=0, atol=0)
    torch.testing.assert_close(results[0][3], results[1][3], rtol=0, atol=0)
    assert int(results[0][2][1].max()) == 0  # a row without thresholds: every score in bucket 0
