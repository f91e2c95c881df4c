"""Row-wise sharding of torchrec embedding tables, on CPU/gloo and CUDA/nccl; plans and checkpoints (the rows a
rank holds afterwards: ``bigrank.model.tables.local_table_rows``).

On CUDA the stock torchrec sharders are used as they are (they offer ``row_wise``), the planner's topology is
``compute_device="cuda"`` with the device's real memory (``hbm_cap``) in its storage estimate, and the
tables are fbgemm-gpu TBEs (the planner picks the kernel: ``fused`` in HBM, or UVM caching when they do not
fit). torchrec's stock sharders offer ``row_wise`` only for CUDA/MTIA devices; on CPU the row-wise sharding
itself works with gloo (bucketised all-to-all of ids in, reduce-scatter of pooled rows out), so the CPU-only
sharders below just add ``row_wise`` to the offered types. Each rank then owns the contiguous rows
``[r * ceil(n/W), min(n, (r+1) * ceil(n/W)))`` of each table, stored in one fbgemm TBE whose optimizer runs
inside the backward pass ("fused"): the sharded tables never produce dense gradients.

Fused optimizers: ``sgd`` (exact SGD, duplicate ids coalesced), ``adagrad`` (exact Adagrad, Duchi et al.
2011, w -= lr·g/(sqrt(Σg²)+eps)), ``rowwise_adagrad`` (one accumulator per row, the mean of g² over the row)
on CPU (fbgemm-gpu-cpu 1.8) and CUDA; ``adam`` and weight decay only on CUDA (fbgemm-gpu 1.8). fbgemm's
tables need an embedding dimension that is a multiple of 4.
"""

from __future__ import annotations

import logging
import os
import shutil
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

FUSED_OPTIMIZERS = ("sgd", "adagrad", "rowwise_adagrad", "adam")
_CPU_FUSED_OPTIMIZERS = ("sgd", "adagrad", "rowwise_adagrad")
_WEIGHT_DECAY_OPTIMIZERS = ("rowwise_adagrad", "adam")


def _row_wise_sharder_classes():
    from torchrec.distributed.embedding import EmbeddingCollectionSharder
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.types import ShardingType

    row_wise = ShardingType.ROW_WISE.value

    class RowWiseEmbeddingBagCollectionSharder(EmbeddingBagCollectionSharder):
        """``EmbeddingBagCollectionSharder`` that offers ``row_wise`` on every device type, CPU included."""

        def sharding_types(self, compute_device_type: str) -> list[str]:
            types = list(super().sharding_types(compute_device_type))
            return types if row_wise in types else types + [row_wise]

    class RowWiseEmbeddingCollectionSharder(EmbeddingCollectionSharder):
        """``EmbeddingCollectionSharder`` that offers ``row_wise`` on every device type, CPU included."""

        def sharding_types(self, compute_device_type: str) -> list[str]:
            types = list(super().sharding_types(compute_device_type))
            return types if row_wise in types else types + [row_wise]

    return RowWiseEmbeddingBagCollectionSharder, RowWiseEmbeddingCollectionSharder


