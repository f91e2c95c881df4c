"""Smooth-AP, Recall@quantile and pAUC@budget against explicit-loop references, in the hard limit, and
item-parallel over real gloo process groups (2 and 3 ranks, uneven and empty shards)."""

from __future__ import annotations

import math

import pytest
import torch

import bigrank.losses.softrank as softrank
from bigrank.losses.softrank import (
    PAUCAtBudgetLoss,
    RecallAtQuantileLoss,
    SmoothAPLoss,
    pauc_at_budget_loss,
    recall_at_quantile_loss,
    smooth_ap_loss,
)
from tests.distributed_utils import run_distributed

LOSSES = {
    "smooth_ap": (smooth_ap_loss, dict(temperature=0.3)),
    "recall": (recall_at_quantile_loss, dict(quantile=0.2, temperature=0.3)),
    "pauc_iqr": (pauc_at_budget_loss, dict(alpha=0.0, beta=0.3, n_knots=4, temperature=0.5)),
    "pauc_band": (pauc_at_budget_loss, dict(alpha=0.1, beta=0.6, tau_scale="band", temperature=1.0)),
}


def make_batch(batch=6, width=23, seed=0, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    scores = torch.randn(batch, width, generator=gen, dtype=dtype)
    labels = torch.rand(batch, width, generator=gen) < 0.25
    mask = torch.rand(batch, width, generator=gen) < 0.85
    labels[0] = False  # degenerate: no positive
    labels[1] = True  # degenerate: every valid candidate positive
    labels[2, :] = False
    labels[2, 3] = mask[2, 3] = True  # exactly one positive
    return scores, labels, mask


# --------------------------------------------------------------------------------------- references (loops)
def sig(x):
    return 1.0 / (1.0 + torch.exp(-x))


def rows_of(scores, labels, mask):
    for b in range(scores.shape[0]):
        cand = [j for j in range(scores.shape[1]) if mask is None or bool(mask[b, j])]
        pos = [j for j in cand if bool(labels[b, j])]
        yield b, cand, pos


def reference_smooth_ap(scores, labels, mask, temperature):
    losses, valid = [], []
    for b, cand, pos in rows_of(scores, labels, mask):
        ok = 0 < len(pos) < len(cand)
        total = scores.new_zeros(())
        for k in pos if ok else []:
            rank_all = 1 + sum(sig((scores[b, j] - scores[b, k]) / temperature) for j in cand if j != k)
            rank_pos = 1 + sum(sig((scores[b, j] - scores[b, k]) / temperature) for j in pos if j != k)
            total = total + rank_pos / rank_all
        losses.append(1 - total / len(pos) if ok else scores.new_zeros(()))
        valid.append(ok)
    return torch.stack(losses), torch.tensor(valid)


def kth_largest(values, fraction):
    ordered = sorted(values, key=float, reverse=True)
    k = min(max(1, math.ceil(fraction * len(ordered) - 1e-9)), len(ordered))
    return ordered[k - 1]


def reference_recall(scores, labels, mask, quantile, temperature):
    losses, valid = [], []
    for b, cand, pos in rows_of(scores, labels, mask):
        ok = 0 < len(pos) < len(cand)
        if not ok:
            losses.append(scores.new_zeros(()))
            valid.append(False)
            continue
        theta = kth_largest([scores[b, j].detach() for j in cand], quantile)
        recall = sum(sig((scores[b, j] - theta) / temperature) for j in pos) / len(pos)
        losses.append(1 - recall)
        valid.append(True)
    return torch.stack(losses), torch.tensor(valid)


def reference_pauc(scores, labels, mask, alpha, beta, temperature, tau_scale="iqr", n_knots=2):
    losses, valid = [], []
    for b, cand, pos in rows_of(scores, labels, mask):
        neg = [j for j in cand if j not in pos]
        ok = 0 < len(pos) < len(cand)
        if ok:
            neg_scores = [scores[b, j].detach() for j in neg]
            knots = [alpha + i * (beta - alpha) / (n_knots - 1) for i in range(n_knots)]
            thresholds = [kth_largest(neg_scores, f) for f in knots]
            if tau_scale == "band":
                scale = thresholds[0] - thresholds[-1]
            else:
                quartiles = torch.quantile(torch.stack(neg_scores), torch.tensor([0.25, 0.75], dtype=scores.dtype))
                scale = quartiles[1] - quartiles[0]
            ok = bool(scale > 0)
        if not ok:
            losses.append(scores.new_zeros(()))
            valid.append(False)
            continue
        tau = temperature * scale
        tpr = [sum(sig((scores[b, j] - t) / tau) for j in pos) / len(pos) for t in thresholds]
        pauc = (0.5 * tpr[0] + sum(tpr[1:-1]) + 0.5 * tpr[-1]) / (n_knots - 1)
        losses.append(1 - pauc)
        valid.append(True)
    return torch.stack(losses), torch.tensor(valid)


def hard_average_precision(scores, labels):
    order = torch.argsort(scores, descending=True)
    hits, total = 0, 0.0
    for rank, j in enumerate(order.tolist(), start=1):
        if labels[j]:
            hits += 1
            total += hits / rank
    return total / max(hits, 1)


# ------------------------------------------------------------------------------------------------- tests
@pytest.mark.parametrize("use_mask", [False, True])
def test_smooth_ap_matches_loop_reference_value_and_gradient(use_mask):
    scores, labels, mask = make_batch()
    mask = mask if use_mask else None
    ours = scores.clone().requires_grad_(True)
    theirs = scores.clone().requires_grad_(True)
    loss, valid = smooth_ap_loss(ours, labels, mask, "none", temperature=0.3, return_valid=True)
    ref, ref_valid = reference_smooth_ap(theirs, labels, mask, 0.3)
    assert torch.equal(valid, ref_valid) and not valid[0] and not valid[1] and valid[2]
    torch.testing.assert_close(loss, ref, rtol=1e-10, atol=1e-12)
    weights = torch.arange(1.0, 7.0, dtype=torch.float64)
    (loss * weights).sum().backward()
    (ref * weights).sum().backward()
    torch.testing.assert_close(ours.grad, theirs.grad, rtol=1e-9, atol=1e-12)
    # Negatives get gradient too (they push the positives' ranks down), but masked columns never do.
    assert ours.grad[3:][~labels[3:]].abs().sum() > 0
    if use_mask:
        assert torch.all(ours.grad[~mask] == 0)


def test_smooth_ap_chunked_equals_unchunked(monkeypatch):
    scores, labels, mask = make_batch(batch=5, width=40, seed=3)
    full = scores.clone().requires_grad_(True)
    smooth_ap_loss(full, labels, mask, temperature=0.2).backward()
    monkeypatch.setattr(softrank, "PAIRWISE_BLOCK_ELEMENTS", 7)  # a few columns per chunk
    chunked = scores.clone().requires_grad_(True)
    loss = smooth_ap_loss(chunked, labels, mask, temperature=0.2)
    loss.backward()
    torch.testing.assert_close(chunked.grad, full.grad, rtol=1e-12, atol=1e-14)
    inputs = (scores[:, :9].clone().requires_grad_(True),)
    assert torch.autograd.gradcheck(lambda s: smooth_ap_loss(s, labels[:, :9], None, temperature=0.5), inputs)


def test_smooth_ap_tends_to_hard_ap_and_perfect_scores_give_zero():
    gen = torch.Generator().manual_seed(1)
    scores = torch.randn(4, 60, generator=gen, dtype=torch.float64)
    labels = torch.rand(4, 60, generator=gen) < 0.2
    hard = torch.tensor([hard_average_precision(scores[b], labels[b]) for b in range(4)])
    soft = smooth_ap_loss(scores, labels, reduction="none", temperature=1e-5)
    torch.testing.assert_close(1 - soft, hard.to(torch.float64), atol=1e-3, rtol=0)
    assert (soft - (1 - hard)).abs().max() < (
        smooth_ap_loss(scores, labels, reduction="none", temperature=0.5) - (1 - hard)
    ).abs().max()
    perfect = torch.where(labels, 5.0 + scores.abs(), -scores.abs()).to(torch.float64)
    assert float(smooth_ap_loss(perfect, labels, temperature=0.01)) < 1e-6
    assert float(smooth_ap_loss(-perfect, labels, temperature=0.01)) > 0.5


@pytest.mark.parametrize("use_mask", [False, True])
def test_recall_matches_loop_reference_and_gradient_reaches_positives_only(use_mask):
    scores, labels, mask = make_batch(width=37, seed=5)
    mask = mask if use_mask else None
    ours = scores.clone().requires_grad_(True)
    theirs = scores.clone().requires_grad_(True)
    loss, valid = recall_at_quantile_loss(ours, labels, mask, "none", quantile=0.2, temperature=0.3, return_valid=True)
    ref, ref_valid = reference_recall(theirs, labels, mask, 0.2, 0.3)
    assert torch.equal(valid, ref_valid)
    torch.testing.assert_close(loss, ref, rtol=1e-10, atol=1e-12)
    loss.sum().backward()
    ref.sum().backward()
    torch.testing.assert_close(ours.grad, theirs.grad, rtol=1e-9, atol=1e-12)
    positives = labels if mask is None else labels & mask
    assert torch.all(ours.grad[~positives] == 0)
    assert torch.all(ours.grad[3:][positives[3:]] < 0)  # raising a positive always raises recall


def test_recall_tends_to_hard_recall_and_perfect_scores_give_zero():
    gen = torch.Generator().manual_seed(2)
    scores = torch.randn(5, 200, generator=gen, dtype=torch.float64)
    labels = torch.rand(5, 200, generator=gen) < 0.05
    labels[:, 0] = True
    soft = recall_at_quantile_loss(scores, labels, reduction="none", quantile=0.1, temperature=1e-6)
    for b in range(5):
        theta = kth_largest(list(scores[b]), 0.1)
        pos = scores[b][labels[b]]
        hard = ((pos > theta).double() + 0.5 * (pos == theta).double()).mean()
        assert abs(float(soft[b]) - (1 - float(hard))) < 1e-6
    perfect = torch.where(labels, 3.0, 0.0).to(torch.float64) + 0.01 * scores
    assert float(recall_at_quantile_loss(perfect, labels, quantile=0.1, temperature=0.01)) < 1e-6


@pytest.mark.parametrize(
    "tau_scale,alpha,beta,n_knots", [("iqr", 0.0, 0.3, 2), ("iqr", 0.05, 0.5, 5), ("band", 0.1, 0.6, 3)]
)
def test_pauc_matches_loop_reference_and_gradient_reaches_positives_only(tau_scale, alpha, beta, n_knots):
    scores, labels, mask = make_batch(width=41, seed=7)
    ours = scores.clone().requires_grad_(True)
    theirs = scores.clone().requires_grad_(True)
    params = dict(alpha=alpha, beta=beta, temperature=0.7, tau_scale=tau_scale, n_knots=n_knots)
    loss, valid = pauc_at_budget_loss(ours, labels, mask, "none", return_valid=True, **params)
    ref, ref_valid = reference_pauc(theirs, labels, mask, **params)
    assert torch.equal(valid, ref_valid) and int(valid.sum()) >= 3
    torch.testing.assert_close(loss, ref, rtol=1e-10, atol=1e-12)
    loss.sum().backward()
    ref.sum().backward()
    torch.testing.assert_close(ours.grad, theirs.grad, rtol=1e-9, atol=1e-12)
    assert torch.all(ours.grad[~(labels & mask)] == 0)


def test_pauc_perfect_scores_give_zero_and_iqr_sample_is_strided():
    gen = torch.Generator().manual_seed(4)
    labels = torch.rand(3, 500, generator=gen) < 0.05
    labels[:, 0] = True
    scores = torch.randn(3, 500, generator=gen, dtype=torch.float64)
    perfect = torch.where(labels, 10.0, scores)
    assert float(pauc_at_budget_loss(perfect, labels, beta=0.05, temperature=0.01)) < 1e-6
    # With a sample smaller than the row, the IQR comes from every 5th column (global index).
    negative = ~labels
    iqr = softrank._negative_iqr(scores, negative, 100, None)
    sample = scores[:, ::5].masked_fill(labels[:, ::5], float("nan"))
    expected = torch.nanquantile(sample, 0.75, dim=1) - torch.nanquantile(sample, 0.25, dim=1)
    torch.testing.assert_close(iqr, expected)


def test_degenerate_rows_are_excluded_and_reported_never_nan():
    scores, labels, mask = make_batch()
    for name, (fn, params) in LOSSES.items():
        per_row, valid = fn(scores, labels, mask, "none", return_valid=True, **params)
        mean = fn(scores, labels, mask, "mean", **params)
        torch.testing.assert_close(mean, per_row[valid].mean(), msg=name)
        assert per_row[0] == 0 and per_row[1] == 0 and not valid[0] and not valid[1], name
    # A batch where every row is degenerate: loss 0, finite gradient, every row reported.
    x = scores.clone().requires_grad_(True)
    only_positive = torch.ones_like(labels)
    module = SmoothAPLoss()
    loss = module(x, only_positive)
    loss.backward()
    assert float(loss.detach()) == 0 and torch.isfinite(x.grad).all() and module.last_excluded_rows == scores.shape[0]
    module = RecallAtQuantileLoss(quantile=0.2)
    module(scores, labels, mask)
    assert module.last_excluded_rows == 2
    module = PAUCAtBudgetLoss(beta=0.3)
    module(scores, labels, mask)
    assert module.last_excluded_rows == 2


def test_nan_in_masked_columns_is_ignored_and_masked_columns_do_not_matter():
    scores, labels, mask = make_batch()
    poisoned = scores.masked_fill(~mask, float("nan"))
    other = scores.masked_fill(~mask, 1e6)
    for name, (fn, params) in LOSSES.items():
        a = fn(poisoned, labels, mask, "none", **params)
        b = fn(other, labels, mask, "none", **params)
        assert torch.isfinite(a).all(), name
        torch.testing.assert_close(a, b, msg=name)


def test_module_defaults_and_mutable_temperature():
    assert SmoothAPLoss().temperature == 0.01
    recall = RecallAtQuantileLoss()
    assert (recall.quantile, recall.temperature) == (0.005, 0.01)
    pauc = PAUCAtBudgetLoss()
    assert (pauc.alpha, pauc.beta, pauc.temperature, pauc.tau_scale) == (0.0, 0.005, 0.1, "iqr")
    scores, labels, mask = make_batch()
    module = SmoothAPLoss(temperature=0.3)
    first = module(scores, labels, mask)
    module.temperature = 0.05
    torch.testing.assert_close(module(scores, labels, mask), smooth_ap_loss(scores, labels, mask, temperature=0.05))
    assert not torch.isclose(first, module(scores, labels, mask))


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda s, l: smooth_ap_loss(s, l.int()), "labels must be a bool"),
        (lambda s, l: smooth_ap_loss(s, l[:, :3]), "labels must have the shape"),
        (lambda s, l: smooth_ap_loss(s[0], l[0]), r"shape \[B, n\]"),
        (lambda s, l: smooth_ap_loss(s.long(), l), "floating point"),
        (lambda s, l: smooth_ap_loss(s, l, l.float()), "mask must be a bool"),
        (lambda s, l: smooth_ap_loss(s, l, reduction="avg"), "reduction"),
        (lambda s, l: smooth_ap_loss(s, l, temperature=0.0), "temperature"),
        (lambda s, l: smooth_ap_loss(s.masked_fill(l, float("nan")), l), "NaN or infinite"),
        (lambda s, l: recall_at_quantile_loss(s, l, quantile=1.0), "quantile"),
        (lambda s, l: pauc_at_budget_loss(s, l, alpha=0.5, beta=0.1), "alpha < beta"),
        (lambda s, l: pauc_at_budget_loss(s, l, tau_scale="std"), "tau_scale"),
        (lambda s, l: pauc_at_budget_loss(s, l, n_knots=1), "n_knots"),
        (lambda s, l: RecallAtQuantileLoss(quantile=0.0), "quantile"),
    ],
)
def test_bad_input_raises_value_error_naming_the_problem(call, match):
    scores, labels, _ = make_batch()
    labels[2:, 5] = True
    with pytest.raises(ValueError, match=match):
        call(scores, labels)


