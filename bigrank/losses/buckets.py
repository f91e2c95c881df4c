"""Bucketing a score block among each row's sorted thresholds: the one pass of the user-major shared losses
(``bigrank.losses.shared``) that touches every score.

Row r's thresholds ``t_r`` (ascending, padded with +inf to ``2^m_r`` entries, ``2^m_r > |t_r|``) make its
buckets: the bucket of a score z is ``k = |{j : t_rj < z}|``, 0..|t_r|. :func:`threshold_table` lays the rows out
in one flat table (:class:`ThresholdTable`), each row at its own depth m_r: a row's work and its buffers follow
its own number of thresholds, so one user with 20K positives among 256 costs its own row more, not every row of
the batch. :func:`bucket_stats` adds each score's 1 and z to its row's ``counts[k]`` and ``sums[k]`` (flat
tensors laid out as the table) and keeps k (int16, or int32 past 32,767 thresholds a row) for
:func:`bucket_gather`, which reads back the row's ``prefix[k]`` for every score: the backward then needs neither
the scores again nor a second search.

Two implementations compute the same buckets, counts and sums (bit for bit: the sums are added in column order
on both):

* native (CPU; float32 or bfloat16 blocks): ``csrc/buckets.c``, built with the system C compiler at first use
  (``cc -O3 -march=native``, ~0.2 s) and loaded with ctypes. Where the compiler targets AVX-512, a branchless
  binary search of each row at its own depth, sixteen scores at a time with gathers. Elsewhere each row's *cell
  table* (``bucket_cells``, built once a table): 4 x 2^depth cells of equal width over the row's thresholds, each
  cell knowing the bucket at its left edge, so a score's cell bounds its bucket and one or two comparisons with
  the thresholds inside the cell settle it (exact: the cell is a non-decreasing function of the score; O(1)
  expected, whatever the row's depth). The library is cached in ``$XDG_CACHE_HOME/bigrank`` (a directory of this
  user's, mode 0700), keyed by the source, the compiler's version and the target the compiler sees for
  ``-march=native`` (its predefined macros: the same key on x86 and aarch64); a cached library that does not load
  is rebuilt once. Measured with ``python -m benchmarks.bench_buckets --columns 32768`` (256 users, 363 thresholds
  a user, one thread, CPU time; 2026-11-28 on a 2-core AVX2 machine at load 4.6): the statistics pass 5.0-5.4 ns a
  score (the one-at-a-time binary search it replaces: 15-17, and 5.7 with sixteen searches interleaved level by
  level), against the torch path's 81-89; the gather 3.0-3.5 ns against 15-20; with one user of 20,000 thresholds
  among the 256, 5.1-5.4 ns. (On an AVX-512 machine, 2026-11-27, the binary search took 6.5-6.7 ns a score.)
* torch (any device, any dtype; the reference): ``torch.searchsorted`` and ``scatter_add_``, one call per depth.

A NaN score has no bucket: both raise ValueError. ``BIGRANK_NATIVE=0`` forces the torch path; a machine without
a compiler falls back to it with one warning.
"""

from __future__ import annotations

import atexit
import ctypes
import hashlib
import os
import shutil
import stat
import subprocess
import tempfile
import threading
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch

__all__ = [
    "ThresholdTable",
    "bucket_gather",
    "bucket_stats",
    "index_dtype",
    "native_available",
    "threshold_table",
]

_SOURCE = Path(__file__).with_name("csrc") / "buckets.c"
# What the library is built with; -march=native is the target the key reads back from the compiler.
_TARGET_FLAGS = ["-march=native"]
_BUILD_FLAGS = ["-O3", *_TARGET_FLAGS, "-shared", "-fPIC"]
_NAN_SCORES = "bucket_stats: the scores hold NaN, which has no bucket among the thresholds"
_lock = threading.Lock()
_library: ctypes.CDLL | None = None
_load_failed = False


# ----------------------------------------------------------------------------------------------- the table
@dataclass(frozen=True)
class _Depth:
    """The rows searched at depth ``m`` (int64[R_m], ascending): a dense [R_m, 2^m] block of the flat table
    from entry ``first``."""

    m: int
    rows: torch.Tensor
    first: int


