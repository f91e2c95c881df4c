"""The model of one rank of ``model.kind: towers``: the torchrec user tower and this rank's catalog rows, each table
in its layout (its training, checkpoint parts and export rows: ``bigrank.train.towers``).

::

    users         int64[b]                      a rank's batch (b = B / W)
    u_local       = user_vectors(model, users)  float[b, d]   torchrec tables (+ history bag): row-wise sharded
                                                               or data-parallel (replicated), per table
    V_r           = model.shard.weight           float[n_r, d] the catalog rows held: [start_r, stop_r) when
                                                               sharded, all n when replicated

The layout of each table comes from ``model.layout`` (``bigrank.model.layout``: ``auto`` by a cost model
measured at start-up).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from bigrank.config import Config
from bigrank.data.manifest import DatasetManifest
from bigrank.distributed.collectives import group_size
from bigrank.model.catalog import CatalogShard

__all__ = [
    "TowersModel",
    "build_towers",
    "history_bags",
    "history_generator",
    "user_vectors",
    "user_vectors_fn",
]

_HISTORY_DRAWS = 0x4B1D  # tags the seed of history-bag draws apart from the other numpy streams of a run


@dataclass
class TowersModel:
    """The model of one rank: the user tower and the catalog rows, each table in its layout."""

    tower: Any  # DistributedModelParallel around bigrank.model.towers.UserTower
    shard: CatalogShard
    plan: Any
    num_users: int
    num_items: int
    history: tuple[np.ndarray, np.ndarray] | None  # (indptr, items) CSR of the train split, when used
    device: torch.device = torch.device("cpu")  # where the tower's rows, the catalog shard and the step live
    layout: dict[str, str] = field(default_factory=dict)  # {table: "replicated" | "sharded"}
    layout_plan: str = ""  # the cost model's table (bigrank.model.layout.format_layout_plan), or why none ran
    replicated_tower: dict[str, torch.Tensor] = field(default_factory=dict)  # data-parallel tables' parameters

    @property
    def user_module(self):
        return self.tower.module

    def ranking_view(self, known_splits: tuple[str, ...] = ("train",)):
        """``(user_vectors_fn, CatalogView)`` that evaluation ranks with: this rank's owned catalog rows (the user
        vectors are the trained rows, whatever ``known_splits``)."""
        return user_vectors_fn(self), self.shard.owned()


def build_towers(
    config: Config,
    group,
    manifest: DatasetManifest,
    device: torch.device | str = "cpu",
    explain_layout: bool = True,
    initialize: bool = True,
) -> TowersModel:
    """Build the sharded user tower and this rank's catalog shard on ``device`` (this worker's device from
    ``bigrank.devices.worker_device``) for the dataset of ``manifest`` (the run's, from
    ``bigrank.data.manifest.dataset_manifest``); collective. ``explain_layout``: see :func:`decide_layout`.
    ``initialize=False`` skips the initial values of the tables and the catalog, for a model that a checkpoint
    load fills next (evaluate, export: at ML-1B drawing them cost ~1 s of start-up)."""
    from bigrank.data.stream import read_user_items
    from bigrank.model.sharding import shard_row_wise
    from bigrank.model.tables import replicated_table_parameters
    from bigrank.model.towers import HISTORY_TABLE, USER_TABLE, UserTower

    model_cfg = config.model
    device = torch.device(device)
    layout, layout_plan = decide_layout(config, manifest, group, device, explain_layout)
    tower = UserTower(
        manifest.num_users,
        model_cfg.dim,
        num_items=manifest.num_items if model_cfg.history else None,
        history=model_cfg.history,
        init_std=model_cfg.init_std,
        seed=config.seed,
        device="meta",
    )
    dmp, plan = shard_row_wise(
        tower,
        optimizer=config.optim.user_optimizer,
        lr=config.optim.user_lr,
        process_group=group,
        device=device,
        data_parallel_tables=[t for t in (USER_TABLE, HISTORY_TABLE) if layout.get(t) == "replicated"],
        initialize=initialize,
    )
    replicated_tables = replicated_table_parameters(dmp)
    shard = CatalogShard(
        manifest.num_items,
        model_cfg.dim,
        group,
        replicated=layout["catalog"] == "replicated",
        init_std=model_cfg.item_init_std,
        seed=config.seed + 1,
        device=device,
        initialize=initialize,
    )
    history = read_user_items(manifest, "train", manifest.num_users) if model_cfg.history else None
    return TowersModel(
        dmp,
        shard,
        plan,
        manifest.num_users,
        manifest.num_items,
        history,
        device,
        layout,
        layout_plan,
        replicated_tables,
    )


def decide_layout(
    config: Config, manifest: DatasetManifest, group, device: torch.device, explain: bool = True
) -> tuple[dict[str, str], str]:
    """``({table: layout}, plan text)`` of this run (collective when a table is ``auto`` or ``explain`` on several
    workers: the cost model's constants are measured over ``group``). ``explain=False`` (evaluation, export:
    layouts given, no plan written) skips the measurement when no table is ``auto``."""
    from bigrank.config import requested_layouts
    from bigrank.losses.registry import FULL_CATALOG_LOSSES
    from bigrank.model.layout import StepShape, choose_layouts, format_layout_plan, measure_link

    requested = requested_layouts(config.model)
    world = group_size(group)
    train_rows = manifest.rows("train") if config.model.history else 0
    loss = config.loss
    shape = StepShape(
        world_size=world,
        batch_size=config.train.batch_size,
        dim=config.model.dim,
        num_items=manifest.num_items,
        num_users=manifest.num_users,
        history=config.model.history,
        mean_history=train_rows / max(manifest.num_users, 1),
        full_catalog=loss.name in FULL_CATALOG_LOSSES or loss.candidates == "catalog",
        num_negatives=int(loss.num_negatives or 0),
    )
    if world == 1:
        return dict.fromkeys(requested, "sharded"), "layout: one worker holds every table whole (one shard)"
    if not explain and "auto" not in requested.values():  # nothing to decide or show: nothing to measure
        return requested, ""
    link = measure_link(group, device, *_dense_updates(config))
    chosen = choose_layouts(shape, requested, link)
    return chosen, format_layout_plan(shape, requested, chosen, link)


def _dense_updates(config: Config):
    """The cost model's dense-update factories: a step of this run's catalog optimizer and of the tower's
    replicated-table optimizer (``bigrank.train.replicas``), as ``measure_link`` times them."""
    from bigrank.train.item_optim import catalog_optimizer
    from bigrank.train.replicas import tower_optimizer

    optim = config.optim

    def catalog(weight):
        return catalog_optimizer(weight, optim).step_dense

    def tower(weight):
        return tower_optimizer(weight, optim.user_optimizer, optim.user_lr).step_dense

    return catalog, tower


def history_bags(
    history,
    user_ids: torch.Tensor,
    exclude: torch.Tensor | None,
    dropout: float = 0.0,
    rng=None,
    sample_size: int | None = None,
):
    """``(values int64[sum(lengths)], lengths int64[b])``: each user's train items, minus the row's own
    positive (training: the bag must not contain the item being predicted). Unknown users (id < 0) get an empty
    bag.

    Args:
        history: ``(indptr int64[U+1], items int64[nnz])``, the CSR of the train split (``TowersModel.history``).
        user_ids: int64[b].
        exclude: int64[b] item to leave out of each bag (ids not in the bag leave it whole), or None.
        dropout, sample_size, rng: training only (``model.history_dropout``, ``model.history_sample_size``),
            drawn from the numpy Generator ``rng``: with ``dropout`` > 0 each remaining item leaves the bag with
            that probability, then a bag longer than ``sample_size`` keeps a uniform random subset of that many
            items (in bag order). The MEAN pooling averages whatever is kept.

    Raises ValueError when ``dropout`` or ``sample_size`` is set without ``rng``.
    """
    if rng is None and (dropout > 0 or sample_size is not None):
        raise ValueError("history_bags: history dropout and sample_size draw from rng; pass a numpy Generator")
    indptr, items = history
    parts, lengths = [], []
    excluded = exclude.tolist() if exclude is not None else None
    for k, user in enumerate(user_ids.tolist()):
        row = items[indptr[user] : indptr[user + 1]] if user >= 0 else items[:0]
        if excluded is not None:
            row = row[row != excluded[k]]
        if dropout > 0 and len(row):
            row = row[rng.random(len(row)) >= dropout]
        if sample_size is not None and len(row) > sample_size:
            row = row[np.sort(rng.choice(len(row), sample_size, replace=False))]
        parts.append(row)
        lengths.append(len(row))
    values = np.concatenate(parts).astype(np.int64) if parts else np.empty(0, np.int64)
    return torch.from_numpy(values), torch.tensor(lengths, dtype=torch.int64)


def history_generator(seed: int, step: int, rank: int) -> np.random.Generator:
    """The numpy Generator of one training step's history-bag draws on one rank: a function of
    ``(seed, step, rank)`` alone, so a resumed run draws the masks of an uninterrupted one (nothing to save in
    a checkpoint) and every step and rank draws other masks."""
    return np.random.default_rng([seed, step, rank, _HISTORY_DRAWS])


def user_vectors(
    model: TowersModel,
    user_ids: torch.Tensor,
    *,
    pad_to: int | None = None,
    exclude=None,
    history_dropout: float = 0.0,
    rng=None,
    history_sample_size: int | None = None,
    bags: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """User vectors float32[len(user_ids), d] (collective: every rank calls it with the same ``pad_to``).

    ``exclude``: int64[b] item to leave out of each user's history bag (training); ids < 0 are unknown users.
    ``history_dropout``, ``history_sample_size``, ``rng``: training only; see :func:`history_bags`.
    ``bags``: ``(values int64, lengths int64[b])``, the history bags to pool instead of the users' train items
    (a user-major step's bags, ``bigrank.train.user_steps.split_bags``).
    """
    history = None
    if bags is not None:
        history = bags
    elif model.history is not None:
        history = history_bags(model.history, user_ids, exclude, history_dropout, rng, history_sample_size)
    features = model.user_module.features(user_ids, history, pad_to=pad_to, device=model.device)
    return model.tower(features)[: user_ids.numel()]


def user_vectors_fn(model: TowersModel):
    """``fn(user_ids int64[b]) -> float[b, d]`` for evaluation (no grad; callers pad collectively)."""

    def fn(user_ids: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return user_vectors(model, torch.as_tensor(user_ids, dtype=torch.int64))

    return fn