def fused_params(
    optimizer: str = "sgd",
    lr: float = 0.01,
    *,
    weight_decay: float = 0.0,
    eps: float = 1e-8,
    betas: tuple[float, float] = (0.9, 0.999),
    device_type: str = "cpu",
) -> dict[str, Any]:
    """The fbgemm ``fused_params`` of a fused (in-backward) optimizer for the sharded tables.

    Update rules, applied to the rows looked up in the batch (g summed over duplicates and ranks):
      sgd              w -= lr·g
      adagrad          s += g²;          w -= lr·g / (sqrt(s) + eps)     (one s per element)
      rowwise_adagrad  s += mean_j g_j²; w -= lr·g / (sqrt(s) + eps)     (one s per row)
      adam             CUDA only (``betas``), as torch.optim.Adam on the looked-up rows.
    ``weight_decay`` (L2, ``g + wd·w``) exists in fbgemm only for rowwise_adagrad and adam on CUDA; its CPU
    kernels ignore it, so it is refused on CPU.
    Raises ValueError for an unknown optimizer, ``adam`` on CPU, lr ≤ 0, weight_decay < 0 or weight decay
    with an optimizer/device that would ignore it.
    """
    with quiet_torchrec():
        from fbgemm_gpu.split_embedding_configs import EmbOptimType
        from fbgemm_gpu.split_table_batched_embeddings_ops_training import WeightDecayMode

    if optimizer not in FUSED_OPTIMIZERS:
        raise ValueError(f"unknown fused optimizer {optimizer!r}; choose one of {', '.join(FUSED_OPTIMIZERS)}")
    if device_type == "cpu" and optimizer not in _CPU_FUSED_OPTIMIZERS:
        raise ValueError(
            f"fused optimizer {optimizer!r} is not supported by fbgemm on CPU; "
            f"choose one of {', '.join(_CPU_FUSED_OPTIMIZERS)}"
        )
    if not lr > 0:
        raise ValueError(f"learning rate must be > 0, got {lr}")
    if weight_decay < 0:
        raise ValueError(f"weight_decay must be >= 0, got {weight_decay}")
    if weight_decay > 0 and (device_type == "cpu" or optimizer not in _WEIGHT_DECAY_OPTIMIZERS):
        # fbgemm's sgd/adagrad kernels take no weight_decay, and its CPU kernels ignore it (checked on
        # fbgemm-gpu-cpu 1.8 for rowwise_adagrad, all modes): refuse rather than drop it silently.
        raise ValueError(
            f"weight_decay is not supported by the fused {optimizer!r} on {device_type}; fbgemm applies it "
            f"only on CUDA with {' or '.join(_WEIGHT_DECAY_OPTIMIZERS)}: use weight_decay=0"
        )
    opt_type = {
        "sgd": EmbOptimType.EXACT_SGD,
        "adagrad": EmbOptimType.EXACT_ADAGRAD,
        "rowwise_adagrad": EmbOptimType.EXACT_ROWWISE_ADAGRAD,
        "adam": EmbOptimType.ADAM,
    }[optimizer]
    params: dict[str, Any] = {"optimizer": opt_type, "learning_rate": float(lr), "eps": float(eps)}
    if weight_decay > 0:
        params["weight_decay"] = float(weight_decay)
        params["weight_decay_mode"] = WeightDecayMode.L2
    if optimizer == "adam":
        params["beta1"], params["beta2"] = (float(b) for b in betas)
    return params


def row_wise_sharders(params: dict[str, Any], device_type: str = "cpu") -> list:
    """The sharders (bag and sequence collections) carrying the fused optimizer ``params``.

    CUDA: torchrec's stock sharders (they offer ``row_wise`` there). CPU: the subclasses that add
    ``row_wise``, which the stock sharders offer only on CUDA/MTIA.
    """
    if device_type == "cpu":
        bag_sharder_cls, seq_sharder_cls = _row_wise_sharder_classes()
    else:
        from torchrec.distributed.embedding import EmbeddingCollectionSharder as seq_sharder_cls
        from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder as bag_sharder_cls
    return [bag_sharder_cls(fused_params=dict(params)), seq_sharder_cls(fused_params=dict(params))]


def planner_topology(
    device: torch.device | str,
    world_size: int,
    *,
    local_world_size: int | None = None,
    hbm_cap_bytes: int | None = None,
):
    """The planner's ``Topology`` for ``world_size`` ranks computing on ``device``'s type.

    On CUDA the storage estimate uses the device's real memory: ``hbm_cap_bytes`` (default: the total memory
    of ``device``, ``torch.cuda.get_device_properties``), so the planner moves tables to UVM caching only when
    they do not fit. ``local_world_size`` (ranks per host; default ``LOCAL_WORLD_SIZE``, which the local
    launcher and Ray Train set, else ``world_size``) tells the planner which ranks share a host.
    """
    from torchrec.distributed.planner.types import KernelConfig, TopologyFactory, TrainerConfig

    device = torch.device(device)
    if local_world_size is None:
        local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    local_world_size = max(1, min(int(local_world_size), world_size))
    trainer = {"world_size": world_size, "local_world_size": local_world_size}
    if device.type == "cuda":
        if hbm_cap_bytes is None:
            hbm_cap_bytes = torch.cuda.get_device_properties(device).total_memory
        trainer["hbm_cap_bytes"] = int(hbm_cap_bytes)
    with quiet_torchrec():
        return TopologyFactory.create_topology(
            trainer_config=TrainerConfig(**trainer), kernel_config=KernelConfig(compute_device=device.type)
        )


def embedding_table_names(module: nn.Module) -> list[str]:
    """Names of the tables of every (unsharded) ``EmbeddingBagCollection``/``EmbeddingCollection`` in ``module``."""
    return list(embedding_table_dims(module))


