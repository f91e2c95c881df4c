"""SoftRank NDCG: rank distributions against explicit loops and Monte-Carlo sampling, the custom backward
against autograd through the plain recursion, the loss against a loop reference, and item-parallel runs."""

from __future__ import annotations

import math

import pytest
import torch

from bigrank.losses.softndcg import SoftNDCGLoss, rank_distributions, softrank_ndcg_loss
from tests.distributed_utils import run_distributed


def phi(x):
    return 0.5 * (1.0 + torch.erf(x / math.sqrt(2.0)))


def loop_rank_distributions(scores, valid, sigma):
    """Taylor et al. eq. 5 with explicit loops (autograd through every step)."""
    batch, size = scores.shape
    rows = []
    for b in range(batch):
        dists = []
        for j in range(size):
            dist = [scores.new_ones(())] + [scores.new_zeros(()) for _ in range(size - 1)]
            if valid[b, j]:
                for i in range(size):
                    if i == j or not valid[b, i]:
                        continue
                    pi = phi((scores[b, i] - scores[b, j]) / (math.sqrt(2.0) * sigma))
                    dist = [dist[r] * (1 - pi) + (dist[r - 1] * pi if r else 0.0) for r in range(size)]
            dists.append(torch.stack(dist))
        rows.append(torch.stack(dists))
    return torch.stack(rows)


def loop_soft_ndcg(scores, gains, valid, sigma, k=None):
    p = loop_rank_distributions(scores, valid, sigma)
    losses = []
    for b in range(scores.shape[0]):
        g = [float(gains[b, j]) if valid[b, j] else 0.0 for j in range(scores.shape[1])]
        discount = [1 / math.log2(2 + r) if k is None or r < k else 0.0 for r in range(scores.shape[1])]
        expected = sum(g[j] * p[b, j, r] * discount[r] for j in range(len(g)) for r in range(len(g)))
        ideal = sum(gain * d for gain, d in zip(sorted(g, reverse=True), discount, strict=True))
        losses.append(1 - expected / ideal)
    return torch.stack(losses)