# ---------------------------------------------------------------------------------------------- distributed
def _distributed_body(rank, world_size, group, scores, labels, mask, splits):
    start = sum(splits[:rank])
    stop = start + splits[rank]
    results = {}
    for name, (fn, params) in LOSSES.items():
        for use_mask in (False, True):
            local = scores[:, start:stop].clone().requires_grad_(True)
            local_mask = mask[:, start:stop] if use_mask else None
            loss, valid = fn(local, labels[:, start:stop], local_mask, "mean", group=group, return_valid=True, **params)
            loss.backward()
            results[name, use_mask] = (loss.detach(), valid, local.grad)
    return results


@pytest.mark.parametrize("splits", [[13, 30], [9, 0, 34]])
def test_distributed_equals_single_process(splits):
    scores, labels, mask = make_batch(batch=7, width=sum(splits), seed=11)
    results = run_distributed(_distributed_body, len(splits), args=(scores, labels, mask, splits))
    for name, (fn, params) in LOSSES.items():
        for use_mask in (False, True):
            full = scores.clone().requires_grad_(True)
            loss, valid = fn(full, labels, mask if use_mask else None, "mean", return_valid=True, **params)
            loss.backward()
            grads = []
            for rank_result in results:
                rank_loss, rank_valid, rank_grad = rank_result[name, use_mask]
                torch.testing.assert_close(rank_loss, loss.detach(), rtol=1e-12, atol=1e-14, msg=name)
                assert torch.equal(rank_valid, valid)
                grads.append(rank_grad)
            torch.testing.assert_close(torch.cat(grads, dim=1), full.grad, rtol=1e-10, atol=1e-13, msg=name)
