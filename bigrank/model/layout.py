"""Which tables a worker holds whole (*replicated*) and which it row-shards, decided once per run by cost.

Three tables can each take either layout: the item ``catalog``, the ``user_table`` and the ``history_table``
of the user tower.

* **sharded**: each worker holds ``~n/W`` rows. The catalog scores the all-gathered user vectors of the global
  batch against its rows and the loss exchanges per-row statistics; the tower's tables are torchrec row-wise
  shards (ids and pooled rows travel by all-to-all). Bytes per step grow with the batch, never with the table.
* **replicated**: each worker holds every row and computes its own batch rows alone (the catalog's loss runs
  with no group; the tower's tables are torchrec ``DATA_PARALLEL``); the gradients of all replicated tables are
  summed in one all-reduce per step. Bytes per step grow with the table, the number of collectives does not.

The cost of one step under each assignment is predicted from the run's shapes and this machine's measured
constants (:func:`measure_link`):

    seconds = collectives * latency + bytes / bandwidth + sum over tables of updated elements * update_seconds

where ``update_seconds`` is a dense step of the table's own optimizer (the catalog's ``optim.item_optimizer``
with its weight decay, the tower's ``optim.user_optimizer``), timed at start-up.

``bytes`` is what one worker sends: ring collectives move ``(W - 1) / W`` of the gathered payload
(all-gather, reduce-scatter, all-to-all) and ``2 (W - 1) / W`` of an all-reduced one (Thakur, Rabenseifner &
Gropp 2005, "Optimization of collective communication operations in MPICH"). Compute that is the same in both
layouts (the score GEMMs: ``B x n/W`` sharded, ``B/W x n`` replicated) is left out; the dense optimizer
pass over a replicated table is not (every worker updates every row). ``auto`` takes the cheapest of all
assignments; :func:`format_layout_plan` prints them all, so a user sees why.
"""

from __future__ import annotations

import itertools
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from bigrank.distributed.collectives import group_size, is_distributed
from bigrank.model.layouts import LAYOUT_TABLES, LAYOUTS

__all__ = [
    "LAYOUTS",
    "Link",
    "StepShape",
    "choose_layouts",
    "format_layout_plan",
    "measure_link",
    "predict_step",
]

FLOAT_BYTES = 4
ID_BYTES = 8
# Collectives of one step that do not depend on the table sizes. Sharded catalog: the all-gather of the user
# vectors and targets (with its size exchange), its backward, and the loss's per-row statistics (full-catalog
# losses: the positive's score, the merged top-k and support sums, the second pass of rankmax/sparsemax;
# sampled softmax: the positives' scores and the log-sum-exp terms) — 6 to 7 counted on gloo
# (benchmarks/bench_scaling.py). Row-wise sharded tower: torchrec's all-to-alls of the lengths and ids and of
# the pooled rows, and the pooled rows' gradients in backward. Replicated catalog: the step's loss and row count
# (before backward, so every worker stops on the same NaN) and the gradient all-reduce.
SHARDED_CATALOG_COLLECTIVES = 3
LOSS_COLLECTIVES = {"full": 3, "sampled": 3}
SHARDED_TOWER_COLLECTIVES = 4
REPLICATED_COLLECTIVES = 2
ROW_STATISTICS = 4  # float64 values per row in the loss's exchanges (top-k of 1-2, support sum and size)


@dataclass(frozen=True)
class Link:
    """This machine's measured constants (:func:`measure_link`)."""

    latency_s: float  # one all-reduce of 4 KB right after some compute, mean (what a step's collective waits)
    bandwidth_bytes_s: float  # bytes one worker sends per second in a 4 MiB all-reduce
    update_s_per_element: float  # a dense step of the catalog's optimizer, per float updated
    tower_update_s_per_element: float | None = None  # the same for the tower's tables (None: as the catalog)

    @property
    def tower_update_s(self) -> float:
        return self.update_s_per_element if self.tower_update_s_per_element is None else self.tower_update_s_per_element

    def describe(self) -> str:
        bandwidth = "∞" if self.bandwidth_bytes_s == float("inf") else f"{self.bandwidth_bytes_s / 1e9:.2f} GB/s"
        return (
            f"collective wait {self.latency_s * 1e6:.0f} µs (mean, between compute), bandwidth {bandwidth}, "
            f"dense update {self.update_s_per_element * 1e9:.2f} ns/element (catalog), "
            f"{self.tower_update_s * 1e9:.2f} (user tower)"
        )


@dataclass(frozen=True)
class StepShape:
    """What one training step moves: the run's sizes (from the config and the dataset manifest)."""

    world_size: int
    batch_size: int  # global batch B
    dim: int
    num_items: int
    num_users: int
    history: bool = False
    mean_history: float = 0.0  # mean number of train items per user (history bag length)
    full_catalog: bool = True  # every item scored (else: sampled candidates)
    num_negatives: int = 0  # sampled candidates per step


