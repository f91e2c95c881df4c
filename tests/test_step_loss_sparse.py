"""Sampled steps read and update only the catalog rows they touch: the fused sampled softmax equals
``sampled_softmax_loss`` on the materialised candidate columns (loss and gradients, one process and two gloo
processes), and several steps of sparse row updates end with the parameters of dense torch.optim steps."""

from __future__ import annotations

from functools import partial

import pytest
import torch

from bigrank.config import LossConfig
from bigrank.data.samplers import candidate_labels
from bigrank.losses.sampled import accidental_hits, sampled_softmax_loss
from bigrank.losses.softrank import smooth_ap_loss
from bigrank.train.item_optim import RowOptimizer
from tests.distributed_utils import run_distributed
from tests.sampled_steps import DIM, NUM_ITEMS, reference_columns, sampled_inputs, sampled_step_loss

_step_loss = partial(sampled_step_loss, seed=7)


def test_accidental_hits_are_every_equal_pair():
    target = torch.tensor([3, 5, 3, 9])
    negatives = torch.tensor([5, 3, 3, 1, 5])
    rows, cols = accidental_hits(target, negatives)
    pairs = sorted(zip(rows.tolist(), cols.tolist(), strict=True))
    expected = sorted((b, j) for b in range(4) for j in range(5) if target[b] == negatives[j])
    assert pairs == expected


@pytest.mark.parametrize(("sampler", "temperature"), [("uniform", 1.0), ("popularity", 0.5)])
def test_fused_sampled_softmax_equals_the_materialised_loss(sampler, temperature):
    # 30 negatives from 40 items for 12 rows: accidental hits and repeated negatives are certain.
    users, catalog, target = sampled_inputs(1)
    step_loss = _step_loss("sampled_softmax", sampler=sampler, params={"temperature": temperature})
    weight = catalog.clone()
    u = users.clone().requires_grad_()
    loss = step_loss(u, target, weight, step=3)
    loss.backward()
    touched = step_loss.last_rows
    assert weight.grad is None and touched.rows.shape == (touched.ids.numel(), DIM)
    assert torch.equal(touched.ids, touched.ids.unique())

    ids, labels, mask, log_q = reference_columns(step_loss, target, 3)
    assert bool(labels[:, -step_loss.num_samples :].any())  # an accidental hit among the negatives
    u_ref = users.clone().requires_grad_()
    w_ref = catalog.clone().requires_grad_()
    scores = u_ref @ w_ref[ids].T / temperature
    expected = sampled_softmax_loss(scores, labels, log_q, mask)
    expected.backward()
    torch.testing.assert_close(loss, expected)
    torch.testing.assert_close(u.grad, u_ref.grad)
    dense = torch.zeros_like(catalog).index_add_(0, touched.ids, touched.grad)
    torch.testing.assert_close(dense, w_ref.grad)


def _distributed_body(rank, world_size, group, users, catalog, target):
    from bigrank.distributed.collectives import all_gather_no_grad, all_reduce_sum
    from bigrank.model.catalog import shard_range

    start, stop = shard_range(NUM_ITEMS, rank, world_size)
    step_loss = _step_loss("sampled_softmax", start=start, stop=stop, negatives=24, rank=rank)
    u = users.clone().requires_grad_()
    loss = step_loss(u, target, catalog[start:stop].clone(), group=group, step=5)
    loss.backward()
    touched = step_loss.last_rows
    grad_rows = torch.zeros(stop - start, DIM, dtype=users.dtype).index_add_(0, touched.ids, touched.grad)
    # The reference: every rank's columns concatenated in rank order, one single-process loss.
    ids, labels, mask, log_q = reference_columns(step_loss, target, 5)
    sizes = all_gather_no_grad(torch.tensor([ids.numel()]), group).tolist()
    all_ids = all_gather_no_grad(ids, group)
    all_log_q = all_gather_no_grad(log_q, group)
    all_mask = all_gather_no_grad(mask.T.contiguous(), group).T
    u_ref = users.clone().requires_grad_()
    w_ref = catalog.clone().requires_grad_()
    expected = sampled_softmax_loss(u_ref @ w_ref[all_ids].T, candidate_labels(target, all_ids), all_log_q, all_mask)
    expected.backward()
    return {
        "sizes": sizes,
        "loss": float(loss),
        "expected": float(expected),
        "grad_users": all_reduce_sum(u.grad, group),  # each rank holds the part of its own columns
        "expected_users": u_ref.grad,
        "grad_rows": grad_rows,
        "expected_rows": w_ref.grad[start:stop],
    }


