"""`bigrank tune` on a real embedded Ray runtime (one for the module) and the demo data: a 2-trial search writes
the trials table and a best config that `bigrank train` accepts; a bad space key is an error naming it before
Ray starts; a search interrupted (SIGINT, as Ctrl+C) after its first report resumes, and its trials continue
from their run's checkpoints without reporting an epoch twice."""

from __future__ import annotations

import csv
import os
import signal
from pathlib import Path

import pytest
import yaml
from ray.tune import Callback

from bigrank.config import ConfigError, load_config

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def ray_runtime():
    """One embedded Ray runtime for the module (run_search uses it instead of starting its own)."""
    import ray

    ray.init(
        address="local",
        num_cpus=2,
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
        runtime_env={"env_vars": {"GLOO_SOCKET_IFNAME": "lo"}},
        logging_config=ray.LoggingConfig(log_level="ERROR"),
    )
    try:
        yield ray
    finally:
        ray.shutdown()


def _base_config(tmp_path, demo_data):
    """configs/demo.yaml made cheap: one worker per trial (2 trials at once on 2 CPUs), ~27 steps an epoch."""
    path = tmp_path / "base.yaml"
    raw = yaml.safe_load((Path(__file__).parents[1] / "configs" / "demo.yaml").read_text())
    raw["data"]["root"] = str(demo_data)
    raw["run_dir"] = str(tmp_path / "runs" / "demo")
    raw["workers"] = 1
    raw["train"].update(batch_size=4096, epochs=1, log_every=5, keep_checkpoints=1)
    raw["eval"].update(ks=[10, 100])
    path.write_text(yaml.safe_dump(raw))
    return path


def _space(tmp_path, text: str) -> Path:
    path = tmp_path / "space.yaml"
    path.write_text(text)
    return path


def test_a_bad_space_key_is_an_error_naming_it(tmp_path, demo_data, capsys):
    from bigrank.cli import main
    from bigrank.tune import SpaceError, load_space, search_base, validate_space

    base = search_base(load_config(_base_config(tmp_path, demo_data)))
    cases = {
        "optim.usr_lr: {loguniform: [0.01, 0.1]}": "optim.usr_lr",  # no such key
        "loss.params.kk: {grid: [1, 5]}": "loss.params.kk",  # not a parameter of rankmax
        "model.dim: {choice: [32, 30]}": "model.dim",  # a value the key refuses (not a multiple of 4)
        "train.epochs: {uniform: [1, 3]}": "train.epochs",  # floats for an integer key
    }
    for line, key in cases.items():
        space = load_space(_space(tmp_path, f"space:\n  {line}\n"))
        with pytest.raises(SpaceError, match=key.replace(".", r"\.")):
            validate_space(space, base)
    with pytest.raises(SpaceError, match="run_dir"):
        load_space(_space(tmp_path, "space:\n  run_dir: /elsewhere\n"))
    with pytest.raises(SpaceError, match="sampler"):
        load_space(_space(tmp_path, "sampler: random\nspace:\n  model.dim: 32\n"))
    with pytest.raises(SpaceError, match="ap@5"):
        validate_space(load_space(_space(tmp_path, "metric: ap@5\nspace:\n  model.dim: 32\n")), base)
    # Two values each valid alone (the base has the history tower) but not together: named before any trial runs.
    with_history = dict(base, model=dict(base["model"], history=True))
    crossed = "space:\n  model.history: {choice: [true, false]}\n  model.history_dropout: {choice: [0.0, 0.5]}\n"
    with pytest.raises(SpaceError, match=r"'model\.history' = False and 'model\.history_dropout' = 0\.5"):
        validate_space(load_space(_space(tmp_path, crossed)), with_history)
    # The space's own fixed values count: history fixed on makes the dropout valid on a base without it.
    assert base["model"]["history"] is False
    fixed_on = "space:\n  model.history: true\n  model.history_dropout: {choice: [0.0, 0.5]}\n"
    validate_space(load_space(_space(tmp_path, fixed_on)), base)
    # The command reports it plainly (exit status 2) before any Ray runtime or trial starts.
    bad = _space(tmp_path, "space:\n  optim.usr_lr: {loguniform: [0.01, 0.1]}\n")
    code = main(["tune", str(_base_config(tmp_path, demo_data)), "--space", str(bad), "--out", str(tmp_path / "x")])
    assert code == 2
    assert "optim.usr_lr" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_a_tiny_search_writes_the_trials_table_and_a_best_config_that_train_accepts(
    ray_runtime, tmp_path, demo_data, capsys
):
    from bigrank.cli import main
    from bigrank.tune import load_space, run_search

    # item_lr is sampled, but the first (here: only) sample is the base config's own value; Tune runs it with
    # every grid value of user_lr.
    text = (
        "space:\n  optim.user_lr: {grid: [0.05, 0.2]}\n  optim.item_lr: {loguniform: [0.001, 1.0]}\n  train.epochs: 1\n"
    )
    space = load_space(_space(tmp_path, text))
    config = load_config(_base_config(tmp_path, demo_data))
    result = run_search(config, space, tmp_path / "search")

    with open(tmp_path / "search" / "trials.csv") as handle:
        rows = list(csv.DictReader(handle))
    assert len(rows) == 2 and {row["status"] for row in rows} == {"finished"}
    assert sorted(float(row["optim.user_lr"]) for row in rows) == [0.05, 0.2]
    for row in rows:
        assert float(row["optim.item_lr"]) == pytest.approx(config.optim.item_lr)
        assert float(row["epochs"]) == 1.0 and 0 < float(row["valid ap@10"]) < 1 and 0 < float(row["test ap@10"]) < 1
    best = max(rows, key=lambda row: float(row["valid ap@10"]))
    assert (tmp_path / "search" / "trials.txt").read_text().startswith("trial")
    assert result.best_config == tmp_path / "search" / "best.yaml"

    # best.yaml is the best trial's resolved config, back on the base run_dir, and `bigrank train` runs it.
    best_config = load_config(result.best_config)
    assert best_config.optim.user_lr == pytest.approx(float(best["optim.user_lr"]))
    assert best_config.run_dir == config.run_dir and best_config.workers == 1
    run_dir = tmp_path / "retrain"
    code = main(
        ["train", str(result.best_config), "--launcher", "local", "--set", f"run_dir={run_dir}",
         "--set", "train.max_steps=2", "--set", "eval.at_end=false", "--set", "train.progress=false"]
    )  # fmt: skip
    assert code == 0
    assert (run_dir / "checkpoints" / "step-00000002").is_dir()


