"""The export format: names, checksums and readers shared by the writer, the indexes and the servers.

This module is the leaf of ``bigrank.export``: it imports no other module of the package, so the writer
(``writer``), the indexes (``index``), the seen-items file (``seen``) and the servers (``recommend``,
``serve``, ``ray_serve``) all import from it and never from each other in a cycle.

Layout of an export ``DIR`` (see ``bigrank.export.writer`` for how it is written)::

    DIR/manifest.json                          written last: its presence means the export is complete
    DIR/items/part-rNNNNN.parquet              item_id: int32, [original_id: int64 or string, attributes …],
                                               embedding: fixed_size_list<float32>[d]
    DIR/users/part-rNNNNN.parquet              user_id: int32, [original_id: int64 or string], embedding
    DIR/history/part-rNNNNN.parquet            (models with a history tower) the history table, item-indexed
    DIR/<table>_float16/…, DIR/<table>_int8/…  optional quantised copies (int8 adds ``scale: float32``); ids and
                                               embeddings only
    DIR/seen/part-rNNNNN.parquet               per-user seen items (``bigrank.export.seen``), CSR-like
    DIR/items/index-<name>.faiss               optional FAISS indexes (``bigrank.export.index``)

Original ids and attributes (exports of ingested data; ``bigrank.export.writer.read_id_mapping``): the
``items`` and ``users`` parts carry ``original_id`` in the dataset's type (int64 or string), and the items parts
the item attributes of the dataset's ``items.parquet`` (string, integer, float and boolean columns, up to
``writer.MAX_ATTRIBUTE_BYTES`` in all). The manifest's ``original_ids`` says which: ``{"users": "string",
"items": "int64", "item_attributes": {"title": "string", …}, "item_attributes_skipped": {name: why}}`` (``users``
/ ``items`` null without original ids). Exports written before it have no such entry, int64 ``original_id`` and
an optional ``title``; they read the same way.

Integrity (``bigrank.integrity``): the manifest records every part's and index's byte size and sha256; Parquet
parts carry page checksums, verified whenever they are read. ``load_export`` checks sizes always and the
sha256 checksums by default (servers; ``--no-verify`` skips them), raising on the first damaged file;
``verify_export`` (``bigrank verify DIR``) checks them all and reports every damaged file.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np

from bigrank import integrity

EXPORT_KIND = "bigrank-embeddings"
EXPORT_FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
SCORE_FUNCTION = "inner_product"
QUANTIZATIONS = ("float16", "int8")
TABLE_ID_COLUMNS = {"items": "item_id", "users": "user_id", "history": "item_id"}
SEEN_TABLE = "seen"
INDEX_KINDS = ("exact", "ivf", "hnsw")
INDEX_QUANTIZATIONS = ("float32", *QUANTIZATIONS)


def part_file(table: str, rank: int) -> str:
    """Relative path of the part of ``rank`` in ``table``: ``<table>/part-r{rank:05d}.parquet``."""
    return f"{table}/part-r{rank:05d}.parquet"


def index_name(kind: str, quantize: str | None = None) -> str:
    """Manifest key of an index: ``"ivf"`` (float32 vectors) or ``"ivf-int8"`` / ``"hnsw-float16"`` …

    ``quantize``: None or ``"float32"`` (full precision), ``"float16"`` or ``"int8"`` (FAISS scalar quantiser).
    """
    if kind not in INDEX_KINDS:
        raise ValueError(f"unknown index kind {kind!r}; choose one of {INDEX_KINDS}")
    quantize = quantize or "float32"
    if quantize not in INDEX_QUANTIZATIONS:
        raise ValueError(f"unknown index quantisation {quantize!r}; choose one of {INDEX_QUANTIZATIONS}")
    return kind if quantize == "float32" else f"{kind}-{quantize}"


def parse_index_name(name: str) -> tuple[str, str]:
    """``"ivf-int8"`` -> ``("ivf", "int8")``, ``"exact"`` -> ``("exact", "float32")``; ValueError otherwise."""
    kind, _, quantize = str(name).partition("-")
    index_name(kind, quantize or None)  # validates both halves
    return kind, quantize or "float32"


def index_file(name: str) -> str:
    """Relative path of the index ``name`` (``index_name``) in an export: ``items/index-<name>.faiss``."""
    parse_index_name(name)
    return f"items/index-{name}.faiss"


def sha256_file(path: str | Path, block_bytes: int = 1 << 22) -> str:
    """Hex sha256 of the file at ``path`` (read in blocks of ``block_bytes``)."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(block_bytes):
            digest.update(block)
    return digest.hexdigest()


