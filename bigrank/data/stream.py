"""Streaming reader over a dataset split: per-rank shares, bounded shuffle, prefetch, exact resume.

``ParquetStream(dataset, split, batch_size, rank, world_size, ...)`` (``dataset``: a
:class:`~bigrank.data.manifest.DatasetManifest`, or its directory) yields batches as dicts of torch tensors
(``user_id`` / ``item_id`` int64, ``rating`` float32 when asked for). How an epoch is laid out:

1. **Global order.** The split's row groups (listed in the manifest) are permuted with a generator seeded
   by (seed, epoch) — the same on every rank. Concatenated, they form the epoch's global row sequence of
   ``N`` rows.
2. **Rank shares.** Rank ``r`` of ``W`` owns rows ``[r*N//W, (r+1)*N//W)`` of that sequence: shares differ
   by at most one row and together cover every row exactly once. A rank reads only the row groups that
   overlap its share (at most two row groups are shared, each rank reading its own slice).
3. **Bounded shuffle.** A rank's share is cut into windows of whole pieces of at least ``shuffle_buffer``
   rows (at most ``shuffle_buffer`` + one row group in memory); each window's rows are permuted uniformly
   (``shuffle_order``: a Rao-Sandelius shuffle in cache-sized buckets) with a generator seeded by (seed,
   epoch, rank, window). Because every window's content and permutation are known from the manifest alone,
   the stream can start at any row without reading what came before.
4. **Batches and lock-step.** All ranks run ``steps_per_epoch()`` steps, the same number on every rank
   (computed from the manifest), so collectives stay in lock-step:

   * ``drop_last=False`` (default): ``steps = ceil(ceil(N/W) / batch_size)``. Batch ``s`` of a rank holds its
     rows ``[s*B, min((s+1)*B, share))``: every row is seen exactly once per epoch; the last batch of a rank
     is smaller, and when ``N % W != 0`` it can hold **zero rows** on the ranks with the smaller share (an
     empty batch is still yielded so that the rank takes part in the step's collectives).
   * ``drop_last=True``: ``steps = (N//W) // batch_size``; every batch is full and the
     ``N - W*steps*B`` rows at the end of the shares are skipped this epoch (different rows every epoch).

Resume: ``state_dict()`` records where the epoch stands in terms that do not depend on the rank: the epoch,
the world size its row sequence was laid out with, and the rows not yet handed out as intervals of that
sequence. Every rank holds the same state. ``load_state_dict()`` continues with the next batch exactly when
the world size and batch size are unchanged (an interrupted and resumed epoch yields the same batches as an
uninterrupted one).

Resume on another worker count (**the data position across a change of world size**): the rows of the epoch
not yet handed out when the checkpoint was taken — for each old rank, the rest of its share, in rank order —
form the epoch's *remaining sequence*; the new ranks split it into contiguous shares as in step 2 and read it
in batches of their own batch size. So within an epoch no row is lost or repeated, whatever sequence of
world sizes the epoch ran under (2 → 3 → 1 included); the global batch size may change too. The next epoch
is laid out afresh with the current world size. The state moves to the next epoch as soon as the last batch
of an epoch is handed out. ``set_epoch(e)`` moves to the start of epoch ``e`` unless the stream is already in
epoch ``e`` (so a resumed trainer can call it without losing its place).

Reading: with ``prefetch > 0`` a background thread reads, decodes and bucket-groups the next window while the
caller trains on the current one (pyarrow's decode and the numpy/torch kernels release the GIL; whole windows
are handed over, never single batches, so no per-batch thread hand-off). Each batch is gathered from its
window and converted to int64 on the caller's thread: a fresh tensor per column that the caller owns.

Files are checked against the manifest when the stream is built (``DatasetManifest.validate``): a missing,
truncated or corrupt file is an error naming it, raised before training starts. Pages are read with their
checksums verified (``bigrank.integrity``): a row group with a flipped byte or that fails to decode raises
``CorruptFileError`` (a ValueError) naming the file and row group when it is read, never wrong ids.
"""

from __future__ import annotations

import math
import queue
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np

from bigrank import integrity
from bigrank.data import manifest as layout

