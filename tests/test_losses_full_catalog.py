"""Single-process full-catalog losses against brute-force references, closed forms and finite differences."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from bigrank.losses import (
    ChunkedScores,
    RankmaxLoss,
    SoftmaxLoss,
    SparsemaxLoss,
    rankmax,
    rankmax_loss,
    softmax_loss,
    sparsemax,
    sparsemax_loss,
)
from bigrank.losses.rankmax import positives_to_k
from bigrank.losses.scores import score_matrix
from tests.reference_losses import rankmax_reference, sparsemax_loss_row, sparsemax_row


def make_scores(batch=8, n=40, scale=1.0, seed=0, dtype=torch.float64):
    generator = torch.Generator().manual_seed(seed)
    scores = torch.randn(batch, n, generator=generator, dtype=dtype) * scale
    target = torch.randint(0, n, (batch,), generator=generator)
    return scores, target


def scores_with_all_regimes(k: int, n: int = 30, seed: int = 0):
    """Rows covering: positive far below the top k, positive inside the top k, positive among the clipped top
    t (loss 0), widely spread scores (t > 0), and exact ties at the k-th value."""
    generator = torch.Generator().manual_seed(seed)
    rows, targets = [], []
    for scale in (0.3, 1.0, 4.0, 12.0):
        for placement in ("low", "top", "first"):
            z = torch.randn(n, generator=generator, dtype=torch.float64) * scale
            order = torch.argsort(z, descending=True)
            y = {"low": order[-1], "top": order[min(k, n) - 1], "first": order[0]}[placement]
            rows.append(z)
            targets.append(int(y))
    tied = torch.randn(n, generator=generator, dtype=torch.float64)
    order = torch.argsort(tied, descending=True)
    tied[order[k - 1 : k + 2]] = tied[order[k - 1]].item()  # three scores equal at the k-th place
    rows += [tied, tied.clone()]
    targets += [int(order[-1]), int(order[0])]
    return torch.stack(rows), torch.tensor(targets)


@pytest.mark.parametrize("k", [1, 2, 5])
def test_rankmax_matches_bisection_reference(k):
    scores, target = scores_with_all_regimes(k)
    expected_projection, expected_loss = rankmax_reference(scores, target, k)
    projection = rankmax(scores, target, k=k)
    torch.testing.assert_close(projection, expected_projection, atol=1e-9, rtol=0)
    torch.testing.assert_close(rankmax_loss(scores, target, k=k, reduction="none"), expected_loss, atol=1e-9, rtol=0)


@pytest.mark.parametrize("k", [1, 3, 7])
def test_rankmax_projection_properties(k):
    scores, target = make_scores(batch=16, n=60, scale=3.0, seed=k)
    p = rankmax(scores, target, k=k)
    torch.testing.assert_close(p.sum(dim=1), torch.full((16,), float(k), dtype=torch.float64))
    assert p.min() >= 0 and p.max() <= 1
    assert (p.gather(1, target.unsqueeze(1)) > 0).all(), "the positive must be in the support"
    # Monotone: a higher score never gets a smaller weight (Proposition 1b).
    order = torch.argsort(scores, dim=1, descending=True)
    sorted_p = p.gather(1, order)
    assert (sorted_p[:, :-1] >= sorted_p[:, 1:] - 1e-12).all()


def test_rankmax_k1_is_eq15_and_gradient_is_eq16():
    scores, target = make_scores(batch=10, n=50, scale=0.7)
    scores.requires_grad_(True)
    positive = scores.gather(1, target.unsqueeze(1))
    hinge = (scores - positive + 1).clamp_min(0)
    torch.testing.assert_close(rankmax_loss(scores, target, k=1, reduction="none"), torch.log(hinge.sum(dim=1)))
    torch.testing.assert_close(rankmax(scores, target, k=1), hinge / hinge.sum(dim=1, keepdim=True))

    rankmax_loss(scores, target, k=1, reduction="sum").backward()
    with torch.no_grad():
        p_y = 1.0 / hinge.sum(dim=1)  # Rankmax(z, y)_y = alpha_y since mu = z_y - 1
        support = (scores > positive - 1).sum(dim=1)
        expected = torch.where(scores > positive - 1, p_y.unsqueeze(1), 0.0)
        # Eq. 16 with s counting the support without y: the gradient sums to zero across the row.
        expected.scatter_(1, target.unsqueeze(1), (-(support - 1) * p_y).unsqueeze(1))
    torch.testing.assert_close(scores.grad, expected)
    torch.testing.assert_close(scores.grad.sum(dim=1), torch.zeros(10, dtype=torch.float64))


@pytest.mark.parametrize("k", [1, 3])
def test_rankmax_loss_gradcheck(k):
    scores, target = scores_with_all_regimes(k, n=12, seed=3)
    # Finite differences need a margin from the kinks; drop exactly tied rows (checked separately below).
    scores, target = scores[:-2].clone().requires_grad_(True), target[:-2]
    assert torch.autograd.gradcheck(lambda s: rankmax_loss(s, target, k=k, reduction="sum"), (scores,))
    assert torch.autograd.gradcheck(lambda s: rankmax(s, target, k=k), (scores,))


def test_rankmax_gradient_at_ties_is_a_symmetric_subgradient():
    k = 3
    scores, target = scores_with_all_regimes(k, n=12, seed=3)
    scores = scores[-1:].clone().requires_grad_(True)  # positive first, three-way tie at the k-th value
    target = target[-1:]
    rankmax_loss(scores, target, k=k).backward()
    tied = scores.detach()[0] == scores.detach()[0].sort(descending=True).values[k - 1]
    assert tied.sum() == 3
    grads = scores.grad[0][tied]
    torch.testing.assert_close(grads, grads[:1].expand(3))  # tied scores share the gradient equally
    torch.testing.assert_close(scores.grad.sum(), torch.tensor(0.0, dtype=torch.float64))


def _rows_with_their_own_k():
    """Every regime of ``scores_with_all_regimes`` for k = 1, 2 and 5 in one batch, with each row's own k."""
    parts = [(*scores_with_all_regimes(k, seed=k), k) for k in (1, 2, 5)]
    scores = torch.cat([p[0] for p in parts])
    target = torch.cat([p[1] for p in parts])
    row_k = torch.cat([torch.full((p[0].shape[0],), p[2], dtype=torch.int64) for p in parts])
    return scores, target, row_k


