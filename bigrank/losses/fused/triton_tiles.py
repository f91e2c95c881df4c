"""The Triton kernels of the fused full-catalog step: scores ``U @ V.T`` tile by tile, never stored.

Two kernels serve every fused loss; a ``MODE`` (compile-time) picks the row statistics and the gradient:

* ``row_stats_kernel``, grid (row blocks, column splits): each program holds a [BLOCK_B, d] tile of U, walks
  its share of the items in [BLOCK_N, d] tiles, computes the [BLOCK_B, BLOCK_N] scores in registers and folds
  them into per-row statistics. It writes ``out[split, row, :]`` (float32, 4 numbers a row): the host merges
  the splits in float64 (a few numbers per row, never [B, n]).

  - ``SOFTMAX``: (max_i z_i, sum_i exp(z_i - max)), the online log-sum-exp (Milakov & Gimelshein 2018);
  - ``THRESHOLD``: (max_i z_i, sum_i (z_i - mu_r)_+, |{i : z_i > mu_r}|, |{i : z_i == eq_r}|): Rankmax's
    eq. 12 sums for k = 1 at a threshold mu_r known before the pass (eq. 11: mu = z_y - eta), and in its second
    pass (rows whose positive is the top score: mu = z_[1] - eta) the ties of z_[1] that share mu's gradient.
    Rankmax k = 1 needs no search for its threshold: t = 0, alpha = 1 / sum.

* ``row_grad_kernel``, grid (item tiles): each program holds a [BLOCK_N, d] tile of V, walks every row block,
  recomputes its scores, forms G = dL/dscores in registers and accumulates dV_tile = G^T U in registers (one
  store at the end) and dU += G V_tile with atomic adds (FlashAttention-2's backward does dQ the same way):
  four GEMMs in all per step with the statistics pass, against the chunked path's three plus its HBM traffic.

  - ``SOFTMAX``: G = scale_r exp(z - a_r) (a_r the log-sum-exp);
  - ``THRESHOLD``: G = scale_r [z > a_r] + share_r [z == eq_r] (Rankmax k = 1's bulk, eq. 16).

  The gradient's one entry per row at the positive (-scale_r, or Rankmax's via-mu term) is added by the host:
  it is sparse.

Precision: GEMM inputs are in the compute dtype (float32, or bfloat16 for ``train.precision=bf16``),
accumulators float32; bf16 scores are rounded to bfloat16 before use (``ROUND_SCORES``), so that the
thresholds compare the same values as the chunked path's score blocks; G is cast to the compute dtype for its
two GEMMs, as the chunked path's gradient blocks are. ``INTERPRETED`` (``TRITON_INTERPRET=1``) works around two
interpreter gaps with bfloat16 (its dot and its rounding cast), computing the same values. ``INPUT_PRECISION``
is "ieee" for true float32 GEMMs and "tf32" under ``train.precision=tf32``.

Imported only when a fused kernel runs (Triton is optional, and ``TRITON_INTERPRET=1`` must be set before it is
imported to run these kernels on CPU tensors).
"""

from __future__ import annotations

import triton
import triton.language as tl

from bigrank.losses.fused.modes import SOFTMAX, THRESHOLD  # noqa: F401 - the kernels compare MODE with 0 / 1


