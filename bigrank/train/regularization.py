"""L2 regularisation of the user tower, as an explicit loss term.

fbgemm's fused optimisers apply weight decay only on CUDA (``rowwise_adagrad`` / ``adam``); its CPU kernels
ignore it (``bigrank.model.sharding.fused_params`` refuses it there). The user rows never have a dense
gradient either (the update happens inside backward), so no torch optimiser can decay them. The equivalent
that works on every device is a term of the loss on the user vectors of the step:

    penalty = user_l2 * (1 / B) * sum_{b in this rank's rows} ||f(u_b)||^2          (B: the global batch)

Its gradient ``2 * user_l2 * f(u_b) / B`` flows back through the torchrec lookup to exactly the rows used in
the step (the user row, and the history rows of the bag when the tower has one), and the fused optimiser
applies it with the loss gradient. Summed over ranks it is ``user_l2 * mean_b ||f(u_b)||^2`` of the global
batch: a per-example penalty, so a user is regularised in proportion to its number of training rows — the
frequency-weighted L2 of "weighted-lambda regularisation" (Zhou et al., ALS-WR, 2008). The penalty is local to
the rank (no collective): the replicated loss's gradient reaches the same vectors through the all-gather's
reduce-scatter, and the two add up in backward.
"""

from __future__ import annotations

import torch

__all__ = ["user_l2_penalty"]


def user_l2_penalty(
    local_vectors: torch.Tensor, global_batch: int, user_l2: float, rows: torch.Tensor | None = None
) -> torch.Tensor | None:
    """``user_l2 * sum_b rows_b ||local_vectors[b]||^2 / global_batch`` (a 0-dim tensor), or None when
    ``user_l2`` is 0.

    Args:
        local_vectors: float[b, d] this rank's user vectors of the step (padding rows removed).
        global_batch: rows of the step over all ranks (``B``).
        user_l2: the coefficient (``optim.user_l2``), >= 0.
        rows: float[b] the training rows each vector stands for (a user-major step: the user's train items, so
            that the penalty is the row-wise one); None: 1 each.
    """
    if user_l2 < 0:
        raise ValueError(f"user_l2 must be >= 0, got {user_l2}")
    if global_batch < 1:
        raise ValueError(f"global_batch must be >= 1, got {global_batch}")
    if user_l2 == 0:
        return None
    if rows is None:
        return local_vectors.pow(2).sum() * (float(user_l2) / global_batch)
    return (local_vectors.pow(2).sum(dim=1) * rows.to(local_vectors.dtype)).sum() * (float(user_l2) / global_batch)