@pytest.mark.parametrize("chunk_size", [None, 7])
def test_rankmax_with_a_k_per_row_is_each_rows_own_rankmax(chunk_size):
    """A per-row k (the label-set size of Section 3) gives each row the loss and gradient of its own k: against
    the bisection reference row by row, and against the scalar-k loss on each row (dense and chunked)."""
    scores, target, row_k = _rows_with_their_own_k()
    expected = torch.cat(
        [rankmax_reference(scores[b : b + 1], target[b : b + 1], int(row_k[b]))[1] for b in range(len(row_k))]
    )
    torch.testing.assert_close(rankmax_loss(scores, target, k=row_k, reduction="none"), expected, atol=1e-9, rtol=0)
    generator = torch.Generator().manual_seed(1)
    users = torch.randn(len(row_k), 6, generator=generator, dtype=torch.float64, requires_grad=True)
    items = torch.randn(30, 6, generator=generator, dtype=torch.float64, requires_grad=True)
    source = ChunkedScores(users, items, chunk_size) if chunk_size else users @ items.T
    rankmax_loss(source, target, k=row_k, margin=0.7, reduction="sum").backward()
    got = users.grad.clone(), items.grad.clone()
    users.grad, items.grad = None, None
    dense = users @ items.T
    rows = range(len(row_k))
    sum(rankmax_loss(dense[b : b + 1], target[b : b + 1], k=int(row_k[b]), margin=0.7) for b in rows).backward()
    torch.testing.assert_close(got[0], users.grad, atol=1e-12, rtol=0)
    torch.testing.assert_close(got[1], items.grad, atol=1e-12, rtol=0)


