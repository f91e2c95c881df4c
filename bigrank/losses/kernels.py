"""Row-wise passes over large score blocks, fused when it pays.

A full-catalog loss touches the [B, n] score matrix a few times per step (top-k, a thresholded sum, the
gradient). In eager PyTorch each pass allocates B x n temporaries and makes several trips through memory
(e.g. ``(z - mu).clamp_min(0)``, ``.sum``, ``count_nonzero``); at B = 256, n = 849K these cost more than the
GEMMs themselves. For blocks of at least ``COMPILE_MIN_ELEMENTS`` entries the same functions are compiled with
``torch.compile`` (inductor: one fused loop per pass, float64 accumulators in registers); small blocks, and any
machine where compilation fails, use the eager versions, which compute the same values.

``COMPILE_MIN_ELEMENTS`` is 2^18 (``python -m benchmarks.bench_kernels``, d 64, one full step: GEMM, loss,
backward): from 256K entries up the compiled step of rankmax and softmax measured 1.4-3.6x faster than eager on
one or two threads, and the ~3.5 s a process spends compiling is repaid in 40-3,400 steps; at 64K entries the
two tie. It used to be 2^22, which sent a 2-worker ml-latest-small run's half-size blocks (256 x 9,742) to the
eager kernels while the 1-worker run's 512 x 9,742 compiled: half of the gap between 2 workers and 1 (issue
26). ML-1M's blocks (512 x 3,706) ran eager even on one worker.

Set ``BIGRANK_COMPILE=0`` to force eager, ``BIGRANK_COMPILE=1`` to compile whatever the size (tests). On CUDA
the compiled kernels are Triton kernels.

Low-precision blocks (bfloat16/float16 scores) are compared, shifted and exponentiated in float32 (thresholds,
shifts and scales are passed in float32; the upcast is fused into the compiled kernels) and summed in
float64; gradients come back in the block's dtype. float32 and float64 blocks are computed as before.
"""

from __future__ import annotations

import os
import warnings

import torch

__all__ = [
    "COMPILE_MIN_ELEMENTS",
    "exp_grad",
    "masked_scale",
    "max_and_sum_exp",
    "max_support_sum_count",
    "relu_grad",
    "relu_square_sum",
    "sigmoid_grad",
    "sigmoid_sums",
    "support_sum_count",
    "topk_values",
]

COMPILE_MIN_ELEMENTS = 1 << 18
_compiled: dict[str, object] = {}
_compile_failed = False


def _mode() -> str:
    return os.environ.get("BIGRANK_COMPILE", "auto").strip().lower()


def _run(name: str, eager, *args):
    """Run ``eager(*args)``, or its compiled twin when the first argument is large enough."""
    global _compile_failed
    mode = _mode()
    big = args[0].numel() >= COMPILE_MIN_ELEMENTS
    if _compile_failed or mode in ("0", "false", "off", "eager") or (mode == "auto" and not big):
        return eager(*args)
    function = _compiled.get(name)
    if function is None:
        function = _compiled[name] = torch.compile(eager, dynamic=True)
    try:
        return function(*args)
    except Exception as error:  # noqa: BLE001 - no compiler, unsupported backend: fall back, keep training
        _compile_failed = True
        warnings.warn(f"bigrank: torch.compile of loss kernels failed ({error!r}); using eager kernels", stacklevel=2)
        return eager(*args)


def _stat_dtype(block: torch.Tensor) -> torch.dtype:
    """The dtype row statistics are computed in: at least float32 (bf16 scores are compared in float32)."""
    return torch.promote_types(block.dtype, torch.float32)


def _support_sum_count(block: torch.Tensor, mu: torch.Tensor):
    shifted = block.to(mu.dtype) - mu.unsqueeze(1)
    # sum(dtype=float64) accumulates in float64 without a float64 copy of the block (eager: the copies were
    # most of the pass at demo sizes); the count is exact in int64.
    count = (shifted > 0).sum(dim=1).to(torch.float64)
    return shifted.clamp_min_(0).sum(dim=1, dtype=torch.float64), count


def support_sum_count(block: torch.Tensor, mu: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sum_i (z_i - mu)_+, |{i : z_i > mu}|)`` per row: float64 [R], float64 [R] for ``block`` [R, c]."""
    return _run("support_sum_count", _support_sum_count, block, mu.to(_stat_dtype(block)))


def _max_support_sum_count(block: torch.Tensor, mu: torch.Tensor):
    support_sum, count = _support_sum_count(block, mu)  # compiled together with the max: one loop over the block
    return block.to(mu.dtype).amax(dim=1).to(torch.float64), support_sum, count


def max_support_sum_count(block: torch.Tensor, mu: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(max_i z_i, sum_i (z_i - mu)_+, |{i : z_i > mu}|)`` per row, float64 [R] each, for ``block`` [R, c]
    (c >= 1): Rankmax k = 1's first pass in one read of the block (the max and the support sums were two
    passes; on a GPU each is a trip through memory of the whole block)."""
    return _run("max_support_sum_count", _max_support_sum_count, block, mu.to(_stat_dtype(block)))


