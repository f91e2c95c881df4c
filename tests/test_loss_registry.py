"""The loss registry is the one list of losses: each entry's parameters (its ``*Params`` dataclass) have the
defaults of the loss function and module they build, config validation and the trainer read it, bad
values are errors naming the dotted key, and the docs show its table."""

from __future__ import annotations

import dataclasses
import inspect
from pathlib import Path

import pytest
import torch

from bigrank.config import LossConfig, config_from_dict
from bigrank.errors import ConfigError
from bigrank.losses import registry
from bigrank.losses.build import CandidateLoss, build_loss, check_loss_config
from bigrank.losses.registry import LOSSES, parse_params

REPO = Path(__file__).resolve().parents[1]


def _minimal(**extra) -> dict:
    raw = {"data": {"root": "data/x"}, "run_dir": "runs/x"}
    raw.update(extra)
    return raw


def _defaults(fn) -> dict:
    return {
        name: p.default
        for name, p in inspect.signature(fn).parameters.items()
        if p.default is not inspect.Parameter.empty
    }


@pytest.mark.parametrize("name", list(LOSSES))
def test_params_defaults_are_the_loss_function_and_module_defaults(name):
    spec = LOSSES[name]
    params = {f.name: f.default for f in dataclasses.fields(spec.params)}
    module_defaults = _defaults(spec.module.__init__)
    function_defaults = _defaults(spec.function)
    module_defaults.pop("reduction", None)  # the trainer always averages over the batch (the default "mean")
    assert params == module_defaults, f"{name}: Params vs {spec.module.__name__}.__init__"
    # The function holds more keywords (reduction, group, ...); the module may apply a parameter itself
    # (sampled softmax divides the scores by its temperature before calling the function; rankmax turns
    # k_fraction and each row's positives into the function's per-row k).
    applied_by_module = {"sampled_softmax": {"temperature"}, "rankmax": {"k_fraction"}}.get(name, set())
    for param, default in params.items():
        if param not in applied_by_module:
            assert function_defaults[param] == default, f"{name}.{param}: Params vs {spec.function.__name__}"
    assert all(f.metadata.get("doc") for f in dataclasses.fields(spec.params)), f"{name}: a parameter lacks a doc"
    spec.params().check()  # the defaults are valid
    module = build_loss(LossConfig(name=name, params=parse_params(name, {})))
    assert isinstance(module, spec.module if spec.kind == registry.FULL_CATALOG else CandidateLoss)


def test_pauc_scale_sample_size_default_is_the_loss_functions():
    # It was 8192 in the config and 2048 in the loss; the loss's documented default (an IQR from ~2,000
    # negatives is within a few per cent, and the sort behind the quartiles stays cheap) is the one.
    assert parse_params("pauc_at_budget", {})["scale_sample_size"] == 2048


def test_every_loss_is_a_config_choice_and_kinds_partition_the_names():
    assert set(registry.FULL_CATALOG_LOSSES) | set(registry.CANDIDATE_LOSSES) == set(LOSSES)
    assert not set(registry.FULL_CATALOG_LOSSES) & set(registry.CANDIDATE_LOSSES)
    name_field = {f.name: f for f in dataclasses.fields(LossConfig)}["name"]
    assert tuple(name_field.metadata["choices"]) == tuple(LOSSES)
    for name in LOSSES:
        assert config_from_dict(_minimal(loss={"name": name})).loss.params == dataclasses.asdict(LOSSES[name].params())


