"""The trainer with real gloo processes, real Parquet data and real checkpoints: a run killed mid-way and
restarted ends with exactly the parameters and optimizer states of an uninterrupted run, a NaN loss stops the run
naming the step and the last good checkpoint, a dead worker does not hang the launcher, every configured loss
learns (the loss falls, both tables move, Recall@10 beats random). Training, evaluation with another worker count
and export through the CLI are in tests/test_workflow.py."""

from __future__ import annotations

import copy
import dataclasses
import json
import pickle

import numpy as np
import pytest
import torch

from bigrank.train.launcher import WorkerError, launch_local
from bigrank.train.workers import train_worker
from tests.conftest import TINY_ITEMS as NUM_ITEMS
from tests.conftest import checkpoint_parameters, read_checkpoint, tiny_config

RUN = {
    "loss": {"name": "rankmax"},
    "optim": {"user_lr": 0.1, "item_lr": 0.1},
    "train": {"batch_size": 64, "epochs": 3},
    "eval": {"every_epochs": None, "at_end": False},
}


def _config(root, run_dir, **sections):
    return tiny_config(root, run_dir, RUN, **sections)


def _train_records(run_dir):
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [record for record in map(json.loads, lines) if record["type"] == "train"]


RESUME_CASES = {
    # Sampled Smooth-AP after a sampled-softmax warm-up (a schedule and per-step negative draws to resume),
    # lazy Adam on the touched item rows and row-wise Adagrad on the users (optimizer states to resume).
    "smooth_ap_warmup_adam": {
        "loss": {
            "name": "smooth_ap",
            "candidates": "sampled",
            "sampler": "popularity",
            "num_negatives": 40,
            "warmup": {"loss": "sampled_softmax", "steps": 4, "blend_steps": 3, "temp_decay_steps": 10},
        },
        "optim": {"item_optimizer": "adam", "item_lr": 0.01},
    },
    # The fused sampled softmax with sparse row-wise Adagrad updates of the touched item rows, and a history
    # tower whose bags lose items at random (per-step draws to resume).
    "sampled_softmax_rowwise_adagrad_history_dropout": {
        "model": {"history": True, "history_dropout": 0.5, "history_sample_size": 8},
        "loss": {"name": "sampled_softmax", "num_negatives": 40},
        "optim": {"item_optimizer": "rowwise_adagrad", "item_lr": 0.05},
    },
}