def test_rankmax_per_row_k_gradcheck():
    scores, target, row_k = _rows_with_their_own_k()
    scores = scores[::2] + 1e-3 * torch.arange(scores[::2].numel(), dtype=torch.float64).reshape(-1, 30)  # no ties
    scores.requires_grad_(True)
    assert torch.autograd.gradcheck(lambda s: rankmax_loss(s, target[::2], k=row_k[::2], margin=0.8), (scores,))


def test_rankmax_k_fraction_sets_each_rows_k_from_its_positives():
    assert positives_to_k(torch.tensor([1, 3, 10, 250]), 1, 0.1).tolist() == [1, 1, 1, 25]
    assert positives_to_k(torch.tensor([1, 3, 10, 250]), 2, 1.0).tolist() == [2, 3, 10, 250]
    scores, target = make_scores(batch=5, n=40)
    positives = torch.tensor([1, 4, 12, 40, 7])
    loss = RankmaxLoss(k=2, margin=0.5, k_fraction=0.5, reduction="none")(scores, target, positives=positives)
    expected = rankmax_loss(scores, target, k=torch.tensor([2, 2, 6, 20, 4]), margin=0.5, reduction="none")
    torch.testing.assert_close(loss, expected, atol=0, rtol=0)
    assert not torch.equal(loss, rankmax_loss(scores, target, k=2, margin=0.5, reduction="none"))
    with pytest.raises(ValueError, match="needs positives"):
        RankmaxLoss(k_fraction=0.5)(scores, target)
    with pytest.raises(ValueError, match=r"k_fraction must be a number in \[0, 1\]"):
        RankmaxLoss(k_fraction=1.5)
    assert "k_fraction=0.5" in repr(RankmaxLoss(k_fraction=0.5))


def test_softmax_loss_matches_cross_entropy():
    scores, target = make_scores(batch=9, n=33)
    scores.requires_grad_(True)
    ours = softmax_loss(scores, target, reduction="none")
    reference = F.cross_entropy(scores, target, reduction="none")
    torch.testing.assert_close(ours, reference)
    (grad,) = torch.autograd.grad(ours.sum(), scores)
    (expected,) = torch.autograd.grad(reference.sum(), scores)
    torch.testing.assert_close(grad, expected)
    assert torch.autograd.gradcheck(lambda s: softmax_loss(s, target), (scores,))


@pytest.mark.parametrize("support_guess", [1, 4, 64])
def test_sparsemax_matches_sorting_reference(support_guess):
    scores, target = make_scores(batch=12, n=40, scale=0.2, seed=5)  # small spread: wide supports, retries
    expected = torch.tensor([sparsemax_row(row) for row in scores.tolist()], dtype=torch.float64)
    torch.testing.assert_close(sparsemax(scores, support_guess=support_guess), expected, atol=1e-12, rtol=0)
    expected_loss = torch.tensor(
        [sparsemax_loss_row(row, int(y)) for row, y in zip(scores.tolist(), target, strict=True)], dtype=torch.float64
    )
    ours = sparsemax_loss(scores, target, reduction="none", support_guess=support_guess)
    torch.testing.assert_close(ours, expected_loss, atol=1e-12, rtol=0)


def test_sparsemax_loss_gradient_is_sparsemax_minus_onehot():
    scores, target = make_scores(batch=6, n=25, scale=2.0, seed=7)
    scores.requires_grad_(True)
    sparsemax_loss(scores, target, reduction="sum", support_guess=2).backward()
    expected = sparsemax(scores.detach()) - F.one_hot(target, 25).double()
    torch.testing.assert_close(scores.grad, expected)
    assert torch.autograd.gradcheck(lambda s: sparsemax_loss(s, target, support_guess=2), (scores,))
    assert torch.autograd.gradcheck(lambda s: sparsemax(s, support_guess=2), (scores,))


