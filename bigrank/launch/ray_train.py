"""Run a training worker function on Ray Train: an embedded local Ray runtime or an existing cluster.

``train_on_ray(config, worker)`` (called by the run layer, ``bigrank.run.train``, with
``bigrank.train.workers.train_worker``) builds a ``TorchTrainer`` with one Ray worker per training process:

    ScalingConfig(num_workers=config.workers, or (ray.min_workers, workers): elastic; CPU/GPU per worker)
    TorchConfig(backend="cpu:gloo,cuda:nccl" when GPUs are requested, "gloo" otherwise)
    RunConfig(storage_path=config.ray.storage_path, failure_config=FailureConfig(config.ray.max_failures))

``torch.distributed`` is initialised in every worker before the trainer runs, which is all the trainer needs: on a
cluster by Ray Train (``TorchConfig``); on a runtime whose every node is this machine's loopback (the embedded one)
by the workers themselves (``bigrank.launch.ray_group.WorkerProcessGroup``,
``bigrank.train.bootstrap.join_loopback_group``), so that the group's store listens on 127.0.0.1 only, not on
every interface as Ray Train's would. torchrec (and fbgemm's operators) are imported inside the workers, never in
the driver.

Where Ray runs:
    * no address (argument, ``config.ray.address`` or ``RAY_ADDRESS``): an embedded single-node runtime on
      127.0.0.1 without dashboard, started here and shut down at the end;
    * otherwise ``ray.init(address)`` joins that cluster ("auto", "HOST:PORT" or "ray://HOST:10001"); the
      run directory and ``storage_path`` (default ``RUN_DIR/ray``) must then be on storage every node sees
      (NFS, a shared volume). A token in ``~/.ray/auth_token`` / ``RAY_AUTH_TOKEN`` turns on Ray's token
      authentication, which Ray 2.60 heads started with ``ray start`` require.

Fault tolerance. When a worker dies, Ray Train restarts the whole worker group (up to ``ray.max_failures``
times) and calls the loop again. The source of truth for resuming is the run directory: ``train_worker``
reloads its newest complete checkpoint (model, both optimisers, each rank's stream position, the RNG and the
loss schedule), so no finished step is lost and no row is trained twice. The checkpoint format is the
trainer's own (DCP user tables + per-rank catalog rows, renamed into place once complete) because every rank
writes its part of one directory; copying every intermediate checkpoint into Ray's storage would double the
I/O of large runs for no gain. The final checkpoint is reported to Ray Train
(``ray.train.report(summary, checkpoint=...)``), so ``Result.checkpoint`` names a usable copy of it.

Elastic recovery (``ray.min_workers``). Ray Train 2.60 (Train v2, the default) takes
``ScalingConfig(num_workers=(min, max))``: when the worker group restarts after a failure and only
``m < workers`` workers fit on the cluster (a node gone), it starts ``m >= min_workers`` workers (and grows
back to ``workers`` when resources return, checked every ``elastic_resize_monitor_interval_s``). The worker
function resumes from the newest checkpoint on whatever worker count it gets. Without ``ray.min_workers`` the
group size is fixed, and a restart that cannot place ``workers`` workers fails after Ray's worker-group start
timeout (``RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S``, 60 s) has passed ``max(1, ray.max_failures) + 1`` times
(Ray itself would wait forever, for an autoscaler); the error then says to set ``ray.min_workers``.
"""

from __future__ import annotations

import functools
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bigrank.atomic import write_text_atomic
from bigrank.config import Config
from bigrank.errors import CommandError
from bigrank.ray_runtime import RayConnectionError, start_ray
from bigrank.signals import STOP_GRACE_SECONDS, Stopped, graceful_stop, raise_in_ray, stop_exception, watch_stop_file

__all__ = [
    "RayConnectionError",
    "RayTrainingError",
    "init_ray",
    "nodes_on_loopback",
    "resolve_address",
    "ray_worker_loop",
    "scaling_workers",
    "train_on_ray",
]

# Environment of the embedded runtime's workers: gloo must use the loopback interface there.
_LOCAL_ENV = {"GLOO_SOCKET_IFNAME": "lo"}
# The stop request in the run directory (the signal's number): the driver writes it, the workers watch it.
STOP_FILE = "stop-request"


