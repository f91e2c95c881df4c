"""Soft-rank losses over the whole catalog through the chunked engine equal the dense candidate losses with
one-hot labels (values and gradients w.r.t. user vectors and items), chunked or not, one process or an
item-parallel group of 2 or 3 gloo processes with uneven shards."""

from __future__ import annotations

import pytest
import torch

from bigrank.losses.scores import ChunkedScores
from bigrank.losses.softrank import pauc_at_budget_loss, recall_at_quantile_loss, smooth_ap_loss
from bigrank.losses.softrank_catalog import (
    pauc_at_budget_catalog_loss,
    recall_at_quantile_catalog_loss,
    smooth_ap_catalog_loss,
)
from tests.distributed_utils import run_distributed

BATCH, ITEMS, DIM = 7, 53, 4
CASES = {
    "smooth_ap": (smooth_ap_loss, smooth_ap_catalog_loss, {"temperature": 0.3}),
    "recall_at_quantile": (recall_at_quantile_loss, recall_at_quantile_catalog_loss, {"quantile": 0.1}),
    "pauc_iqr": (
        pauc_at_budget_loss,
        pauc_at_budget_catalog_loss,
        {"beta": 0.2, "n_knots": 3, "scale_sample_size": 16},
    ),
    "pauc_band": (pauc_at_budget_loss, pauc_at_budget_catalog_loss, {"beta": 0.3, "tau_scale": "band"}),
}


def _inputs(seed=0):
    generator = torch.Generator().manual_seed(seed)
    users = torch.randn(BATCH, DIM, generator=generator, dtype=torch.float64)
    items = torch.randn(ITEMS, DIM, generator=generator, dtype=torch.float64)
    target = torch.randint(0, ITEMS, (BATCH,), generator=generator)
    return users, items, target


def _dense_reference(dense_fn, params, users, items, target):
    u, v = users.clone().requires_grad_(), items.clone().requires_grad_()
    scores = u @ v.T
    labels = torch.zeros(BATCH, ITEMS, dtype=torch.bool)
    labels[torch.arange(BATCH), target] = True
    loss = dense_fn(scores, labels, **params)
    loss.backward()
    return loss.detach(), u.grad, v.grad


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("chunk", [None, 5])
def test_catalog_loss_equals_the_dense_candidate_loss(case, chunk):
    dense_fn, catalog_fn, params = CASES[case]
    users, items, target = _inputs(1)
    expected, grad_u, grad_v = _dense_reference(dense_fn, params, users, items, target)
    u, v = users.clone().requires_grad_(), items.clone().requires_grad_()
    scores = u @ v.T if chunk is None else ChunkedScores(u, v, chunk)
    loss = catalog_fn(scores, target, **params)
    loss.backward()
    torch.testing.assert_close(loss, expected)
    torch.testing.assert_close(u.grad, grad_u)
    torch.testing.assert_close(v.grad, grad_v)


def _body(rank, world_size, group, case, users, items, target, bounds):
    from bigrank.distributed.collectives import all_reduce_sum

    _, catalog_fn, params = CASES[case]
    start, stop = bounds[rank]
    u, v = users.clone().requires_grad_(), items[start:stop].clone().requires_grad_()
    loss = catalog_fn(ChunkedScores(u, v, 4), target, group=group, offset=start, **params)
    loss.backward()
    return float(loss), all_reduce_sum(u.grad, group), v.grad


@pytest.mark.parametrize("case", list(CASES))
def test_item_parallel_catalog_loss_equals_one_process(case):
    dense_fn, _, params = CASES[case]
    users, items, target = _inputs(2)
    target[0] = 3  # a row whose positive sits in the first (short) shard
    expected, grad_u, grad_v = _dense_reference(dense_fn, params, users, items, target)
    bounds = [(0, 9), (9, 30), (30, ITEMS)]
    results = run_distributed(_body, 3, args=(case, users, items, target, bounds))
    for (loss, got_u, got_v), (start, stop) in zip(results, bounds, strict=True):
        assert loss == pytest.approx(float(expected), rel=1e-10)
        torch.testing.assert_close(got_u, grad_u)
        torch.testing.assert_close(got_v, grad_v[start:stop])
