"""One worker bootstrap: what every bigrank worker process sets up before it runs a job, whoever started it.

Two steps, each in one place:

1. The process, once, by the launcher that started it (the launchers differ in what they already did):

   * :func:`start_local_process` — a process of the local launcher (``bigrank.train.launcher``, on torch
     elastic): it ends with its launcher (``prctl(PR_SET_PDEATHSIG)``), SIGINT and SIGTERM stop a training
     loop at a step boundary and end anything else at once (see below), ``threads`` torch threads, gloo on the
     loopback interface, and the default process group (on the store of torch elastic's agent, named by
     ``MASTER_ADDR``/``MASTER_PORT``, one key prefix per attempt of the group) with the backend the run layer
     chose for the workers' devices (``bigrank.devices.process_group_backend``).
   * :func:`start_ray_process` — a Ray Train worker: Ray Train owns the actor's signals; the torch threads follow
     the CPUs Ray gave the worker. On a runtime whose every node is this machine's loopback (the embedded one)
     the worker joins the default process group itself, as a local worker does: rank 0 hosts the store on
     127.0.0.1 and hands its port to the others through Ray Train (``ray.train.collective``); on a cluster Ray
     Train's ``TorchConfig`` has created it (with the same backend choice, ``bigrank.launch.ray_train``).

2. The job, by every worker function (train, evaluate, export, a tune trial's training) under either
   launcher: :func:`start_worker` — the process group checked, the CPU control group, the device, the seed, the
   allocator settings (:func:`keep_freed_memory`, below) and torchrec's per-step warnings silenced. The Trainer
   and ``load_trained_model`` call it.

Freed memory stays in the process: a training step frees and re-allocates the same large buffers every step.
Each step allocates its score blocks, gradients and statistics (megabytes each) and frees them at the end.
glibc's malloc serves blocks above its mmap threshold (128 KiB, raised dynamically up to 32 MiB) with fresh
``mmap`` calls and returns them with ``munmap``, and gives back freed memory at the top of its heap above the
trim threshold (128 KiB): either way the next step touches new pages, one minor page fault per 4 KiB page.
Measured on MovieLens-1M (``configs/ml-1m-softmax.yaml``, 1 worker, 300 steps, ``/usr/bin/time -v``): 1.74M
minor page faults and 3.4 s of system time; with the thresholds of :func:`keep_freed_memory` 156K faults and
0.7 s, and 1.29x the examples/s (rankmax: 2.06M → 154K faults, 1.14x).

Signals in a local worker. While a training loop runs, SIGINT and SIGTERM only ask it to stop: every rank
records the request, the ranks agree on the step to stop at inside a collective the step makes anyway, write a
final checkpoint there and raise :class:`~bigrank.signals.Stopped` (``bigrank.signals.step_boundaries``,
``bigrank.train.trainer``). Elsewhere (start-up, evaluation, export) they keep their default action, ending the
worker at once; a run resumes from its last complete checkpoint (checkpoints are renamed into place only once
complete). The launcher forwards the signal it got to every worker, SIGKILLs them when they are not done within
its grace period or at a second signal, and reports the stop. A Python KeyboardInterrupt would instead unwind
through ``torch.multiprocessing``'s wrapper, which exits with status 0 without a result. A signal the launching
command ignores (a shell's background job ignores SIGINT) stays ignored in its workers and is not forwarded.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import datetime
import logging
import os
import signal
import socket
import sys
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist

from bigrank.signals import defer_stop_signals

__all__ = [
    "PROCESS_GROUP_TIMEOUT",
    "Worker",
    "join_loopback_group",
    "keep_freed_memory",
    "loopback_store",
    "require_process_group",
    "silence_torchrec_step_warnings",
    "start_local_process",
    "start_ray_process",
    "start_worker",
]

# A collective that waits longer than this fails (a peer hung): long enough for a slow checkpoint or evaluation.
PROCESS_GROUP_TIMEOUT = datetime.timedelta(minutes=30)
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
_LOOPBACK = ("127.0.0.1", "localhost", "::1")
_M_TRIM_THRESHOLD = -1  # glibc malloc.h
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20
TRIM_THRESHOLD = 1 << 30


@dataclass(frozen=True)
class Worker:
    """A started worker: its process group, rank and world size, its device, and the group for CPU-side
    control traffic (``bigrank.distributed.groups.init_control_group``: the world itself unless it is nccl-only)."""

    group: dist.ProcessGroup
    rank: int
    world_size: int
    device: torch.device
    control_group: dist.ProcessGroup


def start_local_process(backend: str = "gloo", threads: int | None = None, parent_pid: int | None = None) -> None:
    """Set up a process of the local launcher (see the module docstring) and join the default process group.

    ``backend``: ``gloo``, or ``cpu:gloo,cuda:nccl`` for workers on GPUs. ``threads``: torch threads (None:
    torch's default). ``parent_pid``: the launcher's pid; the process exits at once when it is already gone.
    """
    if parent_pid is not None:
        _exit_with_parent(parent_pid)
    defer_stop_signals()  # SIGINT/SIGTERM wait for a training loop's step boundary (a signal ignored stays so)
    if threads is not None:
        torch.set_num_threads(max(1, threads))
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # one machine: gloo's sockets stay on the loopback
    if dist.is_initialized():
        return
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        # The group's store, on rank 0 (bigrank.train.launcher has torch elastic's agent keep none for the
        # workers): on a loopback address it listens there only; torch's own TCPStore server listens on every
        # interface whatever its host name.
        address, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        if rank == 0 and address in _LOOPBACK:
            store = loopback_store(port, PROCESS_GROUP_TIMEOUT, address)
        else:
            store = dist.TCPStore(address, port, is_master=rank == 0, timeout=PROCESS_GROUP_TIMEOUT)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=PROCESS_GROUP_TIMEOUT)
        return
    # torch elastic's agent hosts one store for every attempt of the group; env:// would use it unprefixed, and a
    # restarted group then reads the previous attempt's addresses and fails to connect (torch issue #135712).
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    agent_store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=PROCESS_GROUP_TIMEOUT
    )
    dist.init_process_group(
        backend,
        store=dist.PrefixStore(f"bigrank/attempt-{attempt}", agent_store),
        rank=rank,
        world_size=world_size,
        timeout=PROCESS_GROUP_TIMEOUT,
    )


def loopback_store(port: int, timeout: datetime.timedelta, address: str = "127.0.0.1") -> dist.TCPStore:
    """A TCPStore server listening on ``address:port`` only (``port`` 0: a free one). torch's TCPStore binds its
    server to every interface whatever ``host_name`` says; handed a socket already bound (``master_listen_fd``),
    it listens on that one."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((address, port))
        sock.listen(socket.SOMAXCONN)
        port = sock.getsockname()[1]
    except OSError:
        sock.close()
        raise
    # The store owns the descriptor from here on (detach: Python's socket object would close it when collected).
    return dist.TCPStore(address, port, is_master=True, timeout=timeout, master_listen_fd=sock.detach())


def start_ray_process(backend: str | None = None) -> bool:
    """Set up a Ray Train worker process: torch threads as many as the CPUs Ray gave the worker (Ray sets
    ``OMP_NUM_THREADS``, which torch may have read before), and the root logger back to WARNING (Ray Train sets it
    to INFO, where fbgemm logs every library it loads and every table's full argument list).

    ``backend``: None when Ray Train started the process group (``TorchConfig``); else the workers start it here,
    on a store that listens on 127.0.0.1 only (:func:`join_loopback_group`; ``bigrank.launch.ray_group`` says
    why). Collective then. Returns whether this call started the group (the caller destroys it at the end)."""
    logging.getLogger().setLevel(logging.WARNING)
    threads = int(os.environ.get("OMP_NUM_THREADS") or 0)
    if threads > 0:
        torch.set_num_threads(threads)
    if backend is None or dist.is_initialized():
        return False
    join_loopback_group(backend)
    return True


def join_loopback_group(backend: str) -> None:
    """Join the default process group of this Ray Train worker group on a store bound to 127.0.0.1 (every worker
    on this machine): rank 0 hosts it (:func:`loopback_store` on a free port), and the others learn its port from
    ``ray.train.collective.broadcast_from_rank_zero`` (Ray's own channel between the workers: no other listener).
    Sets the variables Ray Train's ``TorchConfig`` would (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
    ``LOCAL_WORLD_SIZE``, ``NODE_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``: torchrec's planner reads
    ``LOCAL_WORLD_SIZE``) and, for nccl, its asynchronous error handling unless the environment chose one."""
    import ray.train
    from ray.train.collective import broadcast_from_rank_zero

    context = ray.train.get_context()
    rank, world_size = context.get_world_rank(), context.get_world_size()
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(context.get_local_rank()),
        LOCAL_WORLD_SIZE=str(context.get_local_world_size()),
        NODE_RANK=str(context.get_node_rank()),
    )
    if "nccl" in backend and not {"TORCH_NCCL_ASYNC_ERROR_HANDLING", "TORCH_NCCL_BLOCKING_WAIT"} & set(os.environ):
        os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "1"  # a timed-out collective fails (Ray Train's setting)
    store = loopback_store(0, PROCESS_GROUP_TIMEOUT) if rank == 0 else None
    port = broadcast_from_rank_zero(store.port if store is not None else None)
    os.environ.update(MASTER_ADDR=_LOOPBACK[0], MASTER_PORT=str(port))
    if store is None:
        store = dist.TCPStore(_LOOPBACK[0], port, is_master=False, timeout=PROCESS_GROUP_TIMEOUT)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=PROCESS_GROUP_TIMEOUT)


