"""Typed run config: defaults, --set overrides, errors naming the dotted key, the round trip through config.yaml,
and the shipped configs in configs/ load."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from bigrank.cli import main
from bigrank.config import (
    Config,
    ConfigError,
    apply_overrides,
    config_from_dict,
    dump_config,
    load_config,
    save_config,
)

REPO = Path(__file__).resolve().parents[1]


def _write(tmp_path, raw: dict) -> Path:
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def _minimal(**extra) -> dict:
    raw = {"data": {"root": "data/x"}, "run_dir": "runs/x"}
    raw.update(extra)
    return raw


def test_defaults_overrides_and_absolute_paths(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    config = load_config(
        _write(tmp_path, _minimal(loss={"name": "rankmax", "params": {"k": 3}})),
        ["train.max_steps=50", "eval.ks=[5, 50]", "eval.sample_users=null", "loss.params.margin=0.5", "seed=7"],
    )
    assert isinstance(config, Config)
    assert config.train.max_steps == 50 and config.eval.ks == [5, 50] and config.eval.sample_users is None
    assert config.loss.params == {"k": 3, "margin": 0.5, "k_fraction": 0.0}  # merged over the loss's defaults
    assert config.seed == 7 and config.train.batch_size == 1024 and config.optim.item_optimizer == "adagrad"
    assert config.data.root == str(tmp_path / "data/x") and config.run_dir == str(tmp_path / "runs/x")
    assert config.loss.candidates == "catalog"  # resolved
    assert config.optim.item_lr == 0.05 and isinstance(config.optim.item_lr, float)
    overridden = load_config(_write(tmp_path, _minimal(optim={"user_lr": "2e-2"})), ["optim.item_lr=1"])
    assert overridden.optim.item_lr == 1.0 and isinstance(overridden.optim.item_lr, float)
    assert overridden.optim.user_lr == 0.02  # YAML 1.1 reads 2e-2 as a string: still a number here


def test_resolved_config_round_trips_through_yaml(tmp_path):
    raw = _minimal(
        loss={
            "name": "smooth_ap",
            "candidates": "sampled",
            "sampler": "popularity",
            "warmup": {"loss": "sampled_softmax", "steps": 5, "temp_decay_steps": 10},
        },
        debug={"fail_at_step": 3},
    )
    config = config_from_dict(raw, base_dir=tmp_path)
    save_config(config, tmp_path / "config.yaml")
    again = load_config(tmp_path / "config.yaml")
    assert again == config
    assert again.loss.warmup.steps == 5 and again.loss.params == {"temperature": 0.01}
    assert again.loss.warmup.params == {"temperature": 1.0}
    assert yaml.safe_load(dump_config(config))["debug"]["fail_at_step"] == 3


@pytest.mark.parametrize(
    "raw, overrides, message",
    [
        (_minimal(train={"batchsize": 4}), [], "unknown key 'train.batchsize'"),
        (_minimal(), ["loss.warmup.stepz=3"], "unknown key 'loss.warmup.stepz'"),
        (_minimal(colour="red"), [], "unknown key 'colour'"),
        (_minimal(), ["train.batch_size=abc"], "train.batch_size must be an integer, got 'abc'"),
        (_minimal(), ["train.batch_size=2.5"], "train.batch_size must be an integer"),
        (_minimal(), ["model.history=yes please"], "model.history must be true or false"),
        (_minimal(), ["optim.item_optimizer=lbfgs"], "optim.item_optimizer must be one of sgd, adagrad, adam"),
        (_minimal(), ["loss.name=hinge"], "loss.name must be one of rankmax"),
        (_minimal(), ["loss.name=rankmax", "loss.params.temperature=1"], "unknown key 'loss.params.temperature'"),
        (_minimal(), ["loss.name=softmax", "loss.params.k=2"], "'loss.params.k': loss 'softmax' accepts temperature"),
        (_minimal(), ["loss.name=rankmax", "loss.params.k=1.5"], "loss.params.k must be an integer"),
        (_minimal(), ["model.dim=30"], "model.dim must be a positive multiple of 4"),
        (_minimal(), ["model.history=true", "model.history_dropout=1"], "model.history_dropout must lie in [0, 1)"),
        (_minimal(), ["model.history=true", "model.history_dropout=-0.1"], "model.history_dropout must lie in"),
        (_minimal(), ["model.history=true", "model.history_dropout=.nan"], "model.history_dropout must be a finite"),
        (_minimal(), ["model.history_dropout=0.5"], "model.history_dropout needs model.history: true"),
        (_minimal(), ["model.history=true", "model.history_sample_size=0"], "model.history_sample_size must be >= 1"),
        (_minimal(), ["model.history_sample_size=8"], "model.history_sample_size needs model.history: true"),
        (_minimal(), ["model.history=true", "model.history_sample_size=true"], "model.history_sample_size"),
        (_minimal(), ["model.history=true", "model.history_sample_size=8.5"], "model.history_sample_size"),
        (_minimal(), ["train.batch_size=101"], "train.batch_size (101) is the global batch"),
        (_minimal(), ["eval.ks=[10, 0]"], "eval.ks must be a non-empty list"),
        (_minimal(), ["eval.ks=10"], "eval.ks must be a list"),
        (_minimal(), ["eval.splits=[valid, holdout]"], "eval.splits[1] must be valid or test, got 'holdout'"),
        (_minimal(), ["loss.name=softmax", "loss.candidates=sampled"], "loss.candidates must be catalog"),
        (_minimal(), ["loss.warmup.steps=2"], "loss.warmup is for candidate losses"),
        ({"run_dir": "x"}, [], "data.root must be set"),
        (_minimal(), ["train.max_steps=0"], "train.max_steps must be >= 1 or null"),
        (_minimal(), ["train.resume=always"], "train.resume must be one of auto, force; got 'always'"),
        (_minimal(), ["train.chunk_size=0"], 'train.chunk_size must be >= 1, "auto" or null'),
        (_minimal(), ["train.chunk_size=big"], 'train.chunk_size must be >= 1, "auto" or null'),
        (_minimal(), ["optim.user_lr=-1"], "optim.user_lr must be > 0"),
        (_minimal(), ["train=3"], "train must be a mapping"),
        (_minimal(train={"epochs": 2}), ["train.epochs.x=3"], "train.epochs is not a section"),
        (_minimal(), ["novalue"], "must look like section.key=value"),
        (_minimal(), ["ray.min_workers=3"], "ray.min_workers must be between 1 and workers (2) or null"),
        (_minimal(), ["workers=4", "ray.min_workers=2", "train.batch_size=8"], "allows 3 workers, which do not"),
    ],
)
def test_bad_config_is_an_error_naming_the_key(tmp_path, raw, overrides, message):
    with pytest.raises(ConfigError) as error:
        load_config(_write(tmp_path, raw), overrides)
    assert message in str(error.value)


@pytest.mark.parametrize(
    "override",
    [
        "optim.user_lr=.inf",
        "optim.item_lr=.inf",
        "optim.item_lr=.nan",
        "optim.item_lr=1e999",  # an exponent string: a float overflowing to inf
        "optim.weight_decay=.inf",
        "optim.user_l2=.inf",
        "model.item_init_std=.inf",
        "model.init_std=-.inf",
        "loss.beta=.inf",
        "ray.cpus_per_worker=.inf",
        "loss.params.temperature=.inf",  # softmax's parameter (bigrank.losses.registry)
        "loss.params.margin=.nan",  # rankmax's
    ],
)
def test_an_infinite_or_nan_number_is_an_error_naming_the_key(tmp_path, override):
    key, value = override.split("=")
    name = "rankmax" if key == "loss.params.margin" else "softmax"
    with pytest.raises(ConfigError) as error:
        load_config(_write(tmp_path, _minimal()), [f"loss.name={name}", override])
    assert f"{key} must be a finite number, got" in str(error.value)


def test_apply_overrides_creates_sections_and_parses_yaml_scalars():
    raw = apply_overrides({}, ["a.b.c=1", "a.d=null", "e=[1, 2]", "f=true", "g=1e-3", "h=text"])
    assert raw == {"a": {"b": {"c": 1}, "d": None}, "e": [1, 2], "f": True, "g": 1e-3, "h": "text"}


def test_cli_reports_the_bad_key_and_exits_2(tmp_path, capsys):
    path = _write(tmp_path, _minimal())
    assert main(["train", str(path), "--set", "train.batch_sise=8"]) == 2
    assert "unknown key 'train.batch_sise'" in capsys.readouterr().err
    assert main(["train", str(tmp_path / "missing.yaml")]) == 2
    assert "config file not found" in capsys.readouterr().err
    assert main(["train", str(path)]) == 2  # data.root does not exist
    assert "dataset directory does not exist" in capsys.readouterr().err


@pytest.mark.parametrize("name", sorted(path.stem for path in (REPO / "configs").glob("*.yaml")))
def test_shipped_configs_load(name):
    """Every config in configs/ loads, and its settings pass the pre-flight of its batching."""
    from bigrank.train.user_steps import check_user_batching

    config = load_config(REPO / "configs" / f"{name}.yaml")
    assert config.workers >= 1 and config.train.batch_size % config.workers == 0
    check_user_batching(config)


@pytest.mark.parametrize("value, expected", [("auto", "auto"), ("4096", 4096), ("null", None)])
def test_chunk_size_takes_items_auto_or_null(tmp_path, value, expected):
    assert load_config(_write(tmp_path, _minimal()), [f"train.chunk_size={value}"]).train.chunk_size == expected


def test_check_changes_nothing_and_resolve_fills_a_new_config(tmp_path):
    """The checks of each section only read; ``resolve`` returns the config the code reads (loss parameters
    merged over their defaults, candidates decided, absolute paths) and leaves the user's config as given."""
    from bigrank.config import _build, check, resolve

    raw = {"data": {"root": "data/x"}, "run_dir": "runs/x", "loss": {"name": "rankmax", "params": {"k": 3}}}
    given = _build(Config, raw, "")
    before = given.to_dict()
    assert check(given) is given and given.to_dict() == before
    resolved = resolve(given, tmp_path)
    assert given.to_dict() == before  # untouched: a user's value and a resolved one never mix
    assert resolved.loss.params == {"k": 3, "margin": 1.0, "k_fraction": 0.0}
    assert resolved.loss.candidates == "catalog" and given.loss.candidates is None
    assert resolved.data.root == str(tmp_path / "data" / "x")
    assert resolve(resolved, tmp_path).to_dict() == resolved.to_dict()  # resolving twice changes nothing
