"""Negative samplers for sampled losses over an item-parallel catalog, and in-batch negatives shared by workers.

Each rank owns a contiguous shard ``[offset, offset + num_items)`` of the catalog and draws its negatives from
its own shard, so it can score them locally; the candidate columns of a batch are then split across ranks,
which is exactly the layout ``sampled_softmax_loss(..., group=group)`` expects.

Every sampler returns the global ids drawn and ``log_q``: the log of the *expected number of draws* of each
item in that call, ``log(num_samples * q_j)``. That is the logQ correction of sampled softmax (Bengio &
Senecal 2008; Yi et al. RecSys 2019): a constant ``log num_samples`` would cancel inside one softmax, but the
shards draw from different proposals (different sizes, different popularity mass), so only the expected count
makes the corrections of different ranks comparable.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from bigrank.distributed.collectives import all_gather_no_grad

__all__ = [
    "ItemFrequencyEstimator",
    "PopularitySampler",
    "SampledItems",
    "UniformSampler",
    "candidate_labels",
    "share_in_batch_items",
    "shard_columns",
]


@dataclass
class SampledItems:
    """``ids``: int64[n] global item ids (with repeats: sampling is with replacement). ``log_q``: float64[n],
    log of the expected number of draws of each id in the call that produced it."""

    ids: torch.Tensor
    log_q: torch.Tensor


def _check_shard(num_items, offset) -> None:
    if isinstance(num_items, bool) or not isinstance(num_items, int) or num_items < 1:
        raise ValueError(f"num_items (shard size) must be a positive integer, got {num_items!r}")
    if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
        raise ValueError(f"offset must be a non-negative integer, got {offset!r}")


def _check_num_samples(num_samples) -> None:
    if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < 1:
        raise ValueError(f"num_samples must be a positive integer, got {num_samples!r}")


class UniformSampler:
    """Uniform draws (with replacement) over the shard ``[offset, offset + num_items)``: q_j = 1 / num_items."""

    def __init__(self, num_items: int, offset: int = 0):
        _check_shard(num_items, offset)
        self.num_items, self.offset = num_items, offset

    def log_q(self, ids: torch.Tensor, num_samples: int) -> torch.Tensor:
        """log(num_samples / num_items) for every id of the shard (ValueError for ids outside it)."""
        _check_num_samples(num_samples)
        local = _local_ids(ids, self.offset, self.num_items)
        return torch.full(local.shape, math.log(num_samples / self.num_items), dtype=torch.float64)

    def sample(self, num_samples: int, generator: torch.Generator | None = None) -> SampledItems:
        _check_num_samples(num_samples)
        local = torch.randint(self.num_items, (num_samples,), generator=generator)
        ids = local + self.offset
        return SampledItems(ids, self.log_q(ids, num_samples))


class PopularitySampler:
    """Draws proportional to ``(counts + smoothing) ** beta`` over the shard (word2vec's unigram^0.75 proposal,
    Mikolov et al. 2013). ``counts``: float/int [num_items] interaction counts of the shard's items, in shard
    order. Items with zero weight are never drawn. beta = 0 is uniform; beta = 1 follows popularity."""

    def __init__(self, counts: torch.Tensor, beta: float = 0.75, offset: int = 0, smoothing: float = 0.0):
        if not isinstance(counts, torch.Tensor) or counts.dim() != 1:
            raise ValueError("counts must be a 1-D tensor of per-item counts for the shard")
        _check_shard(counts.numel(), offset)
        if not math.isfinite(beta) or beta < 0:
            raise ValueError(f"beta must be a finite number >= 0, got {beta!r}")
        if not math.isfinite(smoothing) or smoothing < 0:
            raise ValueError(f"smoothing must be a finite number >= 0, got {smoothing!r}")
        counts = counts.detach().to(torch.float64).cpu()
        if not bool(torch.isfinite(counts).all()) or bool((counts < 0).any()):
            raise ValueError("counts must be finite and >= 0")
        weights = (counts + smoothing).pow(beta) if beta > 0 else torch.ones_like(counts)
        weights = torch.where(counts + smoothing > 0, weights, torch.zeros_like(weights))
        total = float(weights.sum())
        if total <= 0:
            raise ValueError("every item of the shard has zero weight: nothing can be sampled")
        self.num_items, self.offset, self.beta = counts.numel(), offset, float(beta)
        self.probabilities = weights / total
        cdf = torch.cumsum(self.probabilities, 0)
        self._cdf = cdf / cdf[-1]  # exact 1 at the end, so every uniform draw in [0, 1) lands on an item

    def log_q(self, ids: torch.Tensor, num_samples: int) -> torch.Tensor:
        """log(num_samples * q_j) for ids of the shard (-inf for items that can never be drawn)."""
        _check_num_samples(num_samples)
        local = _local_ids(ids, self.offset, self.num_items)
        return math.log(num_samples) + torch.log(self.probabilities[local.cpu()]).to(local.device)

    def sample(self, num_samples: int, generator: torch.Generator | None = None) -> SampledItems:
        _check_num_samples(num_samples)
        uniform = torch.rand(num_samples, generator=generator, dtype=torch.float64)
        # Inverse-CDF sampling: the first item whose cumulative probability exceeds u (zero-weight items have
        # the same cdf as their predecessor and are skipped).
        local = torch.searchsorted(self._cdf, uniform, right=True).clamp_(max=self.num_items - 1)
        ids = local + self.offset
        return SampledItems(ids, self.log_q(ids, num_samples))


def _local_ids(ids: torch.Tensor, offset: int, num_items: int) -> torch.Tensor:
    if not isinstance(ids, torch.Tensor) or ids.is_floating_point() or ids.dtype == torch.bool:
        raise ValueError("ids must be an integer tensor of global item ids")
    local = ids.to(torch.int64) - offset
    if local.numel() and (int(local.min()) < 0 or int(local.max()) >= num_items):
        raise ValueError(f"ids outside this shard [{offset}, {offset + num_items})")
    return local


# ------------------------------------------------------------------------------------ in-batch negatives
def share_in_batch_items(item_ids: torch.Tensor, group=None) -> torch.Tensor:
    """The positive items of every worker's batch, concatenated in rank order: int64[sum_r B_r].

    In-batch negatives (Yi et al. 2019): each row's candidates are the other rows' positives. Sharing the ids
    across workers lets every worker use the global batch as its candidate set (each rank then scores the ones
    in its own item shard, see ``shard_columns``). No gradient: these are ids.
    """
    if not isinstance(item_ids, torch.Tensor) or item_ids.dim() != 1 or item_ids.is_floating_point():
        raise ValueError("item_ids must be a 1-D integer tensor")
    return all_gather_no_grad(item_ids.to(torch.int64), group)


def shard_columns(ids: torch.Tensor, offset: int, num_items: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Which of ``ids`` fall in the shard ``[offset, offset + num_items)``: (bool mask [n], local rows [m])."""
    _check_shard(num_items, offset)
    inside = (ids >= offset) & (ids < offset + num_items)
    return inside, ids[inside] - offset