@pytest.mark.parametrize(
    "name, params, message",
    [
        ("rankmax", {"k": 0}, r"loss.params \(rankmax\): k must be an integer >= 1"),
        ("rankmax", {"margin": -1.0}, r"loss.params \(rankmax\): margin must be"),
        ("recall_at_quantile", {"quantile": 2.0}, r"loss.params \(recall_at_quantile\): quantile must be in \(0, 1\)"),
        ("pauc_at_budget", {"alpha": 0.5, "beta": 0.1}, r"need 0 <= alpha < beta <= 1"),
        ("pauc_at_budget", {"tau_scale": "mad"}, r"tau_scale must be 'iqr' or 'band'"),
        ("pauc_at_budget", {"n_knots": 1}, r"n_knots must be an integer >= 2"),
        ("pauc_at_budget", {"scale_sample_size": 2}, r"scale_sample_size must be an integer >= 4"),
        ("softrank_ndcg", {"num_candidates": 1}, r"num_candidates must be an integer >= 2"),
        ("softrank_ndcg", {"k": 0}, r"k must be an integer >= 1"),
        ("smooth_ap", {"temperature": 0.0}, r"temperature must be"),
        ("sampled_softmax", {"temperature": -1.0}, r"temperature must be"),
        ("sparsemax", {"support_guess": 0}, r"support_guess must be an integer >= 1"),
        ("rankmax", {"k": 1.5}, r"loss.params.k must be an integer"),
        ("softrank_ndcg", {"sigma": None}, r"loss.params.sigma must not be null"),
        ("smooth_ap", {"temp": 1.0}, r"unknown key 'loss.params.temp': loss 'smooth_ap' accepts temperature"),
    ],
)
def test_bad_parameters_are_errors_naming_the_key_at_load_time(name, params, message):
    with pytest.raises(ConfigError, match=message):
        config_from_dict(_minimal(loss={"name": name, "params": params}))


def test_warmup_parameters_are_checked_under_their_own_key():
    warmup = {"loss": "sampled_softmax", "params": {"temperature": 0.0}}
    with pytest.raises(ConfigError, match=r"loss.warmup.params \(sampled_softmax\): temperature must be"):
        config_from_dict(_minimal(loss={"name": "smooth_ap", "warmup": warmup}))
    warmup = {"loss": "smooth_ap", "params": {"k": 2}}
    with pytest.raises(ConfigError, match="unknown key 'loss.warmup.params.k'"):
        config_from_dict(_minimal(loss={"name": "smooth_ap", "warmup": warmup}))


@pytest.mark.parametrize(
    "name, params",
    [
        ("rankmax", {"k": 0}),
        ("recall_at_quantile", {"quantile": 1.0}),
        ("pauc_at_budget", {"alpha": 0.2, "beta": 0.1}),
        ("pauc_at_budget", {"tau_scale": "mad"}),
        ("softrank_ndcg", {"sigma": 0.0}),
        ("smooth_ap", {"temperature": -0.1}),
        ("sampled_softmax", {"temperature": 0.0}),
    ],
)
def test_the_params_checks_agree_with_the_loss_modules(name, params):
    """What a Params check rejects, the loss module rejects too (the checks are the same rules)."""
    spec = LOSSES[name]
    with pytest.raises(ValueError):
        spec.params(**params).check()
    with pytest.raises(ValueError):
        spec.module(**params)


def test_check_loss_config_builds_the_loss_and_the_warmup_wrapper():
    config = config_from_dict(
        _minimal(loss={"name": "smooth_ap", "warmup": {"loss": "sampled_softmax", "steps": 3, "temp_decay_steps": 5}})
    )
    check_loss_config(config.loss)
    module = build_loss(config.loss)
    assert type(module).__name__ == "LossWarmupWrapper"
    config.loss.warmup.temp_start = -1.0  # a bad schedule surfaces as a ConfigError naming loss.warmup
    with pytest.raises(ConfigError, match="loss.warmup: "):
        check_loss_config(config.loss)


def test_candidate_loss_passes_log_q_to_sampled_softmax_only():
    scores = torch.randn(3, 5)
    labels = torch.zeros(3, 5, dtype=torch.bool)
    labels[:, 0] = True
    log_q = torch.tensor([0.0, -1.0, -2.0, -3.0, -4.0])  # uneven: a constant log_q would cancel
    sampled = CandidateLoss("sampled_softmax", parse_params("sampled_softmax", {}))
    assert not torch.allclose(sampled(scores, labels, log_q=log_q), sampled(scores, labels))
    smooth = CandidateLoss("smooth_ap", parse_params("smooth_ap", {}))
    torch.testing.assert_close(smooth(scores, labels, log_q=log_q), smooth(scores, labels))


def test_the_docs_show_the_registry_table():
    text = (REPO / "docs" / "architecture.md").read_text()
    assert registry.markdown_table() in text, "docs/architecture.md: paste bigrank.losses.registry.markdown_table()"