class RayTrainingError(CommandError):
    """The training failed on Ray after its allowed restarts; the message holds the worker's error."""


def resolve_address(config: Config, address: str | None = None) -> str | None:
    """The cluster to join: ``address``, else ``config.ray.address``, else ``RAY_ADDRESS``; None = embedded."""
    for candidate in (address, config.ray.address, os.environ.get("RAY_ADDRESS")):
        if candidate and candidate.strip():
            return candidate.strip()
    return None


def init_ray(config: Config, address: str | None = None) -> bool:
    """Start an embedded local Ray runtime sized for ``config`` (``address`` None) or join ``address``
    (``bigrank.ray_runtime.start_ray``): at least ``workers * ray.cpus_per_worker`` CPUs, so that a 2-worker run
    never waits for resources on a smaller machine (the processes then share the cores), its workers' gloo on
    the loopback interface. Returns whether this call started or joined Ray (the caller then shuts it down)."""
    return start_ray(
        address,
        cpus=config.workers * config.ray.cpus_per_worker,
        gpus=config.workers * config.ray.gpus_per_worker,
        env=_LOCAL_ENV,
    )


def ray_worker_loop(worker: Callable[[dict], dict], backend: str | None, config_dict: dict[str, Any]) -> None:
    """The function each Ray Train worker runs: ``worker(config_dict)`` (the trainer) on the process group, then one
    ``ray.train.report`` of its summary with the final checkpoint (rank 0 attaches it). ``backend``: None when Ray
    Train started the group (a cluster); else the workers start it on the loopback interface with that backend
    (``bigrank.train.bootstrap.start_ray_process``) and destroy it at the end, as Ray Train's ``TorchConfig``
    does its own."""
    import torch.distributed as dist

    # The workers' imports (torch, torchrec): the driver of a cluster run needs neither.
    from bigrank.train.bootstrap import start_ray_process

    own_group = start_ray_process(backend)  # the process; the worker function starts the job (start_worker)
    try:
        _run_and_report(worker, config_dict)
    finally:
        if own_group and dist.is_initialized():
            dist.destroy_process_group()


def _run_and_report(worker: Callable[[dict], dict], config_dict: dict[str, Any]) -> None:
    """``worker(config_dict)`` with the driver's stop requests watched, and its one report to Ray Train."""
    import ray.train

    watch_stop_file(Path(config_dict["run_dir"]) / STOP_FILE)  # the driver's signals, at step boundaries
    try:
        summary = worker(config_dict)
    except Stopped as stopped:  # every rank, at the step they agreed on, after the final checkpoint
        ray.train.report({"stopped_by": int(stopped.signum)})
        return
    context = ray.train.get_context()
    checkpoint = None
    if context.get_world_rank() == 0 and summary.get("checkpoint"):
        checkpoint = ray.train.Checkpoint.from_directory(summary["checkpoint"])
    # One directory name per report: the same command again on a finished run reports the same step once more, and
    # two results naming one directory have Ray delete it when pruning the older (the next start then fails on "a
    # checkpoint that does not exist anymore"). Only rank 0 attaches a checkpoint, so only its name is used.
    name = f"bigrank-step-{int(summary['steps']):08d}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    ray.train.report(dict(summary), checkpoint=checkpoint, checkpoint_dir_name=name)


def nodes_on_loopback() -> bool:
    """Whether every live node of the connected Ray runtime has this machine's loopback address (the embedded
    runtime of ``bigrank.ray_runtime``, a local cluster started on 127.0.0.1): then every worker runs here and
    the process group can listen on 127.0.0.1 only."""
    import ray

    from bigrank.ray_runtime import LOOPBACK

    nodes = [node for node in ray.nodes() if node.get("Alive")]
    return bool(nodes) and all(node.get("NodeManagerAddress") == LOOPBACK for node in nodes)


def scaling_workers(config: Config) -> int | tuple[int, int]:
    """``ScalingConfig.num_workers`` of ``config``: ``workers``, or ``(ray.min_workers, workers)`` (elastic)."""
    minimum = config.ray.min_workers
    if minimum is None or minimum >= config.workers:
        return config.workers
    return (minimum, config.workers)


