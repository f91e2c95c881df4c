"""model.kind item_bag (bigrank.train.item_bag): a user is the bag of its items. One step against a brute-force
reference (multi-hot users, the dense score matrix with each item's own term taken out, the mask-based shared
Rankmax, a hand-written SGD update) on 1, 2 and 3 real gloo workers (item-parallel, uneven shards); a resume on
other worker counts; evaluation equal to brute force over the export; fold-in equal to the exported users; early
stopping that ends with the best evaluation's weights; the config checks."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from bigrank.config import config_from_dict, validate
from bigrank.data.stream import read_user_items
from bigrank.data.user_batches import UserBatches
from bigrank.errors import ConfigError
from bigrank.losses import rankmax_shared_loss
from bigrank.model.catalog import CatalogShard
from bigrank.model.item_item import multi_hot
from bigrank.train.launcher import launch_local
from bigrank.train.workers import export_worker, train_worker
from tests.conftest import brute_force_metrics, read_checkpoint, read_pairs, tiny_config

RUN = {
    "model": {"kind": "item_bag", "params": {"l2": 4.0, "init_std": 0.3}},
    "loss": {"name": "rankmax", "params": {"k": 1, "margin": 1.0}},
    "optim": {"item_optimizer": "adam", "item_lr": 0.05, "lr_decay": "linear"},
    "train": {"batch_size": 24, "epochs": 6, "precision": "fp32", "chunk_size": 16},
    "eval": {"every_epochs": 2, "ks": [10], "splits": ["valid", "test"]},
}


def _raw(root, run_dir, workers=2, *layers, **sections) -> dict:
    return tiny_config(root, run_dir, RUN, *layers, workers=workers, raw=True, **sections)


def _config(root, run_dir, workers=2, *layers, **sections):
    return validate(config_from_dict(_raw(root, run_dir, workers, *layers, **sections)))


def _tables(run_dir, step):
    state = read_checkpoint(run_dir / "checkpoints" / f"step-{step:08d}")
    return state["inputs"]["weight"], state["catalog"]["weight"]


def _reference_step(root, num_items=101, dim=8, seed=3, lr=0.5, l2=4.0, margin=1.0, batch=24):
    """The first step of ``_one_step_config`` in plain torch: P, Q as the run initialises them, the step's users
    as UserBatches orders them, z = s(x) (x P Q^T - x * diag(P Q^T)), the mask-based shared Rankmax, the L2 on
    every row, one SGD update. Returns the mean row loss (what the run logs) and the updated P and Q."""
    init = RUN["model"]["params"]["init_std"]
    inputs = CatalogShard(num_items, dim, init_std=init, seed=seed + 2).weight.detach().double().requires_grad_()
    outputs = CatalogShard(num_items, dim, init_std=init, seed=seed + 1).weight.detach().double().requires_grad_()
    history = read_user_items(root, "train", 120)
    users = np.flatnonzero(np.diff(history[0]) > 0)
    x = multi_hot(history, UserBatches(users, batch, seed=seed).order(0)[:batch], num_items).double()
    scores = x.sum(dim=1, keepdim=True).rsqrt() * ((x @ inputs) @ outputs.T - x * (inputs * outputs).sum(dim=1))
    rows = x > 0
    loss = rankmax_shared_loss(scores, rows, margin, reduction="sum") / rows.sum()
    penalty = l2 / history[0][-1] * (inputs.pow(2).sum() + outputs.pow(2).sum())
    (loss + penalty).backward()
    with torch.no_grad():
        return float(loss), inputs - lr * inputs.grad, outputs - lr * outputs.grad


def _one_step_config(root, run_dir, workers):
    return _config(
        root,
        run_dir,
        workers,
        optim={"item_optimizer": "sgd", "item_lr": 0.5, "lr_decay": "none"},
        train={"max_steps": 1, "precision": "fp32"},
        eval={"every_epochs": None, "at_end": False},
    )


@pytest.mark.parametrize("workers", [1, 2, 3])
def test_a_step_equals_the_dense_reference_on_any_worker_count(tiny_dataset, tmp_path, workers):
    """Item-parallel: 2 and 3 workers split the 101 items unevenly; each holds both rows of its items, pools its
    items of every bag and patches its own items' scores; the step is the one-process dense step."""
    loss, inputs, outputs = _reference_step(tiny_dataset)
    summary = launch_local(train_worker, workers, (_one_step_config(tiny_dataset, tmp_path, workers),), timeout=300)
    assert summary[0]["first_loss"] == pytest.approx(loss, rel=1e-5)
    got_inputs, got_outputs = _tables(tmp_path, 1)
    torch.testing.assert_close(got_inputs.double(), inputs, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got_outputs.double(), outputs, rtol=1e-5, atol=1e-6)


