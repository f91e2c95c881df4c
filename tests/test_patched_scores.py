"""``PatchedScores`` (``bigrank.losses.scores``): a score source plus a sparse patch. Every full-catalog loss, row-wise
and user-major, on 1, 2 and 3 ranks, must give the loss and gradients of the dense matrix ``U V^T + patch``, with
the patch values' gradient the score gradient at their entries (float64, finite differences as the reference of
the reference)."""

from __future__ import annotations

import pytest
import torch

from bigrank.losses import rankmax_loss, softmax_loss
from bigrank.losses.scores import ChunkedScores, PatchedScores, score_matrix
from bigrank.losses.shared import rankmax_shared_catalog_loss, softmax_shared_catalog_loss
from tests.distributed_utils import run_distributed
from tests.test_distributed_catalog import uneven_bounds
from tests.test_shared_catalog_losses import factors, user_positives

SHARED = {
    "rankmax": lambda s, p, i, **kw: rankmax_shared_catalog_loss(s, p, i, 0.7, "sum", **kw),
    "softmax": lambda s, p, i, **kw: softmax_shared_catalog_loss(s, p, i, "sum", temperature=0.5, **kw),
}
ROW_WISE = {
    "rankmax-k3": lambda s, y, **kw: rankmax_loss(s, y, k=3, margin=0.7, reduction="sum", **kw),
    "softmax": lambda s, y, **kw: softmax_loss(s, y, reduction="sum", temperature=0.5, **kw),
}


def patch_entries(users: int, n: int, seed: int = 2):
    """rows, columns, values float64 of a patch with repeated places (two entries at one score add up)."""
    generator = torch.Generator().manual_seed(seed)
    rows = torch.randint(0, users, (30,), generator=generator)
    columns = torch.randint(0, n, (30,), generator=generator)
    rows[1], columns[1] = rows[0], columns[0]
    values = torch.randn(30, generator=generator, dtype=torch.float64)
    return rows, columns, values


def dense(u, v, rows, columns, values):
    return (u @ v.T).index_put((rows, columns), values, accumulate=True)


def grads(fn, *tensors):
    tensors = [t.clone().requires_grad_() for t in tensors]
    loss = fn(*tensors)
    return (loss.detach(), *torch.autograd.grad(loss, tensors))


@pytest.mark.parametrize("name", SHARED)
@pytest.mark.parametrize("chunk_size", [None, 6])
def test_shared_losses_read_the_patched_scores(name, chunk_size):
    users, n = 6, 40
    _, indptr, items = user_positives(users, n)
    u, v = factors(users, n, 5, torch.float64)
    rows, columns, values = patch_entries(users, n)
    shared = SHARED[name]

    def patched(u, v, values):
        return shared(PatchedScores(_source(u, v, chunk_size), rows, columns, values), indptr, items)

    got = grads(patched, u, v, values)
    expected = grads(lambda u, v, values: shared(dense(u, v, rows, columns, values), indptr, items), u, v, values)
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("name", ROW_WISE)
def test_row_wise_losses_read_the_patched_scores(name):
    """Rankmax k = 3 reads the rows' top k in a second pass over a subset of rows (``blocks(rows)``)."""
    users, n = 7, 33
    u, v = factors(users, n, 4, torch.float64, seed=8)
    rows, columns, values = patch_entries(users, n, seed=9)
    target = torch.tensor([0, 5, 7, 3, 32, 1, 5])
    loss = ROW_WISE[name]
    got = grads(lambda u, v, w: loss(PatchedScores(ChunkedScores(u, v, 5), rows, columns, w), target), u, v, values)
    expected = grads(lambda u, v, w: loss(dense(u, v, rows, columns, w), target), u, v, values)
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def test_patch_gradient_matches_finite_differences():
    users, n = 3, 9
    _, indptr, items = user_positives(users, n, seed=4)
    u, v = factors(users, n, 3, torch.float64, seed=5)
    rows, columns, values = patch_entries(users, n, seed=6)
    values = values.clone().requires_grad_()
    torch.autograd.gradcheck(
        lambda w: SHARED["softmax"](PatchedScores(ChunkedScores(u, v, 4), rows, columns, w), indptr, items),
        (values,),
    )