def embedding_table_dims(module: nn.Module) -> dict[str, int]:
    """Embedding dimension of each table of the (unsharded) torchrec collections in ``module``."""
    from torchrec import EmbeddingBagCollection, EmbeddingCollection

    dims: dict[str, int] = {}
    for sub in module.modules():
        if isinstance(sub, EmbeddingBagCollection):
            dims.update({config.name: config.embedding_dim for config in sub.embedding_bag_configs()})
        elif isinstance(sub, EmbeddingCollection):
            dims.update({config.name: config.embedding_dim for config in sub.embedding_configs()})
    return dims


@contextmanager
def quiet_torchrec() -> Iterator[None]:
    """Silence torchrec's planner/topology advice, fbgemm's import-time deprecation notices and DCP's
    single-process notice, none of which apply here."""
    logger = logging.getLogger("torchrec")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            warnings.simplefilter("ignore", DeprecationWarning)  # fbgemm's import-time notices
            warnings.filterwarnings("ignore", message=r"torch.distributed is disabled.*single process")
            yield
    finally:
        logger.setLevel(level)


def shard_row_wise(
    module: nn.Module,
    *,
    optimizer: str = "sgd",
    lr: float = 0.01,
    weight_decay: float = 0.0,
    eps: float = 1e-8,
    process_group: dist.ProcessGroup | None = None,
    device: torch.device | str | None = None,
    gradient_division: bool = False,
    data_parallel_tables: Sequence[str] = (),
    initialize: bool = True,
):
    """Plan row-wise sharding of every embedding table in ``module`` (except ``data_parallel_tables``) and wrap it
    in ``DistributedModelParallel``.

    ``data_parallel_tables``: tables every rank holds whole (torchrec's ``DATA_PARALLEL`` sharding type, its
    ``dense`` kernel): their lookups need no collective, their parameters get a dense gradient of this rank's
    batch in backward, and nothing syncs them — torchrec's DDP wrappers are left off, because the trainer
    all-reduces their gradients in one buffer with the catalog's and updates them with its own optimizer
    (``bigrank.train.replicas``). They have no fused optimizer.

    Collective: every rank of ``process_group`` (default: the world) must call it with the same module
    configuration. Build ``module`` on the ``meta`` device for big tables: only the local rows are then
    allocated; after sharding, ``module.reset_parameters()`` (if it has one, e.g. :class:`UserTower`) refills
    them with its deterministic initialisation (``initialize=False``: not, for a model that a checkpoint load
    fills next; the rows then hold whatever torchrec allocated).

    Gradients: by default the sharded tables receive exactly the gradient of the loss that is
    back-propagated, summed over ranks (``dL/dE = Σ_r dL_r/dE``), as the item-parallel catalog does. torchrec's
    own default divides it by the world size (it assumes DDP-style per-rank mean losses); pass
    ``gradient_division=True`` for that. This is torchrec's process-wide switch
    (``torchrec.distributed.comm_ops.set_gradient_division``): the last call in a process wins.

    Device: ``device`` (default CPU) is this rank's device (``bigrank.devices.worker_device``): on CUDA the
    process group must carry CUDA tensors (nccl, or ``cpu:gloo,cuda:nccl``), the tables are allocated on
    that GPU, and ``optimizer="adam"`` and weight decay are available.

    Returns:
        ``(dmp, plan)``: ``dmp`` is the ``DistributedModelParallel`` (call it like ``module``; ``dmp.module``
        is ``module`` with its tables replaced by sharded ones; ``dmp.fused_optimizer`` holds the optimizer
        state), ``plan`` the ``ShardingPlan`` (see :func:`format_plan`).
    Raises ValueError when ``module`` has no embedding tables or the optimizer settings are invalid.
    """
    from torchrec.distributed import comm_ops
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints
    from torchrec.distributed.planner.storage_reservations import FixedPercentageStorageReservation
    from torchrec.distributed.types import ShardingEnv, ShardingType

    for name, dim in embedding_table_dims(module).items():
        if dim % 4:
            raise ValueError(f"table {name!r} has dim {dim}: fbgemm's sharded tables need a multiple of 4")
    if not dist.is_initialized():
        raise ValueError("shard_row_wise needs an initialised torch.distributed process group")
    group = process_group if process_group is not None else dist.group.WORLD
    device = torch.device(device) if device is not None else torch.device("cpu")
    tables = embedding_table_names(module)
    if not tables:
        raise ValueError(f"{type(module).__name__} holds no torchrec embedding tables to shard")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    sharders = row_wise_sharders(
        fused_params(optimizer, lr, weight_decay=weight_decay, eps=eps, device_type=device.type), device.type
    )
    unknown = sorted(set(data_parallel_tables) - set(tables))
    if unknown:
        raise ValueError(f"data_parallel_tables names tables the module does not have: {unknown} (it has {tables})")
    wanted = {
        name: (ShardingType.DATA_PARALLEL if name in data_parallel_tables else ShardingType.ROW_WISE).value
        for name in tables
    }
    constraints = {name: ParameterConstraints(sharding_types=[kind]) for name, kind in wanted.items()}
    topology = planner_topology(device, dist.get_world_size(group))
    with quiet_torchrec():
        planner = EmbeddingShardingPlanner(
            topology=topology,
            constraints=constraints,
            storage_reservation=FixedPercentageStorageReservation(0.15),
        )
        plan = planner.collective_plan(module, sharders, group)
        dmp = DistributedModelParallel(
            module,
            env=ShardingEnv.from_process_group(group),
            device=device,
            plan=plan,
            sharders=sharders,
            data_parallel_wrapper=_no_data_parallel_wrapper(),
        )
    _check_sharding(plan, wanted)
    _unwrap_data_parallel_lookups(dmp)
    comm_ops.set_gradient_division(bool(gradient_division))
    reset = getattr(dmp.module, "reset_parameters", None)
    if initialize and callable(reset):
        reset()
    return dmp, plan


