"""Write trained embeddings as an export directory: per-rank Parquet parts, then a checksummed manifest.

The layout of an export is described in ``bigrank.export.format`` (the leaf module holding its names,
checksums and readers).

Every rank writes the rows it owns (no gather of the catalog or the user table through one process); the
part of rank ``r`` is ``part-r{r:05d}.parquet``. Row ``i`` of a table is the dense id ``i`` and the parts
cover ``[0, rows)`` contiguously, so the concatenation of the parts in ``row_start`` order is the table and
a position in a FAISS index built from it is the item id. The score of user ``u`` and item ``i`` is the
inner product ``<users[u], items[i]>``. Each part is written to a temporary name and renamed into place; the
manifest records each part's row range, byte size and sha256, so a truncated or replaced file is detected
when the export is loaded (``bigrank.export.format.load_export``). With a dataset, the export also
carries the users' seen items (``bigrank.export.seen``), so serving needs no training data.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from bigrank import integrity
from bigrank.data import manifest as layout
from bigrank.export.format import (
    EXPORT_FORMAT_VERSION,
    EXPORT_KIND,
    MANIFEST_NAME,
    QUANTIZATIONS,
    SCORE_FUNCTION,
    SEEN_TABLE,
    TABLE_ID_COLUMNS,
    part_file,
    sha256_file,
)
from bigrank.export.index import build_export_index
from bigrank.export.seen import SPLIT_BITS, write_seen_part
from bigrank.runlock import LOCK_FILE

ROW_GROUP_ROWS = 65536
INT8_MAX = 127


def quantize_int8(vectors: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-row symmetric int8 quantisation: ``vectors[r] ≈ scale[r] * q[r]``.

    ``vectors``: float32[n, d]. Returns ``q``: int8[n, d] in ``[-127, 127]`` and ``scale``: float32[n]
    (``max_j |vectors[r, j]| / 127``; 1 for an all-zero row). The error per entry is at most ``scale / 2``.
    """
    vectors = np.asarray(vectors, dtype=np.float32)
    scale = np.abs(vectors).max(axis=1, initial=0.0) / INT8_MAX
    scale = np.where(scale > 0, scale, 1.0).astype(np.float32)
    q = np.clip(np.rint(vectors / scale[:, None]), -INT8_MAX, INT8_MAX).astype(np.int8)
    return q, scale


def embedding_array(vectors: np.ndarray):
    """``pyarrow.FixedSizeListArray`` of the rows of ``vectors`` ([n, d], any numeric dtype), no copy."""
    import pyarrow as pa

    vectors = np.ascontiguousarray(vectors)
    return pa.FixedSizeListArray.from_arrays(pa.array(vectors.reshape(-1)), vectors.shape[1])


