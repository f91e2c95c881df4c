"""The one list of model kinds: name → parameters (``model.params``) and the kind's implementation.

A model kind is one registered unit, as a loss is (``bigrank.losses.registry``) and as torchtitan's
``TrainSpec`` (``torchtitan/protocols/train_spec.py``) holds a model with its builders. Whatever differs between
kinds comes through its :class:`ModelSpec`; the run layer, the Trainer, the Evaluator, export and serving look
the kind up and name none:

* ``bigrank.config``: ``model.kind`` is a registered name; ``model.params`` holds the fields of the kind's
  ``*Params`` dataclass (merged over their defaults, converted, then checked with the whole config by
  ``params.check(config)``: ConfigError naming the dotted key);
* ``bigrank.run.prepare_run``, ``bigrank.train.trainer.Trainer``, ``bigrank.train.workers``: ``spec.kind``, a
  ``bigrank.train.kind.ModelKind`` — the pre-flight, the model and its layout, the training step and its stream,
  the ranking view, the checkpoint parts and identity, the export rows.

This module imports no torch: a spec names its parameters and its implementation by import path, resolved on
first use (``spec.params``, ``spec.kind``), so loading a config (``bigrank --help``, ``bigrank submit``) stays
light. A kind's ``*Params`` module must be torch-free for the same reason.

Adding a kind: a torch-free module with its ``*Params`` dataclass, a module with its ``ModelKind``, and one line
in :data:`MODEL_KINDS` (or :func:`register_model_kind` from outside the package: ``tests/test_model_kinds.py``
trains, evaluates and exports a toy kind that way).
"""

from __future__ import annotations

import dataclasses
import importlib
import typing
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from bigrank.errors import ConfigError
from bigrank.scalars import convert_param, params_markdown_table

__all__ = [
    "DEFAULT_KIND",
    "MODEL_KINDS",
    "ModelSpec",
    "NoParams",
    "markdown_table",
    "model_spec",
    "parse_model_params",
    "register_model_kind",
    "upgrade_model_keys",
]


DEFAULT_KIND = "towers"  # model.kind when a config names none


def _resolve(path: str):
    """``"package.module:Name"`` → the object (imports the module)."""
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


@dataclass(frozen=True)
class NoParams:
    """The parameters of a kind that takes none in ``model.params``."""

    def check(self, config) -> None:
        """Nothing to check."""


@dataclass(frozen=True)
class ModelSpec:
    """One model kind: its config ``name``, the import paths of its ``*Params`` dataclass (``params_path``,
    torch-free: ``model.params``'s fields, defaults and ``check(config)``) and of its ``ModelKind`` object
    (``kind_path``, see ``bigrank.train.kind``), a ``summary`` for the docs, and ``renamed``: ``(old key,
    parameter)`` pairs, the ``model.<old key>`` of configs written before ``model.params`` that now reads as
    ``model.params.<parameter>`` (saved runs keep loading, resuming and evaluating)."""

    name: str
    params_path: str
    kind_path: str
    summary: str
    renamed: tuple[tuple[str, str], ...] = ()

    @cached_property
    def params(self) -> type:
        """The kind's ``*Params`` dataclass (imports its torch-free module)."""
        return _resolve(self.params_path)

    @cached_property
    def kind(self) -> Any:
        """The kind's implementation, a ``bigrank.train.kind.ModelKind`` (imports torch and the kind's modules;
        not named as a type here: this module is below everything that trains, and imports none of it)."""
        return _resolve(self.kind_path)


