"""The cluster engine of ``bigrank ingest --address ADDR [--buckets B]``: Ray tasks read, Ray actors each run one
DuckDB over a bucket of users; the driver (``bigrank.data.ingest.pipeline``) runs the same steps as on one machine.

Read. The input is cut into one group per cluster CPU, balanced by bytes, and each group is read by a Ray task
(1 CPU, spread over the nodes). A Parquet file larger than a CPU's share of the input is cut at row-group bounds
into ranges of about that share (:func:`read_units`), so one 1B-row file is read by every CPU, not by one; a text
file (CSV, JSON Lines: a compressed one cannot be cut) is read whole by one task. DuckDB scans a task's files and
ranges one at a time (``Source.subset``, ``Columns.rows_sql``, a range by ``file_row_number``, whose filter DuckDB
answers from the row groups it needs only: the rows as ``u, i, t, v, bad``, exactly as one machine loads them),
each row goes to bucket ``bucket_of(xxh64(user id), B)`` (``bigrank.data.ingest.hashing``; a null user to
bucket 0, where it is only counted and dropped), and the task writes one Parquet piece per bucket under the
ingest's work directory (``OUT/.ingest/pieces/task-T/bucket-B.parquet``).

Buckets. Bucket ``b`` is an actor (:class:`StoreActor`, no CPU reserved: it runs between the read tasks) holding a
:class:`~bigrank.data.ingest.store.RowStore` in ``OUT/.ingest/store-b``, which loads its pieces
(``RowStore.load_rows``) and then answers the driver's ``map``/``map_each`` calls. Buckets are contiguous ranges
of user hashes, so bucket ``b``'s users, ranked inside it and offset by the users of the buckets before it, get
the ids one machine gives them; the reductions across buckets (item codes and counts, the random split's cut
points) are the driver's, each bucket's sparse answer folded in as it arrives (``RayEngine.fold``), and what it
hands back to every store (the item vocabulary, ~1M rows) goes into Ray's object store once, as Arrow. Same
input and options: the same dataset as one machine, ids, splits and rows.

Placement. The buckets are dealt to the nodes in proportion to their CPUs (hard node affinity); a node's stores share
its ``--memory-limit`` (default half of the node's memory, or of its pod's cgroup limit) and its CPUs
(``--threads``: DuckDB threads per store, default the node's CPUs over its stores). ``--buckets`` defaults to the
cluster's CPUs: the stores' own Python work (xxh64 of every id, the ranks) runs one thread per store, so one store
per CPU keeps every core busy, while more would only add processes, per-store overhead and pieces (tasks x buckets
files).

Storage. The inputs and ``--out`` (so the pieces, the stores' databases and spill files under ``OUT/.ingest``, and
the parts the stores write) must be at the same path on every node: NFS or another shared volume. A node that
cannot see them fails with an error saying so.

Stops and errors. ``interrupt()`` (called from the main thread's signal handler while the driver's steps run in
another thread, ``bigrank.data.ingest._Steps``) cancels the read tasks and kills the actors, so the
driver's wait ends at once; ``close()`` waits until they are gone, then the ingest deletes what was written. A
task's error reaches the user as the one line the local engine gives (a CommandError naming the file), not a
Ray traceback; a lost node or killed worker is an error saying to run the command again.
"""

from __future__ import annotations

import copy
import os
import shutil
import threading
import time
from pathlib import Path

import numpy as np

from bigrank.data.ingest.hashing import bucket_of, id_hashes
from bigrank.data.ingest.options import IngestOptions
from bigrank.data.ingest.pipeline import BATCH_ROWS, Interrupted, SideConnections
from bigrank.data.ingest.sources import duckdb_error, file_list
from bigrank.data.ingest.store import Columns, RowStore
from bigrank.errors import CommandError

__all__ = [
    "RayEngine",
    "StoreActor",
    "default_buckets",
    "file_groups",
    "piece_path",
    "place",
    "read_into_buckets",
    "read_units",
]

PIECES_DIR = "pieces"
# Rows a read task gathers for one bucket before writing them as a row group: PIECE_ROWS, or fewer with many
# buckets, so that what a task holds for all its buckets stays near PENDING_ROWS rows (~50 bytes each).
PIECE_ROWS = 1 << 16
PENDING_ROWS = 1 << 21
# Seconds between two looks at the stop flag while the driver waits on Ray.
POLL_SECONDS = 0.2
# Seconds close() waits for killed actors and cancelled tasks to be gone before the ingest deletes their files.
CLOSE_SECONDS = 60.0
SHARED_STORAGE = "the inputs and --out must be at the same path on every node of the cluster (NFS, a shared volume)"