@dataclass
class TableCost:
    """Predicted cost of one table's layout in one step, per worker."""

    collectives: int = 0
    bytes: float = 0.0
    update_elements: float = 0.0  # catalog rows x d updated by this worker
    tower_update_elements: float = 0.0  # replicated tower rows x d updated by this worker
    notes: list[str] = field(default_factory=list)

    def seconds(self, link: Link) -> float:
        return (
            self.collectives * link.latency_s
            + self.bytes / link.bandwidth_bytes_s
            + self.update_elements * link.update_s_per_element
            + self.tower_update_elements * link.tower_update_s
        )


def _ring(world: int) -> tuple[float, float]:
    """Fractions of the payload one worker sends in a ring all-gather and a ring all-reduce."""
    return (world - 1) / world, 2 * (world - 1) / world


def predict_step(shape: StepShape, layout: dict[str, str]) -> TableCost:
    """Collectives, bytes sent and elements updated by one worker in one step under ``layout`` ({table: layout};
    ``history_table`` only when the tower has one)."""
    world, batch, dim = shape.world_size, shape.batch_size, shape.dim
    gather, reduce = _ring(world)
    local = batch / world
    cost = TableCost()
    kind = "full" if shape.full_catalog else "sampled"
    if layout["catalog"] == "sharded":
        cost.collectives += SHARDED_CATALOG_COLLECTIVES + LOSS_COLLECTIVES[kind]
        cost.bytes += gather * batch * (2 * dim * FLOAT_BYTES + ID_BYTES)  # vectors + targets, then their grads
        cost.bytes += LOSS_COLLECTIVES[kind] * gather * batch * ROW_STATISTICS * 8
        cost.update_elements += shape.num_items / world * dim if shape.full_catalog else 0
    else:
        cost.collectives += REPLICATED_COLLECTIVES
        if shape.full_catalog:
            cost.bytes += reduce * shape.num_items * dim * FLOAT_BYTES
            cost.update_elements += shape.num_items * dim
        else:  # the touched rows (each worker's positives and negatives) are all-gathered
            cost.bytes += gather * world * (local + shape.num_negatives) * (dim + 1) * FLOAT_BYTES
    tower = [("user_table", shape.num_users, 1.0)]
    if shape.history:
        tower.append(("history_table", shape.num_items, max(shape.mean_history, 1.0)))
    if any(layout[table] == "sharded" for table, _, _ in tower):
        cost.collectives += SHARDED_TOWER_COLLECTIVES
    for table, rows, ids_per_user in tower:
        if layout[table] == "sharded":
            cost.bytes += gather * local * (ids_per_user * ID_BYTES + 2 * dim * FLOAT_BYTES)
        else:
            cost.bytes += reduce * rows * dim * FLOAT_BYTES
            cost.tower_update_elements += rows * dim
            if layout["catalog"] == "sharded":
                cost.collectives += 0 if table != tower[0][0] and layout[tower[0][0]] == "replicated" else 1
    if world == 1:
        cost.collectives, cost.bytes = 0, 0.0
    return cost


def _assignments(shape: StepShape) -> list[dict[str, str]]:
    tables = LAYOUT_TABLES if shape.history else LAYOUT_TABLES[:2]
    return [dict(zip(tables, choice, strict=True)) for choice in itertools.product(LAYOUTS, repeat=len(tables))]


def choose_layouts(shape: StepShape, requested: dict[str, str], link: Link) -> dict[str, str]:
    """The layout of each table: ``requested`` ({table: "auto" | "replicated" | "sharded"}) where it is not
    ``auto``, else the assignment of least predicted seconds among those that keep the requested tables fixed.
    One worker: everything ``sharded`` (one shard is the whole table: today's path, no data-parallel kernels)."""
    tables = LAYOUT_TABLES if shape.history else LAYOUT_TABLES[:2]
    for table in tables:
        if requested.get(table, "auto") not in ("auto", *LAYOUTS):
            raise ValueError(f"layout of {table} must be auto, replicated or sharded, got {requested[table]!r}")
    if shape.world_size == 1:
        return dict.fromkeys(tables, "sharded")
    fits = [a for a in _assignments(shape) if all(requested.get(t, "auto") in ("auto", a[t]) for t in tables)]
    return min(fits, key=lambda a: (predict_step(shape, a).seconds(link), list(a.values()).count("replicated")))


