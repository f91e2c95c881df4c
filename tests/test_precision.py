"""bf16 scoring (``train.precision=bf16``) on CPU: bf16 scores, float32 row kernels, float64 statistics.

References: the same losses in float32. bf16 rounds every score to 8 significant bits, so the loss moves by
about 2^-8 relative; what must not happen is a further loss of accuracy in the statistics (a threshold, a
log-sum-exp or a sum computed in bf16), which the kernel test below pins exactly.
"""

from __future__ import annotations

import pytest
import torch

from bigrank.losses import ChunkedScores, kernels, rankmax_loss, softmax_loss, sparsemax_loss
from bigrank.losses.scores import score_matrix

N, B, D = 3000, 16, 16
LOSSES = {
    "softmax": softmax_loss,
    "rankmax_k1": lambda s, y: rankmax_loss(s, y, k=1),
    "rankmax_k10": lambda s, y: rankmax_loss(s, y, k=10),
    "sparsemax": sparsemax_loss,
}


def factors(seed=0):
    generator = torch.Generator().manual_seed(seed)
    users = torch.randn(B, D, generator=generator)
    items = torch.randn(N, D, generator=generator) * 0.5
    target = torch.randint(0, N, (B,), generator=generator)
    return users, items, target


def loss_and_grads(loss_fn, users, items, target, chunk_size, dtype):
    users = users.clone().requires_grad_(True)
    items = items.clone().requires_grad_(True)
    loss = loss_fn(score_matrix(users, items, chunk_size, dtype), target)
    loss.backward()
    return loss, users.grad, items.grad


def cosine(a, b):
    return float(torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0))


@pytest.mark.parametrize("name", list(LOSSES))
@pytest.mark.parametrize("chunk_size", [None, 700])
def test_bf16_scores_stay_close_to_fp32(name, chunk_size):
    users, items, target = factors()
    ref_loss, ref_users, ref_items = loss_and_grads(LOSSES[name], users, items, target, chunk_size, None)
    loss, grad_users, grad_items = loss_and_grads(LOSSES[name], users, items, target, chunk_size, torch.bfloat16)
    assert loss.dtype == torch.float32  # the loss is not rounded to bf16
    assert grad_users.dtype == grad_items.dtype == torch.float32  # parameters' gradients keep their dtype
    torch.testing.assert_close(loss, ref_loss, rtol=2e-2, atol=2e-2)
    assert cosine(grad_users, ref_users) > 0.99
    assert cosine(grad_items, ref_items) > 0.99


@pytest.mark.parametrize("name", list(LOSSES))
def test_bf16_chunked_equals_bf16_dense(name):
    users, items, target = factors(1)
    dense = loss_and_grads(LOSSES[name], users, items, target, None, torch.bfloat16)
    chunked = loss_and_grads(LOSSES[name], users, items, target, 512, torch.bfloat16)
    torch.testing.assert_close(chunked[0], dense[0], rtol=1e-3, atol=1e-3)
    # dense: bf16 dL/dscores through one bf16 GEMM; chunked: per-chunk bf16 GEMMs summed in float32
    for got, want in zip(chunked[1:], dense[1:], strict=True):
        assert cosine(got, want) > 0.999


def test_row_kernels_on_bf16_blocks_compute_in_float32():
    """Each kernel on a bf16 block equals the same kernel on that block upcast to float32: thresholds, shifts
    and comparisons are not rounded to bf16 (z - mu in bf16 would lose the low bits of mu)."""
    generator = torch.Generator().manual_seed(3)
    block = (torch.randn(8, 999, generator=generator) * 3 + 20).to(torch.bfloat16)
    wide = block.float()
    mu = wide.amax(dim=1) - 2.3456789  # not representable in bf16 at this magnitude
    lower, upper = mu - 0.123, mu + 1.987
    scale = torch.rand(8, generator=generator, dtype=torch.float64) + 0.5
    torch.testing.assert_close(kernels.support_sum_count(block, mu), kernels.support_sum_count(wide, mu))
    torch.testing.assert_close(kernels.relu_square_sum(block, mu), kernels.relu_square_sum(wide, mu))
    torch.testing.assert_close(kernels.max_and_sum_exp(block), kernels.max_and_sum_exp(wide))
    masked = kernels.masked_scale(block, lower, upper, scale)
    assert masked.dtype == torch.bfloat16
    torch.testing.assert_close(masked, kernels.masked_scale(wide, lower, upper, scale).to(torch.bfloat16))
    grad = kernels.exp_grad(block, mu + 3, scale)
    torch.testing.assert_close(grad, kernels.exp_grad(wide, mu + 3, scale).to(torch.bfloat16))
    relu = kernels.relu_grad(block, mu, scale)
    torch.testing.assert_close(relu, kernels.relu_grad(wide, mu, scale).to(torch.bfloat16))


def test_chunked_scores_dtype_checks():
    users, items, _ = factors()
    scores = ChunkedScores(users, items, 100, torch.bfloat16)
    assert scores.dtype == torch.bfloat16
    start, block = next(scores.blocks())
    assert start == 0 and block.dtype == torch.bfloat16
    torch.testing.assert_close(block, (users.bfloat16() @ items[:100].bfloat16().T))
    columns = torch.arange(B) * 7
    torch.testing.assert_close(
        scores.gather_columns(columns), (users.bfloat16() @ items.bfloat16().T).gather(1, columns[:, None])[:, 0]
    )
    with pytest.raises(ValueError, match="differ in dtype"):
        ChunkedScores(users.double(), items, 100)
