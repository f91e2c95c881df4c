"""The run layer: one pre-flight for every entry point, before any process or Ray runtime starts."""

from __future__ import annotations

import pytest

from bigrank import run
from bigrank.config import config_from_dict
from bigrank.errors import CommandError, ConfigError


def _config(tmp_path, root, **loss):
    raw = {"data": {"root": str(root)}, "run_dir": str(tmp_path / "run"), "loss": loss or {"name": "softmax"}}
    return config_from_dict(raw)


def test_prepare_run_reads_the_manifest_and_names_a_missing_dataset(tmp_path, tiny_dataset):
    manifest = run.prepare_run(_config(tmp_path, tiny_dataset))
    assert manifest.num_items == 101
    with pytest.raises(FileNotFoundError, match="dataset directory does not exist"):
        run.prepare_run(_config(tmp_path, tmp_path / "missing"))


def test_prepare_run_builds_the_loss_first(tmp_path, tiny_dataset):
    # A bad warm-up schedule passes the per-field checks of the config; building the loss catches it.
    config = _config(
        tmp_path, tiny_dataset, name="smooth_ap", warmup={"loss": "sampled_softmax", "temp_decay_steps": 5}
    )
    config.loss.warmup.temp_start = -1.0
    with pytest.raises(ConfigError, match="loss.warmup: "):
        run.prepare_run(config)


def test_train_checks_the_launcher_before_starting_anything(tmp_path, tiny_dataset):
    config = _config(tmp_path, tiny_dataset)
    with pytest.raises(CommandError, match="--address needs the Ray launcher"):
        run.train(config, launcher="local", address="127.0.0.1:6379")
    with pytest.raises(CommandError, match="unknown launcher 'slurm'"):
        run.train(config, launcher="slurm")
    assert not (tmp_path / "run").exists()  # nothing was started or written


def test_the_jobs_entrypoint_without_a_config_exits_2(monkeypatch, capsys):
    monkeypatch.delenv("BIGRANK_JOB_CONFIG", raising=False)
    assert run.main() == 2
    assert "BIGRANK_JOB_CONFIG is not set" in capsys.readouterr().err
