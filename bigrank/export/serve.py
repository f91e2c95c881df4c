"""A small HTTP JSON endpoint over a ``Recommender`` (standard library ``http.server`` only).

The zero-dependency default of ``bigrank serve``; ``bigrank serve --ray`` runs the same API on Ray Serve
(``bigrank.export.ray_serve``). Routes and replies are defined in ``bigrank.export.api``::

    GET  /health
    GET  /recommend?user=U&k=K[&exclude_seen=1]   or   ?items=I1,I2,…&k=K
    POST /recommend  {"users": [U, …], "k": K}    or   {"histories": [[I, …], …], "k": K}

``U`` and ``I`` are original ids where the export has them (int64 or string), dense ids otherwise or when the
server is made with ``dense_ids=True`` (``bigrank serve --dense-ids``); see ``bigrank.export.api``.
Bad parameters and unknown ids answer 400 with ``{"error": message}``; unknown paths 404. The server is threaded; the
recommender serialises index searches with its own lock, so requests are searched one at a time.

Reloading (``serve_until_stopped`` with a ``bigrank.export.reload.Reloader``): SIGHUP, or a newer export in a
watched directory, loads and verifies the new export in a thread beside the old one, then ``RecommendServer.swap``
makes the next requests use it while those in flight finish on the old one; a damaged export is refused and the
old one keeps serving. ``/health`` names the export served (``export``, ``export_id``).

Stopping (``serve_until_stopped``, what ``bigrank serve`` runs): the first SIGTERM or SIGINT closes the
listening socket (new connections are refused), lets every connection already taken finish its request for
up to ``DRAIN_SECONDS``, and returns; a second signal stops at once.
"""

from __future__ import annotations

import contextlib
import json
import sys
import threading
import time
from dataclasses import dataclass
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

from bigrank.export.api import MAX_K, health, parse_get, parse_post, search_queries

MAX_BODY_BYTES = 1 << 20
# How long a stopping server waits for the requests it has taken: below the 30 s Kubernetes waits between a
# pod's SIGTERM and its SIGKILL (terminationGracePeriodSeconds).
DRAIN_SECONDS = 20.0


@dataclass(frozen=True)
class Served:
    """What the server answers from: a ``Recommender`` and the seen items of ``exclude_seen`` (or None)."""

    recommender: object
    seen: object = None


def check_seen(recommender, seen) -> None:
    """ValueError when ``seen`` (not None) counts another number of items than the export of ``recommender``."""
    if seen is not None and seen.num_items != recommender.num_items:
        raise ValueError(
            f"the seen items ({seen.root}) count {seen.num_items} items but the export has {recommender.num_items}"
        )


