"""The run layer: one pre-flight and one way to start each job, shared by every entry point.

    prepare_run(config)                   the loss is built once (bad values: ConfigError naming the key) and
                                          the dataset manifest is read (a missing dataset: FileNotFoundError
                                          naming the path), before any process or Ray runtime starts; the
                                          DatasetManifest it returns goes to the local workers (read once
                                          per run; a Ray worker reads it once itself)
    train(config, launcher, address)      prepare_run, the lock of the run directory (bigrank.runlock), then the
                                          Ray launcher (bigrank.launch.ray_train) or the local one
                                          (bigrank.train.launcher) running bigrank.train.workers's worker
    evaluate(...), export(...)            a run's checkpoint in local processes

Callers: the ``bigrank train | evaluate | export`` commands (``bigrank.cli.train``), each trial of ``bigrank tune``
(``bigrank.tune.trial``: the pre-flight), a job submitted with ``bigrank submit`` (``python -m bigrank.run``,
:func:`main`), and ``pipelines/demo.py``. The launchers are leaves: they take the worker function and know nothing
of commands.
"""

from __future__ import annotations

import copy
import os
import sys
from pathlib import Path
from typing import Any

import yaml

from bigrank.config import Config, config_from_dict, format_change, load_run_config, resume_changes
from bigrank.data.manifest import DatasetManifest
from bigrank.devices import check_devices, cuda_build, process_group_backend, visible_gpus
from bigrank.errors import CommandError, ConfigError, Terminated
from bigrank.export.writer import check_export_dir
from bigrank.launch.jobs import CONFIG_ENV
from bigrank.launch.ray_train import train_on_ray
from bigrank.losses.build import check_loss_config
from bigrank.model.registry import model_spec
from bigrank.runlock import hold_run_dir
from bigrank.train.checkpoint import latest_checkpoint
from bigrank.train.evaluate import format_eval_table
from bigrank.train.launcher import WorkerError, launch_local
from bigrank.train.workers import evaluate_worker, export_worker, train_worker

__all__ = [
    "INFERENCE_ENV",
    "LAUNCHERS",
    "check_resume_config",
    "evaluate",
    "export",
    "format_summary",
    "load_run_config",
    "main",
    "prepare_run",
    "train",
]

LAUNCHERS = ("ray", "local")
# The environment of the evaluate and export workers: OpenMP threads that sleep as soon as they are idle instead of
# spinning first (libgomp's default). The certified top-K runs ~100 small torch ops per batch of users; a worker of
# several threads on cores that another process's spinning OpenMP threads also use (another torch job on the
# machine) then waits at the end of each op for its own threads to be scheduled again. `bigrank evaluate --split
# test --sample-users 10000 --workers 1` on ML-1B (2 threads on 2 cores beside a 2-thread training job, load 4.2;
# 2026-11-26) took 292 s wall and 291 s CPU; with the passive policy 37.3-37.8 s and 36-37 s (2 workers of 1 thread
# each, which never wait so: ~50 s either way). Beside lighter load it cost ~3 % (39.1 s against 37.9 s wall).
# Training keeps the default (not measured).
INFERENCE_ENV = {"OMP_WAIT_POLICY": "PASSIVE"}
# Worker errors whose message says it all (no traceback printed): bad input the user can fix.
_PLAIN_ERRORS = ("ValueError", "FileNotFoundError", "FloatingPointError", "ConfigError", "RuntimeError")


def prepare_run(config: Config, launcher: str = "ray") -> DatasetManifest:
    """The pre-flight of every run: check the devices, build the loss once and read the dataset's manifest.

    Raises DeviceError (a GPU asked for where there is none, saying what to change; ``launcher`` "local" counts
    this machine's GPUs), ConfigError (a bad loss parameter, naming the key; a dataset the model kind cannot
    train on, e.g. a catalog too large for an n x n matrix: the kind's ``preflight``) or FileNotFoundError (no
    dataset at ``data.root``) before anything is spawned.
    Returns the dataset's manifest, for the workers.
    """
    check_devices(config, launcher)
    check_loss_config(config.loss)
    manifest = DatasetManifest.load(config.data.root)
    model_spec(config.model.kind).kind.preflight(config, manifest)
    if config.train.init_from and latest_checkpoint(config.run_dir) is None:
        from bigrank.train.warm_start import check_init_from

        check_init_from(config, manifest)
    return manifest


def _launch_local(
    fn, workers: int, args: tuple, device_type: str = "cpu", max_restarts: int = 0, env: dict | None = None
) -> list[Any]:
    """``fn(*args)`` in ``workers`` local processes (gloo; ``cpu:gloo,cuda:nccl`` on GPUs), the group started
    again up to ``max_restarts`` times after a failure, the variables of ``env`` set for them (where this process
    sets none); a worker's error becomes a CommandError with its message (and its traceback on stderr when it is
    not a plain user error)."""
    backend = process_group_backend(device_type)
    try:
        return launch_local(fn, workers, args, backend=backend, max_restarts=max_restarts, env=env)
    except WorkerError as error:
        if error.error_type not in _PLAIN_ERRORS and error.traceback:
            print(error.traceback, file=sys.stderr)
        raise CommandError(str(error)) from None


