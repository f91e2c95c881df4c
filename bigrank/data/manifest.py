"""Dataset layout: the manifest, atomic Parquet writes, and up-front validation of the files.

A dataset is a directory::

    <root>/manifest.json                       written last: its presence means the dataset is complete
    <root>/{train,valid,test}/part-NNNNN.parquet
    <root>/users.parquet, items.parquet        (ingested data: dense id -> original id, titles)
    <root>/truth.npz                           (synthetic data without expansion: the true factors)

Parquet columns: ``user_id: int32`` and ``item_id: int32`` (0-based; ids lie in ``[0, num_users)`` and
``[0, num_items)``), plus ``rating: float32`` / ``timestamp: int64`` where the source has them.

Every file is written to a temporary name and renamed into place (``os.replace``), so an interrupted run
never leaves a file that looks complete, and the manifest is written after all data files. The manifest
records, per split, the row count, the relative file paths, each file's size in bytes, its row count and
its row-group sizes: readers plan their work from it (identically on every rank) and a truncated or
replaced file is caught before training starts.

Integrity (``bigrank.integrity``): every Parquet file is written with page checksums and read with their
verification, so a flipped byte in a page is an error naming the file and row group when it is read. The
manifest's ``integrity`` entry records the size and CRC-32 of every data file (split parts, ``users.parquet``,
``items.parquet``, ``truth.npz``)::

    "integrity": {"checksum": "crc32", "page_checksums": true,
                  "files": {"train/part-00000.parquet": {"bytes": 1234, "crc32": "89abcdef"}, ...}}

Opening a dataset checks sizes and footers (``validate_dataset``, ``DatasetManifest.validate``: cheap); training
checks the CRC-32 of every file it will read before its first step, the ranks sharing the work
(``DatasetManifest.check_checksums``; ``data.verify: quick`` skips it), so a flipped byte in a row group read late
in an epoch stops the run before it trains on anything; ``bigrank verify ROOT`` checks every checksum and reports
every damaged file (``verify_dataset``: reads every byte). Datasets written before checksums were recorded have no
``integrity`` entry: they load as before and ``verify`` checks what their manifest has.

A run reads the manifest once per process into a :class:`DatasetManifest` and passes it down (trainer, model,
stream, evaluation, export); the readers also take a directory (:func:`as_manifest` reads it then).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from bigrank import integrity
from bigrank.atomic import temporary_path, write_atomic, write_json_atomic  # noqa: F401 (re-exported)
from bigrank.errors import CorruptFileError

# 2: ingested datasets: original ids of any type with counts in users/items.parquet, dense ids by hash order, the
# random split by a seeded hash; every dataset: the per-user index written with it (``user_index``). 1 still reads.
FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)
MANIFEST_NAME = "manifest.json"
SPLITS = ("train", "valid", "test")
ROW_GROUP_SIZE = 1 << 20
ROWS_PER_FILE = 1 << 23
COMPRESSION = "zstd"
REQUIRED_KEYS = ("format_version", "num_users", "num_items", "splits", "schema", "seed", "source", "generator")
ID_COLUMNS = ("user_id", "item_id")
SPLIT_FRACTIONS = (0.8, 0.1, 0.1)
COLUMN_TYPES = {"user_id": "int32", "item_id": "int32", "rating": "float32", "timestamp": "int64"}
# Data files beside the split parts, recorded in the manifest's integrity entry when present.
SIDE_FILES = ("users.parquet", "items.parquet", "truth.npz")


def repair_advice(root: str | Path, verify_hint: bool = True) -> str:
    """What to do about a damaged dataset file (ends every corruption error of the data layer); ``verify_hint``:
    also name the command that lists every damaged file."""
    advice = (
        "The dataset is damaged: re-generate it (`bigrank generate`) or re-ingest it (`bigrank ingest`) into a new "
        "directory, or restore it from a copy"
    )
    return advice + (f"; `bigrank verify {root}` lists every damaged file." if verify_hint else ".")


def random_split_labels(rng: np.random.Generator, count: int, fractions=SPLIT_FRACTIONS) -> np.ndarray:
    """Exact-size random split of ``count`` pairs (the Rankmax paper's 80/10/10 protocol by default).

    Returns int8 labels of shape (count,): 0 = train, 1 = valid, 2 = test (index into ``SPLITS``).
    """
    sizes = [int(round(f * count)) for f in fractions[:-1]]
    labels = np.full(count, len(fractions) - 1, dtype=np.int8)
    order = rng.permutation(count)
    start = 0
    for label, size in enumerate(sizes):
        labels[order[start : start + size]] = label
        start += size
    return labels


def remove_stale_temporaries(directory: str | Path) -> int:
    """Delete leftovers of interrupted writes (``.*.tmp-*``) under ``directory``; returns how many."""
    removed = 0
    for path in Path(directory).rglob(".*.tmp-*"):
        path.unlink(missing_ok=True)
        removed += 1
    return removed


def arrow_table(columns: Mapping[str, np.ndarray]):
    """A ``pyarrow.Table`` from numpy columns, cast to the layout's types (``COLUMN_TYPES``)."""
    import pyarrow as pa

    arrays, names = [], []
    for name, values in columns.items():
        dtype = COLUMN_TYPES.get(name)
        values = np.asarray(values)
        if dtype is not None and values.dtype != np.dtype(dtype):
            values = values.astype(dtype)
        arrays.append(pa.array(values))
        names.append(name)
    return pa.Table.from_arrays(arrays, names=names)


def write_parquet_atomic(
    path: str | Path,
    columns: Mapping[str, np.ndarray],
    row_group_size: int = ROW_GROUP_SIZE,
    compression: str = COMPRESSION,
) -> Path:
    """Write numpy ``columns`` (equal lengths) to the Parquet file ``path`` atomically.

    Row groups hold ``row_group_size`` rows (the unit of work of the streaming reader); every page carries a
    CRC-32 (``bigrank.integrity``). Returns ``path``.
    """
    import pyarrow.parquet as pq

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    table = arrow_table(columns)
    return write_atomic(
        path,
        lambda tmp: pq.write_table(
            table, tmp, row_group_size=row_group_size, compression=compression, **integrity.PARQUET_WRITE_OPTIONS
        ),
    )


def part_name(split: str, index: int) -> str:
    """Relative path of part ``index`` of ``split``: ``<split>/part-NNNNN.parquet``."""
    return f"{split}/part-{index:05d}.parquet"


def write_split_parts(
    root: str | Path,
    split: str,
    columns: Mapping[str, np.ndarray],
    first_part: int = 0,
    rows_per_file: int = ROWS_PER_FILE,
    row_group_size: int = ROW_GROUP_SIZE,
    compression: str = COMPRESSION,
) -> list[str]:
    """Write in-memory ``columns`` of one split as part files ``first_part, first_part+1, ...``.

    Returns the relative paths written (none when the columns are empty).
    """
    lengths = {len(values) for values in columns.values()}
    if len(lengths) != 1:
        raise ValueError(f"columns of split {split!r} have different lengths: {sorted(lengths)}")
    return write_split_batches(
        root,
        split,
        [arrow_table(columns)],
        lambda index: part_name(split, first_part + index),
        rows_per_file,
        row_group_size,
        compression,
    )


def write_split_batches(
    root: str | Path,
    split: str,
    batches: Iterable,
    name_of: Callable[[int], str] | None = None,
    rows_per_file: int = ROWS_PER_FILE,
    row_group_size: int = ROW_GROUP_SIZE,
    compression: str = COMPRESSION,
) -> list[str]:
    """Stream ``batches`` (pyarrow RecordBatches or Tables of one schema, in the layout's column types) into part
    files of ``rows_per_file`` rows and row groups of ``row_group_size`` rows, each written atomically with page
    checksums; memory holds one row group. ``name_of(k)`` is the relative path of the k-th file (default
    ``part_name(split, k)``). Returns the relative paths written (none for no rows)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    root = Path(root)
    name_of = name_of or (lambda index: part_name(split, index))
    written: list[str] = []
    state = {"writer": None, "tmp": None, "rows": 0}

    def close() -> None:
        if state["writer"] is not None:
            state["writer"].close()
            os.replace(state["tmp"], root / written[-1])
            state["writer"] = None

    def write(table) -> None:
        if state["writer"] is None:
            written.append(name_of(len(written)))
            path = root / written[-1]
            path.parent.mkdir(parents=True, exist_ok=True)
            state["tmp"] = temporary_path(path)
            state["writer"] = pq.ParquetWriter(
                state["tmp"], table.schema, compression=compression, **integrity.PARQUET_WRITE_OPTIONS
            )
            state["rows"] = 0
        state["writer"].write_table(table, row_group_size=row_group_size)
        state["rows"] += table.num_rows
        if state["rows"] >= rows_per_file:
            close()

    pending, pending_rows = [], 0
    try:
        for batch in batches:
            pending.append(batch if isinstance(batch, pa.Table) else pa.Table.from_batches([batch]))
            pending_rows += batch.num_rows
            # Emit whole row groups, never crossing a file boundary, so every file but the last holds exactly
            # rows_per_file rows and every row group but a file's last exactly row_group_size.
            while pending_rows >= row_group_size:
                table = pa.concat_tables(pending)
                room = rows_per_file - state["rows"] if state["writer"] is not None else rows_per_file
                take = min(row_group_size, room)
                write(table.slice(0, take))
                rest = table.slice(take)
                pending, pending_rows = ([rest] if rest.num_rows else []), rest.num_rows
        if pending_rows:
            write(pa.concat_tables(pending))
        close()
    finally:
        if state["writer"] is not None:
            state["writer"].close()
            Path(state["tmp"]).unlink(missing_ok=True)
    return written


def describe_files(root: str | Path, files: Iterable[str]) -> dict:
    """Read the footers of ``files`` (relative to ``root``) and describe the split they form.

    Returns ``{rows, files, file_rows, file_bytes, row_groups}`` where ``row_groups[f]`` lists the row
    counts of the row groups of file ``f``. Raises like ``validate_dataset`` on a missing or corrupt file.
    """
    root = Path(root)
    files = list(files)
    file_rows, file_bytes, row_groups = [], [], []
    for name in files:
        metadata = _read_footer(root / name, root)
        groups = [metadata.row_group(g).num_rows for g in range(metadata.num_row_groups)]
        file_rows.append(int(metadata.num_rows))
        file_bytes.append((root / name).stat().st_size)
        row_groups.append(groups)
    return {
        "rows": int(sum(file_rows)),
        "files": files,
        "file_rows": file_rows,
        "file_bytes": file_bytes,
        "row_groups": row_groups,
    }


def _read_footer(path: Path, root: Path):
    import pyarrow.parquet as pq

    if not path.is_file():
        raise FileNotFoundError(f"dataset file is missing: {path}")
    try:
        return pq.read_metadata(path)  # the footer only: no page is read, so none to verify (integrity)
    except Exception as error:  # pyarrow raises ArrowInvalid / OSError for a bad footer
        raise ValueError(
            f"dataset file is corrupt or truncated (unreadable Parquet footer): {path}: {error}. {repair_advice(root)}"
        ) from error


def file_schema(path: str | Path) -> dict[str, str]:
    """Column name -> Arrow type name of one Parquet file."""
    import pyarrow.parquet as pq

    schema = pq.read_schema(path)
    return {field.name: str(field.type) for field in schema}


def write_manifest(root: str | Path, **fields) -> dict:
    """Describe the split files from their footers (:func:`describe_dataset`, ``fields`` its keyword arguments)
    and write ``<root>/manifest.json`` atomically; returns the manifest.

    Call it only after every data file is in place: the manifest is the mark of a complete dataset. (The dataset
    writers call ``bigrank.data.user_index.write_manifest_with_indexes``, which writes each split's per-user index
    first.)
    """
    manifest = describe_dataset(root, **fields)
    write_json_atomic(Path(root) / MANIFEST_NAME, manifest)
    return manifest


def describe_dataset(
    root: str | Path,
    *,
    num_users: int,
    num_items: int,
    split_files: Mapping[str, list[str]],
    seed: int | None,
    source: str,
    generator: Mapping,
    extra: Mapping | None = None,
) -> dict:
    """The manifest :func:`write_manifest` writes, without writing it: the split files described from their
    footers, ``extra`` keys (e.g. ``num_rated_items``), and the size and CRC-32 of every data file
    (``integrity_entry``)."""
    root = Path(root)
    splits = {name: describe_files(root, files) for name, files in split_files.items()}
    schema = {}
    for description in splits.values():
        if description["files"]:
            schema = file_schema(root / description["files"][0])
            break
    manifest = {
        "format_version": FORMAT_VERSION,
        "num_users": int(num_users),
        "num_items": int(num_items),
        "num_ratings": int(sum(s["rows"] for s in splits.values())),
        "splits": splits,
        "schema": schema,
        "seed": seed,
        "source": source,
        "generator": dict(generator),
    }
    manifest.update(extra or {})
    manifest["integrity"] = integrity_entry(root, [name for split in splits.values() for name in split["files"]])
    return manifest


def integrity_entry(root: str | Path, part_files: Iterable[str]) -> dict:
    """The manifest's ``integrity`` entry: the checksum algorithm and ``{bytes, crc32}`` of ``part_files``
    and of the ``SIDE_FILES`` present under ``root`` (hashed in parallel; ~0.6-1 GB/s a core)."""
    root = Path(root)
    names = list(part_files) + [name for name in SIDE_FILES if (root / name).is_file()]
    return {"checksum": integrity.CHECKSUM, "page_checksums": True, "files": integrity.describe_files(root, names)}


def load_manifest(root: str | Path) -> dict:
    """Read and check ``<root>/manifest.json``.

    Raises FileNotFoundError when the directory or the manifest is missing (a dataset whose generation did
    not finish has no manifest), ValueError when it is not valid JSON, has another format version or lacks
    a required key.
    """
    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"dataset directory does not exist: {root}")
    path = root / MANIFEST_NAME
    if not path.is_file():
        raise FileNotFoundError(
            f"no {MANIFEST_NAME} in {root}: not a bigrank dataset, or its generation did not finish "
            "(rerun `bigrank generate ... --resume`)"
        )
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{path} is not valid JSON: {error}") from error
    if not isinstance(manifest, dict):
        raise ValueError(f"{path} does not hold a JSON object")
    missing = [key for key in REQUIRED_KEYS if key not in manifest]
    if missing:
        raise ValueError(f"{path} lacks the keys {missing}")
    if manifest["format_version"] not in READABLE_VERSIONS:
        raise ValueError(
            f"{path} has format_version {manifest['format_version']}, this bigrank reads "
            f"{' and '.join(map(str, READABLE_VERSIONS))}"
        )
    for name, split in manifest["splits"].items():
        for key in ("rows", "files", "file_rows", "row_groups"):
            if key not in split:
                raise ValueError(f"{path}: split {name!r} lacks {key!r}")
    return manifest


@dataclass(frozen=True)
class DatasetManifest:
    """A dataset's ``manifest.json``, read and checked once (:meth:`load`), then passed down to whatever reads the
    dataset: the trainer, the model, the stream, evaluation and export take it instead of the root string.

    ``splits`` maps a split name to its entry (``rows``, ``files``, ``file_rows``, ``row_groups``, ``file_bytes``);
    ``raw`` is the whole JSON object (other keys: ``schema``, ``seed``, ``source``, ``generator``, ``integrity``).
    :meth:`validate` checks a split's files against it (sizes, footers) once per process: later calls for the
    same split are free (every page is still verified as it is read). The record of what was checked stays in
    the process: a copy sent to another process (pickle) checks its files again there.
    """

    root: Path
    num_users: int
    num_items: int
    splits: Mapping[str, Mapping[str, Any]]
    raw: Mapping[str, Any]
    # {(split, deep)} whose files this process has checked (see validate); not compared, not pickled.
    _checked: set = field(default_factory=set, repr=False, compare=False)

    @classmethod
    def load(cls, root: str | Path) -> DatasetManifest:
        """Read and check ``<root>/manifest.json`` (errors as :func:`load_manifest`): the one read of a process."""
        raw = load_manifest(root)
        return cls(Path(root), int(raw["num_users"]), int(raw["num_items"]), raw["splits"], raw)

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_checked"] = set()  # files are checked in the process that reads them
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)

    def split(self, name: str) -> Mapping[str, Any]:
        """The entry of split ``name``; ValueError naming the available splits when it is absent."""
        return split_info(self.raw, name)

    def rows(self, name: str) -> int:
        """Rows of split ``name`` (ValueError when absent)."""
        return int(self.split(name)["rows"])

    def files(self, name: str) -> list[Path]:
        """Paths of the Parquet parts of split ``name``, in order (ValueError when the split is absent)."""
        return [self.root / relative for relative in self.split(name)["files"]]

    @property
    def schema(self) -> Mapping[str, str]:
        """Column name -> Arrow type name of the split files (empty for a dataset without rows)."""
        return self.raw.get("schema") or {}

    @property
    def source(self) -> str:
        """Where the ratings came from (``synthetic:demo``, ``movielens:...``)."""
        return self.raw["source"]

    def excluded_splits(self, split: str) -> tuple[str, ...]:
        """The splits left out of the rankings when ``split`` is evaluated (:func:`excluded_splits`)."""
        return excluded_splits(self.raw, split)

    def side_file(self, name: str) -> Path | None:
        """Path of the side file ``name`` (one of ``SIDE_FILES``: ``users.parquet`` …) when the dataset has it."""
        if name not in SIDE_FILES:
            raise ValueError(f"{name!r} is not a dataset side file; they are {SIDE_FILES}")
        path = self.root / name
        return path if path.is_file() else None

    def validate(self, splits: Iterable[str] | None = None, deep: bool = False) -> DatasetManifest:
        """``validate_dataset``'s checks of the files of ``splits`` (default: all), each split once per process
        (``deep``: also decode every row group and check the ids' ranges). Returns ``self``."""
        names = list(self.splits) if splits is None else list(splits)
        for split in names:
            if (split, deep) in self._checked or (split, True) in self._checked:
                continue
            info = self.split(split)
            if len(info["file_rows"]) != len(info["files"]) or len(info["row_groups"]) != len(info["files"]):
                raise ValueError(f"manifest of {self.root}: split {split!r} lists inconsistent file entries")
            if sum(info["file_rows"]) != info["rows"]:
                raise ValueError(f"manifest of {self.root}: split {split!r} row count differs from its files' sum")
            for index in range(len(info["files"])):
                validate_file(self.root, self.raw, split, index, deep)
            self._checked.add((split, deep))
        return self

    def check_checksums(
        self, splits: Iterable[str], group=None, progress: Callable[[str], None] | None = None
    ) -> tuple[int, int]:
        """Check the size and CRC-32 of every file of ``splits`` against the manifest's ``integrity`` entry, each
        rank of ``group`` a disjoint share (``integrity.check_files_shared``: collective when torch.distributed is
        initialised, reads ~1/W of the bytes); returns ``(files, bytes)`` checked by all ranks together, ``(0, 0)``
        for a dataset without recorded checksums (written by an older bigrank).

        Every rank raises the same CorruptFileError (a ValueError) naming the first damaged file (in name order)
        and, when its pages tell, the row group (read again group by group: the error path only).
        ``progress``: called with a line about every 10 s while this rank's share is read (rank 0's, say)."""
        recorded = self.raw.get("integrity") or {}
        if recorded.get("checksum") != integrity.CHECKSUM:
            return 0, 0
        names = dict.fromkeys(name for split in splits for name in self.split(split)["files"])  # ordered, unique
        entries = {name: recorded["files"][name] for name in names if name in recorded["files"]}
        total = sum(int(entry.get("bytes", 0)) for entry in entries.values())
        problems = integrity.check_files_shared(
            self.root, entries, group=group, progress=progress, what="dataset checksums"
        )
        if problems:
            name, problem = problems[0]
            path = self.root / name
            group_index = integrity.first_damaged_row_group(path) if path.suffix == ".parquet" else None
            where = f"; the damage is in row group {group_index}" if group_index is not None else ""
            more = f" ({len(problems) - 1} more damaged files)" if len(problems) > 1 else ""
            raise CorruptFileError(
                f"dataset file {path} is {problem}{where}{more}. {repair_advice(self.root)}",
                path=path,
                row_group=group_index,
            )
        return len(entries), total


def dataset_manifest(root: str | Path, manifest: DatasetManifest | None = None) -> DatasetManifest:
    """The manifest of the dataset at ``root`` (a run's ``data.root``): ``manifest`` when given (read once by the
    caller: the run's pre-flight, a worker's entry), else read now. ValueError when ``manifest`` is another
    dataset's."""
    if manifest is None:
        return DatasetManifest.load(root)
    if manifest.root.resolve() != Path(root).resolve():
        raise ValueError(f"the dataset manifest given is of {manifest.root}, but data.root is {root}")
    return manifest


def as_manifest(dataset: DatasetManifest | str | Path) -> DatasetManifest:
    """``dataset`` itself when it is a :class:`DatasetManifest`, else the manifest of the dataset directory it names
    (read now): lets the readers take either, the run passing the one it read."""
    return dataset if isinstance(dataset, DatasetManifest) else DatasetManifest.load(dataset)


def excluded_splits(manifest: Mapping, split: str) -> tuple[str, ...]:
    """The splits whose items of a user are left out of the rankings when ``split`` is evaluated: the manifest's
    ``eval_exclude`` entry for ``split`` when it records one, else ``("train",)``.

    ``bigrank ingest --split given`` records ``{"valid": ["train"], "test": ["train", "valid"]}``: the papers that
    ship a train and a test file rank, for a test user, every item but those of the train file, and a validation
    split carved from (or given beside) the train file holds train items too. The other splits keep the
    default: a test user's valid items may be recommended, and count as misses (as every figure measured so far).
    """
    recorded = (manifest.get("eval_exclude") or {}).get(split)
    return tuple(recorded) if recorded is not None else ("train",)


def split_info(manifest: Mapping, split: str) -> dict:
    """The manifest entry of ``split``; ValueError naming the available splits when it is absent."""
    if split not in manifest["splits"]:
        raise ValueError(f"dataset has no split {split!r}; it has {sorted(manifest['splits'])}")
    return manifest["splits"][split]


def validate_dataset(root: str | Path, splits: Iterable[str] | None = None, deep: bool = False) -> dict:
    """Check the files of ``splits`` (default: all) against the manifest before any work starts.

    Checks that every file exists (FileNotFoundError naming it), has the recorded size (truncated or
    replaced files), has a readable footer, and holds the recorded rows and row groups with ``user_id`` /
    ``item_id`` of type int32 (ValueError naming the file): a few ``stat`` calls and footer reads, cheap at any
    scale. ``deep=True`` also decodes every row group (verifying its page checksums) and checks ids lie in
    ``[0, num_users)`` / ``[0, num_items)`` — this reads all the data. Whole-file checksums are
    ``verify_dataset``'s job. Returns the manifest.
    """
    return dict(DatasetManifest.load(root).validate(splits, deep).raw)


def validate_file(root: Path, manifest: Mapping, split: str, index: int, deep: bool = False) -> None:
    """``validate_dataset``'s checks of file ``index`` of ``split`` (its manifest entry) under ``root``."""
    info = manifest["splits"][split]
    path = root / info["files"][index]
    if not path.is_file():
        raise FileNotFoundError(f"dataset file listed in the manifest is missing: {path}")
    expected_bytes = info.get("file_bytes", [None] * len(info["files"]))[index]
    size = path.stat().st_size
    if expected_bytes is not None and size != expected_bytes:
        raise ValueError(
            f"dataset file is truncated or was modified: {path} has {size} bytes, the manifest records "
            f"{expected_bytes}. {repair_advice(root)}"
        )
    metadata = _read_footer(path, root)
    groups = [metadata.row_group(g).num_rows for g in range(metadata.num_row_groups)]
    if metadata.num_rows != info["file_rows"][index] or groups != list(info["row_groups"][index]):
        raise ValueError(
            f"dataset file {path} holds {metadata.num_rows} rows in row groups {groups[:8]}..., "
            f"the manifest records {info['file_rows'][index]}"
        )
    schema = metadata.schema.to_arrow_schema()
    for column in ID_COLUMNS:
        if column not in schema.names or str(schema.field(column).type) != "int32":
            raise ValueError(f"dataset file {path} lacks an int32 column {column!r}")
    if deep:
        _check_file_contents(root, path, manifest)


def _check_file_contents(root: Path, path: Path, manifest: Mapping) -> None:
    parquet = integrity.open_parquet(path)
    for group in range(parquet.num_row_groups):
        table = read_row_group(parquet, path, group, ID_COLUMNS, root)
        users = table.column("user_id").to_numpy()
        items = table.column("item_id").to_numpy()
        if len(users) and (users.min() < 0 or users.max() >= manifest["num_users"]):
            raise ValueError(
                f"dataset file {path} is invalid: user_id out of [0, {manifest['num_users']}) in row group {group}"
            )
        if len(items) and (items.min() < 0 or items.max() >= manifest["num_items"]):
            raise ValueError(
                f"dataset file {path} is invalid: item_id out of [0, {manifest['num_items']}) in row group {group}"
            )


def read_row_group(handle, path: Path, group: int, columns, root: str | Path, **options):
    """Row group ``group`` of the dataset file ``path`` (``handle``: its ``integrity.open_parquet``), pages
    verified; a damaged page raises CorruptFileError naming the file and row group (``root``: the dataset, for
    the advice). ``options`` go to ``ParquetFile.read_row_group`` (``use_threads``)."""
    try:
        return handle.read_row_group(group, columns=list(columns), **options)
    except Exception as error:  # pyarrow raises OSError / ArrowInvalid for a bad page
        raise integrity.damaged_parquet("dataset file", path, error, repair_advice(root), row_group=group) from error


def verify_dataset(root: str | Path) -> integrity.Report:
    """Check every file of the dataset at ``root`` against its manifest, reading every byte (``bigrank verify``).

    With an ``integrity`` entry: each file's size and CRC-32. A manifest written before checksums were recorded:
    the split parts' sizes and footers (``validate_dataset``'s checks) and a decode of every row group, with a
    note saying that a flip that still decodes cannot be told. Every problem is reported by file, none raised.
    """
    root = Path(root)
    manifest = load_manifest(root)
    report = integrity.Report("dataset", root, repair_advice(root, verify_hint=False))
    recorded = manifest.get("integrity")
    if recorded and recorded.get("checksum") == integrity.CHECKSUM:
        for name, entry in recorded["files"].items():
            report.check(name, entry)
        return report
    report.notes.append(
        "the manifest records no checksums (written by an older bigrank): checked sizes, footers and that every "
        "row group decodes; a changed byte that still decodes cannot be found. Re-generate to record checksums."
    )
    for split, info in manifest["splits"].items():
        sizes = info.get("file_bytes") or [None] * len(info["files"])
        for index, (name, size) in enumerate(zip(info["files"], sizes, strict=True)):
            if report.check(name, {} if size is None else {"bytes": size}) is None:
                try:
                    validate_file(root, manifest, split, index, deep=True)
                except (OSError, ValueError) as error:
                    report.problems.append((name, str(error)))
    return report
