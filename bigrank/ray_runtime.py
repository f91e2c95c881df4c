"""An embedded (single-node, started here) Ray runtime that listens on loopback only.

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

Joining an existing cluster (``ray.init(address=...)``) does not go through here and is unchanged.
"""

from __future__ import annotations

import os
from typing import Any

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