@pytest.mark.parametrize("case", list(RESUME_CASES))
def test_resume_after_a_crash_equals_an_uninterrupted_run(tiny_dataset, tmp_path, case):
    # 2 epochs + a bit, sparse item updates (StepLoss.last_rows -> RowOptimizer.step_rows) on every step.
    sections = dict(RESUME_CASES[case])
    sections["train"] = {"batch_size": 200, "epochs": 3, "max_steps": 20, "checkpoint_every": 4}
    warmup = "warmup" in sections["loss"]
    straight = tmp_path / "straight"
    summary = launch_local(train_worker, 2, (_config(tiny_dataset, straight, **sections),), timeout=240)[0]
    assert summary["steps"] == 20 and summary["steps_per_epoch"] < 10  # crosses two epoch boundaries

    crashed = tmp_path / "crashed"
    config = _config(tiny_dataset, crashed, debug={"fail_at_step": 15, "fail_rank": 1}, **sections)
    with pytest.raises(WorkerError, match="rank 1 failed: WorkerDied"):
        launch_local(train_worker, 2, (config,), timeout=240)
    stale = crashed / "checkpoints" / "step-00000099.partial"  # as if a save had crashed half-way
    (stale / "tower").mkdir(parents=True)
    resumed = launch_local(train_worker, 2, (config,), timeout=240)[0]  # the same command again
    assert not stale.exists()
    assert resumed["resumed_from"].endswith("step-00000012") and resumed["steps"] == 20

    expected = checkpoint_parameters(straight / "checkpoints" / "step-00000020")
    actual = checkpoint_parameters(crashed / "checkpoints" / "step-00000020")
    # The whole optimizer states: the user tables' (row-wise Adagrad: momentum1) and every rank's Adam state
    # (step, exp_avg, exp_avg_sq), key for key.
    assert any(key.endswith("momentum1") for key in expected[2]), sorted(expected[2])
    torch.testing.assert_close(actual[2], expected[2], rtol=1e-6, atol=1e-7)
    item_keys = {"adam": {"step", "exp_avg", "exp_avg_sq", "row_step"}, "rowwise_adagrad": {"step", "sum"}}
    assert [set(state) for state in expected[3]] == [item_keys[sections["optim"]["item_optimizer"]]], expected[3]
    torch.testing.assert_close(actual[3], expected[3], rtol=1e-6, atol=1e-9)
    assert all(float(state["step"]) == 20 for state in actual[3])
    torch.testing.assert_close(actual[0], expected[0], rtol=1e-6, atol=1e-7)  # catalog
    torch.testing.assert_close(actual[1], expected[1], rtol=1e-6, atol=1e-7)  # user table
    if "model" in sections:
        history_table = "tables.embedding_bags.history_table.weight"
        expected_rows, actual_rows = (
            read_checkpoint(run / "checkpoints" / "step-00000020")["tower"]["model"][history_table]
            for run in (straight, crashed)
        )
        torch.testing.assert_close(actual_rows, expected_rows, rtol=1e-6, atol=1e-7)
        # The dropout reaches the step: with the same sample size but no dropout the first step's loss is another.
        whole = dict(
            sections, model={"history": True, "history_sample_size": 8}, train=dict(sections["train"], max_steps=1)
        )
        launch_local(train_worker, 2, (_config(tiny_dataset, tmp_path / "whole", **whole),), timeout=240)
        assert _train_records(tmp_path / "whole")[0]["loss"] != pytest.approx(_train_records(straight)[0]["loss"])
    assert actual[4] == expected[4]  # data stream positions
    if warmup:
        schedule = json.loads(read_checkpoint(crashed / "checkpoints" / "step-00000020")["loss"]["schedule"])
        assert schedule["schedule"]["global_step"] == 20
    # The log of the crashed run's lost steps was replaced by the resumed run's: one record per step.
    assert [r["step"] for r in _train_records(crashed)] == list(range(1, 21))
    assert [r["loss"] for r in _train_records(crashed)] == pytest.approx(
        [r["loss"] for r in _train_records(straight)], rel=1e-5
    )
    assert all("temperature" in r for r in _train_records(crashed))


def test_nan_loss_stops_the_run_naming_the_step_and_the_last_checkpoint(tiny_dataset, tmp_path):
    run_dir = tmp_path / "nan"
    config = _config(tiny_dataset, run_dir, train={"max_steps": 10, "checkpoint_every": 2}, debug={"nan_at_step": 5})
    with pytest.raises(WorkerError) as error:
        launch_local(train_worker, 2, (config,), timeout=240)
    assert error.value.error_type == "FloatingPointError"
    assert "loss is nan at step 5" in error.value.message
    assert str(run_dir / "checkpoints" / "step-00000004") in error.value.message
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir())[-1:] == ["step-00000004"]
    # Resuming that run with another model is refused before any tensor is loaded.
    other = _config(tiny_dataset, run_dir, model={"dim": 12}, train={"max_steps": 10})
    with pytest.raises(WorkerError, match=r"checkpoint of another model \(model.dim differ"):
        launch_local(train_worker, 2, (other,), timeout=240)


def _fail_on_rank_one(marker):
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise ValueError(f"bad input on purpose ({marker})")
    dist.barrier()  # rank 0 waits for rank 1 forever: the launcher must kill it
    return "never"


