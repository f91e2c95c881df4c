"""What a model kind supplies to the one training loop, to evaluation and to export (``bigrank.model.registry``
names each kind's :class:`ModelKind` by import path; ``spec.kind`` resolves it).

The loop (``bigrank.train.trainer.Trainer``) owns everything that is the same for every kind: the process group
and the run directory, resume and checkpoint cadence, the agreed stop at a step boundary, the learning-rate
schedule, the debug switches (``debug.fail_at_step``, ``debug.nan_at_step``), the finite-loss guard, the step
counters, the logs and evaluation timing. A kind supplies what differs, as a torchtitan model supplies its
builders through its ``TrainSpec`` (not a subclass of the trainer)::

    kind.preflight(config, manifest)            before any worker starts (bigrank.run.prepare_run)
    training = kind.start_training(run)         on every rank: the model, built and laid out; the stream of
                                                batches; the optimisers; the checkpoint parts
    training.set_lr_factor(f)                   before a step, when the schedule is not constant
    training.step(batch, context) -> StepResult forward, loss, backward and update of one global step
    kind.load(config, worker, manifest)         the model of a checkpoint for evaluation and export, and the
                                                checkpoint parts that hold its weights
    kind.identity(config, model)                the settings a checkpoint's tensors depend on
    model.ranking_view()                        what evaluation ranks with (bigrank.train.evaluator.RankingModel)
    kind.export_rows(model, rank, world_size)   the rows this rank writes to an export

A kind's model module holds no process group: its build applies the rows each rank holds and owns
(``bigrank.model.catalog.shard_range`` / ``owned_range``), as torchtitan applies ``parallelize_llama`` to a
plain ``Transformer``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch

    from bigrank.config import Config
    from bigrank.data.manifest import DatasetManifest
    from bigrank.devices import Precision
    from bigrank.train.bootstrap import Worker
    from bigrank.train.checkpoint import Stateful
    from bigrank.train.evaluator import RankingModel

__all__ = [
    "STOP_BIT",
    "ExportRows",
    "ModelKind",
    "Rows",
    "StepContext",
    "StepResult",
    "Stream",
    "Training",
    "TrainingRun",
]

# A step may carry its rank's stop request (``StepContext.stop_requested``) in the int64 ids it all-gathers anyway:
# bit 62 set in a rank's ids (item ids and counts are < 2**31, the padding -1) says that rank asked to stop, so
# every rank reads every rank's request at no extra collective or byte.
STOP_BIT = 1 << 62

Rows = tuple  # (start, stop, float32[stop - start, d]): rows [start, stop) of a global table, on the CPU


@dataclass(frozen=True)
class TrainingRun:
    """What the loop hands a kind when a run starts on this rank: the resolved config, the dataset's manifest, the
    started worker (process group, rank, world size, device, control group), how this device scores (``precision``,
    ``bigrank.devices.setup_precision``) and the run directory (rank 0 may write its plan files there)."""

    config: Config
    manifest: DatasetManifest
    worker: Worker
    precision: Precision
    run_dir: Path


@dataclass(frozen=True)
class StepContext:
    """The loop's side of one step.

    ``step``: updates made before this one (0-based). ``stop_requested``: this rank has a stop request, which the
    step's collective must carry to every rank (:attr:`StepResult.stopping`). ``nan``: ``debug.nan_at_step`` names
    this step (the guard's test): the kind passes its loss through :meth:`poison` before the loss's collective.
    ``check_finite(value)``: the loop's guard, called with the global loss before any parameter moves (it raises
    FloatingPointError naming the step and the last good checkpoint)."""

    step: int
    stop_requested: bool
    nan: bool
    check_finite: Callable[[float], None]

    def poison(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` times NaN when ``debug.nan_at_step`` names this step, else ``loss``."""
        return loss * float("nan") if self.nan else loss


@dataclass(frozen=True)
class StepResult:
    """One step's outcome, the same on every rank: the global batch's mean row loss, its rows (training
    examples, for the examples/s the loop logs) and whether any rank asked to stop (then every rank stops
    after this step)."""

    loss: float
    rows: int
    stopping: bool


@dataclass(frozen=True)
class ExportRows:
    """The rows rank ``r`` writes to an export (``bigrank.export.writer.export_embeddings``), each
    :data:`Rows`: item vectors, user vectors and, when users can be folded in from items, the history rows; ``info``
    is what the kind adds to the export manifest's ``model`` section (its ``dim`` when it differs from
    ``model.dim``, ``fold_in``: ``"sqrt_sum"`` when a user given by items is their sum over the square root of
    their count instead of the default mean, ``user_vectors: "full"`` when the user rows already hold the history
    term)."""

    items: Rows
    users: Rows
    history: Rows | None = None
    info: Mapping[str, Any] = field(default_factory=dict)


class Stream(Protocol):
    """The training batches of one rank (e.g. ``bigrank.data.stream.ParquetStream``: (user, item) rows; a kind
    trained user by user has a stream of users). The position is a count of global steps, so a run resumes on any
    worker count; :attr:`epoch` moves on as an epoch's last batch is handed out."""

    epoch: int

    def steps_per_epoch(self) -> int: ...

    def steps_left_in_epoch(self) -> int: ...

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


class Training(Protocol):
    """A kind's training parts on one rank (:meth:`ModelKind.start_training`).

    ``model``: what evaluation ranks with. ``stream``: the batches. ``parts``: the kind's checkpoint parts by name
    (weights and optimiser state; the loop adds ``stream``, ``train`` and the per-rank ``rng``); their names are
    the checkpoint's, so they stay as they are once runs exist. ``temperature``: the loss's current temperature
    for the logs (None: none)."""

    model: RankingModel
    stream: Stream
    parts: Mapping[str, Stateful]

    @property
    def temperature(self) -> float | None: ...

    def set_lr_factor(self, factor: float) -> None:
        """Set every optimiser's rate to its base rate times ``factor`` (the loop's schedule), before the step."""

    def step(self, batch: dict[str, torch.Tensor], context: StepContext) -> StepResult:
        """Forward, loss, backward and update of one global step on this rank's ``batch`` (collective)."""


class ModelKind:
    """The implementation of one model kind (see the module docstring); a kind's module defines one object of a
    subclass and its :class:`~bigrank.model.registry.ModelSpec` names it. Methods without a default raise
    NotImplementedError."""

    name = ""

    def preflight(self, config: Config, manifest: DatasetManifest) -> None:
        """Refuse, before any worker starts, a run this kind cannot do on this dataset (ConfigError naming the
        setting). Default: nothing to refuse."""

    def start_training(self, run: TrainingRun) -> Training:
        """The training parts of ``run`` on this rank (collective: builds the model and its layout)."""
        raise NotImplementedError

    def load(self, config: Config, worker: Worker, manifest: DatasetManifest) -> tuple[RankingModel, dict]:
        """``(model, parts)``: the model of ``config`` on ``worker`` for evaluation or export, and its weights'
        checkpoint parts, which a checkpoint load fills (collective; on any worker count)."""
        raise NotImplementedError

    def identity(self, config: Config, model: RankingModel) -> dict[str, Any]:
        """The settings a checkpoint's tensors depend on (``Checkpointer(identity=...)``: a checkpoint of another
        identity is refused, naming the settings that differ)."""
        raise NotImplementedError

    def export_rows(self, model: RankingModel, rank: int, world_size: int) -> ExportRows:
        """The rows rank ``rank`` of ``world_size`` exports (collective when the model's rows are)."""
        raise NotImplementedError