def test_fused_sampled_softmax_two_processes_equal_one_loss_over_all_columns():
    users, catalog, target = sampled_inputs(2)
    results = run_distributed(_distributed_body, 2, args=(users, catalog, target))
    for result in results:
        assert result["loss"] == pytest.approx(result["expected"], rel=1e-12)
        torch.testing.assert_close(result["grad_users"], result["expected_users"])
        torch.testing.assert_close(result["grad_rows"], result["expected_rows"])
    assert results[0]["loss"] == results[1]["loss"]


@pytest.mark.parametrize("loss_name", ["sampled_softmax", "smooth_ap"])
@pytest.mark.parametrize(("optimizer", "torch_optimizer"), [("sgd", torch.optim.SGD), ("adagrad", torch.optim.Adagrad)])
def test_sparse_row_updates_equal_dense_torch_optim_steps(loss_name, optimizer, torch_optimizer):
    """Five steps: StepLoss + RowOptimizer.step_rows against a dense gradient of the same loss (the catalog
    indexed as a whole parameter) + torch.optim; same draws, the same parameters at the end."""
    params = {"temperature": 0.5} if loss_name == "smooth_ap" else {}
    step_loss = _step_loss(loss_name, params=params)
    _, catalog, _ = sampled_inputs(3)
    sparse_weight = torch.nn.Parameter(catalog.clone())
    sparse = RowOptimizer(sparse_weight, optimizer, 0.1)
    dense_weight = torch.nn.Parameter(catalog.clone())
    dense = torch_optimizer([dense_weight], lr=0.1)
    for step in range(5):
        users, _, target = sampled_inputs(10 + step)
        loss = step_loss(users, target, sparse_weight, step=step)
        loss.backward()
        assert sparse_weight.grad is None
        sparse.step_rows(step_loss.last_rows.ids, step_loss.last_rows.grad)

        ids, labels, mask, log_q = reference_columns(step_loss, target, step)
        scores = users @ dense_weight[ids].T
        if loss_name == "sampled_softmax":
            reference = sampled_softmax_loss(scores, labels, log_q, mask)
        else:
            reference = smooth_ap_loss(scores, labels, mask, temperature=0.5)
        torch.testing.assert_close(loss, reference)
        dense.zero_grad()
        reference.backward()
        dense.step()
    torch.testing.assert_close(sparse_weight.detach(), dense_weight.detach(), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize(("loss_name", "batch"), [("sampled_softmax", 512), ("smooth_ap", 512), ("softrank_ndcg", 64)])
def test_a_sampled_steps_gradients_are_the_same_bits_on_every_call(loss_name, batch):
    """The fused sampled softmax, the fused soft-rank losses and the materialised columns (SoftNDCG) take each
    touched row once per draw (``bigrank.train.losses.repeat_rows``): the backward adds a repeated row's gradients
    in the same order every time. 1,024 negatives of 64-d rows from 101 items and 512 positives repeat every row,
    in gathers large enough for torch's parallel backward of ``rows[index]`` (atomic adds, whose order changed from
    call to call: issue 49); 4 threads, so that the adds race even on 2 cores. SoftNDCG's materialised [B, C] columns
    cost B C^2: a smaller batch, whose gather of the candidate columns is still large enough."""
    from bigrank.train.losses import StepLoss

    generator = torch.Generator().manual_seed(0)
    users, catalog = torch.randn(batch, 64, generator=generator), torch.randn(101, 64, generator=generator)
    target = torch.randint(0, 101, (batch,), generator=generator)
    config = LossConfig(name=loss_name, candidates="sampled", num_negatives=1024)
    step_loss = StepLoss(config, num_items=101, shard_start=0, shard_stop=101, seed=7)
    threads = torch.get_num_threads()
    torch.set_num_threads(4)
    try:
        grads = []
        for _ in range(8):
            u = users.clone().requires_grad_()
            step_loss(u, target, catalog, step=3).backward()
            grads.append((step_loss.last_rows.grad, u.grad))
    finally:
        torch.set_num_threads(threads)
    for rows, user_grads in grads[1:]:
        assert torch.equal(rows, grads[0][0]) and torch.equal(user_grads, grads[0][1])