def repair_advice(export_dir: str | Path, verify_hint: bool = True) -> str:
    """What to do about a damaged export file (ends every corruption error of an export); ``verify_hint``: also
    name the command that lists every damaged file."""
    advice = f"The export is damaged: run `bigrank export` again into {export_dir} (or restore it from a copy)"
    return advice + (f"; `bigrank verify {export_dir}` lists every damaged file." if verify_hint else ".")


def export_id(manifest: dict) -> str:
    """A short fingerprint of an export: the first 16 hex digits of the sha256 of its manifest (as canonical JSON),
    which records every file's sha256, so two exports share it only when they hold the same bytes. The servers
    report it (``/health``) so that a client sees which export answers, before and after a swap."""
    canonical = json.dumps(manifest, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


def read_export_manifest(export_dir: str | Path) -> dict:
    """``<export_dir>/manifest.json``, checked to be a bigrank export of this format (no file is checked).

    Raises FileNotFoundError for a missing directory or manifest, ValueError for another kind or version.
    """
    export_dir = Path(export_dir)
    if not export_dir.is_dir():
        raise FileNotFoundError(f"export directory does not exist: {export_dir}")
    path = export_dir / MANIFEST_NAME
    if not path.is_file():
        raise FileNotFoundError(
            f"no {MANIFEST_NAME} in {export_dir}: not a bigrank export, or the export did not finish (run it again)"
        )
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{path} is not valid JSON: {error}") from error
    if not isinstance(manifest, dict) or manifest.get("kind") != EXPORT_KIND:
        raise ValueError(f"{path} is not the manifest of a bigrank embeddings export")
    if manifest.get("format_version") != EXPORT_FORMAT_VERSION:
        raise ValueError(f"{path} has format_version {manifest.get('format_version')}; this bigrank reads 1")
    return manifest


def file_problems(export_dir: str | Path, manifest: dict, verify: bool):
    """Yield ``(relative path, error)`` for every part and index file of ``manifest`` that is damaged.

    ``error`` is the FileNotFoundError (missing) or ValueError (size, sha256 or row count differs) that names
    the file. Sizes are checked always; ``verify=True`` also each file's sha256 and each part's row count.
    """
    export_dir = Path(export_dir)
    for name, table in manifest["tables"].items():
        for part in table["parts"]:
            try:
                _check_file(export_dir / part["file"], part, verify, f"part of table {name!r}")
                if verify:
                    _check_rows(export_dir / part["file"], part["rows"])
            except (OSError, ValueError) as error:
                yield part["file"], error
    for name, entry in manifest.get("indexes", {}).items():
        try:
            _check_file(export_dir / entry["file"], entry, verify, f"{name} index")
        except (OSError, ValueError) as error:
            yield entry["file"], error


def load_export(export_dir: str | Path, verify: bool = True) -> dict:
    """Read ``<export_dir>/manifest.json`` and check the files it lists; returns the manifest.

    Always checks that every part and index file exists and has the recorded byte size; ``verify=True``
    also checks each file's sha256 and each part's Parquet row count. Raises FileNotFoundError for a missing
    directory, manifest or file and ValueError naming the file for a truncated, modified or corrupt one (the
    first found, with what to do; ``verify_export`` lists them all).
    """
    manifest = read_export_manifest(export_dir)
    for _, error in file_problems(export_dir, manifest, verify):
        raise type(error)(f"{error}. {repair_advice(export_dir)}") from error
    return manifest


def verify_export(export_dir: str | Path) -> integrity.Report:
    """Check every file of the export at ``export_dir`` (sizes, sha256, row counts) and report each damaged one
    by name (``bigrank verify``); raises only for a missing or unreadable manifest."""
    manifest = read_export_manifest(export_dir)
    report = integrity.Report("export", Path(export_dir), repair_advice(export_dir, verify_hint=False))
    entries = [p for table in manifest["tables"].values() for p in table["parts"]]
    entries += list(manifest.get("indexes", {}).values())
    report.files = len(entries)
    report.bytes = sum(int(entry["bytes"]) for entry in entries)
    report.problems = [(name, str(error)) for name, error in file_problems(export_dir, manifest, verify=True)]
    return report


def _check_file(path: Path, entry: dict, verify: bool, what: str) -> None:
    if not path.is_file():
        raise FileNotFoundError(f"export file listed in the manifest is missing ({what}): {path}")
    size = path.stat().st_size
    if size != entry["bytes"]:
        raise ValueError(
            f"export file is truncated or was modified ({what}): {path} has {size} bytes, "
            f"the manifest records {entry['bytes']}"
        )
    if verify and sha256_file(path) != entry["sha256"]:
        raise ValueError(f"export file is corrupt ({what}): {path} does not match its sha256 in the manifest")


def _check_rows(path: Path, rows: int) -> None:
    try:
        found = integrity.open_parquet(path).metadata.num_rows
    except Exception as error:  # pyarrow raises ArrowInvalid / OSError for a bad footer
        raise ValueError(f"export file is corrupt (unreadable Parquet footer): {path}: {error}") from error
    if found != rows:
        raise ValueError(f"export file {path} holds {found} rows, the manifest records {rows}")


def read_export_parquet(export_dir: str | Path, relative: str, handle=None, row_group: int | None = None):
    """The Parquet part ``relative`` of an export as a ``pyarrow.Table`` (``row_group``: only that row group of
    ``handle``, its ``integrity.open_parquet``), every page verified against its checksum. A damaged part raises
    CorruptFileError naming it, the row group, and what to do."""
    path = Path(export_dir) / relative
    try:
        if row_group is None:
            return integrity.read_parquet(path)
        return handle.read_row_group(row_group)
    except Exception as error:  # pyarrow raises OSError / ArrowInvalid for a bad page
        advice = repair_advice(export_dir)
        raise integrity.damaged_parquet("export file", path, error, advice, row_group=row_group) from error


# Keys of ``read_table``'s answer that are not item attributes.
TABLE_KEYS = ("ids", "embedding", "scale", "original_id")


def read_table(export_dir: str | Path, manifest: dict, name: str, arrow: bool = False) -> dict:
    """All rows of table ``name`` ("items", "users", "history", "items_float16", …) in id order.

    Returns ``{"ids": int32[n], "embedding": [n, d] (float32, float16 or int8), "scale": float32[n]?,
    "original_id": [n]?, <attribute>: [n]? …}``, optional keys when the parts have those columns: ``original_id``
    (items and users of an export of ingested data) as int64[n], or object[n] of str for string ids; every other
    column (items: the item attributes, e.g. ``title``) under its own name, strings as object[n] (None where
    null), numbers and booleans as numpy arrays. ``arrow=True``: ``original_id`` and the attributes as pyarrow
    arrays instead (compact, typed, nulls kept), what the servers hold.
    """
    import pyarrow as pa

    if name not in manifest["tables"]:
        raise ValueError(f"the export has no table {name!r}; it has {sorted(manifest['tables'])}")
    entry = manifest["tables"][name]
    parts = sorted(entry["parts"], key=lambda p: p["row_start"])
    pieces = []
    for part in parts:
        pieces.append(read_export_parquet(export_dir, part["file"]))
    table = pa.concat_tables(pieces)
    ids = table.column(entry["id_column"]).to_numpy()
    if not np.array_equal(ids, np.arange(entry["rows"])):
        raise ValueError(f"table {name!r} of {export_dir}: the parts' ids are not 0 … {entry['rows'] - 1} in order")
    embedding = table.column("embedding").combine_chunks()
    if isinstance(embedding, pa.ChunkedArray):  # an empty table has no chunk to combine
        embedding = pa.concat_arrays(embedding.chunks) if embedding.num_chunks else None
    dim = int(entry["dim"])
    flat = embedding.flatten().to_numpy(zero_copy_only=False) if embedding is not None else np.empty(0)
    out = {"ids": ids.astype(np.int32), "embedding": flat.reshape(len(ids), dim)}
    if "scale" in table.column_names:
        out["scale"] = table.column("scale").to_numpy()
    for column in table.column_names:
        if column in (entry["id_column"], "embedding", "scale"):
            continue
        values = table.column(column)
        values = values.combine_chunks() if values.num_chunks else pa.array([], values.type)
        out[column] = values if arrow else _as_numpy(values)
    return out


def _as_numpy(values) -> np.ndarray:
    """A pyarrow array as numpy: strings as object[n] of str (None where null), the rest as ``to_numpy``."""
    import pyarrow as pa

    if pa.types.is_string(values.type) or pa.types.is_large_string(values.type):
        return np.asarray(values.to_pylist(), dtype=object)
    if pa.types.is_int64(values.type) and not values.null_count:
        return values.to_numpy()
    return values.to_numpy(zero_copy_only=False)
