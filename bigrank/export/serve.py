"""A small HTTP JSON endpoint over a ``Recommender`` (standard library ``http.server`` only).

Routes (GET only)::

    /health                              {"status": "ok", "num_items", "num_users", "dim", "index", "has_history"}
    /recommend?user=U&k=K                {"user": U, "k": K, "index": …, "items": [{"item_id", "score", …}]}
    /recommend?items=I1,I2,…&k=K         fold-in of a user given by items (exports with a history table)
               &exclude_seen=1           also drop the user's rated items (server started with a dataset)

Bad parameters answer 400 with ``{"error": message}``; unknown paths 404. The server is threaded; the
recommender serialises index searches with its own lock.
"""

from __future__ import annotations

import json
import sys
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

DEFAULT_K = 10
MAX_K = 1000
RECOMMEND_PARAMETERS = {"user", "items", "k", "exclude_seen"}


class RecommendServer(ThreadingHTTPServer):
    """``ThreadingHTTPServer`` that holds the recommender (and optional seen items) for its handlers."""

    daemon_threads = True

    def __init__(self, address, recommender, seen=None, max_k: int = MAX_K, quiet: bool = False):
        super().__init__(address, RecommendHandler)
        self.recommender = recommender
        self.seen = seen
        self.max_k = max_k
        self.quiet = quiet


class RecommendHandler(BaseHTTPRequestHandler):
    """Answers ``/health`` and ``/recommend`` with JSON."""

    server: RecommendServer

    def do_GET(self) -> None:  # noqa: N802 - the name http.server dispatches to
        url = urlsplit(self.path)
        try:
            if url.path == "/health":
                self._send(HTTPStatus.OK, self._health())
            elif url.path == "/recommend":
                self._send(HTTPStatus.OK, self._recommend(url.query))
            else:
                self._send(HTTPStatus.NOT_FOUND, {"error": f"unknown path {url.path!r}; use /recommend or /health"})
        except ValueError as error:
            self._send(HTTPStatus.BAD_REQUEST, {"error": str(error)})
        except Exception as error:  # noqa: BLE001 - a server answers 500 instead of dropping the connection
            self._send(HTTPStatus.INTERNAL_SERVER_ERROR, {"error": f"{type(error).__name__}: {error}"})

    def _health(self) -> dict:
        rec = self.server.recommender
        return {
            "status": "ok",
            "num_items": rec.num_items,
            "num_users": rec.num_users,
            "dim": int(rec.item_vectors.shape[1]),
            "index": rec.index_kind,
            "has_history": rec.has_history,
            "exclude_seen": self.server.seen is not None,
        }

    def _recommend(self, query: str) -> dict:
        params = parse_query(query)
        rec = self.server.recommender
        k = parse_int(params.get("k", str(DEFAULT_K)), "k")
        if not 1 <= k <= self.server.max_k:
            raise ValueError(f"k must lie in [1, {self.server.max_k}], got {k}")
        exclude_seen = parse_flag(params.get("exclude_seen", "0"), "exclude_seen")
        if ("user" in params) == ("items" in params):
            raise ValueError("give exactly one of user=<id> or items=<id,id,…>")
        if exclude_seen and self.server.seen is None:
            raise ValueError("exclude_seen needs a server started with --exclude-seen DATA_ROOT")
        if "user" in params:
            user = parse_int(params["user"], "user")
            if not 0 <= user < rec.num_users:
                raise ValueError(f"user {user} is outside [0, {rec.num_users})")
            excluded = self.server.seen.items_of(user) if exclude_seen else None
            return {"user": user, "k": k, "index": rec.index_kind, "items": rec.recommend(user, k, excluded)}
        items = [parse_int(value, "items") for value in params["items"].split(",") if value.strip()]
        if not items:
            raise ValueError("items must list at least one item id")
        if exclude_seen:
            raise ValueError("exclude_seen applies to user=<id>; the given items are always excluded")
        return {"items_given": items, "k": k, "index": rec.index_kind, "items": rec.recommend_items_history(items, k)}

    def _send(self, status: HTTPStatus, payload: dict) -> None:
        body = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args) -> None:  # noqa: A002 - signature of the base class
        if not self.server.quiet:
            sys.stderr.write(f"{self.address_string()} {format % args}\n")


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


def parse_int(value: str, name: str) -> int:
    """``value`` as an int; ValueError naming the parameter otherwise."""
    try:
        return int(value.strip())
    except ValueError:
        raise ValueError(f"{name} must be an integer, got {value!r}") from None


def parse_flag(value: str, name: str) -> bool:
    """``1/true/yes`` -> True, ``0/false/no`` (or empty) -> False; ValueError otherwise."""
    lowered = value.strip().lower()
    if lowered in ("1", "true", "yes"):
        return True
    if lowered in ("", "0", "false", "no"):
        return False
    raise ValueError(f"{name} must be 0 or 1, got {value!r}")


def make_server(recommender, host: str = "127.0.0.1", port: int = 0, seen=None, quiet: bool = False):
    """A ``RecommendServer`` bound to ``(host, port)`` (port 0: any free port; see ``server_address``).

    ``seen``: optional ``bigrank.export.recommend.SeenItems`` enabling ``exclude_seen=1``. Call
    ``serve_forever()`` to answer requests and ``shutdown()`` + ``server_close()`` to stop.
    """
    if seen is not None and seen.num_items != recommender.num_items:
        raise ValueError(
            f"the dataset {seen.root} has {seen.num_items} items but the export has {recommender.num_items}"
        )
    return RecommendServer((host, port), recommender, seen=seen, quiet=quiet)