@pytest.mark.parametrize("temperature", [0.1, 0.5, 3.0])
def test_sparsemax_temperature_is_the_sorting_reference_of_scaled_scores(temperature):
    # Small scores (wide supports at T = 1), so T < 1 changes the support: the loss is exactly that of z / T.
    generator = torch.Generator().manual_seed(13)
    users = torch.randn(8, 5, generator=generator, dtype=torch.float64).mul_(0.3).requires_grad_()
    items = torch.randn(45, 5, generator=generator, dtype=torch.float64).requires_grad_()
    target = torch.randint(0, 45, (8,), generator=generator)
    scaled = ((users @ items.T) / temperature).tolist()
    expected = torch.tensor(
        [sparsemax_loss_row(row, int(y)) for row, y in zip(scaled, target, strict=True)], dtype=torch.float64
    )
    for scores in (users @ items.T, ChunkedScores(users, items, chunk_size=10)):
        ours = sparsemax_loss(scores, target, reduction="none", support_guess=2, temperature=temperature)
        torch.testing.assert_close(ours, expected, atol=1e-12, rtol=0)
    scores = (users @ items.T).detach().requires_grad_()
    SparsemaxLoss(reduction="sum", temperature=temperature)(scores, target).backward()
    gradient = (sparsemax(scores.detach() / temperature) - F.one_hot(target, 45).double()) / temperature
    torch.testing.assert_close(scores.grad, gradient)


@pytest.mark.parametrize(
    "loss_fn", [lambda s, y: rankmax_loss(s, y, k=4), softmax_loss, lambda s, y: sparsemax_loss(s, y, support_guess=8)]
)
def test_chunked_scores_equal_dense(loss_fn):
    generator = torch.Generator().manual_seed(11)
    users = torch.randn(7, 5, generator=generator, dtype=torch.float64, requires_grad=True)
    items = torch.randn(53, 5, generator=generator, dtype=torch.float64, requires_grad=True)
    target = torch.randint(0, 53, (7,), generator=generator)
    dense = loss_fn(users @ items.T, target)
    dense_grads = torch.autograd.grad(dense, (users, items))
    chunked = loss_fn(ChunkedScores(users, items, chunk_size=10), target)
    chunked_grads = torch.autograd.grad(chunked, (users, items))
    torch.testing.assert_close(chunked, dense, atol=1e-12, rtol=0)
    for ours, expected in zip(chunked_grads, dense_grads, strict=True):
        torch.testing.assert_close(ours, expected, atol=1e-12, rtol=0)


def test_reductions_and_modules():
    scores, target = make_scores()
    per_row = rankmax_loss(scores, target, k=2, reduction="none")
    torch.testing.assert_close(rankmax_loss(scores, target, k=2, reduction="sum"), per_row.sum())
    torch.testing.assert_close(rankmax_loss(scores, target, k=2), per_row.mean())
    torch.testing.assert_close(RankmaxLoss(k=2)(scores, target), per_row.mean())
    torch.testing.assert_close(SoftmaxLoss()(scores, target), softmax_loss(scores, target))
    torch.testing.assert_close(SparsemaxLoss(reduction="sum")(scores, target), sparsemax_loss(scores, target, "sum"))
    assert "k=2" in repr(RankmaxLoss(k=2))