def test_launcher_reports_the_failing_rank_and_does_not_hang():
    with pytest.raises(WorkerError) as error:
        launch_local(_fail_on_rank_one, 2, ("xyz",), timeout=120)
    assert error.value.rank == 1 and error.value.error_type == "ValueError"
    assert "bad input on purpose (xyz)" in str(error.value) and "Traceback" in error.value.traceback
    # Ray Tune copies and pickles a trial's exception: both keep every field (not a TypeError from __init__).
    for twin in (copy.copy(error.value), pickle.loads(pickle.dumps(error.value))):
        assert (twin.rank, twin.error_type, twin.message, twin.traceback) == (
            1, "ValueError", error.value.message, error.value.traceback
        )  # fmt: skip
        assert str(twin) == str(error.value)


def test_worker_needs_a_process_group(tiny_dataset, tmp_path):
    with pytest.raises(RuntimeError, match="initialised torch.distributed process group"):
        train_worker(_config(tiny_dataset, tmp_path / "x"))


def _train_each(configs):
    return [train_worker(config) for config in configs]


# Every configured loss, over the candidates where it is meant to work (sampled negatives and/or the whole
# catalog shard), with the scoring variants of the trainer (chunked scores, the history tower).
LEARNING_CASES = {
    "rankmax": {"loss": {"name": "rankmax", "params": {"k": 3}}, "train": {"chunk_size": 16}},
    "softmax": {"loss": {"name": "softmax"}, "model": {"history": True}},
    "sparsemax": {"loss": {"name": "sparsemax", "params": {"support_guess": 4}}, "train": {"chunk_size": 20}},
    "smooth_ap": {"loss": {"name": "smooth_ap", "params": {"temperature": 0.1}}},
    "smooth_ap_sampled": {
        "loss": {"name": "smooth_ap", "params": {"temperature": 0.1}, "candidates": "sampled", "num_negatives": 40}
    },
    "recall_at_quantile": {"loss": {"name": "recall_at_quantile", "params": {"quantile": 0.1, "temperature": 0.3}}},
    "pauc_at_budget": {"loss": {"name": "pauc_at_budget", "params": {"beta": 0.2, "temperature": 0.3}}},
    "softrank_ndcg": {"loss": {"name": "softrank_ndcg", "candidates": "sampled", "num_negatives": 40}},
    "sampled_softmax": {"loss": {"name": "sampled_softmax", "num_negatives": 40}},
}


def test_every_configured_loss_learns(tiny_dataset, tmp_path):
    """2 epochs of each configured loss: the loss falls, training moves both the catalog and the user table,
    and the valid Recall@10 beats a random ranking by a clear factor. One process group for all of them."""
    from bigrank.config import CANDIDATE_LOSSES, FULL_CATALOG_LOSSES

    assert {case["loss"]["name"] for case in LEARNING_CASES.values()} == {*FULL_CATALOG_LOSSES, *CANDIDATE_LOSSES}
    configs = []
    for name, sections in LEARNING_CASES.items():
        sections = {key: dict(value) for key, value in sections.items()}
        train = {"epochs": 2, "batch_size": 128, **sections.pop("train", {})}
        optim = {"user_lr": 0.1, "item_lr": 0.1, **sections.pop("optim", {})}
        evaluation = {"every_epochs": None, "at_end": True, "ks": [10], "splits": ["valid"]}
        configs.append(_config(tiny_dataset, tmp_path / name, train=train, optim=optim, eval=evaluation, **sections))
    per_rank = launch_local(_train_each, 2, (configs,), timeout=600)
    failures = []
    for name, summary, other in zip(LEARNING_CASES, per_rank[0], per_rank[1], strict=True):
        assert other["last_loss"] == summary["last_loss"], name  # the loss is replicated on both ranks
        steps_per_epoch = summary["steps_per_epoch"]
        assert summary["steps"] == 2 * steps_per_epoch, name
        records = _train_records(tmp_path / name)
        assert ("temperature" in records[0]) == (name not in ("rankmax", "softmax", "sparsemax")), name
        first = np.mean([r["loss"] for r in records[:steps_per_epoch]])
        last = np.mean([r["loss"] for r in records[-steps_per_epoch:]])
        # Both tables moved during the second epoch: the gradient reaches the catalog and the user table.
        epoch_one, epoch_two = sorted((tmp_path / name / "checkpoints").iterdir())
        before, after = checkpoint_parameters(epoch_one), checkpoint_parameters(epoch_two)
        items_moved = float(((after[0] - before[0]).abs().amax(dim=1) > 1e-6).float().mean())
        users_moved = float(((after[1] - before[1]).abs().amax(dim=1) > 1e-6).float().mean())
        recall = summary["eval"]["valid"]["recall@10"]
        figures = (
            f"{name}: loss {first:.4f} -> {last:.4f}, rows moved: items {items_moved:.2f} users {users_moved:.2f}, "
            f"recall@10 {recall:.3f}"
        )
        print(figures)
        # A random ranking finds about 10/101 of the held-out items in the top 10 (train items excluded).
        if not (last < first and items_moved > 0.5 and users_moved > 0.5 and recall > 2.5 * 10 / NUM_ITEMS):
            failures.append(figures)
    assert not failures, "\n".join(failures)


