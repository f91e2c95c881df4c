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
MovieLens-1M (issue 25). The kind (:data:`ITEM_ITEM`, registered in ``bigrank.model.registry``; its parameters
are ``bigrank.model.item_item_params``) supplies the model, its step, its checkpoint part and the order of the
data; ``bigrank.train.trainer.Trainer``'s loop does the rest (checkpoints, signals, the schedule, logs,
evaluation), as for every kind.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from bigrank.atomic import write_text_atomic
from bigrank.config import Config, model_params
from bigrank.data.manifest import DatasetManifest
from bigrank.data.user_batches import UserBatches
from bigrank.distributed.collectives import all_reduce_no_grad
from bigrank.errors import ConfigError
from bigrank.losses import rankmax_shared_loss, softmax_shared_loss
from bigrank.model.catalog import CatalogView, owned_range
from bigrank.model.item_item import ItemItemModel, check_catalog_size, multi_hot
from bigrank.records import PLAN_TEXT
from bigrank.train.kind import ExportRows, ModelKind, StepContext, StepResult, TrainingRun

__all__ = [
    "ITEM_ITEM",
    "DenseAdam",
    "ItemItemKind",
    "ItemItemRun",
    "ItemItemState",
    "ItemItemTraining",
    "UserBatches",
    "build_item_item",
    "item_item_identity",
]

_PARAMETERS = ("full", "inputs", "outputs")


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
    """A built item-item model on this rank: the module, the train split's items of every user (its input), and the
    catalog rows ``[owned_start, owned_stop)`` this rank owns (it holds them all: the model is replicated); what
    training, evaluation and export share."""

    module: ItemItemModel
    history: tuple[np.ndarray, np.ndarray]  # (indptr, items) CSR of the train split
    num_users: int
    num_items: int
    owned_start: int
    owned_stop: int
    device: torch.device = torch.device("cpu")  # where the module lives (this worker's device)

    def inputs(self, user_ids) -> torch.Tensor:
        """The multi-hot train items float32[b, n] of ``user_ids``, on the module's device."""
        ids = torch.as_tensor(user_ids, dtype=torch.int64).cpu().numpy()
        return multi_hot(self.history, ids, self.num_items).to(self.device)

    def user_vectors(self, user_ids: torch.Tensor) -> torch.Tensor:
        """float[b, r + n] score-time vectors of ``user_ids`` (no grad)."""
        with torch.no_grad():
            return self.module.user_vectors(self.inputs(user_ids))

    def ranking_view(self, known_splits: tuple[str, ...] = ("train",)):
        """``(user_vectors_fn, CatalogView)`` evaluation ranks with: the item vectors ``[Q_j, e_j]`` of the rows
        this rank owns (the user vectors read the train items the model holds, whatever ``known_splits``)."""
        start, stop = self.owned_start, self.owned_stop
        with torch.no_grad():
            rows = self.module.item_vectors(start, stop)
        return self.user_vectors, CatalogView(start, stop, self.num_items, self.module.dim, rows)


def build_item_item(config, group, manifest: DatasetManifest, device: torch.device | str = "cpu") -> ItemItemRun:
    """The item-item model of ``config`` for the dataset of ``manifest`` on ``device`` (this worker's device),
    initialised from ``config.seed`` (drawn on the CPU: the same values on every device); the rows this rank owns
    are its share of ``group``'s (``owned_range``)."""
    from bigrank.data.stream import read_user_items

    device = torch.device(device)
    module = ItemItemModel(manifest.num_items, config.model.dim, seed=config.seed).to(device)
    history = read_user_items(manifest, "train", manifest.num_users)
    start, stop = owned_range(manifest.num_items, group)
    return ItemItemRun(module, history, manifest.num_users, manifest.num_items, start, stop, device)


def item_item_identity(config, run: ItemItemRun) -> dict[str, Any]:
    """The checkpoint identity of an item-item run (the settings its tensors depend on)."""
    return {
        "model.kind": "item_item",
        "model.dim": config.model.dim,
        "dataset users": run.num_users,
        "dataset items": run.num_items,
    }