def format_layout_plan(shape: StepShape, requested: dict[str, str], chosen: dict[str, str], link: Link) -> str:
    """The plan's layout section: the measured constants, every assignment's predicted cost, the chosen one."""
    lines = [
        f"layout ({shape.world_size} workers, global batch {shape.batch_size}, d {shape.dim}, "
        f"{shape.num_items:,} items, {shape.num_users:,} users, "
        f"{'full catalog' if shape.full_catalog else f'{shape.num_negatives:,} sampled negatives'})",
        f"  measured: {link.describe()}",
        "  requested: " + ", ".join(f"{t} {requested.get(t, 'auto')}" for t in chosen),
        f"  {'assignment':<52}{'collectives':>12}{'MB sent':>10}{'M updated':>11}{'predicted ms':>14}",
    ]
    for assignment in _assignments(shape):
        cost = predict_step(shape, assignment)
        mark = "  <- chosen" if assignment == chosen else ""
        name = ", ".join(f"{t} {v[:4]}" for t, v in assignment.items())
        updated = cost.update_elements + cost.tower_update_elements
        lines.append(
            f"  {name:<52}{cost.collectives:>12}{cost.bytes / 1e6:>10.2f}{updated / 1e6:>11.2f}"
            f"{cost.seconds(link) * 1e3:>14.2f}{mark}"
        )
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------- measurement
def _mean_between_compute(fn, compute, repeats: int) -> float:
    """Mean seconds of ``fn`` called right after ``compute`` (not timed), as a step calls its collectives."""
    total = 0.0
    for _ in range(repeats):
        compute()
        started = time.perf_counter()
        fn()
        total += time.perf_counter() - started
    return total / repeats


def _timed(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


# Builds, for a parameter, one dense step of an optimizer (called with the gradient): the run's own optimizers,
# which the training layer passes in (bigrank.train.model.decide_layout).
UpdateFactory = Callable[[nn.Parameter], Callable[[torch.Tensor], None]]


def _rowwise_adagrad(weight: torch.Tensor) -> Callable[[torch.Tensor], None]:
    """A dense row-wise Adagrad step on ``weight`` (the default optimizer of both tables)."""
    accumulator = torch.zeros(weight.shape[0], device=weight.device)

    def step(grad: torch.Tensor) -> None:
        accumulator.add_(grad.square().mean(dim=1))
        weight.data.addcdiv_(grad, accumulator.sqrt().add_(1e-8).unsqueeze(1), value=-1e-3)

    return step


def _update_seconds(make_step: UpdateFactory, device: torch.device) -> float:
    """Seconds per element of one dense step of the optimizer ``make_step`` builds, on a 4 MiB table."""
    rows, dim = 16_384, 64
    weight = nn.Parameter(torch.randn(rows, dim, device=device))
    grad = torch.randn(rows, dim, device=device)
    step = make_step(weight)

    def update() -> None:
        step(grad)
        grad.mul_(1.0)  # the gradient buffer is written once a step too

    update()
    return _timed(update, 5) / (rows * dim)


@torch.no_grad()
def measure_link(
    group: dist.ProcessGroup | None,
    device: torch.device | str = "cpu",
    catalog_update: UpdateFactory | None = None,
    tower_update: UpdateFactory | None = None,
) -> Link:
    """This machine's collective latency and bandwidth over ``group`` and the speed of a dense step of the
    catalog's and the user tower's optimizers (``catalog_update`` / ``tower_update``; default: row-wise
    Adagrad) (collective; ~0.25 s). Every figure is the maximum over the workers, so every worker decides the
    same layouts."""
    device = torch.device(device)
    update_s = _update_seconds(catalog_update or _rowwise_adagrad, device)
    tower_update_s = _update_seconds(tower_update or _rowwise_adagrad, device)
    grad = torch.randn(16_384, 64, device=device)
    row_update = _rowwise_adagrad(nn.Parameter(torch.randn(16_384, 64, device=device)))

    def update() -> None:  # a burst of memory-bound compute, as a step has between its collectives
        row_update(grad)
        grad.mul_(1.0)

    latency, bandwidth = 0.0, float("inf")
    if is_distributed(group):
        small, large = torch.zeros(1, dtype=torch.float64, device=device), torch.zeros(1 << 20, device=device)
        dist.all_reduce(small, group=group)
        idle_latency = _timed(lambda: dist.all_reduce(small, group=group), 20)
        # The median of 15: of 5 it read 0.66-1.26 GB/s in 8 runs here, of 15 0.79-0.95 (~50 ms more).
        seconds = max(_timed(lambda: dist.all_reduce(large, group=group), 15) - idle_latency, 1e-9)
        bandwidth = _ring(group_size(group))[1] * large.numel() * FLOAT_BYTES / seconds
        # A step calls its collectives between bursts of compute, with row statistics of a few KB: their mean
        # wait is what it pays. On a virtual machine whose idle vCPUs halt, that is ~4x the idle median here
        # (benchmarks/bench_collectives.py: 1.0-1.4 ms against 0.26 ms, a tail near a 4 ms scheduler tick).
        row_stats = torch.zeros(512, dtype=torch.float64, device=device)
        latency = _mean_between_compute(lambda: dist.all_reduce(row_stats, group=group), update, 40)
    figures = torch.tensor([latency, 1.0 / bandwidth, update_s, tower_update_s], dtype=torch.float64, device=device)
    if is_distributed(group):
        dist.all_reduce(figures, op=dist.ReduceOp.MAX, group=group)
    latency, inverse_bandwidth, update_s, tower_update_s = figures.tolist()
    return Link(latency, 1.0 / inverse_bandwidth if inverse_bandwidth else float("inf"), update_s, tower_update_s)
