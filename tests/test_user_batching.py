"""``train.batching: users`` for the towers (``bigrank.train.user_steps``): a step of users, one score vector
each; its plan line, its refusals, and a mid-epoch resume on other worker counts that finishes as the
uninterrupted run did (the users of each global step are the same on any worker count, and the loss is global)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from bigrank.errors import ConfigError
from bigrank.run import prepare_run
from bigrank.train.launcher import launch_local
from bigrank.train.workers import train_worker
from tests.conftest import read_checkpoint, tiny_config

RUN = {
    "loss": {"name": "rankmax", "params": {"k": 1, "margin": 1.0}},
    "model": {"layout": "sharded"},
    "optim": {"user_lr": 0.1, "item_lr": 0.1},
    "train": {"batching": "users", "batch_size": 24, "epochs": 4, "precision": "fp32", "chunk_size": 32},
    "eval": {"every_epochs": None, "at_end": True, "ks": [10], "splits": ["valid"]},
}


def _config(root, run_dir, workers=2, **sections):
    return tiny_config(root, run_dir, RUN, workers=workers, **sections)


@pytest.fixture(scope="module")
def user_runs(tiny_dataset, tmp_path_factory):
    """An uninterrupted 2-worker users run of 4 epochs (5 steps each) and the same run stopped at step 7."""
    root = tmp_path_factory.mktemp("user-batching")
    straight = launch_local(train_worker, 2, (_config(tiny_dataset, root / "straight"),), timeout=300)[0]
    stopped = root / "stopped"
    launch_local(train_worker, 2, (_config(tiny_dataset, stopped, train={"max_steps": 7}),), timeout=300)
    return root, straight, stopped


def test_a_users_run_plans_learns_and_counts_rows(user_runs):
    root, straight, _ = user_runs
    plan = (root / "straight" / "plan.txt").read_text()
    assert "batching: users (24 users a step, one score vector per user" in plan
    assert straight["steps"] == 4 * 5  # 120 users with a train item, 24 a step
    records = [json.loads(line) for line in (root / "straight" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["type"] == "train"]
    assert train[-1]["loss"] < train[0]["loss"]
    assert straight["eval"]["valid"]["recall@10"] > 0.4  # random: ~0.1


def test_users_resumed_on_three_then_one_worker_finish_as_the_uninterrupted_run(tiny_dataset, user_runs):
    """2 workers to step 7, 3 workers to step 13, 1 worker to the end: the same global steps, so the same
    catalog as the uninterrupted 2-worker run within float32 summation order."""
    root, straight, stopped = user_runs
    run_dir = root / "elastic"
    shutil.copytree(stopped, run_dir)
    middle = launch_local(train_worker, 3, (_config(tiny_dataset, run_dir, 3, train={"max_steps": 13}),), timeout=300)
    assert middle[0]["resumed_from"].endswith("step-00000007")
    final = launch_local(train_worker, 1, (_config(tiny_dataset, run_dir, 1),), timeout=300)[0]
    assert final["steps"] == straight["steps"]
    ends = [read_checkpoint(d / "checkpoints" / f"step-{final['steps']:08d}") for d in (root / "straight", run_dir)]
    torch.testing.assert_close(ends[1]["catalog"]["weight"], ends[0]["catalog"]["weight"], rtol=1e-4, atol=1e-5)
    assert final["eval"]["valid"]["recall@10"] == pytest.approx(straight["eval"]["valid"]["recall@10"], abs=0.01)


def test_a_rows_checkpoint_is_not_resumed_as_users(tiny_dataset, user_runs):
    """The batching changes what the stream's position means: the refusal names ``train.batching``."""
    root, _, stopped = user_runs
    rows = _config(tiny_dataset, root / "rows", train={"batching": "rows", "batch_size": 120, "max_steps": 2})
    launch_local(train_worker, 1, (rows,), timeout=300)
    users = _config(tiny_dataset, root / "rows", 1, train={"max_steps": 4})
    with pytest.raises(Exception, match="train.batching"):
        launch_local(train_worker, 1, (users,), timeout=300)


@pytest.mark.parametrize(
    ("sections", "message"),
    [
        ({"loss": {"name": "sparsemax", "params": {}}}, "loss 'sparsemax' is taken row by row"),
        ({"loss": {"name": "rankmax", "params": {"k": 3}}}, "rankmax with k > 1"),
        ({"loss": {"name": "rankmax", "params": {"k_fraction": 0.5}}}, "rankmax with k > 1"),
        ({"loss": {"name": "smooth_ap", "params": {}}}, "loss 'smooth_ap' is taken row by row"),
        ({"model": {"layout": "sharded", "history": True}}, "needs model.history_dropout > 0"),
    ],
)
def test_users_batching_refuses_what_it_cannot_share_before_any_worker(tiny_dataset, tmp_path, sections, message):
    config = _config(tiny_dataset, tmp_path / "run", **sections)
    with pytest.raises(ConfigError, match=message):
        prepare_run(config, launcher="local")


def test_a_users_run_with_a_history_bag_learns(tiny_dataset, tmp_path):
    """The history tower: each user's train items split into the bag and the targets (``split_bags``)."""
    model = {"layout": "sharded", "history": True, "history_dropout": 0.3}
    config = _config(tiny_dataset, tmp_path / "run", model=model)
    result = launch_local(train_worker, 2, (config,), timeout=300)[0]
    assert result["eval"]["valid"]["recall@10"] > 0.4  # random: ~0.1


def test_split_bags_keeps_every_target_out_of_its_users_bag():
    """Each user's train items are split: targets (left out by the dropout) and the bag (the rest, at most
    ``sample_size``); no target is in its own user's bag, and every item is one or the other unless sampled out."""
    import numpy as np

    from bigrank.train.user_steps import split_bags

    rng = np.random.default_rng(0)
    lengths = np.array([0, 1, 7, 30, 12])
    indptr = np.concatenate([[0], np.cumsum(lengths)])
    items = np.concatenate([rng.choice(100, n, replace=False) for n in lengths]).astype(np.int64)
    (values, bag_lengths), target_indptr, targets = split_bags(indptr, items, 0.4, np.random.default_rng(1), 5)
    assert target_indptr[-1] == len(targets) and 0 < len(targets) < len(items)
    bag_starts = np.concatenate([[0], np.cumsum(bag_lengths.numpy())])
    for user in range(len(lengths)):
        own = set(items[indptr[user] : indptr[user + 1]].tolist())
        bag = set(values[bag_starts[user] : bag_starts[user + 1]].tolist())
        target = set(targets[target_indptr[user] : target_indptr[user + 1]].tolist())
        assert bag <= own and target <= own and not bag & target
        assert len(bag) == min(5, len(own) - len(target))  # the bag is whatever the dropout kept, sampled to 5
