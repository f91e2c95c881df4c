"""``model.kind: towers`` (the default): its training step, checkpoint parts, identity and export rows
(the model itself, built and laid out, is ``bigrank.train.model``; the kind's entry in the registry is
``bigrank.model.registry``).

One step on rank r of W (global batch B, local batch b = B/W)::

    users, items  = the rank's next batch of (user, item) train pairs         ParquetStream, same steps on all ranks
    u_local       = tower(users)              [b, d]                           torchrec row-wise sharded user table
    U, target     = all_gather_rows_with_ids(u_local, items)   [B, d], int64[B]   one all-gather
                                                           (backward: reduce-scatter of dL/dU to the owners)
    loss          = L(U @ V_r^T, target; group, offset=start_r)               V_r: this rank's catalog rows
    loss.backward(); item_optimizer.step_rows(touched rows) | step_dense()   the fused user-table optimizer
                                                           updates in backward

The loss is the loss of the global batch, replicated on every rank; the catalog rows get exactly their
gradient of it, so no gradient all-reduce is needed. A replicated catalog (``model.layout``) instead takes each
rank's rows against the whole catalog and sums the gradients over the ranks (``bigrank.train.replicas``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import torch

from bigrank.atomic import write_text_atomic
from bigrank.config import Config
from bigrank.data.manifest import DatasetManifest
from bigrank.data.stream import ParquetStream
from bigrank.data.user_batches import UserBatches
from bigrank.distributed.collectives import all_gather_replicated, all_gather_rows_with_ids, all_reduce_no_grad
from bigrank.losses.fused.select import resolve_kernel
from bigrank.losses.scores import replicated_inputs, score_matrix
from bigrank.records import PLAN_JSON, PLAN_TEXT
from bigrank.train.item_optim import catalog_optimizer
from bigrank.train.kind import STOP_BIT, ExportRows, ModelKind, StepContext, StepResult, TrainingRun
from bigrank.train.losses import StepLoss
from bigrank.train.model import TowersModel, build_towers, history_generator, user_vectors
from bigrank.train.regularization import user_l2_penalty
from bigrank.train.replicas import ReplicaSync
from bigrank.train.state import CatalogState, CatalogWeights, LossState, TowerState
from bigrank.train.user_steps import check_user_batching, gather_users, shared_loss_fn, split_bags, train_items

__all__ = ["TOWERS", "TowersKind", "TowersTraining", "towers_identity"]


def towers_identity(config: Config, model: TowersModel) -> dict[str, Any]:
    """The settings a towers checkpoint's tensors depend on (a resume with other values cannot load them): the
    ``Checkpointer``'s ``identity`` for the run of ``config`` and its ``model``. Runs written before model kinds
    were registered hold this very dict: keep it as it is."""
    return {
        "model.dim": config.model.dim,
        "model.history": config.model.history,
        "dataset users": model.num_users,
        "dataset items": model.num_items,
        "optim.user_optimizer": config.optim.user_optimizer,
        "optim.item_optimizer": config.optim.item_optimizer,
    } | ({"train.batching": "users"} if config.train.batching == "users" else {})


class TowersTraining:
    """The towers' training parts on this rank (``bigrank.train.kind.Training``): the model in its layout (the
    plan printed and written to ``plan.txt``/``plan.json`` by rank 0), the stream of (user, item) rows, the item
    optimizer, the step loss, the replicated tables' updates, and the checkpoint parts ``tower``, ``catalog``,
    ``loss``. :meth:`step` is one global step (the module docstring)."""

    def __init__(self, run: TrainingRun):
        from bigrank.model.sharding import format_plan, write_plan

        config, manifest, worker = run.config, run.manifest, run.worker
        self.config, self.group, self.rank, self.world_size = config, worker.group, worker.rank, worker.world_size
        self.device = worker.device
        self.model = model = build_towers(config, self.group, manifest, self.device)
        kernel = resolve_kernel(config.train.kernel, self.device.type, config.loss)
        if self.rank == 0:
            print(f"training on {self.device} ({self.world_size} workers, precision {run.precision.name})", flush=True)
            plan_text = f"precision {run.precision.describe()}\n{_batching_line(config)}\n{kernel.describe()}"
            plan_text += f"\n{model.layout_plan}\n\n{format_plan(model.plan)}"
            print(f"sharding plan ({self.world_size} workers):\n{plan_text}", flush=True)
            write_plan(model.plan, run.run_dir / PLAN_JSON)
            write_text_atomic(run.run_dir / PLAN_TEXT, plan_text + "\n")
        train_cfg = config.train
        self.batching = train_cfg.batching
        # A rank's rows (or users, up to ceil(B / W) as UserBatches slices them) in a step.
        size, world = train_cfg.batch_size, self.world_size
        self.local_batch = -(-size // world) if self.batching == "users" else size // world
        if self.batching == "users":
            self.stream = self._user_stream(run)
        else:
            self.stream = self._row_stream(run)
        shard = model.shard
        optim = config.optim
        by_popularity = config.loss.sampler == "popularity" and config.loss.candidates == "sampled"
        self.item_optimizer = catalog_optimizer(shard.weight, optim)
        self.step_loss = StepLoss(
            config.loss,
            num_items=model.num_items,
            shard_start=shard.start,
            shard_stop=shard.stop,
            item_counts=_item_counts(manifest, shard.start, shard.stop) if by_popularity else None,
            seed=config.seed,
            rank=self.rank,
            score_dtype=run.precision.score_dtype,
            kernel=kernel.name,
        )
        # A loss whose k follows each row's label set (rankmax, loss.params.k_fraction) reads every user's
        # number of train items: int64[num_users], 8 bytes a user.
        self.user_positives = None
        if self.step_loss.needs_positives:
            self.user_positives = _user_counts(manifest, model.num_users)
        self.replicas = ReplicaSync(
            model,
            self.item_optimizer,
            optim.user_optimizer,
            optim.user_lr,
            self.group,
            full_catalog=config.loss.candidates != "sampled",
            max_touched_rows=self.local_batch + self.step_loss.num_samples,
        )
        self.parts = {
            "tower": TowerState(
                model.tower,
                {t: (p, self.replicas.tower_optimizers[t]) for t, p in model.replicated_tower.items()},
                self.group,
            ),
            "catalog": CatalogState(shard, self.item_optimizer),
            "loss": LossState(self.step_loss),
        }

    def _row_stream(self, run: TrainingRun) -> ParquetStream:
        """``train.batching: rows``: the train split's (user, item) rows, ``local_batch`` a step on this rank."""
        config, manifest, train_cfg = run.config, run.manifest, run.config.train
        stream = ParquetStream(
            manifest,
            "train",
            self.local_batch,
            rank=self.rank,
            world_size=self.world_size,
            seed=config.seed,
            shuffle_buffer=config.data.shuffle_buffer,
            drop_last=train_cfg.drop_last,
            prefetch=config.data.prefetch,
        )
        if stream.steps_per_epoch() < 1:
            raise ValueError(f"train split too small: no full step of {train_cfg.batch_size} rows (train.batch_size)")
        return stream

    def _user_stream(self, run: TrainingRun) -> UserBatches:
        """``train.batching: users``: the users with a train item, ``train.batch_size`` a global step; this rank
        takes its slice (at most ``local_batch`` users) and reads their train items each step."""
        config = run.config
        users, self.read_train_items = train_items(run.manifest, self.model.history)
        self.user_loss = shared_loss_fn(config)
        return UserBatches(users, config.train.batch_size, rank=self.rank, world_size=self.world_size, seed=config.seed)

    @property
    def temperature(self) -> float | None:
        """The step loss's current softmax temperature (warm-up schedules), for the logs."""
        return self.step_loss.temperature

    def set_lr_factor(self, factor: float) -> None:
        """The item optimizer's, the fused user tables' and the replicated tables' rates times ``factor``; before
        the forward: fbgemm's fused update takes the rate of the forward's lookup (``bigrank.train.schedule``)."""
        from bigrank.train.schedule import set_learning_rates

        optim = self.config.optim
        set_learning_rates(factor, self.item_optimizer, optim.item_lr, self.model.tower, optim.user_lr)
        self.replicas.set_user_lr(optim.user_lr * factor)

    def step(self, batch: dict[str, torch.Tensor], context: StepContext) -> StepResult:
        """One optimisation step on the global batch (collective; the module docstring, and
        ``bigrank.train.user_steps`` for ``train.batching: users``)."""
        if self.batching == "users":
            forward = self._users_forward(batch, context)
        else:
            forward = self._rows_forward(batch, context)
        return self._update(*forward, context)

    def _rows_forward(self, batch: dict[str, torch.Tensor], context: StepContext):
        """A row-wise step's loss: ``(loss, value, rows, stats, stopping, penalty)`` (see ``_update``)."""
        config = self.config
        users, items = batch["user_id"], batch["item_id"]
        dropout, sample = config.model.history_dropout, config.model.history_sample_size
        rng = None
        if dropout > 0 or sample is not None:
            rng = history_generator(config.seed, context.step, self.rank)
        local_vectors = user_vectors(
            self.model,
            users,
            pad_to=self.local_batch,
            exclude=items,
            history_dropout=dropout,
            rng=rng,
            history_sample_size=sample,
        )
        items = items.to(self.device, non_blocking=True)
        stats = None
        if self.model.shard.replicated:
            loss, value, rows, stats, stopping = self._local_loss(local_vectors, items, users, context)
        else:
            loss, value, rows, stopping = self._global_loss(local_vectors, items, users, context)
        penalty = user_l2_penalty(local_vectors, rows, config.optim.user_l2)  # this rank's rows
        return loss, value, rows, stats, stopping, penalty

    def _users_forward(self, batch: dict[str, torch.Tensor], context: StepContext):
        """A user-major step's loss (``bigrank.train.user_steps``): ``(loss, value, rows, stats, stopping,
        penalty)`` as ``_rows_forward``'s, with rows the step's (user, train item) pairs."""
        config = self.config
        users = batch["user_id"].numpy()
        indptr, items = self.read_train_items(users)
        bags = None
        if self.model.history is not None:  # the targets are the items the dropout left out of the bag
            rng = history_generator(config.seed, context.step, self.rank)
            dropout, sample = config.model.history_dropout, config.model.history_sample_size
            bags, indptr, items = split_bags(indptr, items, dropout, rng, sample)
        local_vectors = user_vectors(self.model, torch.from_numpy(users), pad_to=self.local_batch, bags=bags)
        shard, chunk, dtype = self.model.shard, config.train.chunk_size, self.step_loss.score_dtype
        stats = None
        if shard.replicated:  # this rank's users against the whole catalog
            local_rows = len(items)

            def local_sum():
                scores = score_matrix(local_vectors, shard.weight, chunk, dtype=dtype)
                indptr_t, items_t = torch.from_numpy(indptr), torch.from_numpy(items)
                return self.user_loss(scores, indptr_t, items_t, group=None, offset=shard.start)

            loss, value, rows, stats, stopping = self._local_totals(
                local_sum, local_rows, local_vectors, context, fold=False
            )
        else:
            vectors, global_indptr, global_items, stopping = gather_users(
                local_vectors, indptr, items, self.local_batch, self.group, context.stop_requested
            )
            rows = int(global_items.numel())
            scores = score_matrix(vectors, shard.weight, chunk, dtype=dtype)
            loss_sum = self.user_loss(scores, global_indptr, global_items, group=self.group, offset=shard.start)
            loss = context.poison(loss_sum / max(rows, 1))
            value = float(loss.detach())
        user_rows = torch.from_numpy(np.diff(indptr)).to(local_vectors.device)
        penalty = user_l2_penalty(local_vectors, rows, config.optim.user_l2, user_rows)
        return loss, value, rows, stats, stopping, penalty

    def _update(self, loss, value, rows, stats, stopping, penalty, context: StepContext) -> StepResult:
        """Backward and the updates of one step from its forward's ``loss`` (this rank's part of the global
        loss), ``value`` (the global mean, None while folded into the replicated gradients' all-reduce),
        ``rows``, ``stats`` (the folded ``[sum, rows, stops]``, or None), ``stopping`` and ``penalty``."""
        if stats is None:
            context.check_finite(value)
        self.model.shard.weight.grad = None
        self.replicas.zero_grad()
        (loss if penalty is None else loss + penalty).backward()
        touched = self.step_loss.last_rows  # candidate losses: only the rows the step read (sparse update)
        if self.model.shard.replicated and self.world_size > 1:
            # Sums the catalog's and the tower's replicated gradients (and the folded loss sum and row count).
            summed = self.replicas.reduce(touched, stats)
            scale = 1.0
            if stats is not None:  # the shares were taken of the nominal batch: rescale to the real one
                total_loss, total_rows, stops = summed.tolist()
                stopping = stops > 0
                value, scale, rows = total_loss / max(total_rows, 1), rows / max(total_rows, 1), int(total_rows)
                context.check_finite(value)
            self.replicas.apply(scale)
        else:
            self.replicas.step()  # the tower's replicated tables, if any
            if touched is not None:
                self.item_optimizer.step_rows(touched.ids, touched.grad)
            else:
                self.item_optimizer.step_dense(self.model.shard.weight.grad)
        self.step_loss.after_step()
        return StepResult(value, rows, stopping)

    def _global_loss(self, local_vectors, items, users, context: StepContext):
        """Sharded catalog: the loss of the all-gathered global batch against this rank's rows, the same value
        on every rank; ``(loss, value, rows of the global batch, stopping)``."""
        global_vectors, target, stopping = self._gather_batch(local_vectors, items, context.stop_requested)
        with replicated_inputs():  # the target and the batch are all-gathered: the same on every rank
            loss = self.step_loss(
                global_vectors,
                target,
                self.model.shard.weight,
                group=self.group,
                chunk_size=self.config.train.chunk_size,
                step=context.step,
                positives=self._gather_positives(users),
            )
        loss = context.poison(loss)
        return loss, float(loss.detach()), int(target.numel()), stopping

    def _local_loss(self, local_vectors, items, users, context: StepContext):
        """Replicated catalog: this rank's rows against the whole catalog, no collective in the loss.

        Returns ``(share, value, rows, stats, stopping)``: ``share`` is this rank's share of the global batch's
        mean loss (the shares of all ranks add up to the global loss, so their gradients add up to its gradient),
        ``value`` the global mean and ``rows`` the global batch's rows. The loss sum and row count cross ranks
        once so that every rank sees the same value (and the same NaN): folded into the gradient all-reduce
        after backward when nothing is updated inside backward (``stats`` float32[3] is then this rank's
        ``[sum, rows, stop request]``, ``share`` is taken of the nominal batch and ``value`` is None until the
        sum arrives), else in a small all-reduce before backward (``stats`` None). Either way the ranks' stop
        requests travel summed beside the loss: ``stopping`` is whether any rank asked (None while folded)."""
        positives = None if self.user_positives is None else self.user_positives[users].to(self.device)

        def local_sum():
            mean = self.step_loss(
                local_vectors,
                items,
                self.model.shard.weight,
                group=None,
                chunk_size=self.config.train.chunk_size,
                step=context.step,
                positives=positives,
            )
            return mean * items.numel()

        return self._local_totals(local_sum, items.numel(), local_vectors, context)

    def _local_totals(self, local_sum, rows: int, local_vectors, context: StepContext, fold: bool = True):
        """``_local_loss``'s result from ``local_sum()``, this rank's summed loss over its ``rows`` rows (not
        called without rows). ``fold=False``: never folded (a user-major step's penalty needs the step's rows
        before backward)."""
        if rows:
            local_sum = local_sum()
        else:  # an empty last batch: still part of the step's collectives (and of a sharded tower's backward)
            local_sum = local_vectors.sum() * 0.0
        local_sum = context.poison(local_sum)
        # [sum, rows, stop requests]: the ranks' stop requests are summed with the loss.
        counts = torch.tensor([float(rows), float(context.stop_requested)], device=self.device)
        totals = torch.cat([local_sum.detach().float().reshape(1), counts])
        if fold and self.replicas.folds_loss:
            nominal = self.config.train.batch_size
            return local_sum / nominal, None, nominal, totals, None
        total_loss, total_rows, stops = all_reduce_no_grad(totals.double(), self.group).tolist()
        total_rows = max(int(total_rows), 1)
        return local_sum / total_rows, total_loss / total_rows, total_rows, None, stops > 0

    def _gather_batch(
        self, local_vectors: torch.Tensor, items: torch.Tensor, stop_requested: bool
    ) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """The global batch's user vectors float[B', d] and positives int64[B'] in one all-gather (each rank's
        rows padded to the local batch: the last batch of an epoch can be smaller, even empty), and whether any
        rank's ids carried its stop request (``STOP_BIT``)."""
        if stop_requested:
            items = items.to(torch.int64) | STOP_BIT
        vectors, target = all_gather_rows_with_ids(local_vectors, items, self.local_batch, self.group)
        low, high = torch.stack(torch.aminmax(target)).tolist()  # one device-to-host read for both checks
        stopping = high >= STOP_BIT
        if stopping:
            target = torch.where(target >= STOP_BIT, target - STOP_BIT, target)
        if low >= 0:
            return vectors, target, stopping
        valid = target >= 0
        return vectors[valid], target[valid], stopping

    def _gather_positives(self, users: torch.Tensor) -> torch.Tensor | None:
        """The train-item counts int64[B'] of the global batch's users, in ``_gather_batch``'s row order (None
        unless the loss needs them)."""
        if self.user_positives is None:
            return None
        local = torch.full((self.local_batch,), -1, dtype=torch.int64)
        local[: users.numel()] = self.user_positives[users.to(torch.int64)]
        gathered = all_gather_replicated(local.to(self.device), self.group)
        return gathered[gathered >= 0]


