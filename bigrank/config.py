"""Typed run configuration: YAML files in ``configs/`` loaded into dataclasses, with ``--set a.b=v`` overrides.

Every key is checked: an unknown key is an error naming its full dotted path (``train.batchsize`` →
"unknown key 'train.batchsize'"), a value of the wrong type or out of range is an error naming the key.
Override values are parsed as YAML scalars (``--set train.max_steps=50``, ``--set eval.sample_users=null``,
``--set eval.ks=[10,100]``). The resolved configuration (defaults filled in, ``data.root`` and ``run_dir``
made absolute) is what the trainer saves as ``RUN_DIR/config.yaml``; loading that file gives the same config.

Losses come from the loss registry (``bigrank.losses.registry``): ``loss.name`` is one of its names and
``loss.params`` may only hold that loss's parameters (its ``*Params`` dataclass), merged over their defaults
and checked there (types and values), with errors naming the dotted key (``loss.params.k``). Model kinds come
from the model registry (``bigrank.model.registry``) the same way: ``model.kind`` and ``model.params``, whose
``*Params`` dataclass also checks the settings of the other sections its kind trains with.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
import os
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from bigrank.atomic import write_text_atomic
from bigrank.errors import ConfigError
from bigrank.losses.fused.select import KERNELS
from bigrank.losses.registry import CANDIDATE_LOSSES, FULL_CATALOG_LOSSES, LOSSES, parse_params
from bigrank.model.layouts import LAYOUT_TABLES, LAYOUTS
from bigrank.model.registry import DEFAULT_KIND, model_spec, parse_model_params, upgrade_model_keys
from bigrank.scalars import EXPONENT_NUMBER, SCALAR_TYPES, convert_scalar

__all__ = [
    "Config",
    "ConfigError",
    "add_override_argument",
    "apply_overrides",
    "check",
    "config_from_dict",
    "dump_config",
    "load_config",
    "load_run_config",
    "model_params",
    "parse_override",
    "parse_yaml",
    "requested_layouts",
    "resolve",
    "resume_changes",
    "save_config",
    "set_key",
    "validate",
]


# ``train.device`` and ``train.precision``: the one list of each (``bigrank.devices`` imports them: it imports
# torch, which this module must not). ``train.kernel``'s choices are the losses' (``KERNELS``), ``model.layout``'s
# the model's (``LAYOUT_TABLES``, ``LAYOUTS``): imported from below, where they are decided.
DEVICES = ("auto", "cpu", "cuda")
PRECISIONS = ("auto", "fp32", "tf32", "bf16")


def _choices(*values: str, doc: str = "") -> dict:
    return {"choices": values, "doc": doc}


@dataclass
class DataConfig:
    root: str = ""  # dataset directory (bigrank Parquet layout with manifest.json)
    shuffle_buffer: int = 1 << 20  # rows shuffled together by the stream
    prefetch: int = 4  # > 0: a background thread reads the next shuffle window ahead (0: read inline)
    # Before its first step a run checks its dataset files against the manifest. full: the size and CRC-32 of
    # every file it will read (train, and the splits its evaluation reads), the workers sharing the files (reads
    # the data once: ~1-2 s a GB a worker); quick: sizes and footers only (a flipped byte is then found when its
    # row group is read, by its page checksum, possibly hours in). `bigrank verify DATA` checks everything.
    verify: str = field(default="full", metadata=_choices("full", "quick"))

    def check(self) -> None:
        _check(self.shuffle_buffer >= 1, "data.shuffle_buffer", "must be >= 1")


@dataclass
class ModelConfig:
    # One of bigrank.model.registry.MODEL_KINDS (docs/architecture.md lists them). The default, towers: a user
    # tower against item vectors, trained row by row, any catalog size; the keys below are its settings.
    kind: str = DEFAULT_KIND
    # The kind's own parameters (the fields of its *Params dataclass in the registry), merged over their defaults.
    params: dict[str, Any] = field(default_factory=dict)
    dim: int = 32  # size of the vectors (multiple of 4: fbgemm's tables); what it sizes in another kind: its docs
    history: bool = False  # add the mean-pooled bag of the user's train items to the user vector
    # Training only (evaluation and export always pool the whole bag): each item of a history bag is left out
    # with probability history_dropout (a denoising regulariser, as in Steck 2020's EDLAE), then a bag longer
    # than history_sample_size keeps a random subset of that many items (bounds a heavy user's lookup cost;
    # null: no cap).
    history_dropout: float = 0.0
    history_sample_size: int | None = None
    init_std: float | None = None  # user rows N(0, init_std^2); null: 1/sqrt(dim)
    item_init_std: float = 0.1  # catalog rows N(0, item_init_std^2)
    # Each table (catalog, user_table, history_table) held whole by every worker ("replicated") or split by rows
    # ("sharded"); "auto" picks by a measured cost model (bigrank.model.layout, printed in RUN_DIR/plan.txt).
    # One value for every table, or a mapping {table: value} (tables left out: auto).
    layout: str | dict[str, str] = "auto"

    def check(self) -> None:
        _check(self.dim >= 4 and self.dim % 4 == 0, "model.dim", f"must be a positive multiple of 4, got {self.dim}")
        _check(self.init_std is None or self.init_std > 0, "model.init_std", "must be > 0 or null")
        _check(self.item_init_std > 0, "model.item_init_std", "must be > 0")
        _check(
            0 <= self.history_dropout < 1,
            "model.history_dropout",
            f"must lie in [0, 1), got {self.history_dropout}",
        )
        _check(
            self.history_sample_size is None or self.history_sample_size >= 1,
            "model.history_sample_size",
            f"must be >= 1 or null, got {self.history_sample_size}",
        )
        parse_model_params(self.kind, self.params)  # an unknown kind or parameter: ConfigError naming the key
        requested_layouts(self)  # raises ConfigError naming the key
        for key, value, unset in (
            ("history_dropout", self.history_dropout, 0),
            ("history_sample_size", self.history_sample_size, None),
        ):
            _check(
                self.history or value == unset, f"model.{key}", "needs model.history: true (a history bag to sample)"
            )


@dataclass
class WarmupConfig:
    loss: str = field(default="sampled_softmax", metadata={"doc": "the warm-up loss (a candidate loss)"})
    params: dict[str, Any] = field(default_factory=dict)
    steps: int = 0
    blend_steps: int = 0
    temp_start: float = 0.5
    temp_end: float = 0.01
    temp_decay_steps: int = 10_000

    def check(self, main_loss: str) -> None:
        _check(self.loss in CANDIDATE_LOSSES, "loss.warmup.loss", f"must be one of {', '.join(CANDIDATE_LOSSES)}")
        _check(main_loss in CANDIDATE_LOSSES, "loss.warmup", "needs a candidate main loss")
        parse_params(self.loss, self.params, "loss.warmup.params")  # raises naming the parameter
        for name in ("steps", "blend_steps"):
            _check(getattr(self, name) >= 0, f"loss.warmup.{name}", "must be >= 0")
        _check(self.temp_decay_steps >= 1, "loss.warmup.temp_decay_steps", "must be >= 1")
        _check(self.temp_start > 0, "loss.warmup.temp_start", "must be > 0")
        _check(self.temp_end > 0, "loss.warmup.temp_end", "must be > 0")


@dataclass
class LossConfig:
    name: str = field(default="softmax", metadata=_choices(*LOSSES))
    params: dict[str, Any] = field(default_factory=dict)
    # Candidate losses only: the whole local catalog shard, or sampled negatives plus each row's positive
    # (null: sampled for sampled_softmax, catalog otherwise).
    candidates: str | None = field(default=None, metadata=_choices("catalog", "sampled"))
    sampler: str = field(default="uniform", metadata=_choices("uniform", "popularity"))
    num_negatives: int = 1024  # sampled negatives per step over the whole catalog (split over ranks)
    beta: float = 0.75  # popularity sampler exponent: q ∝ (count + 1)^beta
    warmup: WarmupConfig | None = None

    def check(self) -> None:
        parse_params(self.name, self.params, "loss.params")  # raises naming the parameter
        if self.name in FULL_CATALOG_LOSSES:
            _check(self.candidates in (None, "catalog"), "loss.candidates", f"must be catalog for {self.name!r}")
            _check(self.warmup is None, "loss.warmup", f"is for candidate losses, not {self.name!r}")
        _check(self.num_negatives >= 1, "loss.num_negatives", "must be >= 1")
        _check(self.beta >= 0, "loss.beta", "must be >= 0")
        if self.warmup is not None:
            self.warmup.check(self.name)


@dataclass
class OptimConfig:
    # Fused into the sharded user tables' backward (fbgemm); adam only on CUDA (train.device).
    user_optimizer: str = field(
        default="rowwise_adagrad", metadata=_choices("sgd", "adagrad", "rowwise_adagrad", "adam")
    )
    user_lr: float = 0.05
    item_optimizer: str = field(default="adagrad", metadata=_choices("sgd", "adagrad", "adam", "rowwise_adagrad"))
    item_lr: float = 0.05
    weight_decay: float = 0.0  # items only (the fused user tables have none on CPU)
    # L2 of the user tower (bigrank.train.regularization): + user_l2 * ||f(u)||^2 per training row, mean over
    # the global batch; reaches the fused user (and history) rows through backward, on CPU too.
    user_l2: float = 0.0
    # Learning-rate schedule of both optimisers (bigrank.train.schedule): linear warm-up, then decay.
    lr_warmup_steps: int = 0
    lr_decay: str = field(default="none", metadata=_choices("none", "linear", "cosine"))
    lr_final_ratio: float = 0.0  # lr of the last step / base lr, with lr_decay linear or cosine

    def check(self) -> None:
        _check(self.user_lr > 0, "optim.user_lr", f"must be > 0, got {self.user_lr}")
        _check(self.item_lr > 0, "optim.item_lr", f"must be > 0, got {self.item_lr}")
        _check(self.weight_decay >= 0, "optim.weight_decay", "must be >= 0")
        _check(self.user_l2 >= 0, "optim.user_l2", "must be >= 0")
        _check(self.lr_warmup_steps >= 0, "optim.lr_warmup_steps", "must be >= 0")
        _check(0 <= self.lr_final_ratio <= 1, "optim.lr_final_ratio", "must be in [0, 1]")


@dataclass
class EarlyStoppingConfig:
    """``train.early_stopping``: stop on the validation split and keep the best checkpoint
    (``bigrank.train.early_stopping``)."""

    metric: str = field(
        default="ap@10",
        metadata={
            "doc": "a metric of the evaluations of eval.splits[0] while training (accuracy, recall@K, ap@K or ndcg@K; "
            "its K is evaluated beside eval.ks); higher is better"
        },
    )
    patience: int = field(default=2, metadata={"doc": "evaluations without a better value before the run stops"})
    min_delta: float = field(default=0.0, metadata={"doc": "how much better a value must be to count as better"})

    @property
    def k(self) -> int | None:
        """The cut-off the metric reads (None: accuracy)."""
        return int(self.metric.split("@")[1]) if "@" in self.metric else None

    def check(self, eval_config: EvalConfig) -> None:
        import re

        _check(
            re.fullmatch(r"(recall|ap|ndcg)@[1-9]\d*|accuracy", self.metric) is not None,
            "train.early_stopping.metric",
            f"must be accuracy, recall@K, ap@K or ndcg@K, got {self.metric!r}",
        )
        _check(self.patience >= 1, "train.early_stopping.patience", "must be >= 1")
        _check(self.min_delta >= 0, "train.early_stopping.min_delta", "must be >= 0")
        _check(
            bool(eval_config.every_epochs),
            "train.early_stopping",
            "needs eval.every_epochs >= 1 (it stops on the evaluations made while training)",
        )
        _check(
            eval_config.splits[0] == "valid",
            "train.early_stopping",
            f"stops on eval.splits[0], which must be valid (stopping on {eval_config.splits[0]!r} would tune on it)",
        )


@dataclass
class TrainConfig:
    batch_size: int = 1024  # GLOBAL batch (rows per step over all workers); divisible by the worker count
    epochs: int = 1
    max_steps: int | None = None  # stop after this many steps (null: epochs * steps per epoch)
    drop_last: bool = False  # skip the incomplete last batch of each epoch
    # model.kind towers: rows = a step is batch_size (user, item) rows, each scoring the catalog; users = a step
    # is batch_size users, each scoring the catalog once for all of its train items (rankmax k = 1 or softmax;
    # bigrank.losses.shared). The item-item model is always trained by users.
    batching: str = field(default="rows", metadata=_choices("rows", "users"))
    log_every: int = 10  # steps between metrics.jsonl / TensorBoard records
    checkpoint_every: int | None = None  # steps between checkpoints (null: only at epoch ends and the end)
    keep_checkpoints: int = 2  # complete checkpoints kept (oldest removed first)
    chunk_size: int | str | None = None  # items scored at once by full-catalog losses (null: the whole shard;
    # "auto": blocks of about 2^22 scores, bounded memory and usually faster on CPU)
    progress: bool = True  # tqdm bar on rank 0
    # One device per worker: cuda:LOCAL_RANK (local launcher) or Ray's GPU; auto = cuda when
    # ray.gpus_per_worker > 0 (Ray) or the local launcher sees a GPU (bigrank.devices).
    device: str = field(default="auto", metadata=_choices(*DEVICES))
    # Score GEMM: fp32; tf32 (CUDA tensor cores, fp32 tensors); bf16 (bf16 scores, fp32 parameters and
    # gradients); the losses' statistics (thresholds, sums, log-sum-exp) are accumulated in float64 always.
    # auto: bf16 on a CPU with bf16 GEMM units, else fp32 (bigrank.devices.resolve_precision; the log and
    # plan.txt say which and why).
    precision: str = field(default="auto", metadata=_choices(*PRECISIONS))
    # How full-catalog losses run their step: fused = Triton kernels that never store a score (CUDA; softmax and
    # rankmax k = 1); chunked = score blocks of train.chunk_size (the reference, and the CPU path); auto = fused
    # where it can run, else chunked (bigrank.losses.fused.select; the plan says which and why).
    kernel: str = field(default="auto", metadata=_choices(*KERNELS))
    # Resuming a run whose saved config differs in a key that alters its trajectory (TRAJECTORY_KEYS):
    # auto = refuse, naming the changes; force = go on with the new settings (they become the run's config).
    resume: str = field(default="auto", metadata=_choices("auto", "force"))
    # Local launcher (torch elastic): worker-group restarts from the last checkpoint after a worker fails (Ray's
    # launcher: ray.max_failures).
    max_restarts: int = 0
    # A run directory whose newest checkpoint a new run starts from (a warm start on a grown vocabulary,
    # bigrank.train.warm_start); ignored once this run has a checkpoint of its own (it resumes from that).
    init_from: str | None = None
    # Stop when the validation metric has not improved for `patience` evaluations, and end with the weights of the
    # best evaluation (null: train every epoch, end with the last weights).
    early_stopping: EarlyStoppingConfig | None = None

    def check(self) -> None:
        _check(self.batch_size >= 1, "train.batch_size", "must be >= 1")
        _check(self.max_restarts >= 0, "train.max_restarts", "must be >= 0")
        _check(self.epochs >= 1, "train.epochs", "must be >= 1")
        _check(self.max_steps is None or self.max_steps >= 1, "train.max_steps", "must be >= 1 or null")
        _check(self.log_every >= 1, "train.log_every", "must be >= 1")
        _check(self.checkpoint_every is None or self.checkpoint_every >= 1, "train.checkpoint_every", "must be >= 1")
        _check(self.keep_checkpoints >= 1, "train.keep_checkpoints", "must be >= 1")
        _check(
            self.chunk_size is None
            or self.chunk_size == "auto"
            or (isinstance(self.chunk_size, int) and self.chunk_size >= 1),
            "train.chunk_size",
            'must be >= 1, "auto" or null',
        )
        _check(
            not (self.device == "cpu" and self.precision == "tf32"),
            "train.precision",
            "tf32 is a CUDA tensor-core mode: use fp32 or bf16 with train.device=cpu",
        )
        _check(
            not (self.device == "cpu" and self.kernel == "fused"),
            "train.kernel",
            "fused is a CUDA (Triton) kernel: use chunked or auto with train.device=cpu",
        )


@dataclass
class EvalConfig:
    every_epochs: int | None = 1  # evaluate on splits[0] every N epochs while training (null/0: never)
    ks: list[int] = field(default_factory=lambda: [10, 100, 1000])
    splits: list[str] = field(default_factory=lambda: ["valid", "test"])
    sample_users: int | None = None  # evaluate a random sample of users (null: all users)
    batch_size: int = 256  # users scored at once per rank
    at_end: bool = True  # evaluate every split after training and write eval.json
    # Rank in bf16 and certify the fp32 top-K (same lists as fp32, faster) on CPUs with bf16 units; fp32 elsewhere.
    certified_bf16: bool = True

    def check(self) -> None:
        _check(self.every_epochs is None or self.every_epochs >= 0, "eval.every_epochs", "must be >= 0 or null")
        _check(
            bool(self.ks) and all(k >= 1 for k in self.ks),
            "eval.ks",
            f"must be a non-empty list of K >= 1, got {self.ks}",
        )
        _check(bool(self.splits), "eval.splits", "must name at least one split")
        for i, split in enumerate(self.splits):
            # The train items are excluded from the rankings, so only the held-out splits can be evaluated.
            _check(split in ("valid", "test"), f"eval.splits[{i}]", f"must be valid or test, got {split!r}")
        _check(self.sample_users is None or self.sample_users >= 1, "eval.sample_users", "must be >= 1 or null")
        _check(self.batch_size >= 1, "eval.batch_size", "must be >= 1")


@dataclass
class RayConfig:
    address: str | None = None  # null: start an embedded local Ray; "auto" or ray://host:port otherwise
    cpus_per_worker: float = 1.0
    gpus_per_worker: float = 0.0
    max_failures: int = 0  # worker-group restarts from the last checkpoint
    # Elastic recovery: when fewer than `workers` workers can be placed after a failure (a node gone), go on
    # from the last checkpoint with as many as fit, down to this many (null: always exactly `workers`).
    min_workers: int | None = None
    storage_path: str | None = None

    def check(self) -> None:
        _check(self.cpus_per_worker > 0, "ray.cpus_per_worker", "must be > 0")
        _check(self.gpus_per_worker >= 0, "ray.gpus_per_worker", "must be >= 0")
        _check(self.max_failures >= -1, "ray.max_failures", "must be >= -1 (-1: unlimited)")


@dataclass
class DebugConfig:
    fail_at_step: int | None = None  # rank `fail_rank` exits (os._exit) when starting this step, once per run dir
    fail_rank: int = 1
    nan_at_step: int | None = None  # the loss of this step is made NaN (tests of the NaN guard)

    def check(self) -> None:
        _check(self.fail_at_step is None or self.fail_at_step >= 1, "debug.fail_at_step", "must be >= 1 or null")
        _check(0 <= self.fail_rank, "debug.fail_rank", "must be >= 0")
        _check(self.nan_at_step is None or self.nan_at_step >= 1, "debug.nan_at_step", "must be >= 1 or null")


@dataclass
class Config:
    data: DataConfig = field(default_factory=DataConfig)
    run_dir: str = ""
    seed: int = 0
    workers: int = 2  # processes of the local launcher / Ray workers
    model: ModelConfig = field(default_factory=ModelConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    ray: RayConfig = field(default_factory=RayConfig)
    debug: DebugConfig = field(default_factory=DebugConfig)

    def to_dict(self) -> dict[str, Any]:
        """Plain nested dict (YAML/JSON-ready; what ``config.yaml`` holds)."""
        return dataclasses.asdict(self)


# ------------------------------------------------------------------------------------------------- parsing
def _type_name(tp) -> str:
    return getattr(tp, "__name__", str(tp)).replace("NoneType", "null")


def _convert(value: Any, tp, key: str) -> Any:
    """``value`` checked against the annotation ``tp`` (nested dataclasses recurse); raises ConfigError."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(tp)
        if value is None:
            if type(None) in options:
                return None
            raise ConfigError(f"{key} must not be null")
        last_error = None
        for option in options:
            if option is type(None):
                continue
            try:
                return _convert(value, option, key)
            except ConfigError as error:
                last_error = error
        raise last_error  # type: ignore[misc]
    if dataclasses.is_dataclass(tp):
        if value is None:
            value = {}
        if not isinstance(value, dict):
            raise ConfigError(f"{key} must be a mapping of keys, got {type(value).__name__} {value!r}")
        return _build(tp, value, key)
    if origin is list:
        (item_type,) = typing.get_args(tp)
        if not isinstance(value, list):
            raise ConfigError(f"{key} must be a list, got {value!r}")
        return [_convert(v, item_type, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if value is None:
            return {}
        if not isinstance(value, dict):
            raise ConfigError(f"{key} must be a mapping, got {value!r}")
        return dict(value)
    if tp in SCALAR_TYPES:
        return convert_scalar(value, tp, key)
    if tp is Any:
        return value
    raise ConfigError(f"{key}: unsupported type {_type_name(tp)}")  # a bug in the schema, not in the file


@functools.cache
def _type_hints(cls) -> dict:
    return typing.get_type_hints(cls)  # resolving the annotations is most of a small config's build time


def _build(cls, raw: dict, prefix: str):
    hints = _type_hints(cls)
    names = {f.name: f for f in dataclasses.fields(cls)}
    for key in raw:
        if key not in names:
            where = f"{prefix}.{key}" if prefix else str(key)
            raise ConfigError(f"unknown key {where!r}; {prefix or 'the top level'} accepts: {', '.join(names)}")
    values = {}
    for name, spec in names.items():
        if name not in raw:
            continue
        key = f"{prefix}.{name}" if prefix else name
        value = _convert(raw[name], hints[name], key)
        choices = spec.metadata.get("choices")
        if choices and value is not None and value not in choices:
            raise ConfigError(f"{key} must be one of {', '.join(choices)}; got {value!r}")
        values[name] = value
    return cls(**values)


# ------------------------------------------------------------------------------------------------ checks
def _check(condition: bool, key: str, message: str) -> None:
    if not condition:
        raise ConfigError(f"{key} {message}")


def check(config: Config) -> Config:
    """Every check of ``config`` — each section's own (``Section.check``) and those across sections; raises
    ConfigError naming the key. Changes nothing; returns ``config``."""
    _check(bool(config.data.root), "data.root", "must be set (a dataset directory)")
    _check(bool(config.run_dir), "run_dir", "must be set (where checkpoints and metrics go)")
    for key, path in (
        ("data.root", config.data.root),
        ("run_dir", config.run_dir),
        ("ray.storage_path", config.ray.storage_path),
    ):
        _check("\0" not in (path or ""), key, "must not contain a NUL character")
    _check(config.workers >= 1, "workers", f"must be >= 1, got {config.workers}")
    config.data.check()
    config.model.check()
    config.loss.check()
    config.optim.check()
    config.train.check()
    _check(
        config.train.batch_size % config.workers == 0,
        "train.batch_size",
        f"({config.train.batch_size}) is the global batch: it must be divisible by workers ({config.workers})",
    )
    _check(
        not (config.train.device == "cpu" and config.optim.user_optimizer == "adam"),
        "optim.user_optimizer",
        "adam runs in fbgemm's fused CUDA kernels only: use sgd, adagrad or rowwise_adagrad with train.device=cpu",
    )
    config.eval.check()
    if config.train.early_stopping is not None:
        config.train.early_stopping.check(config.eval)
    config.ray.check()
    min_workers = config.ray.min_workers
    _check(
        min_workers is None or 1 <= min_workers <= config.workers,
        "ray.min_workers",
        f"must be between 1 and workers ({config.workers}) or null, got {min_workers}",
    )
    if min_workers is not None:  # an elastic restart may run on any count in [min_workers, workers]
        for count in range(min_workers, config.workers):
            _check(
                config.train.batch_size % count == 0,
                "ray.min_workers",
                f"({min_workers}) allows {count} workers, which do not divide train.batch_size "
                f"({config.train.batch_size})",
            )
    config.debug.check()
    model_params(config).check(config)  # the kind's parameters and the settings it trains with
    return config


def model_params(config: Config):
    """The ``*Params`` of ``config``'s model kind, holding ``model.params`` (merged over the defaults)."""
    return model_spec(config.model.kind).params(**parse_model_params(config.model.kind, config.model.params))


def resolve(config: Config, base_dir: str | os.PathLike | None = None) -> Config:
    """A checked ``config`` with every derived value filled in, as a new Config (``config`` is left as given):
    loss parameters merged over their defaults, ``loss.candidates`` decided, paths made absolute against
    ``base_dir`` (default: the current directory). This resolved config is what the rest of the code reads and
    what a run saves."""
    resolved = copy.deepcopy(config)
    loss = resolved.loss
    loss.params = parse_params(loss.name, loss.params, "loss.params")
    resolved.model.params = parse_model_params(resolved.model.kind, resolved.model.params)
    if loss.candidates is None:  # sampled softmax samples, the other losses see the whole catalog
        loss.candidates = "sampled" if loss.name == "sampled_softmax" else "catalog"
    if loss.warmup is not None:
        loss.warmup.params = parse_params(loss.warmup.loss, loss.warmup.params, "loss.warmup.params")
    base = Path(base_dir) if base_dir is not None else Path.cwd()
    resolved.data.root = _absolute(resolved.data.root, base)
    resolved.run_dir = _absolute(resolved.run_dir, base)
    if resolved.ray.storage_path:
        resolved.ray.storage_path = _absolute(resolved.ray.storage_path, base)
    return resolved


def validate(config: Config) -> Config:
    """:func:`check` then :func:`resolve` (paths against the current directory): the resolved config."""
    return resolve(check(config))


def requested_layouts(model: ModelConfig) -> dict[str, str]:
    """``model.layout`` as ``{table: "auto" | "replicated" | "sharded"}`` for each table the model has (the
    history table only with ``model.history``); raises ConfigError naming the key of a bad value."""
    tables = LAYOUT_TABLES if model.history else tuple(t for t in LAYOUT_TABLES if t != "history_table")
    choices = ("auto", *LAYOUTS)
    layout = model.layout
    if isinstance(layout, str):
        _check(layout in choices, "model.layout", f"must be one of {', '.join(choices)} or a mapping, got {layout!r}")
        return dict.fromkeys(tables, layout)
    for table, value in layout.items():
        where = f"model.layout.{table}" if str(table).isprintable() else f"model.layout[{table!r}]"  # one line
        _check(table in tables, where, f"is not a table of this model ({', '.join(tables)})")
        _check(value in choices, f"model.layout.{table}", f"must be one of {', '.join(choices)}, got {value!r}")
    return {table: layout.get(table, "auto") for table in tables}


# ------------------------------------------------------------------------------------------------ resume
# The keys (a section covers its keys) whose change alters a resumed run's trajectory: the model, the loss, the
# updates, the data and its order, the number and length of the steps. A run resumed with another value is
# neither the old run nor a new one. The other keys (workers: a run resumes on any worker count; evaluation,
# logging, checkpoint cadence, devices and precision, Ray, debug) may change on resume.
TRAJECTORY_KEYS = (
    "seed",
    "data.root",
    "data.shuffle_buffer",
    "model",
    "loss",
    "optim",
    "train.batch_size",
    "train.epochs",
    "train.max_steps",
    "train.drop_last",
    "train.batching",
    "train.early_stopping",
)
_NOT_COMPARED = ("train.resume",)  # the switch itself
# Keys under TRAJECTORY_KEYS that do not alter the trajectory: a run resumes on any layout, as on any worker
# count (checkpoints hold each table by owned rows, whatever the layout).
_LAYOUT_FREE = ("model.layout",)
_UNSET = "(unset)"


def _flat(tree: dict, prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            flat.update(_flat(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def resume_changes(saved: dict, new: dict) -> tuple[dict[str, tuple], dict[str, tuple]]:
    """The differences between a run's saved config and a new one (both as ``Config.to_dict()``), by dotted
    key: ``(trajectory, harmless)``, each ``{key: (old, new)}`` sorted by key; a key missing on one side has the
    value ``"(unset)"``. ``trajectory`` holds the keys under :data:`TRAJECTORY_KEYS`."""
    old_flat, new_flat = _flat(saved), _flat(new)
    trajectory, harmless = {}, {}
    for key in sorted(set(old_flat) | set(new_flat)):
        old, value = old_flat.get(key, _UNSET), new_flat.get(key, _UNSET)
        if old == value or key in _NOT_COMPARED:
            continue
        alters = any(key == prefix or key.startswith(prefix + ".") for prefix in TRAJECTORY_KEYS) and not any(
            key == prefix or key.startswith(prefix + ".") for prefix in _LAYOUT_FREE
        )
        (trajectory if alters else harmless)[key] = (old, value)
    return trajectory, harmless


def format_change(key: str, change: tuple) -> str:
    """``key: old → new`` with YAML-like values (``null``, ``[10, 100]``)."""
    old, new = (value if isinstance(value, str) else json.dumps(value) for value in change)
    return f"{key}: {old} → {new}"


# ----------------------------------------------------------------------------------------------- loading
# PyYAML's constructors let ValueError, TypeError, KeyError or AttributeError out of a malformed tagged scalar
# (``!!int x``, ``!!bool x``, ``!!timestamp x``), and its recursive composer RecursionError out of deep nesting.
_YAML_FAILURES = (yaml.YAMLError, ValueError, TypeError, KeyError, AttributeError, RecursionError)


def parse_yaml(text: str | bytes, what: str, error_type: type[ConfigError] = ConfigError) -> Any:
    """``yaml.safe_load(text)``; whatever PyYAML raises becomes one line, ``error_type(f"{what}: {reason}")``,
    the reason with its line and column instead of PyYAML's multi-line excerpt of the text."""
    try:
        return yaml.safe_load(text)
    except _YAML_FAILURES as error:
        raise error_type(f"{what}: {_yaml_reason(error)}") from None


def _yaml_reason(error: Exception) -> str:
    if isinstance(error, yaml.MarkedYAMLError) and error.problem:
        reason = error.problem
        if error.problem_mark is not None:
            reason += f" at line {error.problem_mark.line + 1}, column {error.problem_mark.column + 1}"
        if error.context:
            reason += f" ({error.context})"
    elif isinstance(error, yaml.YAMLError):
        reason = str(error)
    elif isinstance(error, RecursionError):
        reason = "nested too deeply"
    else:
        reason = f"a tagged value cannot be converted ({type(error).__name__}: {error})"
    return " ".join(reason.split())


def parse_override(text: str) -> tuple[list[str], Any]:
    """``"a.b=v"`` → (["a", "b"], v parsed as a YAML scalar/flow value). Raises ConfigError when malformed."""
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not key or not key.isprintable() or any(not part for part in key.split(".")):
        raise ConfigError(f"override {text!r} must look like section.key=value")
    value = parse_yaml(raw, f"override {key}: cannot parse value {raw!r}") if raw.strip() else ""
    if isinstance(value, str) and EXPONENT_NUMBER.fullmatch(value.strip()):
        value = float(value)
    return key.split("."), value


def load_run_config(run_dir: str | os.PathLike) -> Config:
    """The resolved config a run saved (``RUN_DIR/config.yaml``), with ``run_dir`` the directory named here (made
    absolute): a copied or moved run reads its own checkpoints and gets its own results (``eval.json``), and the
    run it was copied from is left alone. The ``run_dir`` the file records is where the run was trained: history,
    not a destination. FileNotFoundError when there is no config.yaml."""
    path = Path(run_dir) / "config.yaml"
    if not path.is_file():
        raise FileNotFoundError(f"{run_dir} is not a run directory (no config.yaml)")
    config = load_config(path)
    config.run_dir = _absolute(str(run_dir), Path.cwd())
    return config


def add_override_argument(parser) -> None:
    """The ``--set KEY=VALUE`` option (repeatable, into ``args.overrides``) of every command taking a config."""
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config key, e.g. --set train.max_steps=100 (repeatable)",
    )


def apply_overrides(raw: dict, overrides: list[str] | tuple[str, ...]) -> dict:
    """Set each ``a.b=v`` of ``overrides`` in the nested dict ``raw`` (in place; returns it)."""
    for text in overrides:
        path, value = parse_override(text)
        try:
            set_key(raw, ".".join(path), value)
        except ConfigError as error:
            raise ConfigError(f"override {text!r}: {error}") from None
    return raw


def get_key(raw: dict, key: str):
    """The value at the dotted ``key`` of the nested dict ``raw`` (None when absent): :func:`set_key`'s reader."""
    node = raw
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def set_key(raw: dict, key: str, value) -> dict:
    """Set the dotted ``key`` of the nested dict ``raw`` to ``value``, sections created as needed (in place;
    returns ``raw``). The one way a ``--set`` override or a search-space value reaches a raw config. Raises
    ConfigError when a prefix of ``key`` holds a value, not a section."""
    node = raw
    parts = key.split(".")
    for depth, part in enumerate(parts[:-1]):
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        elif not isinstance(child, dict):
            raise ConfigError(f"{'.'.join(parts[: depth + 1])} is not a section")
        node = child
    node[parts[-1]] = value
    return raw


def _absolute(path: str, base: Path) -> str:
    expanded = Path(os.path.expanduser(path))
    return str(expanded if expanded.is_absolute() else (base / expanded).resolve())


def config_from_dict(raw: dict, *, base_dir: str | os.PathLike | None = None) -> Config:
    """Build and validate a Config from a nested dict; relative paths are resolved against ``base_dir``
    (default: the current directory)."""
    if not isinstance(raw, dict):
        raise ConfigError(f"a config must be a mapping of sections, got {type(raw).__name__}")
    raw = upgrade_model_keys(copy.deepcopy(raw))  # keys of configs saved before model.params
    return resolve(check(_build(Config, raw, "")), base_dir)


def load_config(path: str | os.PathLike, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Read a YAML config, apply ``--set`` overrides, check everything (ConfigError names the key).

    Relative ``data.root`` / ``run_dir`` are taken relative to the current directory (run commands from the
    repository root, as the configs in ``configs/`` assume).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"config file not found: {path}")
    raw = parse_yaml(path.read_bytes(), f"{path} is not valid YAML") or {}  # bytes: PyYAML names bad UTF-8
    if not isinstance(raw, dict):
        raise ConfigError(f"{path} must hold a mapping of sections, got {type(raw).__name__}")
    return config_from_dict(apply_overrides(raw, overrides))


def dump_config(config: Config) -> str:
    """The resolved config as YAML text (``load_config`` of it gives an equal Config)."""
    return yaml.safe_dump(config.to_dict(), sort_keys=False, default_flow_style=None)


def save_config(config: Config, path: str | os.PathLike) -> None:
    """Write :func:`dump_config` to ``path`` atomically (temp file + os.replace)."""
    write_text_atomic(path, dump_config(config))
