"""The fused shared-negatives Smooth-AP / Recall@quantile / pAUC@budget (``bigrank.losses.sampled_softrank``,
dispatched by ``StepLoss``) equal the generic ``softrank`` losses on the materialised sampled columns [unique
positives | negatives] with the generic labels (accidental hits are positives) and mask: values, gradients
w.r.t. the user vectors and every catalog row, in one process and over 2 and 3 gloo ranks with uneven shards.
A warm-up wrapper dispatches each of its losses to the fused paths and equals the wrapper on the columns."""

from __future__ import annotations

from functools import partial

import pytest
import torch

from bigrank.config import LossConfig, WarmupConfig
from bigrank.data.samplers import candidate_labels
from bigrank.losses.sampled import sampled_softmax_loss
from bigrank.losses.sampled_softrank import smooth_ap_shared_negatives
from bigrank.losses.softrank import pauc_at_budget_loss, recall_at_quantile_loss, smooth_ap_loss
from bigrank.losses.warmup import LossWarmupWrapper
from bigrank.train.losses import StepLoss
from tests.distributed_utils import run_distributed
from tests.sampled_steps import DIM, NUM_ITEMS, reference_columns, sampled_inputs, sampled_step_loss

# (loss name, loss params, the generic loss on the materialised columns)
CASES = {
    "smooth_ap": ({"temperature": 0.3}, lambda s, lab, m: smooth_ap_loss(s, lab, m, temperature=0.3)),
    "recall_q": (
        {"quantile": 0.2, "temperature": 0.4},
        lambda s, lab, m: recall_at_quantile_loss(s, lab, m, quantile=0.2, temperature=0.4),
    ),
    "pauc_iqr": (
        {"beta": 0.3, "temperature": 0.2, "n_knots": 3, "scale_sample_size": 8},
        lambda s, lab, m: pauc_at_budget_loss(s, lab, m, beta=0.3, temperature=0.2, n_knots=3, scale_sample_size=8),
    ),
    "pauc_band": (
        {"alpha": 0.05, "beta": 0.4, "tau_scale": "band"},
        lambda s, lab, m: pauc_at_budget_loss(s, lab, m, alpha=0.05, beta=0.4, tau_scale="band"),
    ),
}
NAMES = {"smooth_ap": "smooth_ap", "recall_q": "recall_at_quantile", "pauc_iqr": "pauc_at_budget"}
NAMES["pauc_band"] = "pauc_at_budget"


_step_loss = partial(sampled_step_loss, seed=11)


def _fused_step(step_loss, users, catalog, target, step, group=None, start=0, stop=NUM_ITEMS):
    """StepLoss on a shard with the generic path disabled: (loss, dL/dusers, dense dL/dshard)."""

    def no_columns(*args, **kwargs):
        raise AssertionError("the generic [B, C] columns were built: the fused path was not taken")

    step_loss._sampled_candidates = no_columns
    u = users.clone().requires_grad_()
    loss = step_loss(u, target, catalog[start:stop].clone(), group=group, step=step)
    loss.backward()
    touched = step_loss.last_rows
    rows = torch.zeros(stop - start, DIM, dtype=users.dtype).index_add_(0, touched.ids, touched.grad)
    return loss, u.grad, rows


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("step", [3, 4])
def test_fused_equals_the_generic_loss_on_the_materialised_columns(case, step):
    params, reference = CASES[case]
    users, catalog, target = sampled_inputs(step)
    step_loss = _step_loss(NAMES[case], params)
    loss, grad_users, grad_rows = _fused_step(step_loss, users, catalog, target, step)

    ids, labels, mask, _ = reference_columns(step_loss, target, step)
    assert bool(labels[:, -step_loss.num_samples :].any())  # an accidental hit among the negatives
    u_ref, w_ref = users.clone().requires_grad_(), catalog.clone().requires_grad_()
    expected = reference(u_ref @ w_ref[ids].T, labels, mask)
    expected.backward()
    torch.testing.assert_close(loss, expected)
    torch.testing.assert_close(grad_users, u_ref.grad)
    torch.testing.assert_close(grad_rows, w_ref.grad)
    assert float(grad_users.abs().sum()) > 0


