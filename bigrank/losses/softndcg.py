"""SoftRank NDCG (Taylor, Guiver, Robertson & Minka, "SoftRank: Optimizing Non-Smooth Rank Metrics", WSDM 2008).

Each candidate's score is treated as a Gaussian ``s_j ~ N(mean_j, sigma^2)``. The probability that i beats j
(the pairwise contest) is ``pi_ij = Phi((mean_i - mean_j) / (sqrt(2) sigma))`` (eq. 3), and the rank
distribution of j follows from adding the contestants one at a time (the rank-binomial recursion, eq. 5)::

    p_j^(1)(r) = delta(r)                 p_j^(i)(r) = p_j^(i-1)(r - 1) pi_ij + p_j^(i-1)(r) (1 - pi_ij)

SoftNDCG is the expected NDCG under these distributions (eq. 8):
``G_soft = (1 / G_max) sum_j g_j sum_r D(r) p_j(r)`` with ``D(r) = 1 / log2(2 + r)`` (rank r = 0 is the top).
This is the exact recursion, not the expected-rank shortcut. The model itself treats the contests of one
candidate as independent (Taylor et al.'s pairwise-contest approximation; they share that candidate's noise in
reality): expected ranks are exact, and whole distributions are close to Monte-Carlo sampling of the Gaussian
scores when sigma is small against the score gaps (tests check both).

Cost: the recursion is O(N^2) time per candidate whose distribution is needed, for a list of N candidates.
Only candidates with a gain add to the expected DCG, so the loss computes the distributions of the P
positives of each row alone: O(N^2 P) time and O(N P) memory per row (``rank_distributions`` gives all N:
O(N^3)). It runs on a candidate list per row: all positives (gain > 0) plus the highest-scoring negatives,
``num_candidates`` in all.
The backward pass does not store the N intermediate distributions (that would be O(N^3) memory): the gradient
of ``p_j`` w.r.t. ``pi_ij`` needs j's rank distribution without contestant i, which is recovered by dividing
the generating polynomial ``prod_i ((1 - pi_ij) + pi_ij z)`` by the factor of i, in the numerically stable
direction (forward when pi_ij <= 1/2, from the top rank down otherwise).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from bigrank.distributed.collectives import all_gather_replicated, is_distributed
from bigrank.losses.softrank import check_positive_float, finish, local_positives, row_counts
from bigrank.losses.validation import check_reduction, check_scores

__all__ = ["SoftNDCGLoss", "rank_distributions", "softrank_ndcg_loss"]

# Elements of a [b, N, N] block the backward recursions work on at once (512 KB of float32: cache-sized).
_CACHE_ELEMENTS = 1 << 17
# A candidate list longer than this would need B x N^2 floats per step and O(N^3) time: ask for a shorter list.
MAX_LIST_SIZE = 4096


def _negligible(dtype: torch.dtype) -> float:
    """Probabilities below this are set to 0 in the recursions: far below rounding of O(1) terms, and it keeps
    products of many small probabilities out of the subnormal range, where CPU arithmetic is ~100x slower."""
    return torch.finfo(dtype).tiny ** 0.5


class _RankBinomial(torch.autograd.Function):
    """``p[b, j, r]`` = probability that candidate j has rank r, from ``pi[b, i, j]`` = P(i beats j).

    ``pi`` is [B, N, M]: the N contestants of each of M candidates (M = N for the whole list; fewer when only
    some candidates' distributions are needed, e.g. the positives of SoftNDCG); the result is [B, M, N].
    Entries of ``pi`` that are not contests (i == j, padding) must be 0: a factor ``(1 - 0) + 0 z`` is a no-op.
    """

    @staticmethod
    def forward(ctx, pi):
        batch, size, width = pi.shape
        # Rank-major [r, b, j] (each rank's slice a contiguous operand), on blocks of rows that stay in cache,
        # two buffers in turn: no allocation inside the ~N iterations (they went to memory on the whole batch).
        ranks = pi.new_empty(size, batch, width)
        block = max(1, _CACHE_ELEMENTS // max(1, size * width))
        for start in range(0, batch, block):
            rows = slice(start, start + block)
            ranks[:, rows] = _rank_binomial_block(pi[rows])
        ctx.save_for_backward(pi, ranks)
        return ranks.permute(1, 2, 0).contiguous()

    @staticmethod
    def backward(ctx, grad_p):
        pi, ranks = ctx.saved_tensors
        size, width = ranks.shape[0], ranks.shape[2]
        if size < 2:
            return torch.zeros_like(pi)
        # Rows are independent: run the recursions on blocks of rows whose [b, N, M] tensors stay in cache
        # (each of the ~2N iterations makes 4 passes over them; on the whole batch those passes went to memory).
        block = max(1, _CACHE_ELEMENTS // max(1, size * width))
        grad_pi = torch.empty_like(pi)
        for start in range(0, pi.shape[0], block):
            rows = slice(start, start + block)
            grad_pi[rows] = _rank_binomial_grad(pi[rows], ranks[:, rows], grad_p[rows])
        return grad_pi


def _rank_binomial_block(pi):
    """The rank-binomial recursion (Taylor et al. 2008, eq. 5) for a block of rows of ``pi`` [b, N, M]:
    ``p[r, b, j]`` [N, b, M]."""
    batch, size, width = pi.shape
    beats = pi.transpose(0, 1).contiguous()  # [i, b, j]
    keep = 1.0 - beats
    current, following = pi.new_zeros(size, batch, width), pi.new_zeros(size, batch, width)
    current[0] = 1.0
    floor = _negligible(pi.dtype)
    for i in range(size):
        top = min(i + 2, size)  # after i + 1 contests the support is ranks 0 .. i + 1 (current[top - 1] is 0)
        torch.mul(current[:top], keep[i], out=following[:top])
        following[1:top].addcmul_(current[: top - 1], beats[i])
        F.threshold_(following[:top], floor, 0.0)
        current, following = following, current
    return current


def _rank_binomial_grad(pi, ranks, grad_p):
    """dL/dpi [b, N, M] of ``_RankBinomial`` for a block of rows; ``ranks`` is its output rank-major [N, b, M]."""
    size = ranks.shape[0]
    # dL/dpi_ij = sum_r q_ij(r) (w_j(r + 1) - w_j(r)), with q_ij = p_j without contestant i and w = grad_p.
    # Rank-major copies, so that each rank's slice is a contiguous [b, 1, j] operand (strided [..., r] slices
    # of the [b, j, N] tensors made every addcmul_ below several times slower).
    step = (grad_p[:, :, 1:] - grad_p[:, :, :-1]).permute(2, 0, 1).contiguous().unsqueeze(2)  # [N-1, b, 1, j]
    nonzero = step.ne(0).flatten(1, 3).any(dim=1).nonzero()
    last = int(nonzero.max()) + 1 if nonzero.numel() else 0  # ranks past the last non-zero step add 0
    target = ranks.unsqueeze(2)  # [N, b, 1, j]
    keep = 1.0 - pi
    forward = pi <= 0.5  # which division is stable for each pair; the other one is skipped (zero factors)
    zero = pi.new_zeros(())
    # q(r) = (p(r) - pi q(r - 1)) / (1 - pi): rounding is amplified by pi / (1 - pi) <= 1 when pi <= 1/2.
    scale = torch.where(forward, keep.reciprocal(), zero)
    minus_ratio = torch.where(forward, -pi * scale, zero)  # -(q * ratio) == q * (-ratio) exactly
    grad_pi, q = torch.zeros_like(pi), torch.zeros_like(pi)
    floor = _negligible(pi.dtype)
    for r in range(last):
        F.threshold_(q.mul_(minus_ratio).addcmul_(target[r], scale), floor, 0.0)
        grad_pi.addcmul_(q, step[r])
    # q(r - 1) = (p(r) - (1 - pi) q(r)) / pi from the top rank down: amplification (1 - pi) / pi < 1.
    scale = torch.where(forward, zero, pi.reciprocal())
    minus_ratio = torch.where(forward, zero, -keep * scale)
    q = torch.zeros_like(pi)
    for r in range(size - 1, 0, -1):
        F.threshold_(q.mul_(minus_ratio).addcmul_(target[r], scale), floor, 0.0)  # now q(r - 1)
        if r - 1 < last:
            grad_pi.addcmul_(q, step[r - 1])
    return grad_pi


def rank_distributions(scores: torch.Tensor, valid: torch.Tensor | None = None, sigma: float = 0.1) -> torch.Tensor:
    """SoftRank rank distributions of a candidate list: ``p[b, j, r]`` = P(candidate j has rank r) [B, N, N].

    Args:
        scores: float[B, N] score means of the candidates. valid: bool[B, N] (False = padding: not a contestant,
            its own distribution is a point mass at rank 0). sigma: score noise standard deviation.

    Each row ``p[b, j, :]`` sums to 1; differentiable w.r.t. ``scores`` (Taylor et al. 2008, eq. 3 and 5).
    """
    sigma = check_positive_float(sigma, "sigma")
    batch, size = scores.shape
    if valid is None:
        valid = torch.ones(batch, size, dtype=torch.bool, device=scores.device)
    diff = (scores.unsqueeze(2) - scores.unsqueeze(1)) / (math.sqrt(2.0) * sigma)  # [b, i, j]: s_i - s_j
    eye = torch.eye(size, dtype=torch.bool, device=scores.device)
    contest = valid.unsqueeze(2) & valid.unsqueeze(1) & ~eye
    pi = torch.where(contest, torch.special.ndtr(diff), diff.new_zeros(()))
    return _RankBinomial.apply(pi)


def _rank_distributions_of(scores, valid, slots, present, sigma) -> torch.Tensor:
    """``rank_distributions(scores, valid, sigma)[b, slots[b, m]]`` for the slots flagged in ``present``
    [B, M] (0 elsewhere: no contest): [B, M, N], without the other candidates' distributions."""
    size = scores.shape[1]
    chosen = scores.gather(1, slots)
    diff = (scores.unsqueeze(2) - chosen.unsqueeze(1)) / (math.sqrt(2.0) * sigma)  # [b, i, m]: s_i - s_m
    others = torch.arange(size, device=scores.device).view(1, size, 1) != slots.unsqueeze(1)
    contest = valid.unsqueeze(2) & (present & valid.gather(1, slots)).unsqueeze(1) & others
    pi = torch.where(contest, torch.special.ndtr(diff), diff.new_zeros(()))
    return _RankBinomial.apply(pi)


def _discounts(size: int, k: int | None, dtype, device) -> torch.Tensor:
    ranks = torch.arange(size, dtype=dtype, device=device)
    discount = 1.0 / torch.log2(ranks + 2.0)
    if k is not None:
        discount = torch.where(ranks < k, discount, discount.new_zeros(()))
    return discount


def _candidate_list(scores, gains, valid, positive, n_positive, num_candidates, group):
    """Each row's list: every positive plus the top-scoring negatives, ``num_candidates`` in all (more when a
    row has more positives). Returns (scores [B, N] with gradient, gains [B, N], in_list bool [B, N])."""
    if num_candidates is None:
        local = torch.stack([scores, gains.to(scores.dtype), valid.to(scores.dtype)], dim=-1)  # [B, C, 3]
    else:
        pos_scores, pos_present = local_positives(scores, positive)
        pos_gains = local_positives(gains, positive)[0].to(scores.dtype)
        negatives = valid & ~positive
        width = min(num_candidates, scores.shape[1])
        ranked = scores.detach().masked_fill(~negatives, float("-inf"))
        top = ranked.topk(width, dim=1).indices
        neg_present = torch.isfinite(ranked.gather(1, top))
        local = torch.cat(
            [
                torch.stack([pos_scores, pos_gains, pos_present.to(scores.dtype)], dim=-1),
                torch.stack([scores.gather(1, top), scores.new_zeros(top.shape), neg_present.to(scores.dtype)], dim=-1),
            ],
            dim=1,
        )  # fmt: skip
    if is_distributed(group):
        # Every rank runs the same (replicated) list computation on the gathered lists.
        local = all_gather_replicated(local.transpose(0, 1).contiguous(), group).transpose(0, 1)
    list_scores, list_gains, present = local[..., 0], local[..., 1].detach(), local[..., 2].detach() > 0.5
    if num_candidates is None:
        return list_scores, list_gains, present
    is_positive = present & (list_gains > 0)
    key = torch.where(is_positive, float("inf"), torch.where(present, list_scores.detach(), float("-inf")))
    length = min(key.shape[1], max(num_candidates, int(n_positive.max()) if n_positive.numel() else 0))
    order = key.topk(length, dim=1).indices
    slots = torch.arange(length, device=scores.device)
    in_list = present.gather(1, order) & (slots.unsqueeze(0) < n_positive.clamp_min(num_candidates).unsqueeze(1))
    return list_scores.gather(1, order), list_gains.gather(1, order), in_list


def softrank_ndcg_loss(
    scores: torch.Tensor,
    gains: torch.Tensor,
    mask: torch.Tensor | None = None,
    reduction: str = "mean",
    *,
    group=None,
    sigma: float = 0.1,
    k: int | None = None,
    num_candidates: int | None = 64,
    return_valid: bool = False,
):
    """1 - SoftNDCG per row (Taylor et al., WSDM 2008, eq. 8), exact rank-binomial recursion.

    Args:
        scores: float[B, C] local candidate scores. gains: float[B, C] relevance gains >= 0 (or bool, gain 1);
            positives are gains > 0. mask: bool[B, C] valid columns.
        reduction: "mean" | "sum" | "none" (over non-degenerate rows).
        group: process group splitting the columns across ranks; the shards' candidate lists are gathered
            and every rank computes the same SoftNDCG.
        sigma: standard deviation of the Gaussian score noise (score units; the smoothing "temperature").
        k: truncate the discount at rank k (SoftNDCG@k); None = no truncation.
        num_candidates: list size per row: all positives plus the highest-scoring negatives (the list grows when
            a row has more positives). None = every valid column (for inputs that already are a short list).
        return_valid: also return ``valid: bool[B]`` (False = no positive or no negative: excluded).

    The ideal DCG is taken over the list, which holds every positive, so it is the row's ideal DCG(@k).
    Memory O(B N P), time O(B N^2 P) for a list of N candidates, P of them positive (at most).
    """
    check_reduction(reduction)
    check_scores(scores)
    sigma = check_positive_float(sigma, "sigma")
    if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
        raise ValueError(f"k must be a positive integer or None, got {k!r}")
    if num_candidates is not None and (
        isinstance(num_candidates, bool) or not isinstance(num_candidates, int) or num_candidates < 2
    ):
        raise ValueError(f"num_candidates must be an integer >= 2 or None, got {num_candidates!r}")
    if not isinstance(gains, torch.Tensor) or gains.shape != scores.shape:
        shape = tuple(gains.shape) if isinstance(gains, torch.Tensor) else type(gains).__name__
        raise ValueError(f"gains must be a tensor with the shape of scores {tuple(scores.shape)}, got {shape}")
    if not (gains.is_floating_point() or gains.dtype == torch.bool):
        raise ValueError(f"gains must be floating point (or bool), got dtype {gains.dtype}")
    if mask is not None and (
        not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool or mask.shape != scores.shape
    ):
        raise ValueError(f"mask must be a bool tensor with the shape of scores {tuple(scores.shape)}")
    valid = torch.ones_like(scores, dtype=torch.bool) if mask is None else mask
    clean = scores if mask is None else scores.masked_fill(~mask, 0.0)
    gains = gains.detach()
    if gains.dtype == torch.bool:  # binary relevance: no [B, C] float copy, nothing to check
        bad_gains = None
        positive = gains if mask is None else gains & mask
    else:
        usable = torch.isfinite(gains) & (gains >= 0)
        bad_gains = (~usable if mask is None else ~usable & mask).any(dim=1)
        positive = gains > 0 if mask is None else (gains > 0) & mask
    n_valid, n_positive = row_counts(
        clean, valid, positive, group, raw_scores=None if mask is None else scores,
        bad_labels=bad_gains, labels_problem="gains must be finite and >= 0 in valid columns",
    )  # fmt: skip
    list_scores, list_gains, in_list = _candidate_list(clean, gains, valid, positive, n_positive, num_candidates, group)
    if list_scores.shape[1] > MAX_LIST_SIZE:
        raise ValueError(
            f"SoftNDCG candidate list has {list_scores.shape[1]} entries (> {MAX_LIST_SIZE}): the recursion is "
            "O(N^3); pass num_candidates to keep the positives and the top-scoring negatives only"
        )
    list_gains = torch.where(in_list, list_gains, list_gains.new_zeros(()))
    # Only candidates with a gain add to the expected DCG, so only their rank distributions are computed:
    # O(B N^2 P) for P positives a row instead of O(B N^3) (the values of the whole list's distributions).
    slots, has_gain = local_positives(torch.arange(list_gains.shape[1]).expand_as(list_gains), list_gains > 0)
    p = _rank_distributions_of(list_scores, in_list, slots, has_gain, sigma)  # [B, P, N]
    discount = _discounts(list_scores.shape[1], k, scores.dtype, scores.device)
    chosen_gains = torch.where(has_gain, list_gains.gather(1, slots), list_gains.new_zeros(()))  # 0: padding
    expected_dcg = torch.einsum("bm,bmr,r->b", chosen_gains, p, discount)
    ideal_dcg = (list_gains.sort(dim=1, descending=True).values * discount).sum(dim=1)
    valid_rows = (n_positive > 0) & (n_positive < n_valid) & (ideal_dcg > 0)
    ndcg = expected_dcg / torch.where(valid_rows, ideal_dcg, ideal_dcg.new_ones(()))
    return finish(1.0 - ndcg, valid_rows, reduction, return_valid)


class SoftNDCGLoss(nn.Module):
    """``softrank_ndcg_loss`` as a module. ``temperature`` is an alias of ``sigma`` (the score noise), so
    ``LossWarmupWrapper`` can anneal it; ``last_excluded_rows`` counts the degenerate rows of the last call."""

    def __init__(
        self, sigma: float = 0.1, k: int | None = None, num_candidates: int | None = 64, reduction: str = "mean"
    ):
        super().__init__()
        check_reduction(reduction)
        self.sigma = check_positive_float(sigma, "sigma")
        self.k, self.num_candidates, self.reduction = k, num_candidates, reduction
        self.last_excluded_rows = 0

    @property
    def temperature(self) -> float:
        return self.sigma

    @temperature.setter
    def temperature(self, value: float) -> None:
        self.sigma = check_positive_float(value, "temperature")

    def forward(self, scores, gains, mask=None, *, group=None):
        loss, valid = softrank_ndcg_loss(
            scores, gains, mask, self.reduction, group=group, sigma=self.sigma, k=self.k,
            num_candidates=self.num_candidates, return_valid=True,
        )  # fmt: skip
        self.last_excluded_rows = int((~valid).sum())
        return loss