# The resumed runs' settings: a constant rate (the middle leg stops at train.max_steps, which a decay would read as
# the run's length) and Adagrad (Adam's normalised steps turn the float32 summation orders of 2, 3 and 1 workers
# into visible differences within a few dozen steps, where a Rankmax support boundary moves by a rounding error).
DROPOUT = {
    "model": {"params": {**RUN["model"]["params"], "bag_dropout": 0.25}},
    "optim": {"lr_decay": "none", "item_optimizer": "adagrad", "item_lr": 0.1},
}


@pytest.fixture(scope="module")
def item_bag_runs(tiny_dataset, tmp_path_factory):
    """The tiny data trained 6 epochs (30 steps) on 2 workers with a bag dropout (Adagrad), and the same run resumed
    on 3 workers from its mid-epoch checkpoint of step 12, then on 1 worker from step 21."""
    root = tmp_path_factory.mktemp("item-bag")
    train = {"checkpoint_every": 12, "keep_checkpoints": 10}
    runs = {"two": launch_local(train_worker, 2, (_config(tiny_dataset, root / "two", 2, DROPOUT, train=train),))[0]}
    shutil.copytree(root / "two", root / "resumed")
    for checkpoint in (root / "resumed" / "checkpoints").iterdir():
        if int(checkpoint.name.split("-")[1]) > 12:
            shutil.rmtree(checkpoint)
    quiet = {"every_epochs": None}
    resumed = _config(tiny_dataset, root / "resumed", 3, DROPOUT, train={"max_steps": 21}, eval=quiet)
    launch_local(train_worker, 3, (resumed,), timeout=300)
    resumed = _config(tiny_dataset, root / "resumed", 1, DROPOUT, eval=quiet)
    runs["resumed"] = launch_local(train_worker, 1, (resumed,), timeout=300)[0]
    return root, runs