def write_part(path: Path, columns: Mapping[str, object]) -> dict:
    """Write one part atomically (temp + ``os.replace``); returns ``{bytes, sha256}`` of the final file.

    ``columns`` maps names to numpy arrays or pyarrow arrays of equal length.
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    names = list(columns)
    arrays = [value if isinstance(value, pa.Array) else pa.array(value) for value in columns.values()]
    table = pa.Table.from_arrays(arrays, names=names)
    tmp = layout.temporary_path(path)
    # Embeddings are incompressible, all-distinct floats: compression and dictionary encoding cost time
    # (dictionary encoding doubled the write time of a 200K x 64 part) and save nothing.
    pq.write_table(
        table,
        tmp,
        row_group_size=ROW_GROUP_ROWS,
        compression="none",
        use_dictionary=False,
        **integrity.PARQUET_WRITE_OPTIONS,  # a CRC-32 per page, verified by every reader
    )
    checksum = sha256_file(tmp)
    size = tmp.stat().st_size
    os.replace(tmp, path)
    return {"bytes": int(size), "sha256": checksum}


def _rows_as_numpy(name: str, rows) -> tuple[int, int, np.ndarray]:
    """Check a ``(row_start, row_stop, tensor[rows, d])`` triple; returns it with a float32 numpy matrix."""
    if not isinstance(rows, tuple | list) or len(rows) != 3:
        raise ValueError(f"{name} must be (row_start, row_stop, tensor[rows, d]), got {type(rows).__name__}")
    start, stop, values = rows
    start, stop = int(start), int(stop)
    if hasattr(values, "detach"):
        values = values.detach().to("cpu").float().contiguous().numpy()
    values = np.ascontiguousarray(values, dtype=np.float32)
    if values.ndim != 2:
        raise ValueError(f"{name}: the embedding rows must be 2-D [rows, d], got shape {values.shape}")
    if not 0 <= start <= stop or values.shape[0] != stop - start:
        raise ValueError(f"{name}: row range [{start}, {stop}) does not match {values.shape[0]} rows")
    if not np.isfinite(values).all():
        raise ValueError(f"{name}: rows [{start}, {stop}) hold NaN or infinite values")
    return start, stop, values


# Columns of users/items.parquet that are not item attributes (the vocabulary's own), and names an attribute
# may not take in an export part or a result row.
VOCABULARY_COLUMNS = ("item_id", "user_id", "original_id", "count", "first_seen")
RESERVED_ATTRIBUTE_NAMES = ("ids", "embedding", "scale", "score", "rank")
# The item attributes an export carries, all columns together (Arrow bytes): servers hold them in memory.
MAX_ATTRIBUTE_BYTES = 256 << 20


def read_id_mapping(dataset: layout.DatasetManifest | None, table: str) -> dict | None:
    """Dense id -> original id (and, for items, the item attributes) of ``table`` ("items" or "users").

    Reads ``<root>/users.parquet`` (``user_id, original_id[, count, first_seen]``) or ``<root>/items.parquet``
    (``item_id, original_id[, count, first_seen]`` and any attribute columns) of an ingested dataset, in any row
    order. Returns None without a dataset or when the dataset has no such file (synthetic datasets), else::

        {"original_id": pyarrow int64 or string array [n] indexed by dense id, "kind": "int64" | "string",
         "attributes": {name: pyarrow array [n]}, "skipped": {name: why it is not carried}}

    Attributes (items only) are the columns other than ``VOCABULARY_COLUMNS`` whose type is a string, an integer,
    a float or a boolean, in the file's order, up to ``MAX_ATTRIBUTE_BYTES`` in all; the others are named in
    ``skipped``. Raises ValueError when the dense ids are not ``0 … n-1``, or the original ids are null, repeated
    or of another type.
    """
    import pyarrow as pa

    from bigrank.export.ids import OriginalIdIndex, as_id_array

    path = None if dataset is None else dataset.side_file(f"{table}.parquet")
    if path is None:
        return None
    id_column = TABLE_ID_COLUMNS[table]
    try:
        data = integrity.read_parquet(path)
    except Exception as error:  # pyarrow raises OSError / ArrowInvalid for a bad page
        advice = layout.repair_advice(dataset.root)
        raise integrity.damaged_parquet("dataset file", path, error, advice) from error
    if id_column not in data.column_names or "original_id" not in data.column_names:
        raise ValueError(f"{path} lacks the columns {id_column!r} and 'original_id'; it has {data.column_names}")
    dense = data.column(id_column).to_numpy()
    order = np.argsort(dense, kind="stable")
    if not np.array_equal(dense[order], np.arange(len(dense))):
        raise ValueError(f"{path}: {id_column} is not a permutation of 0 … {len(dense) - 1}")
    data = data.take(order)
    original = as_id_array(data.column("original_id"), f"original_id of {path}")
    OriginalIdIndex(original)  # refuses repeated ids here, not in every server that loads the export
    mapping = {"original_id": original, "kind": "int64" if pa.types.is_int64(original.type) else "string"}
    mapping["attributes"], mapping["skipped"] = {}, {}
    if table == "items":
        budget = MAX_ATTRIBUTE_BYTES
        for name in data.column_names:
            if name in VOCABULARY_COLUMNS:
                continue
            column, why = _attribute(data.column(name), name)
            if column is not None and column.nbytes > budget:
                column, why = None, f"over the {MAX_ATTRIBUTE_BYTES >> 20} MiB that an export carries of attributes"
            if column is None:
                mapping["skipped"][name] = why
                continue
            budget -= column.nbytes
            mapping["attributes"][name] = column
    return mapping


def _attribute(column, name: str):
    """``(array, None)``: an items.parquet column as an export attribute (strings as ``pa.string()``, numbers and
    booleans as they are, half floats as float32); ``(None, why)`` when it is not carried."""
    import pyarrow as pa

    if name in RESERVED_ATTRIBUTE_NAMES:
        return None, f"{name!r} is a reserved name in exports and replies"
    column = column.combine_chunks() if column.num_chunks else pa.array([], column.type)
    kind = column.type
    if pa.types.is_dictionary(kind):
        column, kind = column.dictionary_decode(), kind.value_type
    if pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_string_view(kind):
        return column.cast(pa.string()), None
    if pa.types.is_float16(kind):
        return column.cast(pa.float32()), None
    if pa.types.is_integer(kind) or pa.types.is_floating(kind) or pa.types.is_boolean(kind):
        return column, None
    return None, f"type {kind} is not carried (strings, integers, floats and booleans are)"


def _dataset_summary(dataset: layout.DatasetManifest | None) -> dict | None:
    if dataset is None:
        return None
    return {
        "root": str(dataset.root.resolve()),
        "source": dataset.source,
        "num_users": dataset.num_users,
        "num_items": dataset.num_items,
        "original_ids": dataset.side_file("items.parquet") is not None,
    }


def _id_summary(mappings: Mapping[str, dict | None]) -> dict:
    """The manifest's ``original_ids`` entry: which tables carry original ids, of which kind, and the item
    attributes carried (name -> Arrow type) and left out (name -> why)."""
    items = mappings.get("items") or {}
    return {
        "users": (mappings.get("users") or {}).get("kind"),
        "items": items.get("kind"),
        "item_attributes": {name: str(column.type) for name, column in items.get("attributes", {}).items()},
        "item_attributes_skipped": dict(items.get("skipped", {})),
    }


def _write_rank_parts(
    out_dir: Path, rank: int, tables: Mapping[str, tuple[int, int, np.ndarray]], dataset, quantize, mappings
) -> dict:
    """Write this rank's parts of every table (and quantised copies); returns their descriptions.

    ``mappings``: ``read_id_mapping`` of "items" and "users" (None without side files): the ``items`` and
    ``users`` parts carry their original ids (and the items their attributes); the history table and the
    quantised copies carry ids and embeddings only."""
    import pyarrow as pa

    written: dict[str, dict] = {}
    for table, (start, stop, values) in tables.items():
        id_column = TABLE_ID_COLUMNS[table]
        base = {id_column: np.arange(start, stop, dtype=np.int32)}
        extra_columns = {}  # original ids and attributes: in the items and users tables only, not their copies
        mapping = mappings.get(table)
        if mapping is not None:
            if stop > len(mapping["original_id"]):
                raise ValueError(
                    f"{table}: rows [{start}, {stop}) exceed the {len(mapping['original_id'])} ids of the dataset "
                    f"{dataset.root}: the model does not match this dataset"
                )
            ids = mapping["original_id"].slice(start, stop - start)
            if pa.types.is_large_string(ids.type) and ids.nbytes < 2**31:  # the export's string type, when it fits
                ids = ids.cast(pa.string())
            extra_columns["original_id"] = ids
            for name, column in mapping["attributes"].items():
                extra_columns[name] = column.slice(start, stop - start)
        copies = {table: {**extra_columns, "embedding": embedding_array(values)}}
        if "float16" in quantize:
            copies[f"{table}_float16"] = {"embedding": embedding_array(values.astype(np.float16))}
        if "int8" in quantize:
            q, scale = quantize_int8(values)
            copies[f"{table}_int8"] = {"embedding": embedding_array(q), "scale": scale}
        for name, extra in copies.items():
            relative = part_file(name, rank)
            info = write_part(out_dir / relative, {**base, **extra})
            written[name] = {"file": relative, "row_start": start, "row_stop": stop, "rows": stop - start, **info}
    return written


def _all_gather(obj, world_size: int, group) -> list:
    if group is None:
        return [obj]
    import torch.distributed as dist

    gathered = [None] * world_size
    dist.all_gather_object(gathered, obj, group=group)
    return gathered


def _raise_failures(statuses: Sequence[dict], what: str) -> None:
    failures = [f"rank {r}: {s['error']}" for r, s in enumerate(statuses) if s.get("error")]
    if failures:
        raise ValueError(f"export failed while {what}: " + "; ".join(failures))


def check_export_dir(out_dir: str | os.PathLike) -> None:
    """ValueError unless ``out_dir`` may be (over)written by an export: absent, empty, a finished export, or
    holding only an export's entries (an export cut short)."""
    if not _is_export_dir(Path(out_dir)):
        raise ValueError(f"{out_dir} is not empty and is not a bigrank export: choose a new or empty --out directory")