def train(config: Config, *, launcher: str = "ray", address: str | None = None) -> dict[str, Any]:
    """Train ``config`` (resuming from the run's newest checkpoint); returns rank 0's run summary.

    ``launcher``: "ray" (Ray Train on an embedded runtime, or the cluster of ``address`` / ``ray.address`` /
    ``RAY_ADDRESS``) or "local" (``workers`` local processes on torch elastic, ``train.max_restarts`` restarts;
    ``address`` must be None). With the local launcher SIGINT / SIGTERM stop the workers
    (``bigrank.train.launcher``), print the last complete checkpoint and raise KeyboardInterrupt / Terminated.

    This process holds the lock of ``run_dir`` while the run lasts (``bigrank.runlock``): a second ``train`` of
    the same directory, with either launcher, fails at once with RunDirectoryInUse naming the holder. A resumed
    run is checked against its saved config first (:func:`check_resume_config`).
    """
    if launcher not in LAUNCHERS:
        raise CommandError(f"unknown launcher {launcher!r}; choose one of {', '.join(LAUNCHERS)}")
    if launcher == "local" and address:
        raise CommandError("--address needs the Ray launcher (drop --launcher local)")
    manifest = prepare_run(config, launcher)
    with hold_run_dir(config.run_dir, "bigrank train"):
        check_resume_config(config)
        if launcher == "ray":  # a Ray worker may run on another node: it reads the manifest itself, once
            return train_on_ray(config, train_worker, address=address)
        return _train_local(config, manifest)


def check_resume_config(config: Config) -> None:
    """Before a run resumes: compare ``config`` with the one the run saved (``RUN_DIR/config.yaml``).

    A change of a key that alters the trajectory (``bigrank.config.TRAJECTORY_KEYS``: seed, data, model, loss,
    optim, the batch size and the run's length) raises ConfigError listing every such key with its old and new
    value, unless ``train.resume`` is ``force`` (then they are printed and the run goes on with them). The other
    changes (workers, eval, logging, ...) are printed on one line. A run without a complete checkpoint starts
    over, so there is nothing to check.
    """
    saved_path = Path(config.run_dir) / "config.yaml"
    if latest_checkpoint(config.run_dir) is None or not saved_path.is_file():
        return
    raw = yaml.safe_load(saved_path.read_text()) or {}
    try:  # defaults filled in as in the new config; a config of an older bigrank may not load: compare it raw
        saved = config_from_dict(raw).to_dict()
    except (ConfigError, ValueError):
        saved = raw
    trajectory, harmless = resume_changes(saved, config.to_dict())
    if harmless:
        changes = ", ".join(format_change(key, change) for key, change in harmless.items())
        print(f"resuming {config.run_dir} with changed settings that keep its trajectory: {changes}", flush=True)
    if not trajectory:
        return
    lines = "\n".join(f"  {format_change(key, change)}" for key, change in trajectory.items())
    if config.train.resume == "force":
        print(f"train.resume=force: resuming {config.run_dir} with changed settings:\n{lines}", flush=True)
        return
    raise ConfigError(
        f"{config.run_dir} holds a run trained with other settings; resuming it with these would change its "
        f"course:\n{lines}\nrestore them, use a new run_dir, or continue this run with the new settings: "
        "--set train.resume=force"
    )


def _train_local(config: Config, manifest: DatasetManifest) -> dict[str, Any]:
    """``train_worker`` in ``workers`` local processes, each given the pre-flight's ``manifest`` (no worker reads
    it again); a stop by SIGINT/SIGTERM names the last checkpoint."""
    try:
        kind = check_devices(config, "local")
        return _launch_local(train_worker, config.workers, (config, manifest), kind, config.train.max_restarts)[0]
    except (KeyboardInterrupt, Terminated):  # the launcher has stopped every worker
        last = latest_checkpoint(config.run_dir)
        kept = f"the last complete checkpoint is {last}" if last else "no checkpoint had been written yet"
        print(f"training of {config.run_dir} stopped; {kept}", file=sys.stderr, flush=True)
        raise