def _no_data_parallel_wrapper():
    """A torchrec ``DataParallelWrapper`` that wraps nothing (the trainer syncs the data-parallel tables)."""
    from torchrec.distributed.model_parallel import DataParallelWrapper

    class NoDataParallelWrapper(DataParallelWrapper):
        def wrap(self, dmp, env, device) -> None:
            pass

    return NoDataParallelWrapper()


def _unwrap_data_parallel_lookups(dmp) -> None:
    """Take torchrec's own DDP off the data-parallel tables' lookups.

    torchrec's sharded collections wrap each data-parallel lookup in ``DistributedDataParallel`` themselves
    (``ShardedEmbeddingBagCollection.init_data_parallel``, whatever the ``DataParallelWrapper``): one more
    all-reduce per step, of the mean rather than the sum, plus ~0.2 ms of DDP bookkeeping per forward on
    CPU (measured with the torch profiler on the demo). The trainer sums these gradients in its own single
    all-reduce (``bigrank.train.replicas``), so the lookups run bare. (tests/test_layout.py checks that the
    replicas stay equal and the gradients are the sums.)"""
    from torch.nn.parallel import DistributedDataParallel

    for module in dmp.modules():
        lookups = getattr(module, "_lookups", None)
        if isinstance(lookups, list | nn.ModuleList):
            for index, lookup in enumerate(lookups):
                if isinstance(lookup, DistributedDataParallel):
                    lookups[index] = lookup.module


def _check_sharding(plan, wanted: dict[str, str]) -> None:
    found = {name: sharding.sharding_type for _, name, sharding in _plan_entries(plan)}
    wrong = {name: found.get(name) for name, kind in wanted.items() if found.get(name) != kind}
    if wrong:
        raise RuntimeError(f"the planner did not shard these tables as asked ({wanted}): {wrong}")


def _plan_entries(plan):
    for module_path, module_plan in plan.plan.items():
        for table, sharding in module_plan.items():
            yield module_path, table, sharding


def plan_to_dict(plan) -> dict[str, Any]:
    """JSON-ready description of a ``ShardingPlan``: per table its sharding type, kernel, ranks and shards."""
    out: dict[str, Any] = {}
    for module_path, table, sharding in _plan_entries(plan):
        shards = []
        spec = sharding.sharding_spec
        for shard in getattr(spec, "shards", None) or []:
            shards.append(
                {
                    "offsets": list(shard.shard_offsets),
                    "sizes": list(shard.shard_sizes),
                    "placement": str(shard.placement),
                }
            )
        out[f"{module_path}.{table}" if module_path else table] = {
            "sharding_type": sharding.sharding_type,
            "compute_kernel": sharding.compute_kernel,
            "ranks": list(sharding.ranks or []),
            "shards": shards,
        }
    return out


