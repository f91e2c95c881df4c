"""The recommend HTTP API, independent of the server that carries it (stdlib ``serve`` or Ray ``ray_serve``).

Routes::

    GET  /health                         {"status": "ok", "num_items", "num_users", "dim", "index", …,
                                          "export", "export_id", "export_created_unix"}
    GET  /recommend?user=U&k=K           {"user": U, "k": K, "index": …, "items": [{"item_id", "score", …}]}
    GET  /recommend?items=I1,I2,…&k=K    fold-in of a user given by items (exports with a history table)
                   &exclude_seen=1       also drop the user's rated items
    POST /recommend  {"users": [U, …], "k": K, "exclude_seen": false}
                  or {"histories": [[I, …], …], "k": K}
                                         {"k": K, "index": …, "results": [<one GET answer per user/history>]}

Ids: where the export has original ids (``Recommender.user_id_kind`` / ``item_id_kind``: ``"int64"`` or
``"string"``), ``user``, ``items``, ``users`` and ``histories`` are original ids unless the server was started
with ``dense_ids=True`` (``bigrank serve --dense-ids``); without them they are dense ids. A string-id export takes
JSON strings and, in a query string, the raw text (``items`` split at commas: give ids holding a comma by POST);
an int64-id export takes integers, as JSON numbers or digit strings. The reply echoes the ids given (``"user"``,
``"items_given"``) as original ids in the export's type; each result row keeps the dense ``item_id`` and adds the
item's ``original_id`` and attributes (``Recommender.describe``). Unknown ids and ids of the wrong type are
ValueErrors (400) naming them. ``/health`` says which ids the server takes: ``"user_ids"`` / ``"item_ids"`` are
``"int64"``, ``"string"`` or ``"dense"``.

A request is parsed into ``Query`` objects (query vector, k, excluded items, what to echo back), the
server searches their vectors (one at a time or as a batch: ``Recommender.search_batch``) and ``answer``
turns ids and scores into the JSON reply. Bad parameters raise ValueError, which both servers answer
with 400 and ``{"error": message}``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import parse_qs, quote

import numpy as np

from bigrank.export.ids import parse_original_id

DEFAULT_K = 10
MAX_K = 1000
MAX_POST_QUERIES = 1000
RECOMMEND_PARAMETERS = {"user", "items", "k", "exclude_seen"}
POST_FIELDS = {"users", "histories", "k", "exclude_seen"}


@dataclass
class Query:
    """One search: ``vector`` float32[d], the ``k`` wanted, ``excluded`` item ids, and the request's ``echo``."""

    vector: np.ndarray
    k: int
    excluded: np.ndarray
    echo: dict


def health(rec, seen, dense_ids: bool = False) -> dict:
    """The ``/health`` reply of a server holding ``rec`` (a ``Recommender``) and ``seen`` (or None), taking
    dense ids only when ``dense_ids``: ``user_ids`` / ``item_ids`` say which ids it takes."""
    return {
        "status": "ok",
        "num_items": rec.num_items,
        "num_users": rec.num_users,
        "dim": rec.dim,
        "index": rec.index_kind,
        "has_history": rec.has_history,
        "exclude_seen": seen is not None,
        "user_ids": user_id_kind(rec, dense_ids) or "dense",
        "item_ids": item_id_kind(rec, dense_ids) or "dense",
        # Which export answers: clients and tests see a swap (``bigrank.export.reload``) here.
        "export": str(rec.export_dir),
        "export_id": rec.export_id,
        "export_created_unix": rec.manifest.get("created_unix"),
    }


def user_id_kind(rec, dense_ids: bool = False) -> str | None:
    """``"int64"`` / ``"string"``: the original user ids a server over ``rec`` takes; None: dense ids."""
    return None if dense_ids else rec.user_id_kind


def item_id_kind(rec, dense_ids: bool = False) -> str | None:
    """``"int64"`` / ``"string"``: the original item ids a server over ``rec`` takes; None: dense ids."""
    return None if dense_ids else rec.item_id_kind


