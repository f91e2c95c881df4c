"""The shipped search spaces (configs/tune/*.space.yaml): each one is accepted by `bigrank tune` against its base
config (every key and candidate value checked by the config schema, as `bigrank tune` does before Ray starts),
and each shipped config holds values inside its own space, so `bigrank tune` runs it as its first trial (the
search starts from the shipped settings and can only confirm or beat them on the validation metric)."""

from __future__ import annotations

from pathlib import Path

import pytest

from bigrank.config import load_config
from bigrank.tune import Domain, SearchSpace, base_point, get_key, load_space, search_base, validate_space

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
SHIPPED = sorted(path.name.removesuffix(".space.yaml") for path in (CONFIGS / "tune").glob("*.space.yaml"))


def _space_and_base(name: str):
    space = load_space(CONFIGS / "tune" / f"{name}.space.yaml")
    base = search_base(load_config(CONFIGS / f"{name}.yaml"))
    return space, base


def test_every_dataset_ships_a_space_per_loss():
    assert {"ml-latest-small-rankmax", "ml-1m-rankmax", "ml-1m-softmax", "ml-1m-sampled_softmax"} <= set(SHIPPED)


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_space_validates_against_its_config(name):
    space, base = _space_and_base(name)
    validate_space(space, base, where=f"{name} space")
    assert space.metric == "ap@10"


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_config_lies_inside_its_space_and_is_the_first_trial(name):
    space, base = _space_and_base(name)
    outside = {
        key: (get_key(base, key), domain.values)
        for key, domain in space.params.items()
        if not domain.contains(get_key(base, key))
    }
    assert not outside, f"configs/{name}.yaml holds values outside its space: {outside}"
    start = base_point(space, base)
    sampled = [key for key, domain in space.params.items() if domain.kind not in ("fixed", "grid")]
    assert sampled and {key: get_key(start, key) for key in sampled} == {key: get_key(base, key) for key in sampled}


def test_base_point_is_none_when_a_base_value_lies_outside_the_space():
    space = SearchSpace(
        params={
            "optim.user_lr": Domain("loguniform", [0.01, 0.1]),
            "loss.params.k": Domain("choice", [1, 5]),
            "model.dim": Domain("grid", [32, 64]),
        }
    )
    base = {"optim": {"user_lr": 0.05}, "loss": {"params": {"k": 5}}, "model": {"dim": 48}}
    assert base_point(space, base) == {"optim": {"user_lr": 0.05}, "loss": {"params": {"k": 5}}}  # grid left out
    assert base_point(space, {**base, "optim": {"user_lr": 0.5}}) is None
    assert base_point(space, {**base, "loss": {"params": {"k": 10}}}) is None
    assert base_point(SearchSpace(params={"model.dim": Domain("grid", [32, 64])}), base) is None
