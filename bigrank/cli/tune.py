"""``bigrank tune``: the command line."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from bigrank.config import (
    ConfigError,
    add_override_argument,
    load_config,
)
from bigrank.signals import raise_for
from bigrank.tune.search import run_search
from bigrank.tune.space import (
    load_space,
)


def register(subparsers) -> None:
    """Add ``bigrank tune`` to the ``bigrank`` parser."""
    parser = subparsers.add_parser(
        "tune",
        help="hyper-parameter search on Ray Tune (ASHA); resumes when run again",
        description="Search the config keys of SPACE around CONFIG: every trial is a bigrank training run. Writes "
        "DIR/trials.csv, DIR/trials.txt and DIR/best.yaml (ready for `bigrank train`). Running the same command "
        "again resumes an interrupted search.",
    )
    parser.add_argument("config", metavar="CONFIG", help="base YAML config of every trial")
    parser.add_argument("--space", required=True, metavar="SPACE", help="search-space YAML file")
    parser.add_argument("--trials", type=int, default=None, help="samples of the space (default: the space file's)")
    parser.add_argument("--out", default=None, help="experiment directory (default: RUN_DIR-tune of CONFIG)")
    parser.add_argument(
        "--address",
        default=None,
        help="Ray cluster to join (HOST:6379 or ray://HOST:10001; default: ray.address, RAY_ADDRESS, else an "
        "embedded local runtime)",
    )
    parser.add_argument("--max-concurrent", type=int, default=None, help="trials at once (default: CPUs allow)")
    parser.add_argument("--time-budget", type=float, default=None, metavar="SECONDS", help="stop the search then")
    parser.add_argument(
        "--no-base-trial",
        dest="base_trial",
        action="store_false",
        help="sample every trial (default: the first trial runs CONFIG's own values of the sampled keys when they "
        "lie in the space)",
    )
    add_override_argument(parser)
    parser.set_defaults(func=run_tune, resumable=True)


def run_tune(args: argparse.Namespace) -> int:
    from bigrank.data.manifest import load_manifest

    if args.trials is not None and args.trials < 1:
        raise ConfigError(f"--trials must be >= 1, got {args.trials}")
    config = load_config(args.config, args.overrides)
    space = load_space(args.space)
    load_manifest(config.data.root)  # a missing dataset is reported before Ray starts
    out = Path(args.out) if args.out else Path(config.run_dir + "-tune")
    result = run_search(
        config,
        space,
        out,
        trials=args.trials,
        address=args.address,
        max_concurrent=args.max_concurrent,
        time_budget_s=args.time_budget,
        base_trial=args.base_trial,
    )
    print(result.table)
    print(f"\ntrials: {result.out / 'trials.csv'}")
    if result.stopped_by is not None:  # the CLI says how to resume, and exits 130 / 143
        raise_for(result.stopped_by)
    if result.best_config is not None:
        print(f"best config: {result.best_config}  (bigrank train {result.best_config})")
        return 0
    statuses = [row["status"] for row in result.rows]
    counts = ", ".join(f"{statuses.count(status)} {status}" for status in sorted(set(statuses))) or "none ran"
    print(f"no trial finished ({counts}): no best config written", file=sys.stderr)
    if statuses and set(statuses) == {"error"}:
        first = result.rows[0]
        print(f"every trial failed; trial {first['trial']}: {first['error']}", file=sys.stderr)
    else:
        print(f"see {result.out / 'trials.txt'}; an interrupted search resumes with the same command", file=sys.stderr)
    return 1  # no best config: a script that goes on to `bigrank train DIR/best.yaml` must not
