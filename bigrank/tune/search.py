"""The search: Ray Tune's set-up (ASHA on evaluated epochs, the base config's values as the first point, the
trial's resources), resuming an interrupted search, and the outputs."""

from __future__ import annotations

import contextlib
import copy
import json
import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path

from bigrank.atomic import write_json_atomic, write_text_atomic
from bigrank.config import (
    Config,
    ConfigError,
    get_key,
)
from bigrank.signals import graceful_stop, raise_in_ray, signal_name
from bigrank.tune.results import (
    SearchResult,
    _csv_text,
    _trial_rows,
    format_table,
    write_best_config,
)
from bigrank.tune.space import (
    _CONTEXT,
    SearchSpace,
    _max_epochs,
    search_base,
    set_space_key,
    validate_space,
)
from bigrank.tune.trial import bigrank_trial


def base_point(space: SearchSpace, base: dict) -> dict | None:
    """The base config's own values of the sampled keys, as a point for Tune's first trial; None when one of
    them lies outside its domain (the base is not in the space) or nothing is sampled.

    A search that starts from the given settings can only confirm or beat them on the validation metric (once
    that trial finishes: ASHA or the time budget may still stop it), instead of depending on the draws to come
    near them. Grid keys stay out of the point (Tune runs every grid value with it); fixed keys are the same
    for every trial anyway.
    """
    point: dict = {}
    for key, domain in space.params.items():
        if domain.kind in ("fixed", "grid"):
            continue
        value = get_key(base, key)
        if not domain.contains(value):
            return None
        set_space_key(point, key, value)
    return point or None


def param_space(space: SearchSpace, base: dict, runs_root: Path) -> dict:
    """Tune's ``param_space``: the base config with a Tune domain at every tuned key, plus the trial context."""
    tuned = copy.deepcopy(base)
    for key, domain in space.params.items():
        set_space_key(tuned, key, domain.to_tune())
    tuned[_CONTEXT] = {"runs_root": str(runs_root), "metric": space.metric}
    return tuned


def _check_same_search(out: Path, identity: dict) -> None:
    path = out / "search.json"
    if path.is_file():
        saved = json.loads(path.read_text())
        if saved != identity:
            changed = sorted(key for key in identity if saved.get(key) != identity[key])
            raise ConfigError(
                f"{out} holds a search with another {' and '.join(changed)}: Ray Tune cannot change a search "
                "half-way; use another --out (or remove that directory to start over)"
            )


def run_search(
    config: Config,
    space: SearchSpace,
    out: str | os.PathLike,
    *,
    trials: int | None = None,
    address: str | None = None,
    max_concurrent: int | None = None,
    time_budget_s: float | None = None,
    callbacks: list | None = None,
    verbose: int = 0,
    base_trial: bool = True,
) -> SearchResult:
    """Run (or resume) the search of ``space`` around ``config``; write the trials table and the best config.

    Args:
        config: the base config (validated); every trial is this config with the space's values set.
        space: from :func:`load_space`; checked here with :func:`validate_space` before Ray starts.
        out: the experiment directory (Tune state, ``runs/``, ``trials.csv``, ``trials.txt``, ``best.yaml``).
        trials: samples of the space (default: the space file's ``trials``).
        address: a Ray cluster to join (default: ``ray.address``, ``RAY_ADDRESS``, else an embedded runtime).
        max_concurrent: at most this many trials at once (default: as many as the CPUs allow).
        time_budget_s: stop the search after this many seconds (running trials are stopped; a later run of
            the same search does not resume them).
        callbacks: extra Tune callbacks (tests).
        verbose: Tune's own progress output (0: none; each trial prints a line per evaluation).
        base_trial: run the base config's values of the sampled keys as the first trial (when they lie in the
            space; :func:`base_point`), so the search starts from the given settings.
    Returns a :class:`SearchResult`. Raises SpaceError/ConfigError naming the bad key before Ray starts, and
    RunDirectoryInUse when another process holds ``out`` (``bigrank.runlock``: one search at a time writes it).

    Stopping (called from the main thread). The first SIGINT or SIGTERM ends the search as Ray Tune ends it on
    Ctrl+C: Tune saves the experiment state, stops the running trials (their actors end, and with them the
    trials' training processes) and returns; the tables are written and the result's ``stopped_by`` names the
    signal. The same call again resumes the search. A second signal stops at once (KeyboardInterrupt /
    Terminated), as does a signal before Tune runs.
    """
    from bigrank.runlock import hold_run_dir

    out = Path(out).resolve()
    base = search_base(config)
    validate_space(space, base)
    with hold_run_dir(out, "bigrank tune"):
        return _search(
            config, space, out, base, trials=trials, address=address, max_concurrent=max_concurrent,
            time_budget_s=time_budget_s, callbacks=callbacks, verbose=verbose, base_trial=base_trial,
        )  # fmt: skip


