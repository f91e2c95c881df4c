"""Fuzzed search-space files of ``bigrank tune`` (Hypothesis): every file loads into a SearchSpace of the declared
types or raises one SpaceError line; a loaded space checked against a config passes or raises one ConfigError
line (all before Ray starts, which these tests never do); ``bigrank tune`` answers a bad space file with exit
status 2 and one line on stderr. The plain tests at the end pin each bug the fuzzing found."""

from __future__ import annotations

import contextlib
import io
import math

import pytest
import yaml
from fuzz_strategies import KEYS, NASTY_YAML, VALUES, assert_one_line
from hypothesis import given
from hypothesis import strategies as st

from bigrank.cli import main
from bigrank.config import ConfigError, config_from_dict
from bigrank.tune.space import DOMAINS, SearchSpace, SpaceError, load_space, search_base, validate_space

NUMBERS = st.one_of(
    st.integers(min_value=-2, max_value=20),
    st.floats(min_value=-1, max_value=2),
    st.floats(allow_nan=True, allow_infinity=True),
    st.booleans(),
)
DOMAIN_SPECS = st.one_of(
    st.sampled_from([0.1, 8, "rankmax", True, None]),  # a fixed value
    st.builds(lambda kind, values: {kind: values}, st.sampled_from(DOMAINS), st.lists(NUMBERS, min_size=2, max_size=2)),
    VALUES,
    st.builds(lambda kind, values: {kind: values}, st.sampled_from(DOMAINS), st.lists(NUMBERS, max_size=3)),
    st.builds(lambda kind, values: {kind: values}, st.sampled_from(DOMAINS) | st.text(max_size=6), VALUES),
    st.dictionaries(st.sampled_from(DOMAINS), st.lists(NUMBERS, min_size=2, max_size=2), min_size=2, max_size=3),
)
SPACE_KEYS = st.one_of(
    st.sampled_from(KEYS),
    st.sampled_from(["run_dir", "eval.splits", "eval.at_end", "train.progress", "", ".", "a..b"]),
    st.text(max_size=10),
    st.integers(),
)
VALID_SPACES = st.fixed_dictionaries(
    {"space": st.dictionaries(st.sampled_from(KEYS), DOMAIN_SPECS, min_size=1, max_size=3)},
    optional={
        "metric": st.sampled_from(["ap@10", "recall@100", "accuracy", "ap@7"]),
        "trials": st.integers(min_value=1, max_value=5),
        "scheduler": st.fixed_dictionaries(
            {}, optional={"grace_period": st.integers(1, 3), "reduction_factor": st.floats(1.5, 4)}
        ),
        "max_concurrent": st.none() | st.integers(min_value=1, max_value=4),
    },
)
# A space file that is valid but for one or two parts: it gets past the first checks and reaches the others.
PARTS = ["space", "metric", "trials", "scheduler", "max_concurrent", "extra"]
PARTS += ["scheduler.grace_period", "scheduler.reduction_factor", "scheduler.x", "space.optim.user_lr"]
MUTATION = st.tuples(st.sampled_from(PARTS) | SPACE_KEYS.map(lambda key: f"space.{key}"), NUMBERS | VALUES)


def _mutated(raw: dict, mutations: list) -> dict:
    for part, value in mutations:
        section, _, key = part.partition(".")
        if key and isinstance(raw.get(section), dict):
            raw[section][key] = value
        else:
            raw[section] = value
    return raw


SPACES = st.builds(_mutated, VALID_SPACES, st.lists(MUTATION, max_size=2))


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_loaded(space: SearchSpace) -> None:
    """What the search reads of a loaded space has the declared type (a bool is no count, NaN no bound)."""
    assert _is_int(space.trials) and space.trials >= 1, space.trials
    assert space.max_concurrent is None or (_is_int(space.max_concurrent) and space.max_concurrent >= 1)
    assert space.grace_period is None or (_is_int(space.grace_period) and space.grace_period >= 1)
    assert isinstance(space.reduction_factor, float) and math.isfinite(space.reduction_factor)
    assert isinstance(space.metric, str) and space.params
    for key, domain in space.params.items():
        assert isinstance(key, str) and key
        if domain.kind in ("uniform", "loguniform", "randint"):
            low, high = domain.values
            assert math.isfinite(low) and math.isfinite(high) and low < high, (key, domain)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """The raw config every trial starts from (``search_base`` of a small valid config)."""
    root = tmp_path_factory.mktemp("fuzz-space")
    config = config_from_dict({"data": {"root": str(root / "data")}, "run_dir": str(root / "run"), "workers": 1})
    return root, search_base(config)


def _load(path) -> SearchSpace | None:
    try:
        space = load_space(path)
    except SpaceError as error:
        assert_one_line(error)
        return None
    _check_loaded(space)
    return space


@given(raw=SPACES)
def test_space_files_load_or_name_the_problem_and_check_against_a_config(base, raw):
    root, base_raw = base
    path = root / "space.yaml"
    path.write_text(yaml.safe_dump(raw))
    space = _load(path)
    if space is not None:
        try:
            validate_space(space, base_raw, where=str(path))
        except ConfigError as error:  # SpaceError is one
            assert_one_line(error)


@given(
    text=st.text(max_size=60)
    | st.sampled_from(NASTY_YAML).map(lambda v: f"space: {{optim.user_lr: {v}}}")
    | st.binary(max_size=30)
)
def test_any_space_file_loads_or_names_the_problem(base, text):
    path = base[0] / "space.yaml"
    path.write_bytes(text if isinstance(text, bytes) else text.encode("utf-8", "surrogatepass"))
    _load(path)


@given(raw=SPACES)
def test_tune_cli_answers_a_bad_space_with_status_2_and_one_line(base, raw):
    """Through ``bigrank tune`` with a dataset that does not exist: a good space stops there, before Ray."""
    root, _ = base
    config, space = root / "base.yaml", root / "cli-space.yaml"
    config.write_text(yaml.safe_dump({"data": {"root": str(root / "no-dataset")}, "run_dir": str(root / "run")}))
    space.write_text(yaml.safe_dump(raw))
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(io.StringIO()):
        code = main(["tune", str(config), "--space", str(space)])
    err = stderr.getvalue()
    assert code == 2 and err.startswith("bigrank tune: error: ") and err.count("\n") == 1, (code, err)


# ------------------------------------------------------------------------------ the bugs the fuzzing found
@pytest.mark.parametrize(
    "text, message",
    [
        ("space: {optim.user_lr: 0.1}\nmax_concurrent: true\n", "max_concurrent must be an integer >= 1 or null"),
        ('space: {"\\r": 0.1}\n', "space key '\\r' must be a dotted config key"),  # a line break in messages
        ('space: {optim.user_lr: 0.1}\nscheduler: {"a\\nb": 1}\n', "unknown key 'scheduler.a\\nb'"),
        ("space: {optim.user_lr: !!float x}\n", "is not valid YAML: a tagged value cannot be converted"),
        ("space: {optim.user_lr: [0.1\n", "is not valid YAML: expected ',' or ']', but got '<stream end>'"),
    ],
)
def test_a_bad_space_file_is_one_space_error_line(tmp_path, text, message):
    path = tmp_path / "space.yaml"
    path.write_text(text)
    with pytest.raises(SpaceError) as error:
        load_space(path)
    assert message in str(error.value)
    assert_one_line(error.value)