def test_full_catalog_row_of_849000_items():
    n = 849_000
    scores, target = make_scores(batch=2, n=n, scale=0.5, seed=1, dtype=torch.float32)
    scores.requires_grad_(True)
    loss = rankmax_loss(scores, target, k=10)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(scores.grad).all()
    torch.testing.assert_close(scores.grad.sum(dim=1), torch.zeros(2), atol=1e-4, rtol=0)
    positive = scores.detach().gather(1, target.unsqueeze(1))
    eq15 = torch.log((scores.detach().double() - positive.double() + 1).clamp_min(0).sum(dim=1))
    torch.testing.assert_close(
        rankmax_loss(scores.detach(), target, k=1, reduction="none").double(), eq15, rtol=1e-5, atol=1e-5
    )
    torch.testing.assert_close(softmax_loss(scores.detach(), target), F.cross_entropy(scores.detach(), target))
    p = rankmax(scores.detach(), target, k=10)
    torch.testing.assert_close(p.sum(dim=1), torch.full((2,), 10.0), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda s, y: rankmax_loss(s, y, k=0), "k must be an integer >= 1"),
        (lambda s, y: rankmax_loss(s, y, k=41), "k must be <= the number of items"),
        (lambda s, y: rankmax(s, y, k=41), "k must be <= the number of items"),
        (lambda s, y: rankmax_loss(s, y, margin=0.0), "margin must be a finite number > 0"),
        (lambda s, y: rankmax_loss(s, y, margin=float("nan")), "margin"),
        (lambda s, y: rankmax_loss(s, y + 40), "outside \\[0, 40\\)"),
        (lambda s, y: softmax_loss(s, -y - 1), "outside \\[0, 40\\)"),
        (lambda s, y: rankmax(s, y + 40), "outside \\[0, 40\\)"),
        (lambda s, y: rankmax_loss(s, y[:3]), "target must have shape"),
        (lambda s, y: sparsemax_loss(s[0], y), "shape \\[B, n\\]"),
        (lambda s, y: sparsemax_loss(s, y, temperature=0.0), "temperature must be a finite number > 0"),
        (lambda s, y: SparsemaxLoss(temperature=float("inf"))(s, y), "temperature must be a finite number > 0"),
        (lambda s, y: rankmax_loss(s, y.double()), "integer item ids"),
        (lambda s, y: rankmax_loss(s, y, reduction="avg"), "reduction must be one of"),
        (lambda s, y: rankmax_loss(s.long(), y), "floating point"),
        (lambda s, y: rankmax_loss(s, y, k=torch.ones(3, dtype=torch.int64)), "per-row k must be an integer tensor"),
        (lambda s, y: rankmax_loss(s, y, k=torch.ones(8)), "per-row k must be an integer tensor"),
        (lambda s, y: rankmax_loss(s, y, k=torch.zeros(8, dtype=torch.int64)), "per-row k must be >= 1"),
        (lambda s, y: rankmax_loss(s, y, k=torch.full((8,), 41)), "k must be <= the number of items n = 40"),
    ],
)
def test_bad_input_raises_value_error(call, message):
    scores, target = make_scores(n=40)
    with pytest.raises(ValueError, match=message):
        call(scores, target)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("loss_fn", [rankmax_loss, softmax_loss, sparsemax_loss, lambda s, y: rankmax(s, y)])
def test_non_finite_scores_are_rejected(loss_fn, bad):
    scores, target = make_scores()
    scores[3, 7] = bad
    with pytest.raises(ValueError, match=r"NaN or infinite values .*3"):
        loss_fn(scores, target)


def test_loss_is_zero_when_positive_is_clipped_at_one():
    # Positive far above everything: Rankmax gives it weight 1, so -log min(1, .) = 0 and no gradient.
    scores = torch.tensor([[10.0, 0.0, 0.1, -0.2]], dtype=torch.float64, requires_grad=True)
    loss = rankmax_loss(scores, torch.tensor([0]), k=2)
    loss.backward()
    assert loss.item() == 0.0
    assert (scores.grad == 0).all()
    assert math.isclose(rankmax(scores.detach(), torch.tensor([0]), k=2)[0, 0].item(), 1.0)


def test_rankmax_when_the_support_is_exactly_the_top_k():
    # A gap of more than the margin below z_[k] with the positive inside the top k: the projection is the
    # indicator of the top k (any alpha >= 1 / eta works), and the loss is 0.
    scores = torch.tensor([[3.0, 2.0, 1.5, 0.0, -1.0]], dtype=torch.float64)
    target = torch.tensor([0])
    expected_projection, expected_loss = rankmax_reference(scores, target, 3)
    torch.testing.assert_close(rankmax(scores, target, k=3), expected_projection)
    torch.testing.assert_close(rankmax_loss(scores, target, k=3, reduction="none"), expected_loss)
    torch.testing.assert_close(expected_projection, torch.tensor([[1.0, 1.0, 1.0, 0.0, 0.0]], dtype=torch.float64))


