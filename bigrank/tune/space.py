"""The search space of ``bigrank tune``: the file's format, its domains, and the checks of every key and value
against the config schema (a value the key refuses, two values that cannot go together) before Ray starts."""

from __future__ import annotations

import copy
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from bigrank.config import (
    Config,
    ConfigError,
    config_from_dict,
    parse_yaml,
    set_key,
)

DOMAINS = ("grid", "choice", "uniform", "loguniform", "randint")
_SPACE_KEYS = ("space", "metric", "trials", "scheduler", "max_concurrent")
_SCHEDULER_KEYS = ("grace_period", "reduction_factor")
# Keys the search itself sets for every trial.
_RESERVED_KEYS = ("run_dir", "eval.splits", "eval.at_end", "train.progress")
_CONTEXT = "_tune"  # param_space key of what every trial needs besides its config
_POLL_SECONDS = 1.0
_METRIC_NAME = re.compile(r"accuracy|recall@\d+|ndcg@\d+|ap@\d+")


class SpaceError(ConfigError):
    """A problem in a search-space file; the message names the file and the key."""


# --------------------------------------------------------------------------------------------- the space
@dataclass
class Domain:
    """One tuned key: ``kind`` (a DOMAINS entry, or "fixed") and its ``values`` (the list, or [low, high])."""

    kind: str
    values: list

    def candidates(self) -> list:
        """Values that stand for the domain when checking it against the config schema."""
        return list(self.values)

    def contains(self, value) -> bool:
        """Whether ``value`` is one this domain can produce (a listed value, or inside ``[low, high]``)."""
        if self.kind in ("fixed", "grid", "choice"):
            return value in self.values
        if not _number(value):
            return False
        low, high = self.values
        return low <= value <= high

    def to_tune(self):
        from ray import tune

        if self.kind == "fixed":
            return self.values[0]
        if self.kind == "grid":
            return tune.grid_search(list(self.values))
        if self.kind == "choice":
            return tune.choice(list(self.values))
        low, high = self.values
        if self.kind == "uniform":
            return tune.uniform(low, high)
        if self.kind == "loguniform":
            return tune.loguniform(low, high)
        return tune.randint(low, high + 1)  # Tune's upper bound is exclusive


@dataclass
class SearchSpace:
    """A parsed space file (see the module docstring)."""

    params: dict[str, Domain]
    metric: str = "ap@10"
    trials: int = 1
    grace_period: int | None = None
    reduction_factor: float = 3.0
    max_concurrent: int | None = None
    raw: dict = field(default_factory=dict)


def _number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _parse_domain(key: str, spec, where: str) -> Domain:
    if not isinstance(spec, dict):
        return Domain("fixed", [spec])
    if len(spec) != 1 or next(iter(spec)) not in DOMAINS:
        raise SpaceError(f"{where}: space key {key!r} must be a plain value or one of {{{', '.join(DOMAINS)}: ...}}")
    kind, values = next(iter(spec.items()))
    if kind in ("grid", "choice"):
        if not isinstance(values, list) or not values:
            raise SpaceError(f"{where}: space key {key!r}: {kind} needs a non-empty list of values")
        return Domain(kind, list(values))
    if not isinstance(values, list) or len(values) != 2 or not all(_number(v) for v in values):
        raise SpaceError(f"{where}: space key {key!r}: {kind} needs [low, high] numbers, got {values!r}")
    low, high = values
    if not low < high:
        raise SpaceError(f"{where}: space key {key!r}: {kind} needs low < high, got {values!r}")
    if kind == "loguniform" and low <= 0:
        raise SpaceError(f"{where}: space key {key!r}: loguniform needs low > 0, got {low}")
    if kind == "randint" and not all(isinstance(v, int) for v in values):
        raise SpaceError(f"{where}: space key {key!r}: randint needs integers, got {values!r}")
    if kind != "randint":
        low, high = float(low), float(high)
    return Domain(kind, [low, high])