DEFAULT_SHUFFLE_BUFFER = 1 << 20
# The window permutation of this version (recorded in the state: positions inside an epoch are positions in
# the shuffled sequence, so a state from another permutation can only be resumed at an epoch boundary).
WINDOW_SHUFFLE = "rao-sandelius-16k"
_DONE = object()


class ParquetStream:
    """Iterable over the batches of one split for one rank (see the module docstring for the policy).

    ``for batch in stream`` yields the rest of the current epoch; ``len(stream)`` and
    ``steps_per_epoch()`` give the number of steps every rank runs per epoch. Batches are dicts of torch
    tensors of shape (b,), b <= batch_size, owned by the caller. ``prefetch > 0``: a background thread reads
    one window ahead (the value itself no longer counts batches); ``prefetch <= 0``: read on the caller's thread.
    """

    def __init__(
        self,
        dataset: layout.DatasetManifest | str | Path,
        split: str,
        batch_size: int,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
        shuffle: bool = True,
        shuffle_buffer: int = DEFAULT_SHUFFLE_BUFFER,
        drop_last: bool = False,
        columns: Sequence[str] = ("user_id", "item_id"),
        prefetch: int = 4,
        validate: bool = True,
    ):
        if batch_size < 1:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in [0, world_size={world_size})")
        if shuffle_buffer < 1:
            raise ValueError(f"shuffle_buffer must be positive, got {shuffle_buffer}")
        self.dataset = dataset = layout.as_manifest(dataset)
        self.root = dataset.root
        self.split = split
        self.batch_size = int(batch_size)
        self.rank = int(rank)
        self.world_size = int(world_size)
        self.seed = int(seed)
        self.shuffle = bool(shuffle)
        self.shuffle_buffer = int(shuffle_buffer)
        self.drop_last = bool(drop_last)
        self.columns = tuple(columns)
        self.prefetch = int(prefetch)
        if validate:
            dataset.validate([split])
        info = dataset.split(split)
        schema = dataset.schema
        missing = [c for c in self.columns if schema and c not in schema]
        if missing:
            raise ValueError(f"dataset {self.root} has no column(s) {missing}; it has {sorted(schema)}")
        self._files = dataset.files(split)
        group_file, group_index, group_rows = [], [], []
        for file_index, groups in enumerate(info["row_groups"]):
            for index, rows in enumerate(groups):
                if rows:
                    group_file.append(file_index)
                    group_index.append(index)
                    group_rows.append(rows)
        self._group_file = np.asarray(group_file, dtype=np.int64)
        self._group_index = np.asarray(group_index, dtype=np.int64)
        self._group_rows = np.asarray(group_rows, dtype=np.int64)
        self.num_rows = int(self._group_rows.sum())
        self.epoch = 0
        self._step = 0  # batches handed out in the current segment of the epoch
        # The epoch's row sequence S0 is laid out by ``_layout_world_size`` ranks (module docstring); the current
        # segment reads the intervals ``_remaining`` of S0 (None: all of it) split over this stream's ranks.
        self._layout_world_size = self.world_size
        self._remaining: list[tuple[int, int]] | None = None
        self._handles: dict[int, object] = {}

    # ----- the plan (identical on every rank) -----
    def _segment_rows(self) -> int:
        """Rows of the current segment's sequence (the whole split at the start of an epoch)."""
        if self._remaining is None:
            return self.num_rows
        return sum(b - a for a, b in self._remaining)

    def share(self, rank: int | None = None) -> tuple[int, int]:
        """Rows ``[start, stop)`` of the current segment's sequence owned by ``rank`` (default: own)."""
        rank = self.rank if rank is None else rank
        rows = self._segment_rows()
        return rank * rows // self.world_size, (rank + 1) * rows // self.world_size

    def _segment_steps(self, rows: int) -> int:
        if self.drop_last:
            return (rows // self.world_size) // self.batch_size
        return math.ceil(math.ceil(rows / self.world_size) / self.batch_size)

    def steps_per_epoch(self) -> int:
        """Steps every rank runs in a whole epoch laid out with this world size (see the module docstring)."""
        return self._segment_steps(self.num_rows)

    def steps_left_in_epoch(self) -> int:
        """Steps every rank still runs in the current epoch (after a change of world size this can differ
        by one from ``steps_per_epoch() - steps done``)."""
        return self._segment_steps(self._segment_rows()) - self._step

    def __len__(self) -> int:
        return self.steps_per_epoch()

    def rows_per_epoch(self) -> int:
        """Rows this rank yields per whole epoch."""
        if self.drop_last:
            return self.steps_per_epoch() * self.batch_size
        return (self.rank + 1) * self.num_rows // self.world_size - self.rank * self.num_rows // self.world_size

    def _group_order(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(len(self._group_rows))
        return np.random.default_rng([self.seed, epoch, 0x57AE]).permutation(len(self._group_rows))

    def _windows(
        self, epoch: int, rank: int | None = None, world_size: int | None = None
    ) -> list[list[tuple[int, int, int]]]:
        """Rank ``rank``'s share of the epoch's layout by ``world_size`` ranks (defaults: this stream's) as
        windows of pieces ``(group, lo, hi)`` (rows lo:hi of row group ``group``)."""
        rank = self.rank if rank is None else rank
        world_size = self.world_size if world_size is None else world_size
        order = self._group_order(epoch)
        sizes = self._group_rows[order]
        starts = np.concatenate([[0], np.cumsum(sizes)])
        begin, end = rank * self.num_rows // world_size, (rank + 1) * self.num_rows // world_size
        windows, current, current_rows = [], [], 0
        first = int(np.searchsorted(starts, begin, side="right")) - 1
        for k in range(max(first, 0), len(order)):
            if starts[k] >= end:
                break
            lo = max(begin - int(starts[k]), 0)
            hi = min(end - int(starts[k]), int(sizes[k]))
            if hi <= lo:
                continue
            current.append((int(order[k]), lo, hi))
            current_rows += hi - lo
            if not self.shuffle or current_rows >= self.shuffle_buffer:
                windows.append(current)
                current, current_rows = [], 0
        if current:
            windows.append(current)
        return windows

    # ----- state -----
    def state_dict(self) -> dict:
        """Where the epoch stands (the same on every rank, independent of the rank): the epoch, the world size
        its sequence was laid out with, the intervals of that sequence the current segment reads, the
        segment's world size and batch size and the batches handed out in it; plus the settings that must
        match on restore."""
        return {
            "epoch": self.epoch,
            "step": self._step,
            "split": self.split,
            "world_size": self.world_size,
            "batch_size": self.batch_size,
            "layout_world_size": self._layout_world_size,
            "remaining": None if self._remaining is None else [list(interval) for interval in self._remaining],
            "seed": self.seed,
            "shuffle": self.shuffle,
            "shuffle_buffer": self.shuffle_buffer,
            "drop_last": self.drop_last,
            "num_rows": self.num_rows,
            "window_shuffle": WINDOW_SHUFFLE,
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue from ``state`` (``state_dict()`` of a stream over the same split and settings; its world
        size and batch size may differ from this stream's: the rest of the epoch is then re-split, see the
        module docstring)."""
        for key in ("split", "seed", "shuffle", "shuffle_buffer", "drop_last"):
            if key in state and state[key] != getattr(self, key):
                raise ValueError(f"stream state has {key}={state[key]!r} but this stream has {getattr(self, key)!r}")
        if state.get("num_rows", self.num_rows) != self.num_rows:
            raise ValueError(f"stream state is for a split of {state['num_rows']} rows, this one has {self.num_rows}")
        old_world, old_batch = int(state["world_size"]), int(state["batch_size"])
        remaining = state.get("remaining")
        remaining = None if remaining is None else [(int(a), int(b)) for a, b in remaining]
        layout_world = int(state.get("layout_world_size", old_world))
        rows = self.num_rows if remaining is None else sum(b - a for a, b in remaining)
        old_steps = _steps(rows, old_world, old_batch, self.drop_last)
        step = int(state["step"])
        if not 0 <= step <= old_steps:
            raise ValueError(f"stream state step {step} is outside [0, {old_steps}]")
        mid_epoch = 0 < step < old_steps or (remaining is not None and step < old_steps)
        if self.shuffle and mid_epoch and state.get("window_shuffle") != WINDOW_SHUFFLE:
            raise ValueError(
                f"stream state is inside epoch {state['epoch']} of a sequence shuffled by "
                f"{state.get('window_shuffle', 'an older bigrank')!r}, this bigrank shuffles windows with "
                f"{WINDOW_SHUFFLE!r}: resuming there would repeat and skip rows; resume from a checkpoint taken "
                "at an epoch boundary, or with the bigrank that wrote it"
            )
        self.epoch = int(state["epoch"])
        if step >= old_steps:  # the epoch was finished: the next one is laid out with this world size
            self.epoch, self._step, self._remaining, self._layout_world_size = self.epoch + 1, 0, None, self.world_size
        elif (old_world, old_batch) == (self.world_size, self.batch_size):
            self._step, self._remaining, self._layout_world_size = step, remaining, layout_world
        else:  # re-split the rows the old ranks had not handed out yet
            intervals = [(0, self.num_rows)] if remaining is None else remaining
            rest = []
            for rank in range(old_world):
                # drop_last skips rows only in the segment that ends the epoch: the old shares' tails stay
                lo, hi = rank * rows // old_world, (rank + 1) * rows // old_world
                rest.extend(_take(intervals, min(lo + step * old_batch, hi), hi))
            self._step, self._remaining, self._layout_world_size = 0, _merge(rest), layout_world
        if self._remaining is None and self._step == 0:
            self._layout_world_size = self.world_size

    def set_epoch(self, epoch: int) -> None:
        """Move to the start of ``epoch``; no-op when already in ``epoch`` (keeps a restored position)."""
        if int(epoch) != self.epoch:
            self.epoch = int(epoch)
            self._step, self._remaining, self._layout_world_size = 0, None, self.world_size

    # ----- reading -----
    def _read_piece(self, group: int, lo: int, hi: int) -> dict[str, np.ndarray]:
        file_index = int(self._group_file[group])
        path = self._files[file_index]
        index = int(self._group_index[group])
        handle = self._handles.get(file_index)
        if handle is None:
            if len(self._handles) >= 8:
                self._handles.clear()
            try:
                handle = self._handles[file_index] = integrity.open_parquet(path)
            except Exception as error:  # replaced since the stream was built
                raise ValueError(
                    f"cannot open dataset file {path}: {error}. {layout.repair_advice(self.root)}"
                ) from error
        # Pages are verified against their checksums: a damaged one raises CorruptFileError naming file and group.
        table = layout.read_row_group(handle, path, index, self.columns, self.root)
        if table.num_rows != int(self._group_rows[group]):
            raise ValueError(
                f"row group {index} of {path} holds {table.num_rows} rows, the manifest records "
                f"{int(self._group_rows[group])}"
            )
        return {name: table.column(name).to_numpy()[lo:hi] for name in self.columns}

    def _read_window(self, epoch: int, rank: int, window_index: int, pieces) -> _Chunk:
        """Window ``window_index`` of layout rank ``rank``'s share: its columns and the order its rows are handed
        out in, a uniform permutation seeded by (seed, epoch, rank, window) (``shuffle_order``; unshuffled: the
        columns as read, in order).

        The rows are moved once here, grouped by bucket (a scatter into 64-256 sequential streams), and each
        batch gathers its own rows within a bucket (``_Chunk.take``: cache-resident) and converts them to
        int64, as a bare scan converts its batches. Whole-window random gathers and int64 copies cost more
        than the Parquet decode (cache misses, page faults).
        """
        parts = [self._read_piece(*piece) for piece in pieces]
        rows = sum(len(p[self.columns[0]]) for p in parts)
        if not self.shuffle:
            return _Chunk(parts[0], None, 0, rows)  # unshuffled windows are single pieces
        grouping, order = shuffle_order(rows, [self.seed, epoch, rank, window_index, 0x5B0F])
        if len(self.columns) == 2 and all(p[name].dtype == np.int32 for p in parts for name in self.columns):
            # user and item ids (int32 in the files): one int64 gather instead of two
            return _Chunk({}, order, 0, rows, _gather(_pack(parts, self.columns), grouping), self.columns)
        columns = {name: np.concatenate([p[name] for p in parts]) for name in self.columns}
        return _Chunk({name: _gather(values, grouping) for name, values in columns.items()}, order, 0, rows)

    def _read_intervals(self, epoch: int, layout_world_size: int, intervals, stop_event=None):
        """Yield the rows of the intervals ``[a, b)`` of the epoch's sequence (laid out by ``layout_world_size``
        ranks: each rank's share, window-shuffled, in rank order) as ``_Chunk``s, in order."""
        bounds = [r * self.num_rows // layout_world_size for r in range(layout_world_size + 1)]
        windows: dict[int, tuple[list, np.ndarray]] = {}
        for a, b in intervals:
            while a < b:
                if stop_event is not None and stop_event.is_set():
                    return
                rank = int(np.searchsorted(bounds, a, side="right")) - 1
                while bounds[rank + 1] <= a:  # skip empty shares
                    rank += 1
                if rank not in windows:
                    pieces = self._windows(epoch, rank, layout_world_size)
                    sizes = [sum(hi - lo for _, lo, hi in window) for window in pieces]
                    windows[rank] = (pieces, np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64))
                pieces, starts = windows[rank]
                offset, stop = a - bounds[rank], min(b, bounds[rank + 1]) - bounds[rank]
                window = int(np.searchsorted(starts, offset, side="right")) - 1
                while offset < stop:
                    data = self._read_window(epoch, rank, window, pieces[window])
                    lo, hi = offset - int(starts[window]), min(stop, int(starts[window + 1])) - int(starts[window])
                    yield data.part(lo, hi)
                    offset = int(starts[window]) + hi
                    window += 1
                a = bounds[rank] + stop

    def _segment_share(self, plan: tuple) -> tuple[int, int, int]:
        """``(steps, begin, end)`` of the segment ``plan``: its steps, and this rank's rows ``[begin, end)`` of
        the segment's row sequence (cut to whole batches with ``drop_last``)."""
        remaining = plan[2]
        rows = self.num_rows if remaining is None else sum(b - a for a, b in remaining)
        steps = self._segment_steps(rows)
        begin, end = self.rank * rows // self.world_size, (self.rank + 1) * rows // self.world_size
        if self.drop_last:
            end = begin + steps * self.batch_size
        return steps, begin, end

    def _batches(self, plan: tuple, chunks: Iterator[dict]):
        """Batches ``(step, batch)`` of the segment ``plan`` to its end, gathered from ``chunks`` (the rows of
        this rank's part of the segment in order, from ``_read_intervals``) and converted to the output dtypes
        (one small copy per column and batch, as a bare scan's conversion)."""
        import torch

        first_step = plan[3]
        steps, begin, end = self._segment_share(plan)
        chunk, position = None, 0
        for step in range(first_step, steps):
            size = max(0, min(self.batch_size, end - begin - step * self.batch_size))
            pieces = []
            while size > 0:
                if chunk is None or position == chunk.rows:
                    chunk, position = next(chunks), 0
                count = min(size, chunk.rows - position)
                pieces.append(chunk.take(position, position + count))
                position += count
                size -= count
            batch = {}
            for name in self.columns:
                if len(pieces) == 1:
                    values = pieces[0][name]
                elif pieces:  # the batch straddles two windows
                    values = np.concatenate([p[name] for p in pieces])
                else:  # the empty final batch of a rank with the smaller share
                    values = np.empty(0, dtype=_numpy_dtype(name))
                batch[name] = torch.from_numpy(values)
            yield step, batch

    def _chunks(self, plan: tuple, stop_event: threading.Event | None = None) -> Iterator[dict]:
        """The rows this rank reads in the segment ``plan``, in order, as dicts of torch tensors (shuffled
        windows or parts of them)."""
        epoch, layout_world_size, remaining, first_step = plan
        _, begin, end = self._segment_share(plan)
        position = min(begin + first_step * self.batch_size, end)
        own = _take(remaining or [(0, self.num_rows)], position, end)
        return self._read_intervals(epoch, layout_world_size, own, stop_event)

    def __iter__(self) -> Iterator[dict]:
        plan = (self.epoch, self._layout_world_size, self._remaining, self._step)
        epoch, steps = self.epoch, self._segment_steps(self._segment_rows())
        if self._step >= steps:  # a restored state at the very end of an epoch
            self._next_epoch()
            return
        source, stop_event, worker = self._start(plan)
        try:
            for step, batch in self._batches(plan, source):
                # The state moves past this batch before the caller sees it: a checkpoint taken while
                # the batch is being trained on resumes at the next one.
                if step + 1 >= steps:
                    self._next_epoch()
                else:
                    self.epoch, self._step = epoch, step + 1
                yield batch
        finally:
            if stop_event is not None:
                stop_event.set()
                _drain(source)
                worker.join()

    def _next_epoch(self) -> None:
        self.epoch, self._step, self._remaining, self._layout_world_size = self.epoch + 1, 0, None, self.world_size

    def _start(self, plan: tuple):
        """The chunk source: a background thread that reads and shuffles the next window while the caller
        trains on the current one (a queue of one window, so at most three windows are alive), or the plain
        generator (``prefetch <= 0``). Handing over whole windows rather than batches keeps the thread hand-off
        (and its GIL switches) out of the per-batch path."""
        if self.prefetch <= 0:
            return self._chunks(plan), None, None
        buffer: queue.Queue = queue.Queue(maxsize=1)
        stop_event = threading.Event()

        def put(item) -> bool:
            # Timed puts so that a consumer that stopped listening (break, error) never blocks the thread.
            while not stop_event.is_set():
                try:
                    buffer.put(item, timeout=0.1)
                    return True
                except queue.Full:
                    continue
            return False

        def produce():
            try:
                for item in self._chunks(plan, stop_event):
                    if not put(item):
                        return
                put(_DONE)
            except BaseException as error:  # handed to the consumer, raised there
                put(error)

        worker = threading.Thread(target=produce, name=f"ParquetStream-{self.split}-{self.rank}", daemon=True)
        worker.start()

        return _QueueSource(buffer), stop_event, worker


def _numpy_dtype(column: str):
    """The dtype a column is handed out in: ids and timestamps int64, ratings float32."""
    return np.float32 if column == "rating" else np.int64


# Mean rows per bucket of shuffle_order. torch.randperm runs serially (no OpenMP region, whose barrier stalls a
# loaded machine and competes with the trainer's threads) up to 32,768 rows, at ~6 ns a row; above 65,536 rows it
# costs ~10x more a row. Buckets of 16K rows on average stay under 32,768 rows.
BUCKET_ROWS = 1 << 14


def shuffle_order(rows: int, entropy, bucket_rows: int = BUCKET_ROWS) -> tuple[np.ndarray, np.ndarray]:
    """A uniformly random permutation of ``rows`` rows in two cache-friendly parts (Rao-Sandelius shuffle).

    Every row draws a uniform bucket among ``k`` (a power of two, mean bucket size <= ``bucket_rows``);
    ``grouping`` (uint64, shape (rows,)) lists the rows bucket by bucket (a stable counting sort), and ``order``
    (int32, shape (rows,)) permutes each bucket's segment of ``grouping`` uniformly (``torch.randperm``), so
    ``grouping[order]`` is the permutation. Independent uniform buckets followed by uniform shuffles within
    them give every one of the ``rows!`` orders the same probability (Rao 1961, Sandelius 1962; Bacher et al.,
    "MergeShuffle", 2015, section 2). ``entropy`` (ints) seeds it: the same entropy, the same permutation.
    """
    import pyarrow as pa
    import pyarrow.compute as pc
    import torch

    numpy_seed, torch_seed = np.random.SeedSequence(entropy).generate_state(2)
    buckets = 1
    while buckets * bucket_rows < rows and buckets < 1 << 16:
        buckets *= 2
    key_type = np.uint8 if buckets <= 256 else np.uint16
    raw = np.random.default_rng(int(numpy_seed)).bit_generator.random_raw((rows * key_type().itemsize + 7) // 8)
    keys = raw.view(key_type)[:rows] & key_type(buckets - 1)  # buckets divides 2^bits: exactly uniform
    # Arrow's stable sort of small-range integers is a counting sort: ~4x numpy's radix argsort here.
    grouping = pc.array_sort_indices(pa.array(keys)).to_numpy()
    order = np.empty(rows, dtype=np.int32)
    generator = torch.Generator().manual_seed(int(torch_seed))
    start = 0
    for count in np.bincount(keys, minlength=buckets).tolist():
        segment = order[start : start + count]
        torch.randperm(count, generator=generator, dtype=torch.int32, out=torch.from_numpy(segment))
        segment += start  # numpy: no OpenMP region
        start += count
    return grouping, order


class _Chunk:
    """Rows ``lo:hi`` of a window in hand-out order: row ``k`` is ``columns[name][order[k]]`` (``order`` None:
    ``columns[name][k]``). ``packed`` (int64, or None): the two int32 columns ``names`` of a shuffled window
    as one array, ``first << 32 | second`` (one gather moves both)."""

    def __init__(self, columns: dict, order: np.ndarray | None, lo: int, hi: int, packed=None, names=()):
        self.columns, self.order, self.lo, self.rows = columns, order, lo, hi - lo
        self.packed, self.names = packed, names

    def part(self, lo: int, hi: int) -> _Chunk:
        """Rows ``lo:hi`` of this chunk."""
        return _Chunk(self.columns, self.order, self.lo + lo, self.lo + hi, self.packed, self.names)

    def take(self, lo: int, hi: int) -> dict[str, np.ndarray]:
        """Rows ``lo:hi`` of this chunk, one new array per column in its output dtype (``_numpy_dtype``)."""
        lo, hi = self.lo + lo, self.lo + hi
        if self.order is None:
            return {name: values[lo:hi].astype(_numpy_dtype(name)) for name, values in self.columns.items()}
        index = self.order[lo:hi]
        if self.packed is not None:
            rows = np.take(self.packed, index)
            second = rows << 32
            second >>= 32  # arithmetic shifts: exact for any int32 pair
            rows >>= 32
            return {self.names[0]: rows, self.names[1]: second}
        return {name: np.take(values, index).astype(_numpy_dtype(name)) for name, values in self.columns.items()}


def _gather(values: np.ndarray, index: np.ndarray) -> np.ndarray:
    """``values[index]`` with Arrow's take (~1.5x numpy's here); a read-only array."""
    import pyarrow as pa
    import pyarrow.compute as pc

    return pc.take(pa.array(values), pa.array(index)).to_numpy()


def _pack(parts: list[dict[str, np.ndarray]], names: Sequence[str]) -> np.ndarray:
    """The int32 columns ``names[0]``, ``names[1]`` of ``parts`` (concatenated) as int64 ``first << 32 | second``."""
    rows = sum(len(part[names[0]]) for part in parts)
    packed = np.empty(rows, dtype=np.int64)
    start = 0
    for part in parts:
        first, second = part[names[0]], part[names[1]]
        target = packed[start : start + len(first)]
        target[...] = first
        target <<= 32
        target |= second.view(np.uint32)
        start += len(first)
    return packed


class _QueueSource:
    """Iterator over the prefetch queue; raises the producer's exception in the consumer."""

    def __init__(self, buffer: queue.Queue):
        self.buffer = buffer

    def __iter__(self):
        return self

    def __next__(self):
        item = self.buffer.get()
        if item is _DONE:
            raise StopIteration
        if isinstance(item, BaseException):
            raise item
        return item


def _steps(rows: int, world_size: int, batch_size: int, drop_last: bool) -> int:
    if drop_last:
        return (rows // world_size) // batch_size
    return math.ceil(math.ceil(rows / world_size) / batch_size)


def _take(intervals, lo: int, hi: int) -> list[tuple[int, int]]:
    """Positions ``[lo, hi)`` of the concatenation of ``intervals`` as intervals of the underlying sequence."""
    taken, start = [], 0
    for a, b in intervals:
        size = b - a
        left, right = max(lo - start, 0), min(hi - start, size)
        if left < right:
            taken.append((a + left, a + right))
        start += size
        if start >= hi:
            break
    return taken


def _merge(intervals) -> list[tuple[int, int]]:
    """Adjacent intervals joined (order kept); empty ones dropped."""
    merged: list[tuple[int, int]] = []
    for a, b in intervals:
        if b <= a:
            continue
        if merged and merged[-1][1] == a:
            merged[-1] = (merged[-1][0], b)
        else:
            merged.append((a, b))
    return merged


def _drain(source) -> None:
    buffer = getattr(source, "buffer", None)
    if buffer is None:
        return
    try:
        while True:
            buffer.get_nowait()
    except queue.Empty:
        pass


def iter_row_groups(
    dataset: layout.DatasetManifest | str | Path,
    split: str,
    columns: Sequence[str] = ("user_id", "item_id"),
    share: tuple[int, int] | None = None,
):
    """Yield every row group of ``split`` of ``dataset`` (a ``DatasetManifest`` or its directory) in file order as
    a dict of numpy arrays (bounded memory).

    ``share = (index, count)``: only the row groups whose position in the split's list of row groups (file order,
    as the manifest lists them) is ``index`` modulo ``count``, so ``count`` readers (the ranks of a group) each
    read a disjoint part and together every row group once; files holding none of them are not opened.

    The split's files are checked first (``DatasetManifest.validate``, once per process: sizes and footers, a
    missing or truncated file named before any row is read) and every page is verified as it is read
    (CorruptFileError naming the file and row group)."""
    dataset = layout.as_manifest(dataset)
    root = dataset.root
    index, count = (0, 1) if share is None else (int(share[0]), int(share[1]))
    if count < 1 or not 0 <= index < count:
        raise ValueError(f"share {share} is not (index, count) with 0 <= index < count")
    paths = dataset.validate([split]).files(split)
    first = 0  # position of the file's first row group in the split's list
    for path, groups in zip(paths, dataset.split(split)["row_groups"], strict=True):
        mine = [g for g in range(len(groups)) if (first + g) % count == index]
        first += len(groups)
        if not mine:
            continue
        try:
            parquet = integrity.open_parquet(path)
        except FileNotFoundError as error:
            raise FileNotFoundError(f"dataset file is missing: {path}") from error
        except Exception as error:
            raise ValueError(f"cannot read dataset file {path}: {error}. {layout.repair_advice(root)}") from error
        for group in mine:
            table = layout.read_row_group(parquet, path, group, columns, root)  # pages verified
            yield {c: table.column(c).to_numpy() for c in columns}


def read_user_items(
    dataset: layout.DatasetManifest | str | Path, split: str, num_users: int | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """All (user, item) pairs of ``split`` of ``dataset`` (a ``DatasetManifest`` or its directory) as per-user CSR
    arrays, read row group by row group.

    Returns ``(indptr, items)``: ``indptr`` int64 of shape (num_users + 1,), ``items`` int32 of shape
    (rows,); the items of user ``u`` are ``items[indptr[u]:indptr[u+1]]``, sorted ascending (so
    ``np.searchsorted`` tests membership). ``num_users`` defaults to the manifest's. Memory: ~16 bytes per
    row of the split while sorting.
    """
    dataset = layout.as_manifest(dataset)
    num_users = dataset.num_users if num_users is None else int(num_users)
    num_items = dataset.num_items
    keys = []
    for group in iter_row_groups(dataset, split):
        keys.append(group["user_id"].astype(np.int64) * num_items + group["item_id"])
    keys = np.sort(np.concatenate(keys)) if keys else np.empty(0, dtype=np.int64)
    users = keys // num_items
    if len(users) and (users.min() < 0 or users.max() >= num_users):
        raise ValueError(f"split {split!r} of {dataset.root} has user ids outside [0, {num_users})")
    indptr = np.zeros(num_users + 1, dtype=np.int64)
    np.cumsum(np.bincount(users, minlength=num_users), out=indptr[1:])
    return indptr, (keys - users * num_items).astype(np.int32)
