"""Ranking losses.

Full catalog (every item scored; single process or item-parallel with ``group=`` / ``offset=``):
``rankmax``/``rankmax_loss`` (Kong et al. 2020), ``softmax_loss``, ``sparsemax``/``sparsemax_loss``
(Martins & Astudillo 2016). ``scores`` may be a tensor or a ``ChunkedScores`` (lazy ``U @ V.T``).

Soft-rank and sampled (scores over candidate columns, ``labels`` marking positives): ``smooth_ap_loss``,
``recall_at_quantile_loss``, ``pauc_at_budget_loss`` (the ``imbalanced-losses`` family), ``softrank_ndcg_loss``
(Taylor et al. 2008), ``sampled_softmax_loss`` (logQ correction), and ``LossWarmupWrapper``.
"""

from bigrank.losses.rankmax import RankmaxLoss, rankmax, rankmax_loss
from bigrank.losses.sampled import SampledSoftmaxLoss, sampled_softmax_loss
from bigrank.losses.scores import ChunkedScores
from bigrank.losses.softmax import SoftmaxLoss, softmax_loss
from bigrank.losses.softndcg import SoftNDCGLoss, rank_distributions, softrank_ndcg_loss
from bigrank.losses.softrank import (
    PAUCAtBudgetLoss,
    RecallAtQuantileLoss,
    SmoothAPLoss,
    pauc_at_budget_loss,
    recall_at_quantile_loss,
    smooth_ap_loss,
)
from bigrank.losses.sparsemax import SparsemaxLoss, sparsemax, sparsemax_loss
from bigrank.losses.warmup import LossWarmupWrapper

__all__ = [
    "ChunkedScores",
    "LossWarmupWrapper",
    "PAUCAtBudgetLoss",
    "RankmaxLoss",
    "RecallAtQuantileLoss",
    "SampledSoftmaxLoss",
    "SmoothAPLoss",
    "SoftNDCGLoss",
    "SoftmaxLoss",
    "SparsemaxLoss",
    "pauc_at_budget_loss",
    "rank_distributions",
    "rankmax",
    "rankmax_loss",
    "recall_at_quantile_loss",
    "sampled_softmax_loss",
    "smooth_ap_loss",
    "softmax_loss",
    "softrank_ndcg_loss",
    "sparsemax",
    "sparsemax_loss",
]
