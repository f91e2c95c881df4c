"""The training-time history bags of bigrank.train.model: the row's own positive is left out, with
``model.history_dropout`` each other item leaves the bag independently with that probability, and with
``model.history_sample_size`` a longer bag keeps a random subset of that size, dropout first (brute-force
reference: the same numpy draws, one user at a time). The draws of a step are a function of (seed, step, rank)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from bigrank.train.model import history_bags, history_generator

# CSR of 4 users' train items: user 2 has none.
INDPTR = np.array([0, 3, 5, 5, 9])
ITEMS = np.array([4, 1, 7, 2, 4, 0, 3, 5, 6])


def _bags(values, lengths):
    return [row.tolist() for row in torch.split(values, lengths.tolist())]


def _reference_bags(users, exclude, dropout, seed, sample_size=None):
    """The bags drawn one user at a time: the positive left out, then each item's dropout draw, then the sample."""
    rng, expected = np.random.default_rng(seed), []
    for user, positive in zip(users.tolist(), exclude.tolist(), strict=True):
        row = np.array([item for item in ITEMS[INDPTR[user] : INDPTR[user + 1]] if item != positive], dtype=np.int64)
        row = row[rng.random(len(row)) >= dropout]
        if sample_size is not None and len(row) > sample_size:
            row = row[np.sort(rng.choice(len(row), sample_size, replace=False))]
        expected.append(row.tolist())
    return expected


def test_bags_leave_out_the_rows_positive_and_unknown_users_are_empty():
    users = torch.tensor([0, 1, 2, 3, -1])
    values, lengths = history_bags((INDPTR, ITEMS), users, torch.tensor([1, 9, 0, 0, 3]))
    assert _bags(values, lengths) == [[4, 7], [2, 4], [], [3, 5, 6], []]
    values, lengths = history_bags((INDPTR, ITEMS), users, None)  # evaluation: the whole bag
    assert _bags(values, lengths) == [[4, 1, 7], [2, 4], [], [0, 3, 5, 6], []]


@pytest.mark.parametrize("dropout", [0.25, 0.5])
def test_dropout_keeps_the_items_whose_draw_is_at_least_p(dropout):
    users, exclude = torch.tensor([3, 0, 2, 3]), torch.tensor([5, 1, 0, 0])
    values, lengths = history_bags((INDPTR, ITEMS), users, exclude, dropout, np.random.default_rng(7))
    assert _bags(values, lengths) == _reference_bags(users, exclude, dropout, seed=7)


def test_dropout_removes_about_p_of_a_long_bag_and_the_same_seed_draws_the_same_bags():
    indptr, items = np.array([0, 20_000]), np.arange(20_000)
    users, exclude = torch.tensor([0]), torch.tensor([-1])
    values, lengths = history_bags((indptr, items), users, exclude, 0.3, np.random.default_rng(1))
    assert abs(int(lengths[0]) / 20_000 - 0.7) < 0.02
    again, _ = history_bags((indptr, items), users, exclude, 0.3, np.random.default_rng(1))
    other, _ = history_bags((indptr, items), users, exclude, 0.3, np.random.default_rng(2))
    assert torch.equal(values, again) and not torch.equal(values[:1000], other[:1000])


def test_sample_size_keeps_a_random_subset_of_at_most_that_many_items_in_bag_order():
    users, exclude = torch.tensor([3, 0, 2]), torch.tensor([-1, 4, -1])
    values, lengths = history_bags((INDPTR, ITEMS), users, exclude, 0.0, np.random.default_rng(3), sample_size=2)
    bags = _bags(values, lengths)
    assert lengths.tolist() == [2, 2, 0]  # user 3's 4 items sampled down, user 0's 2 left whole
    assert bags[1] == [1, 7]
    positions = [ITEMS[5:9].tolist().index(item) for item in bags[0]]
    assert positions == sorted(positions) and len(set(positions)) == 2
    drawn = {
        tuple(_bags(*history_bags((INDPTR, ITEMS), users, exclude, 0.0, np.random.default_rng(s), 2))[0])
        for s in range(40)
    }
    assert len(drawn) == 6  # every 2-subset of 4 items comes up


def test_dropout_comes_before_the_sample_size():
    users, exclude = torch.tensor([3, 0, 3, 1]), torch.tensor([-1, 4, 6, -1])
    values, lengths = history_bags((INDPTR, ITEMS), users, exclude, 0.3, np.random.default_rng(5), sample_size=2)
    assert _bags(values, lengths) == _reference_bags(users, exclude, 0.3, seed=5, sample_size=2)


def test_draws_without_a_generator_are_an_error():
    for dropout, sample_size in ((0.5, None), (0.0, 2)):
        with pytest.raises(ValueError, match="numpy Generator"):
            history_bags((INDPTR, ITEMS), torch.tensor([0]), None, dropout, None, sample_size)


def test_each_step_and_rank_draws_other_masks_and_the_same_ones_again():
    def mask(seed, step, rank):
        return history_generator(seed, step, rank).random(64) >= 0.5

    assert np.array_equal(mask(0, 7, 1), mask(0, 7, 1))  # a resumed step draws what it drew before
    others = [mask(0, 8, 1), mask(0, 7, 0), mask(1, 7, 1), mask(0, 0, 0)]
    assert all(not np.array_equal(mask(0, 7, 1), other) for other in others)