def _search(
    config: Config,
    space: SearchSpace,
    out: Path,
    base: dict,
    *,
    trials: int | None,
    address: str | None,
    max_concurrent: int | None,
    time_budget_s: float | None,
    callbacks: list | None,
    verbose: int,
    base_trial: bool,
) -> SearchResult:
    """:func:`run_search` once ``out`` is held: Tune's run, then the trials table and the best config."""
    import ray
    from ray import tune
    from ray.tune.schedulers import ASHAScheduler
    from ray.tune.search import BasicVariantGenerator

    from bigrank.launch.ray_train import init_ray, resolve_address

    trials = trials or space.trials
    identity = {"config": json.loads(json.dumps(base)), "space": json.loads(json.dumps(space.raw, default=str))}
    _check_same_search(out, identity)
    out.mkdir(parents=True, exist_ok=True)
    write_json_atomic(out / "search.json", identity)

    metric = f"valid/{space.metric}"
    max_t = _max_epochs(space, base)
    every = int(base["eval"]["every_epochs"])
    grace = space.grace_period or max(every, max_t // 4)
    scheduler = ASHAScheduler(
        time_attr="epoch",
        max_t=max_t,
        grace_period=min(grace, max_t),
        reduction_factor=space.reduction_factor,
    )
    resources = tune.PlacementGroupFactory([{"CPU": config.workers * config.ray.cpus_per_worker}])
    trainable = tune.with_resources(bigrank_trial, resources)
    address = resolve_address(config, address)
    with graceful_stop(_end_tune_run) as stop:
        owns_runtime = init_ray(config, address)
        stop.reinstall()  # ray.init installs a SIGTERM handler of its own, which aborts this process
        try:
            if tune.Tuner.can_restore(str(out)):
                print(f"resuming the search in {out}", flush=True)
                tuner = tune.Tuner.restore(str(out), trainable=trainable, resume_unfinished=True, resume_errored=True)
            else:
                start = base_point(space, base) if base_trial else None
                if start is not None:
                    print("the first trial runs the base config's values of the sampled keys", flush=True)
                tuner = tune.Tuner(
                    trainable,
                    param_space=param_space(space, base, out / "runs"),
                    tune_config=tune.TuneConfig(
                        metric=metric,
                        mode="max",
                        scheduler=scheduler,
                        search_alg=BasicVariantGenerator(points_to_evaluate=[start] if start else None),
                        num_samples=trials,
                        max_concurrent_trials=max_concurrent or space.max_concurrent,
                        time_budget_s=time_budget_s,
                    ),
                    run_config=tune.RunConfig(
                        name=out.name,
                        storage_path=str(out.parent),
                        callbacks=callbacks,
                        verbose=verbose,
                        checkpoint_config=tune.CheckpointConfig(num_to_keep=1),
                    ),
                )
            with _tune_signals():
                results = tuner.fit()
        finally:
            if owns_runtime:
                ray.shutdown()

    rows = _trial_rows(results, space)
    table = format_table(rows)
    if rows:
        write_text_atomic(out / "trials.csv", _csv_text(rows))
    write_text_atomic(out / "trials.txt", table + "\n")
    best_path = None
    finished = [row for row in rows if row["status"] == "finished" and row[f"valid {space.metric}"] is not None]
    if finished:
        best_path = write_best_config(finished[0], config.run_dir, out / "best.yaml", space.metric)
    return SearchResult(rows=rows, best_config=best_path, out=out, table=table, stopped_by=stop.signum)


def _end_tune_run(signum: int) -> None:
    """The first SIGINT/SIGTERM of a search: Tune's own graceful end (the handler it installs for SIGUSR1 and,
    unless disabled, SIGINT while ``Tuner.fit`` runs), or a plain stop before Tune runs."""
    tune_handler = signal.getsignal(signal.SIGUSR1)
    if not callable(tune_handler):  # Tune is not running (yet, or any more): stop now, also inside ray.init
        raise_in_ray(signum)
    print(
        f"{signal_name(signum)}: ending the search; Ray Tune saves its state and stops the running trials "
        "(again to stop at once)",
        file=sys.stderr,
        flush=True,
    )
    tune_handler(signal.SIGUSR1, None)


@contextlib.contextmanager
def _tune_signals() -> Iterator[None]:
    """Around ``Tuner.fit``: Tune leaves SIGINT to ``graceful_stop`` (so that SIGINT and SIGTERM end the search
    the same way and the command knows which came), and the SIGUSR1 handler it installs (and never removes)
    goes when the fit returns, so that :func:`_end_tune_run` knows whether Tune runs."""
    name = "TUNE_DISABLE_SIGINT_HANDLER"
    saved_env, saved_usr1 = os.environ.get(name), signal.getsignal(signal.SIGUSR1)
    os.environ[name] = "1"
    try:
        yield
    finally:
        signal.signal(signal.SIGUSR1, saved_usr1 if saved_usr1 is not None else signal.SIG_DFL)
        if saved_env is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = saved_env
