"""Training, evaluation and export of ``model.kind: item_item`` (``bigrank.model.item_item``).

The item-item model is trained user by user, not row by row: a step takes a global batch of U users
(``train.batch_size``), scores the catalog once per user from all of the user's train items and takes the loss
of every (user, train item) row against that one score vector (``bigrank.losses.rankmax_shared_loss`` or
``softmax_shared_loss``). Rank r of W holds the whole model (it is at most a few GB: ``MAX_ITEMS``), scores
its slice of the batch and the ranks all-reduce the gradients (data parallel)::

    users         the rank's slice of the global batch                       UserBatches (any worker count)
    x             = multi_hot(train items of users)      float[u, n]
    z             = model(x)                               float[u, n]
    loss          = sum over the users' train items of L(z, y) / (rows of the global batch)
                    + lambda / N * (||W||^2 + ||P||^2 + ||Q||^2) / W         N: train rows of the split
    backward; all-reduce the gradients (sum); Adam (lr: optim.item_lr, decayed by optim.lr_decay)

Objective and optimiser are those of ``benchmarks/rankmax_item_item.py``, which measured the model on
MovieLens-1M (issue 25). The trainer reuses :class:`~bigrank.train.trainer.Trainer`'s loop, checkpoints,
signals, logs and evaluation; only the model, its step and the order of the data are its own.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from bigrank.data.manifest import DatasetManifest
from bigrank.distributed.collectives import all_reduce_no_grad
from bigrank.losses import rankmax_shared_loss, softmax_shared_loss
from bigrank.model.catalog import CatalogView, owned_range
from bigrank.model.item_item import ItemItemModel, multi_hot
from bigrank.train.checkpoint import Checkpointer
from bigrank.train.evaluator import Evaluator
from bigrank.train.schedule import LearningRateSchedule
from bigrank.train.state import RNGState, StreamState, TrainState
from bigrank.train.trainer import Trainer, _fail_once

__all__ = [
    "DenseAdam",
    "ItemItemRun",
    "ItemItemState",
    "ItemItemTrainer",
    "UserBatches",
    "build_item_item",
    "item_item_identity",
]

_USER_ORDER = 0x5E25  # tags the seed of the users' order apart from the other numpy streams of a run
_PARAMETERS = ("full", "inputs", "outputs")


class UserBatches:
    """The users with a train item, in a new random order each epoch, ``batch_size`` users per global step.

    Rank ``r`` of ``W`` trains on users ``[r * b // W, (r + 1) * b // W)`` of each global batch of ``b`` users
    (a slice may be empty). The position is a count of global steps in the epoch, so a run resumes on any
    worker count. Yields ``{"user_id": int64[slice]}``; :attr:`epoch` moves on as the epoch's last batch is
    handed out (before the caller trains on it), as ``ParquetStream``'s does.
    """

    def __init__(self, users: np.ndarray, batch_size: int, *, rank: int = 0, world_size: int = 1, seed: int = 0):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.users = np.asarray(users, dtype=np.int64)
        self.batch_size, self.rank, self.world_size, self.seed = int(batch_size), rank, world_size, seed
        self.epoch, self._step = 0, 0

    def steps_per_epoch(self) -> int:
        return math.ceil(len(self.users) / self.batch_size)

    def steps_left_in_epoch(self) -> int:
        return self.steps_per_epoch() - self._step

    def order(self, epoch: int) -> np.ndarray:
        """The users in the order of ``epoch``: a function of ``(seed, epoch)`` alone."""
        return np.random.default_rng([self.seed, epoch, _USER_ORDER]).permutation(self.users)

    def __iter__(self):
        steps, order = self.steps_per_epoch(), self.order(self.epoch)
        for step in range(self._step, steps):
            batch = order[step * self.batch_size : (step + 1) * self.batch_size]
            mine = batch[self.rank * len(batch) // self.world_size : (self.rank + 1) * len(batch) // self.world_size]
            if step + 1 >= steps:
                self.epoch, self._step = self.epoch + 1, 0
            else:
                self._step = step + 1
            yield {"user_id": torch.from_numpy(mine.copy())}

    def state_dict(self) -> dict:
        return {
            "epoch": self.epoch,
            "step": self._step,
            "batch_size": self.batch_size,
            "users": len(self.users),
            "seed": self.seed,
        }

    def load_state_dict(self, state: dict) -> None:
        for key, mine in (("batch_size", self.batch_size), ("users", len(self.users)), ("seed", self.seed)):
            if int(state[key]) != mine:
                raise ValueError(f"user-batch state has {key}={state[key]} but this run has {mine}")
        self.epoch, self._step = int(state["epoch"]), int(state["step"])


class DenseAdam:
    """Adam (Kingma & Ba 2015, Algorithm 1; ``torch.optim.adam``'s arithmetic) over named dense parameters, with
    its moments allocated up front so that a checkpoint loads into them in place."""

    def __init__(self, parameters: dict[str, torch.Tensor], lr: float):
        self.parameters, self.lr = parameters, float(lr)
        self.exp_avg = {name: torch.zeros_like(p) for name, p in parameters.items()}
        self.exp_avg_sq = {name: torch.zeros_like(p) for name, p in parameters.items()}
        self.steps = torch.zeros(())  # updates made (float, as torch.optim.Adam keeps it)

    def step(self) -> None:
        from torch.optim.adam import adam

        names = list(self.parameters)
        counts = [self.steps.clone() for _ in names]
        adam(
            [self.parameters[name].data for name in names],
            [self.parameters[name].grad for name in names],
            [self.exp_avg[name] for name in names],
            [self.exp_avg_sq[name] for name in names],
            [],
            counts,
            foreach=True,
            amsgrad=False,
            beta1=0.9,
            beta2=0.999,
            lr=self.lr,
            weight_decay=0.0,
            eps=1e-8,
            maximize=False,
        )
        self.steps.add_(1)

    def state_dict(self) -> dict[str, Any]:
        state = {f"{name}.exp_avg": tensor for name, tensor in self.exp_avg.items()}
        state.update({f"{name}.exp_avg_sq": tensor for name, tensor in self.exp_avg_sq.items()})
        state["steps"] = self.steps
        return state


class ItemItemState:
    """The model's matrices (replicated on every rank) and, when training, Adam's moments: one checkpoint part."""

    def __init__(self, model: ItemItemModel, optimizer: DenseAdam | None = None):
        self.model, self.optimizer = model, optimizer

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {name: getattr(self.model, name).data for name in _PARAMETERS}
        if self.optimizer is not None:
            state["adam"] = self.optimizer.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass  # DCP wrote every tensor in place (they share the parameters' and moments' storage)


@dataclass
class ItemItemRun:
    """A built item-item model on this rank: the module, the train split's items of every user (its input) and
    the process group; what the trainer, evaluation and export share."""

    module: ItemItemModel
    history: tuple[np.ndarray, np.ndarray]  # (indptr, items) CSR of the train split
    group: Any
    num_users: int
    num_items: int
    device: torch.device = torch.device("cpu")  # where the module lives (this worker's device)

    def inputs(self, user_ids) -> torch.Tensor:
        """The multi-hot train items float32[b, n] of ``user_ids``, on the module's device."""
        ids = torch.as_tensor(user_ids, dtype=torch.int64).cpu().numpy()
        return multi_hot(self.history, ids, self.num_items).to(self.device)

    def user_vectors(self, user_ids: torch.Tensor) -> torch.Tensor:
        """float[b, r + n] score-time vectors of ``user_ids`` (no grad)."""
        with torch.no_grad():
            return self.module.user_vectors(self.inputs(user_ids))

    def ranking_view(self):
        """``(user_vectors_fn, CatalogView)`` evaluation ranks with: the item vectors ``[Q_j, e_j]`` of the rows
        this rank owns."""
        start, stop = owned_range(self.num_items, self.group)
        with torch.no_grad():
            rows = self.module.item_vectors(start, stop)
        return self.user_vectors, CatalogView(start, stop, self.num_items, self.module.dim, rows)


def build_item_item(config, group, manifest: DatasetManifest, device: torch.device | str = "cpu") -> ItemItemRun:
    """The item-item model of ``config`` for the dataset of ``manifest`` on ``device`` (this worker's device),
    initialised from ``config.seed`` (drawn on the CPU: the same values on every device)."""
    from bigrank.data.stream import read_user_items

    device = torch.device(device)
    module = ItemItemModel(manifest.num_items, config.model.dim, seed=config.seed).to(device)
    history = read_user_items(manifest, "train", manifest.num_users)
    return ItemItemRun(module, history, group, manifest.num_users, manifest.num_items, device)


def item_item_identity(config, run: ItemItemRun) -> dict[str, Any]:
    """The checkpoint identity of an item-item run (see ``bigrank.train.checkpoint.model_identity``)."""
    return {
        "model.kind": "item_item",
        "model.dim": config.model.dim,
        "dataset users": run.num_users,
        "dataset items": run.num_items,
    }


class ItemItemTrainer(Trainer):
    """:class:`~bigrank.train.trainer.Trainer` for ``model.kind: item_item`` (see the module docstring)."""

    def __init__(self, config, manifest: DatasetManifest | None = None):
        from bigrank.atomic import write_text_atomic
        from bigrank.records import PLAN_TEXT

        self._start_run(config, manifest)
        config, manifest = self.config, self.manifest
        self.model = run = build_item_item(config, self.group, manifest, self.device)
        module = run.module
        indptr = run.history[0]
        users = np.flatnonzero(np.diff(indptr) > 0)
        self.train_rows = int(indptr[-1])
        if self.train_rows == 0:
            raise ValueError(f"the train split of {manifest.root} is empty")
        self.stream = UserBatches(
            users, config.train.batch_size, rank=self.rank, world_size=self.world_size, seed=config.seed
        )
        self.optimizer = DenseAdam({name: getattr(module, name) for name in _PARAMETERS}, config.optim.item_lr)
        self.state = TrainState()
        self.lr_schedule = LearningRateSchedule.for_run(config, self.stream.steps_per_epoch())
        self.lr_factor = 1.0
        self.local_batch = config.train.batch_size // self.world_size
        self.checkpointer = Checkpointer(
            self.run_dir,
            {
                "item_item": ItemItemState(module, self.optimizer),
                "stream": StreamState(self.stream),
                "train": self.state,
            },
            rank_parts={"rng": RNGState()},
            every=config.train.checkpoint_every,
            keep=config.train.keep_checkpoints,
            identity=item_item_identity(config, run),
            group=self.group,
        )
        self.evaluator = Evaluator(config, run, self.group, manifest)
        self.eval_history: list[dict] = []
        if self.rank == 0:
            plan = (
                f"model item_item: W {run.num_items} x {run.num_items} (full rank) + P, Q {run.num_items} x "
                f"{module.rank}, replicated on {self.world_size} workers (gradients all-reduced), float32\n"
                f"{len(users)} users with train items, {self.train_rows} train rows, "
                f"{self.stream.steps_per_epoch()} steps of {config.train.batch_size} users per epoch"
            )
            print(f"training on {self.device} ({self.world_size} workers)\n{plan}", flush=True)
            write_text_atomic(self.run_dir / PLAN_TEXT, plan + "\n")

    def train_step(self, batch: dict[str, torch.Tensor]) -> tuple[float, int]:
        """One step on the global batch of users; returns ``(mean row loss, rows of the global batch)``."""
        config = self.config
        _fail_once(config, self.run_dir, self.state.step + 1, self.rank)
        self.lr_factor = self.lr_schedule.factor(self.state.step)
        self.optimizer.lr = config.optim.item_lr * self.lr_factor
        module = self.model.module
        x = self.model.inputs(batch["user_id"])
        positives = x > 0
        scores = module(x)
        params = config.loss.params
        if config.loss.name == "rankmax":
            loss_sum = rankmax_shared_loss(scores, positives, params["margin"], reduction="sum")
        else:
            loss_sum = softmax_shared_loss(scores, positives, "sum", params.get("temperature", 1.0))
        if config.debug.nan_at_step == self.state.step + 1:
            loss_sum = loss_sum * float("nan")
        # [loss sum, rows, stop requests] of every rank: the step's mean and whether any rank must stop.
        local = torch.tensor([float(loss_sum.detach()), float(positives.sum()), float(self._stop_requested())])
        total_loss, total_rows, stops = all_reduce_no_grad(local.double(), self.group).tolist()
        self.stopping = stops > 0
        value = total_loss / max(total_rows, 1.0)
        self._check_finite(value)
        penalty = config.model.item_item_l2 / self.train_rows / self.world_size  # added once over the ranks
        for parameter in self.optimizer.parameters.values():
            parameter.grad = None
        (loss_sum / max(total_rows, 1.0) + penalty * module.squared_norm()).backward()
        module.full.grad.diagonal().zero_()
        if self.world_size > 1:
            for parameter in self.optimizer.parameters.values():
                dist.all_reduce(parameter.grad, group=self.group)
        self.optimizer.step()
        module.zero_diagonal()
        self.state.step += 1
        self.state.first_loss = value if self.state.first_loss is None else self.state.first_loss
        self.state.last_loss = value
        return value, int(total_rows)

    def _temperature(self) -> float | None:
        return None


def export_rows(run: ItemItemRun, rank: int, world_size: int, batch_users: int = 1024):
    """``(item_rows, user_rows, history_rows)`` of rank ``rank`` for ``bigrank.export.writer.export_embeddings``:
    the item vectors ``[Q_j, e_j]`` and the history rows ``[P_h, W_h]`` of its owned items (a user with items
    ``x`` is ``|x|^-1/2`` times the sum of theirs: the export's ``"fold_in": "sqrt_sum"``), and the user vectors
    ``s(x) [x P, x W]`` of an even share of the users, each ``(start, stop, float32[stop - start, r + n])``."""
    start, stop = owned_range(run.num_items, run.group)
    module = run.module
    with torch.no_grad():
        items = module.item_vectors(start, stop).cpu()
        history = torch.cat([module.inputs[start:stop], module.full[start:stop]], dim=1).cpu()
    first, last = rank * run.num_users // world_size, (rank + 1) * run.num_users // world_size
    ids = torch.arange(first, last)
    users = [run.user_vectors(ids[k : k + batch_users]) for k in range(0, len(ids), batch_users)]
    user_rows = torch.cat(users).cpu() if users else torch.empty(0, run.module.dim)
    return (start, stop, items), (first, last, user_rows), (start, stop, history)