class TowersKind(ModelKind):
    """``model.kind: towers`` (``bigrank.train.kind.ModelKind``)."""

    name = "towers"

    def preflight(self, config: Config, manifest: DatasetManifest) -> None:
        """Refuse ``train.batching: users`` with a loss taken row by row (``user_steps.check_user_batching``)."""
        check_user_batching(config)

    def start_training(self, run: TrainingRun) -> TowersTraining:
        """The towers' training parts on this rank (collective)."""
        return TowersTraining(run)

    def load(self, config: Config, worker, manifest: DatasetManifest) -> tuple[TowersModel, dict]:
        """The model in the sharded layout, without initial values, and its weights' parts (``tower``, and the
        catalog's rows without the optimizer: ``CatalogWeights``)."""
        # Evaluation and export read each table by the rows a rank owns: the sharded layout holds exactly those
        # (a checkpoint loads into any layout), without a replica of every table on every worker.
        config = dataclasses.replace(config, model=dataclasses.replace(config.model, layout="sharded"))
        model = build_towers(
            config, worker.group, manifest, device=worker.device, explain_layout=False, initialize=False
        )
        return model, {"tower": TowerState(model.tower), "catalog": CatalogWeights(model.shard)}

    def identity(self, config: Config, model: TowersModel) -> dict[str, Any]:
        """:func:`towers_identity`."""
        return towers_identity(config, model)

    def export_rows(self, model: TowersModel, rank: int, world_size: int) -> ExportRows:
        """The user table's and (with ``model.history``) the history table's rows this rank holds, and the catalog
        rows of its shard (the loaded layout is sharded: the rows are the rank's own)."""
        from bigrank.model.tables import HISTORY_TABLE, local_table_rows, local_user_rows

        start, stop, vectors = local_user_rows(model.user_module)
        users = (start, stop, vectors.detach().cpu().clone())
        history = None
        if model.history is not None:
            start, stop, rows = local_table_rows(model.user_module, HISTORY_TABLE)
            history = (start, stop, rows.detach().cpu().clone())
        shard = model.shard
        items = (shard.start, shard.stop, shard.weight.detach().cpu().clone())
        return ExportRows(items, users, history)


