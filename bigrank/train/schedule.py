"""Learning-rate schedule of a training run: linear warm-up, then a linear or cosine decay.

The learning rate of the update made by step ``t`` (0-based: ``t`` updates came before it) of a run of ``T``
steps is ``base_lr * factor(t)`` with, for ``W`` warm-up steps and final ratio ``r``::

    factor(t) = (t + 1) / W                                 t < W        (linear warm-up; the first update is
                                                                          not a zero step)
    p         = (t - W) / (T - W)                           t >= W       (decay progress, in [0, 1))
    factor(t) = r + (1 - r) * (1 - p)                       linear decay (Goyal et al. 2017 warm-up)
    factor(t) = r + (1 - r) * (1 + cos(pi * p)) / 2         cosine decay (Loshchilov & Hutter, SGDR, 2017)
    factor(t) = 1                                           no decay

``factor`` depends only on ``(t, T)``, so a resumed run needs no schedule state. :func:`set_learning_rates`
sets the factor on both optimisers of the trainer before each step's forward pass:

* the item optimiser (any ``torch.optim`` optimiser): ``group["lr"] = base * factor`` for each param group;
* the user tower's fused torchrec optimiser: the fbgemm kernels update the rows *inside* backward, with the rate
  they held at the forward lookup (observed on fbgemm-gpu-cpu 1.8: a rate set between forward and backward
  reached only the next step). torchrec 1.8's ``EmbeddingFusedOptimizer`` (``dmp.fused_optimizer``, a
  ``CombinedOptimizer`` of ``KeyedOptimizer``s) pushes ``param_groups[0]["lr"]`` into its fbgemm module
  (``set_learning_rate``) when its ``step()`` or ``zero_grad()`` is called, and does nothing else there;
  ``set_optimizer_step`` only sets the step counter of optimisers that have one (Adam), not the rate. So the
  rate is set with :func:`bigrank.model.sharding.set_fused_learning_rate` (param groups, then ``step()``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["DECAYS", "LearningRateSchedule", "set_learning_rates"]

DECAYS = ("none", "linear", "cosine")


@dataclass(frozen=True)
class LearningRateSchedule:
    """``factor(t)`` of the module docstring for a run of ``total_steps`` steps.

    Args:
        total_steps: steps of the whole run (``T``).
        warmup_steps: linear warm-up steps (``W``; 0: none).
        decay: "none" | "linear" | "cosine".
        final_ratio: ``r``, the factor the decay approaches at the end of the run.
    """

    total_steps: int
    warmup_steps: int = 0
    decay: str = "none"
    final_ratio: float = 0.0

    def __post_init__(self):
        if self.total_steps < 1:
            raise ValueError(f"total_steps must be >= 1, got {self.total_steps}")
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {self.warmup_steps}")
        if self.decay not in DECAYS:
            raise ValueError(f"decay must be one of {', '.join(DECAYS)}, got {self.decay!r}")
        if not 0.0 <= self.final_ratio <= 1.0:
            raise ValueError(f"final_ratio must be in [0, 1], got {self.final_ratio}")

    @classmethod
    def for_run(cls, config, steps_per_epoch: int) -> LearningRateSchedule:
        """The schedule of the run of ``config`` (a :class:`~bigrank.config.Config`: ``optim.lr_warmup_steps``,
        ``lr_decay``, ``lr_final_ratio``) over ``train.epochs`` epochs of ``steps_per_epoch`` steps, or
        ``train.max_steps`` steps when fewer."""
        train, optim = config.train, config.optim
        total_steps = train.epochs * steps_per_epoch
        if train.max_steps is not None:
            total_steps = min(total_steps, train.max_steps)
        return cls(total_steps, optim.lr_warmup_steps, optim.lr_decay, optim.lr_final_ratio)

    @property
    def constant(self) -> bool:
        """True when every factor is 1 (the optimisers' rates are then never touched)."""
        return self.warmup_steps == 0 and self.decay == "none"

    def factor(self, step: int) -> float:
        """Multiplier of the base learning rates for the update of step ``step`` (0-based)."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        if self.decay == "none":
            return 1.0
        span = max(self.total_steps - self.warmup_steps, 1)
        progress = min((step - self.warmup_steps) / span, 1.0)
        if self.decay == "linear":
            shape = 1.0 - progress
        else:
            shape = 0.5 * (1.0 + math.cos(math.pi * progress))
        return self.final_ratio + (1.0 - self.final_ratio) * shape


def set_learning_rates(factor: float, item_optimizer, item_lr: float, tower=None, user_lr: float | None = None) -> None:
    """Set ``item_lr * factor`` on ``item_optimizer`` (a ``torch.optim`` optimizer's param groups, or the ``lr`` of
    a ``bigrank.train.item_optim.RowOptimizer``) and ``user_lr * factor`` on the fused optimizer of the sharded
    ``tower`` (skipped when ``tower`` is None). Call it before the step's forward pass: the fused update happens
    inside backward with the rate fbgemm's lookup took in forward (measured: a rate set between forward and
    backward is only used by the next step)."""
    if hasattr(item_optimizer, "param_groups"):  # a torch.optim optimizer
        for group in item_optimizer.param_groups:
            group["lr"] = item_lr * factor
    else:  # bigrank.train.item_optim.RowOptimizer
        item_optimizer.lr = item_lr * factor
    if tower is not None:
        from bigrank.model.sharding import set_fused_learning_rate

        set_fused_learning_rate(tower, user_lr * factor)