def test_two_sampled_softmax_runs_of_one_config_end_with_the_same_bits(tiny_dataset, tmp_path):
    """The same config on the same worker count, twice: the same loss at every step and the same parameters and
    optimizer states to the last bit, as for the full-catalog losses. 1,024 negatives of 64-d rows drawn from 101
    items repeat every row many times, in a gather large enough (65,536 elements) for torch's parallel backward of
    ``rows[index]``, whose atomic adds once summed a repeated row's gradients in a new order every run (issue 49:
    two ML-1M runs parted after their first step); 4 torch threads, so that the adds race even on 2 cores."""
    sections = {
        "workers": 1,
        "model": {"dim": 64},
        "loss": {"name": "sampled_softmax", "num_negatives": 1024},
        "optim": {"item_optimizer": "adagrad"},
        "train": {"batch_size": 512, "max_steps": 5},
    }
    runs = [tmp_path / "first", tmp_path / "second"]
    launch_local(_train_each, 1, ([_config(tiny_dataset, run, **sections) for run in runs],), threads=4, timeout=240)
    first, second = ([r["loss"] for r in _train_records(run)] for run in runs)
    assert len(first) == 5 and first == second
    states = [checkpoint_parameters(run / "checkpoints" / "step-00000005") for run in runs]
    for name, a, b in zip(("catalog", "user table"), states[0][:2], states[1][:2], strict=True):
        assert torch.equal(a, b), name
    for a, b in zip(states[0][2:4], states[1][2:4], strict=True):  # the user and item optimizers' states
        flat_a, flat_b = (dict(pairs) for pairs in (_tensors(a), _tensors(b)))
        assert flat_a.keys() == flat_b.keys() and all(torch.equal(flat_a[k], flat_b[k]) for k in flat_a), flat_a.keys()


def _tensors(tree, prefix=""):
    """``(dotted key, tensor)`` of every tensor in a nest of dicts and lists."""
    items = tree.items() if isinstance(tree, dict) else enumerate(tree)
    for key, value in items:
        if isinstance(value, dict | list):
            yield from _tensors(value, f"{prefix}{key}.")
        elif isinstance(value, torch.Tensor):
            yield f"{prefix}{key}", value


