"""``bigrank plot RUN_DIR [RUN_DIR ...] --out FIG.png``: loss and evaluation metrics over epochs for several runs
(``bigrank.train.plot`` draws them)."""

from __future__ import annotations


def register(subparsers) -> None:
    """Add ``bigrank plot`` to the ``bigrank`` parser."""
    parser = subparsers.add_parser(
        "plot",
        help="plot loss and evaluation metrics over epochs for one or more runs",
        description="Draw the training loss and the evaluation metrics (Recall@K, AP@K, Accuracy) of each run's "
        "metrics.jsonl over epochs, all runs on one figure (PNG, PDF or SVG by the --out suffix).",
    )
    parser.add_argument("run_dirs", metavar="RUN_DIR", nargs="+", help="run directories holding metrics.jsonl")
    parser.add_argument("--out", required=True, metavar="FIG.png", help="output image file")
    parser.add_argument("--title", default=None, help="figure title (default: none)")
    parser.set_defaults(func=run_plot)


def run_plot(args) -> int:
    from bigrank.train.plot import plot_runs  # when the command runs, as every command imports what it drives

    path = plot_runs(args.run_dirs, args.out, title=args.title)
    print(f"wrote {path}")
    return 0
