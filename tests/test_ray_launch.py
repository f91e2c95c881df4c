"""Ray Train launching with a real embedded Ray runtime on 127.0.0.1: a run whose rank 1 dies mid-epoch is
restarted by Ray Train (FailureConfig(max_failures=1)), resumes from the last checkpoint and ends with exactly
the parameters, losses and metrics of an uninterrupted run; the final checkpoint is reported to Ray Train;
`bigrank train --launcher ray` goes through the same launcher; a worker's error beyond max_failures is surfaced;
an address where nothing listens fails at once naming it. No wall-clock asserts: a loaded machine is slow."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from bigrank import run
from bigrank.cli import main
from bigrank.config import save_config
from bigrank.launch.ray_train import RayConnectionError, RayTrainingError, init_ray
from bigrank.train.launcher import free_port
from tests.conftest import checkpoint_parameters, tiny_config

pytestmark = pytest.mark.slow


RUN = {
    "seed": 5,
    "loss": {"name": "rankmax"},
    "optim": {"item_optimizer": "adam", "item_lr": 0.01, "user_lr": 0.1},
    # 8 steps per epoch (~1,450 train rows / 200 per step, last batch short), checkpoints every 4 steps
    "train": {"batch_size": 200, "epochs": 3, "max_steps": 14, "checkpoint_every": 4},
    "eval": {"every_epochs": 1, "ks": [10, 50], "splits": ["valid", "test"]},
    "ray": {"max_failures": 1},
}


def _config(root, run_dir, **sections):
    return tiny_config(root, run_dir, RUN, **sections)


@pytest.fixture(scope="module")
def ray_runtime(tiny_dataset, tmp_path_factory):
    """One embedded Ray runtime for the module (train_on_ray reuses it instead of starting its own)."""
    import ray

    assert init_ray(_config(tiny_dataset, tmp_path_factory.mktemp("unused")))
    try:
        yield ray
    finally:
        ray.shutdown()


def _records(run_dir, kind):
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["type"] == kind]


def test_a_worker_killed_mid_epoch_is_restarted_and_ends_like_an_uninterrupted_run(
    ray_runtime, tiny_dataset, tmp_path, capsys
):
    straight_dir = tmp_path / "straight"
    straight = run.train(_config(tiny_dataset, straight_dir), launcher="ray")
    assert straight["steps"] == 14 and straight["world_size"] == 2 and straight["resumed_from"] is None
    steps_per_epoch = straight["steps_per_epoch"]
    assert steps_per_epoch == 8  # the failure below (step 11) is mid-epoch, 3 steps after checkpoint 8
    # The final checkpoint was reported to Ray Train, which keeps its own complete copy.
    assert straight["ray_checkpoint"] and (straight_dir / "ray").is_dir()
    ray_copy = checkpoint_parameters(Path(straight["ray_checkpoint"]))
    torch.testing.assert_close(ray_copy[0], checkpoint_parameters(straight_dir / "checkpoints" / "step-00000014")[0])

    # Rank 1 exits (os._exit) when it starts step 11; `bigrank train --launcher ray` with max_failures=1.
    crashed_dir = tmp_path / "crashed"
    config_file = tmp_path / "crashed.yaml"
    save_config(_config(tiny_dataset, crashed_dir, debug={"fail_at_step": 11, "fail_rank": 1}), config_file)
    capsys.readouterr()
    assert main(["train", str(config_file), "--launcher", "ray"]) == 0
    printed = capsys.readouterr().out
    assert "resumed from" in printed and "step-00000008" in printed
    assert (crashed_dir / ".debug-failed-at-11").is_file()  # the failure did happen

    expected = checkpoint_parameters(straight_dir / "checkpoints" / "step-00000014")
    actual = checkpoint_parameters(crashed_dir / "checkpoints" / "step-00000014")
    torch.testing.assert_close(actual[0], expected[0], rtol=1e-6, atol=1e-7)  # catalog
    torch.testing.assert_close(actual[1], expected[1], rtol=1e-6, atol=1e-7)  # user table
    # The whole optimizer states: the user tables' row-wise Adagrad and every rank's Adam (step and moments).
    assert any(key.endswith("momentum1") for key in expected[2]), sorted(expected[2])
    torch.testing.assert_close(actual[2], expected[2], rtol=1e-6, atol=1e-7)
    assert all(set(state) == {"step", "exp_avg", "exp_avg_sq", "row_step"} for state in expected[3]), expected[3]
    torch.testing.assert_close(actual[3], expected[3], rtol=1e-6, atol=1e-9)
    assert actual[4] == expected[4]  # data stream positions
    # No finished step lost, none trained twice: one train record per step, same losses.
    crashed_train = _records(crashed_dir, "train")
    assert [r["step"] for r in crashed_train] == list(range(1, 15))
    assert [r["loss"] for r in crashed_train] == pytest.approx([r["loss"] for r in _records(straight_dir, "train")])
    got = json.loads((crashed_dir / "eval.json").read_text())
    want = json.loads((straight_dir / "eval.json").read_text())
    for split in ("valid", "test"):
        for key in ("recall@10", "recall@50", "ap@10", "accuracy"):
            assert got[split][key] == pytest.approx(want[split][key], rel=1e-6, abs=1e-9), (split, key)


def test_a_failure_beyond_max_failures_fails_the_run_with_the_worker_error(ray_runtime, tiny_dataset, tmp_path):
    config = _config(tiny_dataset, tmp_path / "run", ray={"max_failures": 0}, debug={"nan_at_step": 2})
    with pytest.raises(RayTrainingError) as error:
        run.train(config, launcher="ray")
    # The worker's own error comes through, naming the step and the last good checkpoint (none yet).
    message = str(error.value)
    assert f"Ray training of {tmp_path / 'run'} failed" in message
    assert "FloatingPointError" in message and "loss is nan at step 2" in message, message
    assert "no checkpoint yet" in message, message


def test_an_address_where_nothing_listens_fails_at_once_naming_it(tiny_dataset, tmp_path):
    address = f"127.0.0.1:{free_port()}"
    # "cannot reach" comes from the socket check made before ray.init, not from Ray's minute-long retries.
    with pytest.raises(RayConnectionError, match=f"cannot reach the Ray cluster at {address}"):
        run.train(_config(tiny_dataset, tmp_path / "run"), launcher="ray", address=address)