def _first_batch_positives(config):
    """On each rank: the train-item counts the trainer hands the loss for its first global batch, the users of
    that batch's rows (gathered the way the batch is), and the loss of one step on it."""
    import torch.distributed as dist

    from bigrank.distributed.collectives import all_gather_rows_with_ids
    from bigrank.train.trainer import Trainer

    trainer = Trainer(config)
    batch = next(iter(trainer.stream))
    users = batch["user_id"].to(torch.int64)
    positives = trainer.training._gather_positives(users)  # the towers' step (bigrank.train.towers)
    dummy = torch.zeros(users.numel(), 1)
    _, gathered_users = all_gather_rows_with_ids(dummy, users, trainer.training.local_batch, trainer.group)
    loss, _ = trainer.train_step(batch)
    dist.barrier(trainer.group)
    return positives, gathered_users[gathered_users >= 0], loss


def test_a_per_row_k_reads_each_rows_own_users_train_items(tiny_dataset, tmp_path):
    """rankmax with ``k_fraction``: on 2 workers every row of the global batch gets the train-item count of its
    own user (counted here from the Parquet files), in the gathered batch's row order, and a step trains."""
    import pyarrow.parquet as pq

    config = _config(tiny_dataset, tmp_path / "run", loss={"name": "rankmax", "params": {"k_fraction": 0.5}})
    per_rank = launch_local(_first_batch_positives, 2, (config,), timeout=300)
    parts = sorted((tiny_dataset / "train").glob("*.parquet"))
    users = np.concatenate([pq.read_table(path, columns=["user_id"])["user_id"].to_numpy() for path in parts])
    counts = np.bincount(users.astype(np.int64))
    for positives, batch_users, loss in per_rank:
        assert positives.tolist() == counts[batch_users.numpy()].tolist()
        assert len(set(positives.tolist())) > 1  # users of different activity: a mix-up of rows would show
        assert np.isfinite(loss) and loss == per_rank[0][2]


def _manifest_reads(config, export_dir) -> dict[str, int]:
    """In a fresh worker process: how many times each job opens the dataset's manifest.json (every ``open`` of
    the process is seen through Python's audit hook ``open``: ``open``, ``io.open``, ``os.open``, ``Path``)."""
    import os
    import sys
    from pathlib import Path

    from bigrank.data.manifest import DatasetManifest
    from bigrank.train.workers import evaluate_worker, export_worker

    target = (Path(config.data.root) / "manifest.json").resolve()
    opened = []

    def count(event, args):
        if event == "open" and isinstance(args[0], str | bytes | os.PathLike):
            if Path(os.fsdecode(args[0])).resolve() == target:
                opened.append(1)

    sys.addaudithook(count)  # lasts as long as this worker process
    reads = {}
    manifest = DatasetManifest.load(config.data.root)
    reads["load"] = len(opened)
    train_worker(config, manifest)  # as the run layer's local launcher passes the pre-flight's manifest
    reads["train given the manifest"] = len(opened) - reads["load"]
    for job, run in (
        ("train", lambda: train_worker(dataclasses.replace(config, run_dir=config.run_dir + "-again"))),
        ("evaluate", lambda: evaluate_worker(config)),
        ("export", lambda: export_worker(config, export_dir)),
    ):
        before = len(opened)
        run()
        reads[job] = len(opened) - before
    return reads


def test_each_job_reads_the_dataset_manifest_once_per_process(tiny_dataset, tmp_path):
    # Every part that reads the dataset: the stream, the history bags (model.history), each user's train
    # items (a per-row k), evaluation during training and at its end, evaluate and export (the seen items).
    config = _config(
        tiny_dataset,
        tmp_path / "run",
        workers=1,
        model={"dim": 8, "history": True},
        loss={"name": "rankmax", "params": {"k_fraction": 0.1}},
        train={"batch_size": 256, "epochs": 2},
        eval={"every_epochs": 1, "at_end": True, "ks": [10], "splits": ["valid", "test"]},
    )
    reads = launch_local(_manifest_reads, 1, (config, str(tmp_path / "export")), timeout=240)[0]
    assert reads == {"load": 1, "train given the manifest": 0, "train": 1, "evaluate": 1, "export": 1}