def test_a_run_resumed_on_other_worker_counts_trains_the_same_model(item_bag_runs):
    """The users, their bag dropout (drawn from (seed, step, user, item)) and the loss of every global step are
    the same on any worker count."""
    root, runs = item_bag_runs
    assert runs["two"]["steps"] == runs["resumed"]["steps"] == 30
    for got, expected in zip(_tables(root / "resumed", 30), _tables(root / "two", 30), strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
    plan = (root / "two" / "plan.txt").read_text()
    assert "model item_bag: input rows P and output rows Q, 101 x 8 each" in plan
    assert "item-parallel on 2 workers" in plan and "bag dropout 0.25" in plan


def test_evaluation_equals_brute_force_on_the_export_and_fold_in_equals_the_users(item_bag_runs, tiny_dataset):
    from bigrank.export.recommend import Recommender, load_export, read_table

    root, runs = item_bag_runs
    trained = runs["two"]["eval"]["test"]
    assert trained["recall@10"] > 0.4  # topic data: a random ranking of 101 items gets ~0.1
    export = root / "export"
    launch_local(export_worker, 2, (_config(tiny_dataset, root / "two", 2, DROPOUT), str(export)), timeout=300)
    manifest = load_export(export)
    items, users = (read_table(export, manifest, name)["embedding"].astype(np.float64) for name in ("items", "users"))
    assert items.shape == (101, 8) and users.shape == (120, 8)
    assert json.loads((export / "manifest.json").read_text())["model"]["kind"] == "item_bag"
    expected = brute_force_metrics(tiny_dataset, "test", users, items, [10])
    for name in ("accuracy", "recall@10", "ap@10"):
        assert trained[name] == pytest.approx(expected[name], abs=1e-6), name
    # The users are their bags: a user given by its train items folds in to its exported vector, and so does a
    # user the run never saw.
    recommender = Recommender(export)
    assert recommender.manifest["fold_in"] == "sqrt_sum" and recommender.has_history
    inputs, _ = _tables(root / "two", 30)
    for user, history in list(read_pairs(tiny_dataset, "train").items())[:5]:
        folded = recommender.fold_in_vector(sorted(history))
        np.testing.assert_allclose(folded, users[user], rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(folded, inputs[sorted(history)].sum(0) / np.sqrt(len(history)), rtol=1e-5)


def test_early_stopping_ends_with_the_best_evaluation(tiny_dataset, tmp_path):
    """A learning rate that overshoots after a few epochs: the run stops after `patience` worse evaluations, keeps
    the best evaluation's checkpoint beyond keep_checkpoints, ends with its weights (the last checkpoint's
    trainer.json names them) and evaluates them; a second `bigrank train` finds the run finished."""
    config = _config(
        tiny_dataset,
        tmp_path,
        1,
        optim={"item_lr": 0.3, "lr_decay": "none"},
        train={"epochs": 40, "keep_checkpoints": 1, "early_stopping": {"metric": "ap@10", "patience": 2}},
        eval={"every_epochs": 1},
    )
    summary = launch_local(train_worker, 1, (config,), timeout=300)[0]
    evaluations = [(record["step"], record["ap@10"]) for record in summary["eval_history"]]
    best_step, best = max(evaluations, key=lambda entry: (entry[1], -entry[0]))
    assert summary["steps"] < 40 * 5, "the run should stop early"
    assert summary["steps"] == evaluations[-1][0] and best_step == evaluations[-3][0]
    assert all(value <= best for _, value in evaluations[-2:])
    assert "stopped early (2 evaluations without a better ap@10)" in summary["early_stopping"]
    last = tmp_path / "checkpoints" / f"step-{summary['steps']:08d}"
    assert json.loads((last / "trainer.json").read_text())["weights_from_step"] == best_step
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [
        f"step-{s:08d}" for s in (best_step, summary["steps"])
    ]
    for got, expected in zip(_tables(tmp_path, summary["steps"]), _tables(tmp_path, best_step), strict=True):
        assert torch.equal(got, expected)
    assert summary["eval"]["valid"]["ap@10"] == pytest.approx(best, abs=1e-9)
    assert summary["eval"]["valid"]["weights_from_step"] == best_step
    again = launch_local(train_worker, 1, (config,), timeout=300)[0]
    assert again["steps"] == summary["steps"] and again["examples"] == 0


@pytest.mark.parametrize(
    ("section", "values", "message"),
    [
        ("loss", {"name": "sampled_softmax", "params": {}}, "loss.name must be rankmax or softmax"),
        ("loss", {"params": {"k": 2}}, "loss.params.k must be 1"),
        ("model", {"history": True}, "model.history must be false"),
        ("model", {"layout": "replicated"}, "model.layout must be auto or sharded"),
        ("optim", {"user_l2": 0.1}, "optim.user_l2 must be 0 .* its L2 is model.params.l2"),
        ("model", {"params": {"bag_dropout": 1.0}}, r"model.params.bag_dropout must be in \[0, 1\)"),
        ("model", {"params": {"alpha": 1}}, "unknown key 'model.params.alpha': model.kind 'item_bag' accepts l2"),
        ("train", {"kernel": "fused"}, "train.kernel fused has no kernel for model.kind item_bag"),
        ("train", {"early_stopping": {"metric": "mrr"}}, "must be accuracy, recall@K, ap@K or ndcg@K"),
    ],
)
def test_config_names_the_setting_item_bag_cannot_train_with(tmp_path, section, values, message):
    with pytest.raises(ConfigError, match=message):
        validate(config_from_dict(_raw(tmp_path, tmp_path / "run", **{section: values})))


def test_early_stopping_on_the_test_split_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="must be valid .stopping on 'test' would tune on it"):
        validate(
            config_from_dict(
                _raw(tmp_path, tmp_path / "run", train={"early_stopping": {}}, eval={"splits": ["test", "valid"]})
            )
        )


def test_a_given_splits_test_users_are_made_of_their_train_and_carved_valid_items(tmp_path):
    """A benchmark's train.txt/test.txt (--split given, valid carved from train): the test ranking leaves out train
    and valid, and the item-bag user is made of both (what the user is known by), without retraining: eval.json
    equals brute force over vectors pooled from train + valid, and pooling train alone ranks otherwise."""
    from tests.test_ingest_given import ingest_benchmark_files

    data = ingest_benchmark_files(tmp_path)
    config = _config(data, tmp_path / "run", 1, eval={"ks": [20], "every_epochs": 0, "splits": ["valid", "test"]})
    summary = launch_local(train_worker, 1, (config,), timeout=300)[0]
    inputs, outputs = (t.double().numpy() for t in _tables(tmp_path / "run", summary["steps"]))

    def users_of(*splits):
        known = [read_pairs(data, split) for split in splits]
        vectors = np.zeros((120, inputs.shape[1]))
        for user in range(120):
            items = sorted(set().union(*(pairs.get(user, set()) for pairs in known)))
            if items:
                vectors[user] = inputs[items].sum(axis=0) / np.sqrt(len(items))
        return vectors

    evaluated = summary["eval"]["test"]
    expected = brute_force_metrics(data, "test", users_of("train", "valid"), outputs, [20], exclude=("train", "valid"))
    for name in ("accuracy", "recall@20", "ndcg@20", "ap@20"):
        assert evaluated[name] == pytest.approx(expected[name], abs=1e-6), name
    train_only = brute_force_metrics(data, "test", users_of("train"), outputs, [20], exclude=("train", "valid"))
    assert train_only["ndcg@20"] != pytest.approx(expected["ndcg@20"], abs=1e-6)
    assert evaluated["recall@20"] > 0.4