def candidate_labels(positive_ids: torch.Tensor, candidate_ids: torch.Tensor) -> torch.Tensor:
    """``labels[b, c] = candidate_ids[c] == positive_ids[b]``: bool[B, C]. A row's own item drawn again as a
    "negative" (an accidental hit) is thereby marked positive and leaves that row's denominator."""
    return positive_ids.to(torch.int64).unsqueeze(1) == candidate_ids.to(torch.int64).unsqueeze(0)


class ItemFrequencyEstimator:
    """Streaming estimate of how often each item shows up in a batch (Yi et al. 2019, Algorithm 2, without
    hashing): for each item seen at step t, ``delta_j <- (1 - a) delta_j + a (t - last_j)``; the probability of
    appearing in a batch is ``1 / delta_j``, which is the expected count used as in-batch logQ.

    Keep one estimator per process, fed with the *global* batch ids (``share_in_batch_items``), so every rank
    holds the same estimate. ``state_dict()``/``load_state_dict()`` make it resumable.
    """

    def __init__(self, num_items: int, learning_rate: float = 0.01):
        _check_shard(num_items, 0)
        if not 0.0 < learning_rate <= 1.0:
            raise ValueError(f"learning_rate must be in (0, 1], got {learning_rate!r}")
        self.learning_rate = float(learning_rate)
        self.last_seen = torch.full((num_items,), -1, dtype=torch.int64)
        self.delta = torch.ones(num_items, dtype=torch.float64)

    def update(self, ids: torch.Tensor, step: int) -> None:
        """Record the ids of the global batch at training step ``step`` (each distinct id once)."""
        ids = torch.unique(ids.to(torch.int64).cpu())
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.delta.numel()):
            raise ValueError(f"ids outside [0, {self.delta.numel()})")
        seen = self.last_seen[ids] >= 0
        gap = (step - self.last_seen[ids]).to(torch.float64)
        updated = (1 - self.learning_rate) * self.delta[ids] + self.learning_rate * gap
        self.delta[ids] = torch.where(seen, updated, self.delta[ids])
        self.last_seen[ids] = step

    def log_q(self, ids: torch.Tensor) -> torch.Tensor:
        """log(1 / delta_j): log of the estimated expected count of each id in one batch, float64."""
        return -torch.log(self.delta[ids.to(torch.int64).cpu()].clamp_min(1.0)).to(ids.device)

    def state_dict(self) -> dict:
        return {"last_seen": self.last_seen.clone(), "delta": self.delta.clone(), "learning_rate": self.learning_rate}

    def load_state_dict(self, state: dict) -> None:
        if state["delta"].shape != self.delta.shape:
            raise ValueError(f"state holds {state['delta'].numel()} items, estimator has {self.delta.numel()}")
        self.last_seen = state["last_seen"].clone()
        self.delta = state["delta"].clone()
        self.learning_rate = float(state["learning_rate"])
