"""Input checks and reductions shared by every loss.

Checks run on the inputs each loss receives; with a process group, checks whose outcome depends on other ranks
(e.g. "target outside [0, n)") are decided from replicated values so that every rank raises together and no
rank is left waiting in a collective.
"""

from __future__ import annotations

import torch

REDUCTIONS = ("mean", "sum", "none")


def check_reduction(reduction: str) -> None:
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")


def check_scores(scores: torch.Tensor, name: str = "scores") -> None:
    """``scores`` must be a floating-point matrix [B, n]."""
    if not isinstance(scores, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(scores).__name__}")
    if scores.dim() != 2:
        raise ValueError(f"{name} must have shape [B, n], got shape {tuple(scores.shape)}")
    if not scores.is_floating_point():
        raise ValueError(f"{name} must be floating point, got dtype {scores.dtype}")


def check_target(target: torch.Tensor, batch: int) -> None:
    """``target`` must be an integer vector [B] (range checks happen where n is known)."""
    if not isinstance(target, torch.Tensor):
        raise ValueError(f"target must be a torch.Tensor, got {type(target).__name__}")
    if target.dim() != 1 or target.shape[0] != batch:
        raise ValueError(f"target must have shape [B]=[{batch}], got shape {tuple(target.shape)}")
    if target.is_floating_point() or target.dtype == torch.bool:
        raise ValueError(f"target must hold integer item ids, got dtype {target.dtype}")


def check_target_range(target: torch.Tensor, num_items: int) -> None:
    if target.numel() and (int(target.min()) < 0 or int(target.max()) >= num_items):
        bad = target[(target < 0) | (target >= num_items)]
        raise ValueError(f"target holds item ids outside [0, {num_items}): e.g. {bad[:5].tolist()}")


def first_nonfinite_row(scores: torch.Tensor) -> torch.Tensor:
    """Per-row flag [B] of rows holding NaN or ±inf.

    A row sum is finite exactly when every entry is finite (barring overflow of huge finite values), so the
    common all-finite case costs one reduction and no [B, n] temporary; only suspicious rows are re-checked.
    """
    row_sums = scores.detach().sum(dim=1)
    suspicious = ~torch.isfinite(row_sums)
    if suspicious.any():
        rows = suspicious.nonzero().squeeze(1)
        suspicious[rows] = ~torch.isfinite(scores.detach()[rows]).all(dim=1)
    return suspicious


def raise_if_nonfinite(bad_rows: torch.Tensor, name: str = "scores") -> None:
    """Raise naming the first rows whose scores are NaN or infinite (``bad_rows`` is a bool [B])."""
    if bad_rows.any():
        rows = bad_rows.nonzero().squeeze(1)[:5].tolist()
        raise ValueError(f"{name} hold NaN or infinite values in rows {rows} (of {bad_rows.numel()})")


def reduce_rows(per_row: torch.Tensor, reduction: str, valid: torch.Tensor | None = None) -> torch.Tensor:
    """Apply ``reduction`` to a per-row loss [B]; rows with ``valid == False`` are left out of mean and sum
    (and are 0 with ``reduction="none"``)."""
    if valid is not None:
        per_row = torch.where(valid, per_row, per_row.new_zeros(()))
    if reduction == "none":
        return per_row
    if reduction == "sum":
        return per_row.sum()
    if valid is None:
        return per_row.sum() / max(per_row.shape[0], 1)
    return per_row.sum() / valid.sum().clamp_min(1).to(per_row.dtype)  # no host sync


def check_temperature(temperature: float) -> None:
    """Raise ValueError unless ``temperature`` is a finite number > 0 (the divisor of a loss's scores)."""
    if not (isinstance(temperature, int | float) and temperature > 0 and temperature != float("inf")):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}")
