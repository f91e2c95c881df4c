"""The one list of training losses: name → kind, parameters (``bigrank.losses.params``) and module.

Everything that needs to know which losses exist reads :data:`LOSSES`: config validation
(``bigrank.config``: ``loss.name`` choices, ``loss.params`` keys, types and values), the trainer and the
pre-flight of every entry point (``bigrank.losses.build.build_loss``, used by
``bigrank.train.losses.StepLoss`` and ``bigrank.run.prepare_run``) and the docs (:func:`markdown_table`,
pasted in ``docs/architecture.md``).

This module imports no torch: a spec names its module and function by import path, resolved on first use
(``spec.module``, ``spec.function``), so loading a config (``bigrank --help``, ``bigrank submit``) stays light.

Kinds:
    * ``full_catalog``: the module is called ``(scores [B, n] or ChunkedScores, target int64[B], *, group,
      offset)`` over every item of the (item-parallel) catalog;
    * ``candidate``: the module is called ``(scores [B, C], labels bool [B, C], mask, *, group)`` over
      candidate columns (the whole local shard, or sampled items); ``bigrank.losses.build.CandidateLoss``
      gives them one call ``(..., group, log_q)``, ``log_q`` reaching sampled softmax only.

A loss's parameters in a config (``loss.params``) are the fields of its ``*Params`` dataclass; the defaults
are the dataclass's, which ``tests/test_loss_registry.py`` checks against the loss function's and module's
own defaults.
"""

from __future__ import annotations

import dataclasses
import importlib
import typing
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from typing import Any

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
from bigrank.scalars import convert_param, params_markdown_table

__all__ = [
    "CANDIDATE",
    "CANDIDATE_LOSSES",
    "FULL_CATALOG",
    "FULL_CATALOG_LOSSES",
    "LOSSES",
    "LossSpec",
    "markdown_table",
    "parse_params",
]

FULL_CATALOG = "full_catalog"
CANDIDATE = "candidate"


def _resolve(path: str):
    """``"package.module:Name"`` → the object (imports the module)."""
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


@dataclass(frozen=True)
class LossSpec:
    """One loss: its config ``name``, ``kind`` (full_catalog | candidate), ``params`` dataclass, and the import
    paths of its ``module`` class (built as ``module(**params)``) and of the plain ``function`` it wraps."""

    name: str
    kind: str
    params: type
    module_path: str
    function_path: str
    summary: str

    @cached_property
    def module(self) -> type:
        """The loss's ``nn.Module`` class (imports torch and the loss's module)."""
        return _resolve(self.module_path)

    @cached_property
    def function(self) -> Callable:
        """The loss function the module wraps."""
        return _resolve(self.function_path)


def _spec(name, kind, params, module, function, summary) -> LossSpec:
    return LossSpec(name, kind, params, f"bigrank.losses.{module}", f"bigrank.losses.{function}", summary)


LOSSES: dict[str, LossSpec] = {
    spec.name: spec
    for spec in (
        _spec("rankmax", FULL_CATALOG, RankmaxParams, "rankmax:RankmaxLoss", "rankmax:rankmax_loss", "Rankmax"),
        _spec("softmax", FULL_CATALOG, SoftmaxParams, "softmax:SoftmaxLoss", "softmax:softmax_loss", "softmax"),
        _spec(
            "sparsemax",
            FULL_CATALOG,
            SparsemaxParams,
            "sparsemax:SparsemaxLoss",
            "sparsemax:sparsemax_loss",
            "sparsemax",
        ),
        _spec("smooth_ap", CANDIDATE, SmoothAPParams, "softrank:SmoothAPLoss", "softrank:smooth_ap_loss", "Smooth-AP"),
        _spec(
            "recall_at_quantile",
            CANDIDATE,
            RecallAtQuantileParams,
            "softrank:RecallAtQuantileLoss",
            "softrank:recall_at_quantile_loss",
            "soft Recall@quantile",
        ),
        _spec(
            "pauc_at_budget",
            CANDIDATE,
            PAUCAtBudgetParams,
            "softrank:PAUCAtBudgetLoss",
            "softrank:pauc_at_budget_loss",
            "partial AUC over a false-positive band",
        ),
        _spec(
            "softrank_ndcg",
            CANDIDATE,
            SoftNDCGParams,
            "softndcg:SoftNDCGLoss",
            "softndcg:softrank_ndcg_loss",
            "SoftRank NDCG",
        ),
        _spec(
            "sampled_softmax",
            CANDIDATE,
            SampledSoftmaxParams,
            "sampled:SampledSoftmaxLoss",
            "sampled:sampled_softmax_loss",
            "sampled softmax with the logQ correction",
        ),
    )
}
FULL_CATALOG_LOSSES = tuple(name for name, spec in LOSSES.items() if spec.kind == FULL_CATALOG)
CANDIDATE_LOSSES = tuple(name for name, spec in LOSSES.items() if spec.kind == CANDIDATE)


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
            raise ConfigError(f"unknown key {f'{key}.{param}'!r}: loss {name!r} accepts {accepted}")
    hints = typing.get_type_hints(spec.params)
    values = {param: convert_param(value, hints[param], f"{key}.{param}") for param, value in raw.items()}
    params = spec.params(**values)
    try:
        params.check()
    except ValueError as error:
        raise ConfigError(f"{key} ({name}): {error}") from None
    return dataclasses.asdict(params)


def markdown_table() -> str:
    """The losses and their parameters (default, description) as a Markdown table (docs/architecture.md)."""
    return params_markdown_table(
        "| loss | kind | parameter | default | meaning |",
        (
            (f"`{spec.name}` | {spec.kind}", spec.params, f"| `{spec.name}` | {spec.kind} | – | – | {spec.summary} |")
            for spec in LOSSES.values()
        ),
    )
