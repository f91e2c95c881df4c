"""CLI commands of the data layer: ``bigrank generate``, ``bigrank ingest``, ``bigrank data-info``."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from bigrank.errors import CommandError

# The generators and readers (numpy, torch, pyarrow) are imported when a command runs, not when the CLI registers its
# commands, so that `bigrank --help` starts in a fraction of a second.


def register(subparsers) -> None:
    """Add the data sub-commands to the ``bigrank`` parser."""
    generate = subparsers.add_parser(
        "generate",
        help="generate a synthetic dataset (preset) or fractal-expand seed ratings",
        description="Generate a synthetic dataset: --preset demo|ml20m|ml1b, or --seed-ratings PATH --expand AxB "
        "(randomized fractal expansion of real or existing ratings). Deterministic for a given --seed.",
    )
    source = generate.add_mutually_exclusive_group(required=True)
    source.add_argument("--preset", choices=["demo", "ml20m", "ml1b"], help="built-in synthetic dataset")
    source.add_argument(
        "--seed-ratings",
        metavar="PATH",
        help="seed for the expansion: a MovieLens ratings file/directory or a bigrank dataset directory",
    )
    generate.add_argument("--expand", metavar="AxB", help="expansion multipliers with --seed-ratings, e.g. 16x32")
    generate.add_argument(
        "--target-ratings",
        type=float,
        default=None,
        help="with --seed-ratings: scale the keep probabilities so the expected size is this many ratings",
    )
    generate.add_argument("--out", required=True, help="output dataset directory (new or empty)")
    generate.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    generate.add_argument("--resume", action="store_true", help="continue an interrupted run in --out")
    generate.add_argument("--no-progress", action="store_true", help="no progress bar")
    generate.set_defaults(func=run_generate)

    ingest = subparsers.add_parser(
        "ingest",
        help="ingest interaction logs (Parquet, CSV/TSV, JSON Lines; MovieLens) into the bigrank layout",
        description="Read interaction logs (files, directories of parts, globs; Parquet, CSV/TSV, JSON Lines, "
        "text compressed with .gz/.zst) with a column mapping, clean them (null ids, duplicates, --min-rating on "
        "the merged rating, k-core), give users and items dense ids (their original ids kept in users/items.parquet) "
        "and split them. A MovieLens directory (ratings.csv / ratings.dat / u.data) needs no mapping. Runs on DuckDB "
        "here, in bounded memory (spills to disk), or on a Ray cluster with --address.",
    )
    ingest.add_argument(
        "paths",
        metavar="PATH",
        nargs="*",
        help="input files, directories of parts or globs (with --split given: or --train/--valid/--test instead)",
    )
    ingest.add_argument("--out", required=True, help="output dataset directory (new or empty)")
    columns = ingest.add_argument_group("columns (a name, or a 0-based position for headerless text)")
    columns.add_argument("--user", metavar="COL", help="user id column (integers or strings)")
    columns.add_argument("--item", metavar="COL", help="item id column (integers or strings)")
    columns.add_argument("--time", metavar="COL", help="time column: epoch numbers (s, ms, us, ns) or ISO-8601")
    value = columns.add_mutually_exclusive_group()
    value.add_argument("--rating", metavar="COL", help="explicit rating column (a number)")
    value.add_argument("--weight", metavar="COL", help="implicit weight column (a number: plays, quantity, …)")
    columns.add_argument(
        "--time-unit",
        choices=["auto", "s", "ms", "us", "ns"],
        default="auto",
        help="epoch unit of numeric times (auto: by the size of the first rows' numbers, checked against the "
        "whole column)",
    )
    reading = ingest.add_argument_group("reading")
    reading.add_argument(
        "--format",
        **_format_option(
            "input format (auto: from the file names); user-lines: one line per user, 'uid item item …' (the "
            "graph-CF benchmarks' train.txt/test.txt; no column options)",
            "user-lines",
        ),
    )
    reading.add_argument(
        "--delimiter",
        help="CSV delimiter (default: , and tab for .tsv, :: for .dat; or the one found in the first file when "
        "that reads one column)",
    )
    header = reading.add_mutually_exclusive_group()
    header.add_argument(
        "--header", dest="header", action="store_true", default=None, help="CSV files have a header line (default)"
    )
    header.add_argument(
        "--no-header", dest="header", action="store_false", help="CSV files have no header: columns by position"
    )
    cleaning = ingest.add_argument_group("cleaning")
    cleaning.add_argument(
        "--min-rating",
        type=float,
        help="keep the pairs rated at least this (explicit -> implicit), tested on a pair's rating after --dedup "
        "merged its rows: the latest (last), earliest (first), best (max) or total (sum) rating",
    )
    cleaning.add_argument(
        "--dedup",
        choices=["last", "first", "sum", "max"],
        help="merge a pair's rows: latest/earliest by time, or sum/max of rating or weight "
        "(default last with --time, else max)",
    )
    cleaning.add_argument(
        "--min-user-items",
        type=int,
        default=1,
        metavar="N",
        help="k-core: users keep at least N items (default 1: off)",
    )
    cleaning.add_argument(
        "--min-item-users",
        type=int,
        default=1,
        metavar="M",
        help="k-core: items keep at least M users (default 1: off)",
    )
    splits = ingest.add_argument_group("split")
    splits.add_argument(
        "--split",
        choices=["random", "last", "time", "given"],
        default="random",
        help="random: fractions of the pairs (default); last: per user by time; time: a global cut; given: the "
        "data's own split (--train/--valid/--test, or --split-column)",
    )
    splits.add_argument(
        "--fractions", default=None, help="train,valid,test fractions (random and last; default 0.8,0.1,0.1)"
    )
    for name in ("train", "valid", "test"):
        splits.add_argument(
            f"--{name}",
            metavar="PATH",
            action="append",
            help=f"--split given: the {name} input (repeatable; files, directories of parts or globs)",
        )
    splits.add_argument(
        "--split-column",
        metavar="COL",
        help="--split given: the column naming each row's split (train, valid or validation, test, or 0/1/2)",
    )
    splits.add_argument(
        "--valid-fraction",
        type=float,
        default=None,
        metavar="F",
        help="--split given without a valid input: carve valid from train, the train pairs a --split random "
        "--fractions 1-F,F,0 --seed S would put in valid (default 0.1; 0: no valid split)",
    )
    splits.add_argument(
        "--valid-from", metavar="T", help="--split time: valid from this time (epoch seconds or ISO-8601)"
    )
    splits.add_argument("--test-from", metavar="T", help="--split time: test from this time")
    splits.add_argument("--seed", type=int, default=0, help="seed of the random split (default 0)")
    items = ingest.add_argument_group("item attributes")
    items.add_argument(
        "--items-file", metavar="PATH", help="a file of item attributes (titles, categories, …) carried to the export"
    )
    items.add_argument("--item-key", metavar="COL", help="its column holding the item id")
    items.add_argument(
        "--items-format", **_format_option("the items file's format (auto: from its name, as the log's)")
    )
    items.add_argument(
        "--items-delimiter",
        metavar="C",
        help="the items file's delimiter (default: its name's, or the one found in it when that reads one column)",
    )
    ingest.add_argument(
        "--vocab-from",
        metavar="OLD_DATASET",
        help="keep the dense ids of this earlier ingested dataset: its users and items keep their ids, new ones are "
        "appended, ids without rows here stay reserved (for `bigrank train --init-from`)",
    )
    engine = ingest.add_argument_group("engine")
    engine.add_argument(
        "--memory-limit",
        help="DuckDB memory before it spills to disk: 8GB, or a fraction of memory (default 0.5): of the machine's, "
        "or of a container's cgroup limit when lower; with --address: per node, shared by its stores",
    )
    engine.add_argument(
        "--threads",
        type=int,
        help="DuckDB threads (default: the CPUs available, fewer under a container's CPU quota); with --address: "
        "per store (default: the node's CPUs over its stores)",
    )
    engine.add_argument(
        "--address",
        help="run on a Ray cluster (auto, HOST:6379, or local for a local Ray runtime); the inputs and --out must "
        "be at the same path on every node (shared storage: the read tasks' pieces and the stores live in "
        "OUT/.ingest)",
    )
    engine.add_argument(
        "--temp-dir", help="where the engine keeps its database and spill files (default: DIR/.ingest under --out)"
    )
    engine.add_argument(
        "--buckets",
        type=int,
        help="with --address: buckets of users, one DuckDB (a Ray actor) each (default: the cluster's CPUs)",
    )
    ingest.add_argument("--no-progress", action="store_true", help="no progress lines")
    ingest.set_defaults(func=run_ingest)

    info = subparsers.add_parser(
        "data-info", help="print a dataset's manifest figures", description="Print the figures of a dataset."
    )
    info.add_argument("root", metavar="ROOT", help="dataset directory")
    info.add_argument("--check", action="store_true", help="also validate every file against the manifest")
    info.set_defaults(func=run_data_info)


def _format_option(help_text: str, *more: str) -> dict:
    """The settings of a format option (``--format``, ``--items-format``): the formats a file is read as, and
    ``more`` (the log's ``user-lines``)."""
    return {"default": "auto", "choices": ["auto", "parquet", "csv", "tsv", "jsonl", *more], "help": help_text}


def load_seed_pairs(path: str | Path):
    """(users, items, num_users, num_items) of a seed: a bigrank dataset (all splits) or MovieLens ratings (read
    through the MovieLens preset of ``bigrank ingest``; ids numbered in the order of the original ids)."""
    path = Path(path)
    import numpy as np

    from bigrank.data import manifest as layout
    from bigrank.data.stream import iter_row_groups

    if (path / layout.MANIFEST_NAME).is_file():
        manifest = layout.load_manifest(path)
        users, items = [], []
        for split in manifest["splits"]:
            for group in iter_row_groups(path, split):
                users.append(group["user_id"])
                items.append(group["item_id"])
        users, items = np.concatenate(users), np.concatenate(items)
        num_users, num_items = manifest["num_users"], manifest["num_items"]
    else:
        users, items = _movielens_pairs(path)
        _, users = np.unique(users, return_inverse=True)
        _, items = np.unique(items, return_inverse=True)
        num_users, num_items = int(users.max()) + 1, int(items.max()) + 1
    keys = np.unique(users.astype(np.int64) * num_items + items)
    return (keys // num_items).astype(np.int32), (keys % num_items).astype(np.int32), num_users, num_items


def _movielens_pairs(path: Path):
    """The (user, item) original ids (int64 arrays) of the MovieLens ratings at ``path``."""
    from bigrank.data.ingest import IngestOptions, movielens
    from bigrank.data.ingest.sources import duckdb_error, open_source, quote_identifier

    paths, options = movielens.apply_preset([path], IngestOptions())
    if options.preset != "movielens":
        raise CommandError(
            f"{path} is neither a bigrank dataset nor MovieLens ratings ({', '.join(movielens.RATING_FILES)})"
        )
    source = open_source(paths, "csv", options.delimiter, options.header)
    user, item = (quote_identifier(source.column(c, "seed")) for c in ("0", "1"))
    import duckdb

    try:
        columns = duckdb.sql(
            f"SELECT CAST({user} AS BIGINT) AS u, CAST({item} AS BIGINT) AS i FROM {source.scan()}"
        ).fetchnumpy()
    except Exception as error:  # DuckDB's conversion/IO errors name the file and line
        raise CommandError(f"cannot read the seed ratings {paths[0]}: {duckdb_error(error)}") from None
    return columns["u"], columns["i"]


def run_generate(args: argparse.Namespace) -> int:
    from bigrank.data import synthetic
    from bigrank.data.expansion import expand_ratings, parse_multiplier

    started = time.perf_counter()
    if args.preset:
        if args.expand or args.target_ratings is not None:
            raise CommandError("--expand and --target-ratings go with --seed-ratings, not --preset")
        manifest = synthetic.generate(
            args.preset, args.out, seed=args.seed, resume=args.resume, progress=not args.no_progress
        )
    else:
        if not args.expand:
            raise CommandError("--seed-ratings needs --expand AxB (e.g. --expand 16x32)")
        multiplier = parse_multiplier(args.expand)
        users, items, num_users, num_items = load_seed_pairs(args.seed_ratings)
        manifest = expand_ratings(
            users,
            items,
            num_users,
            num_items,
            args.out,
            multiplier=multiplier,
            seed=args.seed,
            resume=args.resume,
            progress=not args.no_progress,
            source=f"expansion:{Path(args.seed_ratings).resolve()}",
            generator={"seed_path": str(Path(args.seed_ratings).resolve())},
            target_ratings=args.target_ratings,
        )
    print(format_manifest(manifest, args.out))
    print(f"done in {time.perf_counter() - started:.1f}s", file=sys.stderr)
    return 0


def run_ingest(args: argparse.Namespace) -> int:
    from bigrank.data.ingest import IngestOptions, ingest
    from bigrank.data.ingest.options import parse_fractions

    given = _given_split(args)
    user_lines = args.format == "user-lines"
    split = args.split if given is None else "random"  # the pipeline's own split: the carve (ingest_prepared)
    options = IngestOptions(
        user=args.user,
        item=args.item,
        time=args.time,
        rating=args.rating,
        weight=args.weight,
        format="auto" if user_lines else args.format,
        delimiter=args.delimiter,
        header=args.header,
        time_unit=args.time_unit,
        min_rating=args.min_rating,
        dedup=args.dedup,
        min_user_items=args.min_user_items,
        min_item_users=args.min_item_users,
        split=split,
        fractions=parse_fractions(args.fractions or "0.8,0.1,0.1"),
        valid_from=args.valid_from,
        test_from=args.test_from,
        seed=args.seed,
        items_file=args.items_file,
        item_key=args.item_key,
        items_format=args.items_format,
        items_delimiter=args.items_delimiter,
        memory_limit=args.memory_limit,
        threads=args.threads,
        temp_dir=args.temp_dir,
        address=args.address,
        buckets=args.buckets,
        vocab_from=args.vocab_from,
        progress=not args.no_progress,
    )
    if given is not None or user_lines:
        from bigrank.data.ingest.given import ingest_prepared

        manifest = ingest_prepared(args.paths, args.out, options, given=given, user_lines=user_lines)
    else:
        if not args.paths:
            raise CommandError("give the input PATH (files, directories of parts or globs)")
        manifest = ingest(args.paths, args.out, options)
    print(format_manifest(manifest, args.out))
    return 0


def _given_split(args: argparse.Namespace):
    """The ``GivenSplit`` of ``--split given`` (None for the other splits); CommandError for options that do not
    go with the split chosen."""
    inputs = {name: getattr(args, name) for name in ("train", "valid", "test") if getattr(args, name)}
    if args.split != "given":
        if inputs or args.split_column or args.valid_fraction is not None:
            raise CommandError("--train/--valid/--test, --split-column and --valid-fraction go with --split given")
        return None
    from bigrank.data.ingest.given import DEFAULT_VALID_FRACTION, GivenSplit

    if args.fractions is not None:
        raise CommandError("--fractions goes with --split random or last; --split given keeps the data's own split")
    if inputs and args.split_column:
        raise CommandError("--split given reads --train/--valid/--test or --split-column, not both")
    if args.split_column and not args.paths:
        raise CommandError("--split-column COL names a column of the log: give its PATH")
    fraction = DEFAULT_VALID_FRACTION if args.valid_fraction is None else args.valid_fraction
    if "valid" in inputs and args.valid_fraction is not None:
        raise CommandError("--valid-fraction carves valid from train; a --valid input is given")
    return GivenSplit(inputs=inputs or None, column=args.split_column, valid_fraction=fraction).check()


def run_data_info(args: argparse.Namespace) -> int:
    from bigrank.data import manifest as layout

    manifest = layout.validate_dataset(args.root) if args.check else layout.load_manifest(args.root)
    print(format_manifest(manifest, args.root))
    if args.check:
        print("files: all present and consistent with the manifest")
    return 0


def format_ingest(record: dict) -> list[str]:
    """What an ingest did (the manifest's ``ingest`` entry): rows read, rows each rule dropped, k-core rounds."""
    counts, options, inputs = record["counts"], record["options"], record["inputs"]

    def row(label: str, value: int, what: str = "") -> str:
        return f"  {label:<26}{value:>15,}{' ' + what if what else ''}"

    ids = ", ".join(f"{name} {kind}" for name, kind in record["id_types"].items())
    lines = [
        f"ingest       {inputs['files']:,} {inputs['format']} file(s), {inputs['bytes'] / 1e6:,.1f} MB, read with "
        f"{record['engine']} in {record['seconds']:.1f} s; original ids: {ids}",
        row("rows read", counts["rows_read"]),
        row("null or empty user id", counts["dropped_null_user"], "dropped"),
        row("null or empty item id", counts["dropped_null_item"], "dropped"),
    ]
    lines.append(row(f"duplicates ({options['dedup']})", counts["merged_duplicates"], "merged"))
    if options.get("min_rating") is not None:  # pairs, after the merge
        lines.append(row(f"pairs rated below {options['min_rating']:g}", counts["dropped_below_min_rating"], "dropped"))
    if options["min_user_items"] > 1 or options["min_item_users"] > 1:
        lines.append(
            f"  k-core ({options['min_user_items']} items a user, {options['min_item_users']} users an item): "
            f"{counts['k_core_rounds']} round(s) dropped {counts['k_core_dropped_rows']:,} rows, "
            f"{counts['k_core_dropped_users']:,} users, {counts['k_core_dropped_items']:,} items"
        )
    split = record["split"]
    if split["mode"] == "time":
        how = f"valid from {split['valid_from']}, test from {split['test_from']}"
    elif split["mode"] == "given":
        how = "by " + (f"column {split['column']!r}" if split["by"] == "column" else "input")
        if split["valid"] == "carved":
            how += f"; valid carved from train: fraction {split['valid_fraction']:g}, seed {split['seed']}"
        if split["pairs_in_several_splits"]:
            how += f"; {split['pairs_in_several_splits']:,} pairs given in several splits kept in the first"
        if split["test_users_without_train"]:
            how += f"; {split['test_users_without_train']:,} test users without train pairs"
    else:
        how = "/".join(f"{f:g}" for f in split["fractions"]) + (
            f", seed {options['seed']}" * (split["mode"] == "random")
        )
    lines.append(f"split        {split['mode']} ({how})")
    if split.get("kept_from_parent"):
        kept = ", ".join(f"{n:,} {name}" for name, n in split["kept_from_parent"].items())
        lines.append(f"  pairs keeping the parent's split: {kept}")
    return lines


def format_manifest(manifest: dict, root) -> str:
    """Human-readable summary of a manifest: ids, rated ids, ratings and files per split."""
    lines = [
        f"dataset      {root}",
        f"source       {manifest['source']}  (seed {manifest['seed']})",
        f"users        {manifest['num_users']:,}"
        + (f"  ({manifest['num_rated_users']:,} with ratings)" if "num_rated_users" in manifest else ""),
        f"items        {manifest['num_items']:,}"
        + (f"  ({manifest['num_rated_items']:,} rated)" if "num_rated_items" in manifest else ""),
    ]
    total = 0
    for name, split in manifest["splits"].items():
        size = sum(split.get("file_bytes", [])) / 1e6
        groups = sum(len(g) for g in split["row_groups"])
        lines.append(
            f"{name:<12} {split['rows']:>15,} ratings  {len(split['files']):>5} files  {groups:>6} row groups"
            f"  {size:,.1f} MB"
        )
        total += split["rows"]
    lines.append(f"{'total':<12} {total:>15,} ratings")
    if manifest.get("ingest"):
        lines.extend(format_ingest(manifest["ingest"]))
    parent = manifest.get("parent")
    if parent:
        sizes = manifest.get("vocabulary", {})
        grown = ", ".join(f"{k} {v['before']:,} -> {v['after']:,}" for k, v in sizes.items())
        lines.append(f"ids from     {parent['root']} (dataset {parent['id']}; {grown})")
    if manifest.get("truth"):
        lines.append(f"truth        {manifest['truth']} (true user/item factors)")
    recorded = manifest.get("integrity")
    if recorded:
        lines.append(
            f"checksums    {recorded['checksum']} of {len(recorded['files'])} files (`bigrank verify {root}`), "
            "Parquet page checksums"
        )
    else:
        lines.append("checksums    none recorded (an older dataset): `bigrank verify` checks sizes and decoding only")
    return "\n".join(lines)