def _placement_retries(config: Config) -> int:
    """How many times a worker group that cannot be placed (fewer free CPUs/GPUs than it needs: a node gone)
    is retried, each after Ray's start timeout, before the run fails. Ray's default (-1) waits forever, for an
    autoscaler; bigrank allows as many such retries as restarts (``ray.max_failures``, at least one), so that
    a cluster that lost a node for good ends with an error saying what to do."""
    return -1 if config.ray.max_failures == -1 else max(1, config.ray.max_failures)


def _failure_message(config: Config, error: BaseException) -> str:
    """The error of a failed Ray run; when the worker group could not be placed again, say how to go on."""
    message = f"Ray training of {config.run_dir} failed: {error}"
    if "WorkerGroupStartupTimeoutError" in f"{type(error).__name__} {error!r}" or "startup timed out" in str(error):
        if config.ray.min_workers is None:
            message += (
                f"; fewer than workers={config.workers} workers could be placed (a node gone?): set "
                "ray.min_workers to go on from the last checkpoint on the workers that are left"
            )
        else:
            message += f"; fewer than ray.min_workers={config.ray.min_workers} workers could be placed"
    return message


def _run_name(config: Config) -> str:
    return Path(config.run_dir).name or "bigrank"


def train_on_ray(config: Config, worker: Callable[[dict], dict], *, address: str | None = None) -> dict[str, Any]:
    """Run ``worker(config.to_dict())`` on every Ray Train worker and return rank 0's run summary.

    Args:
        config: a validated Config; ``workers`` Ray workers (``ray.min_workers`` to ``workers`` after a
            restart, when set) each get ``ray.cpus_per_worker`` CPUs and ``ray.gpus_per_worker`` GPUs;
            ``ray.max_failures`` worker-group restarts are allowed.
        worker: a module-level function (pickled to the workers) taking the config dict and returning the
            run summary, on an initialised ``torch.distributed`` group: ``bigrank.train.workers.train_worker``.
        address: the cluster to join (overrides ``config.ray.address`` and ``RAY_ADDRESS``); None and
            neither set: an embedded local runtime on 127.0.0.1.
    Returns the summary dict (steps, losses, examples/s, checkpoint, eval, …) plus ``ray_checkpoint``
    (where Ray Train keeps its copy of the final checkpoint) and ``ray_start_seconds``.
    Raises RayConnectionError when the cluster cannot be reached (naming the address) and RayTrainingError
    when the training fails after its allowed restarts (both CommandErrors: the CLI prints them plainly).
    """
    address = resolve_address(config, address)
    stop_file = Path(config.run_dir) / STOP_FILE
    stop_file.unlink(missing_ok=True)  # a request left by a driver that was killed is not this run's
    training = threading.Event()

    def on_signal(signum: int) -> None:
        """Once the workers train: ask them to stop at a step boundary (:func:`_fit` waits STOP_GRACE_SECONDS for
        them). Before (Ray starting, the workers setting up): stop now, also inside Ray's blocking calls
        (bigrank.signals: KeyboardInterrupt inside Ray, Terminated for SIGTERM once out of the block)."""
        if not training.is_set():
            raise_in_ray(signum)
        write_text_atomic(stop_file, str(int(signum)))  # a worker reads it whole or not at all

    try:
        with graceful_stop(on_signal) as stop:
            started = time.perf_counter()
            owns_runtime = init_ray(config, address)
            stop.reinstall()  # ray.init's own SIGTERM handler would exit 1 (or abort) without a word
            return _fit(config, worker, address, owns_runtime, started, stop, training)
    finally:
        stop_file.unlink(missing_ok=True)


