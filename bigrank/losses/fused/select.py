"""``train.kernel``: which kernels run a full-catalog loss's step, decided once per run.

``resolve_kernel(requested, device_type, loss)`` gives a :class:`KernelChoice` (``fused`` or ``chunked`` and
why), or raises ``ConfigError`` before training starts when ``fused`` is asked for and cannot run:

* ``fused``: the Triton kernels of ``bigrank.losses.fused`` (CUDA, Triton importable, a loss with a fused
  kernel: softmax, or rankmax with k = 1 and no per-row k);
* ``chunked``: ``ChunkedScores`` blocks of ``train.chunk_size`` (the reference; the CPU path);
* ``auto``: fused where it can run, else chunked.

Speed is not measured yet (no GPU was lent when the kernels were written): ``benchmarks/gpu_checks.sh`` measures it.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

from bigrank.errors import ConfigError

__all__ = ["KERNELS", "KernelChoice", "loss_without_fused_kernel", "resolve_kernel", "triton_missing"]

# train.kernel's choices, checked here and by the config (bigrank.config imports them: this module imports no torch).
KERNELS = ("auto", "fused", "chunked")


@dataclass(frozen=True)
class KernelChoice:
    """``name``: ``"fused"`` or ``"chunked"``; ``reason``: why (for the plan line)."""

    name: str
    reason: str

    def describe(self) -> str:
        """One line for the log and plan.txt, e.g. ``kernel chunked (auto: training on cpu)``."""
        return f"kernel {self.name} ({self.reason})"


def triton_missing() -> str | None:
    """Why Triton cannot be used here, or None (found without importing it: an import may set up a GPU)."""
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed (it comes with torch's CUDA build)"
    return None


def loss_without_fused_kernel(loss) -> str | None:
    """Why the ``loss`` config section has no fused kernel, or None when it has one (softmax; rankmax with
    k = 1 and no per-row k). Reads the section only: the same rule as ``bigrank.losses.fused.losses``."""
    params = loss.params or {}
    if loss.name == "softmax":
        return None
    if loss.name == "rankmax":
        if float(params.get("k_fraction", 0.0)) > 0:
            return "rankmax with loss.params.k_fraction > 0 (a per-row k) has no fused kernel"
        if int(params.get("k", 1)) != 1:
            return f"rankmax with k = {params['k']} has no fused kernel (k = 1 only)"
        return None
    return f"{loss.name} has no fused kernel (softmax and rankmax k = 1 have)"


def resolve_kernel(requested: str, device_type: str, loss, *, check_triton: bool = True) -> KernelChoice:
    """The kernel of a run training ``loss`` (the config section) on ``device_type`` (``"cpu"``/``"cuda"``).

    ``check_triton``: whether this process's Triton counts (False in a Ray driver, whose workers may run
    elsewhere: they resolve again themselves)."""
    if requested not in KERNELS:
        raise ConfigError(f"train.kernel must be one of {', '.join(KERNELS)}; got {requested!r}")
    if requested == "chunked":
        return KernelChoice("chunked", "requested")
    from bigrank.losses.registry import FULL_CATALOG_LOSSES

    if loss.name not in FULL_CATALOG_LOSSES:
        reason = f"{loss.name} is not a full-catalog loss"
    elif device_type != "cuda":
        reason = f"training on {device_type}: the fused kernels run on CUDA"
    else:
        reason = loss_without_fused_kernel(loss) or (triton_missing() if check_triton else None)
    if reason is None:
        return KernelChoice("fused", "requested" if requested == "fused" else "auto: CUDA, triton and a fused loss")
    if requested == "fused":
        raise ConfigError(f"train.kernel=fused cannot run: {reason}; set train.kernel=chunked or auto")
    return KernelChoice("chunked", f"auto: {reason}")
