"""Hypothesis strategies shared by the fuzz tests (tests/test_fuzz_*.py): the config schema's dotted keys, values
of every YAML type, and YAML text that trips PyYAML."""

from __future__ import annotations

import dataclasses
import json
import typing

from hypothesis import strategies as st

from bigrank.config import Config
from bigrank.losses.registry import LOSSES
from bigrank.model.registry import MODEL_KINDS


def _schema_keys(cls=Config, prefix: str = "") -> list[str]:
    """Every dotted key of the config schema, sections included (``train``, ``train.epochs``, ...)."""
    keys = []
    hints = typing.get_type_hints(cls)
    for spec in dataclasses.fields(cls):
        key = f"{prefix}{spec.name}"
        keys.append(key)
        sections = [t for t in (hints[spec.name], *typing.get_args(hints[spec.name])) if dataclasses.is_dataclass(t)]
        if sections:
            keys.extend(_schema_keys(sections[0], f"{key}."))
    return keys


LOSS_PARAM_KEYS = sorted(
    {f"{section}.params.{f.name}" for spec in LOSSES.values() for f in dataclasses.fields(spec.params)
     for section in ("loss", "loss.warmup")}
)  # fmt: skip
MODEL_PARAM_KEYS = sorted(
    {f"model.params.{f.name}" for spec in MODEL_KINDS.values() for f in dataclasses.fields(spec.params)}
    | {f"model.{old}" for spec in MODEL_KINDS.values() for old, _ in spec.renamed}  # keys of older configs
)
KEYS = _schema_keys() + LOSS_PARAM_KEYS + MODEL_PARAM_KEYS
CHOICES = sorted(
    set(KEYS)  # keys as values too
    | {"auto", "force", "valid", "test", "catalog", "sampled", "replicated", "sharded", "cpu", "cuda", "bf16"}
    | {"tf32", "fp32", "sgd", "adam", "adagrad", "rowwise_adagrad", "cosine", "linear", "none", "popularity"}
    | set(LOSSES)
    | set(MODEL_KINDS)
)

# YAML that trips PyYAML's scanner, parser, composer or constructors: malformed tagged scalars, unclosed flows,
# aliases (one of them recursive), directives, several documents, complex keys, and YAML 1.1's odd scalars.
NASTY_YAML = [
    "!!int x", "!!float x", "!!bool x", "!!timestamp x", "!!timestamp 2020-13-45", "!!binary x", "!!null x",
    "!!python/object:os.system x", "!!set [1]", "!!omap [1]", "!!pairs x", "!!str [1]", "!!map [1]",
    "[1, 2", "{a: 1", "&a [*a]", "&a {b: *a}", "*a", "'", '"\\q"', "a: b: c", "- a\n b: c", "%YAML 1.1\n---\nx",
    "--- a\n--- b", "\t", "\x00", "@x", "`x", "? [a, b]\n: c", "{[a]: 1}", "[" * 40, "{" * 40,
    ".nan", ".inf", "-.inf", "1e3", "1e400", "0x1F", "0o17", "1_000", "0b101", "1:20", "2020-01-01", "~",
    "null", "yes", "on", "", " ", "\ufeff", "\x85", "\u2028",
]  # fmt: skip

SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-3, max_value=300),
    st.integers(),
    st.floats(allow_nan=True, allow_infinity=True),
    st.floats(min_value=-1, max_value=2),
    st.text(max_size=12),
    st.sampled_from(CHOICES),
)
VALUES = st.recursive(
    SCALARS,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8) | st.sampled_from(KEYS), inner, max_size=3)
    ),
    max_leaves=6,
)
# The text after "KEY=" of an override: YAML of a value, a nasty snippet, or any text at all.
VALUE_TEXTS = st.one_of(
    VALUES.map(lambda value: json.dumps(value)),
    st.sampled_from(NASTY_YAML),
    st.text(max_size=20),
)
KEY_TEXTS = st.one_of(
    st.sampled_from(KEYS), st.text(max_size=12), st.sampled_from(["", ".", "a..b", "train.", " ", "="])
)


def assert_one_line(error: Exception) -> None:
    """The message of ``error`` is one non-empty line (what the CLI prints after ``bigrank CMD: error:``)."""
    message = str(error)
    assert message.strip() and "\n" not in message and "\r" not in message, repr(message)