def test_degenerate_rows_are_excluded_like_the_generic_loss():
    """A row whose every negative is its own target (all hits) has no negative: excluded, not NaN."""
    users, catalog, _ = sampled_inputs(5)
    target = torch.tensor([7, 3])
    negative_ids = torch.tensor([7, 7, 7])
    rows = catalog[negative_ids].clone().requires_grad_()
    u = users[:2].clone().requires_grad_()
    positive_scores = (u * catalog[target]).sum(dim=1)
    loss, valid = smooth_ap_shared_negatives(
        u, rows, negative_ids, target, positive_scores, temperature=0.5, reduction="none", return_valid=True
    )
    assert valid.tolist() == [False, True] and float(loss[0].detach()) == 0.0
    ids = torch.cat([target.unique(), negative_ids])
    labels = candidate_labels(target, ids)
    mask = torch.ones_like(labels)
    mask[:, :2] = labels[:, :2]
    expected = smooth_ap_loss(u.detach() @ catalog[ids].T, labels, mask, "none", temperature=0.5)
    torch.testing.assert_close(loss.detach(), expected)


def test_smooth_ap_shared_negatives_matches_finite_differences():
    """Central differences of the loss against one backward (the fused backward reuses its buffer, so it
    runs once per forward: torch.autograd.gradcheck's repeated backward does not apply)."""
    users, catalog, target = sampled_inputs(6)
    negative_ids = torch.tensor([1, 4, 4, 9, 17, int(target[0]), 23, 30])  # one hit of row 0 at least
    inputs = [users, catalog[negative_ids], catalog[target]]

    def loss_fn(u, rows, positive):
        scores = (u * positive).sum(dim=1)
        return smooth_ap_shared_negatives(u, rows, negative_ids, target, scores, temperature=0.7)

    leaves = [x.clone().requires_grad_() for x in inputs]
    loss_fn(*leaves).backward()
    eps = 1e-6
    for which, leaf in enumerate(leaves):
        for index in [(0, 0), (1, 3), (leaf.shape[0] - 1, DIM - 1), (5 % leaf.shape[0], 2)]:
            plus = [x.clone() for x in inputs]
            minus = [x.clone() for x in inputs]
            plus[which][index] += eps
            minus[which][index] -= eps
            numeric = (loss_fn(*plus) - loss_fn(*minus)) / (2 * eps)
            assert float(leaf.grad[index]) == pytest.approx(float(numeric), rel=1e-5, abs=1e-9)


def _distributed_body(rank, world_size, group, case, users, catalog, target):
    from bigrank.distributed.collectives import all_gather_no_grad, all_reduce_sum
    from bigrank.model.catalog import shard_range

    params, reference = CASES[case]
    start, stop = shard_range(NUM_ITEMS, rank, world_size)
    step_loss = _step_loss(NAMES[case], params, start, stop, negatives=27, rank=rank, sampler="popularity")
    loss, grad_users, grad_rows = _fused_step(step_loss, users, catalog, target, 5, group, start, stop)
    ids, labels, mask, _ = reference_columns(step_loss, target, 5)
    all_ids = all_gather_no_grad(ids, group)
    all_mask = all_gather_no_grad(mask.T.contiguous(), group).T
    u_ref, w_ref = users.clone().requires_grad_(), catalog.clone().requires_grad_()
    expected = reference(u_ref @ w_ref[all_ids].T, candidate_labels(target, all_ids), all_mask)
    expected.backward()
    return {
        "loss": float(loss),
        "expected": float(expected),
        "grad_users": all_reduce_sum(grad_users, group),  # each rank holds the part of its own columns
        "expected_users": u_ref.grad,
        "grad_rows": grad_rows,
        "expected_rows": w_ref.grad[start:stop],
    }


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("world_size", [2, 3])
def test_fused_over_ranks_equals_one_loss_over_all_columns(case, world_size):
    users, catalog, target = sampled_inputs(20 + world_size)
    results = run_distributed(_distributed_body, world_size, args=(case, users, catalog, target))
    for result in results:
        assert result["loss"] == pytest.approx(result["expected"], rel=1e-10, abs=1e-12)
        torch.testing.assert_close(result["grad_users"], result["expected_users"])
        torch.testing.assert_close(result["grad_rows"], result["expected_rows"])
    assert len({result["loss"] for result in results}) == 1


