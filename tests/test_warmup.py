"""LossWarmupWrapper: phase switch, linear blend, geometric temperature decay, resumable schedule."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from bigrank.losses.sampled import SampledSoftmaxLoss
from bigrank.losses.softrank import SmoothAPLoss
from bigrank.losses.warmup import LossWarmupWrapper


def make_batch():
    gen = torch.Generator().manual_seed(0)
    scores = torch.randn(4, 30, generator=gen, dtype=torch.float64)
    labels = torch.rand(4, 30, generator=gen) < 0.2
    labels[:, 0] = True
    return scores, labels


class CountingLoss(nn.Module):
    """A real loss (sampled softmax) that counts how often it is evaluated."""

    def __init__(self):
        super().__init__()
        self.inner = SampledSoftmaxLoss()
        self.calls = 0

    def forward(self, *args, **kwargs):
        self.calls += 1
        return self.inner(*args, **kwargs)


def test_temperature_schedule_is_geometric_from_the_end_of_warmup():
    main = SmoothAPLoss()
    wrapper = LossWarmupWrapper(
        CountingLoss(), main, warmup_steps=10, temp_start=0.5, temp_end=0.02, temp_decay_steps=100
    )
    assert main.temperature == 0.5 and wrapper.in_warmup
    seen = {}
    for step in range(1, 131):
        wrapper.step()
        seen[step] = main.temperature
    assert seen[10] == pytest.approx(0.5)
    assert seen[60] == pytest.approx(math.sqrt(0.5 * 0.02))  # half-way: geometric mean
    assert seen[35] == pytest.approx(0.5 * (0.02 / 0.5) ** 0.25)
    assert seen[110] == pytest.approx(0.02) and seen[130] == pytest.approx(0.02)  # held at the end
    assert all(seen[s + 1] <= seen[s] for s in range(1, 130))
    assert wrapper.current_temperature == main.temperature
    wrapper.step(global_step=5)  # jumping back (e.g. a restart at a given step) re-derives the temperature
    assert main.temperature == 0.5 and wrapper.global_step == 5


def test_phases_and_linear_blend_use_the_right_losses():
    scores, labels = make_batch()
    warm, main = CountingLoss(), SmoothAPLoss()
    wrapper = LossWarmupWrapper(
        warm, main, warmup_steps=2, blend_steps=3, temp_start=0.3, temp_end=0.1, temp_decay_steps=4
    )
    warm_value = SampledSoftmaxLoss()(scores, labels)
    expected_weights = [0.0, 0.0, 0.25, 0.5, 0.75, 1.0, 1.0]
    for step, weight in enumerate(expected_weights):
        assert wrapper.global_step == step and wrapper.main_weight == pytest.approx(weight)
        calls_before = warm.calls
        loss = wrapper(scores, labels)
        main_value = SmoothAPLoss(temperature=wrapper.temperature_at(step))(scores, labels)
        torch.testing.assert_close(loss, (1 - weight) * warm_value + weight * main_value)
        assert warm.calls - calls_before == (1 if weight < 1 else 0)  # the warm-up loss is skipped once done
        wrapper.step()


def test_state_dict_resumes_the_schedule():
    def build():
        return LossWarmupWrapper(CountingLoss(), SmoothAPLoss(), warmup_steps=3, temp_decay_steps=50, blend_steps=2)

    original = build()
    for _ in range(20):
        original.step()
    state = original.state_dict()
    resumed = build()
    assert resumed.global_step == 0 and resumed.current_temperature == 0.5
    resumed.load_state_dict(state)
    assert resumed.global_step == 20 and resumed.current_temperature == original.current_temperature
    original.step()
    resumed.step()
    assert resumed.current_temperature == original.current_temperature
    torch.save(state, buffer := __import__("io").BytesIO())
    buffer.seek(0)
    again = build()
    again.load_state_dict(torch.load(buffer, weights_only=False))
    assert again.global_step == 20


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(warmup_steps=-1), "warmup_steps"),
        (dict(blend_steps=1.5), "blend_steps"),
        (dict(temp_start=0.0), "temp_start"),
        (dict(temp_end=float("nan")), "temp_end"),
        (dict(temp_decay_steps=0), "temp_decay_steps"),
    ],
)
def test_bad_arguments_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LossWarmupWrapper(CountingLoss(), SmoothAPLoss(), **kwargs)


def test_main_loss_without_temperature_is_rejected():
    with pytest.raises(ValueError, match="no 'temperature'"):
        LossWarmupWrapper(CountingLoss(), nn.MSELoss())
