"""Process groups for workers on GPUs: which backend to start, and a group for CPU-side control traffic.

nccl carries only CUDA tensors. bigrank's workers on GPUs start the default group with the backend string
``cpu:gloo,cuda:nccl`` (``bigrank.devices.process_group_backend``): each collective then goes through the
backend of its tensors' device, so CPU tensors (layout checks, checkpoint metadata, ``all_gather_object``) work
unchanged. When the default group is plain ``nccl`` (started by someone else, e.g. a ``TorchConfig`` left at
``backend="nccl"``), :func:`init_control_group` adds a gloo group over the same ranks, and
:func:`control_group` returns the group to send CPU tensors through either way.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = [
    "collective_device",
    "control_group",
    "init_control_group",
    "reset_control_group",
    "supports_cpu_tensors",
    "supports_cuda_tensors",
]

_control: dist.ProcessGroup | None = None


def supports_cpu_tensors(group: dist.ProcessGroup | None = None) -> bool:
    """True when ``group`` (default: the world) has a backend for CPU tensors (gloo, or ``cpu:gloo,…``)."""
    backend = str(dist.get_backend(group)).lower()
    return backend == "gloo" or "cpu:gloo" in backend or backend == "mpi"


def supports_cuda_tensors(group: dist.ProcessGroup | None = None) -> bool:
    """True when ``group`` (default: the world) has a backend for CUDA tensors (nccl, or ``cuda:nccl``)."""
    backend = str(dist.get_backend(group)).lower()
    return "nccl" in backend


def init_control_group() -> dist.ProcessGroup:
    """Create (once) the group CPU-side control traffic goes through; collective: every rank calls it at the
    same point, right after ``init_process_group``. The world itself when it carries CPU tensors, else a new
    gloo group over all ranks."""
    global _control
    if not dist.is_initialized():
        raise RuntimeError("init_control_group needs an initialised torch.distributed process group")
    if _control is None:
        _control = dist.group.WORLD if supports_cpu_tensors() else dist.new_group(backend="gloo")
    return _control


def control_group() -> dist.ProcessGroup:
    """The group for CPU tensors: the world when it carries them, else the gloo group of
    :func:`init_control_group` (raises RuntimeError when that has not been created: creating it here could
    deadlock, as only some ranks might reach this call)."""
    if supports_cpu_tensors():
        return dist.group.WORLD
    if _control is None:
        raise RuntimeError(
            "the default process group is nccl-only: call bigrank.distributed.groups.init_control_group() on "
            "every rank after init_process_group, or start it with backend='cpu:gloo,cuda:nccl'"
        )
    return _control


def collective_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """The device whose tensors ``group``'s collectives take: ``cpu`` when it carries CPU tensors, else this
    rank's current CUDA device (nccl-only groups)."""
    if supports_cpu_tensors(group):
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def reset_control_group() -> None:
    """Forget the control group (after ``destroy_process_group``; tests and restarted worker groups)."""
    global _control
    _control = None
