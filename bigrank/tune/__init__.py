"""``bigrank tune``: hyper-parameter search on Ray Tune, each trial a normal bigrank training run.

    bigrank tune CONFIG --space SPACE.yaml [--trials N] [--out DIR] [--address HOST:6379] [--set key=value]

The space file names config keys with the values to try::

    metric: ap@10                 # validation metric to maximise (eval.ks decide which exist); default ap@10
    trials: 8                     # samples of the space (each grid point is run that many times); default 1
    scheduler: {grace_period: 2, reduction_factor: 3}    # ASHA over evaluated epochs (optional)
    space:
      optim.user_lr: {loguniform: [0.01, 0.5]}
      model.dim: {choice: [32, 64]}
      loss.params.k: {grid: [1, 5]}
      train.epochs: 10            # a plain value: fixed for every trial

Domains: ``grid`` (every value, Tune's grid search), ``choice`` (one at random), ``uniform``/``loguniform``
([low, high] floats), ``randint`` ([low, high] integers, both included). Every key and every value is checked
against the config schema before Ray starts: a key that does not exist, a value the key refuses, or two values
of two keys that cannot go together (``model.history: false`` and ``model.history_dropout: 0.5``), is an error
naming the key or keys.

How a trial runs. Tune runs :func:`bigrank_trial` in an actor holding ``workers * ray.cpus_per_worker`` CPUs
(one placement-group bundle, so one node); the trial starts the run's ``workers`` gloo processes there with the
local launcher (``bigrank.train.launcher.launch_local``: the same ``train_worker`` as ``bigrank train``) in
``DIR/runs/TRIAL_ID``, evaluating the validation split every ``eval.every_epochs`` epochs (1 when unset). The
trial follows the run's ``metrics.jsonl`` and reports each validation evaluation to Tune (``valid/<metric>``,
``epoch``) as soon as training has moved past it, then the final valid and test evaluation with
``finished = 1``. ASHA (``AsyncHyperBandScheduler`` on ``epoch``) stops poor trials early. The first trial runs
the base config's own values of the sampled keys when they lie in the space (:func:`base_point`;
``--no-base-trial`` samples it too). The trainer is a
black box here: anything ``bigrank train`` accepts can be tuned.

Resuming. The search state lives in ``DIR`` (Tune's experiment directory). Running the same command again
restores it (``Tuner.restore``): finished trials are kept, interrupted ones continue — Tune restarts their
function with the last reported step (a tiny Tune checkpoint), and the trainer resumes from the newest
checkpoint of the trial's run directory, so no finished epoch is trained twice. A changed config or space is
refused (Tune cannot change a search half-way): use a new ``--out``.

Outputs (``DIR``): ``trials.csv`` and ``trials.txt`` (one row per trial: status, the tuned values, epochs,
validation and test metrics), ``best.yaml`` (the resolved config of the best *finished* trial by the last
validation metric, ``run_dir`` set back to the base config's: ``bigrank train DIR/best.yaml`` reproduces it).
When no trial finished, no ``best.yaml`` is written and ``bigrank tune`` exits with status 1, saying how many
trials ended how (and, when every trial failed, the first trial's error).

Where Ray runs: no ``--address`` (nor ``ray.address`` / ``RAY_ADDRESS``): an embedded local runtime with the
machine's CPUs; otherwise the cluster at that address (``DIR`` must then be on storage every node sees, and
the data too, as for ``bigrank train --address``).

Where it sits: above the run layer (``bigrank.run``), whose pre-flight each trial runs as a command does, and below
the command (``bigrank.cli.tune``). Ray's start-up is ``bigrank.launch.ray_train.init_ray``'s, as for training.
"""

from bigrank.config import get_key
from bigrank.tune.results import SearchResult, format_table, write_best_config
from bigrank.tune.search import base_point, param_space, run_search
from bigrank.tune.space import (
    DOMAINS,
    Domain,
    SearchSpace,
    SpaceError,
    load_space,
    search_base,
    validate_space,
)
from bigrank.tune.trial import bigrank_trial, completed_evaluations

__all__ = [
    "DOMAINS",
    "Domain",
    "SearchResult",
    "SearchSpace",
    "SpaceError",
    "base_point",
    "bigrank_trial",
    "completed_evaluations",
    "format_table",
    "get_key",
    "load_space",
    "param_space",
    "run_search",
    "search_base",
    "validate_space",
    "write_best_config",
]
