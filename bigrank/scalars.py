"""Scalar values of a YAML config checked against their declared type, shared by the config schema
(``bigrank.config``) and the loss parameters (``bigrank.losses.registry``): one set of rules and messages.

A leaf module (it imports only ``bigrank.errors``), so the loss registry can use it without importing the config.
"""

from __future__ import annotations

import math
import re
import types
import typing
from typing import Any

from bigrank.errors import ConfigError

__all__ = ["EXPONENT_NUMBER", "SCALAR_TYPES", "convert_param", "convert_scalar"]

# Numbers in exponent notation without a dot ("1e-3"), which YAML 1.1 (PyYAML) leaves as strings.
EXPONENT_NUMBER = re.compile(r"[-+]?[0-9]+(\.[0-9]*)?[eE][-+]?[0-9]+")
SCALAR_TYPES = (bool, int, float, str)


def convert_scalar(value: Any, tp: type, key: str) -> Any:
    """``value`` checked against ``tp`` (bool, int, float or str); raises ConfigError naming ``key``.

    ``int`` refuses booleans; ``float`` takes integers and exponent strings ("1e-3") and returns a float, and
    refuses infinities and NaN.
    """
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key} must be true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key} must be an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, str) and EXPONENT_NUMBER.fullmatch(value.strip()):
            value = float(value)  # YAML 1.1 reads 1e-3 (no dot) as a string
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{key} must be a number, got {value!r}")
        try:
            number = float(value)
        except OverflowError:  # an integer beyond float's range
            number = math.inf
        # YAML's .inf / .nan: no setting of bigrank takes them, and an infinite learning rate or weight would
        # only show up as a NaN loss steps later.
        if not math.isfinite(number):
            raise ConfigError(f"{key} must be a finite number, got {value!r}")
        return number
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key} must be a string, got {value!r}")
        return value
    raise ValueError(f"{key}: {tp!r} is not a scalar type")  # a bug in the caller's schema


def convert_param(value: Any, tp, key: str) -> Any:
    """``value`` checked against a loss parameter's annotation (``int``, ``float``, ``str`` or ``X | None``,
    ``bigrank.losses.params``); raises ConfigError naming ``key``."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        options = [option for option in typing.get_args(tp) if option is not type(None)]
        if value is None:
            return None
        (tp,) = options
    if value is None:
        raise ConfigError(f"{key} must not be null")
    if tp in (int, float, str):
        return convert_scalar(value, tp, key)
    raise ConfigError(f"{key}: unsupported parameter type {tp}")  # a bug in bigrank.losses.params


def params_markdown_table(header: str, rows) -> str:
    """A registry's parameters as a Markdown table (docs/architecture.md): ``header`` is its first line (five
    columns, the last three parameter, default, meaning); ``rows`` gives per entry ``(lead, params, bare)``: the
    first two cells of its first line, its parameters' dataclass, and the whole line to print when it has none."""
    import dataclasses

    lines = [header, "|---|---|---|---|---|"]
    for lead, params, bare in rows:
        fields = dataclasses.fields(params)
        if not fields:
            lines.append(bare)
        for i, f in enumerate(fields):
            first = lead if i == 0 else " | "
            default = "null" if f.default is None else f.default
            lines.append(f"| {first} | `{f.name}` | `{default}` | {f.metadata.get('doc', '')} |")
    return "\n".join(lines)
