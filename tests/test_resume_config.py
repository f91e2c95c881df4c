"""Resuming with another config: a key that alters the run's trajectory is an error listing every changed key
with its old and new value (unless ``--set train.resume=force``); harmless keys are listed on one line."""

from __future__ import annotations

import json

import pytest

from bigrank import run
from bigrank.config import config_from_dict, load_config, resume_changes
from bigrank.errors import ConfigError
from tests.conftest import bigrank, tiny_run_yaml

TRAIN = "{batch_size: 64, epochs: 3, max_steps: 4, log_every: 1, progress: false}"
EVAL = "{every_epochs: null, at_end: false, ks: [10]}"


def _raw(**sections) -> dict:
    """A resolved config as ``config.yaml`` holds it, with ``sections`` set over a small base."""
    raw = {"data": {"root": "/data"}, "run_dir": "/run", "loss": {"name": "rankmax"}}
    for section, values in sections.items():
        if isinstance(values, dict):
            raw.setdefault(section, {}).update(values)
        else:
            raw[section] = values
    return config_from_dict(raw).to_dict()


def test_resume_changes_split_trajectory_keys_from_harmless_ones():
    old = _raw(train={"epochs": 3, "log_every": 10})
    new = _raw(
        train={"epochs": 4, "log_every": 5, "resume": "force"},
        optim={"item_lr": 0.2},
        loss={"params": {"margin": 2.0}},
        eval={"ks": [10, 20]},
        workers=4,
        seed=1,
    )
    trajectory, harmless = resume_changes(old, new)
    assert trajectory == {
        "loss.params.margin": (1.0, 2.0),
        "optim.item_lr": (0.05, 0.2),
        "seed": (0, 1),
        "train.epochs": (3, 4),
    }
    assert harmless == {"eval.ks": ([10, 100, 1000], [10, 20]), "train.log_every": (10, 5), "workers": (2, 4)}
    assert resume_changes(old, old) == ({}, {})


@pytest.fixture(scope="module")
def trained_run(tiny_dataset, tmp_path_factory):
    """A finished 4-step run of the tiny data (2 local workers): ``(config file, run dir)``."""
    root = tmp_path_factory.mktemp("resume-config")
    config, run_dir = root / "run.yaml", root / "run"
    config.write_text(tiny_run_yaml(tiny_dataset, run_dir, train=TRAIN, eval=EVAL))
    bigrank("train", config, "--launcher", "local")
    return config, run_dir


def test_a_changed_trajectory_key_is_an_error_listing_every_change(trained_run):
    config, run_dir = trained_run
    metrics = (run_dir / "metrics.jsonl").read_text()
    done = bigrank(
        "train", config, "--launcher", "local", "--set", "train.epochs=4", "--set", "optim.item_lr=0.2",
        "--set", "eval.ks=[5]", check=False, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2, done.stdout + done.stderr
    error = done.stderr
    assert "train.epochs: 3 → 4" in error and "optim.item_lr: 0.1 → 0.2" in error, error
    assert "eval.ks" not in error, error  # a harmless key is no part of the error
    assert "--set train.resume=force" in error, error
    assert "training on" not in done.stdout, done.stdout  # refused before any worker started
    assert (run_dir / "metrics.jsonl").read_text() == metrics
    assert load_config(run_dir / "config.yaml").train.epochs == 3  # the saved config is the run's still


def test_the_same_check_in_the_run_layer_and_nothing_to_check_before_a_checkpoint(trained_run, tmp_path):
    config, run_dir = trained_run
    changed = load_config(config, ["seed=4"])
    with pytest.raises(ConfigError, match=r"seed: 3 → 4"):
        run.check_resume_config(changed)
    # A run directory with a config but no complete checkpoint starts over: any config goes.
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    (fresh / "config.yaml").write_text((run_dir / "config.yaml").read_text())
    run.check_resume_config(load_config(config, ["seed=4", f"run_dir={fresh}"]))


def test_harmless_changes_are_listed_and_force_continues_with_the_new_settings(trained_run):
    config, run_dir = trained_run
    allowed = bigrank(
        "train", config, "--launcher", "local", "--set", "eval.ks=[5]", "--set", "train.log_every=2",
        "--set", "workers=1",
    )  # fmt: skip
    assert "eval.ks: [10] → [5]" in allowed.stdout and "workers: 2 → 1" in allowed.stdout, allowed.stdout
    assert "train.log_every: 1 → 2" in allowed.stdout, allowed.stdout
    assert "resuming from" in allowed.stdout and "steps          4 " in allowed.stdout, allowed.stdout

    forced = bigrank(
        "train", config, "--launcher", "local", "--set", "train.max_steps=6", "--set", "train.resume=force",
    )  # fmt: skip
    assert "train.max_steps: 4 → 6" in forced.stdout, forced.stdout
    assert "resuming from" in forced.stdout and "steps          6 " in forced.stdout, forced.stdout
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 7))
    assert load_config(run_dir / "config.yaml").train.max_steps == 6  # the run's config is the new one now
