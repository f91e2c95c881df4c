"""The one list of training losses: name → kind, parameters (``bigrank.losses.params``) and module.

Everything that needs to know which losses exist reads :data:`LOSSES`: config validation
(``bigrank.config``: ``loss.name`` choices, ``loss.params`` keys, types and values), the trainer
(:func:`build_loss`, used by ``bigrank.train.losses.StepLoss``), the pre-flight of every entry point
(``bigrank.run.prepare_run``) and the docs (:func:`markdown_table`, pasted in ``docs/architecture.md``).

Kinds:
    * ``full_catalog``: the module is called ``(scores [B, n] or ChunkedScores, target int64[B], *, group,
      offset)`` over every item of the (item-parallel) catalog;
    * ``candidate``: the module is called ``(scores [B, C], labels bool [B, C], mask, *, group)`` over
      candidate columns (the whole local shard, or sampled items); :class:`CandidateLoss` gives them one call
      ``(..., group, log_q)``, ``log_q`` reaching sampled softmax only.

A loss's parameters in a config (``loss.params``) are the fields of its ``*Params`` dataclass; the defaults
are the dataclass's, which ``tests/test_loss_registry.py`` checks against the loss function's and module's
own defaults.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from torch import nn

from bigrank.errors import ConfigError
from bigrank.losses.params import (
    PAUCAtBudgetParams,
    RankmaxParams,
    RecallAtQuantileParams,
    SampledSoftmaxParams,
    SmoothAPParams,
    SoftmaxParams,
    SoftNDCGParams,
    SparsemaxParams,
)
from bigrank.losses.rankmax import RankmaxLoss, rankmax_loss
from bigrank.losses.sampled import SampledSoftmaxLoss, sampled_softmax_loss
from bigrank.losses.softmax import SoftmaxLoss, softmax_loss
from bigrank.losses.softndcg import SoftNDCGLoss, softrank_ndcg_loss
from bigrank.losses.softrank import (
    PAUCAtBudgetLoss,
    RecallAtQuantileLoss,
    SmoothAPLoss,
    pauc_at_budget_loss,
    recall_at_quantile_loss,
    smooth_ap_loss,
)
from bigrank.losses.sparsemax import SparsemaxLoss, sparsemax_loss
from bigrank.losses.warmup import LossWarmupWrapper

if TYPE_CHECKING:  # annotations only: bigrank.config imports this module
    from bigrank.config import LossConfig

__all__ = [
    "CANDIDATE",
    "CANDIDATE_LOSSES",
    "FULL_CATALOG",
    "FULL_CATALOG_LOSSES",
    "LOSSES",
    "CandidateLoss",
    "LossSpec",
    "build_loss",
    "check_loss_config",
    "markdown_table",
    "parse_params",
]

FULL_CATALOG = "full_catalog"
CANDIDATE = "candidate"


@dataclass(frozen=True)
class LossSpec:
    """One loss: its config ``name``, ``kind`` (full_catalog | candidate), ``params`` dataclass, ``module``
    class (built as ``module(**params)``) and the plain ``function`` the module wraps."""

    name: str
    kind: str
    params: type
    module: type[nn.Module]
    function: Callable
    summary: str


LOSSES: dict[str, LossSpec] = {
    spec.name: spec
    for spec in (
        LossSpec("rankmax", FULL_CATALOG, RankmaxParams, RankmaxLoss, rankmax_loss, "Rankmax (Kong et al. 2020)"),
        LossSpec("softmax", FULL_CATALOG, SoftmaxParams, SoftmaxLoss, softmax_loss, "softmax cross-entropy"),
        LossSpec("sparsemax", FULL_CATALOG, SparsemaxParams, SparsemaxLoss, sparsemax_loss, "sparsemax loss"),
        LossSpec("smooth_ap", CANDIDATE, SmoothAPParams, SmoothAPLoss, smooth_ap_loss, "Smooth-AP"),
        LossSpec(
            "recall_at_quantile",
            CANDIDATE,
            RecallAtQuantileParams,
            RecallAtQuantileLoss,
            recall_at_quantile_loss,
            "soft Recall@quantile",
        ),
        LossSpec("pauc_at_budget", CANDIDATE, PAUCAtBudgetParams, PAUCAtBudgetLoss, pauc_at_budget_loss, "partial AUC"),
        LossSpec("softrank_ndcg", CANDIDATE, SoftNDCGParams, SoftNDCGLoss, softrank_ndcg_loss, "SoftRank NDCG"),
        LossSpec(
            "sampled_softmax",
            CANDIDATE,
            SampledSoftmaxParams,
            SampledSoftmaxLoss,
            sampled_softmax_loss,
            "sampled softmax with the logQ correction",
        ),
    )
}
FULL_CATALOG_LOSSES = tuple(name for name, spec in LOSSES.items() if spec.kind == FULL_CATALOG)
CANDIDATE_LOSSES = tuple(name for name, spec in LOSSES.items() if spec.kind == CANDIDATE)

# Numbers in exponent notation without a dot ("1e-3"), which YAML 1.1 (PyYAML) leaves as strings.
_EXPONENT_NUMBER = re.compile(r"[-+]?[0-9]+(\.[0-9]*)?[eE][-+]?[0-9]+")


def _typed(value: Any, tp, where: str) -> Any:
    """``value`` checked against a Params field annotation (int, float, str, X | None)."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        options = [option for option in typing.get_args(tp) if option is not type(None)]
        if value is None:
            return None
        (tp,) = options
    if value is None:
        raise ConfigError(f"{where} must not be null")
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where} must be an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, str) and _EXPONENT_NUMBER.fullmatch(value.strip()):
            value = float(value)
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{where} must be a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{where} must be a string, got {value!r}")
        return value
    raise ConfigError(f"{where}: unsupported parameter type {tp}")  # a bug in bigrank.losses.params


