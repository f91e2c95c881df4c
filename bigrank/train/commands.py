"""CLI commands of the trainer: ``bigrank train``, ``bigrank evaluate``, ``bigrank export``.

``train`` hands the config to Ray Train (``bigrank.launch``: an embedded local Ray runtime, or the cluster of
``--address``) or runs ``bigrank.train.loop.train_worker`` in ``workers`` local gloo processes
(``--launcher local``, no Ray). Running the same command again
resumes from the run's newest checkpoint. ``evaluate`` and ``export`` load a run's newest checkpoint in the
same number of local processes by default (``--workers N``: any number; the checkpoint is resharded).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from bigrank.config import add_override_argument


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
    train.set_defaults(func=run_train)

    evaluate = subparsers.add_parser(
        "evaluate",
        help="evaluate a run's last checkpoint on the held-out splits (writes RUN_DIR/eval.json)",
        description="Rank the full catalog for the users of each split with the run's last checkpoint and "
        "report Recall@K, AP@K and Accuracy; writes RUN_DIR/eval.json.",
    )
    evaluate.add_argument("run_dir", metavar="RUN_DIR", help="a run directory (holds config.yaml)")
    evaluate.add_argument("--split", dest="splits", action="append", help="split to evaluate (default: config)")
    evaluate.add_argument("--sample-users", type=int, default=None, help="evaluate a sample of this many users")
    evaluate.add_argument("--checkpoint", default=None, help="checkpoint directory (default: the newest)")
    evaluate.add_argument("--workers", type=int, default=None, help="local processes (default: the run's)")
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
        "--index", action="append", default=[], choices=["exact", "ivf", "hnsw"], help="also build a FAISS index"
    )
    export.add_argument(
        "--quantize", action="append", default=[], choices=["float16", "int8"], help="also write quantised copies"
    )
    export.set_defaults(func=run_export)


def _run_config(run_dir: str):
    from bigrank.config import load_config

    path = Path(run_dir) / "config.yaml"
    if not path.is_file():
        raise FileNotFoundError(f"{run_dir} is not a run directory (no config.yaml)")
    return load_config(path)


def _launch(fn, workers: int, args: tuple):
    """Run ``fn`` in local processes; a worker's error becomes a CommandError with its message (and its
    traceback on stderr when it is not a plain user error)."""
    from bigrank.cli import CommandError
    from bigrank.train.launcher import WorkerError, launch_local

    try:
        return launch_local(fn, workers, args)
    except WorkerError as error:
        expected = ("ValueError", "FileNotFoundError", "FloatingPointError", "ConfigError", "RuntimeError")
        if error.error_type not in expected and error.traceback:
            print(error.traceback, file=sys.stderr)
        raise CommandError(str(error)) from None


def run_train(args: argparse.Namespace) -> int:
    import importlib.util

    from bigrank.cli import CommandError
    from bigrank.config import load_config
    from bigrank.data.manifest import load_manifest
    from bigrank.devices import check_devices
    from bigrank.train.losses import check_loss_config

    config = load_config(args.config, args.overrides)
    check_devices(config, args.launcher)  # a GPU that is not there fails here, before any worker starts
    check_loss_config(config.loss)
    load_manifest(config.data.root)  # a missing dataset is reported here, before any process starts
    if args.launcher == "ray":
        if importlib.util.find_spec("bigrank.launch") is None:
            raise CommandError("the Ray launcher (bigrank.launch) is not available yet; use --launcher local")
        import bigrank.launch as launch

        train_with_ray = getattr(launch, "train_with_ray", None)
        if train_with_ray is None:
            raise CommandError("the Ray launcher (bigrank.launch.train_with_ray) is not available yet")
        summary = train_with_ray(config, address=args.address)
    else:
        if args.address:
            raise CommandError("--address needs the Ray launcher (drop --launcher local)")
        from bigrank.train.loop import train_worker

        summary = _launch(train_worker, config.workers, (config,))[0]
    print(format_summary(summary))
    return 0


def format_summary(summary: dict) -> str:
    """A few lines about a finished training run (and its evaluation table when there is one)."""

    def number(value, spec):
        return "-" if value is None else format(value, spec)

    lines = [
        f"run dir        {summary['run_dir']}",
        f"steps          {summary['steps']} ({number(summary.get('epochs'), '.2f')} epochs, "
        f"{summary.get('world_size')} workers)",
        f"loss           first {number(summary.get('first_loss'), '.4f')}  "
        f"last {number(summary.get('last_loss'), '.4f')}",
        f"examples/s     {number(summary.get('examples_per_s'), ',.0f')}",
        f"checkpoint     {summary.get('checkpoint')}",
    ]
    if summary.get("resumed_from"):
        lines.append(f"resumed from   {summary['resumed_from']}")
    if summary.get("eval"):
        from bigrank.train.evaluate import format_eval_table

        lines += ["", format_eval_table(summary["eval"])]
    elif not summary.get("eval_available", True):
        lines.append("evaluation     skipped (bigrank.train.evaluate is not available)")
    return "\n".join(lines)


def run_evaluate(args: argparse.Namespace) -> int:
    from bigrank.train.evaluate import format_eval_table
    from bigrank.train.loop import evaluate_worker

    config = _run_config(args.run_dir)
    workers = args.workers or config.workers
    results = _launch(evaluate_worker, workers, (config, args.checkpoint, args.splits, args.sample_users))[0]
    print(format_eval_table(results))
    print(f"written to {Path(config.run_dir) / 'eval.json'}")
    return 0


def run_export(args: argparse.Namespace) -> int:
    from bigrank.train.loop import export_worker

    config = _run_config(args.run_dir)
    out = str(Path(args.out).resolve())
    workers = args.workers or config.workers
    result = _launch(export_worker, workers, (config, out, args.checkpoint, tuple(args.index), tuple(args.quantize)))
    manifest = result[0].get("manifest") or {}
    print(f"exported {result[0]['checkpoint']} to {out}")
    if manifest:
        figures = {k: manifest[k] for k in ("num_users", "num_items", "dim") if k in manifest}
        if figures:
            print(json.dumps(figures))
    return 0
