"""model.kind item_item: the full-rank item-item model (bigrank.model.item_item) and its user-by-user trainer
(bigrank.train.item_item) — the scores against explicit loops, the dot-product form that evaluation, export and
serving use, the user batches on any worker count, Adam, the config checks, and real gloo runs: a run resumed on
another worker count lands on the same model, evaluation equals brute force over the exported vectors (loaded
from the checkpoint on 2 workers, as `bigrank evaluate` loads it), fold-in equals the exported users."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from bigrank.config import config_from_dict, validate
from bigrank.errors import ConfigError
from bigrank.model.item_item import MAX_ITEMS, ItemItemModel, check_catalog_size, multi_hot
from bigrank.train.item_item import DenseAdam, UserBatches
from bigrank.train.launcher import launch_local
from bigrank.train.workers import export_worker, train_worker
from tests.conftest import brute_force_metrics, read_checkpoint, tiny_config


def _trained_like(num_items=9, rank=3, seed=0) -> ItemItemModel:
    model = ItemItemModel(num_items, rank, seed=seed, init_std=0.5)
    with torch.no_grad():
        model.full.copy_(torch.randn(num_items, num_items, generator=torch.Generator().manual_seed(seed + 1)))
        model.zero_diagonal()
    return model


def test_scores_follow_the_definition_and_the_dot_product_form():
    """z(x)_j = s(x) (sum_{h in x, h != j} W[h, j] + P[h] . Q[j]) by explicit loops, and u(x) . v_j equals it on
    every item outside x (on x it adds the item's own P[j] . Q[j], never ranked: train items are excluded)."""
    model = _trained_like()
    history = (np.array([0, 3, 3, 5]), np.array([1, 4, 7, 2, 8]))  # users 0, 1 (no items), 2
    users = np.array([2, 0, 1])
    x = multi_hot(history, users, 9)
    assert x.tolist() == [[0, 0, 1, 0, 0, 0, 0, 0, 1], [0, 1, 0, 0, 1, 0, 0, 1, 0], [0] * 9]
    with torch.no_grad():
        scores = model(x)
        dots = model.user_vectors(x) @ model.item_vectors(0, 9).T
    W, P, Q = model.full.detach(), model.inputs.detach(), model.outputs.detach()
    for row, user in enumerate(users):
        items = history[1][history[0][user] : history[0][user + 1]]
        scale = 1 / np.sqrt(max(len(items), 1))
        for j in range(9):
            expected = scale * sum(float(W[h, j] + P[h] @ Q[j]) for h in items if h != j)
            assert float(scores[row, j]) == pytest.approx(expected, abs=1e-5)
            if j not in items:
                assert float(dots[row, j]) == pytest.approx(expected, abs=1e-5)
    assert torch.equal(model.item_vectors(4, 6)[:, 3:], torch.eye(9)[4:6])  # e_j of a slice of the catalog


def test_catalog_size_is_bounded_with_a_clear_error():
    check_catalog_size(MAX_ITEMS)
    with pytest.raises(ValueError, match="item_item holds an n x n matrix.*model.kind towers"):
        check_catalog_size(MAX_ITEMS + 1)


def test_dense_adam_is_torch_adam():
    generator = torch.Generator().manual_seed(0)
    ours = {"a": torch.randn(4, 3, generator=generator).requires_grad_(), "b": torch.randn(5, generator=generator)}
    ours["b"].requires_grad_()
    theirs = {name: p.detach().clone().requires_grad_() for name, p in ours.items()}
    adam, reference = DenseAdam(ours, lr=0.1), torch.optim.Adam(theirs.values(), lr=0.1)
    for step in range(4):
        for params in (ours, theirs):
            for p in params.values():
                p.grad = torch.sin(p.detach() * (step + 1))
        adam.step()
        reference.step()
    for name in ours:
        torch.testing.assert_close(ours[name], theirs[name], rtol=1e-6, atol=1e-7)
    assert float(adam.steps) == 4


def test_user_batches_cover_each_user_once_per_epoch_on_any_worker_count():
    users = np.arange(3, 40, 2)  # 19 users, batches of 6: 4 steps, the last one short
    one = UserBatches(users, 6, seed=5)
    batches = [b["user_id"].tolist() for b in one]
    assert one.epoch == 1 and one.steps_per_epoch() == 4
    assert sorted(sum(batches, [])) == users.tolist()
    assert [len(b) for b in batches] == [6, 6, 6, 1]
    three = [UserBatches(users, 6, rank=r, world_size=3, seed=5) for r in range(3)]
    slices = list(zip(*three, strict=True))
    assert [sum((s["user_id"].tolist() for s in step), []) for step in slices] == batches
    assert [b["user_id"].tolist() for b in one] != batches  # epoch 1: another order
    # Resume mid-epoch on another worker count: the rest of the epoch is the same users.
    stopped = UserBatches(users, 6, seed=5)
    iterator = iter(stopped)
    next(iterator)
    state = stopped.state_dict()
    resumed = UserBatches(users, 6, rank=0, world_size=1, seed=5)
    resumed.load_state_dict(state)
    assert [b["user_id"].tolist() for b in resumed] == batches[1:]
    with pytest.raises(ValueError, match="batch_size=6 but this run has 7"):
        UserBatches(users, 7, seed=5).load_state_dict(state)


RUN = {
    "model": {"kind": "item_item", "params": {"l2": 0.1}},
    "loss": {"name": "rankmax", "params": {"margin": 1.0}},
    "optim": {"item_optimizer": "adam", "item_lr": 0.05, "lr_decay": "linear"},
    "train": {"batch_size": 30, "epochs": 5},
    "eval": {"every_epochs": 2, "ks": [10], "splits": ["valid", "test"]},
}


def _raw(root, run_dir, workers=2, **sections) -> dict:
    return tiny_config(root, run_dir, RUN, workers=workers, raw=True, **sections)


@pytest.mark.parametrize(
    ("section", "values", "message"),
    [
        ("loss", {"name": "sparsemax", "params": {}}, "loss.name must be rankmax or softmax"),
        ("loss", {"params": {"k": 2}}, "loss.params.k must be 1"),
        ("optim", {"item_optimizer": "adagrad"}, "optim.item_optimizer must be adam"),
        ("model", {"history": True}, "model.history must be false"),
        ("optim", {"weight_decay": 1e-4}, "optim.weight_decay must be 0 .* its L2 is model.params.l2"),
        ("model", {"params": {"l2": -1}}, "model.params.l2 must be >= 0"),
        ("model", {"params": {"l2": "x"}}, "model.params.l2 must be a number"),
        ("model", {"params": {"lambda": 1}}, "unknown key 'model.params.lambda': model.kind 'item_item' accepts l2"),
        ("model", {"kind": "graph"}, "model.kind must be one of towers, item_item"),
    ],
)
def test_config_names_the_setting_item_item_cannot_train_with(tmp_path, section, values, message):
    with pytest.raises(ConfigError, match=message):
        validate(config_from_dict(_raw(tmp_path, tmp_path / "run", **{section: values})))


def _parameters(run_dir, step):
    state = read_checkpoint(run_dir / "checkpoints" / f"step-{step:08d}")["item_item"]
    return {name: state[name] for name in ("full", "inputs", "outputs")} | {
        f"adam {name}": tensor for name, tensor in state["adam"].items()
    }


@pytest.fixture(scope="module")
def item_item_runs(tiny_dataset, tmp_path_factory):
    """The tiny data trained 5 epochs (20 steps) on 2 workers, and the same run resumed on 1 worker from its
    mid-epoch checkpoint of step 9 (every later checkpoint removed)."""
    root = tmp_path_factory.mktemp("item-item")
    train = {"checkpoint_every": 9, "keep_checkpoints": 10}
    config = validate(config_from_dict(_raw(tiny_dataset, root / "two", 2, train=train)))
    runs = {"two": launch_local(train_worker, 2, (config,), timeout=300)[0]}
    shutil.copytree(root / "two", root / "resumed")
    for checkpoint in (root / "resumed" / "checkpoints").iterdir():
        if int(checkpoint.name.split("-")[1]) > 9:
            shutil.rmtree(checkpoint)
    resumed = validate(config_from_dict(_raw(tiny_dataset, root / "resumed", 1, eval={"every_epochs": None})))
    runs["resumed"] = launch_local(train_worker, 1, (resumed,), timeout=300)[0]
    return root, runs


def test_a_run_resumed_on_another_worker_count_trains_the_same_model(item_item_runs):
    """Data parallel: 2 workers, then 1 from step 9, end where 2 workers end (the gradients of a global batch
    are the same sum however the users are split)."""
    root, runs = item_item_runs
    assert runs["two"]["steps"] == runs["resumed"]["steps"] == 20
    assert runs["resumed"]["resumed_from"].endswith("step-00000009")
    two, resumed = _parameters(root / "two", 20), _parameters(root / "resumed", 20)
    assert len(two) == 3 + 2 * 3 + 1  # W, P, Q and Adam's two moments of each, and its step count
    for key, tensor in two.items():
        torch.testing.assert_close(resumed[key], tensor, rtol=1e-4, atol=1e-5, msg=key)
    assert float(two["full"].diagonal().abs().max()) == 0.0  # an item's own input never scores it
    assert float(two["full"].abs().max()) > 0.01  # W learned something


def test_item_item_ranks_held_out_items_and_evaluation_equals_brute_force_on_the_export(item_item_runs, tiny_dataset):
    from bigrank.export.recommend import load_export, read_table

    root, runs = item_item_runs
    summary = runs["two"]
    assert len(summary["eval_history"]) == 2  # epochs 2 and 4; the end is the final evaluation
    trained = summary["eval"]["test"]
    assert trained["recall@10"] > 0.4  # topic data: a random ranking of 101 items gets ~0.1
    config = validate(config_from_dict(_raw(tiny_dataset, root / "two", 2)))
    export = root / "export"
    launch_local(export_worker, 2, (config, str(export)), timeout=300)
    manifest = load_export(export)
    items, users = (read_table(export, manifest, name)["embedding"].astype(np.float64) for name in ("items", "users"))
    assert items.shape == (101, 8 + 101) and users.shape == (120, 8 + 101)
    assert json.loads((export / "manifest.json").read_text())["model"]["kind"] == "item_item"
    expected = brute_force_metrics(tiny_dataset, "test", users, items, [10])
    for name in ("accuracy", "recall@10", "ap@10"):
        assert trained[name] == pytest.approx(expected[name], abs=1e-6), name
    # A user given by its train items folds in to its exported vector: |x|^-1/2 times the sum of history rows.
    from bigrank.export.recommend import Recommender
    from tests.conftest import read_pairs

    recommender = Recommender(export)
    assert recommender.manifest["fold_in"] == "sqrt_sum" and recommender.has_history
    for user, history in list(read_pairs(tiny_dataset, "train").items())[:5]:
        folded = recommender.fold_in_vector(sorted(history))
        np.testing.assert_allclose(folded, users[user], rtol=1e-5, atol=1e-5)


def test_the_pre_flight_refuses_a_catalog_too_large_before_any_worker_starts(tiny_dataset, tmp_path, monkeypatch):
    from bigrank import run
    from bigrank.model import item_item

    config = validate(config_from_dict(_raw(tiny_dataset, tmp_path / "run")))
    assert run.prepare_run(config, "local").num_items == 101
    monkeypatch.setattr(item_item, "MAX_ITEMS", 100)  # the tiny catalog has 101 items
    with pytest.raises(ConfigError, match="101 items need .* use model.kind towers"):
        run.prepare_run(config, "local")
    assert not (tmp_path / "run").exists()