class RecommendServer(ThreadingHTTPServer):
    """``ThreadingHTTPServer`` that holds what it serves (``served``: a :class:`Served`) for its handlers.

    :meth:`swap` replaces it in one assignment: each request reads ``served`` once when it starts, so the
    requests in flight finish on the old export and the next ones are answered from the new one.
    """

    daemon_threads = True
    block_on_close = False  # server_close() would join every request thread without a timeout: see drain()
    # socketserver's default listen backlog is 5: with a few dozen clients opening connections (HTTP/1.0, one
    # request per connection) the kernel drops SYNs and clients wait out a 1 s retransmit.
    request_queue_size = 128

    def __init__(
        self, address, recommender, seen=None, max_k: int = MAX_K, quiet: bool = False, dense_ids: bool = False
    ):
        super().__init__(address, RecommendHandler)
        self.served = Served(recommender, seen)
        self.dense_ids = dense_ids
        self.max_k = max_k
        self.quiet = quiet
        self._active = 0  # connections taken and not yet answered (and closed)
        self._active_changed = threading.Condition()

    def swap(self, served: Served) -> None:
        """Answer the requests that start from now on from ``served``."""
        check_seen(served.recommender, served.seen)
        self.served = served

    def process_request(self, request, client_address) -> None:
        # Counted in the accepting thread, before the handler's thread starts: a drain that begins after the
        # accept waits for this connection.
        with self._active_changed:
            self._active += 1
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._done()
            raise

    def process_request_thread(self, request, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._done()

    def _done(self) -> None:
        with self._active_changed:
            self._active -= 1
            self._active_changed.notify_all()

    def drain(self, timeout: float) -> int:
        """Wait up to ``timeout`` seconds for the connections taken to be answered; returns how many are left."""
        deadline = time.monotonic() + timeout
        with self._active_changed:
            while self._active > 0 and (left := deadline - time.monotonic()) > 0:
                self._active_changed.wait(left)
            return self._active


class RecommendHandler(BaseHTTPRequestHandler):
    """Answers ``/health`` and ``/recommend`` with JSON."""

    server: RecommendServer

    def do_GET(self) -> None:  # noqa: N802 - the name http.server dispatches to
        self._dispatch("GET")

    def do_POST(self) -> None:  # noqa: N802 - the name http.server dispatches to
        self._dispatch("POST")

    def _dispatch(self, method: str) -> None:
        url = urlsplit(self.path)
        server = self.server
        rec, seen = server.served.recommender, server.served.seen  # one export for the whole request (swap)
        try:
            if url.path == "/health" and method == "GET":
                self._send(HTTPStatus.OK, health(rec, seen, server.dense_ids))
            elif url.path == "/recommend" and method == "GET":
                query = parse_get(rec, seen, url.query, server.max_k, dense_ids=server.dense_ids)
                self._send(HTTPStatus.OK, search_queries(rec, [query])[0])
            elif url.path == "/recommend" and method == "POST":
                length = (self.headers.get("Content-Length") or "0").strip()
                if not length.isdigit():  # a negative length would read until the client closes the connection
                    raise ValueError(f"Content-Length must be a number of bytes, got {length!r}")
                length = int(length)
                if length > MAX_BODY_BYTES:
                    raise ValueError(f"the body is larger than {MAX_BODY_BYTES} bytes")
                body = self.rfile.read(length)
                k, queries = parse_post(rec, seen, body, server.max_k, dense_ids=server.dense_ids)
                results = search_queries(rec, queries)
                self._send(HTTPStatus.OK, {"k": k, "index": rec.index_kind, "results": results})
            elif url.path in ("/health", "/recommend"):
                self._send(HTTPStatus.METHOD_NOT_ALLOWED, {"error": f"{method} is not allowed on {url.path}"})
            else:
                self._send(HTTPStatus.NOT_FOUND, {"error": f"unknown path {url.path!r}; use /recommend or /health"})
        except ValueError as error:
            self._send(HTTPStatus.BAD_REQUEST, {"error": str(error)})
        except Exception as error:  # noqa: BLE001 - a server answers 500 instead of dropping the connection
            self._send(HTTPStatus.INTERNAL_SERVER_ERROR, {"error": f"{type(error).__name__}: {error}"})

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


def make_server(
    recommender, host: str = "127.0.0.1", port: int = 0, seen=None, quiet: bool = False, dense_ids: bool = False
):
    """A ``RecommendServer`` bound to ``(host, port)`` (port 0: any free port; see ``server_address``).

    ``dense_ids``: take dense user and item ids even where the export has original ids.
    ``seen``: the items ``exclude_seen=1`` drops: a ``bigrank.export.seen.SeenItems`` of a dataset, or by
    default the export's own seen-items table (``recommender.seen``; None when it has none). Call
    ``serve_forever()`` to answer requests and ``shutdown()`` + ``server_close()`` to stop.
    """
    seen = seen if seen is not None else recommender.seen
    check_seen(recommender, seen)
    return RecommendServer((host, port), recommender, seen=seen, quiet=quiet, dense_ids=dense_ids)


def serve_until_stopped(
    server: RecommendServer, drain_seconds: float = DRAIN_SECONDS, reloader=None, hangup: threading.Event | None = None
) -> tuple[int, int]:
    """Answer requests until SIGTERM or SIGINT (call from the main thread), then stop taking connections and
    drain the ones taken (``drain_seconds`` at most); closes the server. Returns ``(signal number, requests
    cut off by the drain's end)``. A second signal raises at once (KeyboardInterrupt / Terminated).

    ``reloader``: a ``bigrank.export.reload.Reloader`` whose ``install`` swaps into this server; SIGHUP, and a
    newer export in its watched directory, reload the export meanwhile. ``hangup``: the event of a
    ``bigrank.signals.hangup_requests`` block the caller opened before it loaded the first export (a SIGHUP that
    came during that load is in it, and reloads now); by default one is opened here. Without a reloader SIGHUP
    keeps its default action (the process ends), as before."""
    from bigrank.signals import graceful_stop, hangup_requests

    serving = threading.Thread(target=server.serve_forever, name="bigrank-serve", daemon=True)
    if reloader is None or hangup is not None:
        hangups = contextlib.nullcontext(hangup if hangup is not None else threading.Event())
    else:
        hangups = hangup_requests()
    with graceful_stop() as stop, hangups as hangup:
        serving.start()
        while not stop.event.wait(0.5):  # short waits: the signal handlers run in this thread between them
            if reloader is not None:
                reloader.poll(hangup)
        server.shutdown()  # the accept loop ends ...
        server.socket.close()  # ... and new connections are refused from here on
        left = server.drain(drain_seconds)
    server.server_close()
    return stop.signum, left