def test_rank_distributions_match_loop_recursion_and_rows_sum_to_one():
    gen = torch.Generator().manual_seed(0)
    scores = torch.randn(3, 7, generator=gen, dtype=torch.float64)
    valid = torch.rand(3, 7, generator=gen) < 0.8
    p = rank_distributions(scores, valid, sigma=0.4)
    torch.testing.assert_close(p, loop_rank_distributions(scores, valid, 0.4), rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(p.sum(dim=2), torch.ones(3, 7, dtype=torch.float64))
    # A valid candidate can only land on ranks 0 .. n_valid - 1.
    for b in range(3):
        assert float(p[b][valid[b]][:, int(valid[b].sum()) :].abs().sum()) == 0


def _ranks_by_sampling(scores, noise):
    noisy = scores + noise  # [n, N]
    return (noisy.unsqueeze(1) > noisy.unsqueeze(2)).sum(dim=2)  # rank of j = how many score above it


def _histogram(ranks, size):
    return torch.stack([torch.bincount(ranks[:, j], minlength=size).double() / ranks.shape[0] for j in range(size)])


def test_rank_distributions_match_monte_carlo_of_gaussian_scores():
    gen = torch.Generator().manual_seed(1)
    size, draws = 8, 100_000
    scores = torch.randn(size, generator=gen, dtype=torch.float64)
    # Expected ranks are exact under the pairwise-contest model (linearity): E[rank_j] = sum_i pi_ij.
    p = rank_distributions(scores.unsqueeze(0), sigma=0.5)[0]
    ranks = _ranks_by_sampling(scores, 0.5 * torch.randn(draws, size, generator=gen, dtype=torch.float64))
    mean_rank = (p * torch.arange(size, dtype=torch.float64)).sum(dim=1)
    stderr = ranks.double().std(dim=0) / math.sqrt(draws)
    assert torch.all((mean_rank - ranks.double().mean(dim=0)).abs() < 5 * stderr + 1e-9)
    # Whole distributions: the contests of one candidate share its noise, which the rank-binomial ignores
    # (Taylor et al. call it an approximation); with noise small against score gaps it is close.
    p = rank_distributions(scores.unsqueeze(0), sigma=0.1)[0]
    sampled = _histogram(
        _ranks_by_sampling(scores, 0.1 * torch.randn(draws, size, generator=gen, dtype=torch.float64)), size
    )
    total_variation = 0.5 * (p - sampled).abs().sum(dim=1)
    assert float(total_variation.max()) < 0.05
    hard = torch.zeros_like(p)
    hard[torch.arange(size), (scores.unsqueeze(0) > scores.unsqueeze(1)).sum(dim=1)] = 1.0
    assert float((0.5 * (hard - sampled).abs().sum(dim=1)).max()) > 0.1  # the check can tell a worse answer


def test_rank_distributions_are_exact_for_independent_contests():
    """The rank-binomial is exact for the model it assumes: every pair plays an independent contest."""
    gen = torch.Generator().manual_seed(2)
    size, draws = 6, 200_000
    scores = torch.randn(size, generator=gen, dtype=torch.float64)
    p = rank_distributions(scores.unsqueeze(0), sigma=1.0)[0]
    pi = phi((scores.unsqueeze(1) - scores.unsqueeze(0)) / math.sqrt(2.0))  # pi[i, j] = P(i beats j)
    wins = torch.rand(draws, size, size, generator=gen, dtype=torch.float64) < pi
    wins &= ~torch.eye(size, dtype=torch.bool)
    sampled = _histogram(wins.sum(dim=1), size)  # rank of j = number of contests j lost
    assert float((p - sampled).abs().max()) < 5 * math.sqrt(0.25 / draws) + 1e-3


def test_custom_backward_matches_autograd_through_the_recursion_even_when_saturated():
    gen = torch.Generator().manual_seed(3)
    valid = torch.ones(2, 6, dtype=torch.bool)
    valid[1, 4] = False
    weights = torch.randn(2, 6, 6, generator=gen, dtype=torch.float64)
    for spread in (0.5, 3.0, 40.0):  # from soft contests to pi within 1e-300 of 0 or 1
        base = spread * torch.randn(2, 6, generator=gen, dtype=torch.float64)
        ours = base.clone().requires_grad_(True)
        theirs = base.clone().requires_grad_(True)
        (rank_distributions(ours, valid, 0.7) * weights).sum().backward()
        (loop_rank_distributions(theirs, valid, 0.7) * weights).sum().backward()
        torch.testing.assert_close(ours.grad, theirs.grad, rtol=1e-8, atol=1e-12)
    inputs = (torch.randn(2, 5, generator=gen, dtype=torch.float64, requires_grad=True),)
    assert torch.autograd.gradcheck(lambda s: (rank_distributions(s, None, 0.3) * weights[:, :5, :5]).sum(), inputs)


@pytest.mark.parametrize("k", [None, 3])
def test_soft_ndcg_matches_loop_reference_value_and_gradient(k):
    gen = torch.Generator().manual_seed(4)
    scores = torch.randn(4, 7, generator=gen, dtype=torch.float64)
    gains = torch.randint(0, 4, (4, 7), generator=gen).double()
    gains[:, 0] = 2.0
    mask = torch.rand(4, 7, generator=gen) < 0.9
    mask[:, 0] = True
    ours = scores.clone().requires_grad_(True)
    theirs = scores.clone().requires_grad_(True)
    loss = softrank_ndcg_loss(ours, gains, mask, "none", sigma=0.5, k=k, num_candidates=None)
    ref = loop_soft_ndcg(theirs, gains, mask, 0.5, k)
    torch.testing.assert_close(loss, ref, rtol=1e-10, atol=1e-12)
    loss.sum().backward()
    ref.sum().backward()
    torch.testing.assert_close(ours.grad, theirs.grad, rtol=1e-8, atol=1e-12)
    assert torch.all(ours.grad[~mask] == 0)


def test_candidate_list_keeps_positives_and_top_negatives():
    gen = torch.Generator().manual_seed(5)
    scores = torch.randn(3, 40, generator=gen, dtype=torch.float64)
    gains = torch.zeros(3, 40, dtype=torch.float64)
    gains[0, [3, 17]] = 1.0
    gains[1, [0, 5, 9, 30]] = torch.tensor([3.0, 1.0, 1.0, 7.0], dtype=torch.float64)
    gains[2, 39] = 1.0
    x = scores.clone().requires_grad_(True)
    loss = softrank_ndcg_loss(x, gains, None, "none", sigma=0.3, num_candidates=6)
    loss.sum().backward()
    for b in range(3):
        pos = gains[b] > 0
        negatives = scores[b].masked_fill(pos, float("-inf")).topk(6 - int(pos.sum())).indices
        keep = torch.cat([pos.nonzero().squeeze(1), negatives])
        ref = loop_soft_ndcg(
            scores[b, keep].unsqueeze(0), gains[b, keep].unsqueeze(0), torch.ones(1, 6, dtype=torch.bool), 0.3
        )
        torch.testing.assert_close(loss[b], ref[0], rtol=1e-10, atol=1e-12)
        outside = torch.ones(40, dtype=torch.bool)
        outside[keep] = False
        assert torch.all(x.grad[b, outside] == 0) and torch.all(x.grad[b, keep] != 0)


def test_small_sigma_approaches_hard_ndcg_and_perfect_order_gives_zero():
    gen = torch.Generator().manual_seed(6)
    scores = torch.randn(2, 12, generator=gen, dtype=torch.float64)
    gains = torch.randint(0, 3, (2, 12), generator=gen).double()
    gains[:, 0] = 1.0
    gains[:, 1] = 0.0
    soft = softrank_ndcg_loss(scores, gains, None, "none", sigma=1e-4, num_candidates=None)
    for b in range(2):
        order = scores[b].argsort(descending=True)
        discount = 1 / torch.log2(torch.arange(12, dtype=torch.float64) + 2)
        hard = (gains[b, order] * discount).sum() / (gains[b].sort(descending=True).values * discount).sum()
        assert abs(float(soft[b]) - (1 - float(hard))) < 1e-6
    perfect = gains * 100.0 + scores.argsort(dim=1).double()  # ordered by gain, every gap >= 1 >> sigma
    assert float(softrank_ndcg_loss(perfect, gains, sigma=0.05, num_candidates=None)) < 1e-6


def test_degenerate_rows_bad_input_and_module():
    scores = torch.randn(3, 10, dtype=torch.float64)
    gains = torch.zeros(3, 10, dtype=torch.float64)
    gains[1] = 1.0  # every candidate positive
    gains[2, 4] = 2.0
    x = scores.clone().requires_grad_(True)
    module = SoftNDCGLoss(sigma=0.2, num_candidates=5)
    loss = module(x, gains)
    loss.backward()
    per_row = softrank_ndcg_loss(scores, gains, None, "none", sigma=0.2, num_candidates=5)
    torch.testing.assert_close(loss.detach(), per_row[2])
    assert module.last_excluded_rows == 2 and torch.isfinite(x.grad).all()
    module.temperature = 0.05  # the warm-up wrapper's knob is sigma
    assert module.sigma == 0.05
    assert SoftNDCGLoss()(scores, gains > 0).isfinite()  # bool gains are binary relevance
    with pytest.raises(ValueError, match="gains must be finite and >= 0"):
        softrank_ndcg_loss(scores, -gains)
    with pytest.raises(ValueError, match="gains must be a tensor with the shape"):
        softrank_ndcg_loss(scores, gains[:, :3])
    with pytest.raises(ValueError, match="k must be"):
        softrank_ndcg_loss(scores, gains, k=0)
    with pytest.raises(ValueError, match="sigma"):
        softrank_ndcg_loss(scores, gains, sigma=-1.0)
    with pytest.raises(ValueError, match="num_candidates"):
        softrank_ndcg_loss(torch.zeros(1, 5000), torch.ones(1, 5000), num_candidates=None)
    with pytest.raises(ValueError, match="NaN or infinite"):
        softrank_ndcg_loss(scores.masked_fill(gains > 0, float("inf")), gains)


# ---------------------------------------------------------------------------------------------- distributed
def _distributed_body(rank, world_size, group, scores, gains, mask, splits):
    start = sum(splits[:rank])
    stop = start + splits[rank]
    out = {}
    for num_candidates in (None, 6):
        local = scores[:, start:stop].clone().requires_grad_(True)
        loss, valid = softrank_ndcg_loss(
            local, gains[:, start:stop], mask[:, start:stop], "mean", group=group, sigma=0.4, k=4,
            num_candidates=num_candidates, return_valid=True,
        )  # fmt: skip
        loss.backward()
        out[num_candidates] = (loss.detach(), valid, local.grad)
    return out


@pytest.mark.parametrize("splits", [[8, 15], [5, 0, 14]])
def test_distributed_equals_single_process(splits):
    gen = torch.Generator().manual_seed(7)
    width = sum(splits)
    scores = torch.randn(5, width, generator=gen, dtype=torch.float64)
    gains = torch.where(torch.rand(5, width, generator=gen) < 0.2, 1.0, 0.0).double()
    gains[0] = 0.0  # degenerate
    gains[1, 2] = 3.0
    mask = torch.rand(5, width, generator=gen) < 0.9
    results = run_distributed(_distributed_body, len(splits), args=(scores, gains, mask, splits))
    for num_candidates in (None, 6):
        full = scores.clone().requires_grad_(True)
        loss, valid = softrank_ndcg_loss(
            full, gains, mask, "mean", sigma=0.4, k=4, num_candidates=num_candidates, return_valid=True
        )
        loss.backward()
        for rank_loss, rank_valid, _ in (r[num_candidates] for r in results):
            torch.testing.assert_close(rank_loss, loss.detach(), rtol=1e-11, atol=1e-13)
            assert torch.equal(rank_valid, valid) and not valid[0]
        grads = torch.cat([r[num_candidates][2] for r in results], dim=1)
        torch.testing.assert_close(grads, full.grad, rtol=1e-9, atol=1e-12)


def test_distributions_of_chosen_candidates_equal_those_of_the_whole_list():
    """SoftNDCG computes only the positives' rank distributions ([B, P, N] from a [B, N, P] contest block):
    each equals the full list's row, values and gradients; padded slots are point masses at rank 0."""
    from bigrank.losses.softndcg import _rank_distributions_of

    gen = torch.Generator().manual_seed(9)
    scores = torch.randn(3, 6, generator=gen, dtype=torch.float64)
    valid = torch.rand(3, 6, generator=gen) < 0.85
    slots = torch.tensor([[4, 0, 2], [1, 5, 0], [3, 3, 3]])
    present = torch.tensor([[True, True, True], [True, True, False], [True, False, False]])
    ours, theirs = scores.clone().requires_grad_(), scores.clone().requires_grad_()
    chosen = _rank_distributions_of(ours, valid, slots, present, 0.4)
    full = rank_distributions(theirs, valid, 0.4)
    expected = full.gather(1, slots.unsqueeze(2).expand(-1, -1, 6))
    mask = (present & valid.gather(1, slots)).unsqueeze(2)
    point_mass = torch.zeros(6, dtype=torch.float64)
    point_mass[0] = 1.0
    torch.testing.assert_close(chosen, torch.where(mask, expected, point_mass), rtol=1e-12, atol=1e-14)
    weights = torch.rand(3, 3, 6, generator=gen, dtype=torch.float64) * mask
    (chosen * weights).sum().backward()
    (expected * weights).sum().backward()
    torch.testing.assert_close(ours.grad, theirs.grad, rtol=1e-9, atol=1e-12)
