"""Brute-force references for the full-catalog losses: full sorts, explicit searches, Python loops."""

from __future__ import annotations

import math

import torch


def capped_simplex_alpha(z: list[float], mu: float, k: int) -> float:
    """alpha with sum_i clip(alpha (z_i - mu), 0, 1) = k, by bisection (the sum is monotone in alpha)."""

    def total(alpha: float) -> float:
        return sum(min(1.0, max(0.0, alpha * (v - mu))) for v in z)

    lo, hi = 0.0, 1.0
    while total(hi) < k:
        hi *= 2
    for _ in range(200):
        mid = (lo + hi) / 2
        if total(mid) < k:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def rankmax_row(z: list[float], y: int, k: int, margin: float) -> tuple[list[float], float]:
    """Rankmax projection of one row (Definition 4) and its loss (eq. 14), from a full sort + bisection."""
    kth = sorted(z, reverse=True)[k - 1]
    mu = min(z[y], kth) - margin
    alpha = capped_simplex_alpha(z, mu, k)
    projection = [min(1.0, max(0.0, alpha * (v - mu))) for v in z]
    return projection, -math.log(min(1.0, alpha * (z[y] - mu)))


def rankmax_reference(scores: torch.Tensor, target: torch.Tensor, k: int, margin: float = 1.0):
    rows = [rankmax_row(scores[b].tolist(), int(target[b]), k, margin) for b in range(scores.shape[0])]
    projection = torch.tensor([p for p, _ in rows], dtype=torch.float64)
    return projection, torch.tensor([loss for _, loss in rows], dtype=torch.float64)


def sparsemax_row(z: list[float]) -> list[float]:
    """Martins & Astudillo, Algorithm 1: full sort, explicit support search."""
    ordered = sorted(z, reverse=True)
    cumulative, support, total = 0.0, 0, 0.0
    for j, v in enumerate(ordered, start=1):
        cumulative += v
        if 1 + j * v > cumulative:
            support, total = j, cumulative
    tau = (total - 1) / support
    return [max(0.0, v - tau) for v in z]


def sparsemax_loss_row(z: list[float], y: int) -> float:
    p = sparsemax_row(z)
    tau = next(v - q for v, q in zip(z, p, strict=True) if q > 0)
    return -z[y] + 0.5 * sum(v * v - tau * tau for v, q in zip(z, p, strict=True) if q > 0) + 0.5
