"""Learning-rate schedule, user L2 and softmax temperature: the schedule's factors against the formulas written
out step by step; the trainer applies the factor to BOTH optimisers (a warm-up step at half rate equals a plain
step at half the rate, for the catalog and for the fused user table); the user L2 term moves exactly the rows
of the batch, each by -lr * 2 * user_l2 * count / B times itself (sgd), through the fused table; the softmax
temperature equals cross-entropy of scores / T, chunked or not."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from bigrank.config import ConfigError, config_from_dict
from bigrank.train.schedule import LearningRateSchedule
from tests.conftest import tiny_config


def _expected(step, total, warmup, decay, final):
    if step < warmup:
        return (step + 1) / warmup
    if decay == "none":
        return 1.0
    p = (step - warmup) / (total - warmup)
    shape = 1 - p if decay == "linear" else (1 + math.cos(math.pi * p)) / 2
    return final + (1 - final) * shape


@pytest.mark.parametrize("decay", ["none", "linear", "cosine"])
def test_schedule_factors_follow_the_formulas(decay):
    schedule = LearningRateSchedule(total_steps=12, warmup_steps=3, decay=decay, final_ratio=0.1)
    factors = [schedule.factor(t) for t in range(12)]
    assert factors == pytest.approx([_expected(t, 12, 3, decay, 0.1) for t in range(12)])
    assert factors[:3] == pytest.approx([1 / 3, 2 / 3, 1.0])  # warm-up: the first update is not a zero step
    assert factors[3] == pytest.approx(1.0)
    if decay != "none":
        assert all(a > b for a, b in zip(factors[3:], factors[4:], strict=False))  # strictly decreasing
        assert factors[-1] > 0.1  # approaches final_ratio, never below
    assert LearningRateSchedule(5).constant and not LearningRateSchedule(5, decay="cosine").constant


def test_schedule_and_l2_settings_are_checked():
    with pytest.raises(ValueError, match="decay"):
        LearningRateSchedule(10, decay="step")
    with pytest.raises(ValueError, match="final_ratio"):
        LearningRateSchedule(10, decay="linear", final_ratio=1.5)
    base = {"data": {"root": "d"}, "run_dir": "r"}
    for key, value, message in [
        ("lr_decay", "exp", "optim.lr_decay"),
        ("lr_final_ratio", -0.1, "optim.lr_final_ratio"),
        ("lr_warmup_steps", -1, "optim.lr_warmup_steps"),
        ("user_l2", -1.0, "optim.user_l2"),
    ]:
        with pytest.raises(ConfigError, match=message):
            config_from_dict({**base, "optim": {key: value}})


def test_softmax_temperature_is_cross_entropy_of_scaled_scores():
    from bigrank.losses import softmax_loss
    from bigrank.losses.registry import parse_params
    from bigrank.losses.scores import ChunkedScores

    generator = torch.Generator().manual_seed(0)
    users = torch.randn(6, 5, generator=generator, dtype=torch.float64, requires_grad=True)
    items = torch.randn(17, 5, generator=generator, dtype=torch.float64, requires_grad=True)
    target = torch.tensor([0, 3, 16, 5, 5, 9])
    for temperature in (0.25, 1.0, 3.0):
        reference = torch.nn.functional.cross_entropy((users @ items.T) / temperature, target)
        ref_grads = torch.autograd.grad(reference, (users, items))
        for scores in (users @ items.T, ChunkedScores(users, items, 4)):
            loss = softmax_loss(scores, target, temperature=temperature)
            grads = torch.autograd.grad(loss, (users, items))
            torch.testing.assert_close(loss, reference)
            for grad, ref in zip(grads, ref_grads, strict=True):
                torch.testing.assert_close(grad, ref)
    with pytest.raises(ValueError, match="temperature"):
        softmax_loss(users @ items.T, target, temperature=0.0)
    assert parse_params("softmax", {}, "loss.params") == {"temperature": 1.0}


# ------------------------------------------------------------------------------------- through the trainer
RUN = {
    "loss": {"name": "softmax"},
    "optim": {"user_optimizer": "sgd", "item_optimizer": "sgd", "user_lr": 0.2, "item_lr": 0.2},
    "train": {"batch_size": 64, "max_steps": 1},
    "eval": {"every_epochs": None, "at_end": False},
}


def _config(root, run_dir, **optim):
    return tiny_config(root, run_dir, RUN, optim=optim)


def _parameters(checkpoint):
    """(catalog [n, d], user table [users, d]) of a trainer checkpoint."""
    from tests.conftest import checkpoint_parameters

    return checkpoint_parameters(checkpoint)[:2]


def _train_each(configs):
    from bigrank.train.workers import train_worker

    return [train_worker(config) for config in configs]


def test_the_trainer_applies_the_schedule_to_both_optimisers_and_the_user_l2_to_the_batch_rows(tiny_dataset, tmp_path):
    from bigrank.train.launcher import launch_local

    user_l2 = 0.5
    configs = {
        "plain": _config(tiny_dataset, tmp_path / "plain"),
        "half_rate": _config(tiny_dataset, tmp_path / "half_rate", user_lr=0.1, item_lr=0.1),
        "warmup": _config(tiny_dataset, tmp_path / "warmup", lr_warmup_steps=2, lr_decay="cosine"),
        "l2": _config(tiny_dataset, tmp_path / "l2", user_l2=user_l2),
    }
    launch_local(_train_each, 2, (list(configs.values()),), timeout=300)
    params = {name: _parameters(tmp_path / name / "checkpoints" / "step-00000001") for name in configs}
    catalog0 = params["plain"][0]

    # One warm-up step of 2 runs at half the rate: the same update as a plain step at half the rate, on the
    # catalog (torch optimizer) and on the user table (fused fbgemm optimizer); not the full-rate update.
    torch.testing.assert_close(params["warmup"][0], params["half_rate"][0])
    torch.testing.assert_close(params["warmup"][1], params["half_rate"][1])
    assert not torch.allclose(params["warmup"][1], params["plain"][1])
    assert not torch.allclose(params["warmup"][0], catalog0)
    with open(tmp_path / "warmup" / "metrics.jsonl") as handle:
        record = next(line for line in handle if '"train"' in line)
    assert '"lr": 0.1' in record and '"user_lr": 0.1' in record

    # L2: same batch, same loss gradient; the difference of the user tables is the L2 part of the sgd step:
    # row u moves by -lr * 2 * user_l2 * n_u / B * w0_u, n_u = the row's occurrences in the batch (B = 64).
    from bigrank.model.towers import USER_TABLE, deterministic_rows

    num_users, dim = params["plain"][1].shape
    initial = deterministic_rows(3, USER_TABLE, num_users, dim, 0, num_users, dim**-0.5)
    delta = (params["l2"][1] - params["plain"][1]).double()
    unit = 0.2 * 2 * user_l2 / 64
    counts = -(delta * initial.double()).sum(1) / initial.double().pow(2).sum(1) / unit
    assert np.allclose(counts.numpy(), np.round(counts.numpy()), atol=1e-3)  # whole occurrences
    assert int(np.round(counts.numpy()).sum()) == 64 and counts.min() > -1e-3  # the 64 rows of the batch
    torch.testing.assert_close(delta, -unit * torch.round(counts)[:, None] * initial.double(), atol=1e-6, rtol=0)
    torch.testing.assert_close(params["l2"][0], catalog0)  # the catalog's step is untouched by the user L2
