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
        help="ingest MovieLens ratings into the bigrank Parquet layout",
        description="Read MovieLens ratings.csv / ratings.dat / u.data, remap ids densely and split them.",
    )
    ingest.add_argument("path", metavar="PATH", help="ratings file, or the directory that holds it")
    ingest.add_argument("--out", required=True, help="output dataset directory (new or empty)")
    ingest.add_argument(
        "--split",
        choices=["random", "last"],
        default="random",
        help="random: 80/10/10 over (user, item) pairs (default); last: per-user by timestamp",
    )
    ingest.add_argument("--seed", type=int, default=0, help="random seed of the split (default 0)")
    ingest.set_defaults(func=run_ingest)

    info = subparsers.add_parser(
        "data-info", help="print a dataset's manifest figures", description="Print the figures of a dataset."
    )
    info.add_argument("root", metavar="ROOT", help="dataset directory")
    info.add_argument("--check", action="store_true", help="also validate every file against the manifest")
    info.set_defaults(func=run_data_info)


def load_seed_pairs(path: str | Path):
    """(users, items, num_users, num_items) of a seed: a bigrank dataset (all splits) or MovieLens ratings."""
    path = Path(path)
    import numpy as np

    from bigrank.data import manifest as layout
    from bigrank.data.movielens import read_ratings
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
        ratings = read_ratings(path)
        _, users = np.unique(ratings["user"], return_inverse=True)
        _, items = np.unique(ratings["item"], return_inverse=True)
        num_users, num_items = int(users.max()) + 1, int(items.max()) + 1
    keys = np.unique(users.astype(np.int64) * num_items + items)
    return (keys // num_items).astype(np.int32), (keys % num_items).astype(np.int32), num_users, num_items


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
    from bigrank.data.movielens import ingest

    manifest = ingest(args.path, args.out, split=args.split, seed=args.seed)
    print(format_manifest(manifest, args.out))
    return 0


def run_data_info(args: argparse.Namespace) -> int:
    from bigrank.data import manifest as layout

    manifest = layout.validate_dataset(args.root) if args.check else layout.load_manifest(args.root)
    print(format_manifest(manifest, args.root))
    if args.check:
        print("files: all present and consistent with the manifest")
    return 0


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
