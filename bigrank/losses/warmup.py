"""Warm-up from an easy loss to a ranking loss, with a geometric temperature schedule (the ``LossWarmupWrapper``
of the ``imbalanced-losses`` package: start the soft-rank loss hot for stable gradients, then sharpen it).

Schedule, as a function of the global step t (the number of optimiser steps taken so far):

* ``t < warmup_steps``: only ``warmup_loss`` (e.g. sampled softmax);
* ``warmup_steps <= t < warmup_steps + blend_steps``: ``(1 - w) * warmup_loss + w * main_loss`` with
  ``w = (t - warmup_steps + 1) / (blend_steps + 1)`` rising linearly towards 1;
* afterwards: only ``main_loss``.

``main_loss.temperature`` follows ``temp_start * (temp_end / temp_start) ** min(1, (t - warmup_steps)^+ /
temp_decay_steps)``: held at ``temp_start`` during warm-up, then decayed geometrically from the moment the main
loss starts to count, and held at ``temp_end`` after ``temp_decay_steps`` steps.

The step counter lives in ``state_dict()`` (under ``_extra_state``), so a run resumed from a checkpoint
continues the schedule where it stopped, with the same temperature.
"""

from __future__ import annotations

import math

from torch import nn

__all__ = ["LossWarmupWrapper"]


def _check_count(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
    return value


def _check_temperature(value, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a positive finite number, got {value!r}")
    return float(value)


class LossWarmupWrapper(nn.Module):
    """Blend ``warmup_loss`` into ``main_loss`` and anneal ``main_loss.temperature``.

    Both losses receive the same call arguments (e.g. ``(scores, labels, mask, group=group)``), so pair losses
    with the same signature (e.g. ``SampledSoftmaxLoss`` then ``SmoothAPLoss``). During pure warm-up or pure
    main phases only one loss is evaluated; the choice depends on the (replicated) step only, so every rank of
    a process group runs the same collectives.

    Call ``step()`` once after each optimiser step (like an LR scheduler): it advances the counter by one and
    writes the new temperature; ``step(global_step=n)`` jumps to step n instead.
    """

    def __init__(
        self,
        warmup_loss: nn.Module,
        main_loss: nn.Module,
        warmup_steps: int = 0,
        temp_start: float = 0.5,
        temp_end: float = 0.01,
        temp_decay_steps: int = 10_000,
        blend_steps: int = 0,
    ):
        super().__init__()
        if not callable(warmup_loss) or not callable(main_loss):
            raise ValueError("warmup_loss and main_loss must be callable losses (nn.Module)")
        if not hasattr(main_loss, "temperature"):
            raise ValueError(f"main_loss ({type(main_loss).__name__}) has no 'temperature' attribute to schedule")
        self.warmup_loss = warmup_loss
        self.main_loss = main_loss
        self.warmup_steps = _check_count(warmup_steps, "warmup_steps")
        self.blend_steps = _check_count(blend_steps, "blend_steps")
        self.temp_start = _check_temperature(temp_start, "temp_start")
        self.temp_end = _check_temperature(temp_end, "temp_end")
        if _check_count(temp_decay_steps, "temp_decay_steps") < 1:
            raise ValueError(f"temp_decay_steps must be >= 1, got {temp_decay_steps!r}")
        self.temp_decay_steps = temp_decay_steps
        self.global_step = 0
        self._apply_temperature()

    # ------------------------------------------------------------------------------------------- schedule
    def temperature_at(self, step: int) -> float:
        """Temperature of ``main_loss`` at global step ``step``."""
        progress = min(1.0, max(0, step - self.warmup_steps) / self.temp_decay_steps)
        return self.temp_start * (self.temp_end / self.temp_start) ** progress

    def main_weight_at(self, step: int) -> float:
        """Weight of ``main_loss`` at global step ``step`` (the warm-up loss gets 1 minus it)."""
        if step < self.warmup_steps:
            return 0.0
        if step >= self.warmup_steps + self.blend_steps:
            return 1.0
        return (step - self.warmup_steps + 1) / (self.blend_steps + 1)

    @property
    def main_weight(self) -> float:
        return self.main_weight_at(self.global_step)

    @property
    def in_warmup(self) -> bool:
        return self.global_step < self.warmup_steps

    @property
    def current_temperature(self) -> float:
        return float(self.main_loss.temperature)

    def step(self, global_step: int | None = None) -> None:
        """Advance the schedule by one step (or jump to ``global_step``) and update the temperature."""
        self.global_step = self.global_step + 1 if global_step is None else _check_count(global_step, "global_step")
        self._apply_temperature()

    def _apply_temperature(self) -> None:
        self.main_loss.temperature = self.temperature_at(self.global_step)

    # -------------------------------------------------------------------------------------------- forward
    def forward(self, *args, **kwargs):
        return self.blend(lambda loss: loss(*args, **kwargs))

    def blend(self, loss_of):
        """``(1 - w) * loss_of(warmup_loss) + w * loss_of(main_loss)`` at this step's main weight w, evaluating
        only the loss whose weight is not 0. ``loss_of(module)`` computes one loss, so callers with their own
        path per loss (e.g. the trainer's fused sampled losses) share the schedule."""
        weight = self.main_weight
        if weight == 0.0:
            return loss_of(self.warmup_loss)
        if weight == 1.0:
            return loss_of(self.main_loss)
        return (1.0 - weight) * loss_of(self.warmup_loss) + weight * loss_of(self.main_loss)

    # ------------------------------------------------------------------------------------- checkpointing
    def get_extra_state(self) -> dict:
        return {"global_step": self.global_step, "temperature": self.current_temperature}

    def set_extra_state(self, state: dict) -> None:
        if not isinstance(state, dict) or "global_step" not in state:
            raise ValueError(f"LossWarmupWrapper state must be a dict with 'global_step', got {state!r}")
        self.global_step = _check_count(int(state["global_step"]), "global_step")
        self._apply_temperature()
