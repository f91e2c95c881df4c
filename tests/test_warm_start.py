"""``train.init_from``: a new run starts from an earlier run's checkpoint on a grown vocabulary
(``bigrank.train.warm_start``), on real gloo workers.

The brute-force expectation: right after the warm start, every tensor of the new run's model parts (weights and
optimizer state) equals the earlier run's checkpoint in the old rows (and old columns of the item-item W) and the
fresh build of the new run everywhere else. Runs on two ingests chained by ``--vocab-from``, for both model kinds,
on 1 and 2 workers (the earlier run on 2) and in both layouts.
"""

from __future__ import annotations

import pytest
import torch

from bigrank.data.ingest import IngestOptions, ingest
from bigrank.errors import ConfigError
from bigrank.train.checkpoint import latest_checkpoint
from bigrank.train.launcher import launch_local
from bigrank.train.workers import train_worker
from tests.conftest import _flatten, read_checkpoint, tiny_config
from tests.test_ingest import make_log, write_parquet_parts
from tests.test_ingest_vocab import _next_day

TOWERS = {
    "model": {"history": True},
    "loss": {"name": "softmax"},
    "optim": {"user_lr": 0.1, "item_lr": 0.1, "item_optimizer": "adagrad"},
    "train": {"batch_size": 64, "epochs": 1},
    "eval": {"every_epochs": None, "at_end": False},
}
ITEM_ITEM = {
    "model": {"kind": "item_item", "params": {"l2": 0.1}},
    "loss": {"name": "rankmax", "params": {"margin": 1.0}},
    "optim": {"item_optimizer": "adam", "item_lr": 0.05},
    "train": {"batch_size": 16, "epochs": 1},
    "eval": {"every_epochs": None, "at_end": False},
}
KINDS = {"towers": TOWERS, "item_item": ITEM_ITEM}
MODEL_PARTS = ("tower", "catalog", "item_item")  # the kinds' weight and optimizer parts (not stream, rng, ...)


@pytest.fixture(scope="module")
def days(tmp_path_factory):
    """Two days of a log ingested as a chain (the second ``--vocab-from`` the first), and an unrelated dataset."""
    root = tmp_path_factory.mktemp("days")
    options = dict(user="user", item="item", time="ts", rating="rating", progress=False, min_user_items=3)
    day1 = make_log(seed=31, rows=900, users=60, items=40, nulls=False)
    ingest([write_parquet_parts(root / "log1", day1)], root / "d1", IngestOptions(**options))
    day2 = write_parquet_parts(root / "log2", _next_day(day1, seed=32))
    ingest([day2], root / "d2", IngestOptions(**options, vocab_from=str(root / "d1")))
    ingest([day2], root / "other", IngestOptions(**options))
    return root


@pytest.fixture(scope="module")
def earlier_runs(days, tmp_path_factory):
    """A 2-worker run of each kind on day one."""
    root = tmp_path_factory.mktemp("earlier")
    for kind, settings in KINDS.items():
        launch_local(train_worker, 2, (tiny_config(days / "d1", root / kind, settings),), timeout=300)
    return root


def _fresh_then_warm(config, fresh_dir, warm_dir):
    """On this rank: build the run as a fresh run, checkpoint it, warm-start it, checkpoint it again."""
    from bigrank.train.trainer import Trainer

    trainer = Trainer(config)
    trainer.checkpointer.run_dir = fresh_dir
    trainer.save_checkpoint()
    assert trainer.resume() is None and trainer.warm_started_from is not None
    trainer.checkpointer.run_dir = warm_dir
    trainer.save_checkpoint()


def _model_tensors(checkpoint) -> dict[str, torch.Tensor]:
    state = read_checkpoint(checkpoint)
    return {
        key: value
        for part in MODEL_PARTS
        if part in state
        for key, value in _flatten(state[part], f"{part}.")
        if torch.is_tensor(value)
    }


@pytest.mark.parametrize(
    ("kind", "workers", "layout"),
    [("towers", 1, "auto"), ("towers", 2, "sharded"), ("towers", 2, "replicated"), ("item_item", 2, "auto")],
)
def test_old_rows_come_from_the_earlier_run_and_new_rows_are_a_fresh_init(
    days, earlier_runs, tmp_path, kind, workers, layout
):
    config = tiny_config(
        days / "d2", tmp_path / "run", KINDS[kind], workers=workers, train={"init_from": str(earlier_runs / kind)}
    )
    if kind == "towers":
        config.model.layout = layout
    launch_local(_fresh_then_warm, workers, (config, tmp_path / "fresh", tmp_path / "warm"), timeout=300)

    old = _model_tensors(latest_checkpoint(earlier_runs / kind))
    fresh = _model_tensors(latest_checkpoint(tmp_path / "fresh"))
    warm = _model_tensors(latest_checkpoint(tmp_path / "warm"))
    assert warm.keys() == fresh.keys() and old.keys() <= warm.keys()
    grown = 0
    for key, value in warm.items():
        before = old[key]
        block = tuple(slice(0, size) for size in before.shape)
        assert torch.equal(value[block], before), f"{key}: the old rows differ from the earlier run's"
        rest = torch.ones(value.shape, dtype=torch.bool)
        rest[block] = False
        assert torch.equal(value[rest], fresh[key][rest]), f"{key}: the new rows differ from a fresh run's"
        grown += int(rest.any())
    # towers: user, history and catalog rows and their Adagrad state; item-item: P, Q, W and their Adam moments
    assert grown >= (5 if kind == "towers" else 6), f"only {grown} tensors grew"
    changed = [key for key, value in warm.items() if value.is_floating_point() and not torch.equal(value, fresh[key])]
    assert len(changed) >= 3, "the earlier run should have moved the old rows away from the fresh init"


def test_a_warm_start_that_cannot_work_is_refused_before_any_worker_starts(days, earlier_runs, tmp_path):
    from bigrank.data.manifest import DatasetManifest
    from bigrank.run import prepare_run

    def refused(root, settings, match, **changes):
        config = tiny_config(root, tmp_path / "run", settings, train={"init_from": str(earlier_runs / "towers")})
        for key, value in changes.items():
            setattr(config.model, key, value)
        with pytest.raises(ConfigError, match=match):
            prepare_run(config, "local")

    refused(days / "d2", TOWERS, r"model.dim=8, this config has 16", dim=16)
    refused(days / "d2", ITEM_ITEM, r"model.kind='towers', this config has 'item_item'")
    refused(days / "d2", TOWERS, r"model.history=True, this config has False", history=False)
    refused(days / "other", TOWERS, "does not descend from the dataset")
    config = tiny_config(days / "d2", tmp_path / "run", TOWERS, train={"init_from": str(tmp_path / "nowhere")})
    with pytest.raises(ConfigError, match="not a run directory"):
        prepare_run(config, "local")
    # the earlier run's own dataset is fine (a descendant of itself), and so is the grown one
    for root in ("d1", "d2"):
        config = tiny_config(days / root, tmp_path / "run", TOWERS, train={"init_from": str(earlier_runs / "towers")})
        assert isinstance(prepare_run(config, "local"), DatasetManifest)