def default_buckets(node_cpus: dict[str, int]) -> int:
    """``--buckets`` when not given: the cluster's CPUs (the module docstring says why), at least 1."""
    return max(1, int(sum(node_cpus.values())))


def place(node_cpus: dict[str, int], buckets: int) -> list[str]:
    """The node of each bucket: the nodes dealt round-robin, each as many times in a round as it has CPUs left, so
    that ``B`` buckets land in proportion to the nodes' CPUs (the cluster's CPUs buckets: one per CPU)."""
    nodes = sorted(node_cpus, key=lambda node: (-node_cpus[node], node))
    slots = [node for k in range(max(node_cpus.values())) for node in nodes if node_cpus[node] > k]
    return [slots[b % len(slots)] for b in range(buckets)]


def file_groups(files, sizes, groups: int) -> list[list]:
    """``files`` (paths, or the ranges of :func:`read_units`) cut into at most ``groups`` non-empty groups of about
    equal bytes (largest first onto the lightest group), each in input order."""
    groups = max(1, min(int(groups), len(files)))
    loads = [0] * groups
    members: list[list[int]] = [[] for _ in range(groups)]
    for index in sorted(range(len(files)), key=lambda k: (-sizes[k], k)):
        lightest = min(range(groups), key=lambda g: (loads[g], g))
        loads[lightest] += sizes[index]
        members[lightest].append(index)
    return [[_unit(files[k]) for k in sorted(group)] for group in members if group]


def _unit(unit):
    return tuple(unit) if isinstance(unit, tuple | list) else str(unit)


