"""Sampled softmax with logQ correction: loop reference, cross-entropy equivalence, unbiasedness of the
corrected normaliser with a real popularity sampler, degenerate rows, bad input, item-parallel equality."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from bigrank.data.samplers import PopularitySampler
from bigrank.losses.sampled import SampledSoftmaxLoss, sampled_softmax_loss
from tests.distributed_utils import run_distributed


def make_batch(batch=6, width=19, seed=0):
    gen = torch.Generator().manual_seed(seed)
    scores = 2 * torch.randn(batch, width, generator=gen, dtype=torch.float64)
    labels = torch.rand(batch, width, generator=gen) < 0.2
    mask = torch.rand(batch, width, generator=gen) < 0.85
    log_q = torch.randn(batch, width, generator=gen, dtype=torch.float64)
    labels[0] = False
    labels[1] = True
    labels[2] = False
    labels[2, 4] = mask[2, 4] = True
    return scores, labels, mask, log_q


def reference(scores, labels, mask, log_q):
    losses, valid = [], []
    for b in range(scores.shape[0]):
        cand = [j for j in range(scores.shape[1]) if mask is None or bool(mask[b, j])]
        pos = [j for j in cand if bool(labels[b, j])]
        neg = [j for j in cand if j not in pos]
        if not pos or not neg:
            losses.append(scores.new_zeros(()))
            valid.append(False)
            continue
        z = scores[b] - (0 if log_q is None else log_q[b])
        total = sum(-z[p] + torch.log(torch.exp(z[p]) + sum(torch.exp(z[n]) for n in neg)) for p in pos)
        losses.append(total / len(pos))
        valid.append(True)
    return torch.stack(losses), torch.tensor(valid)


@pytest.mark.parametrize(
    "use_mask,use_log_q,log_q_1d", [(False, False, False), (True, True, False), (True, True, True)]
)
def test_matches_loop_reference_value_and_gradient(use_mask, use_log_q, log_q_1d):
    scores, labels, mask, log_q = make_batch()
    mask = mask if use_mask else None
    log_q = (log_q[0] if log_q_1d else log_q) if use_log_q else None
    ours = scores.clone().requires_grad_(True)
    theirs = scores.clone().requires_grad_(True)
    loss, valid = sampled_softmax_loss(ours, labels, log_q, mask, "none", return_valid=True)
    ref, ref_valid = reference(theirs, labels, mask, None if log_q is None else log_q.expand_as(scores))
    assert torch.equal(valid, ref_valid) and not valid[0] and not valid[1] and valid[2]
    torch.testing.assert_close(loss, ref, rtol=1e-10, atol=1e-12)
    loss.sum().backward()
    ref.sum().backward()
    torch.testing.assert_close(ours.grad, theirs.grad, rtol=1e-9, atol=1e-12)


def test_one_positive_per_row_is_cross_entropy_and_large_scores_are_stable():
    gen = torch.Generator().manual_seed(1)
    scores = 50 * torch.randn(8, 30, generator=gen)
    target = torch.randint(0, 30, (8,), generator=gen)
    labels = F.one_hot(target, 30).bool()
    torch.testing.assert_close(sampled_softmax_loss(scores, labels), F.cross_entropy(scores, target))
    log_q = torch.randn(30, generator=gen)
    torch.testing.assert_close(sampled_softmax_loss(scores, labels, log_q), F.cross_entropy(scores - log_q, target))


def test_log_q_correction_makes_the_sampled_normaliser_unbiased():
    """With candidates drawn from a popularity proposal, sum_samples exp(s - log(n q)) estimates the full
    sum_j exp(s_j) (importance sampling), so the corrected loss approaches the full softmax loss."""
    gen = torch.Generator().manual_seed(2)
    num_items, draws = 50, 40_000
    item_scores = torch.randn(num_items, generator=gen, dtype=torch.float64)
    counts = torch.randint(200, 1000, (num_items,), generator=gen).double()
    sampler = PopularitySampler(counts, beta=1.0)
    drawn = sampler.sample(draws, generator=gen)
    positive = 7
    candidates = torch.cat([torch.tensor([positive]), drawn.ids[drawn.ids != positive]])
    log_q = torch.cat([torch.zeros(1, dtype=torch.float64), drawn.log_q[drawn.ids != positive]])
    scores = item_scores[candidates].unsqueeze(0)
    labels = torch.zeros_like(scores, dtype=torch.bool)
    labels[0, 0] = True
    full = F.cross_entropy(item_scores.unsqueeze(0), torch.tensor([positive]))
    corrected = sampled_softmax_loss(scores, labels, log_q)
    uncorrected = sampled_softmax_loss(scores, labels)
    assert abs(float(corrected - full)) < 0.02
    assert abs(float(uncorrected - full)) > 5  # log(draws) off without the correction


def test_degenerate_rows_module_temperature_and_bad_input():
    scores, labels, mask, log_q = make_batch()
    x = scores.clone().requires_grad_(True)
    module = SampledSoftmaxLoss()
    loss = module(x, labels, mask, log_q=log_q)
    loss.backward()
    per_row, valid = sampled_softmax_loss(scores, labels, log_q, mask, "none", return_valid=True)
    torch.testing.assert_close(loss.detach(), per_row[valid].mean())
    assert module.last_excluded_rows == 2 and torch.isfinite(x.grad).all() and torch.all(x.grad[:2] == 0)
    module.temperature = 2.0
    torch.testing.assert_close(
        module(scores, labels, mask, log_q=log_q), sampled_softmax_loss(scores / 2, labels, log_q, mask)
    )
    everything_positive = sampled_softmax_loss(x, torch.ones_like(labels))
    assert float(everything_positive.detach()) == 0.0
    masked_inf = log_q.masked_fill(~mask, float("inf"))
    torch.testing.assert_close(
        sampled_softmax_loss(scores, labels, masked_inf, mask), sampled_softmax_loss(scores, labels, log_q, mask)
    )
    with pytest.raises(ValueError, match="log_q must be finite"):
        sampled_softmax_loss(scores, labels, masked_inf)
    with pytest.raises(ValueError, match="log_q must have shape"):
        sampled_softmax_loss(scores, labels, log_q[:, :3])
    with pytest.raises(ValueError, match="log_q must be a floating-point"):
        sampled_softmax_loss(scores, labels, log_q.long())
    with pytest.raises(ValueError, match="labels must be a bool"):
        sampled_softmax_loss(scores, labels.float())
    with pytest.raises(ValueError, match="NaN or infinite"):
        sampled_softmax_loss(scores.masked_fill(labels, float("nan")), labels)
    with pytest.raises(ValueError, match="temperature"):
        SampledSoftmaxLoss(temperature=0.0)


def _distributed_body(rank, world_size, group, scores, labels, mask, log_q, splits):
    start = sum(splits[:rank])
    stop = start + splits[rank]
    local = scores[:, start:stop].clone().requires_grad_(True)
    loss, valid = sampled_softmax_loss(
        local, labels[:, start:stop], log_q[:, start:stop], mask[:, start:stop], group=group, return_valid=True
    )
    loss.backward()
    return loss.detach(), valid, local.grad


@pytest.mark.parametrize("splits", [[4, 15], [7, 0, 12]])
def test_distributed_equals_single_process(splits):
    scores, labels, mask, log_q = make_batch(width=sum(splits), seed=3)
    results = run_distributed(_distributed_body, len(splits), args=(scores, labels, mask, log_q, splits))
    full = scores.clone().requires_grad_(True)
    loss, valid = sampled_softmax_loss(full, labels, log_q, mask, return_valid=True)
    loss.backward()
    for rank_loss, rank_valid, _ in results:
        torch.testing.assert_close(rank_loss, loss.detach(), rtol=1e-12, atol=1e-14)
        assert torch.equal(rank_valid, valid)
    torch.testing.assert_close(torch.cat([r[2] for r in results], dim=1), full.grad, rtol=1e-10, atol=1e-13)
    assert math.isfinite(float(loss.detach()))
