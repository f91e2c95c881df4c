"""The configured loss module, built from the loss registry (``bigrank.losses.registry``).

``build_loss(config.loss)`` returns the named loss's module built from the section's parameters, wrapped in
``LossWarmupWrapper`` when ``loss.warmup`` is set; candidate losses come wrapped in :class:`CandidateLoss`
(one call for all of them). Used by the trainer (``bigrank.train.losses.StepLoss``) and by the pre-flight of
every run (``bigrank.run.prepare_run`` → :func:`check_loss_config`).

The parameters are taken as the config holds them: loading a config (``bigrank.config.resolve``) has already
merged them over their defaults and checked their keys, types and values (``bigrank.losses.registry.parse_params``),
once, so building the loss does not convert them again. What a loss module itself refuses (the same rules as
its ``*Params`` check, ``tests/test_loss_registry.py``) is still a ConfigError naming the key.
"""

from __future__ import annotations

import inspect
from typing import Any, Protocol

from torch import nn

from bigrank.errors import ConfigError
from bigrank.losses.registry import CANDIDATE, FULL_CATALOG, LOSSES
from bigrank.losses.warmup import LossWarmupWrapper

__all__ = ["CandidateLoss", "LossSection", "build_loss", "check_loss_config"]


class LossSection(Protocol):
    """What the builders read of a config's ``loss`` section (``bigrank.config.LossConfig``, which sits above the
    losses and is not imported here): the loss's ``name`` and ``params``, and ``warmup``, None or a section with
    the warm-up loss's ``loss`` and ``params`` and its schedule (``steps``, ``temp_start``, ``temp_end``,
    ``temp_decay_steps``, ``blend_steps``)."""

    name: str
    params: dict
    warmup: Any


class CandidateLoss(nn.Module):
    """A candidate loss with the common call ``(scores [B, C], labels bool [B, C], mask, *, group, log_q)``.

    ``log_q`` reaches the losses whose module takes it (sampled softmax; the soft-rank losses take no proposal
    correction); ``temperature`` is the wrapped loss's (the one ``LossWarmupWrapper`` anneals).
    """

    def __init__(self, name: str, params: dict):
        super().__init__()
        spec = LOSSES[name]
        if spec.kind != CANDIDATE:
            raise ValueError(f"{name!r} is a {spec.kind} loss, not a candidate loss")
        self.name = name
        self.takes_log_q = "log_q" in inspect.signature(spec.module.forward).parameters
        self.inner = spec.module(**params)

    @property
    def temperature(self) -> float:
        return float(self.inner.temperature)

    @temperature.setter
    def temperature(self, value: float) -> None:
        self.inner.temperature = value

    def forward(self, scores, labels, mask=None, *, group=None, log_q=None):
        if self.takes_log_q:
            return self.inner(scores, labels, mask, group=group, log_q=log_q)
        return self.inner(scores, labels, mask, group=group)


def _module(name: str, params: dict, key: str) -> nn.Module:
    try:
        if LOSSES[name].kind == FULL_CATALOG:
            return LOSSES[name].module(**params)
        return CandidateLoss(name, params)
    except ValueError as error:
        raise ConfigError(f"{key} ({name}): {error}") from None


def build_loss(config: LossSection) -> nn.Module:
    """The loss module of the ``loss`` config section (its parameters as a loaded config holds them: merged over
    the defaults and checked), wrapped in ``LossWarmupWrapper`` when ``loss.warmup`` is set. Errors are
    ConfigErrors naming the key."""
    main = _module(config.name, config.params, "loss.params")
    if config.warmup is None:
        return main
    warm = config.warmup
    warmup_loss = _module(warm.loss, warm.params, "loss.warmup.params")
    try:
        return LossWarmupWrapper(
            warmup_loss,
            main,
            warmup_steps=warm.steps,
            temp_start=warm.temp_start,
            temp_end=warm.temp_end,
            temp_decay_steps=warm.temp_decay_steps,
            blend_steps=warm.blend_steps,
        )
    except ValueError as error:
        raise ConfigError(f"loss.warmup: {error}") from None


def check_loss_config(config: LossSection) -> None:
    """Build the loss once, so that any bad value is a ConfigError naming the key before a process starts."""
    build_loss(config)