@triton.jit
def _round_bf16(x):
    """float32 ``x`` rounded to the nearest bfloat16 (ties to even), kept in float32: bit arithmetic, because
    the interpreter's float32 -> bfloat16 cast truncates where CUDA's rounds (finite inputs)."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _dot(a, b, INPUT_PRECISION: tl.constexpr, INTERPRETED: tl.constexpr):
    """``a @ b`` accumulated in float32. The interpreter multiplies bfloat16 inputs as raw integers, so there
    they are widened first (exact: a product of two bfloat16 values is exact in float32)."""
    if INTERPRETED:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b, input_precision=INPUT_PRECISION)


@triton.jit
def _scores(
    u, v_ptr, cols, dims, stride_v, n_stop, D,
    INPUT_PRECISION: tl.constexpr, ROUND_SCORES: tl.constexpr, INTERPRETED: tl.constexpr,
):  # fmt: skip
    """The [BLOCK_B, BLOCK_N] scores of a U tile against the item rows ``cols`` (float32), and the valid columns."""
    col_ok = cols < n_stop
    v = tl.load(v_ptr + cols[:, None] * stride_v + dims[None, :], mask=col_ok[:, None] & (dims[None, :] < D), other=0.0)
    s = _dot(u, tl.trans(v), INPUT_PRECISION, INTERPRETED)
    if ROUND_SCORES:  # the chunked path's score blocks are bfloat16
        s = _round_bf16(s)
    return s, col_ok


@triton.jit
def row_stats_kernel(
    u_ptr, v_ptr, mu_ptr, eq_ptr, out_ptr,
    B, N, D, stride_u, stride_v, cols_per_split,
    MODE: tl.constexpr, INPUT_PRECISION: tl.constexpr, ROUND_SCORES: tl.constexpr, INTERPRETED: tl.constexpr,
    BLOCK_B: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    pid_b = tl.program_id(0)
    pid_s = tl.program_id(1)
    rows = pid_b * BLOCK_B + tl.arange(0, BLOCK_B)
    dims = tl.arange(0, BLOCK_D)
    row_ok = rows < B
    u = tl.load(u_ptr + rows[:, None] * stride_u + dims[None, :], mask=row_ok[:, None] & (dims[None, :] < D), other=0.0)
    mu = tl.load(mu_ptr + rows, mask=row_ok, other=0.0)
    eq = tl.load(eq_ptr + rows, mask=row_ok, other=0.0)
    start = pid_s * cols_per_split
    stop = tl.minimum(start + cols_per_split, N)
    row_max = tl.full((BLOCK_B,), float("-inf"), tl.float32)
    total = tl.zeros((BLOCK_B,), tl.float32)
    count = tl.zeros((BLOCK_B,), tl.float32)
    ties = tl.zeros((BLOCK_B,), tl.float32)
    for col0 in range(start, stop, BLOCK_N):
        cols = col0 + tl.arange(0, BLOCK_N)
        s, col_ok = _scores(u, v_ptr, cols, dims, stride_v, stop, D, INPUT_PRECISION, ROUND_SCORES, INTERPRETED)
        s = tl.where(col_ok[None, :], s, float("-inf"))  # a column past the split: below every threshold
        new_max = tl.maximum(row_max, tl.max(s, axis=1))
        if MODE == 0:
            # Every tile holds a valid column, so new_max is finite and exp(-inf - new_max) is 0.
            total = total * tl.exp(row_max - new_max) + tl.sum(tl.exp(s - new_max[:, None]), axis=1)
        else:
            over = s > mu[:, None]
            total += tl.sum(tl.where(over, s - mu[:, None], 0.0), axis=1)
            count += tl.sum(over.to(tl.float32), axis=1)
            ties += tl.sum((s == eq[:, None]).to(tl.float32), axis=1)
        row_max = new_max
    base = out_ptr + (pid_s * B + rows) * 4
    tl.store(base, row_max, mask=row_ok)
    tl.store(base + 1, total, mask=row_ok)
    tl.store(base + 2, count, mask=row_ok)
    tl.store(base + 3, ties, mask=row_ok)


@triton.jit
def row_grad_kernel(
    u_ptr, v_ptr, a_ptr, scale_ptr, eq_ptr, share_ptr, du_ptr, dv_ptr,
    B, N, D, stride_u, stride_v,
    MODE: tl.constexpr, INPUT_PRECISION: tl.constexpr, ROUND_SCORES: tl.constexpr, INTERPRETED: tl.constexpr,
    BLOCK_B: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    pid_n = tl.program_id(0)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < D
    v = tl.load(v_ptr + cols[:, None] * stride_v + dims[None, :], mask=(cols < N)[:, None] & dim_ok[None, :], other=0.0)
    grad_v = tl.zeros((BLOCK_N, BLOCK_D), tl.float32)
    for row0 in range(0, B, BLOCK_B):
        rows = row0 + tl.arange(0, BLOCK_B)
        row_ok = rows < B
        mask_u = row_ok[:, None] & dim_ok[None, :]
        u = tl.load(u_ptr + rows[:, None] * stride_u + dims[None, :], mask=mask_u, other=0.0)
        s, col_ok = _scores(u, v_ptr, cols, dims, stride_v, N, D, INPUT_PRECISION, ROUND_SCORES, INTERPRETED)
        a = tl.load(a_ptr + rows, mask=row_ok, other=0.0)
        scale = tl.load(scale_ptr + rows, mask=row_ok, other=0.0)
        if MODE == 0:
            g = scale[:, None] * tl.exp(s - a[:, None])
        else:
            eq = tl.load(eq_ptr + rows, mask=row_ok, other=0.0)
            share = tl.load(share_ptr + rows, mask=row_ok, other=0.0)
            g = tl.where(s > a[:, None], scale[:, None], 0.0) + tl.where(s == eq[:, None], share[:, None], 0.0)
        g = tl.where(row_ok[:, None] & col_ok[None, :], g, 0.0)
        if ROUND_SCORES and INTERPRETED:  # G in bfloat16, as the chunked path's gradient blocks
            g = _round_bf16(g)
        else:
            g = g.to(u.dtype)
        grad_v += _dot(tl.trans(g), u, INPUT_PRECISION, INTERPRETED)
        grad_u = _dot(g, v, INPUT_PRECISION, INTERPRETED)
        tl.atomic_add(du_ptr + rows[:, None] * D + dims[None, :], grad_u, mask=mask_u)
    tl.store(dv_ptr + cols[:, None] * D + dims[None, :], grad_v, mask=(cols < N)[:, None] & dim_ok[None, :])
