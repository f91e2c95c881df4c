"""Fused full-catalog losses: Triton kernels in which the B x n scores never leave the chip (``train.kernel``).

* ``triton_tiles``: the two kernels (a statistics pass and a gradient pass over [users x items] tiles);
* ``launch``: tile sizes, grids and the float64 merge of their per-row statistics;
* ``losses``: the fused twins of the softmax and Rankmax k = 1 losses (their local passes and backward);
* ``source``: ``FusedScores``, what ``score_matrix(..., kernel="fused")`` returns;
* ``select``: ``train.kernel: auto | fused | chunked`` resolved for a device and a loss.

Triton is imported only when a kernel runs; with ``TRITON_INTERPRET=1`` (set before Triton's import) the
kernels run on CPU tensors, which is how the tests check them against the chunked losses.
"""
