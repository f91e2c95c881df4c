"""Each loss's hyper-parameters: one frozen dataclass per loss with its defaults and its checks.

A ``*Params`` class holds exactly the keyword arguments of its loss module (``bigrank.losses.registry`` maps
loss names to them), with the same defaults as the loss function and module (``tests/test_loss_registry.py``
compares them, so they cannot drift). ``check()`` raises ValueError naming the parameter — the same rules the
loss modules enforce when they are built, but without torch, so a config is rejected when it is loaded.
Field metadata ``doc`` is the one-line description the docs and ``bigrank tune`` show.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

__all__ = [
    "PAUCAtBudgetParams",
    "RankmaxParams",
    "RecallAtQuantileParams",
    "SampledSoftmaxParams",
    "SmoothAPParams",
    "SoftNDCGParams",
    "SoftmaxParams",
    "SparsemaxParams",
]


def _doc(text: str) -> dict:
    return {"doc": text}


def _integer(value, name: str, minimum: int, *, nullable: bool = False) -> None:
    if nullable and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        also = " or None" if nullable else ""
        raise ValueError(f"{name} must be an integer >= {minimum}{also}, got {value!r}")


def _positive(value, name: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")


def _fraction(value, name: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0.0 < value < 1.0:
        raise ValueError(f"{name} must be in (0, 1), got {value!r}")


# ------------------------------------------------------------------------------------- full-catalog losses
@dataclass(frozen=True)
class RankmaxParams:
    """``RankmaxLoss`` / ``rankmax_loss`` (Kong et al. 2020): projection on the (n, k)-simplex."""

    k: int = field(default=1, metadata=_doc("k of the (n, k)-simplex (eq. 11-13): the ranks the loss optimises, top-k"))
    margin: float = field(default=1.0, metadata=_doc("margin eta below min(z_y, z_[k]) (eq. 11)"))
    k_fraction: float = field(
        default=0.0,
        metadata=_doc("> 0: a row's k is max(k, ceil(k_fraction * its user's train items)), its label set (0: off)"),
    )

    def check(self) -> None:
        _integer(self.k, "k", 1)
        _positive(self.margin, "margin")
        if isinstance(self.k_fraction, bool) or not isinstance(self.k_fraction, int | float):
            raise ValueError(f"k_fraction must be a number in [0, 1], got {self.k_fraction!r}")
        if not 0.0 <= self.k_fraction <= 1.0:
            raise ValueError(f"k_fraction must be a number in [0, 1], got {self.k_fraction!r}")


@dataclass(frozen=True)
class SoftmaxParams:
    """``SoftmaxLoss`` / ``softmax_loss``: full-catalog cross-entropy of ``softmax(z / temperature)``."""

    temperature: float = field(default=1.0, metadata=_doc("divides the scores (< 1 sharpens the distribution)"))

    def check(self) -> None:
        _positive(self.temperature, "temperature")


@dataclass(frozen=True)
class SparsemaxParams:
    """``SparsemaxLoss`` / ``sparsemax_loss`` (Martins & Astudillo 2016) of ``z / temperature``."""

    support_guess: int = field(
        default=64, metadata=_doc("top-k taken per shard to find the threshold (grown when the support is larger)")
    )
    temperature: float = field(
        default=1.0, metadata=_doc("divides the scores (< 1 sharpens: a smaller support, faster steps)")
    )

    def check(self) -> None:
        _integer(self.support_guess, "support_guess", 1)
        _positive(self.temperature, "temperature")


# ----------------------------------------------------------------------------------------- candidate losses
@dataclass(frozen=True)
class SmoothAPParams:
    """``SmoothAPLoss`` / ``smooth_ap_loss`` (Brown et al. 2020)."""

    temperature: float = field(default=0.01, metadata=_doc("sigmoid temperature of the soft ranks (score units)"))

    def check(self) -> None:
        _positive(self.temperature, "temperature")


@dataclass(frozen=True)
class RecallAtQuantileParams:
    """``RecallAtQuantileLoss`` / ``recall_at_quantile_loss``."""

    quantile: float = field(default=0.005, metadata=_doc("fraction of the candidates counted as retrieved"))
    temperature: float = field(default=0.01, metadata=_doc("sigmoid temperature (score units)"))

    def check(self) -> None:
        _fraction(self.quantile, "quantile")
        _positive(self.temperature, "temperature")


@dataclass(frozen=True)
class PAUCAtBudgetParams:
    """``PAUCAtBudgetLoss`` / ``pauc_at_budget_loss``: partial AUC over the false-positive band [alpha, beta]."""

    alpha: float = field(default=0.0, metadata=_doc("lower end of the false-positive-rate band"))
    beta: float = field(default=0.005, metadata=_doc("upper end of the false-positive-rate band"))
    temperature: float = field(default=0.1, metadata=_doc("sigmoid temperature as a fraction of the scale"))
    tau_scale: str = field(default="iqr", metadata=_doc("scale of the temperature: iqr (of the negatives) or band"))
    n_knots: int = field(default=2, metadata=_doc("trapezoid knots over the band"))
    scale_sample_size: int = field(default=2048, metadata=_doc("columns sampled for the IQR of the negatives"))

    def check(self) -> None:
        for name in ("alpha", "beta"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ValueError(f"{name} must be a number, got {value!r}")
        if not 0.0 <= self.alpha < self.beta <= 1.0:
            raise ValueError(f"need 0 <= alpha < beta <= 1, got alpha={self.alpha!r}, beta={self.beta!r}")
        _positive(self.temperature, "temperature")
        if self.tau_scale not in ("iqr", "band"):
            raise ValueError(f"tau_scale must be 'iqr' or 'band', got {self.tau_scale!r}")
        _integer(self.n_knots, "n_knots", 2)
        _integer(self.scale_sample_size, "scale_sample_size", 4)


@dataclass(frozen=True)
class SoftNDCGParams:
    """``SoftNDCGLoss`` / ``softrank_ndcg_loss`` (Taylor et al., WSDM 2008)."""

    sigma: float = field(default=0.1, metadata=_doc("standard deviation of the score noise (the temperature)"))
    k: int | None = field(default=None, metadata=_doc("truncate the discount at rank k (null: no truncation)"))
    num_candidates: int | None = field(
        default=64, metadata=_doc("list size per row: the positives and the top negatives (null: every column)")
    )

    def check(self) -> None:
        _positive(self.sigma, "sigma")
        _integer(self.k, "k", 1, nullable=True)
        _integer(self.num_candidates, "num_candidates", 2, nullable=True)


@dataclass(frozen=True)
class SampledSoftmaxParams:
    """``SampledSoftmaxLoss`` / ``sampled_softmax_loss`` with the logQ correction (Yi et al. RecSys 2019)."""

    temperature: float = field(default=1.0, metadata=_doc("divides the scores before the logQ correction"))

    def check(self) -> None:
        _positive(self.temperature, "temperature")
