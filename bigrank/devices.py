"""Which device a worker trains on, the checks that run before training starts, and the precision set-up.

Three steps, in this order:

1. :func:`check_devices` — in the driver, before any worker starts (``bigrank train`` / ``submit`` pre-flight):
   resolves ``train.device`` and fails with :class:`DeviceError` (saying what to change) when a GPU is requested
   on a CPU-only torch build or a machine without one, when the number of GPUs does not match the workers, or
   when ``train.precision`` makes no sense on the device.
2. :func:`worker_device` — in each worker, after ``init_process_group``: the one device of this worker.
   Under Ray Train it is ``ray.train.torch.get_device()``: Ray sets ``CUDA_VISIBLE_DEVICES`` per worker, so
   ``LOCAL_RANK`` is not the device index there (ray issues #28996, #30063). Under the local launcher it is
   ``cuda:LOCAL_RANK``. ``cpu`` when no GPU is requested. The worker's current CUDA device is set to it
   (nccl, torchrec and ``all_gather_object`` use the current device).
3. :func:`setup_precision` — in each worker: the matmul mode for ``train.precision`` and the dtype scores are
   computed in (:class:`Precision`).

:func:`use_certified_bf16` says whether full-catalog ranking (evaluation, ``recommend``, the exact index of
``serve``) scores in bf16 and certifies the fp32 top-K (``bigrank.model.topk``): on a CPU with native bf16
GEMMs (:func:`cpu_bf16_gemm`) unless turned off (``eval.certified_bf16: false``).

``train.device: auto`` is cuda when ``ray.gpus_per_worker > 0`` (Ray launcher) or when the local launcher
sees a GPU (``torch.cuda.device_count() > 0``; hide GPUs with ``CUDA_VISIBLE_DEVICES=""`` to train on CPU).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

import torch

from bigrank.config import DEVICES, PRECISIONS

__all__ = [
    "DEVICES",
    "PRECISIONS",
    "resolve_precision",
    "DeviceError",
    "Precision",
    "check_devices",
    "check_ray_gpus",
    "cpu_bf16_gemm",
    "use_certified_bf16",
    "process_group_backend",
    "resolve_device_type",
    "setup_precision",
    "worker_device",
]

LAUNCHERS = ("local", "ray")


class DeviceError(ValueError):
    """A device or precision request this machine (or cluster) cannot honour; the message says what to change."""


def cuda_build() -> str | None:
    """The CUDA version torch was built with, or None for a CPU-only build (``torch.version.cuda``)."""
    return torch.version.cuda


def visible_gpus() -> int:
    """GPUs this process can see (0 on a CPU-only build; honours ``CUDA_VISIBLE_DEVICES``)."""
    if cuda_build() is None:
        return 0
    return torch.cuda.device_count()


def resolve_device_type(device: str, launcher: str, gpus_per_worker: float, gpu_count: int) -> str:
    """``"cpu"`` or ``"cuda"`` for a ``train.device`` value (``auto``/``cpu``/``cuda``).

    ``auto``: under Ray, cuda when ``gpus_per_worker > 0``; under the local launcher, cuda when ``gpu_count``
    (the GPUs the launcher sees) is > 0. No checks here: see :func:`check_devices`.
    """
    if device not in DEVICES:
        raise DeviceError(f"train.device must be one of {', '.join(DEVICES)}; got {device!r}")
    if launcher not in LAUNCHERS:
        raise ValueError(f"launcher must be one of {', '.join(LAUNCHERS)}; got {launcher!r}")
    if device != "auto":
        return device
    if launcher == "ray":
        return "cuda" if gpus_per_worker > 0 else "cpu"
    return "cuda" if gpu_count > 0 else "cpu"


def check_devices(
    config,
    launcher: str,
    *,
    gpu_count: int | None = None,
    cuda_version: str | None | bool = False,
) -> str:
    """Pre-flight of ``config.train.device``/``train.precision`` in the driver; returns ``"cpu"`` or ``"cuda"``.

    Args:
        config: a validated ``bigrank.config.Config``.
        launcher: ``"local"`` (``workers`` processes on this machine) or ``"ray"`` (Ray Train workers, which
            may run on other machines: this machine's GPUs are not counted; see :func:`check_ray_gpus`).
        gpu_count, cuda_version: what this machine has (default: :func:`visible_gpus`, :func:`cuda_build`);
            tests pass them to describe another machine.
    Raises DeviceError, before any worker starts, for: a GPU requested on a CPU-only torch build (local
    launcher), or on a machine without GPUs, fewer GPUs than local workers, ``train.device=cuda`` under Ray
    with ``ray.gpus_per_worker`` other than 1, ``train.device=cpu`` with GPUs reserved, ``tf32`` or the fused
    ``adam`` user optimizer on CPU, ``train.kernel=fused`` where it cannot run (``bigrank.losses.fused.select``).
    """
    gpus_per_worker = float(config.ray.gpus_per_worker)
    workers = int(config.workers)
    if cuda_version is False:
        cuda_version = cuda_build()
    if gpu_count is None:
        gpu_count = visible_gpus() if launcher == "local" else 0
    kind = resolve_device_type(config.train.device, launcher, gpus_per_worker, gpu_count)
    if kind == "cuda":
        if launcher == "local":
            if cuda_version is None:
                raise DeviceError(
                    f"train.device={config.train.device} asks for a GPU, but torch {torch.__version__} is a "
                    "CPU-only build: install the CUDA stack (make setup-cuda, requirements-cuda.txt) or set "
                    "train.device=cpu"
                )
            if gpu_count == 0:
                where = os.environ.get("CUDA_VISIBLE_DEVICES")
                hint = f" (CUDA_VISIBLE_DEVICES={where!r})" if where is not None else ""
                raise DeviceError(
                    f"train.device={config.train.device} asks for a GPU, but this machine has none visible{hint}: "
                    "set train.device=cpu"
                )
            if gpu_count < workers:
                raise DeviceError(
                    f"workers={workers} local processes need one GPU each, but this machine has {gpu_count}: "
                    f"set workers={gpu_count} (and a train.batch_size divisible by it) or train.device=cpu"
                )
        elif gpus_per_worker != 1:
            # 0: Ray gives the worker no GPU; < 1: several nccl ranks on one GPU (nccl refuses); > 1: a worker
            # drives one device, the others would idle.
            raise DeviceError(
                f"train.device={config.train.device} under Ray needs ray.gpus_per_worker=1 (one GPU per worker), "
                f"got {config.ray.gpus_per_worker:g}"
            )
    elif gpus_per_worker > 0 and launcher == "ray":
        raise DeviceError(
            f"train.device=cpu with ray.gpus_per_worker={config.ray.gpus_per_worker:g} reserves GPUs that would "
            "stay idle: set ray.gpus_per_worker=0 or train.device=cuda"
        )
    if kind == "cpu" and config.train.precision == "tf32":
        raise DeviceError("train.precision=tf32 is a CUDA tensor-core mode: use fp32 or bf16 on CPU")
    if kind == "cpu" and config.optim.user_optimizer == "adam":
        raise DeviceError(
            "optim.user_optimizer=adam runs in fbgemm's fused CUDA kernels only (training on cpu here): use sgd, "
            "adagrad or rowwise_adagrad, or train on GPUs"
        )
    from bigrank.losses.fused.select import resolve_kernel

    resolve_kernel(config.train.kernel, kind, config.loss, check_triton=launcher == "local")  # fused that can't run
    return kind


def check_ray_gpus(config, cluster_gpus: float) -> None:
    """Raise DeviceError when the Ray cluster has fewer GPUs than ``workers * ray.gpus_per_worker``.

    Call after connecting to the cluster (``ray.cluster_resources().get("GPU", 0)``): without it Ray Train
    waits for the missing GPUs forever instead of failing. Autoscaling clusters may add GPU nodes later; this
    check is for fixed clusters and says so.
    """
    needed = config.workers * config.ray.gpus_per_worker
    if needed > 0 and cluster_gpus < needed:
        raise DeviceError(
            f"workers={config.workers} x ray.gpus_per_worker={config.ray.gpus_per_worker:g} need {needed:g} GPUs, "
            f"but the Ray cluster has {cluster_gpus:g}: lower workers, add GPU nodes, or set "
            "ray.gpus_per_worker=0 and train.device=cpu"
        )


def _in_ray_worker() -> bool:
    """True inside a Ray actor (Ray Train runs the training function in one actor per worker); False in a
    driver and in the local launcher's processes (which never import ray)."""
    ray = sys.modules.get("ray")
    return ray is not None and ray.is_initialized() and ray.get_runtime_context().get_actor_id() is not None


def worker_device(device: str = "auto", *, launcher: str | None = None) -> torch.device:
    """The device of this worker (call in every worker after ``init_process_group``; sets the current CUDA
    device).

    Args:
        device: ``train.device`` (``auto``/``cpu``/``cuda``).
        launcher: ``"ray"`` or ``"local"``; None: ``"ray"`` inside a Ray worker process, else ``"local"``.
    Returns ``cpu``, or ``cuda:i``: from ``ray.train.torch.get_device()`` under Ray, ``cuda:LOCAL_RANK``
    under the local launcher. Raises DeviceError when a GPU is requested and this worker has none (a CPU-only
    build, no visible GPU, LOCAL_RANK beyond the visible GPUs, or a Ray worker given no GPU).
    """
    launcher = launcher or ("ray" if _in_ray_worker() else "local")
    gpus = visible_gpus()
    if launcher == "ray":
        from ray.train.torch import get_device

        ray_device = torch.device(get_device())
        kind = ray_device.type if device == "auto" else resolve_device_type(device, "ray", 0.0, gpus)
        if kind == "cpu":
            return torch.device("cpu")
        if ray_device.type != "cuda":
            raise DeviceError(
                f"train.device={device} but Ray gave this worker no GPU ({ray_device}): set ray.gpus_per_worker=1"
            )
        chosen = ray_device
    else:
        kind = resolve_device_type(device, "local", 0.0, gpus)
        if kind == "cpu":
            return torch.device("cpu")
        if cuda_build() is None:
            raise DeviceError(
                f"train.device={device} asks for a GPU, but torch {torch.__version__} is a CPU-only build: "
                "install requirements-cuda.txt (make setup-cuda) or set train.device=cpu"
            )
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        if local_rank >= gpus:
            raise DeviceError(
                f"local rank {local_rank} needs GPU cuda:{local_rank}, but this process sees {gpus} GPU(s): "
                "start at most one worker per GPU, or set train.device=cpu"
            )
        chosen = torch.device("cuda", local_rank)
    torch.cuda.set_device(chosen)
    return chosen


def process_group_backend(device_type: str) -> str:
    """The ``init_process_group`` backend for workers on ``device_type``: ``gloo`` on CPU, and on CUDA
    ``cpu:gloo,cuda:nccl`` — nccl carries the CUDA tensors, gloo the CPU ones (control traffic: layout
    checks, checkpoint metadata); Ray's ``TorchConfig(backend=...)`` accepts the same string (ray 2.60)."""
    if device_type == "cpu":
        return "gloo"
    if device_type == "cuda":
        return "cpu:gloo,cuda:nccl"
    raise ValueError(f"device_type must be cpu or cuda, got {device_type!r}")


@dataclass(frozen=True)
class Precision:
    """How scores are computed for ``train.precision``.

    ``score_dtype``: the dtype of the score GEMM's inputs and output (``torch.bfloat16`` for ``bf16``, else
    ``torch.float32``); pass it to ``score_matrix(..., dtype=)``. The
    parameters, their gradients and optimizer states stay float32; the losses' per-row statistics
    (thresholds, sums, log-sum-exp) are accumulated in float64 whatever the score dtype.
    ``matmul``: the float32 matmul mode set (``torch.set_float32_matmul_precision``): ``"highest"`` (true
    fp32) for fp32 and bf16, ``"high"`` (TF32 tensor cores on CUDA) for tf32.
    """

    name: str
    score_dtype: torch.dtype
    matmul: str
    reason: str = ""  # why this precision: "requested", or what ``auto`` found

    def describe(self) -> str:
        """One line for the log and plan.txt, e.g. ``bf16 (auto: this CPU multiplies bf16 natively …)``."""
        return f"{self.name} ({self.reason})" if self.reason else self.name


def resolve_precision(precision: str, device_type: str, bf16_units: bool) -> tuple[str, str]:
    """``(precision, reason)`` for ``train.precision``: ``auto`` is bf16 on a CPU with bf16 GEMM units and fp32
    elsewhere; any other value is kept.

    Why bf16 on such CPUs: its GEMMs run ~3.5x fp32's there, and training in it (bf16 scores, fp32 parameters,
    gradients and optimizer state, float64 loss statistics) matched fp32 within the paired interval on
    MovieLens-1M and ml-latest-small (docs/training.md, "Precision"). GPUs stay fp32 under ``auto``: the
    evidence is from CPUs."""
    if precision != "auto":
        return precision, "requested"
    if device_type == "cpu" and bf16_units:
        return "bf16", "auto: this CPU multiplies bf16 natively; train.precision: fp32 turns it off"
    if device_type == "cpu":
        return "fp32", "auto: this CPU has no bf16 GEMM units"
    return "fp32", "auto: bf16 training is measured on CPUs only; train.precision: bf16 to use it"


def setup_precision(precision: str, device: torch.device | str) -> Precision:
    """Set this process's matmul mode for ``train.precision`` and return the :class:`Precision` to score with.

    Raises DeviceError for ``tf32`` on CPU and for ``bf16`` on a GPU without bf16 support (before Ampere).
    """
    device = torch.device(device)
    if precision not in PRECISIONS:
        raise DeviceError(f"train.precision must be one of {', '.join(PRECISIONS)}; got {precision!r}")
    precision, reason = resolve_precision(precision, device.type, device.type == "cpu" and cpu_bf16_gemm())
    if precision == "tf32" and device.type != "cuda":
        raise DeviceError("train.precision=tf32 is a CUDA tensor-core mode: use fp32 or bf16 on CPU")
    if precision == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        name = torch.cuda.get_device_name(device)
        raise DeviceError(f"train.precision=bf16 needs a GPU with bf16 support (Ampere or newer), not {name}")
    matmul = "high" if precision == "tf32" else "highest"
    torch.set_float32_matmul_precision(matmul)
    if device.type == "cuda":
        torch.backends.cudnn.allow_tf32 = precision == "tf32"
    score_dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    return Precision(precision, score_dtype, matmul, reason)


def cpu_bf16_gemm() -> bool:
    """True when this CPU multiplies bf16 natively (AVX512-BF16 or AMX-BF16), so that a bf16 GEMM is ~2-3.5x an
    fp32 one. Asks torch's CPU feature probe (``torch.cpu._is_avx512_bf16_supported`` /
    ``_is_amx_tile_supported``, private but present since torch 2.3), else reads ``/proc/cpuinfo``'s flags."""
    for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"):
        probe = getattr(torch.cpu, name, None)
        try:
            if probe is not None and probe():
                return True
        except RuntimeError:
            pass
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            flags = {flag for line in cpuinfo if line.startswith("flags") for flag in line.split(":", 1)[1].split()}
    except OSError:
        return False
    return bool(flags & {"avx512_bf16", "amx_bf16"})


def use_certified_bf16(requested: bool, device: torch.device | str = "cpu") -> bool:
    """Whether to rank with the certified bf16 top-K (same answer as fp32, faster): ``requested`` (the
    ``eval.certified_bf16`` switch) on a CPU with native bf16 GEMMs; fp32 on GPUs (their fp32 GEMMs are fast,
    and the bit-identity of cuBLAS sub-products is not checked) and on CPUs without bf16 units."""
    return bool(requested) and torch.device(device).type == "cpu" and cpu_bf16_gemm()
