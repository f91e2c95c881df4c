"""The trainer's stateful parts: each one saved and restored generically by the checkpointer (DCP).

Every class here implements ``state_dict()`` / ``load_state_dict()`` in the form ``torch.distributed.checkpoint``
needs: tensors that are split over ranks are ShardedTensors with their global offsets (``row_sharded``), so a
checkpoint reshards to any worker count; everything else is replicated (the same on every rank) or per rank.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from bigrank.train.checkpoint import row_sharded

__all__ = ["CatalogState", "CatalogWeights", "RNGState", "StreamState", "TowerState", "TrainState", "LossState"]


class TowerState:
    """The torchrec user tower and its optimizer state, the same checkpoint whatever each table's layout.

    Row-wise sharded tables are torchrec's own ShardedTensors (weights and fused-optimizer state). A
    data-parallel (replicated) table is saved the same way: each rank writes the rows it owns
    (``shard_range``) of the weight and of its :class:`~bigrank.train.item_optim.RowOptimizer` state, under the
    keys the fused optimizer uses (``"<table>.momentum1"``), so a run resumes in either layout; after a load each
    rank gathers the other ranks' rows (``gather_owned_rows``).

    Args:
        tower: the ``DistributedModelParallel``.
        replicated: ``{table: (parameter, RowOptimizer | None)}`` of the data-parallel tables (no optimizer:
            evaluation and export, which load weights only).
        group: the workers' process group.
    """

    def __init__(self, tower, replicated: dict[str, tuple[Any, Any]] | None = None, group=None):
        self.tower, self.replicated, self.group = tower, dict(replicated or {}), group

    def _key(self, table: str) -> str:
        return f"tables.embedding_bags.{table}.weight"

    def state_dict(self) -> dict[str, Any]:
        from bigrank.model.catalog import owned_range
        from bigrank.model.sharding import tower_checkpoint_state

        state = tower_checkpoint_state(self.tower)
        for table, (parameter, optimizer) in self.replicated.items():
            start, stop = owned_range(parameter.shape[0], self.group)
            rows = parameter.shape[0]
            state["model"][self._key(table)] = row_sharded(parameter.data[start:stop], start, rows, self.group)
            if optimizer is not None and optimizer.row_state():
                momentum = {
                    f"{table}.momentum1": row_sharded(tensor[start:stop], start, rows, self.group)
                    for tensor in optimizer.row_state().values()
                }
                state.setdefault("optimizer", {"state": {}})["state"][self._key(table)] = momentum
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        from bigrank.model.catalog import gather_owned_rows
        from bigrank.model.sharding import restore_tower_checkpoint_state

        for table, (parameter, optimizer) in self.replicated.items():
            # DCP wrote this rank's owned rows in place; the rest come from the other ranks.
            gather_owned_rows(parameter.data, self.group)
            state["model"][self._key(table)] = parameter.data
            if optimizer is not None:
                for tensor in optimizer.row_state().values():
                    gather_owned_rows(tensor, self.group)
            state.get("optimizer", {}).get("state", {}).pop(self._key(table), None)
        restore_tower_checkpoint_state(self.tower, state)


class CatalogWeights:
    """The catalog rows this rank owns (``CatalogShard.owned``, whatever the layout) as a row-sharded tensor of
    the global ``[num_items, d]`` matrix (evaluation and export load only this)."""

    def __init__(self, shard):
        self.shard = shard

    def state_dict(self) -> dict[str, Any]:
        shard = self.shard
        owned = shard.owned_rows(shard.weight.data)
        return {"weight": row_sharded(owned, shard.owned_start, shard.num_items, shard.group)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # DCP wrote the owned rows in place (the ShardedTensor shares the parameter's storage); a replicated
        # catalog gathers the others.
        self.shard.fill_from_owned(self.shard.weight.data)


class CatalogState(CatalogWeights):
    """The catalog rows plus the item optimizer's state (``bigrank.train.item_optim.RowOptimizer``): its
    row-aligned tensors (``[rows held, ...]``) are saved by owned rows like the weight, its step count replicated."""

    def __init__(self, shard, optimizer):
        super().__init__(shard)
        self.optimizer = optimizer

    def state_dict(self) -> dict[str, Any]:
        shard = self.shard
        state = super().state_dict()
        rows = {
            name: row_sharded(shard.owned_rows(tensor), shard.owned_start, shard.num_items, shard.group)
            for name, tensor in self.optimizer.row_state().items()
        }
        state["optimizer"] = {"rows": rows, "step": torch.tensor(float(self.optimizer.step_count))}
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        # The row-aligned tensors were written in place (they share the optimizer's storage).
        for tensor in self.optimizer.row_state().values():
            self.shard.fill_from_owned(tensor)
        self.optimizer.step_count = int(float(state["optimizer"]["step"]))


class StreamState:
    """The data position (rank-independent: see ``bigrank.data.stream``), replicated."""

    def __init__(self, stream):
        self.stream = stream

    def state_dict(self) -> dict[str, Any]:
        return {"position": json.dumps(self.stream.state_dict())}  # one JSON value: DCP stores it as is

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.stream.load_state_dict(json.loads(state["position"]))


class LossState:
    """The loss schedule (warm-up and temperature), replicated."""

    def __init__(self, step_loss):
        self.step_loss = step_loss

    def state_dict(self) -> dict[str, Any]:
        return {"schedule": json.dumps(self.step_loss.state_dict())}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step_loss.load_state_dict(json.loads(state["schedule"]))


class RNGState:
    """This rank's torch RNG state (a per-rank part: restored when the checkpoint has this rank)."""

    def state_dict(self) -> dict[str, Any]:
        return {"torch": torch.get_rng_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        torch.set_rng_state(state["torch"])


@dataclass
class TrainState:
    """Progress of the run, replicated: the global step, the first/last training loss and, with
    ``train.early_stopping``, the stop metric of every evaluation made while training (``[step, value]``, in order)
    and whether the run stopped on it (``bigrank.train.early_stopping``)."""

    step: int = 0
    first_loss: float | None = None
    last_loss: float | None = None
    evaluations: list = field(default_factory=list)
    stopped: bool = False

    def state_dict(self) -> dict[str, Any]:
        return {"progress": json.dumps(asdict(self))}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        progress = json.loads(state["progress"])
        self.step, self.first_loss, self.last_loss = (
            int(progress["step"]),
            progress["first_loss"],
            progress["last_loss"],
        )
        # Checkpoints written before early stopping hold neither.
        self.evaluations = [list(entry) for entry in progress.get("evaluations", [])]
        self.stopped = bool(progress.get("stopped", False))