def _is_export_dir(out_dir: Path) -> bool:
    """True when ``out_dir`` may be (over)written: absent, empty, a finished export, or only our entries (and
    the lock file of ``bigrank.runlock``, which ``bigrank export`` holds while it writes)."""
    if not out_dir.exists():
        return True
    if not out_dir.is_dir():
        return False
    manifest = out_dir / MANIFEST_NAME
    if manifest.is_file():
        try:
            return json.loads(manifest.read_text()).get("kind") == EXPORT_KIND
        except (json.JSONDecodeError, AttributeError):
            return False
    ours = set(TABLE_ID_COLUMNS) | {f"{t}_{q}" for t in TABLE_ID_COLUMNS for q in QUANTIZATIONS} | {SEEN_TABLE}
    ours.add(LOCK_FILE)
    return all(entry.name in ours or entry.name.startswith(f".{MANIFEST_NAME}.tmp-") for entry in out_dir.iterdir())


def _prepare_directory(out_dir: Path) -> None:
    """Rank 0: mark ``out_dir`` incomplete (drop the manifest) and remove the parts of an earlier export."""
    check_export_dir(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / MANIFEST_NAME).unlink(missing_ok=True)  # first: from here on the directory is incomplete
    for table in TABLE_ID_COLUMNS:
        for name in (table, *(f"{table}_{q}" for q in QUANTIZATIONS)):
            shutil.rmtree(out_dir / name, ignore_errors=True)
    shutil.rmtree(out_dir / SEEN_TABLE, ignore_errors=True)
    layout.remove_stale_temporaries(out_dir)


