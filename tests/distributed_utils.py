"""Run a function in N real gloo processes and collect what each rank returns.

Usage::

    def body(rank, world_size, group, x):      # must be a module-level function (it is pickled)
        ...
        return {"loss": loss.item()}

    results = run_distributed(body, world_size=2, args=(x,))   # list indexed by rank

A thin layer over the trainer's own launcher (``bigrank.train.launcher.launch_local``): a failing rank raises
``WorkerError`` with its traceback, and a hang fails after ``timeout`` seconds instead of blocking the suite.
"""

from __future__ import annotations

from bigrank.train.launcher import launch_local


def _with_group(fn, args):
    import torch.distributed as dist

    return fn(dist.get_rank(), dist.get_world_size(), dist.group.WORLD, *args)


def run_distributed(fn, world_size: int, args: tuple = (), timeout: float = 120.0) -> list:
    """Spawn ``world_size`` gloo processes running ``fn(rank, world_size, group, *args)``; return their results."""
    return launch_local(_with_group, world_size, (fn, args), timeout=timeout)
