"""Batches of users, not of rows: the stream of a user-major step (the item-item model; the towers with
``train.batching: users``)."""

from __future__ import annotations

import math

import numpy as np
import torch

__all__ = ["UserBatches"]

_USER_ORDER = 0x5E25  # tags the seed of the users' order apart from the other numpy streams of a run


class UserBatches:
    """The users with a train item, in a new random order each epoch, ``batch_size`` users per global step.

    Rank ``r`` of ``W`` trains on users ``[r * b // W, (r + 1) * b // W)`` of each global batch of ``b`` users
    (a slice may be empty). The position is a count of global steps in the epoch, so a run resumes on any
    worker count. Yields ``{"user_id": int64[slice]}``; :attr:`epoch` moves on as the epoch's last batch is
    handed out (before the caller trains on it), as ``ParquetStream``'s does.
    """

    def __init__(self, users: np.ndarray, batch_size: int, *, rank: int = 0, world_size: int = 1, seed: int = 0):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.users = np.asarray(users, dtype=np.int64)
        self.batch_size, self.rank, self.world_size, self.seed = int(batch_size), rank, world_size, seed
        self.epoch, self._step = 0, 0

    def steps_per_epoch(self) -> int:
        return math.ceil(len(self.users) / self.batch_size)

    def steps_left_in_epoch(self) -> int:
        return self.steps_per_epoch() - self._step

    def order(self, epoch: int) -> np.ndarray:
        """The users in the order of ``epoch``: a function of ``(seed, epoch)`` alone."""
        return np.random.default_rng([self.seed, epoch, _USER_ORDER]).permutation(self.users)

    def __iter__(self):
        steps, order = self.steps_per_epoch(), self.order(self.epoch)
        for step in range(self._step, steps):
            batch = order[step * self.batch_size : (step + 1) * self.batch_size]
            mine = batch[self.rank * len(batch) // self.world_size : (self.rank + 1) * len(batch) // self.world_size]
            if step + 1 >= steps:
                self.epoch, self._step = self.epoch + 1, 0
            else:
                self._step = step + 1
            yield {"user_id": torch.from_numpy(mine.copy())}

    def state_dict(self) -> dict:
        return {
            "epoch": self.epoch,
            "step": self._step,
            "batch_size": self.batch_size,
            "users": len(self.users),
            "seed": self.seed,
        }

    def load_state_dict(self, state: dict) -> None:
        for key, mine in (("batch_size", self.batch_size), ("users", len(self.users)), ("seed", self.seed)):
            if int(state[key]) != mine:
                raise ValueError(f"user-batch state has {key}={state[key]} but this run has {mine}")
        self.epoch, self._step = int(state["epoch"]), int(state["step"])
