"""RowOptimizer: dense steps equal torch.optim's, sparse (touched-row) steps equal dense ones where the two
agree by definition, lazy Adam equals dense Adam run on each row's own gradients, state round-trips."""

from __future__ import annotations

from functools import partial

import pytest
import torch

from bigrank.train.item_optim import RowOptimizer

ROWS, DIM, STEPS = 50, 6, 5


def _grads(seed, touched_per_step=7):
    """Per step: (unique touched rows int64[u], their gradients [u, d], the same as a dense [ROWS, d] gradient)."""
    generator = torch.Generator().manual_seed(seed)
    steps = []
    for _ in range(STEPS):
        ids = torch.randperm(ROWS, generator=generator)[:touched_per_step].sort().values
        values = torch.randn(ids.numel(), DIM, generator=generator)
        dense = torch.zeros(ROWS, DIM)
        dense[ids] = values
        steps.append((ids, values, dense))
    return steps


def _weight(seed=0):
    return torch.randn(ROWS, DIM, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize(
    ("name", "torch_optimizer", "decay"),
    [
        ("sgd", torch.optim.SGD, 0.0),
        ("sgd", torch.optim.SGD, 0.1),
        ("adagrad", torch.optim.Adagrad, 0.0),
        ("adagrad", torch.optim.Adagrad, 0.1),
        ("adam", partial(torch.optim.Adam, fused=True), 0.0),
        ("adam", partial(torch.optim.Adam, fused=True), 0.1),
    ],
)
def test_dense_steps_equal_torch_optim(name, torch_optimizer, decay):
    """Dense Adam steps (every row at one count) run torch's fused kernel: equal to torch.optim.Adam(fused=True)."""
    reference = torch.nn.Parameter(_weight())
    expected = torch_optimizer([reference], lr=0.05, weight_decay=decay)
    ours = torch.nn.Parameter(_weight())
    optimizer = RowOptimizer(ours, name, 0.05, weight_decay=decay)
    for _, _, dense in _grads(1):
        reference.grad = dense.clone()
        expected.step()
        optimizer.step_dense(dense.clone())
    torch.testing.assert_close(ours.detach(), reference.detach(), rtol=0, atol=0)
    if name != "sgd":
        torch_state = expected.state_dict()["state"][0]
        for key, value in optimizer.row_state().items():
            if key in torch_state:
                torch.testing.assert_close(value, torch_state[key], rtol=0, atol=0)


@pytest.mark.parametrize("name", ["sgd", "adagrad", "rowwise_adagrad"])
def test_sparse_steps_equal_dense_steps_without_decay(name):
    dense_weight, sparse_weight = _weight(), _weight()
    dense = RowOptimizer(dense_weight, name, 0.1)
    sparse = RowOptimizer(sparse_weight, name, 0.1)
    for ids, values, full in _grads(2):
        dense.step_dense(full)
        sparse.step_rows(ids, values)
    torch.testing.assert_close(sparse_weight, dense_weight, rtol=1e-6, atol=1e-7)
    for key, value in sparse.row_state().items():
        torch.testing.assert_close(value, dense.row_state()[key], rtol=1e-6, atol=1e-7)
    assert sparse.step_count == dense.step_count == STEPS


def test_sparse_weight_decay_touches_only_the_rows_it_updates():
    weight = _weight()
    before = weight.clone()
    optimizer = RowOptimizer(weight, "adagrad", 0.1, weight_decay=0.5)
    ids = torch.tensor([3, 17])
    optimizer.step_rows(ids, torch.ones(2, DIM))
    untouched = torch.ones(ROWS, dtype=torch.bool)
    untouched[ids] = False
    assert torch.equal(weight[untouched], before[untouched])
    assert torch.equal(optimizer.state["sum"][untouched], torch.zeros(ROWS - 2, DIM))
    # The touched rows decayed: gradient 1 + 0.5 w, Adagrad's first step moves by lr * sign(g).
    g = 1 + 0.5 * before[ids]
    torch.testing.assert_close(weight[ids], before[ids] - 0.1 * g / (g.abs() + 1e-10))


def test_rowwise_adagrad_keeps_one_accumulator_per_row():
    weight = _weight()
    before = weight.clone()
    optimizer = RowOptimizer(weight, "rowwise_adagrad", 0.1)
    grads = torch.randn(2, DIM, generator=torch.Generator().manual_seed(5))
    optimizer.step_rows(torch.tensor([4, 9]), grads)
    assert optimizer.row_state()["sum"].shape == (ROWS,)
    accumulator = grads.square().mean(dim=1)
    torch.testing.assert_close(optimizer.state["sum"][[4, 9]], accumulator)
    torch.testing.assert_close(weight[[4, 9]], before[[4, 9]] - 0.1 * grads / (accumulator.sqrt() + 1e-8)[:, None])


def test_lazy_adam_equals_dense_adam_on_each_rows_own_gradients():
    weight = _weight()
    optimizer = RowOptimizer(weight, "adam", 0.05)
    steps = _grads(3, touched_per_step=20)
    for ids, values, _ in steps:
        optimizer.step_rows(ids, values)
    for row in range(ROWS):
        reference = torch.nn.Parameter(_weight()[row].clone())
        adam = torch.optim.Adam([reference], lr=0.05)
        touched = 0
        for ids, values, _ in steps:
            hit = (ids == row).nonzero()
            if hit.numel():
                reference.grad = values[int(hit)].clone()
                adam.step()
                touched += 1
        torch.testing.assert_close(weight[row], reference.detach(), rtol=1e-5, atol=1e-6)  # float32 pow
        assert int(optimizer.state["row_step"][row]) == touched


def test_state_dict_round_trip_and_torch_checkpoints_load():
    weight = _weight()
    optimizer = RowOptimizer(weight, "adam", 0.05)
    for ids, values, _ in _grads(4):
        optimizer.step_rows(ids, values)
    restored = RowOptimizer(weight.clone(), "adam", 0.05)
    restored.load_state_dict(optimizer.state_dict())
    assert restored.step_count == STEPS
    for key, value in optimizer.row_state().items():
        assert torch.equal(restored.row_state()[key], value)
    # A torch.optim.Adagrad checkpoint (what the trainer wrote before RowOptimizer) resumes bit for bit.
    reference = torch.nn.Parameter(_weight())
    torch_adagrad = torch.optim.Adagrad([reference], lr=0.1)
    ours = torch.nn.Parameter(_weight())
    steps = _grads(6)
    for _, _, dense in steps[:2]:
        reference.grad = dense.clone()
        torch_adagrad.step()
    ours.data.copy_(reference.detach())
    resumed = RowOptimizer(ours, "adagrad", 0.1)
    resumed.load_state_dict(torch_adagrad.state_dict())
    for _, _, dense in steps[2:]:
        reference.grad = dense.clone()
        torch_adagrad.step()
        resumed.step_dense(dense.clone())
    assert torch.equal(ours.detach(), reference.detach())
    with pytest.raises(ValueError, match="state is for 'adam', this optimizer is 'adagrad'"):
        RowOptimizer(_weight(), "adagrad", 0.1).load_state_dict(optimizer.state_dict())


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="must be one of sgd, adagrad, rowwise_adagrad, adam"):
        RowOptimizer(_weight(), "lbfgs", 0.1)
    optimizer = RowOptimizer(_weight(), "sgd", 0.1)
    with pytest.raises(ValueError, match=r"grads \[u, 6\]"):
        optimizer.step_rows(torch.tensor([1, 2]), torch.zeros(3, DIM))
