"""Negative samplers over an item shard, in-batch negatives across real gloo workers, frequency estimation."""

from __future__ import annotations

import math

import pytest
import torch

from bigrank.data.samplers import (
    ItemFrequencyEstimator,
    PopularitySampler,
    UniformSampler,
    candidate_labels,
    shard_columns,
    share_in_batch_items,
)
from tests.distributed_utils import run_distributed


def test_uniform_sampler_stays_in_its_shard_and_is_uniform():
    sampler = UniformSampler(num_items=20, offset=100)
    drawn = sampler.sample(40_000, generator=torch.Generator().manual_seed(0))
    assert drawn.ids.dtype == torch.int64 and int(drawn.ids.min()) >= 100 and int(drawn.ids.max()) < 120
    torch.testing.assert_close(drawn.log_q, torch.full((40_000,), math.log(40_000 / 20), dtype=torch.float64))
    frequency = torch.bincount(drawn.ids - 100, minlength=20).double() / 40_000
    assert float((frequency - 1 / 20).abs().max()) < 0.01  # ~5 standard errors
    with pytest.raises(ValueError, match="outside this shard"):
        sampler.log_q(torch.tensor([99]), 10)


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_popularity_sampler_follows_counts_to_the_beta(beta):
    counts = torch.tensor([0.0, 1.0, 4.0, 9.0, 16.0, 100.0])
    sampler = PopularitySampler(counts, beta=beta, offset=10)
    drawn = sampler.sample(60_000, generator=torch.Generator().manual_seed(1))
    local = drawn.ids - 10
    expected = torch.where(counts > 0, counts.double().pow(beta), 0.0)
    expected = expected / expected.sum()
    frequency = torch.bincount(local, minlength=6).double() / 60_000
    assert int((local == 0).sum()) == 0  # a never-seen item is never drawn
    assert float((frequency - expected).abs().max()) < 0.01
    torch.testing.assert_close(drawn.log_q, math.log(60_000) + torch.log(expected[local]))


def test_popularity_sampler_smoothing_and_bad_input():
    smoothed = PopularitySampler(torch.tensor([0.0, 3.0]), beta=1.0, smoothing=1.0)
    torch.testing.assert_close(smoothed.probabilities, torch.tensor([0.2, 0.8], dtype=torch.float64))
    with pytest.raises(ValueError, match="zero weight"):
        PopularitySampler(torch.zeros(5))
    with pytest.raises(ValueError, match="finite and >= 0"):
        PopularitySampler(torch.tensor([1.0, -1.0]))
    with pytest.raises(ValueError, match="beta"):
        PopularitySampler(torch.ones(3), beta=-0.5)
    with pytest.raises(ValueError, match="1-D"):
        PopularitySampler(torch.ones(3, 2))
    with pytest.raises(ValueError, match="num_samples"):
        UniformSampler(5).sample(0)
    with pytest.raises(ValueError, match="num_items"):
        UniformSampler(0)


def test_candidate_labels_and_shard_columns():
    labels = candidate_labels(torch.tensor([3, 7]), torch.tensor([7, 3, 3, 9]))
    assert labels.tolist() == [[False, True, True, False], [True, False, False, False]]
    inside, local = shard_columns(torch.tensor([5, 12, 19, 20, 11]), offset=10, num_items=10)
    assert inside.tolist() == [False, True, True, False, True] and local.tolist() == [2, 9, 1]


def _share_body(rank, world_size, group):
    ids = torch.arange(rank + 1) + 10 * rank  # uneven batch sizes: 1, 2, 3
    return share_in_batch_items(ids, group)


def test_in_batch_items_are_shared_across_workers_in_rank_order():
    results = run_distributed(_share_body, 3)
    for shared in results:
        assert shared.tolist() == [0, 10, 11, 20, 21, 22]
    assert share_in_batch_items(torch.tensor([4, 2])).tolist() == [4, 2]
    with pytest.raises(ValueError, match="1-D integer"):
        share_in_batch_items(torch.tensor([1.0]))


def test_item_frequency_estimator_learns_the_gap_between_appearances_and_resumes():
    estimator = ItemFrequencyEstimator(num_items=4, learning_rate=0.2)
    for step in range(400):
        ids = [0] + ([1] if step % 4 == 0 else []) + ([2] if step % 10 == 0 else [])
        estimator.update(torch.tensor(ids + [0]), step)  # repeats in one batch count once
    log_q = estimator.log_q(torch.tensor([0, 1, 2]))
    torch.testing.assert_close(
        log_q, -torch.log(torch.tensor([1.0, 4.0, 10.0], dtype=torch.float64)), atol=1e-3, rtol=0
    )
    restored = ItemFrequencyEstimator(num_items=4)
    restored.load_state_dict(estimator.state_dict())
    estimator.update(torch.tensor([3]), 400)
    restored.update(torch.tensor([3]), 400)
    torch.testing.assert_close(restored.delta, estimator.delta)
    with pytest.raises(ValueError, match="outside"):
        estimator.update(torch.tensor([4]), 401)
