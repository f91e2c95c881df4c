"""The trainer's stateful parts: each one saved and restored generically by the checkpointer (DCP).

Every class here implements ``state_dict()`` / ``load_state_dict()`` in the form ``torch.distributed.checkpoint``
needs: tensors that are split over ranks are ShardedTensors with their global offsets (``row_sharded``), so a
checkpoint reshards to any worker count; everything else is replicated (the same on every rank) or per rank.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any

import torch

from bigrank.train.checkpoint import row_sharded

__all__ = ["CatalogState", "CatalogWeights", "RNGState", "StreamState", "TowerState", "TrainState", "LossState"]


class TowerState:
    """The row-wise sharded torchrec user tower and its fused optimizer state (torchrec's own ShardedTensors)."""

    def __init__(self, tower):
        self.tower = tower

    def state_dict(self) -> dict[str, Any]:
        from bigrank.model.sharding import tower_checkpoint_state

        return tower_checkpoint_state(self.tower)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        from bigrank.model.sharding import restore_tower_checkpoint_state

        restore_tower_checkpoint_state(self.tower, state)


class CatalogWeights:
    """This rank's catalog rows ``[start, stop)`` as a row-sharded tensor of the global ``[num_items, d]``
    matrix (evaluation and export load only this)."""

    def __init__(self, shard):
        self.shard = shard

    def state_dict(self) -> dict[str, Any]:
        shard = self.shard
        return {"weight": row_sharded(shard.weight.data, shard.start, shard.num_items, shard.group)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass  # DCP wrote the rows in place (the ShardedTensor shares the parameter's storage)


class CatalogState(CatalogWeights):
    """The catalog rows plus the item optimizer's state (``bigrank.train.item_optim.RowOptimizer``): its
    row-aligned tensors (``[n_local, ...]``) are saved row-sharded like the rows, its step count replicated."""

    def __init__(self, shard, optimizer):
        super().__init__(shard)
        self.optimizer = optimizer

    def state_dict(self) -> dict[str, Any]:
        shard = self.shard
        state = super().state_dict()
        rows = {
            name: row_sharded(tensor, shard.start, shard.num_items, shard.group)
            for name, tensor in self.optimizer.row_state().items()
        }
        state["optimizer"] = {"rows": rows, "step": torch.tensor(float(self.optimizer.step_count))}
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # The row-aligned tensors were written in place (they share the optimizer's storage).
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
    """Progress of the run, replicated: the global step and the first/last training loss."""

    step: int = 0
    first_loss: float | None = None
    last_loss: float | None = None

    def state_dict(self) -> dict[str, Any]:
        return {"progress": json.dumps(asdict(self))}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        progress = json.loads(state["progress"])
        self.step, self.first_loss, self.last_loss = (
            int(progress["step"]),
            progress["first_loss"],
            progress["last_loss"],
        )
