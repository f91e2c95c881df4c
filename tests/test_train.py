"""The trainer with real gloo processes, real Parquet data and real checkpoints: two-process training lowers
the loss and ranks far better than random (and 3 workers re-evaluating the checkpoint find the same figures),
a run killed mid-way and restarted ends with exactly the parameters of an uninterrupted run, a NaN loss stops
the run naming the step and the last good checkpoint, a dead worker does not hang the launcher, every
configured loss trains."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from bigrank.config import config_from_dict
from bigrank.train.launcher import WorkerError, launch_local
from bigrank.train.workers import evaluate_worker, train_worker
from tests.conftest import TINY_ITEMS as NUM_ITEMS
from tests.conftest import checkpoint_parameters, read_checkpoint


def _config(root, run_dir, **sections):
    raw = {
        "data": {"root": str(root), "shuffle_buffer": 256},
        "run_dir": str(run_dir),
        "seed": 3,
        "workers": 2,
        "model": {"dim": 8},
        "loss": {"name": "rankmax"},
        "optim": {"user_lr": 0.1, "item_lr": 0.1},
        "train": {"batch_size": 64, "epochs": 3, "log_every": 1, "progress": False},
        "eval": {"every_epochs": None, "at_end": False},
    }
    for section, values in sections.items():
        if isinstance(values, dict):
            raw.setdefault(section, {}).update(values)
        else:
            raw[section] = values
    return config_from_dict(raw)


def _train_records(run_dir):
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [record for record in map(json.loads, lines) if record["type"] == "train"]


def test_two_process_training_lowers_the_loss_and_beats_random(tiny_dataset, tmp_path):
    run_dir = tmp_path / "run"
    config = _config(
        tiny_dataset,
        run_dir,
        train={"epochs": 6},
        eval={"every_epochs": 3, "at_end": True, "ks": [10], "splits": ["valid", "test"]},
    )
    summaries = launch_local(train_worker, 2, (config,), timeout=240)
    summary = summaries[0]
    assert summaries[1]["last_loss"] == summary["last_loss"]  # the loss is replicated
    steps_per_epoch = summary["steps_per_epoch"]
    assert summary["steps"] == 6 * steps_per_epoch and summary["world_size"] == 2
    records = _train_records(run_dir)
    assert [r["step"] for r in records] == list(range(1, summary["steps"] + 1))
    first = np.mean([r["loss"] for r in records[:steps_per_epoch]])
    last = np.mean([r["loss"] for r in records[-steps_per_epoch:]])
    assert last < 0.7 * first, (first, last)
    assert all(r["examples_per_s"] > 0 and r["lr"] == 0.1 for r in records)
    for name in ("config.yaml", "plan.txt", "plan.json"):
        assert (run_dir / name).is_file()
    assert "row_wise" in (run_dir / "plan.txt").read_text()
    assert list((run_dir / "tensorboard").iterdir())
    checkpoints = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert checkpoints == [f"step-{5 * steps_per_epoch:08d}", f"step-{6 * steps_per_epoch:08d}"]  # keep 2
    results = json.loads((run_dir / "eval.json").read_text())
    assert set(results) >= {"valid", "test"}
    # A random ranking finds 10/101 of a user's held-out items in its top 10 (fewer: train items are excluded);
    # the model learned the topics, so it finds most of them.
    for split in ("valid", "test"):
        assert results[split]["recall@10"] > 3 * 10 / NUM_ITEMS, results
    evals = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in evals if r["type"] == "eval" and r["split"] == "valid"][0] == 3 * steps_per_epoch
    # `bigrank evaluate` with another number of workers reshards the checkpoint and finds the same figures.
    again = launch_local(evaluate_worker, 3, (config,), timeout=240)[0]
    for split in ("valid", "test"):
        assert again[split]["recall@10"] == pytest.approx(results[split]["recall@10"], abs=1e-6)
        assert again[split]["ap@10"] == pytest.approx(results[split]["ap@10"], abs=1e-6)
        assert again[split]["users"] == results[split]["users"]


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
    # The fused sampled softmax with sparse row-wise Adagrad updates of the touched item rows.
    "sampled_softmax_rowwise_adagrad": {
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
    torch.testing.assert_close(actual[0], expected[0], rtol=1e-6, atol=1e-7)  # catalog
    torch.testing.assert_close(actual[1], expected[1], rtol=1e-6, atol=1e-7)  # user table
    for got, want in zip(actual[2], expected[2], strict=True):  # user Adagrad accumulators
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    for got, want in zip(actual[3], expected[3], strict=True):  # item optimizer: row-aligned states + step count
        assert set(got) == set(want) and float(got["step"]) == 20
        for key in set(got) - {"step"}:
            torch.testing.assert_close(got[key], want[key], rtol=1e-6, atol=1e-9)
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


def test_worker_needs_a_process_group(tiny_dataset, tmp_path):
    with pytest.raises(RuntimeError, match="initialised torch.distributed process group"):
        train_worker(_config(tiny_dataset, tmp_path / "x"))


def _train_each(configs):
    return [train_worker(config) for config in configs]


def test_every_loss_trains_in_the_loop(tiny_dataset, tmp_path):
    """Each configured loss (full-catalog, candidate losses over the shard or sampled negatives, chunked
    scoring, the history tower) runs 3 steps with finite losses; one process group for all of them."""
    cases = {
        "rankmax": {"loss": {"name": "rankmax", "params": {"k": 3}}, "train": {"chunk_size": 16}},
        "softmax": {"loss": {"name": "softmax"}, "model": {"history": True}},
        "sparsemax": {"loss": {"name": "sparsemax"}, "train": {"chunk_size": 20}},
        "smooth_ap": {"loss": {"name": "smooth_ap", "params": {"temperature": 0.1}}},
        "recall_at_quantile": {"loss": {"name": "recall_at_quantile", "params": {"quantile": 0.05}}},
        "pauc_at_budget": {"loss": {"name": "pauc_at_budget", "params": {"beta": 0.1}}},
        "softrank_ndcg": {"loss": {"name": "softrank_ndcg", "candidates": "sampled", "num_negatives": 20}},
        "sampled_softmax": {
            "loss": {"name": "sampled_softmax", "num_negatives": 30},
            "optim": {"item_optimizer": "sgd"},
        },
    }
    configs = []
    for name, sections in cases.items():
        train = {"max_steps": 3, **sections.pop("train", {})}
        configs.append(_config(tiny_dataset, tmp_path / name, train=train, **sections))
    per_rank = launch_local(_train_each, 2, (configs,), timeout=240)
    for name, summary, other in zip(cases, per_rank[0], per_rank[1], strict=True):
        assert summary["steps"] == 3, name
        assert np.isfinite(summary["first_loss"]) and np.isfinite(summary["last_loss"]), name
        assert other["last_loss"] == summary["last_loss"], name  # replicated on both ranks
        records = _train_records(tmp_path / name)
        assert ("temperature" in records[0]) == (name not in ("rankmax", "softmax", "sparsemax")), name