def load_space(path: str | os.PathLike) -> SearchSpace:
    """Read and parse a space file (the values are checked against a config by :func:`validate_space`)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"space file not found: {path}")
    raw = parse_yaml(path.read_bytes(), f"{path} is not valid YAML", SpaceError) or {}
    if not isinstance(raw, dict):
        raise SpaceError(f"{path} must hold a mapping with a 'space' section")
    for key in raw:
        if key not in _SPACE_KEYS:
            raise SpaceError(f"{path}: unknown key {key!r}; a space file accepts {', '.join(_SPACE_KEYS)}")
    params_raw = raw.get("space")
    if not isinstance(params_raw, dict) or not params_raw:
        raise SpaceError(f"{path}: 'space' must map config keys (e.g. optim.user_lr) to values or domains")
    params = {}
    for key, spec in params_raw.items():
        if not isinstance(key, str) or not key.isprintable() or any(not part for part in key.split(".")):
            raise SpaceError(f"{path}: space key {key!r} must be a dotted config key such as optim.user_lr")
        if key in _RESERVED_KEYS:
            raise SpaceError(f"{path}: space key {key!r} is set by the search itself and cannot be tuned")
        params[key] = _parse_domain(key, spec, str(path))
    space = SearchSpace(params=params, raw=raw)
    metric = raw.get("metric", space.metric)
    if not isinstance(metric, str):
        raise SpaceError(f"{path}: metric must be a metric name such as ap@10, got {metric!r}")
    space.metric = metric
    trials = raw.get("trials", 1)
    if isinstance(trials, bool) or not isinstance(trials, int) or trials < 1:
        raise SpaceError(f"{path}: trials must be an integer >= 1, got {trials!r}")
    space.trials = trials
    scheduler = raw.get("scheduler") or {}
    if not isinstance(scheduler, dict):
        raise SpaceError(f"{path}: scheduler must be a mapping ({', '.join(_SCHEDULER_KEYS)})")
    for key, value in scheduler.items():
        if key not in _SCHEDULER_KEYS:
            raise SpaceError(
                f"{path}: unknown key {f'scheduler.{key}'!r}; scheduler accepts {', '.join(_SCHEDULER_KEYS)}"
            )
        if not _number(value):
            raise SpaceError(f"{path}: scheduler.{key} must be a number, got {value!r}")
    if "grace_period" in scheduler:
        if not isinstance(scheduler["grace_period"], int) or scheduler["grace_period"] < 1:
            raise SpaceError(f"{path}: scheduler.grace_period must be an integer >= 1 (epochs)")
        space.grace_period = scheduler["grace_period"]
    if "reduction_factor" in scheduler:
        if not scheduler["reduction_factor"] > 1:
            raise SpaceError(f"{path}: scheduler.reduction_factor must be > 1")
        space.reduction_factor = float(scheduler["reduction_factor"])
    max_concurrent = raw.get("max_concurrent")
    if max_concurrent is not None and (
        isinstance(max_concurrent, bool) or not isinstance(max_concurrent, int) or max_concurrent < 1
    ):
        raise SpaceError(f"{path}: max_concurrent must be an integer >= 1 or null")
    space.max_concurrent = max_concurrent
    return space


def set_space_key(raw: dict, key: str, value) -> dict:
    """``bigrank.config.set_key``, its error naming the space key (SpaceError)."""
    try:
        return set_key(raw, key, value)
    except ConfigError as error:
        raise SpaceError(f"space key {key!r}: {error}") from None


def _check_trial_config(raw: dict) -> Config:
    """The Config of a trial's raw dict, loss parameters checked too (ConfigError naming the key)."""
    from bigrank.losses.build import check_loss_config

    config = config_from_dict(copy.deepcopy(raw))
    check_loss_config(config.loss)
    return config


def search_base(config: Config) -> dict:
    """The raw config every trial starts from: ``config`` with what the search needs — validation every
    ``eval.every_epochs`` epochs (1 when unset), valid and test evaluated at the end, no progress bar."""
    raw = config.to_dict()
    raw["eval"]["every_epochs"] = raw["eval"]["every_epochs"] or 1
    raw["eval"]["splits"] = ["valid", "test"]
    raw["eval"]["at_end"] = True
    raw["train"]["progress"] = False
    return raw


def validate_space(space: SearchSpace, base: dict, where: str = "space") -> None:
    """Check ``space`` against the config schema, starting from ``base`` with the space's fixed keys (one
    candidate) set: every candidate value of the other keys alone, then every pair of candidate values of two
    keys (the schema's cross-key rules, e.g. ``model.history_dropout`` needs ``model.history: true``, would
    otherwise fail trials half-way through a search), then one trial with the first value of every key. Raises
    SpaceError naming the key or keys."""
    from bigrank.train.metrics import metric_names

    fixed = {key: domain for key, domain in space.params.items() if len(domain.candidates()) == 1}
    start = copy.deepcopy(base)
    for key, domain in fixed.items():
        set_space_key(start, key, domain.candidates()[0])
    try:
        _check_trial_config(start)
    except (ConfigError, ValueError) as error:
        raise SpaceError(f"{where}: the fixed values of {', '.join(fixed)}: {error}") from None
    varied = [key for key in space.params if key not in fixed]
    for key in varied:
        for value in space.params[key].candidates():
            try:
                _check_trial_config(set_space_key(copy.deepcopy(start), key, value))
            except (ConfigError, ValueError) as error:
                raise SpaceError(f"{where}: space key {key!r} = {value!r}: {error}") from None
    for i, first in enumerate(varied):
        for second in varied[i + 1 :]:
            for first_value in space.params[first].candidates():
                with_first = set_space_key(copy.deepcopy(start), first, first_value)
                for second_value in space.params[second].candidates():
                    try:  # each value of `second` overwrites the last in with_first; the check works on a copy
                        _check_trial_config(set_space_key(with_first, second, second_value))
                    except (ConfigError, ValueError) as error:
                        raise SpaceError(
                            f"{where}: space keys {first!r} = {first_value!r} and {second!r} = {second_value!r} "
                            f"cannot go together: {error}"
                        ) from None
    combined = copy.deepcopy(base)
    for key, domain in space.params.items():
        set_space_key(combined, key, domain.candidates()[0])
    try:
        config = _check_trial_config(combined)
    except (ConfigError, ValueError) as error:
        raise SpaceError(f"{where}: the first value of every key together: {error}") from None
    names = metric_names(config.eval.ks)
    if space.metric not in names:
        raise SpaceError(f"{where}: metric {space.metric!r} is not evaluated; with eval.ks {config.eval.ks}: {names}")


def _max_epochs(space: SearchSpace, base: dict) -> int:
    domain = space.params.get("train.epochs")
    if domain is None:
        return int(base["train"]["epochs"])
    return int(max(domain.candidates()))