def format_plan(plan) -> str:
    """Human-readable table of a ``ShardingPlan``: one line per shard (table, type, kernel, rows, rank)."""
    lines = [f"{'table':<28} {'sharding':<14} {'kernel':<8} {'rows':<22} {'cols':<10} placement"]
    for name, entry in plan_to_dict(plan).items():
        # A data-parallel table has no shards: every rank holds all of it.
        whole = {"offsets": [0, 0], "sizes": ["all", "all"], "placement": f"ranks {entry['ranks']}"}
        for shard in entry["shards"] or [whole]:
            row0, col0 = shard["offsets"][:2]
            rows, cols = shard["sizes"][:2]
            row_range = f"[{row0}, {row0 + rows})" if isinstance(rows, int) else str(rows)
            col_range = f"[{col0}, {col0 + cols})" if isinstance(cols, int) else str(cols)
            lines.append(
                f"{name:<28} {entry['sharding_type']:<14} {entry['compute_kernel']:<8} {row_range:<22} "
                f"{col_range:<10} {shard['placement']}"
            )
    return "\n".join(lines)


def write_plan(plan, path: str | os.PathLike) -> None:
    """Save :func:`plan_to_dict` as JSON at ``path`` (atomic: temp file + ``os.replace``)."""
    from bigrank.atomic import write_json_atomic

    write_json_atomic(path, plan_to_dict(plan), indent=2)


# ---------------------------------------------------------------------------------------------------------
# Checkpoints (torch.distributed.checkpoint)


def tower_checkpoint_state(module: nn.Module) -> dict[str, Any]:
    """State to put under one key of a DCP checkpoint: ``{"model": ..., "optimizer": ...}``.

    ``model`` is the module's state dict (ShardedTensors of the local rows when sharded); ``optimizer`` is
    the fused optimizer's state (Adagrad accumulators …), present only for a ``DistributedModelParallel``.
    Pass the same structure, filled by ``dcp.load``, to :func:`restore_tower_checkpoint_state`.
    """
    state: dict[str, Any] = {"model": module.state_dict()}
    fused = getattr(module, "fused_optimizer", None)
    if fused is not None:
        state["optimizer"] = fused.state_dict()
    return state


def restore_tower_checkpoint_state(module: nn.Module, state: dict[str, Any]) -> None:
    """Copy a state from :func:`tower_checkpoint_state` (after ``dcp.load`` filled it) into ``module``."""
    module.load_state_dict(state["model"])
    fused = getattr(module, "fused_optimizer", None)
    if fused is not None and "optimizer" in state:
        fused.load_state_dict(state["optimizer"])
        fused.step()  # pushes the restored param-group lr into the fbgemm kernels (step() does only that)


def set_fused_learning_rate(module: nn.Module, lr: float) -> None:
    """Set the learning rate of the fused optimizer of a sharded module (for schedules and warm-up).

    The fbgemm kernels read the rate from the param groups only when ``fused_optimizer.step()`` is called
    (it applies nothing else: updates happen inside backward), so this sets both.
    """
    if not lr >= 0:
        raise ValueError(f"learning rate must be >= 0, got {lr}")
    fused = getattr(module, "fused_optimizer", None)
    if fused is None:
        raise ValueError(f"{type(module).__name__} has no fused optimizer (is it sharded with shard_row_wise?)")
    for group in fused.param_groups:
        group["lr"] = float(lr)
    fused.step()


def save_tower_state(module: nn.Module, path: str | os.PathLike) -> None:
    """Save the tower's (sharded) weights and fused-optimizer state to the DCP directory ``path``.

    Collective. Every rank writes its own shard; the directory appears under ``path`` only when complete
    (written to ``path + ".partial"``, renamed by rank 0 after a barrier). Raises FileExistsError if
    ``path`` exists.
    """
    import torch.distributed.checkpoint as dcp

    path = os.fspath(path)
    if os.path.exists(path):
        raise FileExistsError(f"checkpoint directory {path} already exists")
    partial = path + ".partial"
    distributed = dist.is_initialized()
    if os.path.exists(partial) and (not distributed or dist.get_rank() == 0):
        shutil.rmtree(partial)  # left by a crash mid-save; may hold files of another world size
    if distributed:
        dist.barrier()
    with quiet_torchrec():
        dcp.save(tower_checkpoint_state(module), checkpoint_id=partial)
    if distributed:
        dist.barrier()
    if not distributed or dist.get_rank() == 0:
        os.replace(partial, path)
    if distributed:
        dist.barrier()


def load_tower_state(module: nn.Module, path: str | os.PathLike) -> None:
    """Load weights and fused-optimizer state saved by :func:`save_tower_state` into ``module`` (collective).

    The module must have the same tables; its sharding may differ from the saved one (DCP reshards).
    """
    import torch.distributed.checkpoint as dcp

    path = os.fspath(path)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"no checkpoint directory at {path}")
    state = tower_checkpoint_state(module)
    with quiet_torchrec():
        dcp.load(state, checkpoint_id=path)
    restore_tower_checkpoint_state(module, state)