def parse_params(name: str, raw: dict[str, Any], key: str = "loss.params") -> dict[str, Any]:
    """``raw`` (a config's ``params`` mapping of loss ``name``) merged over the loss's defaults and checked.

    Raises ConfigError naming the dotted key: an unknown parameter (``unknown key 'loss.params.x'``), a wrong
    type (``loss.params.k must be an integer``) or a bad value (``loss.params (rankmax): k must be ...``).
    Returns a plain dict (what ``config.yaml`` holds).
    """
    spec = LOSSES[name]
    fields = {f.name: f for f in dataclasses.fields(spec.params)}
    for param in raw:
        if param not in fields:
            accepted = ", ".join(fields) or "no parameters"
            raise ConfigError(f"unknown key '{key}.{param}': loss {name!r} accepts {accepted}")
    hints = typing.get_type_hints(spec.params)
    values = {param: _typed(value, hints[param], f"{key}.{param}") for param, value in raw.items()}
    params = spec.params(**values)
    try:
        params.check()
    except ValueError as error:
        raise ConfigError(f"{key} ({name}): {error}") from None
    return dataclasses.asdict(params)


class CandidateLoss(nn.Module):
    """A candidate loss with the common call ``(scores [B, C], labels bool [B, C], mask, *, group, log_q)``.

    ``log_q`` reaches ``sampled_softmax`` only (the soft-rank losses take no proposal correction);
    ``temperature`` is the wrapped loss's (the one ``LossWarmupWrapper`` anneals).
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
    params = parse_params(name, params, key)
    try:
        if LOSSES[name].kind == FULL_CATALOG:
            return LOSSES[name].module(**params)
        return CandidateLoss(name, params)
    except ValueError as error:
        raise ConfigError(f"{key} ({name}): {error}") from None


def build_loss(config: LossConfig) -> nn.Module:
    """The loss module of the ``loss`` config section: the named loss, wrapped in ``LossWarmupWrapper`` when
    ``loss.warmup`` is set. Errors are ConfigErrors naming the key."""
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


def check_loss_config(config: LossConfig) -> None:
    """Build the loss once, so that any bad value is a ConfigError naming the key before a process starts."""
    build_loss(config)


def markdown_table() -> str:
    """The losses and their parameters (default, description) as a Markdown table (docs/architecture.md)."""
    lines = ["| loss | kind | parameter | default | meaning |", "|---|---|---|---|---|"]
    for spec in LOSSES.values():
        fields = dataclasses.fields(spec.params)
        if not fields:
            lines.append(f"| `{spec.name}` | {spec.kind} | – | – | {spec.summary} |")
        for i, f in enumerate(fields):
            first = f"`{spec.name}` | {spec.kind}" if i == 0 else " | "
            default = "null" if f.default is None else f.default
            lines.append(f"| {first} | `{f.name}` | `{default}` | {f.metadata.get('doc', '')} |")
    return "\n".join(lines)