@pytest.mark.parametrize("main", ["smooth_ap", "recall_at_quantile", "pauc_at_budget"])
def test_warmup_wrapper_uses_the_fused_paths_and_equals_the_wrapper_on_the_columns(main):
    """Steps in the warm-up (sampled softmax only), the blend and the main phase: the fused losses and the
    wrapper on the materialised columns agree, with the scheduled temperature."""
    warmup = WarmupConfig(loss="sampled_softmax", steps=1, blend_steps=2, temp_start=0.6, temp_end=0.2,
                          temp_decay_steps=3)  # fmt: skip
    step_loss = _step_loss(main, {}, warmup=warmup)
    reference = LossWarmupWrapper(
        _GenericSampledSoftmax(), _GENERIC[main](), warmup_steps=1, blend_steps=2, temp_start=0.6, temp_end=0.2,
        temp_decay_steps=3,
    )  # fmt: skip
    for step in range(5):  # weights 0, 1/3, 2/3, 1, 1
        users, catalog, target = sampled_inputs(30 + step)
        loss, grad_users, grad_rows = _fused_step(step_loss, users, catalog, target, step)
        ids, labels, mask, log_q = reference_columns(step_loss, target, step)
        u_ref, w_ref = users.clone().requires_grad_(), catalog.clone().requires_grad_()
        expected = reference(u_ref @ w_ref[ids].T, labels, mask, log_q=log_q)
        expected.backward()
        torch.testing.assert_close(loss, expected)
        torch.testing.assert_close(grad_users, u_ref.grad)
        torch.testing.assert_close(grad_rows, w_ref.grad)
        assert step_loss.temperature == pytest.approx(reference.current_temperature)
        step_loss.after_step()
        reference.step()


class _GenericSampledSoftmax(torch.nn.Module):
    def forward(self, scores, labels, mask, log_q=None):
        return sampled_softmax_loss(scores, labels, log_q, mask)


class _GenericSoftRank(torch.nn.Module):
    """A generic soft-rank loss with defaults and a schedulable ``temperature``."""

    function, temperature = None, 0.0

    def forward(self, scores, labels, mask, log_q=None):
        return type(self).function(scores, labels, mask, temperature=self.temperature)


_GENERIC = {
    name: type(name, (_GenericSoftRank,), {"function": staticmethod(fn)})
    for name, fn in [
        ("smooth_ap", smooth_ap_loss),
        ("recall_at_quantile", recall_at_quantile_loss),
        ("pauc_at_budget", pauc_at_budget_loss),
    ]
}


@pytest.mark.parametrize("name", ["sampled_softmax", "smooth_ap", "recall_at_quantile", "pauc_at_budget"])
def test_bf16_scoring_stays_close_to_float32(name):
    """``train.precision=bf16``: the fused paths run their GEMMs in bf16 and keep statistics in float32; loss
    and gradients stay float32 and close to the float32 step (bf16 keeps 8 significant bits of each score)."""
    generator = torch.Generator().manual_seed(8)
    num_items, batch = 400, 64
    users = torch.randn(batch, 16, generator=generator) * 0.5
    catalog = torch.randn(num_items, 16, generator=generator) * 0.5
    target = torch.randint(0, num_items, (batch,), generator=generator)
    params = {"temperature": 0.5} if name in ("smooth_ap", "recall_at_quantile") else {}  # unsaturated
    results = []
    for dtype in (torch.float32, torch.bfloat16):
        config = LossConfig(name=name, candidates="sampled", num_negatives=300, params=params)
        step_loss = StepLoss(config, num_items=num_items, shard_start=0, shard_stop=num_items, seed=3,
                             score_dtype=dtype)  # fmt: skip
        u = users.clone().requires_grad_()
        loss = step_loss(u, target, catalog, step=1)
        loss.backward()
        assert loss.dtype == torch.float32 and u.grad.dtype == torch.float32
        assert step_loss.last_rows.grad.dtype == torch.float32
        results.append((loss.detach(), u.grad, step_loss.last_rows.grad))
    (loss32, users32, rows32), (loss16, users16, rows16) = results
    torch.testing.assert_close(loss16, loss32, rtol=2e-2, atol=2e-3)
    for low, high in [(users16, users32), (rows16, rows32)]:
        assert float((low - high).norm() / high.norm()) < 0.05