MODEL_KINDS: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        ModelSpec(
            "towers",
            "bigrank.model.registry:NoParams",
            "bigrank.train.towers:TOWERS",
            "a user tower (user table + optional history bag) against item vectors, row by row, any catalog size "
            "(its settings: the model section's own keys, model.dim, history, layout, ...)",
        ),
        ModelSpec(
            "item_item",
            "bigrank.model.item_item_params:ItemItemParams",
            "bigrank.train.item_item:ITEM_ITEM",
            "a full-rank item-to-item matrix beside a low-rank one, user by user (catalogs up to 32,768 items)",
            renamed=(("item_item_l2", "l2"),),
        ),
        ModelSpec(
            "item_bag",
            "bigrank.model.item_bag_params:ItemBagParams",
            "bigrank.train.item_bag:ITEM_BAG",
            "a user is the bag of its items (the sum of their input rows P over the square root of their count, no "
            "user rows) against item vectors Q, each item's own term out of its own score; user by user, "
            "item-parallel, any catalog size",
        ),
    )
}


def register_model_kind(spec: ModelSpec) -> ModelSpec:
    """Add ``spec`` to :data:`MODEL_KINDS` (a kind from outside the package); registering the same spec again
    does nothing, another spec under a registered name raises ValueError. Returns ``spec``.

    Every process that builds the kind must register it (a local launcher's worker imports the module of the
    function it runs, not the caller's registrations)."""
    existing = MODEL_KINDS.get(spec.name)
    if existing is not None and existing != spec:
        raise ValueError(f"model kind {spec.name!r} is registered already ({existing.kind_path})")
    MODEL_KINDS[spec.name] = spec
    return spec


def model_spec(name: str) -> ModelSpec:
    """The spec of ``model.kind`` ``name``; ConfigError naming the registered kinds when there is none."""
    spec = MODEL_KINDS.get(name) if isinstance(name, str) else None
    if spec is None:
        raise ConfigError(f"model.kind must be one of {', '.join(MODEL_KINDS)}; got {name!r}")
    return spec


def parse_model_params(name: str, raw: dict[str, Any], key: str = "model.params") -> dict[str, Any]:
    """``raw`` (``model.params`` of kind ``name``) merged over the kind's defaults, each value converted to its
    field's type. Raises ConfigError naming the dotted key: an unknown parameter (``unknown key
    'model.params.x'``) or a wrong type. The values are checked with the whole config by ``check(config)``
    (``bigrank.config.check``). Returns a plain dict (what ``config.yaml`` holds)."""
    params = model_spec(name).params
    fields = {f.name: f for f in dataclasses.fields(params)}
    for param in raw:
        if param not in fields:
            accepted = ", ".join(fields) or "no parameters"
            raise ConfigError(f"unknown key {f'{key}.{param}'!r}: model.kind {name!r} accepts {accepted}")
    hints = typing.get_type_hints(params)
    values = {param: convert_param(value, hints[param], f"{key}.{param}") for param, value in raw.items()}
    return dataclasses.asdict(params(**values))


def upgrade_model_keys(raw: dict) -> dict:
    """A raw config (a nested dict, as read from YAML) with the renamed keys of :attr:`ModelSpec.renamed` moved
    into ``model.params`` (in place; returns ``raw``). Such a key of the config's own kind becomes its parameter
    (its value wins over one already in ``model.params``: a search space or ``--set`` that names the old key set
    it last); of another kind it is dropped, as it never did anything there (configs saved before
    ``model.params`` hold every kind's key with its default). Anything malformed is left for the schema checks
    to name."""
    model = raw.get("model") if isinstance(raw, dict) else None
    if not isinstance(model, dict):
        return raw
    kind = model.get("kind", DEFAULT_KIND)
    for spec in MODEL_KINDS.values():
        for old, new in spec.renamed:
            if old not in model:
                continue
            if kind != spec.name:
                del model[old]
                continue
            params = model.get("params")
            if params is None:
                params = model["params"] = {}
            if isinstance(params, dict):
                params[new] = model.pop(old)
    return raw


def markdown_table() -> str:
    """The model kinds and their parameters (default, description) as a Markdown table (docs/architecture.md)."""
    return params_markdown_table(
        "| model.kind | model | parameter | default | meaning |",
        (
            (f"`{spec.name}` | {spec.summary}", spec.params, f"| `{spec.name}` | {spec.summary} | – | – | – |")
            for spec in MODEL_KINDS.values()
        ),
    )