class InterruptOnce(Callback):
    """A Tune callback that sends this process SIGINT (as Ctrl+C would) once the first reported result's
    checkpoint is registered (`on_trial_save` comes after the trial records it; `on_checkpoint` before), once
    per marker file (the restored search unpickles it again and must not interrupt itself)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def on_trial_save(self, iteration, trials, trial, **info):
        if not self.marker.exists():
            self.marker.write_text("interrupted\n")
            os.kill(os.getpid(), signal.SIGINT)


def test_an_interrupted_search_resumes_where_it_stopped(ray_runtime, tmp_path, demo_data):
    from bigrank.tune import load_space, run_search

    # grace_period = epochs: ASHA stops no trial here (it would stop the worse of the two after epoch 1).
    text = "scheduler: {grace_period: 2}\nspace:\n  optim.user_lr: {grid: [0.05, 0.2]}\n  train.epochs: 2\n"
    space = load_space(_space(tmp_path, text))
    config = load_config(_base_config(tmp_path, demo_data))
    out = tmp_path / "search"
    marker = tmp_path / "interrupted"
    first = run_search(config, space, out, callbacks=[InterruptOnce(marker)])
    assert marker.exists()
    assert [row["status"] for row in first.rows].count("finished") < 2  # stopped before the end

    second = run_search(config, space, out)
    assert [row["status"] for row in second.rows] == ["finished", "finished"]
    assert second.best_config is not None
    for row in second.rows:
        assert float(row["epochs"]) == 2.0
    # Every evaluated epoch reached Tune, in order, and some trial's run continued from its checkpoint. Tune
    # delivers at least once: a result it logged but whose checkpoint it had not yet registered when the
    # search stopped (the other trial's, racing the interrupt) is sent again by the restored trial.
    progress = [p for p in out.glob("bigrank_trial_*/progress.csv")]
    assert len(progress) == 2
    for path in progress:
        with open(path) as handle:
            epochs = [float(r["epoch"]) for r in csv.DictReader(handle)]
        assert sorted(set(epochs)) == [1.0, 2.0] and epochs == sorted(epochs), (path, epochs)
    logs = [p.read_text() for p in (out / "runs").glob("*/train.log")]
    assert any("resuming from" in log for log in logs)
    # A changed space cannot resume this search.
    other = load_space(_space(tmp_path, "space:\n  optim.user_lr: {grid: [0.1]}\n  train.epochs: 2\n"))
    with pytest.raises(ConfigError, match="another space"):
        run_search(config, other, out)


def test_a_search_whose_every_trial_fails_exits_non_zero_naming_the_error(ray_runtime, tmp_path, demo_data, capsys):
    import json
    import shutil

    from bigrank.cli import main

    # The manifest is intact (the command's own checks pass), a train file is garbage: every trial fails.
    data = tmp_path / "data"
    shutil.copytree(demo_data, data)
    victim = data / json.loads((data / "manifest.json").read_text())["splits"]["train"]["files"][0]
    victim.write_bytes(b"\0" * victim.stat().st_size)
    config = _base_config(tmp_path, data)
    space = _space(tmp_path, "space:\n  train.epochs: 1\n")
    code = main(["tune", str(config), "--space", str(space), "--out", str(tmp_path / "search")])
    err = capsys.readouterr().err
    assert code == 1
    assert "no trial finished (1 error)" in err
    failed = next(line for line in err.splitlines() if line.startswith("every trial failed; trial "))
    assert victim.name in failed and "WorkerError: rank 0 failed" in failed
    assert not (tmp_path / "search" / "best.yaml").exists()


def test_a_trials_error_is_summarised_by_its_cause():
    from ray.exceptions import RayTaskError

    from bigrank.train.launcher import WorkerError
    from bigrank.tune.results import _error_summary

    worker = WorkerError(0, "RuntimeError", "CUDA error: oops\nCompile with TORCH_USE_CUDA_DSA", "Traceback ...")
    wrapped = RayTaskError("train", "Traceback (most recent call last):\n  ...", worker).as_instanceof_cause()
    expected = "WorkerError: rank 0 failed: RuntimeError: CUDA error: oops"
    assert _error_summary(wrapped) == expected  # Ray's wrapper, unwrapped to the trial's exception
    assert _error_summary(worker) == expected  # a multi-line message keeps its first line
    chained = ValueError("the trial's run failed")
    chained.__cause__ = worker
    assert _error_summary(chained) == expected
    bare = RayTaskError("train", "header (pid=1)\n  File ...\nKeyError: 'x'", None)
    assert _error_summary(bare).endswith("KeyError: 'x'")  # no cause kept: the wrapper's last line
    assert len(_error_summary(WorkerError(0, "E", "x" * 1000, ""))) == 300
