"""The fused twins of the chunked full-catalog losses: the same forward (merge of per-row statistics across
ranks, loss formula) and the same analytic gradient, with the per-rank statistics and the backward computed by
the Triton kernels of ``bigrank.losses.fused.triton_tiles`` instead of score blocks.

Each twin subclasses the chunked loss and overrides only its *local* passes (what a rank computes from its own
columns) and the backward, so the item-parallel exchange is the chunked path's code: a rank's kernel gives the
same [B, c] statistics that ``gather_row_stats`` / ``sum_row_stats`` exchange today.

* softmax (Rankmax paper, Section 3.3): the kernel gives (max, sum exp(z - max)) per row; backward
  G = g_r exp(z - logsumexp_r) in the kernel, -g_r at the positive on the host.
* Rankmax k = 1 (Kong et al. 2020, eqs. 11-16): mu = z_y - eta is known before the pass, so one statistics pass
  gives (z_[1], sum_i (z_i - mu)_+, |{i : z_i > mu}|) and the loss log D - log(z_y - mu) (eq. 15); rows whose
  positive is the top score (mu = z_[1] - eta) take a second pass over those rows only, with the ties of z_[1].
  Backward: G = (g_r / D_r) [z > mu_r] + (via-mu share) [z == z_[1]] in the kernel (eq. 16), the positive's
  entry on the host.

Not fused (``fused_impl`` refuses them, ``train.kernel: auto`` keeps them chunked): Rankmax with k > 1 or a
per-row k (the top-k values of each row, needed for z_[k] and for t in eq. 12, would be a k-wide sorted state
per row in registers), and sparsemax (its threshold tau solves sum_i (z_i - tau)_+ = 1 from the sorted
support, an unknown number of top values).
"""

from __future__ import annotations

import torch

from bigrank.losses.fused.launch import row_grad, row_stats
from bigrank.losses.fused.modes import SOFTMAX, THRESHOLD
from bigrank.losses.rankmax import _RankmaxImpl
from bigrank.losses.softmax import _SoftmaxImpl

__all__ = ["FusedRankmaxImpl", "FusedSoftmaxImpl", "fused_impl", "unfused_reason"]


class FusedSoftmaxImpl(_SoftmaxImpl):
    """Softmax cross-entropy, -z_y + log sum_i exp(z_i), with fused statistics and backward."""

    def local_max_sum_exp(self, source) -> tuple[torch.Tensor, torch.Tensor]:
        stats = row_stats(*source.factors(), SOFTMAX)
        return stats[:, 0], stats[:, 1]

    def backward(self, source, state, layout, grad_rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """dL/dU [B, d], dL/dV [n_local, d] for per-row loss gradients ``grad_rows`` float64 [B]:
        dL/dz = g_r (softmax(z)_r - e_y)."""
        grads = row_grad(*source.factors(), SOFTMAX, state["log_normalizer"], grad_rows)
        source.add_target_terms(grads, layout, -grad_rows)
        return source.gradients(grads)


class FusedRankmaxImpl(_RankmaxImpl):
    """Rankmax cross-entropy with k = 1 (eq. 15), with fused statistics and backward."""

    def __init__(self, margin: float):
        super().__init__(1, margin)

    def local_top_and_support(self, source, guess: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        stats = row_stats(*source.factors(), THRESHOLD, mu=guess, eq=torch.full_like(guess, float("inf")))
        return stats[:, :1], stats[:, 1:3]

    def local_support_and_ties(self, source, rows: torch.Tensor, mu: torch.Tensor, kth: torch.Tensor) -> torch.Tensor:
        return row_stats(*source.factors(rows), THRESHOLD, mu=mu, eq=kth)[:, 1:4]

    def backward(self, source, state, layout, grad_rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """dL/dU, dL/dV of eq. 16 (k = 1: t = 0, no upper clip); the terms are ``grad_block``'s, in the kernel."""
        weight = grad_rows * state["active"].to(torch.float64)
        denominator, mu = state["denominator"], state["mu"]
        inv_gap = 1.0 / (layout.positive - mu)
        via_mu = weight * (inv_gap - state["support_size"] / denominator)
        # mu = z_[1] - eta (the positive is the top score): z_[1] carries mu, its ties share it equally.
        kth_carries = ~state["y_carries_mu"] & state["active"]
        eq = torch.where(kth_carries, state["kth"], torch.inf)
        share = torch.where(kth_carries, via_mu / state["ties_at_kth"], 0.0)
        grads = row_grad(*source.factors(), THRESHOLD, mu, weight / denominator, eq, share)
        source.add_target_terms(grads, layout, torch.where(state["y_carries_mu"], via_mu, 0.0) - weight * inv_gap)
        return source.gradients(grads)


def unfused_reason(impl) -> str | None:
    """Why the full-catalog loss ``impl`` has no fused kernel, or None when it has one."""
    if type(impl) is _SoftmaxImpl:
        return None
    if type(impl) is _RankmaxImpl:
        if impl.row_k is not None:
            return "rankmax with a per-row k (loss.params.k_fraction > 0) has no fused kernel"
        if impl.k != 1:
            return f"rankmax with k = {impl.k} has no fused kernel (k = 1 only)"
        return None
    return f"{type(impl).__name__.strip('_').removesuffix('Impl').lower()} has no fused kernel"


def fused_impl(impl):
    """The fused twin of the chunked full-catalog loss ``impl``; ValueError when there is none."""
    reason = unfused_reason(impl)
    if reason is not None:
        raise ValueError(f"{reason}: use train.kernel: chunked (or auto)")
    if type(impl) is _SoftmaxImpl:
        return FusedSoftmaxImpl()
    return FusedRankmaxImpl(impl.margin)
