"""Ray's start-up, for every part of bigrank that starts or joins a Ray runtime: Ray Train runs
(``bigrank.launch.ray_train``), Ray Tune searches (``bigrank.tune``), ingest on a cluster
(``bigrank.data.ingest.cluster``) and ``bigrank serve --ray`` (``bigrank.export.ray_serve``). It sits at the bottom of
the package (it imports nothing of bigrank but its errors), so that each of them takes it from below.

* :func:`start_ray`: join the cluster at an address (with Ray's token authentication when a token is at hand:
  :func:`read_auth_token`), failing within seconds with :class:`RayConnectionError` naming the address when
  nothing listens there; or, without an address, start an embedded runtime here (:func:`init_local_ray`).
* :func:`init_local_ray`: an embedded runtime every listener of which is on 127.0.0.1 (below).

The loopback settings of an embedded (single-node, started here) runtime.
``ray.init(address="local", _node_ip_address="127.0.0.1")`` is not enough in Ray 2.60:
``ray._private.services.resolve_ip_for_localhost`` turns a loopback node address into the machine's
external one unless Ray runs in its single-machine mode (``ray_constants.ENABLE_RAY_CLUSTER`` false, the
``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` default on macOS and Windows). With the external node address the
GCS, raylet (node manager, object manager) and every worker's gRPC server bind all interfaces (their C++
``GrpcServer`` listens on 127.0.0.1 only when the node address is 127.0.0.1), and the dashboard agent, the
runtime-env agent, the dashboard head and the autoscaler monitor open their HTTP/gRPC/metrics ports on
0.0.0.0 or the external address. ``init_local_ray`` starts the runtime in that single-machine mode, so
every one of them binds 127.0.0.1; the processes Ray starts inherit the setting from the environment.

Ray Serve adds listeners this setting does not reach; ``bigrank serve --ray`` binds them itself
(``bigrank.export.ray_serve``): the HAProxy ingress's statistics page and Prometheus exporter, which Ray 2.60
renders from a fixed template on every interface (``bind *:STATS_PORT``, ``bind :METRICS_PORT``), are rebound
to the serve host by a wrapper of the HAProxy binary (``RAY_SERVE_HAPROXY_BINARY_PATH``) that edits the
configuration file before HAProxy reads it; each replica's inter-deployment gRPC server (``"[::]:0"``,
hard-coded in ``ray.serve._private.replica``) binds 127.0.0.1 through ``ServeSettings.internal_grpc_host``,
applied in the replica's own process by bigrank's deployment class.

Joining an existing cluster (:func:`start_ray` with an address: ``ray.init(address=...)``) does not go through
:func:`init_local_ray` and is unchanged.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Any

from bigrank.errors import CommandError

__all__ = ["LOOPBACK", "RayConnectionError", "init_local_ray", "read_auth_token", "start_ray"]

LOOPBACK = "127.0.0.1"
_SINGLE_MACHINE_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


def init_local_ray(**kwargs: Any) -> None:
    """``ray.init`` of an embedded runtime on this machine whose every listener is on 127.0.0.1.

    No dashboard (``include_dashboard`` may be overridden in ``kwargs``; it would listen on 127.0.0.1
    too); the other ``kwargs`` go to ``ray.init`` unchanged.
    """
    import ray
    from ray._private import ray_constants

    kwargs.setdefault("include_dashboard", False)
    kwargs.setdefault("dashboard_host", LOOPBACK)
    saved_env = os.environ.get(_SINGLE_MACHINE_ENV)
    saved_flag = ray_constants.ENABLE_RAY_CLUSTER
    # The processes ray.init starts read the variable at import; this process read it already.
    os.environ[_SINGLE_MACHINE_ENV] = "0"
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        ray.init(address="local", _node_ip_address=LOOPBACK, **kwargs)
    finally:
        # Only the start needs it (afterwards Ray asks the running node for its address); a later
        # ray.init(address=CLUSTER) in this process must resolve this machine's external address again.
        ray_constants.ENABLE_RAY_CLUSTER = saved_flag
        if saved_env is None:
            os.environ.pop(_SINGLE_MACHINE_ENV, None)
        else:
            os.environ[_SINGLE_MACHINE_ENV] = saved_env


class RayConnectionError(CommandError):
    """Ray could not be started or reached; the message names the address."""


def start_ray(
    address: str | None = None, *, cpus: float = 0, gpus: float = 0, env: dict[str, str] | None = None
) -> bool:
    """Join the cluster at ``address``, or (None) start an embedded local runtime with at least ``cpus`` CPUs (the
    machine's, or more) and ``gpus`` GPUs, whose processes get the environment variables ``env``.

    Does nothing when Ray is already initialised in this process (returns False); otherwise returns True (the
    caller owns the runtime and shuts it down). The embedded runtime listens on 127.0.0.1 only, without a
    dashboard. Raises RayConnectionError naming the address when the cluster cannot be reached or refuses this
    process (the token: :func:`read_auth_token`).
    """
    import ray

    if address is not None:
        check_reachable(address)
    if ray.is_initialized():
        return False
    if address is None:
        init_local_ray(  # every listener on 127.0.0.1
            num_cpus=max(os.cpu_count() or 1, int(cpus + 0.999)),
            num_gpus=int(gpus + 0.999) or None,
            runtime_env={"env_vars": dict(env or {})},
            log_to_driver=True,
            # Without a dashboard Ray Train's placement-group cleaner warns every second that the State API
            # is unavailable; Ray's own loggers keep their errors only (the trainer prints its progress).
            logging_config=ray.LoggingConfig(log_level="ERROR"),
        )
        return True
    token_mode = _use_token_auth()
    try:
        ray.init(address=address, log_to_driver=True)
    except (ConnectionError, RuntimeError, ValueError) as error:
        hint = (
            "the cluster may require token authentication: put the head's token (`ray get-auth-token` on the "
            "head, or its ~/.ray/auth_token) in ~/.ray/auth_token here or set RAY_AUTH_TOKEN"
            if not token_mode
            else "check that ~/.ray/auth_token (or RAY_AUTH_TOKEN) holds the head's token"
        )
        raise RayConnectionError(f"cannot connect to the Ray cluster at {address}: {error}; {hint}") from None
    return True


def check_reachable(address: str, timeout: float = 5.0) -> None:
    """Fail within ``timeout`` seconds when nothing listens at a ``HOST:PORT`` / ``ray://HOST:PORT`` address
    (``ray.init`` itself retries for a minute or more before giving up)."""
    if address == "auto":
        return
    if address.startswith(("http://", "https://")):
        raise RayConnectionError(
            f"{address} is a dashboard (Jobs API) address: submit with `bigrank submit CONFIG --address "
            f"{address}`, or give --launcher ray the cluster's GCS address (HOST:6379) or ray://HOST:10001"
        )
    target = address.split("://", 1)[-1].rstrip("/")
    host, sep, port = target.rpartition(":")
    if not sep or not port.isdigit():
        return  # let Ray interpret it
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout):
            pass
    except OSError as error:
        raise RayConnectionError(
            f"cannot reach the Ray cluster at {address}: {error.strerror or error}. Start one (cluster/"
            "local_cluster.sh start) or pass the head's address (HOST:6379 or ray://HOST:10001); without "
            "--address and RAY_ADDRESS, bigrank starts an embedded local Ray runtime."
        ) from None


def _use_token_auth() -> bool:
    """Turn on Ray's token authentication for joining a cluster when a token is at hand and RAY_AUTH_MODE is
    unset: Ray 2.60 heads started with `ray start` require it, and ray.init does not switch it on by itself
    for an existing cluster. Returns whether token mode is on."""
    mode = os.environ.get("RAY_AUTH_MODE")
    if mode is not None:
        return mode.lower() == "token"
    if read_auth_token() is None:
        return False
    os.environ["RAY_AUTH_MODE"] = "token"
    try:  # refresh the configuration Ray's core read when it was imported
        from ray._raylet import Config as RayCoreConfig

        RayCoreConfig.initialize("")
    except (ImportError, AttributeError):
        pass
    return True


def read_auth_token() -> str | None:
    """The Ray token: ``RAY_AUTH_TOKEN``, else the file ``RAY_AUTH_TOKEN_PATH``, else ``~/.ray/auth_token``."""
    token = os.environ.get("RAY_AUTH_TOKEN", "").strip()
    if token:
        return token
    path = Path(os.environ.get("RAY_AUTH_TOKEN_PATH") or Path.home() / ".ray" / "auth_token").expanduser()
    if path.is_file():
        return path.read_text().strip() or None
    return None