def _table_entry(name: str, parts: list[dict], dim: int) -> dict:
    """Manifest entry of one table from the parts of all ranks; checks they tile ``[0, rows)``."""
    parts = sorted((p for p in parts if p is not None), key=lambda p: (p["row_start"], p["row_stop"]))
    position = 0
    for part in parts:
        if part["rows"] == 0:
            continue  # a rank that owns no rows of this table wrote an empty part
        if part["row_start"] != position:
            raise ValueError(
                f"table {name!r}: the ranks' rows do not tile the table: {part['file']} starts at row "
                f"{part['row_start']}, expected {position} (overlapping or missing rows)"
            )
        position = part["row_stop"]
    base = name.split("_")[0]
    id_column = "user_id" if base == SEEN_TABLE else TABLE_ID_COLUMNS[base]
    dtype = name.split("_")[1] if "_" in name else "float32"
    return {
        "id_column": id_column,
        "rows": position,
        "dim": dim,
        "dtype": dtype,
        "parts": parts,
    }


def _seen_entry(parts: list[dict], dataset: layout.DatasetManifest | str | Path) -> dict:
    """Manifest entry of the ``seen`` table of ``dataset`` (its manifest or directory): the ranks' user ranges
    must tile ``[0, num_users)``."""
    entry = _table_entry(SEEN_TABLE, parts, dim=0)
    del entry["dim"], entry["dtype"]
    entry["nnz"] = sum(int(part["nnz"]) for part in parts)
    entry["splits"] = [s for s in SPLIT_BITS if s in layout.as_manifest(dataset).splits]
    entry["split_bits"] = dict(SPLIT_BITS)
    return entry