def _block(flat: torch.Tensor, depth: _Depth) -> torch.Tensor:
    """The [R_m, 2^m] view of the rows of ``depth`` in ``flat`` (laid out as the table)."""
    return flat[depth.first : depth.first + (depth.rows.numel() << depth.m)].view(-1, 1 << depth.m)


@dataclass(frozen=True)
class ThresholdTable:
    """Each row's thresholds, sorted ascending, in one flat table (:func:`threshold_table`).

    Row r owns the ``2^depth[r]`` entries from ``start[r]`` (``2^depth[r] > lengths[r]``) of ``values`` and of
    every per-bucket tensor laid out as the table (:meth:`zeros`: counts, sums, prefix sums): its thresholds
    ascending, then +inf. Rows of one depth lie together, one dense block each (``depths``).

    Attributes:
        values: float[E] the table, E = sum_r 2^depth[r] <= 2 (R + U).
        start: int64[U]; depth: int32[U]; lengths: int64[U].
        order: int64[R] the position, in the thresholds given, of row r's j-th smallest threshold, at
            ``offsets[r] + j`` (the rows' thresholds one after the other, as given: CSR by ``lengths``).
        at: int64[R] where that threshold lies in ``values`` (``start[r] + j``).
        buckets_at: int64[R + U] where row r's buckets 0..lengths[r] lie, row after row: the entries a score
            can fall in (what item-parallel ranks all-reduce).
        depths: the rows of each depth (ascending depths).
    """

    values: torch.Tensor
    start: torch.Tensor
    depth: torch.Tensor
    lengths: torch.Tensor
    order: torch.Tensor
    at: torch.Tensor
    buckets_at: torch.Tensor
    depths: tuple[_Depth, ...]
    native_cells: list = field(default_factory=list, compare=False, repr=False)  # the native kernel's, once built

    @property
    def max_depth(self) -> int:
        return self.depths[-1].m if self.depths else 0

    @property
    def index_dtype(self) -> torch.dtype:
        """The dtype of a bucket index into this table (:func:`index_dtype` of its widest row)."""
        return index_dtype(1 << self.max_depth)

    def zeros(self, dtype: torch.dtype = torch.float64) -> torch.Tensor:
        """A per-bucket tensor laid out as the table: zeros [E]."""
        return torch.zeros(self.values.numel(), dtype=dtype, device=self.values.device)

    def above(self, per_bucket: torch.Tensor) -> torch.Tensor:
        """For each threshold (``order``'s layout, [R]): the sum of ``per_bucket`` [E] over its row's buckets
        above it (j + 1 .. lengths[r] for the row's j-th smallest; the entries past a row's last bucket, which no
        score falls in, must be zero), a suffix sum over each row's buckets."""
        suffix = torch.empty_like(per_bucket)
        for depth in self.depths:
            _block(suffix, depth).copy_(_block(per_bucket, depth).flip(1).cumsum(1).flip(1))
        return suffix[self.at + 1]

    def below(self, per_threshold: torch.Tensor) -> torch.Tensor:
        """Laid out as the table ([E]): at bucket k of row r, the sum of ``per_threshold`` ([R], ``order``'s
        layout) over the row's k smallest thresholds, a prefix sum over each row's thresholds."""
        prefix = self.zeros(per_threshold.dtype)
        prefix[self.at + 1] = per_threshold
        for depth in self.depths:
            block = _block(prefix, depth)
            block.copy_(block.cumsum(1))
        return prefix


def index_dtype(width: int) -> torch.dtype:
    """The dtype of a bucket index for rows of up to ``width`` entries: int16 up to 2^15, else int32."""
    return torch.int16 if width <= 1 << 15 else torch.int32


def _bit_length(lengths: torch.Tensor) -> torch.Tensor:
    """int64 ``n.bit_length()`` of each entry: the least m with 2^m > n."""
    return torch.frexp(lengths.to(torch.float64)).exponent.to(torch.int64)


