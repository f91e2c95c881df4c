"""``model.kind: item_bag``: a user is the bag of its items. Its model, training step, evaluation view, checkpoint
parts and export rows (the kind's entry is in ``bigrank.model.registry``, its parameters in
``bigrank.model.item_bag_params``).

For a user with train items ``x`` (multi-hot, float[n]) the scores of the whole catalog are

    u(x) = s(x) x P,     s(x) = |x|^(-1/2)                                       the user vector, float[d]
    z(x) = u(x) Q^T - s(x) x * diag(P Q^T)                                        float[n]

``P`` (the input rows) and ``Q`` (the output rows, the catalog) are both ``[n, d]`` (d = ``model.dim``). An item's
own input never scores it: the second term takes each of the user's items' own contribution out of its own score
(EASE's zero diagonal, Steck 2019, eq. 2; FISM's "exclude the item being rated", Kabbur et al. 2013, eq. 4), so
every train item ``y`` of ``u`` is a training row ``(z(x), y)`` and the user's rows share one score vector
(``bigrank.losses.shared``). It is the item-item model's low-rank term on its own, without its ``n x n`` matrix,
so it scales with the catalog as the towers do:

* nothing is stored per user: a user's vector is computed from its items whenever it is needed, so it is never
  stale (the towers' user rows move once an epoch when trained user by user), and a user unseen in training is
  served from its items (the export's history rows are ``P``, folded in by ``"sqrt_sum"``);
* the correction touches one score per item of the bag, at the rank that holds both of that item's rows: a
  ``PatchedScores`` over the dot products (``bigrank.losses.scores``), so the loss, its gradient and the item-parallel
  exchange are those of every full-catalog loss.

Item-parallel, whatever the number of workers: rank r holds the input and output rows of its catalog rows
``[start_r, stop_r)`` (``shard_range``), so ``P_i`` and ``Q_i`` of an item sit on the same rank. One step on rank r of
W (a global batch of B users, each rank's slice of ``UserBatches``)::

    x_u, targets    = each local user's train items; with bag_dropout the bag keeps each with prob 1 - p, and
                      every train item stays a target                         (the split's per-user index)
    bags, targets   = the global batch's lists from every rank               gather_lists: two all-gathers
    U_r             = s(x) sum_{i in x, i on r} P_i          [B, d]          this rank's items of every bag
    U               = all_reduce_partials(U_r)               [B, d]          backward: all-reduce of dL/dU
    z_r             = U Q_r^T - s(x) P_i . Q_i at (u, i), i in x on r         PatchedScores(ChunkedScores)
    loss            = L_shared(z_r, targets; group) / R                      R: the step's (user, item) rows
    backward; the touched input rows and every output row updated (optim.item_optimizer, item_lr), each with the
    L2 penalty (lambda / N) ||row||^2 (model.params.l2; N the split's train rows)

The loss is the mean over the step's rows, as the towers' users step, so an epoch's objective is the row-wise one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import Any

import numpy as np
import torch

from bigrank.atomic import write_text_atomic
from bigrank.config import Config, model_params
from bigrank.data.manifest import DatasetManifest
from bigrank.data.user_batches import UserBatches
from bigrank.distributed.collectives import all_reduce_no_grad, all_reduce_partials
from bigrank.losses.scores import PatchedScores, score_matrix
from bigrank.model.catalog import CatalogShard
from bigrank.records import PLAN_TEXT
from bigrank.train.item_optim import RowOptimizer
from bigrank.train.kind import ExportRows, ModelKind, StepContext, StepResult, TrainingRun
from bigrank.train.state import CatalogState, CatalogWeights
from bigrank.train.user_steps import gather_lists, shared_loss_fn, split_items, train_items

__all__ = ["ITEM_BAG", "ItemBagKind", "ItemBagRun", "ItemBagTraining", "build_item_bag", "item_bag_identity"]

# The checkpoint parts of the two tables. "catalog" is the output rows' part, named as the towers' catalog: the
# item vectors that evaluation and export read.
INPUTS, OUTPUTS = "inputs", "catalog"


def keyed_uniform(seed: int, step: int, users: np.ndarray, items: np.ndarray) -> np.ndarray:
    """float64 in [0, 1) for each ``(users[e], items[e])`` pair (int64 arrays of one length): a function of
    ``(seed, step, user, item)`` alone (SplitMix64's finaliser over the combined keys; Steele et al. 2014), so
    the draw does not depend on which rank reads the pair."""
    with np.errstate(over="ignore"):
        state = np.uint64(seed) * np.uint64(0x9E3779B97F4A7C15) + np.uint64(step)
        keys = _mix64(_mix64(np.full(len(users), state, dtype=np.uint64)) ^ users.astype(np.uint64))
        keys = _mix64(keys ^ (items.astype(np.uint64) * np.uint64(0xD1B54A32D192ED03)))
    return (keys >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


def _mix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser (wrapping uint64 arithmetic)."""
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def bag_scale(lengths: torch.Tensor) -> torch.Tensor:
    """``s(x) = |x|^(-1/2)`` float32[U] of bags of ``lengths`` int64[U] (an empty bag: 1; its vector is 0 anyway)."""
    return lengths.clamp_min(1).to(torch.float32).rsqrt()


@dataclass
class LocalBags:
    """The items of a batch of U users' bags that this rank holds: ``user`` int64[E] (each entry's row in the batch),
    ``column`` int64[E] (its local row, ``item - start``), ``scale`` float32[U] (``s(x)`` of each whole bag)."""

    user: torch.Tensor
    column: torch.Tensor
    scale: torch.Tensor

    @classmethod
    def of(cls, indptr: torch.Tensor, items: torch.Tensor, start: int, stop: int) -> LocalBags:
        """The entries of the CSR ``(indptr int64[U + 1], items int64)`` (global item ids) in ``[start, stop)``."""
        lengths = indptr[1:] - indptr[:-1]
        user = torch.repeat_interleave(torch.arange(lengths.numel(), device=items.device), lengths)
        held = (items >= start) & (items < stop)
        return cls(user[held], items[held] - start, bag_scale(lengths))

    def pool(self, picked: torch.Tensor, users: int) -> torch.Tensor:
        """This rank's part of the batch's user vectors, float32[U, d]: ``s(x) sum P_i`` over the held items, from
        ``picked`` float32[E, d], each entry's input row."""
        weighted = picked * self.scale[self.user].unsqueeze(1)
        return picked.new_zeros(users, picked.shape[1]).index_add(0, self.user, weighted)


@dataclass
class ItemBagRun:
    """A built item-bag model on this rank: its input rows ``inputs`` (P) and output rows ``outputs`` (Q, the
    catalog), both holding this rank's rows ``[start, stop)``; ``read_items(users int64[b]) -> (indptr, items)``
    the train items of any users (the split's per-user index). What training, evaluation and export share.
    Evaluation makes a user of its items in every split it leaves out of the ranking (``ranking_view``): with a
    given split's test, the items carved into valid are known too, and pooled without retraining."""

    inputs: CatalogShard
    outputs: CatalogShard
    read_items: Any
    users_with_items: np.ndarray
    num_users: int
    num_items: int
    manifest: DatasetManifest | None = None
    group: Any = None
    device: torch.device = torch.device("cpu")
    readers: dict = field(default_factory=dict)  # the other splits' item readers (known_items), opened once

    @property
    def dim(self) -> int:
        return self.outputs.dim

    def user_vectors(self, user_ids, known_splits: tuple[str, ...] = ("train",)) -> torch.Tensor:
        """``s(x) x P`` float32[b, d] of ``user_ids`` int64[b] from their items in ``known_splits`` (no grad;
        collective: every rank calls it with the same users and pools the items it holds)."""
        ids = torch.as_tensor(user_ids, dtype=torch.int64).cpu().numpy()
        indptr, items = (torch.from_numpy(a).to(self.device) for a in self.known_items(ids, known_splits))
        bags = LocalBags.of(indptr, items, self.inputs.start, self.inputs.stop)
        with torch.no_grad():
            return all_reduce_no_grad(bags.pool(self.inputs.weight.detach()[bags.column], len(ids)), self.group)

    def known_items(self, users: np.ndarray, splits: tuple[str, ...]) -> tuple[np.ndarray, np.ndarray]:
        """The items of ``users`` in ``splits``: ``(indptr int64[b + 1], items int64)``, each user's items of the
        splits one after the other (their per-user indexes, opened once)."""
        parts = [self.read_items(users) if split == "train" else self._reader(split)(users) for split in splits]
        if len(parts) == 1:
            return parts[0]
        lengths = sum(np.diff(indptr) for indptr, _ in parts)
        indptr = np.zeros(len(users) + 1, dtype=np.int64)
        np.cumsum(lengths, out=indptr[1:])
        # Each split's items of a user go after the earlier splits' items of that user.
        rows = np.concatenate([np.repeat(np.arange(len(users)), np.diff(part)) for part, _ in parts])
        order = np.argsort(rows, kind="stable")
        return indptr, np.concatenate([items for _, items in parts])[order]

    def _reader(self, split: str):
        if split not in self.readers:
            self.readers[split] = split_items(self.manifest, split)[1]
        return self.readers[split]

    def ranking_view(self, known_splits: tuple[str, ...] = ("train",)):
        """``(user_vectors_fn, CatalogView)`` evaluation ranks with: the users made of their items in
        ``known_splits`` (what the evaluation leaves out of the ranking), the output rows this rank owns."""
        return partial(self.user_vectors, known_splits=tuple(known_splits)), self.outputs.owned()


def build_item_bag(
    config: Config, group, manifest: DatasetManifest, device: torch.device | str = "cpu", initialize: bool = True
) -> ItemBagRun:
    """The item-bag model of ``config`` for the dataset of ``manifest`` on ``device``: this rank's input and output
    rows (``shard_range`` of ``group``), initialised N(0, ``model.params.init_std``^2) from ``config.seed`` whatever
    the worker count (``initialize=False``: zeros, for a checkpoint load); collective only through the index build."""
    device = torch.device(device)
    params = model_params(config)
    tables = [
        CatalogShard(
            manifest.num_items,
            config.model.dim,
            group,
            init_std=params.init_std,
            seed=config.seed + offset,
            device=device,
            initialize=initialize,
        )
        for offset in (2, 1)  # the output rows draw what the towers' catalog draws (seed + 1)
    ]
    users, read = train_items(manifest)
    return ItemBagRun(*tables, read, users, manifest.num_users, manifest.num_items, manifest, group, device)


def item_bag_identity(config: Config, run: ItemBagRun) -> dict[str, Any]:
    """The checkpoint identity of an item-bag run (the settings its tensors depend on)."""
    return {
        "model.kind": "item_bag",
        "model.dim": config.model.dim,
        "dataset users": run.num_users,
        "dataset items": run.num_items,
        "optim.item_optimizer": config.optim.item_optimizer,
    }


class ItemBagTraining:
    """The item-bag model's training parts on this rank (``bigrank.train.kind.Training``; the module docstring): the
    model, the user batches, an optimizer for each table, the checkpoint parts ``inputs`` and ``catalog``."""

    temperature = None  # no temperature schedule

    def __init__(self, run: TrainingRun):
        config, manifest, worker = run.config, run.manifest, run.worker
        self.config, self.group, self.rank, self.world_size = config, worker.group, worker.rank, worker.world_size
        self.device, self.score_dtype = worker.device, run.precision.score_dtype
        self.params = params = model_params(config)
        self.model = model = build_item_bag(config, self.group, manifest, worker.device)
        self.train_rows = int(manifest.rows("train"))
        if self.train_rows == 0:
            raise ValueError(f"the train split of {manifest.root} is empty")
        size = config.train.batch_size
        self.local_batch = -(-size // self.world_size)
        self.stream = UserBatches(
            model.users_with_items, size, rank=self.rank, world_size=self.world_size, seed=config.seed
        )
        self.loss = shared_loss_fn(config)
        optim = config.optim
        # L2 (lambda / N) ||row||^2 as the optimizers' weight decay 2 lambda / N: on the input rows a step reads
        # (step_rows) and on every output row (step_dense; every item is scored).
        decay = 2.0 * params.l2 / self.train_rows
        self.optimizers = {
            name: RowOptimizer(table.weight, optim.item_optimizer, optim.item_lr, weight_decay=decay)
            for name, table in ((INPUTS, model.inputs), (OUTPUTS, model.outputs))
        }
        self.parts = {name: CatalogState(table, self.optimizers[name]) for name, table in self._tables()}
        if self.rank == 0:
            plan = _plan(config, model, self.world_size, run.precision.describe(), self.stream.steps_per_epoch())
            print(f"training on {self.device} ({self.world_size} workers)\n{plan}", flush=True)
            write_text_atomic(run.run_dir / PLAN_TEXT, plan + "\n")

    def _tables(self):
        return ((INPUTS, self.model.inputs), (OUTPUTS, self.model.outputs))

    def set_lr_factor(self, factor: float) -> None:
        """Both optimizers' rate: ``optim.item_lr`` times ``factor``."""
        for optimizer in self.optimizers.values():
            optimizer.lr = self.config.optim.item_lr * factor

    def _bags_and_targets(self, users: np.ndarray, step: int):
        """This rank's users' ``(bags, targets)`` CSRs: every train item is a target; the bag keeps each with
        probability 1 - ``bag_dropout``, drawn from ``(seed, step, user, item)`` alone, so any worker count and a
        resumed run draw the same bags."""
        indptr, items = self.model.read_items(users)
        targets = (indptr, items)
        dropout = self.params.bag_dropout
        if dropout == 0:
            return targets, targets
        row = np.repeat(np.arange(len(users)), np.diff(indptr))
        keep = keyed_uniform(self.config.seed, step, users[row], items) >= dropout
        bag_indptr = np.zeros(len(users) + 1, dtype=np.int64)
        np.cumsum(np.bincount(row[keep], minlength=len(users)), out=bag_indptr[1:])
        return (bag_indptr, items[keep]), targets

    def step(self, batch: dict[str, torch.Tensor], context: StepContext) -> StepResult:
        """One step on the global batch of users (collective): the mean row loss of the global batch."""
        model = self.model
        inputs, outputs = model.inputs, model.outputs
        bags, targets = self._bags_and_targets(batch["user_id"].numpy(), context.step)
        ((bag_indptr, bag_items), (target_indptr, target_items)), stopping = gather_lists(
            [bags, targets], self.local_batch, self.group, context.stop_requested, self.device
        )
        held = LocalBags.of(bag_indptr, bag_items, inputs.start, inputs.stop)
        touched, entry_rows = torch.unique(held.column, return_inverse=True)
        rows = inputs.weight.detach()[touched].requires_grad_()  # the input rows this step reads
        picked = rows[entry_rows]
        vectors = all_reduce_partials(held.pool(picked, bag_indptr.numel() - 1), self.group)
        # Each bag item's own term out of its own score: -s(x) P_i . Q_i, where both rows are.
        own = (picked * outputs.weight[held.column]).sum(dim=1) * held.scale[held.user]
        scores = score_matrix(vectors, outputs.weight, self.config.train.chunk_size, dtype=self.score_dtype)
        scores = PatchedScores(scores, held.user, held.column, -own)
        loss_sum = self.loss(scores, target_indptr, target_items, group=self.group, offset=outputs.start)
        row_count = int(target_items.numel())
        loss = context.poison(loss_sum / max(row_count, 1))
        value = float(loss.detach())
        context.check_finite(value)
        outputs.weight.grad = None
        loss.backward()
        self.optimizers[INPUTS].step_rows(touched, rows.grad)
        self.optimizers[OUTPUTS].step_dense(outputs.weight.grad)
        return StepResult(value, row_count, stopping)


class ItemBagKind(ModelKind):
    """``model.kind: item_bag`` (``bigrank.train.kind.ModelKind``)."""

    name = "item_bag"

    def start_training(self, run: TrainingRun) -> ItemBagTraining:
        """The training parts on this rank (collective)."""
        return ItemBagTraining(run)

    def load(self, config: Config, worker, manifest: DatasetManifest) -> tuple[ItemBagRun, dict]:
        """The model without initial values and its weights' parts (no optimizer state)."""
        run = build_item_bag(config, worker.group, manifest, worker.device, initialize=False)
        return run, {INPUTS: CatalogWeights(run.inputs), OUTPUTS: CatalogWeights(run.outputs)}

    def identity(self, config: Config, model: ItemBagRun) -> dict[str, Any]:
        """:func:`item_bag_identity`."""
        return item_bag_identity(config, model)

    def export_rows(self, model: ItemBagRun, rank: int, world_size: int, batch_users: int = 4096) -> ExportRows:
        """The output rows (item vectors) and input rows (history rows: a user given by items is their sum over
        the square root of their count, ``"sqrt_sum"``) this rank owns, and the user vectors of an even share of
        the users (computed collectively: every rank pools its items for every user)."""
        first, last = rank * model.num_users // world_size, (rank + 1) * model.num_users // world_size
        users = []
        for start in range(0, model.num_users, batch_users):  # the same batches on every rank
            stop = min(start + batch_users, model.num_users)
            vectors = model.user_vectors(torch.arange(start, stop))
            low, high = max(start, first), min(stop, last)
            if high > low:
                users.append(vectors[low - start : high - start].cpu())
        user_rows = torch.cat(users) if users else torch.empty(0, model.dim)
        items = model.outputs.owned()
        history = model.inputs.owned()
        info = {"kind": "item_bag", "user_vectors": "full", "fold_in": "sqrt_sum"}
        return ExportRows(
            (items.start, items.stop, items.weight.cpu().clone()),
            (first, last, user_rows),
            (history.start, history.stop, history.weight.cpu().clone()),
            info,
        )


ITEM_BAG = ItemBagKind()


def _plan(config: Config, model: ItemBagRun, world_size: int, precision: str, steps: int) -> str:
    """The plan's lines (``plan.txt``): the model, its layout, the batching."""
    params = model_params(config)
    n, d = model.num_items, model.dim
    layout = (
        f"item-parallel on {world_size} workers: each holds the input and output rows of its ~{n // world_size:,} "
        "items; the user vectors' partial sums are all-reduced, the losses exchange per-row statistics"
        if world_size > 1
        else "one worker holds both tables"
    )
    return (
        f"model item_bag: input rows P and output rows Q, {n:,} x {d} each; a user is s(x) x P (no user rows), "
        f"each item's own term out of its own score\n"
        f"layout: {layout}\n"
        f"precision {precision}\n"
        f"batching: users ({config.train.batch_size} users a step, one score vector per user for all of its train "
        f"items; {config.loss.name} shared over them; {steps} steps an epoch), bag dropout {params.bag_dropout}, "
        f"L2 {params.l2} / train rows"
    )