def test_gather_and_blocks_agree_in_low_precision():
    """A patched score read by ``gather_columns`` is the very number its block holds (bf16: the Rankmax
    thresholds are compared with the block scores)."""
    users, n = 4, 50
    u, v = factors(users, n, 8, torch.float32, seed=3)
    rows, columns, values = patch_entries(users, n, seed=7)
    source = PatchedScores(score_matrix(u, v, 16, dtype=torch.bfloat16), rows, columns, values.float())
    full = torch.cat([block for _, block in source.blocks()], dim=1)
    every_row = torch.arange(users).repeat_interleave(n)
    every_column = torch.arange(n).repeat(users)
    assert torch.equal(source.gather_columns(every_column, rows=every_row), full.reshape(-1))


def test_bad_patches_are_refused():
    u, v = factors(2, 8, 3, torch.float64)
    base = ChunkedScores(u, v[:5], 2)
    with pytest.raises(ValueError, match="one length"):
        PatchedScores(base, torch.tensor([0, 1]), torch.tensor([0]), torch.zeros(2))
    with pytest.raises(ValueError, match=r"columns must lie in \[0, 5\)"):
        PatchedScores(base, torch.tensor([0]), torch.tensor([5]), torch.zeros(1))
    with pytest.raises(ValueError, match=r"rows must lie in \[0, 2\)"):
        PatchedScores(base, torch.tensor([2]), torch.tensor([0]), torch.zeros(1))
    nan = PatchedScores(base, torch.tensor([1]), torch.tensor([0]), torch.tensor([float("nan")], dtype=torch.float64))
    with pytest.raises(ValueError, match="NaN or infinite"):
        rankmax_shared_catalog_loss(nan, torch.tensor([0, 1, 2]), torch.tensor([1, 2]))


def _source(u, v, chunk_size):
    return ChunkedScores(u, v, chunk_size) if chunk_size else score_matrix(u, v)


def _item_parallel_body(rank, world_size, group, name, u, v, indptr, items, patch, bounds):
    start, stop = bounds[rank]
    rows, columns, values = patch
    mine = (columns >= start) & (columns < stop)
    u, local_v = u.clone().requires_grad_(), v[start:stop].clone().requires_grad_()
    local_values = values[mine].clone().requires_grad_()
    source = PatchedScores(ChunkedScores(u, local_v, 4), rows[mine], columns[mine] - start, local_values)
    loss = SHARED[name](source, indptr, items, group=group, offset=start)
    grad_u, grad_v, grad_values = torch.autograd.grad(loss, (u, local_v, local_values))
    return loss.detach(), grad_u, grad_v, grad_values, mine


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("name", SHARED)
def test_item_parallel_patched_loss_equals_single_process(world_size, name):
    """Each rank patches the entries of its own columns: the loss of the whole patched matrix, each rank's rows'
    and patch entries' gradients, and its shard's part of the user gradient."""
    users, n = 6, 41
    _, indptr, items = user_positives(users, n, seed=5)
    u, v = factors(users, n, 4, torch.float64, seed=6)
    patch = patch_entries(users, n, seed=7)
    bounds = uneven_bounds(n, world_size)
    results = run_distributed(_item_parallel_body, world_size, (name, u, v, indptr, items, patch, bounds))
    shared = SHARED[name]
    loss, grad_u, grad_v, grad_values = grads(
        lambda u, v, w: shared(dense(u, v, *patch[:2], w), indptr, items), u, v, patch[2]
    )
    for rank, (got_loss, _, got_v, got_values, mine) in enumerate(results):
        start, stop = bounds[rank]
        torch.testing.assert_close(got_loss, loss, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(got_v, grad_v[start:stop], rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(got_values, grad_values[mine], rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(sum(result[1] for result in results), grad_u, rtol=1e-10, atol=1e-10)
