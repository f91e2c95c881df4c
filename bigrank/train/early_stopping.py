"""Early stopping on the validation split (``train.early_stopping``): the number of epochs a dataset needs is read
from its validation split, not fixed by a config tuned on another dataset.

The trainer evaluates ``eval.splits[0]`` (valid) every ``eval.every_epochs`` epochs, and once more after the last
step. Each evaluation's ``metric`` is recorded in the run's ``TrainState`` (checkpointed with it). An evaluation
is *better* when its value exceeds the best so far by more than ``min_delta``; after ``patience`` evaluations in a
row that are not, the run stops. Either way the run ends with the weights of its best evaluation, as Keras'
``EarlyStopping(restore_best_weights=True)`` does: the best evaluation's checkpoint is kept whatever
``train.keep_checkpoints`` says, and the end of the run loads its model parts and writes them as the run's last
checkpoint (``trainer.json`` names ``weights_from_step``), so ``bigrank evaluate``, ``export`` and a warm start read
the best model, and a resume finds the run finished.
"""

from __future__ import annotations

from bigrank.config import EarlyStoppingConfig
from bigrank.train.state import TrainState

__all__ = ["EarlyStopping"]


class EarlyStopping:
    """The stop rule of ``config`` over the evaluations recorded in ``state`` (its ``evaluations`` and ``stopped``)."""

    def __init__(self, config: EarlyStoppingConfig, state: TrainState):
        self.config, self.state = config, state

    @property
    def metric(self) -> str:
        return self.config.metric

    def best(self) -> tuple[int, float] | None:
        """``(step, value)`` of the best evaluation so far (the first of equal ones), or None before any."""
        best = None
        for step, value in self.state.evaluations:
            if best is None or value > best[1] + self.config.min_delta:
                best = (int(step), float(value))
        return best

    def waited(self) -> int:
        """Evaluations since the best one."""
        best = self.best()
        return 0 if best is None else sum(1 for step, _ in self.state.evaluations if step > best[0])

    def evaluated(self, step: int) -> bool:
        """Whether the evaluation after step ``step`` is recorded."""
        return any(int(recorded) == step for recorded, _ in self.state.evaluations)

    def record(self, step: int, results: dict) -> bool:
        """Record the evaluation after step ``step`` (``results``: its metrics); returns whether the run must stop
        now (then ``state.stopped`` is set). Raises KeyError naming the metrics when ``results`` lacks the metric."""
        if self.metric not in results:
            known = sorted(key for key, value in results.items() if isinstance(value, float))
            raise KeyError(f"train.early_stopping.metric {self.metric!r} is not evaluated (evaluated: {known})")
        if not self.evaluated(step):
            self.state.evaluations.append([int(step), float(results[self.metric])])
        if self.waited() >= self.config.patience:
            self.state.stopped = True
        return self.state.stopped

    def describe(self) -> str:
        """One line for the log: the best evaluation and, when stopped, why."""
        best = self.best()
        if best is None:
            return f"early stopping on {self.metric}: no evaluation yet"
        line = f"best {self.metric} {best[1]:.4f} after step {best[0]}"
        if self.state.stopped:
            line = f"stopped early ({self.waited()} evaluations without a better {self.metric}); {line}"
        return line
