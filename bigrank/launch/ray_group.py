"""Ray Train's configuration for runs whose workers start their own process group on the loopback interface.

Ray Train's ``TorchConfig`` starts the process group from its controller: rank 0's worker hosts torch's TCPStore,
whose server listens on every interface whatever host name it is given (measured 2026-11-27 with ``ss -ltnup``
every 0.5 s over an embedded ``bigrank train`` of ``configs/demo.yaml``: a ``RayTrainWorker`` on ``*:PORT`` for
about a third of the run). When every node of the runtime is this machine's loopback (the embedded runtime of
``bigrank.ray_runtime``), ``bigrank.launch.ray_train`` hands Ray Train :class:`WorkerProcessGroup` instead:
the same ``TorchConfig`` but for a backend that starts nothing, and each worker joins the group itself
(``bigrank.train.bootstrap.start_ray_process``), on a store bound to 127.0.0.1 as the local launcher's workers
do. A run that joins a cluster keeps Ray Train's own ``TorchConfig``: its workers may be on other machines.

This module imports ray (its classes derive from Ray Train's): only the driver's ``_fit`` imports it, and Ray's
controller when it unpickles the configuration.
"""

from __future__ import annotations

from dataclasses import dataclass

from ray.train.backend import Backend
from ray.train.torch import TorchConfig

__all__ = ["WorkerProcessGroup"]


class _WorkersStartTheGroup(Backend):
    """A backend that starts and ends no process group: the workers start theirs and destroy it at the end
    (``bigrank.launch.ray_train.ray_worker_loop``)."""

    # As Ray Train's torch backend: every worker of a node sees the node's GPUs, so nccl can use peer-to-peer
    # copies between them (the device of each worker is still the one Ray assigned it: ray.train.torch.get_device).
    share_cuda_visible_devices = True


@dataclass
class WorkerProcessGroup(TorchConfig):
    """``TorchConfig`` (its ``backend`` says which backend the workers start, for the record) whose process group
    the workers start themselves on a loopback store (the module docstring)."""

    @property
    def backend_cls(self):
        return _WorkersStartTheGroup
