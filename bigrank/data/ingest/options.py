"""The options of an ingest (``bigrank ingest``'s flags), checked before any file is read."""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, field

from bigrank.data.ingest.resources import Resource, available_cpus, available_memory
from bigrank.errors import CommandError

__all__ = [
    "DEDUP_MODES",
    "SPLIT_MODES",
    "TIME_UNITS",
    "IngestOptions",
    "epoch_unit_of",
    "parse_fractions",
    "parse_time",
]

DEDUP_MODES = ("last", "first", "sum", "max")
SPLIT_MODES = ("random", "last", "time")
TIME_UNITS = ("auto", "s", "ms", "us", "ns")
# Epoch numbers of each unit stay below the next bound until the year 5138 (1e11 s): what --time-unit auto reads a
# column's largest number by. Today: 1.7e9 s, 1.7e12 ms, 1.7e15 us, 1.7e18 ns.
EPOCH_UNIT_BOUNDS = (("s", 1e11), ("ms", 1e14), ("us", 1e17), ("ns", float("inf")))
EPOCH_UNIT_NAMES = {"s": "seconds", "ms": "milliseconds", "us": "microseconds", "ns": "nanoseconds"}
DEFAULT_FRACTIONS = (0.8, 0.1, 0.1)
# Share of the machine's memory DuckDB may hold before it spills to disk (`--memory-limit`): the rest is for the
# Parquet writer, the vocabularies and whatever else runs.
DEFAULT_MEMORY_FRACTION = 0.5


def parse_fractions(text: str) -> tuple[float, float, float]:
    """``"0.8,0.1,0.1"`` -> (train, valid, test); CommandError unless three non-negative numbers summing to 1."""
    try:
        values = tuple(float(part) for part in str(text).split(","))
    except ValueError:
        raise CommandError(f"--fractions must be three numbers such as 0.8,0.1,0.1, got {text!r}") from None
    if len(values) != 3 or any(not math.isfinite(v) or v < 0 for v in values) or abs(sum(values) - 1) > 1e-9:
        raise CommandError(
            f"--fractions must be three non-negative numbers summing to 1 (train,valid,test), got {text!r}"
        )
    if values[0] == 0:
        raise CommandError("--fractions: the train fraction must be above 0")
    return values


def parse_time(text: str, option: str) -> int:
    """A time given on the command line (epoch seconds, or an ISO-8601 date/time, UTC unless it has an offset) as
    epoch milliseconds."""
    text = str(text).strip()
    if re.fullmatch(r"-?\d+(\.\d+)?", text):
        return int(round(float(text) * 1000))
    from datetime import UTC, datetime

    try:
        moment = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise CommandError(
            f"{option} must be epoch seconds or an ISO-8601 time (2024-01-31T00:00:00Z), got {text!r}"
        ) from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return int(round(moment.timestamp() * 1000))


def epoch_unit_of(largest: float) -> str:
    """The epoch unit (``s``, ``ms``, ``us``, ``ns``) whose numbers today are of the size of ``largest`` (the
    largest absolute time of a column): ``EPOCH_UNIT_BOUNDS``."""
    return next(unit for unit, bound in EPOCH_UNIT_BOUNDS if abs(largest) < bound)


def parse_size(text: str) -> int:
    """``"8GB"``, ``"512MB"``, ``"0.5"`` (a fraction of the memory this process may use: the machine's, or its
    cgroup's limit, ``bigrank.data.ingest.resources``) -> bytes."""
    text = str(text).strip().upper().replace("IB", "B")
    match = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([KMGT]?B)?", text)
    if not match:
        raise CommandError(f"--memory-limit must be a size such as 8GB or a fraction such as 0.5, got {text!r}")
    number, unit = float(match.group(1)), match.group(2)
    if unit is None:
        if not 0 < number <= 1:
            raise CommandError(f"--memory-limit without a unit is a fraction of memory in (0, 1], got {text!r}")
        return int(number * available_memory().amount)
    return int(number * {"B": 1, "KB": 1 << 10, "MB": 1 << 20, "GB": 1 << 30, "TB": 1 << 40}[unit])


