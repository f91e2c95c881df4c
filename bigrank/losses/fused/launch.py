"""Host side of the fused kernels: tile sizes, grids, and the float64 merge of the per-split row statistics.

``row_stats`` and ``row_grad`` take the factors already in the compute dtype (``U_c`` [B, d], ``V_c`` [n, d])
and return float64 per-row statistics, and float32 gradients of the factors. Nothing here allocates a tensor
with a B x n or B x chunk shape: the largest buffers are dU [B, d], dV [n, d] and the splits' statistics
[splits, B, 4].
"""

from __future__ import annotations

import os

import torch

from bigrank.losses.fused.modes import SOFTMAX

__all__ = ["MAX_DIM", "SUPPORTED_DTYPES", "row_grad", "row_stats", "tile_sizes"]

MAX_DIM = 256  # d is one register tile (padded to a power of two); a wider d would need a loop over d
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16)


def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def tile_sizes(dim: int, dtype: torch.dtype, device: torch.device) -> dict:
    """BLOCK_B, BLOCK_N, BLOCK_D and num_warps. Not tuned on a GPU yet (no GPU was lent when they were set):
    64 x 64 tiles for float32 (register-bound at d = 128), 64 x 128 for 16-bit inputs. The interpreter uses
    32 x 32 so that small test shapes span several tiles and splits."""
    block_d = max(16, 1 << (max(dim, 1) - 1).bit_length())
    if device.type != "cuda":
        return dict(BLOCK_B=32, BLOCK_N=32, BLOCK_D=block_d, num_warps=4)
    block_n = 64 if dtype == torch.float32 else 128
    return dict(BLOCK_B=64, BLOCK_N=block_n, BLOCK_D=block_d, num_warps=4 if block_d <= 64 else 8)


def _input_precision(dtype: torch.dtype) -> str:
    """ "tf32" when torch's float32 matmuls use TF32 (train.precision=tf32 sets "high"), else "ieee"."""
    if dtype == torch.float32 and torch.get_float32_matmul_precision() != "highest":
        return "tf32"
    return "ieee"


def _splits(batch: int, width: int, tiles: dict, device: torch.device) -> int:
    """Column splits of the statistics pass: enough programs to fill the GPU (4 per SM) when B alone does not."""
    row_blocks = -(-batch // tiles["BLOCK_B"])
    col_tiles = max(1, -(-width // tiles["BLOCK_N"]))
    if device.type != "cuda":
        return min(2, col_tiles)
    programs = 4 * torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(col_tiles, -(-programs // row_blocks)))


def row_stats(users: torch.Tensor, items: torch.Tensor, mode: int, mu=None, eq=None) -> torch.Tensor:
    """Per-row statistics of the scores ``users @ items.T`` ([R, d] x [n, d]) over all n columns: float64 [R, 4].

    ``mode`` ``SOFTMAX``: (max_i z_i, sum_i exp(z_i - max), 0, 0), the log-sum-exp's two numbers;
    ``THRESHOLD``: (max_i z_i, sum_i (z_i - mu_r)_+, |{i : z_i > mu_r}|, |{i : z_i == eq_r}|) for float [R]
    ``mu`` and ``eq`` (Rankmax's eq. 12 sums at the threshold of eq. 11, and the ties of the top score).
    """
    from bigrank.losses.fused import triton_tiles

    batch, width = users.shape[0], items.shape[0]
    out = torch.zeros((batch, 4), dtype=torch.float64, device=users.device)
    out[:, 0] = float("-inf")
    if batch == 0 or width == 0:
        return out
    tiles = tile_sizes(users.shape[1], users.dtype, users.device)
    splits = _splits(batch, width, tiles, users.device)
    block_n = tiles["BLOCK_N"]
    tiles_per_split = -(-width // (splits * block_n))
    cols_per_split = tiles_per_split * block_n  # a whole number of tiles per split
    splits = -(-width // cols_per_split)
    partial = torch.empty((splits, batch, 4), dtype=torch.float32, device=users.device)
    zeros = torch.zeros(batch, dtype=torch.float32, device=users.device)
    mu = zeros if mu is None else mu.to(torch.float32).contiguous()
    eq = zeros if eq is None else eq.to(torch.float32).contiguous()
    grid = (-(-batch // tiles["BLOCK_B"]), splits)
    triton_tiles.row_stats_kernel[grid](
        users, items, mu, eq, partial, batch, width, users.shape[1], users.stride(0), items.stride(0),
        cols_per_split, MODE=mode, INPUT_PRECISION=_input_precision(users.dtype),
        ROUND_SCORES=users.dtype == torch.bfloat16, INTERPRETED=_interpreted(), **tiles,
    )  # fmt: skip
    partial = partial.to(torch.float64)
    row_max = partial[..., 0].max(dim=0).values
    out[:, 0] = row_max
    if mode == SOFTMAX:
        # Each split's sum is relative to its own max; an empty split (max -inf, sum 0) adds nothing.
        scale = torch.where(partial[..., 1] > 0, torch.exp(partial[..., 0] - row_max), 0.0)
        out[:, 1] = (partial[..., 1] * scale).sum(dim=0)
    else:
        out[:, 1:] = partial[..., 1:].sum(dim=0)
    return out


def row_grad(users: torch.Tensor, items: torch.Tensor, mode: int, a, scale, eq=None, share=None):
    """(dU, dV) float32 ([R, d], [n, d]) of ``sum_ri G_ri z_ri`` with ``z = users @ items.T`` and G formed per
    tile: ``SOFTMAX`` G = scale_r exp(z - a_r); ``THRESHOLD`` G = scale_r [z > a_r] + share_r [z == eq_r].
    dU = G V and dV = G^T U, the two GEMMs of the chunked path's backward, with G never stored."""
    from bigrank.losses.fused import triton_tiles

    batch, width, dim = users.shape[0], items.shape[0], users.shape[1]
    grad_users = torch.zeros((batch, dim), dtype=torch.float32, device=users.device)
    grad_items = torch.zeros((width, dim), dtype=torch.float32, device=users.device)
    if batch == 0 or width == 0:
        return grad_users, grad_items
    tiles = tile_sizes(dim, users.dtype, users.device)
    zeros = torch.zeros(batch, dtype=torch.float32, device=users.device)
    eq = zeros if eq is None else eq.to(torch.float32).contiguous()
    share = zeros if share is None else share.to(torch.float32).contiguous()
    grid = (-(-width // tiles["BLOCK_N"]),)
    triton_tiles.row_grad_kernel[grid](
        users, items, a.to(torch.float32).contiguous(), scale.to(torch.float32).contiguous(), eq, share,
        grad_users, grad_items, batch, width, dim, users.stride(0), items.stride(0), MODE=mode,
        INPUT_PRECISION=_input_precision(users.dtype), ROUND_SCORES=users.dtype == torch.bfloat16,
        INTERPRETED=_interpreted(), **tiles,
    )  # fmt: skip
    return grad_users, grad_items