def export_embeddings(
    out_dir,
    *,
    rank: int,
    world_size: int,
    group,
    item_rows,
    user_rows,
    dataset_root=None,
    model_info: dict,
    quantize=(),
    history_rows=None,
    index=(),
    seen: bool = True,
) -> dict | None:
    """Collective export of the embeddings that each rank holds; returns the manifest on rank 0, else None.

    Args:
        out_dir: export directory (new, empty, or an earlier export, which is replaced).
        rank, world_size, group: this process in the ``torch.distributed`` group ``group`` (None: a single
            process, ``rank=0, world_size=1``). Every rank of the group must call this function.
        item_rows: ``(row_start, row_stop, tensor float32[row_stop - row_start, d])``: the catalog rows
            this rank owns (its ``CatalogShard``); the ranks' ranges must tile ``[0, num_items)``.
        user_rows: the same for the user vectors (the rows the model scores items with); a rank may own an
            empty range.
        dataset_root: the training dataset: its ``DatasetManifest`` (read once by the caller) or its directory;
            its ``items.parquet`` / ``users.parquet`` (ingested data) give the original ids (int64 or string)
            and the item attributes written beside the dense ids (``read_id_mapping``).
        model_info: JSON-able description of the model, e.g. ``{"loss", "dim", "run_dir", "has_history"}``.
        quantize: any of ``"float16"``, ``"int8"``: also write quantised copies of every table.
        history_rows: rows of the history table (item-indexed) for models with a history tower; enables
            fold-in of users given as item lists.
        index: FAISS indexes that rank 0 builds after the manifest: ``"exact"``, ``"ivf"``, ``"hnsw"``,
            optionally scalar-quantised as ``"ivf-int8"``, ``"hnsw-float16"`` …
            (``bigrank.export.index.build_export_index``).
        seen: with a ``dataset_root``, also write the table ``seen``: every user's distinct items per split
            (``bigrank.export.seen``), each rank an even share of the users. Serving then excludes seen
            items and builds history-tower user vectors without the dataset.

    Each rank writes its parts atomically; the ranks then exchange the parts' row ranges, sizes and sha256
    checksums (``all_gather_object``; no embedding leaves its rank) and rank 0 writes ``manifest.json``
    last, atomically. A failure on any rank raises ValueError on every rank instead of hanging the others.
    """
    if group is None and (rank != 0 or world_size != 1):
        raise ValueError(f"group=None means a single process, got rank={rank}, world_size={world_size}")
    out_dir = Path(out_dir)
    quantize = tuple(quantize or ())
    unknown = [q for q in quantize if q not in QUANTIZATIONS]
    if unknown:
        raise ValueError(f"unknown quantisation {unknown}; choose from {QUANTIZATIONS}")
    started = time.perf_counter()

    status: dict = {}
    if rank == 0:
        try:
            _prepare_directory(out_dir)
        except (OSError, ValueError) as error:
            status["error"] = str(error)
    _raise_failures(_all_gather(status, world_size, group), "preparing the directory")

    status, dataset = {}, None
    try:
        dataset = None if dataset_root is None else layout.as_manifest(dataset_root)
        tables = {"items": _rows_as_numpy("item_rows", item_rows), "users": _rows_as_numpy("user_rows", user_rows)}
        if history_rows is not None:
            tables["history"] = _rows_as_numpy("history_rows", history_rows)
        dims = {name: rows[2].shape[1] for name, rows in tables.items()}
        if len(set(dims.values())) != 1:
            raise ValueError(f"the tables have different dimensions: {dims}")
        status["dim"] = dims["items"]
        mappings = {name: read_id_mapping(dataset, name) for name in ("items", "users")}
        status["original_ids"] = _id_summary(mappings)
        status["parts"] = _write_rank_parts(out_dir, rank, tables, dataset, quantize, mappings)
        del mappings  # the seen table below reads the whole dataset: free the ids and attributes first
        if seen and dataset is not None:
            num_users = dataset.num_users
            share = (rank * num_users // world_size, (rank + 1) * num_users // world_size)
            status["parts"][SEEN_TABLE] = write_seen_part(out_dir, rank, dataset, *share)
    except (OSError, ValueError) as error:
        status = {"error": str(error)}
    statuses = _all_gather(status, world_size, group)
    _raise_failures(statuses, "writing the parts")

    manifest = None
    status = {}
    if rank == 0:
        try:
            manifest = _write_manifest(out_dir, statuses, dataset, model_info, quantize, started)
            if index:
                for name in index:
                    build_export_index(out_dir, name)
                manifest = json.loads((out_dir / MANIFEST_NAME).read_text())
        except (OSError, ValueError, RuntimeError) as error:
            status["error"] = str(error)
    # Every rank returns only once the export is complete (or has failed everywhere).
    _raise_failures(_all_gather(status, world_size, group), "writing the manifest")
    return manifest


def _user_vector_rule(has_history: bool, model_info: Mapping) -> str:
    """How a known user's score-time vector follows from the export (recorded as ``user_vector``).

    ``"table"``: the ``users`` rows are the vectors. ``"table+history_mean"`` (history-tower models, unless
    ``model_info["user_vectors"] == "full"`` says the rows already include the history term): the tower's
    ``f(u) = E_user[u] + mean_{i in H(u)} E_hist[i]`` over the user's train items ``H(u)`` in the dataset.
    """
    if has_history and model_info.get("user_vectors") != "full":
        return "table+history_mean"
    return "table"


def _write_manifest(
    out_dir: Path, statuses, dataset: layout.DatasetManifest | None, model_info, quantize, started: float
) -> dict:
    dims = {s["dim"] for s in statuses}
    if len(dims) != 1:
        raise ValueError(f"the ranks hold embeddings of different dimensions: {sorted(dims)}")
    (dim,) = dims
    if model_info.get("dim") is not None and int(model_info["dim"]) != dim:
        raise ValueError(f"model_info says dim={model_info['dim']} but the embeddings have d={dim}")
    names = [name for name in statuses[0]["parts"] if name != SEEN_TABLE]
    tables = {name: _table_entry(name, [s["parts"].get(name) for s in statuses], dim) for name in names}
    if SEEN_TABLE in statuses[0]["parts"]:
        tables[SEEN_TABLE] = _seen_entry([s["parts"][SEEN_TABLE] for s in statuses], dataset)
    if dataset is not None:
        for name, expected in (("items", dataset.num_items), ("users", dataset.num_users)):
            if tables[name]["rows"] != expected:
                raise ValueError(
                    f"the export has {tables[name]['rows']} {name} but the dataset {dataset.root} has {expected}"
                )
    manifest = {
        "kind": EXPORT_KIND,
        "format_version": EXPORT_FORMAT_VERSION,
        "score": SCORE_FUNCTION,
        "dim": dim,
        "num_items": tables["items"]["rows"],
        "num_users": tables["users"]["rows"],
        "has_history": "history" in tables,
        "user_vector": _user_vector_rule("history" in tables, model_info),
        # How a user given by items is folded in from the history rows: their mean (the history tower's pooling)
        # or their sum / sqrt(count) (a model kind whose user vector is |x|^-1/2 times the sum: its export rows say).
        "fold_in": model_info.get("fold_in", "mean"),
        "quantized": list(quantize),
        "quantization": {"int8": "per-row symmetric: embedding ≈ scale * q"} if "int8" in quantize else {},
        "model": json.loads(json.dumps(dict(model_info), default=str)),
        "dataset": _dataset_summary(dataset),
        # Original ids: "int64" / "string" per table, or null where the export has none (synthetic data).
        "original_ids": statuses[0]["original_ids"],
        "world_size": len(statuses),
        "tables": tables,
        "indexes": {},
        "created_unix": time.time(),
        "export_seconds": round(time.perf_counter() - started, 3),
    }
    layout.write_json_atomic(out_dir / MANIFEST_NAME, manifest)
    return manifest