def example_user(export_dir, dense_ids: bool = False) -> str:
    """The ``user=`` value of the example URL a server prints when it starts: the original id of dense user 0,
    URL-quoted, where the server takes original user ids; else ``0``. Reads one column of one part."""
    from bigrank import integrity
    from bigrank.export.format import read_export_manifest

    if dense_ids:
        return "0"
    try:
        manifest = read_export_manifest(export_dir)
        parts = [part for part in manifest["tables"]["users"]["parts"] if part["rows"]]
        if not parts:
            return "0"
        handle = integrity.open_parquet(Path(export_dir) / min(parts, key=lambda part: part["row_start"])["file"])
        if "original_id" not in handle.schema_arrow.names:
            return "0"
        first = handle.read_row_group(0, columns=["original_id"]).column(0)[0].as_py()
    except (OSError, ValueError, KeyError):  # only a hint: a Ray cluster's export may not be readable from here
        return "0"
    return quote(str(first), safe="")


def parse_query(query: str) -> dict[str, str]:
    """Query string -> single values; ValueError for unknown or repeated parameters."""
    params = parse_qs(query, keep_blank_values=True, strict_parsing=False)
    unknown = sorted(set(params) - RECOMMEND_PARAMETERS)
    if unknown:
        raise ValueError(f"unknown parameters {unknown}; use {sorted(RECOMMEND_PARAMETERS)}")
    repeated = sorted(name for name, values in params.items() if len(values) > 1)
    if repeated:
        raise ValueError(f"parameters given more than once: {repeated}")
    return {name: values[0] for name, values in params.items()}


def parse_int(value, name: str) -> int:
    """``value`` (a string or a JSON number) as an int; ValueError naming the parameter otherwise."""
    if isinstance(value, bool):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if isinstance(value, int):
        return value
    try:
        return int(str(value).strip())
    except ValueError:
        raise ValueError(f"{name} must be an integer, got {value!r}") from None


def parse_flag(value, name: str) -> bool:
    """``1/true/yes`` -> True, ``0/false/no`` (or empty) -> False; ValueError otherwise."""
    if isinstance(value, bool):
        return value
    lowered = str(value).strip().lower()
    if lowered in ("1", "true", "yes"):
        return True
    if lowered in ("", "0", "false", "no"):
        return False
    raise ValueError(f"{name} must be 0 or 1, got {value!r}")


def _parse_k(value, max_k: int) -> int:
    k = parse_int(value, "k")
    if not 1 <= k <= max_k:
        raise ValueError(f"k must lie in [1, {max_k}], got {k}")
    return k


def _user_query(rec, seen, user, k: int, exclude_seen: bool, dense_ids: bool) -> Query:
    """The query of one user given as a client sent it (text, or a JSON value)."""
    kind = user_id_kind(rec, dense_ids)
    if kind is None:
        user = given = parse_int(user, "user")
        if not 0 <= user < rec.num_users:
            raise ValueError(f"user {user} is outside [0, {rec.num_users})")
    else:
        given = parse_original_id(user, kind, "user")
        user = rec.user_ids.dense_id(given, "user")
    excluded = seen.items_of(user) if exclude_seen else np.empty(0, np.int64)
    return Query(rec.user_vector(user), k, excluded, {"user": given})


def _history_query(rec, items: list, k: int, dense_ids: bool, what: str) -> Query:
    """The fold-in query of a user given by ``items`` as a client sent them (``what``: the parameter)."""
    if not items:
        raise ValueError(f"{what} must list at least one item id")
    kind = item_id_kind(rec, dense_ids)
    if kind is None:
        given = [parse_int(item, what) for item in items]
        checked = rec.check_items(given)
    else:
        given = [parse_original_id(item, kind, "item") for item in items]
        checked = rec.item_ids.dense_ids(given, "item")
    return Query(rec.fold_in_vector(checked), k, checked, {"items_given": given})


def _split_items(text: str, kind: str | None) -> list[str]:
    """``items=`` of a query string split at commas: empty pieces dropped (and blank ones, but for string ids,
    which are taken exactly as given)."""
    if kind == "string":
        return [piece for piece in text.split(",") if piece != ""]
    return [piece for piece in text.split(",") if piece.strip()]


