"""``FusedScores``: the lazy scores ``U @ V.T`` of a full-catalog loss whose step runs as fused Triton kernels.

``kernel_scores(..., kernel="fused")`` returns it (``train.kernel``). To the losses it is a score source like
``ChunkedScores`` (the positive's score, the non-finite check and the item-parallel layout are the same code);
``catalog_loss_rows`` asks it to :meth:`FusedScores.fuse` the loss, which swaps in the loss's fused statistics
and gradient (``bigrank.losses.fused.losses``) or refuses a loss that has none.
"""

from __future__ import annotations

import torch

from bigrank.losses.fused.launch import MAX_DIM, SUPPORTED_DTYPES
from bigrank.losses.scores import ChunkedScores, score_matrix

__all__ = ["FusedScores", "kernel_scores"]


def kernel_scores(
    user_vectors: torch.Tensor,
    item_rows: torch.Tensor,
    chunk_size: int | str | None = None,
    dtype: torch.dtype | None = None,
    kernel: str = "chunked",
):
    """The scores ``user_vectors @ item_rows.T`` ([B, d] x [n, d]) of a full-catalog loss for ``train.kernel``
    (resolved: ``"fused"`` or ``"chunked"``): :class:`FusedScores` (``chunk_size`` unused), or
    ``score_matrix(user_vectors, item_rows, chunk_size, dtype)``."""
    if kernel == "fused":
        return FusedScores(user_vectors, item_rows, dtype)
    if kernel != "chunked":
        raise ValueError(f"kernel must be 'chunked' or 'fused', got {kernel!r}")
    return score_matrix(user_vectors, item_rows, chunk_size, dtype)


class FusedScores(ChunkedScores):
    """Scores ``user_vectors @ item_rows.T`` ([B, d] x [n_local, d]) that only the fused kernels read.

    ``compute_dtype``: the GEMMs' input dtype (float32 or bfloat16; None: the factors'); gradients of
    both factors come back in their dtype. ``blocks()`` (inherited) is the chunked reference, one block of all
    columns: the fused losses never call it.
    """

    def __init__(self, user_vectors: torch.Tensor, item_rows: torch.Tensor, compute_dtype: torch.dtype | None = None):
        super().__init__(user_vectors, item_rows, max(1, item_rows.shape[0]), compute_dtype)
        if self.compute_dtype not in SUPPORTED_DTYPES:
            names = ", ".join(str(dtype).removeprefix("torch.") for dtype in SUPPORTED_DTYPES)
            raise ValueError(f"the fused kernels compute in {names}, not {self.compute_dtype}")
        if user_vectors.shape[1] > MAX_DIM:
            raise ValueError(
                f"the fused kernels hold d in one tile: d must be <= {MAX_DIM}, got {user_vectors.shape[1]}"
            )

    @property
    def params(self) -> tuple:
        return (self.compute_dtype,)

    def factors(self, rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(U_c [R, d], V_c [n_local, d]) contiguous in the compute dtype, the kernels' inputs (``rows``: a subset)."""
        users = self.user_vectors if rows is None else self.user_vectors[rows]
        return users.to(self.compute_dtype).contiguous(), self.item_rows.to(self.compute_dtype).contiguous()

    def fuse(self, impl):
        """The fused twin of the full-catalog loss ``impl`` (ValueError for a loss without one)."""
        from bigrank.losses.fused.losses import fused_impl

        return fused_impl(impl)

    def add_target_terms(self, grads: tuple[torch.Tensor, torch.Tensor], layout, values: torch.Tensor) -> None:
        """Add ``values[b]`` float64 [B] at each owned row's positive to the gradient: dU[b] += values_b V[y_b]
        and dV[y_b] += values_b U[b] (the sparse part of dL/dscores; rows whose positive is on another rank
        add 0, without a host sync)."""
        if self.num_local == 0:
            return
        grad_users, grad_items = grads
        users, items = self.factors()
        values = torch.where(layout.owned, values, torch.zeros_like(values)).to(torch.float32).unsqueeze(1)
        grad_users += values * items[layout.local_target].to(torch.float32)
        grad_items.index_add_(0, layout.local_target, values * users.to(torch.float32))

    def gradients(self, grads: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """The float32 kernel gradients in the factors' dtypes."""
        return grads[0].to(self.user_vectors.dtype), grads[1].to(self.item_rows.dtype)