class ItemItemTraining:
    """The item-item model's training parts on this rank (``bigrank.train.kind.Training``; the module docstring):
    the model, the user batches, dense Adam, the checkpoint part ``item_item``."""

    def __init__(self, run: TrainingRun):
        config, manifest, worker = run.config, run.manifest, run.worker
        self.config, self.group, self.world_size = config, worker.group, worker.world_size
        self.model = model = build_item_item(config, self.group, manifest, worker.device)
        module = model.module
        indptr = model.history[0]
        users = np.flatnonzero(np.diff(indptr) > 0)
        self.train_rows = int(indptr[-1])
        if self.train_rows == 0:
            raise ValueError(f"the train split of {manifest.root} is empty")
        self.l2 = model_params(config).l2
        self.stream = UserBatches(
            users, config.train.batch_size, rank=worker.rank, world_size=self.world_size, seed=config.seed
        )
        self.optimizer = DenseAdam({name: getattr(module, name) for name in _PARAMETERS}, config.optim.item_lr)
        self.parts = {"item_item": ItemItemState(module, self.optimizer)}
        if worker.rank == 0:
            plan = (
                f"model item_item: W {model.num_items} x {model.num_items} (full rank) + P, Q {model.num_items} x "
                f"{module.rank}, replicated on {self.world_size} workers (gradients all-reduced), float32\n"
                f"{len(users)} users with train items, {self.train_rows} train rows, "
                f"{self.stream.steps_per_epoch()} steps of {config.train.batch_size} users per epoch"
            )
            print(f"training on {worker.device} ({self.world_size} workers)\n{plan}", flush=True)
            write_text_atomic(run.run_dir / PLAN_TEXT, plan + "\n")

    temperature = None  # no temperature schedule

    def set_lr_factor(self, factor: float) -> None:
        """Adam's rate: ``optim.item_lr`` times ``factor``."""
        self.optimizer.lr = self.config.optim.item_lr * factor

    def step(self, batch: dict[str, torch.Tensor], context: StepContext) -> StepResult:
        """One step on the global batch of users (collective): the mean row loss of the global batch."""
        config = self.config
        module = self.model.module
        x = self.model.inputs(batch["user_id"])
        positives = x > 0
        scores = module(x)
        params = config.loss.params
        if config.loss.name == "rankmax":
            loss_sum = rankmax_shared_loss(scores, positives, params["margin"], reduction="sum")
        else:
            loss_sum = softmax_shared_loss(scores, positives, "sum", params.get("temperature", 1.0))
        loss_sum = context.poison(loss_sum)
        # [loss sum, rows, stop requests] of every rank: the step's mean and whether any rank must stop.
        local = torch.tensor([float(loss_sum.detach()), float(positives.sum()), float(context.stop_requested)])
        total_loss, total_rows, stops = all_reduce_no_grad(local.double(), self.group).tolist()
        value = total_loss / max(total_rows, 1.0)
        context.check_finite(value)
        penalty = self.l2 / self.train_rows / self.world_size  # added once over the ranks
        for parameter in self.optimizer.parameters.values():
            parameter.grad = None
        (loss_sum / max(total_rows, 1.0) + penalty * module.squared_norm()).backward()
        module.full.grad.diagonal().zero_()
        if self.world_size > 1:
            for parameter in self.optimizer.parameters.values():
                dist.all_reduce(parameter.grad, group=self.group)
        self.optimizer.step()
        module.zero_diagonal()
        return StepResult(value, int(total_rows), stops > 0)


class ItemItemKind(ModelKind):
    """``model.kind: item_item`` (``bigrank.train.kind.ModelKind``)."""

    name = "item_item"

    def preflight(self, config: Config, manifest: DatasetManifest) -> None:
        """An ``n x n`` matrix: refuse a catalog too large (``MAX_ITEMS``) before any worker starts."""
        try:
            check_catalog_size(manifest.num_items)
        except ValueError as error:
            raise ConfigError(str(error)) from None

    def start_training(self, run: TrainingRun) -> ItemItemTraining:
        """The training parts on this rank (collective)."""
        return ItemItemTraining(run)

    def load(self, config: Config, worker, manifest: DatasetManifest) -> tuple[ItemItemRun, dict]:
        """The model and its matrices' part (no Adam moments)."""
        run = build_item_item(config, worker.group, manifest, worker.device)
        return run, {"item_item": ItemItemState(run.module)}

    def identity(self, config: Config, model: ItemItemRun) -> dict[str, Any]:
        """:func:`item_item_identity`."""
        return item_item_identity(config, model)

    def export_rows(self, model: ItemItemRun, rank: int, world_size: int) -> ExportRows:
        """:func:`export_rows`, with the manifest's ``model`` additions: the kind, the vectors' dimension r + n, the
        rank r, user rows that are whole vectors, and fold-in by ``sqrt_sum``."""
        items, users, history = export_rows(model, rank, world_size)
        module = model.module
        info = {
            "kind": "item_item",
            "dim": module.dim,
            "rank": module.rank,
            "user_vectors": "full",
            "fold_in": "sqrt_sum",
        }
        return ExportRows(items, users, history, info)


ITEM_ITEM = ItemItemKind()


def export_rows(run: ItemItemRun, rank: int, world_size: int, batch_users: int = 1024):
    """``(item_rows, user_rows, history_rows)`` of rank ``rank`` for ``bigrank.export.writer.export_embeddings``:
    the item vectors ``[Q_j, e_j]`` and the history rows ``[P_h, W_h]`` of its owned items (a user with items
    ``x`` is ``|x|^-1/2`` times the sum of theirs: the export's ``"fold_in": "sqrt_sum"``), and the user vectors
    ``s(x) [x P, x W]`` of an even share of the users, each ``(start, stop, float32[stop - start, r + n])``."""
    start, stop = run.owned_start, run.owned_stop
    module = run.module
    with torch.no_grad():
        items = module.item_vectors(start, stop).cpu()
        history = torch.cat([module.inputs[start:stop], module.full[start:stop]], dim=1).cpu()
    first, last = rank * run.num_users // world_size, (rank + 1) * run.num_users // world_size
    ids = torch.arange(first, last)
    users = [run.user_vectors(ids[k : k + batch_users]) for k in range(0, len(ids), batch_users)]
    user_rows = torch.cat(users).cpu() if users else torch.empty(0, run.module.dim)
    return (start, stop, items), (first, last, user_rows), (start, stop, history)
