"""What an ingest reads: the input files, their format and schema, and the SQL that scans them with DuckDB.

``PATH`` arguments are files, directories of parts (every file below them whose name does not start with ``.`` or
``_``, as Spark and Hive write them) or globs. Formats, from the file names unless ``--format`` says:

    Parquet       .parquet .pq
    CSV / TSV     .csv .tsv .txt (delimiter and header settable), and MovieLens's .dat ("::") / u.data (tab)
    JSON Lines    .jsonl .ndjson .json
    each text format may be compressed: .gz, .zst

Before any row is read, every file's schema is read (Parquet footers; the header or first line of text files)
and checked: a truncated or corrupt file, a missing column or parts whose schemas disagree is an error naming
the file (:class:`~bigrank.errors.CommandError`). A :class:`Source` then gives the DuckDB table function that
scans its files (:meth:`Source.scan`), used by both engines: one machine scans them all, the cluster engine a
subset per task (:meth:`Source.subset`).
"""

from __future__ import annotations

import glob
import os
import re
from dataclasses import dataclass, replace
from pathlib import Path

from bigrank.errors import CommandError

__all__ = [
    "FORMATS",
    "Source",
    "duckdb_error",
    "file_list",
    "literal_path",
    "open_source",
    "quote_identifier",
    "quote_literal",
    "resolve_files",
]

FORMATS = ("parquet", "csv", "json")
COMPRESSIONS = (".gz", ".zst", ".zstd")
SUFFIX_FORMATS = {
    ".parquet": "parquet",
    ".pq": "parquet",
    ".csv": "csv",
    ".tsv": "csv",
    ".txt": "csv",
    ".dat": "csv",
    ".data": "csv",
    ".jsonl": "json",
    ".ndjson": "json",
    ".json": "json",
}
DEFAULT_DELIMITERS = {".tsv": "\t", ".data": "\t", ".dat": "::"}
INTEGER_TYPES = ("TINYINT", "SMALLINT", "INTEGER", "BIGINT", "UTINYINT", "USMALLINT", "UINTEGER", "UBIGINT")
NUMBER_TYPES = (*INTEGER_TYPES, "HUGEINT", "FLOAT", "DOUBLE", "REAL")
TIME_TYPES = ("DATE", "TIMESTAMP", "TIMESTAMP WITH TIME ZONE", "TIMESTAMP_S", "TIMESTAMP_MS", "TIMESTAMP_NS")
# DuckDB's readers expand these in every path they are given, a list's items included (DuckDB's globbing).
GLOB_CHARACTERS = "*?["
# Delimiters a text file is sniffed for when the one its name suggests reads a single column (Last.fm's tab-
# separated .dat files, a ;-separated .csv).
SNIFFED_DELIMITERS = (",", "\t", ";", "|")


def quote_literal(text: str) -> str:
    """``text`` as a SQL string literal."""
    return "'" + str(text).replace("'", "''") + "'"


def quote_identifier(name: str) -> str:
    """``name`` as a SQL identifier."""
    return '"' + str(name).replace('"', '""') + '"'


def literal_path(path) -> str:
    """``path`` written so that DuckDB's readers open that one file: DuckDB expands ``*``, ``?`` and ``[`` in
    every path as a glob (``a[1].csv`` would read ``a1.csv``), so each is put in brackets (``a[[]1].csv``), the
    escape DuckDB's glob documents. CommandError for a path that also holds a backslash: DuckDB's glob has no
    escape for it, so that file cannot be named."""
    text = str(path)
    if not any(character in text for character in GLOB_CHARACTERS):
        return text
    if "\\" in text:
        raise CommandError(
            f"{text}: DuckDB cannot open a path holding both a backslash and one of {' '.join(GLOB_CHARACTERS)} "
            "(it reads those as a glob); rename the file or its directory"
        )
    return "".join(f"[{c}]" if c in GLOB_CHARACTERS else c for c in text)


def file_list(files) -> str:
    """The SQL list of ``files`` for DuckDB's ``read_parquet`` / ``read_csv`` / ``read_json``, each one read as
    the file it names (:func:`literal_path`), never as a glob."""
    return "[" + ", ".join(quote_literal(literal_path(f)) for f in files) + "]"


def duckdb_error(error: Exception) -> str:
    """The first line of a DuckDB error without its class prefix ("IO Error: …" stays, the sniffer's notes go)."""
    text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return text


def _base_suffix(name: str) -> tuple[str, str]:
    """``(format suffix, compression suffix)`` of a file name: ``("csv", ".gz")`` for ``x.csv.gz``."""
    lower = name.lower()
    compression = next((c for c in COMPRESSIONS if lower.endswith(c)), "")
    stem = lower[: len(lower) - len(compression)] if compression else lower
    if stem == "u.data" or stem.endswith("/u.data"):
        return ".data", compression
    return os.path.splitext(stem)[1], compression


