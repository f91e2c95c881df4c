"""File integrity: what bigrank records about the files it writes, and how damaged ones are named.

Three layers, cheapest first (datasets, exports and checkpoints each use what fits them):

* **Sizes.** Every file's byte size is recorded when it is written (the dataset and export manifests,
  a checkpoint's ``trainer.json``) and checked whenever the data is opened: a truncated or extended file is an
  error naming it before any work starts. A few ``stat`` calls: always on.
* **Parquet page checksums.** Every Parquet file bigrank writes carries a CRC-32 per page
  (``PARQUET_WRITE_OPTIONS``), and every read verifies them (``open_parquet`` / ``read_parquet``): a flipped byte
  in a page is an error naming the file (and the row group) when that page is read, instead of ids that decode
  to other in-range ids and train silently on wrong data. Files without page checksums (written by an older
  bigrank) read as before. Cost: ``benchmarks/bench_data.py --checksums``.
* **Whole-file checksums.** A CRC-32 of every file (``file_crc32``: zlib, streamed in 4 MiB blocks; the cheapest
  stdlib checksum measured here, ~0.6-1 GB/s a core) is recorded when the file is written and checked by
  ``bigrank verify``. It also covers what page checksums do not: the footer and the page headers, and a flip in a
  row group that a run would read only hours in. Training checks the CRC-32 of every dataset file it will read
  before its first step, and loading a checkpoint every DCP file, each rank of the run a disjoint share
  (``check_files_shared``: the ranks then agree, and every one raises the same error naming the first damaged
  file). ``data.verify: quick`` leaves the dataset's to ``bigrank verify``.

A damaged file found while reading raises :class:`bigrank.errors.CorruptFileError` (a ValueError: the CLI
prints it on one line) naming the file, the row group where known, and what to do.
"""

from __future__ import annotations

import os
import sys
import time
import zlib
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from bigrank.errors import CorruptFileError

__all__ = [
    "CHECKSUM",
    "PARQUET_WRITE_OPTIONS",
    "Report",
    "check_file",
    "check_files_shared",
    "damaged_parquet",
    "describe_file",
    "describe_files",
    "file_crc32",
    "open_parquet",
    "read_parquet",
    "share_files",
]

CHECKSUM = "crc32"  # the whole-file checksum recorded beside each file's size (key of its hex value)
BLOCK_BYTES = 1 << 22  # 4 MiB reads: larger blocks measured no faster, smaller ones pay per-call overhead
PROGRESS_SECONDS = 10  # check_files_shared reports its progress at most this often
# Passed to every pyarrow Parquet writer of bigrank (pq.write_table, pq.ParquetWriter).
PARQUET_WRITE_OPTIONS = {"write_page_checksum": True}
# The text of pyarrow's error for a page whose CRC does not match (pyarrow 14 - 26: an OSError).
_CRC_FAILURE = "CRC checksum verification failed"


# --------------------------------------------------------------------------------------- whole-file checksums
def file_crc32(path: str | os.PathLike, block_bytes: int = BLOCK_BYTES) -> str:
    """CRC-32 (zlib) of the file at ``path`` as 8 hex digits, read in blocks of ``block_bytes``."""
    crc = 0
    buffer = bytearray(block_bytes)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as handle:
        while count := handle.readinto(buffer):
            crc = zlib.crc32(view[:count], crc)  # releases the GIL: describe_files hashes files in parallel
    return f"{crc:08x}"


def describe_file(path: str | os.PathLike) -> dict:
    """``{"bytes": size, "crc32": hex}`` of one file (its manifest entry)."""
    return {"bytes": int(Path(path).stat().st_size), CHECKSUM: file_crc32(path)}


