"""Ranking losses.

Full catalog (every item scored; single process or item-parallel with ``group=`` / ``offset=``):
``rankmax``/``rankmax_loss`` (Kong et al. 2020), ``softmax_loss``, ``sparsemax``/``sparsemax_loss``
(Martins & Astudillo 2016). ``scores`` may be a tensor or a ``ChunkedScores`` (lazy ``U @ V.T``).

Soft-rank and sampled (scores over candidate columns, ``labels`` marking positives): ``smooth_ap_loss``,
``recall_at_quantile_loss``, ``pauc_at_budget_loss`` (the ``imbalanced-losses`` family), ``softrank_ndcg_loss``
(Taylor et al. 2008), ``sampled_softmax_loss`` (logQ correction), and ``LossWarmupWrapper``.

``bigrank.losses.registry`` lists the losses by config name with their parameters (``bigrank.losses.params``)
and ``bigrank.losses.build`` builds the configured one. The names below are loaded on first use (PEP 562):
the config reads the registry and its parameter dataclasses, which need no torch, so that commands which only
parse a config (``bigrank --help``, ``bigrank submit``) do not pay torch's import.
"""

from __future__ import annotations

import importlib
import sys
import types

_EXPORTS = {
    "ChunkedScores": "bigrank.losses.scores",
    "LossWarmupWrapper": "bigrank.losses.warmup",
    "PAUCAtBudgetLoss": "bigrank.losses.softrank",
    "RankmaxLoss": "bigrank.losses.rankmax",
    "RecallAtQuantileLoss": "bigrank.losses.softrank",
    "SampledSoftmaxLoss": "bigrank.losses.sampled",
    "SmoothAPLoss": "bigrank.losses.softrank",
    "SoftNDCGLoss": "bigrank.losses.softndcg",
    "SoftmaxLoss": "bigrank.losses.softmax",
    "SparsemaxLoss": "bigrank.losses.sparsemax",
    "pauc_at_budget_loss": "bigrank.losses.softrank",
    "rank_distributions": "bigrank.losses.softndcg",
    "rankmax": "bigrank.losses.rankmax",
    "rankmax_loss": "bigrank.losses.rankmax",
    "rankmax_shared_loss": "bigrank.losses.rankmax",
    "recall_at_quantile_loss": "bigrank.losses.softrank",
    "sampled_softmax_loss": "bigrank.losses.sampled",
    "smooth_ap_loss": "bigrank.losses.softrank",
    "softmax_loss": "bigrank.losses.softmax",
    "softmax_shared_loss": "bigrank.losses.softmax",
    "softrank_ndcg_loss": "bigrank.losses.softndcg",
    "sparsemax": "bigrank.losses.sparsemax",
    "sparsemax_loss": "bigrank.losses.sparsemax",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'bigrank.losses' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))


# Functions named like the submodule that defines them: once ``bigrank.losses.rankmax`` is loaded, Python sets
# the package attribute ``rankmax`` to that submodule, which would hide the function ``bigrank.losses.rankmax``
# (``from bigrank.losses import rankmax`` would then give a module). The package keeps the function instead;
# the submodule stays importable by its full name (``from bigrank.losses.rankmax import ...``).
_SHADOWED = {"rankmax", "sparsemax"}


class _LossesPackage(types.ModuleType):
    def __setattr__(self, name: str, value) -> None:
        if name in _SHADOWED and isinstance(value, types.ModuleType):
            value = getattr(value, name)
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _LossesPackage