def threshold_table(
    thresholds: torch.Tensor, lengths: torch.Tensor, depth: torch.Tensor | None = None
) -> ThresholdTable:
    """The :class:`ThresholdTable` of each row's thresholds: row r sorted ascending and padded with +inf to
    ``2^depth[r]`` entries, ``depth[r]`` by default the least with ``2^depth[r] > lengths[r]`` (bucket 0..lengths[r]
    always fits). Ties keep the order given.

    Args:
        thresholds: float[R], row r's thresholds being ``thresholds[offsets[r]:offsets[r + 1]]`` (CSR by
            ``lengths``); NaN is refused (ValueError).
        lengths: int64[U] thresholds per row.
        depth: int64[U] each row's depth, at least the default (``benchmarks.bench_buckets`` gives every row the
            longest row's depth: one depth for the batch, as before rows had their own).
    """
    device = thresholds.device
    lengths = lengths.to(device=device, dtype=torch.int64)
    if thresholds.numel() and bool(torch.isnan(thresholds).any()):
        raise ValueError("threshold_table: the thresholds hold NaN")
    least = _bit_length(lengths)
    if depth is None:
        depth = least
    else:
        depth = depth.to(device=device, dtype=torch.int64)
        if bool((depth < least).any()):
            raise ValueError("threshold_table: a row's depth leaves no room for its thresholds (2^depth <= length)")
    rows = lengths.numel()
    start = torch.empty(rows, dtype=torch.int64, device=device)
    depths, first = [], 0
    for m in torch.unique(depth).tolist():
        members = (depth == m).nonzero().squeeze(1)
        start[members] = first + (torch.arange(members.numel(), device=device) << m)
        depths.append(_Depth(m, members, first))
        first += members.numel() << m
    offsets = torch.cumsum(lengths, 0) - lengths
    row_of = torch.repeat_interleave(torch.arange(rows, device=device), lengths)
    at = start[row_of] + torch.arange(thresholds.numel(), device=device) - offsets[row_of]
    values = torch.full((first,), float("inf"), dtype=thresholds.dtype, device=device)
    values[at] = thresholds
    position = torch.full((first,), -1, dtype=torch.int64, device=device)
    position[at] = torch.arange(thresholds.numel(), device=device)
    for group in depths:
        block, order = torch.sort(_block(values, group), dim=1, stable=True)
        _block(values, group).copy_(block)
        positions = _block(position, group)
        positions.copy_(positions.gather(1, order))
    # Sorted, row r's j-th smallest threshold sits where its j-th given one did (start[r] + j): position[at] is
    # the order. Row r's buckets 0..lengths[r] lie from start[r].
    widths = lengths + 1
    bucket_row = torch.repeat_interleave(torch.arange(rows, device=device), widths)
    bucket_first = (torch.cumsum(widths, 0) - widths)[bucket_row]
    buckets_at = start[bucket_row] + torch.arange(bucket_row.numel(), device=device) - bucket_first
    return ThresholdTable(values, start, depth.to(torch.int32), lengths, position[at], at, buckets_at, tuple(depths))


# ------------------------------------------------------------------------------------------ native library
def _cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "bigrank"


def _compiler() -> str:
    return os.environ.get("CC", "cc")


def _run(command: list[str]) -> bytes:
    return subprocess.run(command, capture_output=True, check=True, timeout=120).stdout


def _target() -> bytes:
    """What ``-march=native`` compiles for, as the compiler sees it: its predefined macros (``__AVX512F__``,
    ``__ARM_FEATURE_SVE``, …), the same question on x86 and aarch64. A cache shared by machines with other CPUs
    (a home directory on NFS) then holds one library per target instead of one that faults on the others."""
    return _run([_compiler(), *_TARGET_FLAGS, "-dM", "-E", "-x", "c", os.devnull])


def _private_dir(path: Path) -> bool:
    """Make ``path`` a directory of this user's closed to others (0700), or say it is not one: False when it is a
    symlink, not a directory, or another user's (a library loaded from there could be anyone's code)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        path.mkdir(mode=0o700)
    except FileExistsError:
        pass
    info = os.lstat(path)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid():
        return False
    if stat.S_IMODE(info.st_mode) != 0o700:
        os.chmod(path, 0o700)
    return True


def _own_file(path: Path) -> bool:
    """Whether ``path`` is a regular file of this user's that no one else can write."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return False
    return stat.S_ISREG(info.st_mode) and info.st_uid == os.geteuid() and not info.st_mode & 0o022


