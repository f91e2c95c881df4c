"""Fuzzed config files and ``--set`` overrides (Hypothesis): every input loads into a Config or raises one
ConfigError whose message is one line; a config that loads round-trips through its saved YAML; ``bigrank
train`` answers every bad config with exit status 2 and one line on stderr, never a traceback.

The profile (tests/conftest.py) decides how many examples: a few fixed ones in ``make test``, many random ones
with ``HYPOTHESIS_PROFILE=long``. The plain tests at the end pin each bug the fuzzing found.
"""

from __future__ import annotations

import contextlib
import io

import pytest
import yaml
from fuzz_strategies import KEY_TEXTS, KEYS, NASTY_YAML, VALUE_TEXTS, VALUES, assert_one_line
from hypothesis import given
from hypothesis import strategies as st

from bigrank.cli import main
from bigrank.config import Config, ConfigError, dump_config, load_config, parse_override
from bigrank.losses.registry import LOSSES


def _minimal() -> dict:
    return {"data": {"root": "data/x"}, "run_dir": "runs/x"}


def _set_loosely(raw: dict, key: str, value) -> None:
    """Set ``key`` of ``raw``, replacing whatever lies on its way (a fuzzed dict need not be consistent)."""
    node = raw
    *sections, last = key.split(".")
    for part in sections:
        if not isinstance(node.get(part), dict):
            node[part] = {}
        node = node[part]
    node[last] = value


def _loads_or_names_the_problem(load) -> Config | ConfigError:
    """``load()``'s Config, or its ConfigError after checking that the message is one non-empty line; any
    other exception fails the test (with the input Hypothesis found)."""
    try:
        return load()
    except ConfigError as error:
        assert_one_line(error)
        return error


def _write(directory, text: str | bytes):
    path = directory / "fuzzed.yaml"
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text, encoding="utf-8", errors="surrogatepass")
    return path


@pytest.fixture(scope="module")
def scratch(tmp_path_factory):
    return tmp_path_factory.mktemp("fuzz-config")


@given(
    loss=st.sampled_from(sorted(LOSSES)),
    in_file=st.lists(st.tuples(st.sampled_from(KEYS), VALUES), max_size=4),
    overrides=st.lists(st.tuples(st.sampled_from(KEYS), VALUE_TEXTS), max_size=3),
)
def test_config_files_and_overrides_load_or_name_the_problem(scratch, loss, in_file, overrides):
    """Schema keys set to values of every type (in the file and by --set): a Config or one ConfigError line. A
    config that loads saves and loads again as the same config (what a resumed run reads)."""
    raw = _minimal()
    raw["loss"] = {"name": loss}
    for key, value in in_file:
        _set_loosely(raw, key, value)
    path = _write(scratch, yaml.safe_dump(raw))
    result = _loads_or_names_the_problem(lambda: load_config(path, [f"{k}={v}" for k, v in overrides]))
    if isinstance(result, Config):
        saved = _write(scratch, dump_config(result))
        assert load_config(saved) == result


@given(overrides=st.lists(st.tuples(KEY_TEXTS, VALUE_TEXTS).map("=".join) | st.text(max_size=20), max_size=3))
def test_any_override_text_loads_or_names_the_problem(scratch, overrides):
    path = _write(scratch, yaml.safe_dump(_minimal()))
    _loads_or_names_the_problem(lambda: load_config(path, overrides))


@given(
    text=st.one_of(
        st.text(max_size=60),
        st.sampled_from(NASTY_YAML),
        st.tuples(st.sampled_from(KEYS), st.sampled_from(NASTY_YAML) | st.text(max_size=20)).map(
            lambda kv: (
                "data: {root: x}\nrun_dir: r\n"
                + "".join(f"{p}:\n{'  ' * (i + 1)}" for i, p in enumerate(kv[0].split(".")[:-1]))
                + f"{kv[0].split('.')[-1]}: {kv[1]}"
            )
        ),
        st.binary(max_size=40),
    )
)
def test_any_config_file_loads_or_names_the_problem(scratch, text):
    path = _write(scratch, text)
    _loads_or_names_the_problem(lambda: load_config(path))


# The dataset and run directory stay those of the test: a config that passes every check stops at the pre-flight.
CLI_KEYS = [key for key in KEYS if key not in ("data", "data.root", "run_dir")]


