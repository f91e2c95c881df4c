"""The fused (torch.compile) loss kernels compute what the eager ones do, and the two-stage top-k is exact."""

from __future__ import annotations

import pytest
import torch

from bigrank.losses import kernels


def test_two_stage_topk_is_exact_with_ties_and_ragged_tails():
    generator = torch.Generator().manual_seed(0)
    for width, k in [(100_003, 10), (50_000, 37), (9_000, 5), (300, 4)]:
        block = torch.randint(-500, 500, (3, width), generator=generator).float()  # many ties
        torch.testing.assert_close(kernels.topk_values(block, k), block.topk(k, dim=1).values)
    block = torch.randn(2, 70_001, generator=generator)
    torch.testing.assert_close(kernels.topk_values(block, 1), block.max(dim=1, keepdim=True).values)


def test_compiled_kernels_equal_eager(monkeypatch):
    generator = torch.Generator().manual_seed(1)
    block = torch.randn(5, 4_099, generator=generator)
    mu = torch.randn(5, generator=generator).double()
    upper = mu + 1.5
    scale = torch.rand(5, generator=generator).double()
    calls = {
        "support_sum_count": lambda: kernels.support_sum_count(block, mu),
        "max_support_sum_count": lambda: kernels.max_support_sum_count(block, mu),
        "masked_scale": lambda: kernels.masked_scale(block, mu, upper, scale),
        "max_and_sum_exp": lambda: kernels.max_and_sum_exp(block),
        "exp_grad": lambda: kernels.exp_grad(block, mu, scale),
        "relu_square_sum": lambda: kernels.relu_square_sum(block, mu),
        "relu_grad": lambda: kernels.relu_grad(block, mu, scale),
    }
    monkeypatch.setenv("BIGRANK_COMPILE", "0")
    eager = {name: call() for name, call in calls.items()}
    monkeypatch.setenv("BIGRANK_COMPILE", "1")
    for name, call in calls.items():
        compiled = call()
        assert name in kernels._compiled, f"{name} did not go through torch.compile"
        assert not kernels._compile_failed
        torch.testing.assert_close(compiled, eager[name], rtol=1e-5, atol=1e-5, msg=name)


@pytest.mark.parametrize("mode", ["0", "1"])
def test_losses_agree_across_kernel_modes(monkeypatch, mode):
    from bigrank.losses import rankmax_loss, softmax_loss, sparsemax_loss

    generator = torch.Generator().manual_seed(2)
    scores = torch.randn(4, 3_001, generator=generator)
    target = torch.randint(0, 3_001, (4,), generator=generator)
    monkeypatch.setenv("BIGRANK_COMPILE", mode)
    for loss_fn in (
        lambda s, y: rankmax_loss(s, y, k=3),
        lambda s, y: rankmax_loss(s, y, k=1),
        softmax_loss,
        sparsemax_loss,
    ):
        ours = scores.clone().requires_grad_(True)
        value = loss_fn(ours, target)
        value.backward()
        reference = scores.double().requires_grad_(True)
        monkeypatch.setenv("BIGRANK_COMPILE", "0")
        expected = loss_fn(reference, target)
        expected.backward()
        monkeypatch.setenv("BIGRANK_COMPILE", mode)
        torch.testing.assert_close(value.double(), expected, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ours.grad.double(), reference.grad, rtol=1e-5, atol=1e-6)


def test_auto_compiles_a_two_worker_shard_block_and_leaves_small_blocks_eager(monkeypatch):
    # The dispatch decision only: torch.compile is replaced by a recorder that returns the eager function.
    compiled = []
    monkeypatch.setattr(kernels.torch, "compile", lambda fn, dynamic: compiled.append(fn.__name__) or fn)
    monkeypatch.setattr(kernels, "_compiled", {})
    monkeypatch.setenv("BIGRANK_COMPILE", "auto")
    mu = torch.zeros(256, dtype=torch.float64)
    kernels.support_sum_count(torch.randn(16, 1_000), mu[:16])  # 16K entries: a test-sized block
    assert compiled == []
    # One worker's block of a 2-worker ml-latest-small run (512 rows over 2 workers x 9,742 items) and of ML-1M
    # (3,706 items): the 1-worker run's full block compiles too, so the two compare on the same kernels.
    for items in (9_742, 3_706):
        kernels.support_sum_count(torch.randn(256, items), mu)
    assert compiled == ["_support_sum_count"]
    assert kernels.COMPILE_MIN_ELEMENTS <= 256 * 1_500  # the demo's 2-worker block (1,500 items)