def resolve_files(paths: list[str | Path]) -> list[Path]:
    """The input files of ``paths`` (files, directories searched recursively, globs), sorted, each once. A path
    that exists is taken as it is, even when its name holds ``*``, ``?`` or ``[``; only one that does not is a
    glob.

    CommandError naming the path when one matches nothing.
    """
    files: list[Path] = []
    for path in paths:
        text = str(path)
        if not Path(text).exists() and any(ch in text for ch in GLOB_CHARACTERS):
            matched = [Path(p) for p in sorted(glob.glob(text, recursive=True)) if Path(p).is_file()]
            if not matched:
                raise CommandError(f"no file matches {text}")
            files.extend(matched)
            continue
        path = Path(path)
        if path.is_dir():
            found = sorted(
                p
                for p in path.rglob("*")
                if p.is_file() and not any(part.startswith((".", "_")) for part in p.relative_to(path).parts)
            )
            if not found:
                raise CommandError(f"the directory {path} holds no file")
            files.extend(found)
        elif path.is_file():
            files.append(path)
        else:
            raise CommandError(f"no such file or directory: {path}")
    seen: set[Path] = set()
    unique = []
    for file in files:
        resolved = file.resolve()
        if resolved not in seen:
            seen.add(resolved)
            unique.append(resolved)
    return unique


@dataclass(frozen=True)
class Source:
    """Input files of one format and the columns they hold.

    ``columns`` maps each column name to its DuckDB type as the scan gives it (text formats read every column as
    VARCHAR, so a typed value that does not parse is counted and located, not lost); ``header`` and ``delimiter``
    apply to text files; ``encoding`` is ``utf-8`` or ``latin-1`` (MovieLens's older files).
    """

    files: tuple[str, ...]
    format: str
    columns: dict[str, str]
    delimiter: str = ","
    header: bool = True
    encoding: str = "utf-8"
    typed_text: bool = False  # text columns keep DuckDB's sniffed types (item files: a price stays a number)

    def subset(self, files) -> Source:
        """The same source over ``files`` only (the cluster engine's read tasks)."""
        return replace(self, files=tuple(str(f) for f in files))

    def scan(self, files=None, *, filename: bool = False, row_number: bool = False) -> str:
        """The DuckDB table function scanning ``files`` (default all), with a ``filename`` column and, for
        Parquet, ``file_row_number`` when asked (the error path locates a bad row with them)."""
        files = self.files if files is None else tuple(files)
        listed = file_list(files)
        extra = ", filename = true" if filename else ""
        if self.format == "parquet":
            numbers = ", file_row_number = true" if row_number else ""
            return f"read_parquet({listed}, union_by_name = true{extra}{numbers})"
        if self.format == "json":
            return f"read_json({listed}, format = 'newline_delimited', union_by_name = true{extra})"
        # Named columns once the schema is known (a headerless file's column0, column1, …); every file must have
        # them. Text columns are read as text unless typed_text (then DuckDB's sniffer types them).
        names = f", names = [{', '.join(quote_literal(n) for n in self.columns)}]" if self.columns else ""
        typing = ", auto_detect = true" if self.typed_text else ", all_varchar = true"
        return (
            f"read_csv({listed}, delim = {quote_literal(self.delimiter)}, header = {str(self.header).lower()}, "
            f"quote = '\"', escape = '\"', encoding = {quote_literal(self.encoding)}, "
            f"strict_mode = false, null_padding = true{names}{typing}{extra})"
        )

    def column(self, spec: str, option: str) -> str:
        """The name of the column ``spec`` names: a column name, or a 0-based position (``--user 0``).

        CommandError naming the option and the columns there are when it names none.
        """
        names = list(self.columns)
        if spec in self.columns:
            return spec
        if re.fullmatch(r"\d+", str(spec)):
            position = int(spec)
            if position < len(names):
                return names[position]
            raise CommandError(
                f"{option} {spec}: the input has {len(names)} columns (positions 0-{len(names) - 1}): "
                f"{', '.join(names)}"
            )
        raise CommandError(f"{option}: no column {spec!r} in {self.files[0]}; its columns are: {', '.join(names)}")