def start_worker(config) -> Worker:
    """Set up this rank for a job of ``config`` (a :class:`~bigrank.config.Config`) on the initialised process
    group; collective (every rank calls it at the same point). Returns the :class:`Worker`.

    The CPU control group (``bigrank.distributed.groups``), the device (``bigrank.devices.worker_device``: sets
    the current CUDA device; raises DeviceError when a requested GPU is missing), the torch seed
    ``seed * 1000 + rank``, glibc's allocator thresholds (:func:`keep_freed_memory`) and torchrec's per-step warnings
    off (:func:`silence_torchrec_step_warnings`). Raises RuntimeError when no process group is initialised.
    """
    group, rank, world_size = require_process_group()
    import torchrec  # noqa: F401 - registers fbgemm/torchrec operators before the model uses them

    from bigrank.devices import worker_device
    from bigrank.distributed.groups import init_control_group

    silence_torchrec_step_warnings()
    keep_freed_memory()  # every step frees and re-allocates the same buffers (the module docstring)
    control = init_control_group()
    device = worker_device(config.train.device)
    torch.manual_seed(config.seed * 1_000 + rank)
    return Worker(group, rank, world_size, device, control)


def keep_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds in this process with ``mallopt`` (glibc only; elsewhere it does
    nothing): blocks up to 32 MiB (glibc's largest allowed mmap threshold) come from the heap, and up to 1 GiB of
    freed heap stays mapped for the next step (the module docstring says why). True when set;
    ``BIGRANK_MALLOC_DEFAULTS=1`` keeps glibc's defaults."""
    if os.environ.get("BIGRANK_MALLOC_DEFAULTS") == "1":
        return False
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to tune
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))