def _fit(config, worker, address, owns_runtime, started, stop, training) -> dict[str, Any]:
    """The Ray Train run of :func:`train_on_ray` on the runtime ``init_ray`` gave; shuts an owned runtime down
    however it ends (a signal included: its workers end with it, their last finished checkpoint stays).

    ``fit()`` runs in a thread while this (main) thread waits for it and takes the signals: Ray Train installs
    its own SIGINT handler (an abort with no final checkpoint) only when ``fit()`` runs in the main thread. Once
    ``training`` is set, a first signal asks the workers to stop at their next step boundary (``on_signal`` of
    :func:`train_on_ray`); they then write a final checkpoint and report ``stopped_by``, and this raises the
    signal's exception. Workers that have not stopped ``STOP_GRACE_SECONDS`` after the signal, or a second
    signal, end the run at once."""
    import ray
    from ray.train import CheckpointConfig, FailureConfig, LoggingConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    from bigrank.devices import check_ray_gpus, process_group_backend

    use_gpu = config.ray.gpus_per_worker > 0
    # cpu:gloo,cuda:nccl on GPUs: nccl cannot carry the CPU tensors of control traffic
    backend = process_group_backend("cuda" if use_gpu else "cpu")
    resources = {"CPU": config.ray.cpus_per_worker}
    if use_gpu:
        resources["GPU"] = config.ray.gpus_per_worker
    storage_path = config.ray.storage_path or str(Path(config.run_dir) / "ray")
    try:
        check_ray_gpus(config, ray.cluster_resources().get("GPU", 0))  # else Ray would wait for GPUs forever
        ray_start_seconds = time.perf_counter() - started
        print(f"ray ready in {ray_start_seconds:.1f} s", flush=True)
        if address is not None:
            where = f"the Ray cluster at {address}"
        else:
            where = "an embedded local Ray runtime" if owns_runtime else "this process's Ray runtime"
        num_workers = scaling_workers(config)
        count = f"{num_workers[0]} to {num_workers[1]}" if isinstance(num_workers, tuple) else str(num_workers)
        print(f"training {config.run_dir} on {where}: {count} workers", flush=True)
        if nodes_on_loopback():  # every worker here: they start the group on a loopback store (ray_group)
            from bigrank.launch.ray_group import WorkerProcessGroup

            loop, torch_config = functools.partial(ray_worker_loop, worker, backend), WorkerProcessGroup(backend)
        else:
            loop, torch_config = functools.partial(ray_worker_loop, worker, None), TorchConfig(backend=backend)
        trainer = TorchTrainer(
            loop,
            train_loop_config=config.to_dict(),
            torch_config=torch_config,
            scaling_config=ScalingConfig(num_workers=num_workers, use_gpu=use_gpu, resources_per_worker=resources),
            run_config=RunConfig(
                name=_run_name(config),
                storage_path=storage_path,
                failure_config=FailureConfig(
                    max_failures=config.ray.max_failures, controller_failure_limit=_placement_retries(config)
                ),
                checkpoint_config=CheckpointConfig(num_to_keep=config.train.keep_checkpoints),
                logging_config=LoggingConfig(log_level="WARNING"),
            ),
        )
        outcome: dict[str, Any] = {}

        def fit() -> None:
            try:
                outcome["result"] = trainer.fit()
            except Exception as error:  # noqa: BLE001 - Ray wraps the worker's exception (TrainingFailedError)
                outcome["error"] = error

        thread = threading.Thread(target=fit, name="bigrank-ray-fit", daemon=True)
        training.set()
        thread.start()
        deadline = None
        while thread.is_alive():
            thread.join(0.1)
            if stop.signum is not None and deadline is None:
                deadline = time.monotonic() + STOP_GRACE_SECONDS
            if deadline is not None and time.monotonic() > deadline:
                print(f"the workers did not stop within {STOP_GRACE_SECONDS} s: ending them now", flush=True)
                raise stop_exception(stop.signum)
        if "error" in outcome:
            error = outcome["error"]
            raise RayTrainingError(_failure_message(config, error)) from error
        result = outcome["result"]
        summary = dict(result.metrics or {})
        if result.error is not None:
            raise RayTrainingError(_failure_message(config, result.error))
        if "stopped_by" in summary or stop.signum is not None:  # rank 0 printed the step and its checkpoint
            raise stop_exception(summary.get("stopped_by", stop.signum))
        summary["ray_checkpoint"] = result.checkpoint.path if result.checkpoint else None
        summary["ray_start_seconds"] = ray_start_seconds
        return summary
    finally:
        if owns_runtime:
            ray.shutdown()
