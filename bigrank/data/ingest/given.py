"""A split the data comes with (``bigrank ingest --split given``), and inputs in the one-line-per-user layout.

A paper's table is reproduced on the paper's own split. The benchmark gives it as one input per split
(``--train PATH --test PATH [--valid PATH]``) or as a column naming each row's split (``--split-column COL``:
``train``, ``valid`` or ``validation``, ``test``, or 0/1/2)::

    bigrank ingest --split given --train gowalla/train.txt --test gowalla/test.txt --format user-lines --out data/g
    bigrank ingest log.parquet --user u --item i --split given --split-column fold --out data/log

How (:func:`ingest_prepared`): the pipeline (``bigrank.data.ingest.pipeline``) ingests the union of the inputs once,
into a staging dataset under ``--out``'s ``.ingest`` directory, with every step it takes for any log (cleaning,
dedup, k-core, vocabularies, ``--vocab-from``); then each pair goes to the split its input gave it, and the splits
are written into ``--out`` with the staging dataset's vocabularies. A pair given in several splits (a benchmark
whose train and test overlap) goes to the first of train, valid, test, and is counted (``pairs_in_several_splits``
in the manifest's ``ingest.split`` entry). The second pass costs about a plain ingest's write again.

Validation when the benchmark ships only train and test: the train pairs whose random-split key puts them in the
valid share of ``bigrank ingest --split random --fractions 1-f,f,0 --seed S`` go to valid (``--valid-fraction f``,
default 0.1; ``--seed``, default 0): the random split's own seeded per-pair key (the pipeline computes it, over the
pairs of every input), so about ``f`` of the train pairs, the same pairs on every run and machine. ``f = 0``
carves none. Training then sees the other train pairs, and validation (early stopping, ``bigrank tune``, the
baselines' hyper-parameters) the carved ones.

Evaluation of a given split follows the papers' protocol: a test user's rankings leave out every item of their
train and valid pairs (the manifest's ``eval_exclude``, ``bigrank.data.manifest.excluded_splits``), valid's their
train items.

Inputs in the one-line-per-user layout (``--format user-lines``, ``bigrank.data.ingest.user_lines``) are turned
into Parquet files of ``user, item`` pairs under the staging directory first, with any split.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from bigrank.data import manifest as layout
from bigrank.data.ingest.options import IngestOptions
from bigrank.data.ingest.pipeline import WORK_DIR, Progress, clear, prepare_out
from bigrank.data.ingest.sources import (
    duckdb_error,
    file_list,
    literal_path,
    open_source,
    quote_identifier,
    quote_literal,
    resolve_files,
)
from bigrank.errors import CommandError

__all__ = ["DEFAULT_VALID_FRACTION", "EVAL_EXCLUDE", "GivenSplit", "ingest_prepared"]

DEFAULT_VALID_FRACTION = 0.1
LABELS = {"train": 0, "valid": 1, "test": 2}
# The values a split column may hold (compared in lower case, trimmed).
COLUMN_VALUES = {"train": 0, "0": 0, "valid": 1, "validation": 1, "1": 1, "test": 2, "2": 2}
# What the rankings of each split leave out on a given split (bigrank.data.manifest.excluded_splits).
EVAL_EXCLUDE = {"valid": ["train"], "test": ["train", "valid"]}
STAGE = "given"  # under --out/.ingest (or --temp-dir): the converted inputs and the staging dataset


@dataclass(frozen=True)
class GivenSplit:
    """Where the split comes from: ``inputs`` (``{"train": paths, "test": paths[, "valid": paths]}``) or ``column``
    (a column of the log naming each row's split); ``valid_fraction``: the share of the train pairs carved into
    valid when no input or row is given to valid (the module docstring)."""

    inputs: Mapping[str, Sequence[str]] | None = None
    column: str | None = None
    valid_fraction: float = DEFAULT_VALID_FRACTION

    def check(self) -> GivenSplit:
        """CommandError naming the first problem."""
        if (self.inputs is None) == (self.column is None):
            raise CommandError("--split given reads --train PATH --test PATH [--valid PATH], or --split-column COL")
        if self.inputs is not None:
            unknown = sorted(set(self.inputs) - set(LABELS))
            if unknown:
                raise CommandError(f"a given split's inputs are train, valid and test, not {', '.join(unknown)}")
            missing = [name for name in ("train", "test") if not self.inputs.get(name)]
            if missing:
                raise CommandError(f"--split given needs --{' and --'.join(missing)} PATH")
        if not 0 <= float(self.valid_fraction) < 1:
            raise CommandError(f"--valid-fraction must lie in [0, 1), got {self.valid_fraction}")
        return self

    def carves(self) -> bool:
        """Whether valid is carved from train (no valid input; a split column is decided by its rows)."""
        return self.inputs is not None and not self.inputs.get("valid") and self.valid_fraction > 0


def ingest_prepared(
    paths: Sequence[str | Path],
    out: str | Path,
    options: IngestOptions,
    *,
    given: GivenSplit | None = None,
    user_lines: bool = False,
) -> dict:
    """Ingest with the steps the pipeline does not take: a ``given`` split (then ``paths`` are the log of a
    ``given.column``, or empty for ``given.inputs``) and/or inputs in the one-line-per-user layout
    (``user_lines``: ``options`` then names no columns). Returns the manifest of ``out``.

    ``options.split`` and ``options.fractions`` are the pipeline's split when there is no ``given`` split; with
    one, the pipeline runs the random split of the carve (the module docstring). Like ``ingest``: CommandError
    for bad input, and nothing is left in ``out`` (no manifest) when it fails or a signal stops it."""
    from bigrank.data.ingest import ingest
    from bigrank.signals import graceful_stop, raise_for

    given = given.check() if given is not None else None
    if given is None and not user_lines:
        raise ValueError("ingest_prepared is for a given split or user-lines inputs; call ingest otherwise")
    if given is not None and given.inputs is not None and paths:
        raise CommandError("with --train/--valid/--test, give no other PATH")
    if given is not None and given.column is not None and user_lines:
        raise CommandError("--split-column reads a column of the log; the user-lines layout has none")
    if user_lines:
        named = [flag for flag, value in _column_flags(options) if value is not None]
        if named:
            raise CommandError(f"--format user-lines names its own columns (user, item): drop {', '.join(named)}")
    inputs = dict(given.inputs) if given is not None and given.inputs is not None else {"log": list(paths)}
    inputs = {name: [str(p) for p in resolve_files(list(files))] for name, files in inputs.items() if files}
    if not inputs:
        raise CommandError("give the input files")
    out = Path(out)
    prepare_out(out)
    base = Path(options.temp_dir) if options.temp_dir is not None else out / WORK_DIR
    work = base / f"{STAGE}-{os.getpid()}"
    say = Progress(options.progress)
    try:
        with graceful_stop(raise_for):  # the conversion and the relabelling stop at once, cleaned up below
            work.mkdir(parents=True)
            read = _convert(inputs, work / "inputs", say) if user_lines else inputs
            if user_lines:
                options = replace(options, user="user", item="item", format="parquet", delimiter=None, header=None)
            staged_options, carve, fraction = options, False, 0.0
            if given is not None:
                carve = given.carves()
                if given.column is not None:  # its values are checked before the long pass
                    names_valid = _split_column_names_valid(read["log"], given.column, options)
                    carve = not names_valid and given.valid_fraction > 0
                fraction = given.valid_fraction if carve else 0.0
                # The carve is the pipeline's random split; with --vocab-from the given split decides, not the
                # parent's labels (which the pipeline's random split keeps otherwise).
                staged_options = replace(
                    options, split="random", fractions=(1.0 - fraction, fraction, 0.0), keep_parent_split=False
                )
            stage = work / "stage"
            try:
                staged = ingest([p for files in read.values() for p in files], stage, staged_options)
            except CommandError as error:
                if not (carve and str(error).startswith("the valid split has no rows")):
                    raise
                raise CommandError(  # the pipeline names its own rule: say that it is the carve's
                    f"--valid-fraction {fraction:g} carved no train pair into valid ({error}); give more pairs, a "
                    "larger --valid-fraction, or 0 for no valid split"
                ) from None
            if given is None:
                manifest = _move_dataset(stage, out, staged, inputs)
            else:
                manifest = _write_given(stage, out, staged, read, options, given, carve, inputs, user_lines, say)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        clear(out)
        raise
    shutil.rmtree(work, ignore_errors=True)
    shutil.rmtree(out / WORK_DIR, ignore_errors=True)
    say(f"done: {out} ({manifest['num_ratings']:,} ratings)")
    return manifest


def _column_flags(options: IngestOptions):
    return (
        ("--user", options.user), ("--item", options.item), ("--time", options.time), ("--rating", options.rating),
        ("--weight", options.weight), ("--delimiter", options.delimiter), ("--header/--no-header", options.header),
    )  # fmt: skip


def _convert(inputs: dict[str, list[str]], directory: Path, say) -> dict[str, list[str]]:
    """Each one-line-per-user file of ``inputs`` as a Parquet file of its pairs under ``directory``."""
    from bigrank.data.ingest.user_lines import user_lines_to_parquet

    directory.mkdir(parents=True)
    converted: dict[str, list[str]] = {}
    for name, files in inputs.items():
        converted[name] = []
        for index, file in enumerate(files):
            target = directory / f"{name}-{index:05d}.parquet"
            lines, pairs = user_lines_to_parquet(file, target)
            say(f"{file}: {lines:,} users' lines, {pairs:,} pairs")
            converted[name].append(str(target))
    return converted


def _inputs_record(inputs: dict[str, list[str]], fmt: str) -> dict:
    files = [file for group in inputs.values() for file in group]
    record = {"files": len(files), "format": fmt, "first": files[0], "bytes": sum(os.path.getsize(f) for f in files)}
    if set(inputs) != {"log"}:
        record["splits"] = {name: group for name, group in inputs.items()}
    return record


def _source(inputs: dict[str, list[str]]) -> str:
    first = next(iter(inputs.values()))
    return f"ingest:{first[0] if len(first) == 1 else Path(first[0]).parent}"


def _move_dataset(stage: Path, out: Path, staged: dict, inputs) -> dict:
    """Move the finished staging dataset of user-lines inputs into ``out`` (its paths are relative), naming the
    original inputs."""
    for child in stage.iterdir():
        if child.name != layout.MANIFEST_NAME:
            os.replace(child, out / child.name)
    manifest = dict(staged)
    manifest["source"] = _source(inputs)
    manifest["ingest"] = dict(staged["ingest"], inputs=_inputs_record(inputs, "user-lines"))
    layout.write_json_atomic(out / layout.MANIFEST_NAME, manifest)  # last: the mark of a complete dataset
    return manifest


# Keys of a manifest that describe its split files (recomputed for the given split's files); the others carry over.
_FILE_KEYS = ("format_version", "num_ratings", "splits", "schema", "integrity", "user_index")


def _write_given(
    stage: Path, out: Path, staged: dict, read, options, given: GivenSplit, carve: bool, inputs, user_lines, say
):
    """Label every pair of the staging dataset with its given split, write the splits into ``out`` beside the
    staging vocabularies and the manifest (with the per-user indexes)."""
    import duckdb

    from bigrank.data.ingest import _Steps
    from bigrank.data.user_index import write_manifest_with_indexes

    con = duckdb.connect(
        config={
            "memory_limit": f"{max(options.memory_bytes() >> 20, 64)}MB",
            "threads": options.thread_count(),
            "temp_directory": str(stage.parent / "spill"),
            "preserve_insertion_order": False,
        }
    )

    class Stop:  # what _Steps interrupts on a signal: the running query
        @staticmethod
        def interrupt() -> None:
            con.interrupt()

    try:
        split_files, record = _Steps().run(
            lambda: _relabel(con, stage, out, staged, read, options, given, carve, say), Stop
        )
    except duckdb.Error as error:
        raise CommandError(f"the given split: {duckdb_error(error)}") from None
    finally:
        con.close()
    for name in layout.SIDE_FILES:
        if (stage / name).is_file():
            os.replace(stage / name, out / name)
    fmt = "user-lines" if user_lines else staged["ingest"]["inputs"]["format"]
    ingest_record = dict(staged["ingest"], inputs=_inputs_record(inputs, fmt))
    ingest_record["options"] = dict(ingest_record["options"], split="given", fractions=None)
    ingest_record["split"] = record
    extra = {k: v for k, v in staged.items() if k not in _FILE_KEYS and k not in layout.REQUIRED_KEYS}
    from bigrank.signals import graceful_stop, raise_for

    with graceful_stop(raise_for):
        return write_manifest_with_indexes(
            out,
            num_users=staged["num_users"],
            num_items=staged["num_items"],
            split_files=split_files,
            seed=staged["seed"],
            source=_source(inputs),
            generator=dict(staged["generator"], split="given", fractions=None),
            extra={**extra, "ingest": ingest_record, "eval_exclude": EVAL_EXCLUDE},
            progress=say,
        )


def _labelled_scan(files, options: IngestOptions, label_sql, id_types: Mapping[str, str] | None = None) -> str:
    """``SELECT u, i, g, raw`` of the rows of ``files`` (read with ``options``' format and columns): ids as the
    ingest reads them, cast to the vocabularies' ``id_types`` when given; ``g`` the split label (``label_sql``: a
    constant, or a function of the source giving ``(label SQL, raw value SQL)``), ``raw`` the split column's
    value as text (NULL for a constant label)."""
    from bigrank.data.ingest.store import Columns

    source = open_source(files, options.format, options.delimiter, options.header, options.encoding)
    columns = Columns(
        source, source.column(options.user, "--user"), source.column(options.item, "--item"), None, None, "s"
    )
    kinds = {"int64": "BIGINT", "string": "VARCHAR"}
    user, item = (
        f"TRY_CAST({columns.id_sql(name)} AS {kinds[id_types[role]]})" if id_types else columns.id_sql(name)
        for role, name in (("user", columns.user), ("item", columns.item))
    )
    label, raw = label_sql(source) if callable(label_sql) else (str(label_sql), "NULL")
    return f"SELECT {user} AS u, {item} AS i, {label} AS g, {raw} AS raw FROM {source.scan()}"


def _column_label(column: str):
    """``(label SQL, raw SQL)`` of a row from the split column ``column`` (the label NULL for a value naming no
    split), as a function of the source (``_labelled_scan``)."""

    def label(source) -> tuple[str, str]:
        raw = f"CAST({quote_identifier(source.column(column, '--split-column'))} AS VARCHAR)"
        cases = " ".join(f"WHEN {quote_literal(value)} THEN {code}" for value, code in COLUMN_VALUES.items())
        return f"(CASE lower(trim({raw})) {cases} END)", raw

    return label


def _split_column_names_valid(files, column: str, options: IngestOptions) -> bool:
    """Whether a row of the split column ``column`` names valid. CommandError naming a value that names no split
    (rows with both ids)."""
    import duckdb

    scan = _labelled_scan(files, options, _column_label(column))
    con = duckdb.connect()
    try:
        bad, valid, example = con.execute(
            "SELECT count(*) FILTER (WHERE g IS NULL), count(*) FILTER (WHERE g = 1), "
            f"first(raw) FILTER (WHERE g IS NULL) FROM ({scan}) WHERE u IS NOT NULL AND i IS NOT NULL"
        ).fetchall()[0]
    except duckdb.Error as error:
        raise CommandError(f"--split-column {column}: {duckdb_error(error)}") from None
    finally:
        con.close()
    if bad:
        shown = "an empty value" if example is None else repr(example)
        raise CommandError(
            f"--split-column {column}: {bad:,} row(s) hold {shown} or another value naming no split (train, valid "
            "or validation, test, or 0/1/2)"
        )
    return bool(valid)


def _relabel(con, stage: Path, out: Path, staged: dict, read, options, given: GivenSplit, carved: bool, say):
    """The given split's rows of each split written into ``out``; returns ``(split files, the record)``."""
    id_types = staged["ingest"]["id_types"]
    if given.column is not None:
        scans = [_labelled_scan(read["log"], options, _column_label(given.column), id_types)]
    else:
        scans = [_labelled_scan(files, options, LABELS[name], id_types) for name, files in read.items()]
    con.execute(
        "CREATE TABLE labelled AS SELECT u, i, min(g) AS g, max(g) AS g_max "
        f"FROM ({' UNION ALL '.join(scans)}) WHERE u IS NOT NULL AND i IS NOT NULL GROUP BY u, i"
    ).fetchall()
    given_valid = bool(con.execute("SELECT count(*) FROM labelled WHERE g = 1").fetchall()[0][0])
    vocabulary = {name: quote_literal(literal_path(stage / name)) for name in ("users.parquet", "items.parquet")}
    con.execute(
        "CREATE TABLE given AS SELECT users.user_id, items.item_id, labelled.g, labelled.g_max FROM labelled "
        f"JOIN read_parquet({vocabulary['users.parquet']}) users ON labelled.u = users.original_id "
        f"JOIN read_parquet({vocabulary['items.parquet']}) items ON labelled.i = items.original_id"
    ).fetchall()
    parts = []
    for label, name in enumerate(("train", "valid")):  # the staging split: train, and the carve's valid
        files = [stage / f for f in staged["splits"][name]["files"]]
        if files:
            parts.append(f"SELECT *, {label} AS carved FROM read_parquet({file_list(files)})")
    con.execute(
        "CREATE TABLE final AS SELECT rows.* EXCLUDE (carved), given.g, given.g_max, "
        f"(CASE WHEN given.g = 0 THEN {'rows.carved' if carved else '0'} ELSE given.g END)::UTINYINT AS label "
        f"FROM ({' UNION ALL BY NAME '.join(parts)}) rows LEFT JOIN given USING (user_id, item_id)"
    ).fetchall()
    unlabelled = con.execute("SELECT count(*) FROM final WHERE g IS NULL").fetchall()[0][0]
    if unlabelled:  # every pair of the staging dataset came from an input row: a bug, not bad input
        raise RuntimeError(f"{unlabelled} pairs of the staging dataset {stage} have no given split")
    counts = dict(con.execute("SELECT label, count(*) FROM final GROUP BY label").fetchall())
    rows = {name: int(counts.get(code, 0)) for name, code in LABELS.items()}
    for name in ("train", "test") + (("valid",) if carved or given_valid else ()):
        if rows[name] == 0:
            how = f"--valid-fraction {given.valid_fraction} of the train pairs" if name == "valid" else "its input"
            raise CommandError(f"the {name} split has no rows ({how}); {sum(rows.values()):,} pairs in all")
    several, without_train = con.execute(
        "SELECT count(*) FILTER (WHERE g <> g_max), count(DISTINCT user_id) FILTER (WHERE label = 2 AND user_id NOT IN "
        "(SELECT user_id FROM final WHERE label = 0)) FROM final"
    ).fetchall()[0]
    columns = [name for name in ("user_id", "item_id", "rating", "weight", "timestamp") if name in staged["schema"]]
    split_files = {}
    for name, code in LABELS.items():
        reader = con.sql(
            f"SELECT {', '.join(columns)} FROM final WHERE label = {code} ORDER BY user_id, item_id"
        ).to_arrow_reader(layout.ROW_GROUP_SIZE)
        split_files[name] = layout.write_split_batches(out, name, reader)
    say("given split " + ", ".join(f"{name} {count:,}" for name, count in rows.items()))
    if several:
        say(f"{several:,} pairs were given in more than one split: each kept in the first of train, valid, test")
    record = {
        "mode": "given",
        "by": "column" if given.column is not None else "inputs",
        "valid": "carved" if carved else "given" if rows["valid"] else "none",
        "rows": rows,
        "pairs_in_several_splits": int(several),
        "test_users_without_train": int(without_train),
    }
    if given.column is not None:
        record["column"] = given.column
    if carved:
        record.update(valid_fraction=float(given.valid_fraction), seed=int(options.seed))
    return split_files, record
