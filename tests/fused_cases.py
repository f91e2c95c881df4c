"""The fused kernels and the chunked losses on the same inputs, run under Triton's interpreter.

``python -m tests.fused_cases OUT`` (with ``TRITON_INTERPRET=1`` set before anything imports Triton, as
``tests/test_fused_losses.py`` does in a subprocess) writes ``{case: {"fused": (loss, dU, dV), "chunked": (...)}}``
to OUT (``torch.save``). Single-process cases compare ``kernel_scores(..., kernel="fused")`` with the chunked
path on the same factors; item-parallel cases run the fused kernels on 2 and 3 real gloo ranks (uneven shards)
and compare the summed dU and the concatenated dV with the single-process chunked step.
"""

from __future__ import annotations

import sys

import torch

from bigrank.losses import rankmax_loss, softmax_loss
from bigrank.losses.fused.source import kernel_scores
from tests.distributed_utils import run_distributed
from tests.test_distributed_catalog import uneven_bounds

B, N, D = 37, 203, 24  # several 32-row and 32-column interpreter tiles, ragged edges, d not a power of two
LOSSES = {
    "softmax": lambda s, y, **kw: softmax_loss(s, y, **kw),
    "softmax_t0.5": lambda s, y, **kw: softmax_loss(s, y, temperature=0.5, **kw),
    "rankmax": lambda s, y, **kw: rankmax_loss(s, y, k=1, **kw),
    "rankmax_margin0.3": lambda s, y, **kw: rankmax_loss(s, y, k=1, margin=0.3, **kw),
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def factors(seed: int = 0):
    """U [B, D], V [N, D], target [B]: rows 0-3 have their positive at the top score (Rankmax's second pass),
    and row 4's top score is tied with another item (its ties share mu's gradient)."""
    generator = torch.Generator().manual_seed(seed)
    users = torch.randn(B, D, generator=generator)
    items = torch.randn(N, D, generator=generator) * 0.5
    items[N - 1] = items[7]  # two equal items: equal scores in every row
    users[4] = items[7] * 3  # row 4's top score is item 7's, tied with item N - 1
    target = torch.randint(0, N, (B,), generator=generator)
    target[:4] = (users[:4] @ items.T).argmax(dim=1)
    target[4] = 7
    return users, items, target


def step(loss_fn, users, items, target, dtype, kernel, **kw):
    """(loss, dU, dV) of one step; ``kw``: group and offset for an item-parallel shard."""
    users = users.clone().requires_grad_(True)
    items = items.clone().requires_grad_(True)
    loss = loss_fn(kernel_scores(users, items, 50, dtype, kernel=kernel), target, **kw)
    loss.backward()
    return loss.detach(), users.grad, items.grad


def _shard_body(rank, world_size, group, users, items, target, bounds, name, dtype):
    start, stop = bounds[rank]
    return step(LOSSES[name], users, items[start:stop], target, dtype, "fused", group=group, offset=start)


def main(out: str) -> None:
    users, items, target = factors()
    results = {}
    for name, loss_fn in LOSSES.items():
        for dtype_name, dtype in DTYPES.items():
            chunked = step(loss_fn, users, items, target, dtype, "chunked")
            results[f"single/{name}/{dtype_name}"] = {
                "fused": step(loss_fn, users, items, target, dtype, "fused"),
                "chunked": chunked,
            }
    for world_size in (2, 3):
        bounds = uneven_bounds(N, world_size)
        for name in ("softmax", "rankmax"):
            per_rank = run_distributed(
                _shard_body, world_size, args=(users, items, target, bounds, name, torch.float32)
            )
            losses = torch.stack([loss for loss, _, _ in per_rank])
            assert torch.equal(losses, losses[:1].expand_as(losses)), f"ranks disagree on the loss: {losses}"
            fused = (losses[0], sum(grad for _, grad, _ in per_rank), torch.cat([grad for _, _, grad in per_rank]))
            chunked = step(LOSSES[name], users, items, target, torch.float32, "chunked")
            results[f"parallel{world_size}/{name}/fp32"] = {"fused": fused, "chunked": chunked}
    torch.save(results, out)


if __name__ == "__main__":
    main(sys.argv[1])