TOWERS = TowersKind()


def _batching_line(config: Config) -> str:
    """The plan's line saying how a step batches (``train.batching``)."""
    size = config.train.batch_size
    if config.train.batching == "users":
        return (
            f"batching: users ({size} users a step, one score vector per user for all of its train items; "
            f"{config.loss.name} shared over them)"
        )
    return f"batching: rows ({size} (user, item) rows a step, one score vector per row)"


def _item_counts(manifest: DatasetManifest, start: int, stop: int) -> torch.Tensor:
    """Train interactions of items ``[start, stop)`` (popularity sampler), read row group by row group."""
    from bigrank.data.stream import iter_row_groups

    counts = np.zeros(stop - start, dtype=np.int64)
    for group in iter_row_groups(manifest, "train", columns=("item_id",)):
        items = group["item_id"].astype(np.int64)
        items = items[(items >= start) & (items < stop)] - start
        counts += np.bincount(items, minlength=stop - start)
    return torch.from_numpy(counts)


def _user_counts(manifest: DatasetManifest, num_users: int) -> torch.Tensor:
    """Train interactions of every user, int64[num_users], read row group by row group."""
    from bigrank.data.stream import iter_row_groups

    counts = np.zeros(num_users, dtype=np.int64)
    for group in iter_row_groups(manifest, "train", columns=("user_id",)):
        counts += np.bincount(group["user_id"].astype(np.int64), minlength=num_users)
    return torch.from_numpy(counts)