def _check_exclude_seen(exclude_seen: bool, seen) -> None:
    if exclude_seen and seen is None:
        raise ValueError(
            "exclude_seen needs an export with a seen-items table (exported with its dataset) or a server "
            "started with --exclude-seen DATA_ROOT"
        )


def parse_get(rec, seen, query: str, max_k: int = MAX_K, dense_ids: bool = False) -> Query:
    """The ``Query`` of ``GET /recommend?<query>``; ValueError with a message for bad parameters.

    ``dense_ids``: ``user`` / ``items`` are dense ids even where the export has original ids."""
    params = parse_query(query)
    k = _parse_k(params.get("k", str(DEFAULT_K)), max_k)
    exclude_seen = parse_flag(params.get("exclude_seen", "0"), "exclude_seen")
    if ("user" in params) == ("items" in params):
        raise ValueError("give exactly one of user=<id> or items=<id,id,…>")
    _check_exclude_seen(exclude_seen, seen)
    if "user" in params:
        return _user_query(rec, seen, params["user"], k, exclude_seen, dense_ids)
    if exclude_seen:
        raise ValueError("exclude_seen applies to user=<id>; the given items are always excluded")
    items = _split_items(params["items"], item_id_kind(rec, dense_ids))
    return _history_query(rec, items, k, dense_ids, "items")


def parse_post(
    rec, seen, body: bytes, max_k: int = MAX_K, max_queries: int = MAX_POST_QUERIES, dense_ids: bool = False
) -> tuple[int, list]:
    """``(k, queries)`` of ``POST /recommend`` with a JSON ``body``; ValueError with a message when bad.

    ``dense_ids``: ``users`` / ``histories`` hold dense ids even where the export has original ids."""
    try:
        payload = json.loads(body or b"null")
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"the body must be JSON: {error}") from None
    except RecursionError:
        raise ValueError("the body must be JSON: nested too deeply") from None
    if not isinstance(payload, dict):
        raise ValueError('the body must be a JSON object such as {"users": [1, 2], "k": 10}')
    unknown = sorted(set(payload) - POST_FIELDS)
    if unknown:
        raise ValueError(f"unknown fields {unknown}; use {sorted(POST_FIELDS)}")
    k = _parse_k(payload.get("k", DEFAULT_K), max_k)
    exclude_seen = parse_flag(payload.get("exclude_seen", False), "exclude_seen")
    if ("users" in payload) == ("histories" in payload):
        raise ValueError('give exactly one of "users": [id, …] or "histories": [[id, …], …]')
    _check_exclude_seen(exclude_seen, seen)
    given = payload.get("users", payload.get("histories"))
    if not isinstance(given, list) or not given:
        raise ValueError("users / histories must be a non-empty JSON list")
    if len(given) > max_queries:
        raise ValueError(f"at most {max_queries} users or histories per request, got {len(given)}")
    if "users" in payload:
        return k, [_user_query(rec, seen, user, k, exclude_seen, dense_ids) for user in given]
    if exclude_seen:
        raise ValueError("exclude_seen applies to users; the items of a history are always excluded")
    queries = []
    for history in given:
        if not isinstance(history, list):
            raise ValueError(f"each history must be a list of item ids, got {history!r}")
        queries.append(_history_query(rec, history, k, dense_ids, "histories"))
    return k, queries


def answer(rec, query: Query, ids: np.ndarray, scores: np.ndarray) -> dict:
    """The JSON reply of one query: its echo, ``k``, the index and the result rows."""
    return {**query.echo, "k": query.k, "index": rec.index_kind, "items": rec.describe(ids, scores)}


def search_queries(rec, queries: list[Query]) -> list[dict]:
    """Answer ``queries`` with one batched index search (``Recommender.search_batch``)."""
    if not queries:
        return []
    vectors = np.stack([q.vector for q in queries]).astype(np.float32)
    found = rec.search_batch(vectors, [q.k for q in queries], [q.excluded for q in queries])
    return [answer(rec, q, ids, scores) for q, (ids, scores) in zip(queries, found, strict=True)]