def silence_torchrec_step_warnings() -> None:
    """Process-wide filters for the deprecation warnings torchrec's collectives print on the first step.

    (``reduce_scatter_tensor``/``all_gather_into_tensor`` deprecated, ShardedTensor → DTensor.) :func:`start_worker`
    calls it in every worker (a script or test that shards tables itself may too); they are harmless. One-off
    notices around torchrec's imports and planner are ``bigrank.model.sharding.quiet_torchrec``'s.
    """
    warnings.filterwarnings("ignore", message=r".*reduce_scatter_tensor.*is deprecated", category=FutureWarning)
    warnings.filterwarnings("ignore", message=r".*all_gather_into_tensor.*is deprecated", category=FutureWarning)
    warnings.filterwarnings("ignore", message=r".*deprecating ShardedTensor.*", category=FutureWarning)
    # fbgemm's CPU dense lookup (data-parallel tables) computes its gradient inside the CPU kernel, so autograd
    # warns that no Autograd-key kernel is registered; the gradients are right (tests/test_layout.py compares
    # them with the row-wise sharded tables').
    warnings.filterwarnings("ignore", message=r"fbgemm::dense_embedding_codegen_lookup_function: an autograd kernel")
    logging.getLogger("torchrec").setLevel(logging.ERROR)
    # torch.fx logs "is_fx_tracing will return true …" once when torchrec's forward checks for tracing.
    logging.getLogger("torch.fx._symbolic_trace").setLevel(logging.ERROR)
    # torchrec's plan check logs "Sharding spec not found for …" on the root logger for every data-parallel
    # (replicated) table: such a table has no sharding spec by design.
    root = logging.getLogger()
    if not any(isinstance(f, _DataParallelSpecFilter) for f in root.filters):
        root.addFilter(_DataParallelSpecFilter())


class _DataParallelSpecFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Sharding spec not found for ")


def require_process_group():
    """``(group, rank, world_size)`` of the initialised default process group (RuntimeError when none)."""
    if not dist.is_initialized():
        raise RuntimeError(
            "bigrank's workers need an initialised torch.distributed process group: start them with "
            "bigrank.train.launcher.launch_local (or Ray Train)"
        )
    group = dist.group.WORLD
    return group, dist.get_rank(group), dist.get_world_size(group)


def _exit_with_parent(parent_pid: int) -> None:
    """Have the kernel SIGKILL this process when its parent dies (Linux ``prctl(PR_SET_PDEATHSIG)``), so the
    workers of a launcher killed without clean-up (SIGKILL, the OOM killer) do not train on as orphans. SIGKILL,
    not SIGTERM: a training worker takes SIGTERM as a request to stop at its next step boundary, and without
    the launcher nothing would bound how long that takes.
    Exits at once when the parent is already gone (it died while this process started). Elsewhere than on
    Linux: nothing."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    except (OSError, AttributeError):  # no prctl in this libc: the launcher's own clean-up still applies
        return
    if os.getppid() != parent_pid:
        os._exit(1)