def describe_files(root: str | os.PathLike, names: Iterable[str], threads: int | None = None) -> dict[str, dict]:
    """``{name: describe_file(root / name)}`` for the relative paths ``names``, hashed by ``threads`` threads
    (default: one per core, at most 8; zlib and file reads release the GIL, so the threads run in parallel)."""
    root = Path(root)
    names = list(names)
    threads = threads or min(8, os.cpu_count() or 1)
    if len(names) <= 1 or threads <= 1:
        return {name: describe_file(root / name) for name in names}
    with ThreadPoolExecutor(max_workers=min(threads, len(names))) as pool:
        entries = list(pool.map(lambda name: describe_file(root / name), names))
    return dict(zip(names, entries, strict=True))


def check_file(path: str | os.PathLike, entry: Mapping, checksum: bool = True) -> str | None:
    """What is wrong with the file at ``path`` against its recorded ``entry`` (``describe_file``), or None.

    Checks that it exists and has the recorded size, and with ``checksum`` its CRC-32 when the entry has one.
    """
    path = Path(path)
    if not path.is_file():
        return "missing"
    size = path.stat().st_size
    if "bytes" in entry and size != int(entry["bytes"]):
        return f"truncated or modified: {size} bytes, {int(entry['bytes'])} recorded"
    if checksum and CHECKSUM in entry:
        found = file_crc32(path)
        if found != entry[CHECKSUM]:
            return f"corrupt: {CHECKSUM} {found}, {entry[CHECKSUM]} recorded (same size, other bytes)"
    return None


def share_files(entries: Mapping[str, Mapping], world_size: int) -> list[list[str]]:
    """The names of ``entries`` (``{name: describe_file entry}``) cut into ``world_size`` disjoint shares of about
    equal bytes: largest file first onto the share with the fewest bytes so far (ties by name, then by share
    index), so every rank computes the same shares from the same entries. Share ``r`` lists its names sorted."""
    shares: list[list[str]] = [[] for _ in range(max(1, int(world_size)))]
    loads = [0] * len(shares)
    for name in sorted(entries, key=lambda n: (-int(entries[n].get("bytes", 0)), n)):
        rank = loads.index(min(loads))
        shares[rank].append(name)
        loads[rank] += int(entries[name].get("bytes", 0))
    return [sorted(share) for share in shares]


def check_files_shared(
    root: str | os.PathLike,
    entries: Mapping[str, Mapping],
    group=None,
    progress: Callable[[str], None] | None = None,
    what: str = "checksums",
) -> list[tuple[str, str]]:
    """Check the files ``entries`` (``{relative name: describe_file entry}``) under ``root`` with their sizes and
    CRC-32 (``check_file``), this rank of ``group`` only its share (``share_files``), and return the problems
    every rank found, ``[(name, what is wrong)]`` sorted by name: the same list on every rank.

    Collective over ``group`` when torch.distributed is initialised (one ``all_gather_object`` of the problem
    lists, on a group that carries CPU tensors: the control group); without a process group this process checks
    every file. ``progress``: called with a line (``what``, the GB of this rank's share done, the seconds) after a
    file when the last line is over ``PROGRESS_SECONDS`` old. Every rank gathers even when its own check raised
    nothing, so no rank is left waiting while another raises."""
    root = Path(root)
    rank, world_size = 0, 1
    dist = None
    if "torch.distributed" in sys.modules:  # no torch import for a process that has none (bigrank verify)
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            rank, world_size = dist.get_rank(group), dist.get_world_size(group)
        else:
            dist = None
    mine = share_files(entries, world_size)[rank]
    total = sum(int(entries[name].get("bytes", 0)) for name in mine)
    problems, done = [], 0
    started = reported = time.monotonic()
    for name in mine:
        try:
            problem = check_file(root / name, entries[name])
        except OSError as error:  # an unreadable file is a problem to report, not a rank left out of the gather
            problem = f"unreadable: {error}"
        if problem is not None:
            problems.append((name, problem))
        done += int(entries[name].get("bytes", 0))
        if progress is not None and time.monotonic() - reported > PROGRESS_SECONDS:
            reported = time.monotonic()
            progress(f"  {what}: {done / 1e9:.2f} of {total / 1e9:.2f} GB, {reported - started:.0f} s")
    if dist is not None and world_size > 1:
        gathered: list = [None] * world_size
        dist.all_gather_object(gathered, problems, group=group)
        problems = [problem for share in gathered for problem in share]
    return sorted(problems)


