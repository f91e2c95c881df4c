"""The item-item model (``model.kind: item_item``): a full-rank item-to-item matrix beside a low-rank one.

For a user with train items ``x`` (multi-hot, float[n]) the scores of the whole catalog are

    z(x) = s(x) * (x W + (x P) Q^T - x * diag(P Q^T)),    s(x) = |x|^(-1/2),   diag(W) = 0

``W`` [n, n] is full rank (zero at the start), ``P`` and ``Q`` [n, r] the low-rank term (r = ``model.dim``).
An item's own input never scores it (both terms lose their diagonal, as EASE's matrix does: Steck 2019,
"Embarrassingly Shallow Autoencoders", eq. 2), so every train item ``y`` of the user is a training row
``(z(x), y)`` and the user's rows share one score vector (``bigrank.losses.rankmax_shared_loss``). EASE is the
closed-form least-squares fit of ``W`` alone; a rank-r model reaches EASE truncated to rank r at best, which on
MovieLens-1M trails full-rank EASE (issue 25's note: the gap of bigrank's low-rank models is the rank).

As a dot product, for evaluation, export and serving (the diagonal term is left out: it only changes the
scores of the user's own train items, which are never recommended)::

    user vector  u(x) = s(x) * [x P, x W]        float[r + n]
    item vector  v_j  = [Q_j, e_j]               float[r + n]   (e_j: the j-th unit vector)

``n^2`` parameters (and as many gradients and Adam moments): 0.2 GB at MovieLens-1M's 3,706 items, 12 GB at
27K. :data:`MAX_ITEMS` bounds the catalog.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

__all__ = ["MAX_ITEMS", "ItemItemModel", "check_catalog_size", "multi_hot"]

MAX_ITEMS = 32_768  # 16 n^2 bytes of parameters, gradients and Adam moments: 17 GB here


def check_catalog_size(num_items: int) -> None:
    """Raise ValueError when a catalog is too large for an ``n x n`` matrix (:data:`MAX_ITEMS`)."""
    if num_items > MAX_ITEMS:
        gigabytes = 16 * num_items**2 / 1e9
        raise ValueError(
            f"model.kind item_item holds an n x n matrix: {num_items:,} items need ~{gigabytes:.0f} GB of "
            f"parameters, gradients and Adam moments (at most {MAX_ITEMS:,} items); use model.kind towers"
        )


class ItemItemModel(nn.Module):
    """Scores ``z(x)`` float[U, n] of the module docstring for multi-hot users ``x`` float[U, n].

    Args:
        num_items: catalog size n (at most :data:`MAX_ITEMS`).
        rank: r, the dimension of the low-rank term (``model.dim``).
        seed: ``P`` and ``Q`` start N(0, ``init_std``^2) from this seed; ``W`` starts at 0.
        init_std: standard deviation of the initial ``P`` and ``Q`` (small: the full-rank term leads early).

    Parameters ``full`` (W), ``inputs`` (P) and ``outputs`` (Q), float32.
    """

    def __init__(self, num_items: int, rank: int, *, seed: int = 0, init_std: float = 0.01):
        super().__init__()
        check_catalog_size(num_items)
        if rank < 1:
            raise ValueError(f"rank must be >= 1, got {rank}")
        generator = torch.Generator().manual_seed(seed)
        self.num_items, self.rank = int(num_items), int(rank)
        self.full = nn.Parameter(torch.zeros(num_items, num_items))
        self.inputs = nn.Parameter(torch.randn(num_items, rank, generator=generator) * init_std)
        self.outputs = nn.Parameter(torch.randn(num_items, rank, generator=generator) * init_std)

    @property
    def dim(self) -> int:
        """Dimension of the user and item vectors: r + n."""
        return self.rank + self.num_items

    def forward(self, history: torch.Tensor) -> torch.Tensor:
        """Scores float[U, n] of the users ``history`` float[U, n] (multi-hot: 1 at each train item)."""
        scale = _scale(history)
        self_scores = (self.inputs * self.outputs).sum(dim=1)  # an item's own input never scores it
        low_rank = (history @ self.inputs) @ self.outputs.T - history * self_scores
        return scale * (history @ self.full + low_rank)

    def user_vectors(self, history: torch.Tensor) -> torch.Tensor:
        """``s(x) [x P, x W]`` float[U, r + n] of multi-hot users ``history`` float[U, n]."""
        return _scale(history) * torch.cat([history @ self.inputs, history @ self.full], dim=1)

    def item_vectors(self, start: int, stop: int) -> torch.Tensor:
        """``[Q_j, e_j]`` float[stop - start, r + n] of items ``start <= j < stop``."""
        rows = torch.zeros(stop - start, self.dim, dtype=self.outputs.dtype, device=self.outputs.device)
        rows[:, : self.rank] = self.outputs[start:stop]
        rows[:, self.rank :].diagonal(offset=start).fill_(1.0)
        return rows

    def squared_norm(self) -> torch.Tensor:
        """``||W||^2 + ||P||^2 + ||Q||^2`` (the L2 penalty's sum)."""
        return self.full.pow(2).sum() + self.inputs.pow(2).sum() + self.outputs.pow(2).sum()

    @torch.no_grad()
    def zero_diagonal(self) -> None:
        """Keep ``diag(W) = 0`` (after each update: an item's own input must never score it)."""
        self.full.diagonal().zero_()


def _scale(history: torch.Tensor) -> torch.Tensor:
    return history.sum(dim=1, keepdim=True).clamp_min(1.0).rsqrt()


def multi_hot(history: tuple[np.ndarray, np.ndarray], users: torch.Tensor, num_items: int) -> torch.Tensor:
    """float32[len(users), num_items]: 1 at each train item of each user, from the train split's CSR
    ``(indptr int64[U + 1], items int64[nnz])`` (``bigrank.data.stream.read_user_items``)."""
    indptr, items = history
    users = np.asarray(users, dtype=np.int64)
    starts, stops = indptr[users], indptr[users + 1]
    lengths = stops - starts
    rows = np.repeat(np.arange(len(users), dtype=np.int64), lengths)
    offsets = np.arange(int(lengths.sum()), dtype=np.int64) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    columns = items[np.repeat(starts, lengths) + offsets]
    dense = torch.zeros(len(users), num_items)
    dense[torch.from_numpy(rows), torch.from_numpy(np.asarray(columns, dtype=np.int64))] = 1.0
    return dense