def evaluate(
    config: Config,
    *,
    checkpoint: str | None = None,
    splits: list[str] | None = None,
    sample_users: int | None = None,
    workers: int | None = None,
    use_index: bool = True,
) -> dict[str, dict]:
    """Evaluate a checkpoint of the run of ``config`` (default: the newest) in ``workers`` local processes
    (default: the run's) on this machine's devices (:func:`inference_config`); writes ``RUN_DIR/eval.json``
    and returns its sections.

    ``use_index``: first make sure the dataset has a user index (``bigrank.data.user_index``) of each split
    evaluated and of the splits whose items it excludes (``DatasetManifest.excluded_splits``: train, and valid
    for test on a given split), building the missing ones here, once, with progress on stderr; the workers then
    read the users' items as slices of it instead of decoding the splits' files. False: the workers read the
    files (and use no index)."""
    workers = workers or config.workers
    config, kind = inference_config(config, workers)
    manifest = DatasetManifest.load(config.data.root)
    if use_index:
        from bigrank.data.user_index import ensure_index

        evaluated = splits or config.eval.splits
        for split in evaluated:
            manifest.split(split)  # an unknown split is named before anything is built
        needed = [*evaluated, *(name for split in evaluated for name in manifest.excluded_splits(split))]
        for split in dict.fromkeys(needed):
            manifest.split(split)
            ensure_index(manifest, split, progress=lambda line: print(line, file=sys.stderr, flush=True))
    args = (config, checkpoint, splits, sample_users, manifest, use_index)
    return _launch_local(evaluate_worker, workers, args, kind, env=INFERENCE_ENV)[0]


def export(
    config: Config,
    out: str | os.PathLike,
    *,
    checkpoint: str | None = None,
    index: tuple[str, ...] = (),
    quantize: tuple[str, ...] = (),
    workers: int | None = None,
    seen: bool = True,
) -> dict[str, Any]:
    """Export the embeddings of a checkpoint (default: the newest) to ``out`` in ``workers`` local processes;
    returns rank 0's result (``out``, ``checkpoint``, ``manifest``). ``seen=False`` skips the seen-items table.

    This process holds the lock of ``out`` while the workers write it (``bigrank.runlock``): a second export
    to the same directory fails at once with RunDirectoryInUse naming the holder. A directory that is neither
    empty nor an export is refused before anything is written there."""
    workers = workers or config.workers
    config, kind = inference_config(config, workers)
    check_export_dir(out)
    args = (config, str(out), checkpoint, tuple(index), tuple(quantize), seen)
    with hold_run_dir(out, "bigrank export"):
        return _launch_local(export_worker, workers, args, kind, env=INFERENCE_ENV)[0]


def inference_config(config: Config, workers: int) -> tuple[Config, str]:
    """``(config, device type)`` for loading a run's checkpoint on this machine in ``workers`` local processes:
    CUDA when the run was not pinned to the CPU and this machine has a GPU per worker, else the CPU.
    Checkpoints are device-portable, so a run trained on GPUs evaluates and exports here on CPU too."""
    usable = config.train.device != "cpu" and cuda_build() is not None and visible_gpus() >= workers
    kind = "cuda" if usable else "cpu"
    if kind != config.train.device:
        config = copy.deepcopy(config)
        config.train.device = kind
        if kind == "cpu" and config.train.precision == "tf32":
            config.train.precision = "fp32"
    return config, kind


def format_summary(summary: dict) -> str:
    """A few lines about a finished training run (and its evaluation table when there is one)."""

    def number(value, spec):
        return "-" if value is None else format(value, spec)

    lines = [
        f"run dir        {summary['run_dir']}",
        f"steps          {summary['steps']} ({number(summary.get('epochs'), '.2f')} epochs, "
        f"{summary.get('world_size')} workers)",
        f"loss           first {number(summary.get('first_loss'), '.4f')}  "
        f"last {number(summary.get('last_loss'), '.4f')}",
        f"examples/s     {number(summary.get('examples_per_s'), ',.0f')}",
        f"checkpoint     {summary.get('checkpoint')}",
    ]
    if summary.get("resumed_from"):
        lines.append(f"resumed from   {summary['resumed_from']}")
    if summary.get("eval"):
        lines += ["", format_eval_table(summary["eval"])]
    return "\n".join(lines)


# ----------------------------------------------------------------------------------- Ray Jobs entrypoint
def run_job() -> int:
    """What a job submitted with ``bigrank submit`` runs: train the config of ``BIGRANK_JOB_CONFIG`` with Ray
    Train on the cluster the job runs in."""
    text = os.environ.get(CONFIG_ENV)
    if not text:
        print(f"bigrank job: {CONFIG_ENV} is not set (submit with `bigrank submit`)", file=sys.stderr)
        return 2
    # Which copy of the code runs: the working directory shipped with the job, not an installed bigrank.
    print(f"bigrank code: {Path(__file__).resolve().parent}", flush=True)
    config = config_from_dict(yaml.safe_load(text))
    summary = train(config, launcher="ray")
    print(format_summary(summary), flush=True)
    return 0


def main() -> int:
    """``python -m bigrank.run``: the Ray Jobs entrypoint; user errors print one line and exit with 2."""
    try:
        return run_job()
    except (CommandError, ConfigError, FileNotFoundError, ValueError) as error:
        print(f"bigrank job: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
