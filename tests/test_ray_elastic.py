"""Elastic recovery on Ray: a two-node Ray cluster (``ray.cluster_utils.Cluster``: a head and a worker node,
one CPU each, on this machine) loses its worker node in the middle of a 2-worker run.

* with ``ray.min_workers: 1`` the worker group restarts with the one worker that still fits and the run
  finishes from its last checkpoint (needs the trainer to resume on a different worker count);
* without it the restart cannot place 2 workers, and the error says to set ``ray.min_workers``.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import pytest

from bigrank import run
from bigrank.launch.ray_train import RayTrainingError
from tests.conftest import tiny_config

pytestmark = pytest.mark.slow

MAX_STEPS = 120  # long enough that the node is gone well before the end (~0.05 s a step here)


RUN = {
    "seed": 5,
    "loss": {"name": "softmax"},
    "train": {"batch_size": 200, "epochs": 100, "max_steps": MAX_STEPS, "checkpoint_every": 4},
    "eval": {"every_epochs": None, "ks": [10], "splits": ["valid"]},
    "ray": {"max_failures": 1, "cpus_per_worker": 1.0},
}


def _config(root, run_dir, **ray):
    return tiny_config(root, run_dir, RUN, ray=ray)


# Seconds Ray Train waits for a worker group's placement (its CPUs reserved; the workers start after it) before
# the attempt fails (Ray's default: 60). A reservation on this idle 2-CPU cluster takes < 0.1 s (0.9 s seen under
# a load of 16 on 2 cores). The group that no longer fits waits it out twice (ray_train._placement_retries).
PLACEMENT_TIMEOUT_S = 3.0
# The elastic restart decides its size on Ray Train's view of the cluster (its AutoscalingCoordinator), which is
# refreshed every 20 s: until then the attempts after the node loss still ask for 2 workers and time out (21 s
# seen: 4 timed-out attempts). The test asks the coordinator for a refresh as soon as the node is dead
# (_remove_node_after_first_checkpoint); placement retries (a placement timeout counts as a controller failure,
# up to ray.max_failures: 6 x 3 s) still cover a full refresh period should that refresh come too early.
ELASTIC_MAX_FAILURES = 6


@pytest.fixture(scope="module")
def ray_head():
    """A Ray head node with one CPU, and this process connected to it; shared by the tests (each adds its own
    worker node); yields the ``Cluster``; shuts it down."""
    import ray
    import ray._private.ray_constants as ray_constants
    from ray.cluster_utils import Cluster

    with pytest.MonkeyPatch.context() as patch:
        # ray.init rewrites 127.0.0.1 in a cluster address to this machine's public address, where the test
        # cluster's GCS does not listen; with this flag off it keeps the loopback address (driver side only).
        patch.setattr(ray_constants, "ENABLE_RAY_CLUSTER", False)
        # Read by Ray Train's controller actor, a process of this cluster: set before the cluster starts.
        patch.setenv("RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S", str(PLACEMENT_TIMEOUT_S))
        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "node_ip_address": "127.0.0.1"})
        try:
            ray.init(
                address=cluster.address,
                _node_ip_address="127.0.0.1",  # the driver too: Ray would otherwise pick the machine's public address
                runtime_env={"env_vars": {"GLOO_SOCKET_IFNAME": "lo", "PYTHONPATH": os.environ.get("PYTHONPATH", "")}},
                logging_config=ray.LoggingConfig(log_level="ERROR"),
            )
            yield cluster
        finally:
            ray.shutdown()
            cluster.shutdown()


@pytest.fixture
def two_node_cluster(ray_head):
    """The head and a new worker node with one CPU; yields (cluster, worker_node); removes the node if still
    there. Ray Train's placement waits see a 2-CPU cluster, as with a fresh one."""
    cluster = ray_head
    worker_node = cluster.add_node(num_cpus=1, node_ip_address="127.0.0.1")
    cluster.wait_for_nodes()
    try:
        yield cluster, worker_node
    finally:
        if worker_node in cluster.worker_nodes:
            cluster.remove_node(worker_node)


def _remove_node_after_first_checkpoint(cluster, node, run_dir: Path, *, refresh: bool = False) -> threading.Thread:
    """Removes ``node`` (its workers die with it) once the run has a complete checkpoint; ``refresh``: then has
    Ray Train's AutoscalingCoordinator see the cluster without it at once, not at its next 20 s tick."""

    def watch() -> None:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            if (run_dir / "checkpoints" / "step-00000004").is_dir():
                cluster.remove_node(node)
                if refresh:
                    _refresh_autoscaling_coordinator(node.node_id)
                return
            time.sleep(0.05)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


def _refresh_autoscaling_coordinator(gone_node_id: str) -> None:
    """Once the cluster lists ``gone_node_id`` as dead, refresh Ray Train's AutoscalingCoordinator (its elastic
    scaling policy made it) as its own 20 s tick would: the live nodes and the resources reserved for each run.
    This only brings forward when Ray Train sees the smaller cluster; restarting on it is the code under test."""
    import ray

    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if not any(n["NodeID"] == gone_node_id and n["Alive"] for n in ray.nodes()):
            break
        time.sleep(0.05)
    coordinator = ray.get_actor("AutoscalingCoordinator", namespace="AutoscalingCoordinator")
    ray.get(coordinator.get_reserved_resources.remote("bigrank-test", recompute=True), timeout=30)


def test_a_group_restarted_on_fewer_workers_finishes_when_min_workers_allows(two_node_cluster, tiny_dataset, tmp_path):
    cluster, worker_node = two_node_cluster
    run_dir = tmp_path / "run"
    watcher = _remove_node_after_first_checkpoint(cluster, worker_node, run_dir, refresh=True)
    summary = run.train(
        _config(tiny_dataset, run_dir, min_workers=1, max_failures=ELASTIC_MAX_FAILURES), launcher="ray"
    )
    watcher.join(timeout=5)
    assert len(cluster.list_all_nodes()) == 1  # the worker node is gone
    assert summary["steps"] == MAX_STEPS
    assert summary["world_size"] == 1  # finished on the worker that was left
    assert summary["resumed_from"]  # from the last checkpoint of the 2-worker group
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    steps = [r["step"] for r in map(json.loads, lines) if r["type"] == "train"]
    assert steps == list(range(1, MAX_STEPS + 1))  # no finished step lost, none trained twice


def test_without_min_workers_a_group_that_no_longer_fits_fails_saying_so(two_node_cluster, tiny_dataset, tmp_path):
    cluster, worker_node = two_node_cluster
    run_dir = tmp_path / "run"
    watcher = _remove_node_after_first_checkpoint(cluster, worker_node, run_dir)
    with pytest.raises(RayTrainingError, match="set ray.min_workers"):
        run.train(_config(tiny_dataset, run_dir), launcher="ray")
    watcher.join(timeout=5)
    # The node went (after the 2-worker group's first checkpoint): the restart without it could not be placed.
    assert len(cluster.list_all_nodes()) == 1