def _library_dir() -> Path:
    """The cache directory, or (when it is not a private directory of this user's: one warning) a temporary one of
    this process's."""
    cache = _cache_dir()
    if _private_dir(cache):
        return cache
    scratch = Path(tempfile.mkdtemp(prefix="bigrank-native-"))  # 0700, this user's
    atexit.register(shutil.rmtree, scratch, ignore_errors=True)
    warnings.warn(
        f"bigrank: {cache} is not a directory of this user's (a symlink, or another user's): the native bucket "
        f"kernel is built in {scratch} for this process",
        stacklevel=4,
    )
    return scratch


def _compile(target: Path) -> None:
    """Compile ``csrc/buckets.c`` (with OpenMP when the compiler has it) into ``target``, atomically."""
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        built = Path(scratch) / target.name
        base = [_compiler(), *_BUILD_FLAGS, str(_SOURCE), "-o", str(built)]
        result = subprocess.run([*base, "-fopenmp"], capture_output=True, timeout=120)
        if result.returncode != 0:  # no OpenMP: one thread per call
            _run(base)
        os.chmod(built, 0o700)
        os.replace(built, target)  # atomic: a concurrent builder's file is the same bytes


def _load(target: Path) -> ctypes.CDLL:
    library = ctypes.CDLL(str(target))
    i64, ptr, i32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    library.bucket_stats.argtypes = [
        ptr, i32, i64, i64, i64, ptr, ptr, ptr, i32, ptr, ptr, ptr, ptr, ptr, ptr, ptr, ptr, ptr, i64, i32,
    ]  # fmt: skip
    library.bucket_cells.argtypes = [i64, ptr, ptr, ptr, ptr, ptr, ptr, ptr, ptr, i32]
    library.bucket_gather.argtypes = [i64, i64, ptr, ptr, i64, ptr, ptr, ptr, i32]
    return library


def _build() -> ctypes.CDLL:
    """The library from the cache, compiled there first when missing (or not this user's own file); a cached file
    that does not load (damaged: a full disk, a crash mid-write) is compiled again, once."""
    key = hashlib.sha256()
    for part in (_SOURCE.read_bytes(), _run([_compiler(), "--version"]), _target(), " ".join(_BUILD_FLAGS).encode()):
        key.update(hashlib.sha256(part).digest())
    target = _library_dir() / f"buckets-{key.hexdigest()[:16]}.so"
    if not _own_file(target):
        _compile(target)
    try:
        return _load(target)
    except (OSError, AttributeError):
        _compile(target)
        return _load(target)


def _native() -> ctypes.CDLL | None:
    """The native library, built on first use; None when disabled or when the build failed (warned once)."""
    global _library, _load_failed
    if os.environ.get("BIGRANK_NATIVE", "1").strip().lower() in ("0", "false", "off"):
        return None
    if _library is not None or _load_failed:
        return _library
    with _lock:
        if _library is None and not _load_failed:
            try:
                _library = _build()
            except (OSError, AttributeError, subprocess.SubprocessError) as error:
                _load_failed = True
                warnings.warn(f"bigrank: no native bucket kernel ({error}); using torch.searchsorted", stacklevel=3)
    return _library


def native_available() -> bool:
    """Whether the native kernel is built and enabled (``BIGRANK_NATIVE``)."""
    return _native() is not None


def _ptr(tensor: torch.Tensor | None) -> ctypes.c_void_p | None:
    return None if tensor is None else ctypes.c_void_p(tensor.data_ptr())


def _cells(library: ctypes.CDLL, table: ThresholdTable) -> tuple[torch.Tensor, ...]:
    """The native kernel's cell tables of ``table`` (``bucket_cells`` in ``csrc/buckets.c``), built once per table:
    ``(cells int32, cell_start int64[U], cell_count int32[U], lo float32[U], scale float32[U])``, row r with
    ``2^(depth[r] + 2)`` cells (four or more a threshold) and ``cell_count[r] + 3`` entries from ``cell_start[r]``."""
    built = table.native_cells
    if built:
        return built
    count = (4 << table.depth.to(torch.int64)).to(torch.int32)
    size = count.to(torch.int64) + 3
    cell_start = torch.cumsum(size, 0) - size
    cells = torch.empty(int(size.sum()), dtype=torch.int32)
    lo, scale = torch.empty(count.numel(), dtype=torch.float32), torch.empty(count.numel(), dtype=torch.float32)
    lengths = table.lengths.to(torch.int64).contiguous()
    library.bucket_cells(
        count.numel(), _ptr(table.values), _ptr(table.start), _ptr(lengths), _ptr(cells), _ptr(cell_start),
        _ptr(count), _ptr(lo), _ptr(scale), torch.get_num_threads(),
    )  # fmt: skip
    built.extend((cells, cell_start, count, lo, scale))
    return tuple(built)


