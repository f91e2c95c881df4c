"""Shared set-up of the sampled ``StepLoss`` tests: a small catalog (sampled negatives then hit positives and
repeat), its inputs, and the generic candidate columns built the straightforward way."""

from __future__ import annotations

import torch

from bigrank.config import LossConfig
from bigrank.data.samplers import candidate_labels
from bigrank.train.losses import StepLoss

NUM_ITEMS, DIM, BATCH = 40, 5, 12


def sampled_step_loss(
    name, params=None, start=0, stop=NUM_ITEMS, *, seed, negatives=30, sampler="uniform", rank=0, warmup=None
) -> StepLoss:
    """A sampled-candidates ``StepLoss`` of shard ``[start, stop)`` (popularity counts 0, 1, 2, ...)."""
    config = LossConfig(
        name=name, candidates="sampled", num_negatives=negatives, sampler=sampler, params=params or {}, warmup=warmup
    )
    counts = torch.arange(stop - start, dtype=torch.float64) if sampler == "popularity" else None
    return StepLoss(
        config, num_items=NUM_ITEMS, shard_start=start, shard_stop=stop, item_counts=counts, seed=seed, rank=rank
    )


def sampled_inputs(seed):
    """(users float64[BATCH, DIM], catalog float64[NUM_ITEMS, DIM], target int64[BATCH])."""
    generator = torch.Generator().manual_seed(seed)
    users = torch.randn(BATCH, DIM, generator=generator, dtype=torch.float64)
    catalog = torch.randn(NUM_ITEMS, DIM, generator=generator, dtype=torch.float64)
    target = torch.randint(0, NUM_ITEMS, (BATCH,), generator=generator)
    return users, catalog, target


def reference_columns(step_loss, target, step):
    """The candidate columns of a sampled step built the straightforward way: ids [unique positives of the
    shard | negatives], labels (hits are positives), the positive-only-in-its-row mask and log_q."""
    draw = step_loss._draw(target, step)
    positives = torch.unique(draw.positives)
    ids = torch.cat([positives, draw.negatives])
    labels = candidate_labels(target, ids)
    mask = torch.ones_like(labels)
    mask[:, : positives.numel()] = labels[:, : positives.numel()]
    pos_log_q = step_loss.sampler.log_q(positives, step_loss.num_samples)
    return ids, labels, mask, torch.cat([pos_log_q, draw.neg_log_q])