@given(overrides=st.lists(st.tuples(st.sampled_from(CLI_KEYS), VALUE_TEXTS).map("=".join), min_size=1, max_size=3))
def test_train_cli_answers_a_bad_config_with_status_2_and_one_line(scratch, overrides):
    """Through ``bigrank train`` (a dataset that does not exist, so that a config that passes every check still
    stops at the pre-flight, before anything starts): exit status 2, one line on stderr, no traceback."""
    raw = {"data": {"root": str(scratch / "no-dataset")}, "run_dir": str(scratch / "run")}
    path = _write(scratch, yaml.safe_dump(raw))
    stderr, stdout = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(stdout):
        code = main(["train", str(path), *[arg for text in overrides for arg in ("--set", text)]])
    err = stderr.getvalue()
    assert code == 2, (code, err, stdout.getvalue())
    assert err.startswith("bigrank train: error: ") and err.count("\n") == 1 and "Traceback" not in err, err


# ------------------------------------------------------------------------------ the bugs the fuzzing found
@pytest.mark.parametrize(
    "value, message",
    [
        ("!!int x", "cannot parse value '!!int x'"),  # int() raised ValueError from inside PyYAML
        ("!!float x", "cannot parse value '!!float x'"),  # ValueError
        ("!!bool x", "cannot parse value '!!bool x'"),  # KeyError
        ("!!timestamp x", "cannot parse value '!!timestamp x'"),  # AttributeError
        ("!!timestamp 2020-13-45", "cannot parse value '!!timestamp 2020-13-45'"),  # ValueError from datetime
        ("[" * 2000, "cannot parse value '[[["),  # RecursionError in PyYAML's composer
        ("[1, 2", "expected ',' or ']', but got '<stream end>' at line 1, column 6"),  # was 6 lines
    ],
)
def test_an_override_value_yaml_cannot_read_is_one_config_error_line(value, message):
    with pytest.raises(ConfigError) as error:
        parse_override(f"train.epochs={value}")
    assert message in str(error.value) and "\n" not in str(error.value)
    assert str(error.value).startswith("override train.epochs: cannot parse value")


@pytest.mark.parametrize(
    "text, message",
    [
        ("train: !!int x\n", "is not valid YAML"),
        ("train: [1, 2\n", "is not valid YAML: expected ',' or ']', but got '<stream end>' at line 2, column 1"),
        (b"\xff\xff", "is not valid YAML"),  # UnicodeDecodeError before, naming no file
        (b"train: \xc3\x28\n", "is not valid YAML"),
    ],
)
def test_a_config_file_yaml_cannot_read_is_one_config_error_line(tmp_path, text, message):
    path = _write(tmp_path, text)
    with pytest.raises(ConfigError) as error:
        load_config(path)
    assert str(error.value).startswith(str(path)) and message in str(error.value) and "\n" not in str(error.value)


@pytest.mark.parametrize("key", ["data.root", "run_dir", "ray.storage_path"])
def test_a_path_with_a_nul_character_is_a_config_error_naming_the_key(tmp_path, key):
    """A NUL in a path made ``resolve`` raise ValueError('embedded null byte'), naming no key."""
    path = _write(tmp_path, yaml.safe_dump(_minimal()))
    with pytest.raises(ConfigError, match=f"^{key} must not contain a NUL character"):
        load_config(path, [f'{key}="a\\0b"'])


@pytest.mark.parametrize(
    "raw, overrides, message",
    [
        (_minimal(), ["0\n0=1"], "override '0\\n0=1' must look like section.key=value"),  # the key was printed raw
        ({**_minimal(), "loss": {"name": "rankmax", "params": {"a\nb": 1}}}, [], "unknown key 'loss.params.a\\nb'"),
        ({**_minimal(), "model": {"layout": {"a\nb": "sharded"}}}, [], "model.layout['a\\nb'] is not a table"),
    ],
)
def test_a_key_with_a_line_break_is_named_on_one_line(tmp_path, raw, overrides, message):
    with pytest.raises(ConfigError) as error:
        load_config(_write(tmp_path, yaml.safe_dump(raw)), overrides)
    assert message in str(error.value)
    assert_one_line(error.value)