def _native_ok(block: torch.Tensor, table: ThresholdTable) -> bool:
    return (
        block.device.type == "cpu"
        and block.dtype in (torch.float32, torch.bfloat16)
        and table.values.dtype == torch.float32
        and block.stride(1) == 1
    )


# ------------------------------------------------------------------------------------------------ the passes
def bucket_stats(
    block: torch.Tensor, table: ThresholdTable, counts: torch.Tensor, sums: torch.Tensor, index: torch.Tensor
) -> None:
    """For every score of ``block`` [U, c]: its bucket k among row r's thresholds in ``table``; the row's
    ``counts[k] += 1``, ``sums[k] += z`` (float64 [E], laid out as the table: :meth:`ThresholdTable.zeros`) and
    ``index[r, j] = k`` (``index`` [U, c], ``table.index_dtype``, may be a column slice of a wider tensor).
    Comparisons are made in the table's dtype (float32 for float32 and bfloat16 scores). A NaN score raises
    ValueError (``counts``, ``sums`` and ``index`` are then undefined)."""
    library = _native()
    rows, cols = block.shape
    if rows != table.start.numel():
        raise ValueError(f"bucket_stats: a block of {rows} rows for a table of {table.start.numel()}")
    if rows == 0 or cols == 0:
        return
    if library is not None and _native_ok(block, table) and index.stride(1) == 1:
        bf16 = int(block.dtype == torch.bfloat16)
        idx16, idx32 = (index, None) if index.dtype == torch.int16 else (None, index)
        cells = _cells(library, table)
        status = library.bucket_stats(
            _ptr(block), bf16, rows, cols, block.stride(0), _ptr(table.values), _ptr(table.start),
            _ptr(table.depth), table.max_depth, *(_ptr(part) for part in cells), _ptr(counts), _ptr(sums),
            _ptr(idx16), _ptr(idx32), index.stride(0), torch.get_num_threads(),
        )  # fmt: skip
        if status == -1:
            raise MemoryError("bucket_stats: could not allocate the per-row counters")
        if status == -2:
            raise ValueError(_NAN_SCORES)
        return
    values = block.to(table.values.dtype)
    if bool(torch.isnan(values).any()):  # searchsorted would put it past the last bucket
        raise ValueError(_NAN_SCORES)
    for depth in table.depths:
        whole = depth.rows.numel() == rows  # every row, in order
        part = values if whole else values[depth.rows]
        buckets = torch.searchsorted(_block(table.values, depth), part.contiguous(), right=False)
        _block(counts, depth).scatter_add_(1, buckets, torch.ones_like(part, dtype=counts.dtype))
        _block(sums, depth).scatter_add_(1, buckets, part.to(sums.dtype))
        if whole:
            index.copy_(buckets)
        else:
            index[depth.rows] = buckets.to(index.dtype)


def bucket_gather(index: torch.Tensor, table: ThresholdTable, prefix: torch.Tensor) -> torch.Tensor:
    """Row r's ``prefix[k]`` for every bucket ``k = index[r, j]`` of ``index`` [U, c]: [U, c] in ``prefix``'s dtype
    (``prefix`` [E], laid out as the table; float32 or float64)."""
    library = _native()
    rows, cols = index.shape
    prefix = prefix.contiguous()
    native = prefix.dtype == torch.float32 and index.device.type == "cpu" and index.stride(1) == 1
    if library is not None and native and rows and cols:
        out = torch.empty(rows, cols, dtype=torch.float32)
        idx16, idx32 = (index, None) if index.dtype == torch.int16 else (None, index)
        library.bucket_gather(
            rows, cols, _ptr(idx16), _ptr(idx32), index.stride(0), _ptr(prefix), _ptr(table.start), _ptr(out),
            torch.get_num_threads(),
        )  # fmt: skip
        return out
    return prefix[table.start.unsqueeze(1) + index.to(torch.int64)]
