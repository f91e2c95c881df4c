"""Ranking losses.

Full catalog (every item scored; single process or item-parallel with ``group=`` / ``offset=``):
``rankmax``/``rankmax_loss`` (Kong et al. 2020), ``softmax_loss``, ``sparsemax``/``sparsemax_loss``
(Martins & Astudillo 2016). ``scores`` may be a tensor or a ``ChunkedScores`` (lazy ``U @ V.T``).
"""

from bigrank.losses.rankmax import RankmaxLoss, rankmax, rankmax_loss
from bigrank.losses.scores import ChunkedScores
from bigrank.losses.softmax import SoftmaxLoss, softmax_loss
from bigrank.losses.sparsemax import SparsemaxLoss, sparsemax, sparsemax_loss

__all__ = [
    "ChunkedScores",
    "RankmaxLoss",
    "SoftmaxLoss",
    "SparsemaxLoss",
    "rankmax",
    "rankmax_loss",
    "softmax_loss",
    "sparsemax",
    "sparsemax_loss",
]