def _format_of(files: list[Path], fmt: str) -> tuple[str, str | None]:
    """``(format, default delimiter)`` of ``files``; CommandError when their formats differ or are unknown."""
    if fmt != "auto":
        if fmt not in (*FORMATS, "tsv", "jsonl"):
            raise CommandError(f"unknown --format {fmt!r}; choose auto, parquet, csv, tsv or jsonl")
        return {"tsv": "csv", "jsonl": "json"}.get(fmt, fmt), ("\t" if fmt == "tsv" else None)
    kinds: dict[str, list[Path]] = {}
    delimiters = set()
    for file in files:
        suffix, compression = _base_suffix(file.name)
        kind = SUFFIX_FORMATS.get(suffix)
        if kind is None:
            raise CommandError(
                f"cannot tell the format of {file} from its name; pass --format parquet|csv|tsv|jsonl "
                f"(known suffixes: {', '.join(sorted(SUFFIX_FORMATS))}, compressed with .gz or .zst)"
            )
        if kind == "parquet" and compression:
            raise CommandError(f"{file}: a Parquet file compresses its own pages; it cannot be {compression}")
        kinds.setdefault(kind, []).append(file)
        delimiters.add(DEFAULT_DELIMITERS.get(suffix))
    if len(kinds) > 1:
        examples = "; ".join(f"{kind}: {paths[0]}" for kind, paths in sorted(kinds.items()))
        raise CommandError(f"the inputs mix formats ({examples}); ingest one format at a time")
    (kind,) = kinds
    return kind, (delimiters.pop() if len(delimiters) == 1 else None)


def _describe(con, scan: str, file) -> dict[str, str]:
    try:
        rows = con.execute(f"DESCRIBE SELECT * FROM {scan}").fetchall()
    except Exception as error:  # DuckDB's IOException / InvalidInputException / ConversionException
        raise CommandError(f"cannot read {file}: {duckdb_error(error)}") from None
    return {name: str(kind) for name, kind, *_ in rows}


def _delimiter_of(con, probe: Source) -> str:
    """The delimiter of the text file ``probe`` names: ``probe.delimiter`` (its name's) unless that reads a single
    column and DuckDB's sniffer finds another of ``SNIFFED_DELIMITERS`` that reads more."""
    file = probe.files[0]
    if len(_describe(con, probe.scan(), file)) > 1:
        return probe.delimiter
    try:
        (sniffed,) = con.execute(
            f"SELECT Delimiter FROM sniff_csv({quote_literal(literal_path(file))}, "
            f"encoding = {quote_literal(probe.encoding)}, header = {str(probe.header).lower()})"
        ).fetchall()[0]
    except Exception:  # noqa: BLE001 - no delimiter found: the name's stays, and the columns are reported as read
        return probe.delimiter
    if sniffed in SNIFFED_DELIMITERS and sniffed != probe.delimiter:
        if len(_describe(con, replace(probe, delimiter=sniffed).scan(), file)) > 1:
            return sniffed
    return probe.delimiter


def open_source(
    paths,
    fmt: str = "auto",
    delimiter: str | None = None,
    header: bool | None = None,
    encoding: str = "utf-8",
    typed_text: bool = False,
) -> Source:
    """The :class:`Source` of ``paths``, with every file's schema read and checked against the first's.

    Text files: every file's columns come from its header (``header``: default True) or, without one, are
    ``column0, column1, …`` by position; ``delimiter`` defaults to the format's (``,``; tab for .tsv and u.data;
    ``::`` for .dat), or, when that reads the first file as one column, to the one DuckDB's sniffer finds in it
    (:func:`_delimiter_of`). CommandError naming the file when one cannot be read or its columns differ from the
    first's.
    """
    import duckdb

    files = resolve_files(paths if isinstance(paths, list | tuple) else [paths])
    kind, default_delimiter = _format_of(files, fmt)
    if kind == "csv":
        header = True if header is None else header
    elif delimiter is not None or header is not None:
        raise CommandError(f"--delimiter and --header/--no-header apply to CSV/TSV input, not {kind}")
    schemas = []
    with duckdb.connect() as con:
        if kind == "csv" and delimiter is None:
            probe = Source((str(files[0]),), kind, {}, default_delimiter or ",", header, encoding, typed_text)
            delimiter = _delimiter_of(con, probe)
        for file in files:
            probe = Source((str(file),), kind, {}, delimiter or ",", bool(header), encoding, typed_text)
            columns = _describe(con, probe.scan(), file)
            if kind == "csv" and not header:
                columns = {f"column{i}": kind_ for i, kind_ in enumerate(columns.values())}
            schemas.append(columns)
    first = schemas[0]
    for file, columns in zip(files[1:], schemas[1:], strict=True):
        if kind == "csv" and list(columns) != list(first):
            raise CommandError(
                f"the parts' columns disagree: {files[0]} has {', '.join(first)}; {file} has {', '.join(columns)}"
            )
        if kind != "csv":
            differ = sorted(
                f"{name} ({first.get(name, 'absent')} vs {columns.get(name, 'absent')})"
                for name in set(first) | set(columns)
                if first.get(name) != columns.get(name)
            )
            if differ:
                raise CommandError(f"the parts' schemas disagree: {files[0]} vs {file}: {'; '.join(differ)}")
    return Source(tuple(str(f) for f in files), kind, first, delimiter or ",", bool(header), encoding, typed_text)
