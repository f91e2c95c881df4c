"""CLI commands of the trainer: ``bigrank train``, ``bigrank evaluate``, ``bigrank export``.

Each parses its arguments and calls the run layer (``bigrank.run``): ``train`` runs the pre-flight and hands
the config to Ray Train (an embedded local Ray runtime, or the cluster of ``--address``) or to ``workers``
local gloo processes (``--launcher local``, no Ray). Running the same command again
resumes from the run's newest checkpoint. ``evaluate`` and ``export`` load a run's newest checkpoint in the
same number of local processes by default (``--workers N``: any number; the checkpoint is resharded).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from bigrank.config import add_override_argument, load_config


def register(subparsers) -> None:
    """Add the trainer sub-commands to the ``bigrank`` parser."""
    train = subparsers.add_parser(
        "train",
        help="train a model from a YAML config (resumes from the run's last checkpoint)",
        description="Train the model of CONFIG. Any key can be overridden with --set section.key=value (YAML "
        "value). Running the same command again continues from the last checkpoint in run_dir.",
    )
    train.add_argument("config", metavar="CONFIG", help="YAML config file (see configs/)")
    add_override_argument(train)
    train.add_argument(
        "--launcher",
        choices=["ray", "local"],
        default="ray",
        help="ray (default): Ray Train workers on an embedded local Ray runtime, or on the cluster of --address; "
        "local: plain local processes, no Ray",
    )
    train.add_argument(
        "--address",
        default=None,
        help="Ray cluster to join (HOST:6379 or ray://HOST:10001; default: config ray.address, RAY_ADDRESS, "
        "else an embedded local runtime)",
    )
    train.add_argument(
        "--init-from",
        metavar="RUN_DIR",
        default=None,
        help="start a new run from this earlier run's last checkpoint on a grown vocabulary (a dataset ingested "
        "with --vocab-from the earlier run's dataset): old rows copied by id, new rows initialised fresh "
        "(config key train.init_from)",
    )
    train.set_defaults(func=run_train, resumable=True)

    evaluate = subparsers.add_parser(
        "evaluate",
        help="evaluate a run's last checkpoint on the held-out splits (writes RUN_DIR/eval.json)",
        description="Rank the full catalog for the users of each split with the run's last checkpoint and "
        "report Recall@K, NDCG@K, AP@K and Accuracy; writes RUN_DIR/eval.json.",
    )
    evaluate.add_argument("run_dir", metavar="RUN_DIR", help="a run directory (holds config.yaml)")
    evaluate.add_argument("--split", dest="splits", action="append", help="split to evaluate (default: config)")
    evaluate.add_argument(
        "--ks",
        type=int,
        nargs="+",
        metavar="K",
        default=None,
        help="cut-offs K of Recall@K, NDCG@K and AP@K, any K >= 1 (default: the run's eval.ks), e.g. --ks 20 100",
    )
    evaluate.add_argument("--sample-users", type=int, default=None, help="evaluate a sample of this many users")
    evaluate.add_argument("--checkpoint", default=None, help="checkpoint directory (default: the newest)")
    evaluate.add_argument("--workers", type=int, default=None, help="local processes (default: the run's)")
    evaluate.add_argument(
        "--no-index",
        dest="use_index",
        action="store_false",
        help="read the users' items from the splits' Parquet files instead of the dataset's per-user index "
        "(DATA_ROOT/user_index/, written with the dataset; rebuilt here when missing or stale: ~4 bytes a rating of "
        "disk, ~2 min at ML-1B)",
    )
    evaluate.set_defaults(func=run_evaluate)

    export = subparsers.add_parser(
        "export",
        help="export a run's user and item embeddings (Parquet parts + manifest)",
        description="Write the embeddings of the run's last checkpoint for serving (bigrank recommend/serve).",
    )
    export.add_argument("run_dir", metavar="RUN_DIR", help="a run directory (holds config.yaml)")
    export.add_argument("--out", required=True, help="export directory")
    export.add_argument("--checkpoint", default=None, help="checkpoint directory (default: the newest)")
    export.add_argument("--workers", type=int, default=None, help="local processes (default: the run's)")
    export.add_argument(
        "--index",
        action="append",
        default=[],
        choices=[f"{kind}{suffix}" for kind in ("exact", "ivf", "hnsw") for suffix in ("", "-float16", "-int8")],
        help="also build a FAISS index (kind, or kind-float16 / kind-int8 for a scalar-quantised one)",
    )
    export.add_argument(
        "--quantize", action="append", default=[], choices=["float16", "int8"], help="also write quantised copies"
    )
    export.add_argument(
        "--no-seen",
        dest="seen",
        action="store_false",
        help="skip the per-user seen-items table (writing it reads each rank's users' ratings once); serving "
        "then takes the dataset with --exclude-seen DATA_ROOT (and --data for a history-tower model)",
    )
    export.set_defaults(func=run_export)


# The run layer (torch, the trainer) is imported when a command runs, not when the CLI registers its commands:
# `bigrank --help` and the Ray Jobs commands then start in a fraction of a second instead of seconds.
def run_train(args: argparse.Namespace) -> int:
    from bigrank import run

    overrides = list(args.overrides or [])
    if args.init_from:
        overrides.append(f"train.init_from={json.dumps(str(Path(args.init_from).resolve()))}")
    config = load_config(args.config, overrides)
    summary = run.train(config, launcher=args.launcher, address=args.address)
    print(run.format_summary(summary))
    return 0


def run_evaluate(args: argparse.Namespace) -> int:
    from bigrank import run
    from bigrank.train.evaluate import format_eval_table

    config = run.load_run_config(args.run_dir)
    if args.ks is not None:
        config.eval.ks = sorted(set(args.ks))
        config.eval.check()  # a K below 1 is a ConfigError naming eval.ks
    results = run.evaluate(
        config,
        checkpoint=args.checkpoint,
        splits=args.splits,
        sample_users=args.sample_users,
        workers=args.workers,
        use_index=args.use_index,
    )
    print(format_eval_table(results))
    print(f"written to {Path(config.run_dir) / 'eval.json'}")
    return 0


def run_export(args: argparse.Namespace) -> int:
    from bigrank import run

    config = run.load_run_config(args.run_dir)
    out = str(Path(args.out).resolve())
    result = run.export(
        config, out, checkpoint=args.checkpoint, index=tuple(args.index), quantize=tuple(args.quantize),
        workers=args.workers, seen=args.seen,
    )  # fmt: skip
    manifest = result.get("manifest") or {}
    print(f"exported {result['checkpoint']} to {out}")
    if manifest:
        figures = {k: manifest[k] for k in ("num_users", "num_items", "dim") if k in manifest}
        if figures:
            print(json.dumps(figures))
    return 0