# ------------------------------------------------------------------------------------- verified Parquet reads
def open_parquet(path: str | os.PathLike):
    """``pyarrow.parquet.ParquetFile`` of ``path`` that verifies every page's checksum when it reads it."""
    import pyarrow.parquet as pq

    return pq.ParquetFile(path, page_checksum_verification=True)


def read_parquet(path: str | os.PathLike, **options):
    """``pyarrow.parquet.read_table(path, **options)`` verifying every page's checksum."""
    import pyarrow.parquet as pq

    return pq.read_table(path, page_checksum_verification=True, **options)


def is_checksum_failure(error: BaseException) -> bool:
    """Whether a pyarrow error is a page whose CRC-32 does not match (not merely an undecodable page)."""
    return _CRC_FAILURE in str(error)


def first_damaged_row_group(path: str | os.PathLike) -> int | None:
    """The first row group of ``path`` that fails to read with page verification, or None (all read).

    For naming the row group after a whole-file read failed: it reads the file again, group by group, so
    it runs only on the error path."""
    try:
        handle = open_parquet(path)
        for group in range(handle.num_row_groups):
            try:
                handle.read_row_group(group)
            except Exception:  # noqa: BLE001 - any failure locates the damage
                return group
    except Exception:  # noqa: BLE001 - a footer that does not parse: no row group to name
        return None
    return None


def damaged_parquet(
    kind: str, path: str | os.PathLike, error: BaseException, fix: str, row_group: int | None = None
) -> CorruptFileError:
    """The error for a Parquet file of ``kind`` ("dataset file", "export file") whose read raised ``error``.

    Names the file and the row group (``row_group``, else located by reading the file again group by group)
    and ends with ``fix`` (what the user does about it). A checksum failure says so; any other decode error
    of a file that should decode is damage too (a flip in a page header, a file without page checksums).
    """
    if row_group is None:
        row_group = first_damaged_row_group(path)
    where = f" in row group {row_group}" if row_group is not None else ""
    if is_checksum_failure(error):
        problem = f"a Parquet page{where} fails its checksum (the bytes on disk are not the bytes written)"
    else:
        problem = f"it does not decode{where} ({error})"
    return CorruptFileError(f"{kind} {path} is corrupt: {problem}. {fix}", path=path, row_group=row_group)


# ---------------------------------------------------------------------------------------------------- reports
@dataclass
class Report:
    """What ``bigrank verify`` found in one directory: files and bytes checked, and every problem by name.

    ``problems``: ``(relative path, what is wrong)``; ``notes``: what could not be checked and why;
    ``fix``: what to do when there are problems.
    """

    kind: str  # "dataset", "export", "checkpoint"
    root: Path
    fix: str
    files: int = 0
    bytes: int = 0
    problems: list[tuple[str, str]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def check(self, name: str, entry: Mapping, checksum: bool = True) -> str | None:
        """Check the file ``root / name`` against ``entry`` (``check_file``), count it, record any problem."""
        problem = check_file(self.root / name, entry, checksum)
        self.files += 1
        self.bytes += int(entry.get("bytes", 0))
        if problem is not None:
            self.problems.append((name, problem))
        return problem

    def lines(self) -> list[str]:
        """The report as printed: one line per problem and note, then a verdict line."""
        out = [f"  DAMAGED  {name}: {problem}" for name, problem in self.problems]
        out += [f"  note: {note}" for note in self.notes]
        summary = f"{self.kind} {self.root}: {self.files} files, {self.bytes / 1e6:,.1f} MB checked"
        if self.ok:
            out.append(f"OK  {summary}")
        else:
            out.append(f"FAILED  {summary}, {len(self.problems)} damaged. {self.fix}")
        return out
