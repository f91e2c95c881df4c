"""The shipped search spaces (configs/tune/*.space.yaml): each one is accepted by `bigrank tune` against its base
config (every key and candidate value checked by the config schema, as `bigrank tune` does before Ray starts),
and the Rankmax config — the settings the search found — holds values inside its own space, so a search from the
space can find the shipped settings again (the region that won is searched, not left out)."""

from __future__ import annotations

from pathlib import Path

import pytest

from bigrank.config import load_config
from bigrank.launch.tune import load_space, search_base, validate_space

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
LOSSES = ["rankmax", "softmax", "sparsemax"]


def _space_and_base(loss: str):
    space = load_space(CONFIGS / "tune" / f"ml-latest-small-{loss}.space.yaml")
    base = search_base(load_config(CONFIGS / f"ml-latest-small-{loss}.yaml"))
    return space, base


@pytest.mark.parametrize("loss", LOSSES)
def test_shipped_space_validates_against_its_config(loss):
    space, base = _space_and_base(loss)
    validate_space(space, base, where=f"{loss} space")
    assert space.metric == "ap@10"


def _value_at(raw: dict, key: str):
    node = raw
    for part in key.split("."):
        node = node[part]
    return node


def _inside(domain, value) -> bool:
    if domain.kind in ("fixed", "grid", "choice"):
        return value in domain.values
    low, high = domain.values
    return low <= value <= high


def test_rankmax_config_lies_inside_its_space():
    loss = "rankmax"
    space, base = _space_and_base(loss)
    outside = {
        key: (_value_at(base, key), domain.values)
        for key, domain in space.params.items()
        if not _inside(domain, _value_at(base, key))
    }
    assert not outside, f"configs/ml-latest-small-{loss}.yaml holds values outside its space: {outside}"