@dataclass(frozen=True)
class IngestOptions:
    """What to read and how to clean and split it.

    Columns (``user``, ``item``, ``time``, ``rating``/``weight``): a name, or a 0-based position for headerless
    text. Cleaning runs in this order, each step counted in the manifest: rows with a null or empty id dropped;
    duplicates of a (user, item) pair merged (``dedup``); ``min_rating`` (explicit -> implicit: pairs whose merged
    rating is below it dropped, so that a pair's latest opinion decides under ``last``); the k-core
    (``min_user_items``, ``min_item_users``) iterated to a fixed point. Then the split:
    ``random`` (``fractions`` of the pairs, exact sizes, by a seeded hash), ``last`` (per user by time: the latest
    ``fractions[2]`` of a user's pairs to test, the ``fractions[1]`` before them to valid; users with fewer than 3
    pairs keep all in train) or ``time`` (a global cut: ``valid_from`` <= time < ``test_from`` is valid, after it
    test).
    """

    user: str | None = None
    item: str | None = None
    time: str | None = None
    rating: str | None = None
    weight: str | None = None
    format: str = "auto"
    delimiter: str | None = None
    header: bool | None = None
    encoding: str = "utf-8"
    time_unit: str = "auto"
    min_rating: float | None = None
    dedup: str | None = None
    min_user_items: int = 1
    min_item_users: int = 1
    split: str = "random"
    fractions: tuple[float, float, float] = DEFAULT_FRACTIONS
    valid_from: str | None = None
    test_from: str | None = None
    seed: int = 0
    items_file: str | None = None
    item_key: str | None = None
    items_format: str = "auto"
    items_delimiter: str | None = None  # read as the log is: by the name, else sniffed
    memory_limit: str | None = None
    threads: int | None = None
    temp_dir: str | None = None
    address: str | None = None
    buckets: int | None = None
    progress: bool = True
    vocab_from: str | None = None  # a parent dataset whose ids are kept (bigrank.data.ingest.vocab)
    keep_parent_split: bool = True  # --vocab-from, random split: a pair of the parent keeps its split (not --split
    # given's carve, where the given split decides)
    preset: str | None = None  # "movielens" when the MovieLens files were recognised (set by the ingest)
    extra: dict = field(default_factory=dict)

    def check(self) -> IngestOptions:
        """The options with defaults resolved (``dedup``); CommandError naming the first bad one."""
        if not self.user or not self.item:
            raise CommandError("give the id columns: --user COL --item COL (names, or 0-based positions)")
        if self.rating and self.weight:
            raise CommandError("give --rating or --weight, not both")
        if self.time_unit not in TIME_UNITS:
            raise CommandError(f"--time-unit must be one of {', '.join(TIME_UNITS)}, got {self.time_unit!r}")
        if self.min_rating is not None and not self.rating:
            raise CommandError("--min-rating needs the rating column (--rating COL)")
        if self.min_rating is not None and not math.isfinite(self.min_rating):
            raise CommandError(f"--min-rating must be a finite number, got {self.min_rating}")
        for name in ("min_user_items", "min_item_users"):
            if int(getattr(self, name)) < 1:
                raise CommandError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        value = self.rating or self.weight
        dedup = self.dedup or ("last" if self.time else "max" if value else "first")
        if dedup not in DEDUP_MODES:
            raise CommandError(f"--dedup must be one of {', '.join(DEDUP_MODES)}, got {dedup!r}")
        if dedup in ("last", "first") and not self.time and value:
            raise CommandError(f"--dedup {dedup} keeps a pair's {dedup} row by time: give --time COL, or use sum/max")
        if dedup in ("sum", "max") and not value:
            raise CommandError(f"--dedup {dedup} merges a pair's ratings or weights: give --rating or --weight")
        if self.split not in SPLIT_MODES:
            raise CommandError(f"--split must be one of {', '.join(SPLIT_MODES)}, got {self.split!r}")
        if self.split in ("last", "time") and not self.time:
            raise CommandError(f"--split {self.split} orders pairs by time: give --time COL")
        if self.split == "time":
            if self.valid_from is None or self.test_from is None:
                raise CommandError("--split time needs --valid-from T and --test-from T")
            if parse_time(self.valid_from, "--valid-from") > parse_time(self.test_from, "--test-from"):
                raise CommandError(f"--valid-from {self.valid_from} is after --test-from {self.test_from}")
        elif self.valid_from is not None or self.test_from is not None:
            raise CommandError("--valid-from/--test-from go with --split time")
        if bool(self.items_file) != bool(self.item_key):
            raise CommandError("--items-file PATH and --item-key COL go together")
        if (self.items_delimiter or self.items_format != "auto") and not self.items_file:
            raise CommandError("--items-format and --items-delimiter go with --items-file")
        if self.threads is not None and int(self.threads) < 1:
            raise CommandError(f"--threads must be at least 1, got {self.threads}")
        if self.buckets is not None and int(self.buckets) < 1:
            raise CommandError(f"--buckets must be at least 1, got {self.buckets}")
        if self.buckets is not None and self.address is None:
            raise CommandError("--buckets goes with --address (the Ray engine)")
        if self.vocab_from is not None and self.address is not None:
            # The cluster's buckets write contiguous ranges of user ids; kept ids are scattered over the range.
            raise CommandError("--vocab-from runs on the one-machine engine: drop --address")
        self.memory_bytes()
        return replace_options(self, dedup=dedup, fractions=tuple(float(f) for f in self.fractions))

    @property
    def value(self) -> str | None:
        """The column merged by ``sum``/``max`` and written as ``rating`` or ``weight``."""
        return self.rating or self.weight

    @property
    def value_name(self) -> str | None:
        """The output column of the value: ``rating`` or ``weight``."""
        return "rating" if self.rating else "weight" if self.weight else None

    def memory_bytes(self) -> int:
        """DuckDB's memory limit in bytes (:meth:`memory_plan`)."""
        return int(self.memory_plan().amount)

    def memory_plan(self) -> Resource:
        """DuckDB's memory limit (bytes) and where it comes from: ``--memory-limit``, else half the memory this
        process may use (the machine's, or less under a cgroup limit: ``bigrank.data.ingest.resources``)."""
        if self.memory_limit is not None:
            fraction = re.fullmatch(r"\s*\d+(\.\d+)?\s*", str(self.memory_limit)) is not None
            of = f" of {available_memory().source}" if fraction else ""
            return Resource(parse_size(self.memory_limit), f"--memory-limit {self.memory_limit}{of}")
        available = available_memory()
        return Resource(
            int(DEFAULT_MEMORY_FRACTION * available.amount),
            f"{DEFAULT_MEMORY_FRACTION:g} of {available.amount / 2**30:.1f} GB, {available.source}",
        )

    def thread_count(self) -> int:
        """DuckDB's threads (:meth:`threads_plan`)."""
        return int(self.threads_plan().amount)

    def threads_plan(self) -> Resource:
        """DuckDB's threads and where they come from: ``--threads``, else the CPUs this process may use (fewer
        under a cgroup's CPU quota)."""
        if self.threads is not None:
            return Resource(int(self.threads), "--threads")
        return available_cpus()

    def plan(self) -> str:
        """The engine's limits and their sources, for the progress line."""
        memory, threads = self.memory_plan(), self.threads_plan()
        return (
            f"memory limit {memory.amount / 2**30:.1f} GB ({memory.source}), "
            f"{int(threads.amount)} thread(s) ({threads.source})"
        )

    def record(self) -> dict:
        """The options as the manifest records them (no machine settings)."""
        kept = asdict(self)
        for name in (
            "memory_limit",
            "threads",
            "temp_dir",
            "address",
            "buckets",
            "progress",
            "extra",
            "keep_parent_split",
        ):
            kept.pop(name)
        kept["fractions"] = list(self.fractions)
        return kept


def replace_options(options: IngestOptions, **changes) -> IngestOptions:
    """A copy of ``options`` with ``changes``."""
    from dataclasses import replace

    return replace(options, **changes)