def _masked_scale(block, lower, upper, scale):
    wide = block.to(lower.dtype)
    inside = (wide > lower.unsqueeze(1)) & (wide < upper.unsqueeze(1))
    return (inside.to(scale.dtype) * scale.unsqueeze(1)).to(block.dtype)


def masked_scale(block: torch.Tensor, lower: torch.Tensor, upper: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``scale_r * [lower_r < z_ri < upper_r]`` for ``block`` [R, c]: the Rankmax gradient's bulk."""
    dtype = _stat_dtype(block)
    return _run("masked_scale", _masked_scale, block, lower.to(dtype), upper.to(dtype), scale.to(dtype))


def _max_and_sum_exp(block):
    wide = block.to(torch.promote_types(block.dtype, torch.float32))
    row_max = wide.amax(dim=1)
    return row_max.to(torch.float64), torch.exp(wide - row_max.unsqueeze(1)).sum(dim=1, dtype=torch.float64)


def max_and_sum_exp(block: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(max_i z_i, sum_i exp(z_i - max))`` per row of ``block`` [R, c] (c >= 1), float64."""
    return _run("max_and_sum_exp", _max_and_sum_exp, block)


def _exp_grad(block, shift, scale):
    return (torch.exp(block.to(shift.dtype) - shift.unsqueeze(1)) * scale.unsqueeze(1)).to(block.dtype)


def exp_grad(block: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``scale_r * exp(z_ri - shift_r)``: softmax's gradient with ``shift`` = log-sum-exp."""
    dtype = _stat_dtype(block)
    return _run("exp_grad", _exp_grad, block, shift.to(dtype), scale.to(dtype))


def _relu_square_sum(block, tau):
    return (block.to(tau.dtype) - tau.unsqueeze(1)).clamp_min(0).to(torch.float64).square().sum(dim=1)


def relu_square_sum(block: torch.Tensor, tau: torch.Tensor) -> torch.Tensor:
    """``sum_i (z_i - tau)_+^2`` per row, float64 [R]."""
    return _run("relu_square_sum", _relu_square_sum, block, tau.to(_stat_dtype(block)))


def _relu_grad(block, tau, scale):
    return ((block.to(tau.dtype) - tau.unsqueeze(1)).clamp_min(0) * scale.unsqueeze(1)).to(block.dtype)


def relu_grad(block: torch.Tensor, tau: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``scale_r * (z_ri - tau_r)_+``: sparsemax's gradient."""
    dtype = _stat_dtype(block)
    return _run("relu_grad", _relu_grad, block, tau.to(dtype), scale.to(dtype))


def _sigmoid_sums(block, anchor, tau):
    sig = torch.sigmoid((block - anchor.unsqueeze(1)) / tau)
    return sig.to(torch.float64).sum(dim=1), (sig * (1 - sig)).to(torch.float64).sum(dim=1)


def sigmoid_sums(block: torch.Tensor, anchor: torch.Tensor, tau: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sum_i s_ri, sum_i s_ri (1 - s_ri))`` with ``s = sigmoid((z_ri - anchor_r) / tau)``, float64 [R] each:
    Smooth-AP's soft rank and its derivative sum."""
    # tau as a 0-d tensor: a scheduled temperature must not recompile the kernel every step.
    return _run(
        "sigmoid_sums", _sigmoid_sums, block, anchor.to(block.dtype), torch.tensor(float(tau), dtype=block.dtype)
    )


def _sigmoid_grad(block, anchor, tau, scale):
    sig = torch.sigmoid((block - anchor.unsqueeze(1)) / tau)
    return sig * (1 - sig) * scale.unsqueeze(1)


def sigmoid_grad(block: torch.Tensor, anchor: torch.Tensor, tau: float, scale: torch.Tensor) -> torch.Tensor:
    """``scale_r * s_ri (1 - s_ri)`` with ``s = sigmoid((z_ri - anchor_r) / tau)``: Smooth-AP's gradient block."""
    tau = torch.tensor(float(tau), dtype=block.dtype)
    return _run("sigmoid_grad", _sigmoid_grad, block, anchor.to(block.dtype), tau, scale.to(block.dtype))


def topk_values(block: torch.Tensor, k: int) -> torch.Tensor:
    """The ``k`` largest values of each row of ``block`` [R, c] (descending), O(c) for c >> k.

    Two stages: the maxima of column groups of size g, then an exact top-k among the k groups with the largest
    maxima (they hold every top-k value: a value outside them has at least k larger group maxima above it).
    """
    rows, width = block.shape
    k = min(k, width)
    if k == 1:
        return block.amax(dim=1, keepdim=True)
    group = max(64, int((width / k) ** 0.5))
    groups = width // group
    if groups <= 2 * k:
        return block.topk(k, dim=1).values
    head = block[:, : groups * group].reshape(rows, groups, group)
    best_groups = head.amax(dim=2).topk(k, dim=1).indices
    candidates = head.gather(1, best_groups.unsqueeze(2).expand(rows, k, group)).reshape(rows, k * group)
    candidates = torch.cat([candidates, block[:, groups * group :]], dim=1)
    return candidates.topk(k, dim=1).values