def read_units(files, fmt: str, cpus: int) -> tuple[list, list[int]]:
    """What the read tasks share out: ``(units, bytes of each)``. A unit is a file (its path), or a range of a
    Parquet file's rows ``(path, first row, end row)``: a Parquet file of more than a CPU's share of the input
    (all bytes / ``cpus``) with several row groups is cut at row-group bounds into ranges of about that share. Text
    files stay whole."""
    sizes = [os.path.getsize(f) for f in files]
    share = max(1, sum(sizes) // max(1, int(cpus)))
    if fmt != "parquet":
        return [str(f) for f in files], sizes
    import pyarrow.parquet as pq

    units, unit_sizes = [], []
    for file, size in zip(files, sizes, strict=True):
        metadata = pq.ParquetFile(file).metadata if size > share else None
        if metadata is None or metadata.num_row_groups < 2:
            units.append(str(file))
            unit_sizes.append(size)
            continue
        groups = [metadata.row_group(g) for g in range(metadata.num_row_groups)]
        rows = np.cumsum([0] + [group.num_rows for group in groups])
        taken = np.cumsum([0] + [sum(g.column(c).total_compressed_size for c in range(g.num_columns)) for g in groups])
        parts = max(1, min(len(groups), round(size / share)))  # ranges of about a share each
        # A row group goes to the range its middle byte falls in; the ranges are the runs of one range's groups.
        middle = (taken[:-1] + taken[1:]) / 2
        part = np.minimum(parts - 1, (middle * parts // max(1, taken[-1])).astype(np.int64))
        bounds = np.concatenate([[0], np.flatnonzero(np.diff(part)) + 1, [len(groups)]])
        for first, end in zip(bounds[:-1], bounds[1:], strict=True):
            units.append((str(file), int(rows[first]), int(rows[end])))
            unit_sizes.append(int(taken[end] - taken[first]))
    return units, unit_sizes


def piece_path(work: Path, task: int, bucket: int) -> Path:
    """Where read task ``task`` writes its rows of ``bucket``."""
    return Path(work) / PIECES_DIR / f"task-{task:05d}" / f"bucket-{bucket:05d}.parquet"


def read_into_buckets(columns: Columns, files: list, buckets: int, work: str, task: int, memory_bytes: int):
    """Read ``files`` (paths, or ``(path, first row, end row)`` ranges of Parquet files: :func:`read_units`; one
    DuckDB scan each, in order) as ``u, i, t, v, bad`` and write every row to the piece of its user's bucket
    (:func:`piece_path`; a piece for every bucket, empty ones too, so each store reads ``tasks`` pieces). Returns
    ``{"rows", "seconds", "node"}``. CommandError naming the file that cannot be read.

    The body of the cluster engine's read tasks (also callable here, without Ray)."""
    import duckdb
    import pyarrow as pa
    import pyarrow.parquet as pq

    started = time.monotonic()
    con = duckdb.connect(
        config={"threads": 1, "memory_limit": f"{max(memory_bytes >> 20, 256)}MiB", "preserve_insertion_order": False}
    )
    # The store's setting: ISO-8601 times without an offset are UTC whatever the node's zone.
    con.execute("SET TimeZone = 'UTC'").fetchall()
    con.execute("SET enable_progress_bar = false").fetchall()
    writers: dict[int, pq.ParquetWriter] = {}
    pending: list[list] = [[] for _ in range(buckets)]
    pending_rows = np.zeros(buckets, dtype=np.int64)
    flush_rows = max(1024, min(PIECE_ROWS, PENDING_ROWS // buckets))
    schema = None
    rows = 0

    def flush(bucket: int) -> None:
        if not pending[bucket]:
            return
        if bucket not in writers:
            path = piece_path(Path(work), task, bucket)
            path.parent.mkdir(parents=True, exist_ok=True)
            writers[bucket] = pq.ParquetWriter(path, schema)
        writers[bucket].write_table(pa.concat_tables(pending[bucket]))
        pending[bucket], pending_rows[bucket] = [], 0

    try:
        for unit in files:
            file, rows_sql = _scan_of(columns, unit)
            if not os.path.exists(file):
                raise CommandError(f"{file} is not there on Ray node {_node_address()}: {SHARED_STORAGE}")
            try:
                reader = con.sql(rows_sql).to_arrow_reader(BATCH_ROWS)
                schema = schema or reader.schema
                for batch in reader:
                    rows += batch.num_rows
                    users = batch.column(0)
                    bucket = np.zeros(batch.num_rows, dtype=np.int64)
                    known = users.is_valid()
                    mask = known.to_numpy(zero_copy_only=False)
                    if mask.any():
                        bucket[mask] = bucket_of(id_hashes(users.filter(known)), buckets)
                    order = np.argsort(bucket, kind="stable")
                    bounds = np.searchsorted(bucket[order], np.arange(buckets + 1))
                    table = pa.Table.from_batches([batch], schema=schema).take(pa.array(order))
                    for b in np.flatnonzero(np.diff(bounds)):
                        pending[b].append(table.slice(bounds[b], bounds[b + 1] - bounds[b]))
                        pending_rows[b] += bounds[b + 1] - bounds[b]
                        if pending_rows[b] >= flush_rows:
                            flush(int(b))
            except (duckdb.Error, pa.ArrowException) as error:
                raise CommandError(f"cannot read {file}: {duckdb_error(error)}") from None
        for b in range(buckets):
            flush(b)
        for b in range(buckets):
            if b not in writers:  # an empty piece, so that a store's scan has its schema even without rows
                path = piece_path(Path(work), task, b)
                path.parent.mkdir(parents=True, exist_ok=True)
                pq.write_table(schema.empty_table(), path)
    finally:
        for writer in writers.values():
            writer.close()
        con.close()
    return {"rows": rows, "seconds": time.monotonic() - started, "node": _node_id()}


def _file_of(unit) -> str:
    """The file of a read unit (:func:`read_units`)."""
    return unit[0] if isinstance(unit, tuple | list) else unit


def _scan_of(columns: Columns, unit) -> tuple[str, str]:
    """``(file, the query of its rows as u, i, t, v, bad)`` of a read unit: a whole file, or a range of rows."""
    file = _file_of(unit)
    if isinstance(unit, tuple | list):
        scan = columns.source.subset([file]).scan(row_number=True)
        return file, columns.rows_sql(scan, f"file_row_number >= {int(unit[1])} AND file_row_number < {int(unit[2])}")
    return file, columns.rows_sql(columns.source.subset([file]).scan())


def _node_id() -> str | None:
    import ray

    return ray.get_runtime_context().get_node_id() if ray.is_initialized() else None


def _node_address() -> str:
    import ray

    try:
        return ray.util.get_node_ip_address()
    except Exception:  # noqa: BLE001 - only names the node in an error
        return "?"


class StoreActor:
    """One bucket's :class:`RowStore` in a Ray actor. Its share of the node: ``memory_limit`` over the
    ``stores_on_node`` (the limit, or half the memory, as this node reads it), and ``threads`` DuckDB threads.
    It works in the driver's directory ``cwd``, so that a relative ``--out`` names the same (shared) place."""

    def __init__(self, directory: str, options: IngestOptions, stores_on_node: int, threads: int, cwd: str):
        os.chdir(cwd)
        memory = options.memory_plan()  # this node's: its memory, or its pod's cgroup limit
        self.plan = (
            f"{memory.amount / max(1, stores_on_node) / 2**30:.1f} GB a store ({memory.source}, over "
            f"{stores_on_node} store(s)), {threads} thread(s)"
        )
        self.store = RowStore(directory, int(memory.amount) // max(1, stores_on_node), threads)

    def node(self) -> str:
        """The Ray node this store runs on."""
        return _node_id()

    def limits(self) -> str:
        """This store's memory limit and threads, and where the limit comes from."""
        return self.plan

    def load_pieces(self, pieces: list[str], has_time: bool, has_value: bool) -> dict:
        """Load the bucket's pieces (``RowStore.load_rows``); CommandError when this node cannot see one."""
        missing = [piece for piece in pieces if not os.path.exists(piece)]
        if missing:
            raise CommandError(f"{missing[0]} is not there on Ray node {_node_address()}: {SHARED_STORAGE}")
        scan = f"read_parquet({file_list(pieces)})"
        return self.store.load_rows(scan, has_time, has_value)

    def call(self, method: str, *args):
        """``store.method(*args)``."""
        return getattr(self.store, method)(*args)

    def close(self) -> None:
        """Close the database (before the actor is killed: its files are then complete)."""
        self.store.close()


class RayEngine:
    """The stores as Ray actors, one per bucket of users (the module docstring); joins the cluster at
    ``options.address`` (``local``: an embedded Ray runtime on this machine) unless Ray is initialised already in
    this process, which it then uses and leaves running. ``say`` prints progress lines."""

    def __init__(self, work: Path, options: IngestOptions, say=None):
        import ray

        self.work = Path(work).absolute()
        self.options = options
        self.say = say or (lambda line: None)
        self.name = "ray"
        self.stopped = False
        self.side = SideConnections()  # the driver's own DuckDB connections (an items file, a row to locate)
        self.actors: list = []
        self.tasks: list = []
        self._lock = threading.RLock()
        self._closed = False
        self.owns_ray = _connect(options.address)
        self.node_cpus = {
            node["NodeID"]: int(node["Resources"].get("CPU", 0))
            for node in ray.nodes()
            if node["Alive"] and node["Resources"].get("CPU", 0) >= 1
        }
        if not self.node_cpus:
            self.close()
            raise CommandError(f"the Ray cluster at {options.address} has no node with a CPU")
        self.buckets = int(options.buckets or default_buckets(self.node_cpus))
        self.say(
            f"Ray cluster at {options.address}: {len(self.node_cpus)} node(s), {sum(self.node_cpus.values())} CPUs; "
            f"{self.buckets} bucket(s) of users, one DuckDB each"
            + ("" if options.buckets else " (--buckets: default one per CPU)")
        )

    # ------------------------------------------------------------------------------------------------ steps
    def load(self, source, columns: Columns) -> list[dict]:
        """Read the files in Ray tasks into per-bucket pieces, then load each bucket's pieces into its store."""
        import ray

        if self.stopped:
            raise Interrupted("stopped")
        started = time.monotonic()
        cpus = sum(self.node_cpus.values())
        units, sizes = read_units(source.files, source.format, cpus)
        groups = file_groups(units, sizes, cpus)
        read = ray.remote(read_into_buckets).options(num_cpus=1, scheduling_strategy="SPREAD")
        memory = self.options.memory_bytes() // max(1, min(self.node_cpus.values()))
        tasks = [
            read.remote(_on_files(columns, group), group, self.buckets, str(self.work), task, memory)
            for task, group in enumerate(groups)
        ]
        self._track(tasks=tasks)
        placed = self._start_stores()  # the actors start while the files are read
        done = self._gather(tasks, "read task")
        rows = sum(d["rows"] for d in done)
        nodes = len({d["node"] for d in done})
        ranges = sum(isinstance(unit, tuple) for unit in units)
        cut = f" (large Parquet files cut into {ranges} ranges of row groups)" if ranges else ""
        self.say(
            f"read tasks done: {rows:,} rows from {len(source.files)} file(s){cut} in {len(groups)} task(s) on "
            f"{nodes} node(s), {time.monotonic() - started:.1f}s"
        )
        nodes = self._gather(placed, "start")
        self.say(f"{len(self.actors)} store(s) on {len(set(nodes))} node(s)")
        limits = self._gather([actor.limits.remote() for actor in self.actors], "start")
        for plan in sorted(set(limits)):
            self.say(f"  {limits.count(plan)} store(s): {plan}")
        has_time, has_value = columns.time is not None, columns.value is not None
        loaded = self._gather(
            [
                actor.load_pieces.remote(
                    [str(piece_path(self.work, t, b)) for t in range(len(groups))], has_time, has_value
                )
                for b, actor in enumerate(self.actors)
            ],
            "load",
        )
        shutil.rmtree(self.work / PIECES_DIR, ignore_errors=True)  # every store holds its rows now
        return loaded

    def map(self, method: str, *args) -> list:
        """``store.method(*args)`` of every store, in bucket order (large arguments sent once)."""
        return self.map_each(method, [args] * len(self.actors))

    def map_each(self, method: str, args: list[tuple]) -> list:
        """``store_k.method(*args[k])`` of every store k, in bucket order; an argument object given to several
        stores (an Arrow table, a numpy array) goes into Ray's object store once."""
        import ray

        if self.stopped:
            raise Interrupted("stopped")
        shared: dict[int, object] = {}

        def sent(value):
            if not _is_bulk(value):
                return value
            if id(value) not in shared:
                shared[id(value)] = ray.put(value)
            return shared[id(value)]

        calls = [
            actor.call.remote(method, *(sent(a) for a in given)) for actor, given in zip(self.actors, args, strict=True)
        ]
        return self._gather(calls, method)

    def fold(self, method: str, add, *args) -> None:
        """``add(store.method(*args))`` for every store, as each result arrives (in any order): the driver holds
        one store's result at a time, not every store's (per-item counts of 512 buckets x 10M items would be 41
        GB)."""
        import ray

        if self.stopped:
            raise Interrupted("stopped")
        shared = [ray.put(a) if _is_bulk(a) else a for a in args]
        self._gather([actor.call.remote(method, *shared) for actor in self.actors], method, each=add)

    # ------------------------------------------------------------------------------------------- the actors
    def _start_stores(self) -> list:
        """Start one actor per bucket on its node (:func:`place`); returns the refs of their nodes, once started."""
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        nodes = place(self.node_cpus, self.buckets)
        per_node = {node: nodes.count(node) for node in set(nodes)}
        actor = ray.remote(StoreActor)
        actors = []
        for b, node in enumerate(nodes):
            threads = self.options.threads or max(1, self.node_cpus[node] // per_node[node])
            actors.append(
                actor.options(
                    num_cpus=0,  # the read tasks hold the CPUs first; then the stores run one step at a time
                    max_restarts=0,  # a store restarted empty would give a wrong dataset: fail instead
                    # Hard: a soft affinity lets Ray put a store elsewhere while a node is busy starting workers,
                    # and the node's share of memory and CPUs no longer holds. A node gone fails the ingest.
                    scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False),
                ).remote(str(self.work / f"store-{b:05d}"), self.options, per_node[node], threads, os.getcwd())
            )
        self._track(actors=actors)
        return [a.node.remote() for a in actors]

    def _track(self, tasks=None, actors=None) -> None:
        with self._lock:
            self.tasks.extend(tasks or [])
            self.actors.extend(actors or [])
        if self.stopped:  # a signal came while they were being started
            self.interrupt()

    def _gather(self, refs: list, what: str, each=None) -> list:
        """The results of ``refs`` in order (or, with ``each``, ``each(result)`` as each arrives, and nothing kept),
        waiting in short slices so that a stop ends the wait at once; the first failure (in the order they happen)
        is raised as :meth:`_failure` says."""
        import ray

        results = {}
        waiting = list(refs)
        if each is not None:
            refs.clear()  # the caller's list too: a result's ref goes once it is folded, and Ray frees the object
        while waiting:
            if self.stopped:
                raise Interrupted("stopped")
            ready, waiting = ray.wait(waiting, num_returns=len(waiting), timeout=POLL_SECONDS)
            for ref in ready:
                try:
                    result = ray.get(ref)
                except Exception as error:  # noqa: BLE001 - sorted by _failure
                    self._failure(error, what)
                if each is None:
                    results[ref] = result
                else:
                    each(result)
            ready = ref = result = None  # no reference kept to a folded result
        return [results[ref] for ref in refs] if each is None else []

    def _failure(self, error: Exception, what: str):
        """Raise what the user sees of a failed task or actor call: Interrupted after a stop; a CommandError's own
        line; a DuckDB error as the one line the local engine gives; a dead worker as an error saying what
        happened; anything else (a bug) with Ray's traceback."""
        import duckdb
        from ray import exceptions

        if self.stopped:
            raise Interrupted("stopped") from None
        if isinstance(error, exceptions.RayTaskError):
            cause = error.cause
            if isinstance(cause, CommandError):
                raise cause.with_traceback(None) from None
            if isinstance(cause, duckdb.Error):
                raise CommandError(f"the ingest's {what} step failed on a Ray node: {duckdb_error(cause)}") from None
            raise error
        lost = (
            exceptions.RayActorError,
            exceptions.WorkerCrashedError,
            exceptions.ObjectLostError,
            exceptions.ActorUnschedulableError,
        )
        if isinstance(error, lost):
            first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            raise CommandError(
                f"a Ray worker of the ingest died or could not start during its {what} step "
                f"({type(error).__name__}: {first}); its node may have run out of memory or left the cluster: "
                "run the same command again"
            ) from None
        raise error

    # ------------------------------------------------------------------------------------------- stop, close
    def interrupt(self) -> None:
        """Stop (from the main thread's signal handler): the read tasks are cancelled and the actors killed, so the
        driver's wait ends now; :meth:`close` waits until they are gone."""
        import ray

        self.stopped = True
        self.side.interrupt()
        with self._lock:
            tasks, actors = list(self.tasks), list(self.actors)
        for ref in tasks:
            try:
                ray.cancel(ref, force=True)
            except Exception:  # noqa: BLE001 - a task that has finished cannot be cancelled
                pass
        for actor in actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass

    def close(self) -> None:
        """End the stores (their databases closed first after a normal run), wait until every actor and task is
        gone, and shut down the Ray runtime this engine started or joined."""
        import ray

        if self._closed:
            return
        self._closed = True
        try:
            if self.actors and not self.stopped:
                try:
                    ray.get([actor.close.remote() for actor in self.actors], timeout=CLOSE_SECONDS)
                except Exception:  # noqa: BLE001 - a store that failed is killed below all the same
                    pass
            self.interrupt()
            # Gone before the ingest deletes their directories: a dead actor's calls fail, a cancelled task resolves.
            probes = [actor.node.remote() for actor in self.actors]
            ray.wait(probes + self.tasks, num_returns=len(probes) + len(self.tasks), timeout=CLOSE_SECONDS)
            for ref in probes + self.tasks:  # their errors are expected: taken here, Ray does not print them
                try:
                    ray.get(ref, timeout=0)
                except Exception:  # noqa: BLE001
                    pass
        finally:
            self.actors, self.tasks = [], []
            if self.owns_ray:
                ray.shutdown()


def _on_files(columns: Columns, units: list) -> Columns:
    """``columns`` over the files of ``units`` only: a read task is not sent the list of every input file."""
    narrowed = copy.copy(columns)
    narrowed.source = columns.source.subset(dict.fromkeys(_file_of(unit) for unit in units))
    return narrowed


def _is_bulk(value) -> bool:
    import pyarrow as pa

    return isinstance(value, np.ndarray | pa.Table | pa.Array | pa.ChunkedArray | pa.RecordBatch)


def _connect(address: str) -> bool:
    """Join the cluster at ``address`` as training does (``bigrank.ray_runtime.start_ray``: a token from
    ``~/.ray/auth_token`` or ``RAY_AUTH_TOKEN`` when the cluster wants one), or start an embedded runtime on
    loopback for ``local``; returns whether this call did (the engine then shuts it down)."""
    import ray

    from bigrank.ray_runtime import start_ray

    if ray.is_initialized():
        return False
    return start_ray(None if address == "local" else address)
