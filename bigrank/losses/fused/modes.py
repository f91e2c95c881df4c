"""The ``MODE`` values of the fused kernels (``triton_tiles``), importable without Triton."""

SOFTMAX = 0  # statistics (max, sum exp(z - max)); gradient scale_r exp(z - a_r)
THRESHOLD = 1  # statistics (max, sum (z - mu)_+, count z > mu, count z == eq); gradient scale_r [z > a_r] + ties