def test_score_matrix_auto_chunks_hold_about_2_to_the_22_scores_and_equal_dense():
    generator = torch.Generator().manual_seed(12)
    users = torch.randn(3_000, 4, generator=generator, dtype=torch.float64)
    items = torch.randn(5_000, 4, generator=generator, dtype=torch.float64)
    target = torch.randint(0, 5_000, (3_000,), generator=generator)
    auto = score_matrix(users, items, "auto")
    assert isinstance(auto, ChunkedScores) and auto.chunk_size == 1_399  # ceil(2^22 / 3000)
    assert isinstance(score_matrix(users, items, None), torch.Tensor)
    torch.testing.assert_close(rankmax_loss(auto, target, k=2), rankmax_loss(users @ items.T, target, k=2))


def test_the_package_names_rankmax_and_sparsemax_stay_functions_after_their_submodules_load():
    import importlib

    import bigrank.losses as losses

    for name in ("rankmax", "sparsemax"):
        importlib.import_module(f"bigrank.losses.{name}")  # the submodule of the same name
        assert callable(getattr(losses, name)) and not isinstance(getattr(losses, name), type(losses)), name


def test_a_temperature_keeps_the_chunked_scores_compute_dtype():
    """softmax/sparsemax ``temperature`` on bf16 chunked scores (train.precision bf16) still scores in bf16."""
    from bigrank.losses.scores import divide_scores

    users, items = torch.randn(4, 8), torch.randn(30, 8)
    scaled = divide_scores(score_matrix(users, items, 8, dtype=torch.bfloat16), 0.5)
    assert scaled.dtype == torch.bfloat16
    assert all(block.dtype == torch.bfloat16 for _, block in scaled.blocks())
    torch.testing.assert_close(next(scaled.blocks())[1].float(), (users @ items[:8].T) / 0.5, rtol=2e-2, atol=5e-2)


@pytest.mark.parametrize("scale", [0.01, 1.0, 6.0])
@pytest.mark.parametrize("margin", [1.0, 0.3])
def test_shared_rankmax_equals_rankmax_over_each_positive_row(scale, margin):
    """rankmax_shared_loss (one sort per user) against rankmax_loss over the expanded (user, positive) rows: the
    same loss and the same gradient, for sums and means, with users of one, several and no positives."""
    from bigrank.losses import rankmax_shared_loss

    generator = torch.Generator().manual_seed(7)
    scores = (torch.randn(6, 300, generator=generator, dtype=torch.float64) * scale).requires_grad_()
    positives = torch.rand(6, 300, generator=generator) < 0.05
    positives[0] = False
    positives[0, 3] = True  # one positive
    positives[1] = False  # none: adds nothing
    for reduction in ("sum", "mean"):
        shared = rankmax_shared_loss(scores, positives, margin, reduction)
        (got,) = torch.autograd.grad(shared, scores)
        users, items = positives.nonzero(as_tuple=True)
        expanded = rankmax_loss(scores[users], items, k=1, margin=margin, reduction=reduction)
        (want,) = torch.autograd.grad(expanded, scores)
        torch.testing.assert_close(shared, expanded, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)
    with pytest.raises(ValueError, match="positives must be bool"):
        rankmax_shared_loss(scores, positives.float())


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_shared_softmax_equals_softmax_over_each_positive_row(temperature):
    """softmax_shared_loss against softmax_loss over the expanded (user, positive) rows: loss and gradient."""
    from bigrank.losses import softmax_shared_loss

    generator = torch.Generator().manual_seed(8)
    scores = (torch.randn(5, 200, generator=generator, dtype=torch.float64) * 3).requires_grad_()
    positives = torch.rand(5, 200, generator=generator) < 0.05
    positives[1] = False  # no positive: adds nothing
    positives[2] = False
    positives[2, 7] = True
    for reduction in ("sum", "mean"):
        shared = softmax_shared_loss(scores, positives, reduction, temperature)
        (got,) = torch.autograd.grad(shared, scores)
        users, items = positives.nonzero(as_tuple=True)
        expanded = softmax_loss(scores[users], items, reduction, temperature=temperature)
        (want,) = torch.autograd.grad(expanded, scores)
        torch.testing.assert_close(shared, expanded, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)
    with pytest.raises(ValueError, match="NaN"):
        softmax_shared_loss(scores.detach().index_fill(1, torch.tensor([3]), float("nan")), positives)
