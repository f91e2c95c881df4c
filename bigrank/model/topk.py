"""Exact fp32 top-K of inner-product scores over a catalog (shard), certified from a cheaper bf16 pass.

Ranking a catalog for a user means the top K of ``s_j = <u, v_j>`` over the items j. :func:`exact_topk` returns
the fp32 answer — the values of the fp32 scores and their columns, best first, ties broken by the lower column
(item id) — but with ``certified=True`` scores the catalog in bf16 first (on a CPU with avx512_bf16 / AMX:
~1.8-2.2x the fp32 GEMM rate measured here on one thread, 3.5x reported on two) and computes fp32 scores only for
the few items whose bf16 score, widened by a rigorous bound on the bf16 error, could still reach the top K:

1. ``S_b = bf16(U) @ bf16(V)^T`` on a chunk of users (the bf16 copy of the catalog is made once, by the caller:
   :class:`TopKCatalog`).
2. Every item whose *upper* bound ``S_b[j] + e_j`` reaches the K-th largest *lower* bound ``S_b[i] - e_i`` is a
   candidate. K items have fp32 scores at least that large, so an item below it is strictly beaten by K items
   and cannot be in the fp32 top K, whatever the tie rule. Found in two stages: a per-row bound (the largest
   item norms) picks the candidates from group maxima without a second full pass over the row, then per-entry
   bounds (each item's norms, the size of its bf16 score) drop most of them.
3. The candidates are rescored in fp32 by the same GEMM kernel the fp32 path uses (:func:`rescore` =
   :func:`exact_scores` bit for bit), and their lexicographic top K (score descending, column ascending) is the
   answer. A row whose candidates exceed ``max_candidate_fraction`` of the catalog is ranked in fp32 instead,
   and so is every row when k is too large a share of n for bf16 to pay (``MIN_ITEMS_PER_K``).

The error bound (Higham, *Accuracy and Stability of Numerical Algorithms*, 2nd ed., ch. 3, eq. (3.5): a dot
product of length d summed in any order, with or without FMA, satisfies ``|fl(x^T y) - x^T y| <= g_d |x|^T |y|``,
``g_d = d u / (1 - d u)`` for unit roundoff u; and ``|x|^T |y| <= |x|_2 |y|_2``, Cauchy-Schwarz). Write
``u' = bf16(u) = u + du``, ``v' = bf16(v) = v + dv`` (torch rounds to nearest: ``|du_i| <= 2^-8 |u_i|``; the
error vectors are known exactly, as ``u' - u`` is exact in fp32 by Sterbenz's lemma) and s = <u, v>:

* fp32 reference, any summation order: ``|s_f - s| <= g_d |u| |v|``.
* bf16 inputs: ``<u', v'> - <u, v> = <u', dv> + <du, v>`` exactly, so ``|<u', v'> - s| <= |u'| |dv| + |du| |v|``
  (at most ``(2 u_b + u_b^2) |u| |v|``, ``u_b = 2^-8``, and ~2.5x less on typical data). The product of two bf16
  numbers (8-bit significands) is exact in fp32.
* accumulation: **assumed fp32** — oneDNN's bf16 matmul (AVX512-BF16 ``vdpbf16ps`` / AMX ``tdpbf16ps``)
  accumulates the exact products in fp32, in an order we do not know: ``|s'' - <u', v'>| <= g_d |u'| |v'|``, with
  ``g_d`` taken for ``u = 2^-23`` (twice fp32's ``2^-24``) so that a truncating accumulator is covered too.
* output: torch returns the bf16 GEMM in bf16, one rounding to nearest of the fp32 accumulator:
  ``|s_b - s''| <= u_b |s''| <= c_2 |s_b|``, ``c_2 = u_b / (1 - u_b)``.

Hence ``|s_b - s_f| <= e = |u'| |dv| + |du| |v| + g_d (|u'| |v'| + |u| |v|) + c_2 |s_b| + a`` with
``|u'| <= |u| + |du|`` and ``a`` an absolute term for subnormals: bf16 units flush subnormal inputs and outputs
to zero (DAZ/FTZ), so each input may lose up to 2^-126 and each of the ~2d operations up to 2^-126:
``a = 2.02 * 2^-126 (sqrt(d) (|u'| + |v'|) + 2 d + 1)`` for both paths together. The norms are computed in
float32 and scaled up by ``1 + g_(d+2)`` (a sum of squares, a square root, a conversion), and the sum is
multiplied by ``1 + 2^-20`` for the float64 arithmetic that evaluates it. Worst case (every input half an ulp
off) it is ``~3 u_b |u| |v|``. :func:`bf16_error_bound` evaluates it; the tests check it on worst-case rounding
data, where the observed error reaches over 60% of it, and on data where a bf16 *accumulator* would break it.

Rows are certified only when their inputs are finite and far from overflow (``|u| <= 2^60``,
``|u| max|v| <= 2^100``); other rows, and every row of a catalog with a non-finite entry, take the fp32 path,
which reproduces the fp32 path's NaN/inf handling (``torch.topk`` ranks NaN first; non-finite values get
column -1, as ``bigrank.model.catalog.distributed_topk`` does).

Bit-identity with fp32 brute force needs the candidates' fp32 scores to be *the same bits* as the GEMM's.
MKL's sgemm does not give the same bits for every shape (measured here, torch 2.13 / MKL 2024.2: a product
with 1 or 2 user rows, or with fewer than 4 item columns, takes other kernels with another summation order),
so the fp32 scores are defined by :func:`exact_scores` (one GEMM with at least 16 rows and 16 columns, padding
with zeros) and rescored by :func:`rescore` (a batched GEMM of at least 2 rows x ``max(16, 400 // d + 1)``
candidates, below which ATen switches to its own loop). On an AMD EPYC (MKL 2024.2, 2026-11-26) that ``bmm`` differs
from the GEMM in the last bit, so there the candidates are rescored by :func:`exact_scores` itself, 16 rows at a time
against the union of their candidates. :func:`rescoring_is_exact` checks the kernels against the GEMM on random
data once per (d, threads), uses the first that agrees and turns certification off when none does, so an
unexpected BLAS gives the fp32 path's answer, never a wrong one.

Exclusions (a user's train items) are (row, column) pairs set to -inf before ranking, as the fp32 path does; a
row with fewer than K eligible items is padded with -inf / column -1. Users are processed in chunks of
``chunk_elements // n`` rows so that memory stays bounded.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from bigrank.distributed.collectives import all_gather_no_grad, group_size, is_distributed

__all__ = [
    "MAX_CANDIDATE_FRACTION",
    "TopKCatalog",
    "TopKStats",
    "VectorNorms",
    "bf16_error_bound",
    "exact_topk",
    "exact_scores",
    "merge_topk",
    "rescore",
    "rescoring_is_exact",
]

BF16_UNIT_ROUNDOFF = 2.0**-8
ACCUMULATION_ROUNDOFF = 2.0**-23  # fp32's 2^-24, doubled: also covers accumulators that truncate
SMALLEST_NORMAL = 2.0**-126  # flushed to zero below this by DAZ/FTZ units (bf16 shares fp32's exponent range)
BOUND_SAFETY = 1.0 + 2.0**-20  # covers the float64 rounding of the bound's own evaluation
NORM_LIMIT = 2.0**60  # |u| and max |v| of a certified row: far from overflow in bf16 and fp32
PRODUCT_LIMIT = 2.0**100  # |u| * max |v| of a certified row
MAX_CANDIDATE_FRACTION = 0.05  # a row with more candidates than this share of the catalog is ranked in fp32
# bf16 pays when the GEMM time it saves (~n per row) exceeds the work on >= k candidates per row: measured here
# (d = 64, one thread, 2026-11-25) the break-even is near k = n / 300 (n / k = 214: 0.9x of fp32, 428: 1.1x,
# 4,280: 1.7x), so the bf16 pass is tried only from this many items per k.
MIN_ITEMS_PER_K = 300
CHUNK_ELEMENTS = 1 << 25  # fp32 scores of one chunk of users (128 MiB); the bf16 pass takes twice the rows
CANONICAL_MIN = 16  # exact_scores pads users and items to at least this many rows (one GEMM kernel for all)
_NO_COLUMN = 2**32 - 1  # padding column: ranks after every real column (catalogs have < 2^32 - 1 items)


# ---------------------------------------------------------------------------------------------------- the catalog
@dataclass(frozen=True)
class VectorNorms:
    """``norms`` |x|_2 and ``errors`` |bf16(x) - x|_2 of each row (float64[rows], rounded up)."""

    norms: torch.Tensor
    errors: torch.Tensor

    @classmethod
    def of(cls, vectors: torch.Tensor, rounded: torch.Tensor | None = None, block: int = 1 << 16) -> VectorNorms:
        """Norms of float32 ``vectors`` [rows, d]; ``rounded``: their bf16 copy when already made. Computed
        ``block`` rows at a time (no catalog-sized temporaries); a non-finite entry gives a non-finite norm."""
        rounded = vectors.to(torch.bfloat16) if rounded is None else rounded
        norms, errors = [], []
        for first in range(0, vectors.shape[0], block):
            part = vectors[first : first + block]
            error = rounded[first : first + block].float() - part  # exact: Sterbenz (within a factor 2)
            norms.append(_norms(part))
            errors.append(_norms(error))
        empty = vectors.new_empty(0, dtype=torch.float64)
        return cls(torch.cat(norms) if norms else empty, torch.cat(errors) if errors else empty)


class Workspace:
    """Buffers reused from chunk to chunk and call to call: a fresh tensor of tens of MB costs its page faults
    on first touch (measured here: ~40% of a bf16 GEMM's time, 3x an index_select's), since the CPU allocator
    hands large blocks back to the OS. One per catalog; not for concurrent calls (callers serialise them)."""

    def __init__(self):
        self._buffers: dict[str, torch.Tensor] = {}

    def get(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device) -> torch.Tensor:
        """A tensor of ``shape`` (uninitialised) backed by the buffer ``name``, grown when too small."""
        size = math.prod(shape)
        buffer = self._buffers.get(name)
        if buffer is None or buffer.numel() < size or buffer.dtype != dtype or buffer.device != torch.device(device):
            buffer = torch.empty(size, dtype=dtype, device=device)
            self._buffers[name] = buffer
        return buffer[:size].view(shape)


@dataclass(frozen=True)
class TopKCatalog:
    """A catalog (shard) prepared for :func:`exact_topk`: build it once per set of item vectors and reuse it.

    ``items`` float32[n, d] (the caller's tensor, not copied); ``items_bf16`` its bf16 copy and ``norms`` its
    :class:`VectorNorms` (None when not certifiable); ``max_norm`` / ``max_error`` the largest of them;
    ``certifiable``: every entry finite and ``max_norm <= 2^60`` (else every row takes the fp32 path);
    ``workspace``: the score and gather buffers of :func:`exact_topk` (at most ``chunk_elements`` fp32 scores, or
    twice as many bf16 ones: the same bytes).
    """

    items: torch.Tensor
    items_bf16: torch.Tensor | None
    norms: VectorNorms | None
    max_norm: float
    max_error: float
    certifiable: bool
    workspace: Workspace = field(default_factory=Workspace, compare=False, repr=False)

    @classmethod
    def build(cls, items: torch.Tensor, *, certified: bool = True) -> TopKCatalog:
        """Prepare ``items`` float32[n, d] (another float dtype: ranked in that dtype, never certified); with
        ``certified=False`` no bf16 copy is made (fp32 path only)."""
        if items.dim() != 2:
            raise ValueError(f"items must have shape [n, d], got {tuple(items.shape)}")
        items = items.detach()
        if not items.dtype.is_floating_point:
            raise ValueError(f"items must be floating point, got {items.dtype}")
        # Only float32 catalogs are certified (other dtypes, e.g. float64 in tests, are ranked as they are).
        certified = certified and items.dtype == torch.float32
        if not certified or items.shape[0] == 0:
            return cls(items, None, None, 0.0, 0.0, False)
        items_bf16 = items.to(torch.bfloat16)
        norms = VectorNorms.of(items, items_bf16)
        max_norm, max_error = float(norms.norms.max()), float(norms.errors.max())
        if not (max_norm <= NORM_LIMIT and math.isfinite(max_error)):  # NaN / inf entries: non-finite norms
            return cls(items, None, None, max_norm, max_error, False)
        return cls(items, items_bf16, norms, max_norm, max_error, True)

    @property
    def num_items(self) -> int:
        return int(self.items.shape[0])

    @property
    def dim(self) -> int:
        return int(self.items.shape[1])


def _norms(vectors: torch.Tensor) -> torch.Tensor:
    """Euclidean norms float64[rows] of float32 ``vectors`` [rows, d], rounded up so they bound the true norms:
    computed in float32 (a sum of d squares in any order is within ``g_d`` of the exact sum, Higham (3.5); the
    square root and the conversion add a rounding each), then scaled by ``1 + g_(d+2)`` and the float64 safety."""
    dim = vectors.shape[1]
    gamma = (dim + 2) * 2.0**-24 / (1 - (dim + 2) * 2.0**-24)
    return torch.linalg.vector_norm(vectors, dim=1).double() * ((1 + gamma) * BOUND_SAFETY)


# -------------------------------------------------------------------------------------------------- the bound
def _output_coefficient() -> float:
    return BF16_UNIT_ROUNDOFF / (1 - BF16_UNIT_ROUNDOFF)


def _score_independent_bound(user_norms, user_errors, item_norms, item_errors, dim: int):
    """The terms of the bound that do not depend on the score (all but ``c_2 |s_b|``), float64, broadcast."""
    gamma = dim * ACCUMULATION_ROUNDOFF / (1.0 - dim * ACCUMULATION_ROUNDOFF)
    user_bf16, item_bf16 = user_norms + user_errors, item_norms + item_errors  # |u'| <= |u| + |du|
    inputs = user_bf16 * item_errors + user_errors * item_norms
    accumulation = gamma * (user_bf16 * item_bf16 + user_norms * item_norms)
    absolute = 2.02 * SMALLEST_NORMAL * (math.sqrt(dim) * (user_bf16 + item_bf16) + 2 * dim + 1)
    return (inputs + accumulation + absolute) * BOUND_SAFETY


def bf16_error_bound(users: torch.Tensor, items: torch.Tensor, bf16_scores: torch.Tensor) -> torch.Tensor:
    """The bound ``e`` float64[B, n] on ``|s_bf16 - s_fp32|`` of each score of ``users`` float32[B, d] and
    ``items`` float32[n, d], given the bf16 GEMM's scores ``bf16_scores`` [B, n] (see the module text)."""
    user, item = VectorNorms.of(users), VectorNorms.of(items)
    fixed = _score_independent_bound(
        user.norms.unsqueeze(1), user.errors.unsqueeze(1), item.norms, item.errors, users.shape[1]
    )
    return fixed + _output_coefficient() * bf16_scores.double().abs() * BOUND_SAFETY


def _stage_one_threshold(group_kth: torch.Tensor, fixed: torch.Tensor) -> torch.Tensor:
    """The smallest bf16 score whose upper bound reaches the lower bound of ``group_kth`` (float64[r]).

    With ``e_j <= A + c_2 |s_j|`` for every item (A = ``fixed``, the bound with the largest item norms), the
    lower bound ``x - A - c_2 |x|`` and the upper bound ``x + A + c_2 |x|`` are increasing in x. ``group_kth``
    is <= the k-th largest bf16 score t, so k items have fp32 scores >= lower(group_kth), and an item of the
    fp32 top k has upper(s_b) >= that: s_b >= upper^-1(lower(group_kth)), solved here piecewise in the sign.
    """
    c2 = _output_coefficient() * BOUND_SAFETY
    target = group_kth - fixed - c2 * group_kth.abs() - fixed
    return torch.where(target >= 0, target / (1 + c2), target / (1 - c2))


# ----------------------------------------------------------------------------------------- fp32 scores, canonical
def exact_scores(users: torch.Tensor, items: torch.Tensor, workspace: Workspace | None = None) -> torch.Tensor:
    """The fp32 scores ``users @ items.T`` [B, n] (in the items' dtype) computed as one GEMM of at least 16 x 16.

    The fp32 path of this module and the rescoring of candidates both give these bits: BLAS takes other kernels
    (another summation order, a different last bit) for a product with one or two rows or a few columns, so
    smaller operands are padded with zero rows. ``workspace``: write the scores into its buffer (the result is
    a view of it, valid until the next use of the workspace).
    """
    batch, num_items = users.shape[0], items.shape[0]
    if batch < CANONICAL_MIN:
        users = torch.cat([users, users.new_zeros(CANONICAL_MIN - batch, users.shape[1])])
    if num_items < CANONICAL_MIN:
        items = torch.cat([items, items.new_zeros(CANONICAL_MIN - num_items, items.shape[1])])
    if workspace is None:
        return (users @ items.T)[:batch, :num_items]
    out = workspace.get("exact", (users.shape[0], items.shape[0]), users.dtype, users.device)
    return torch.matmul(users, items.T, out=out)[:batch, :num_items]


def _min_candidates(dim: int) -> int:
    # ATen's bmm runs its own loop (another summation order) when d * m * 1 < 400: keep m above that.
    return max(CANONICAL_MIN, 400 // max(dim, 1) + 1)


def rescore(
    users: torch.Tensor, items: torch.Tensor, columns: torch.Tensor, workspace: Workspace | None = None
) -> torch.Tensor:
    """fp32 scores ``<users[b], items[columns[b, j]]>`` float32[r, m], bit-identical to :func:`exact_scores`.

    By the kernel :func:`rescoring_is_exact` found exact on this machine for vectors of this dimension: one batched
    GEMM (``bmm``, :func:`_rescore_bmm`), or where that takes other bits, the GEMM of :func:`exact_scores` itself
    on groups of rows (:func:`_rescore_gemm`).
    """
    if _rescoring_kernel(int(users.shape[1]), torch.get_num_threads()) == "gemm":
        return _rescore_gemm(users, items, columns, workspace)
    return _rescore_bmm(users, items, columns, workspace)


def _rescore_bmm(
    users: torch.Tensor, items: torch.Tensor, columns: torch.Tensor, workspace: Workspace | None = None
) -> torch.Tensor:
    """:func:`rescore` as one batched GEMM (``bmm`` of the gathered rows [r, m, d] with the users [r, d, 1]), padded
    to at least 2 rows and :func:`_min_candidates` columns: a single-row batch or a short one takes other kernels.
    """
    rows, width = columns.shape
    if rows == 0 or width == 0:
        return users.new_zeros((rows, width))
    if rows < 2:
        users, columns = torch.cat([users, users]), torch.cat([columns, columns])
    minimum = _min_candidates(users.shape[1])
    if width < minimum:
        columns = torch.cat([columns, columns.new_zeros(columns.shape[0], minimum - width)], dim=1)
    flat = columns.reshape(-1)
    if workspace is None:
        gathered = items.index_select(0, flat)
    else:
        gathered = torch.index_select(
            items, 0, flat, out=workspace.get("gather", (flat.numel(), items.shape[1]), items.dtype, items.device)
        )
    gathered = gathered.view(columns.shape[0], columns.shape[1], -1)
    return torch.bmm(gathered, users.unsqueeze(2)).squeeze(2)[:rows, :width]


def _rescore_gemm(
    users: torch.Tensor, items: torch.Tensor, columns: torch.Tensor, workspace: Workspace | None = None
) -> torch.Tensor:
    """:func:`rescore` by :func:`exact_scores` itself: ``CANONICAL_MIN`` rows at a time against the union of their
    candidates, then each row's own columns picked out. For a BLAS whose ``bmm`` takes other bits than its GEMM
    (MKL on an AMD EPYC here: the last bit differs); it computes ~``CANONICAL_MIN`` times the products of
    ``bmm``, at the GEMM's rate."""
    rows, width = columns.shape
    out = users.new_zeros((rows, width))
    if rows == 0 or width == 0:
        return out
    for first in range(0, rows, CANONICAL_MIN):
        last = min(first + CANONICAL_MIN, rows)
        union, inverse = torch.unique(columns[first:last], return_inverse=True)
        if workspace is None:
            gathered = items.index_select(0, union)
        else:
            shape = (union.numel(), items.shape[1])
            gathered = torch.index_select(
                items, 0, union, out=workspace.get("gather", shape, items.dtype, items.device)
            )
        out[first:last] = exact_scores(users[first:last], gathered).gather(1, inverse)
    return out


def _probe(kernel, dim: int) -> bool:
    """Whether ``kernel`` (a rescoring function) and :func:`exact_scores` give the same bits on random data."""
    generator = torch.Generator().manual_seed(dim)
    users = torch.randn(40, dim, generator=generator)
    items = torch.randn(300, dim, generator=generator)
    reference = exact_scores(users, items)
    workspace = Workspace()
    same = torch.equal(exact_scores(users, items, workspace), reference)
    same &= torch.equal(exact_scores(users[:1], items), reference[:1])
    same &= torch.equal(exact_scores(users[2:5], items[7:12]), reference[2:5, 7:12])
    same &= torch.equal(exact_scores(users[3:5], items[100:101]), reference[3:5, 100:101])
    for rows in (1, 2, 3, 17, 40):
        for width in (1, _min_candidates(dim) - 1, 37, 250):
            columns = torch.randint(0, 300, (rows, width), generator=generator)
            want = reference[:rows].gather(1, columns)
            same &= torch.equal(kernel(users[:rows], items, columns), want)
            same &= torch.equal(kernel(users[:rows], items, columns, workspace), want)
    return bool(same)


@functools.lru_cache(maxsize=32)
def _rescoring_kernel(dim: int, threads: int) -> str | None:
    """``"bmm"`` or ``"gemm"``: the first rescoring kernel that gives :func:`exact_scores`'s bits here (None:
    neither; certification is then off)."""
    for name, kernel in (("bmm", _rescore_bmm), ("gemm", _rescore_gemm)):
        if _probe(kernel, dim):
            return name
    return None


def rescoring_is_exact(dim: int) -> bool:
    """True when :func:`rescore` reproduces :func:`exact_scores` bit for bit on this machine's BLAS for vectors of
    dimension ``dim`` (checked on random data once per (d, thread count)); certification needs it."""
    return _rescoring_kernel(int(dim), torch.get_num_threads()) is not None


# ------------------------------------------------------------------------------------------------- statistics
@dataclass
class TopKStats:
    """What :func:`exact_topk` did, summed over calls.

    ``rows``: users ranked. ``bf16_rows``: rows scored in bf16; of those ``fallback_rows`` had too many
    candidates and were ranked in fp32 again. ``fp32_rows``: rows ranked by the fp32 path (certification off or
    unavailable, non-finite or huge inputs, fallbacks). ``rescored``: candidates rescored in fp32 in the
    certified rows, out of ``certified_scores`` = certified rows x items.
    """

    rows: int = 0
    bf16_rows: int = 0
    fallback_rows: int = 0
    fp32_rows: int = 0
    rescored: int = 0
    certified_scores: int = 0

    @property
    def candidate_fraction(self) -> float:
        """Share of the certified rows' scores recomputed in fp32 (NaN when no row was certified)."""
        return self.rescored / self.certified_scores if self.certified_scores else float("nan")

    @property
    def fallback_rate(self) -> float:
        """Share of the bf16-scored rows that fell back to fp32 (NaN when none was scored in bf16)."""
        return self.fallback_rows / self.bf16_rows if self.bf16_rows else float("nan")


# ----------------------------------------------------------------------------------------------------- top-K
@torch.no_grad()
def exact_topk(
    users: torch.Tensor,
    catalog: TopKCatalog,
    k: int,
    *,
    exclude: tuple[torch.Tensor, torch.Tensor] | torch.Tensor | None = None,
    certified: bool = True,
    max_candidate_fraction: float = MAX_CANDIDATE_FRACTION,
    min_items_per_k: int = MIN_ITEMS_PER_K,
    chunk_elements: int = CHUNK_ELEMENTS,
    stats: TopKStats | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The fp32 top-``k`` of ``users @ catalog.items.T`` (as :func:`exact_scores` computes it), per row.

    Args:
        users: float32[B, d] user vectors.
        catalog: the items, prepared once (:meth:`TopKCatalog.build`).
        k: items per row; the result has ``min(k, n)`` columns.
        exclude: items never returned: ``(rows int64[E], columns int64[E])`` pairs or a bool[B, n] mask; their
            score is -inf, as in the fp32 path.
        certified: score in bf16 and rescore the certified candidates (when the catalog is certifiable, the
            device is a CPU and :func:`rescoring_is_exact`); False: fp32 only. The answer is the same.
        max_candidate_fraction: a row with more candidates than this share of n is ranked in fp32.
        min_items_per_k: the bf16 pass is tried only when ``n >= min_items_per_k * k`` (below it the fp32 path
            is as fast: see ``MIN_ITEMS_PER_K``); the answer does not depend on it.
        chunk_elements: users are ranked ``max(1, chunk_elements // n)`` at a time in fp32, and twice as many
            in the bf16 pass (the same bytes of scores; per chunk work is amortised over more rows: ~10 % less
            time at n = 849K, k = 1,000, measured on this machine).
        stats: a :class:`TopKStats` to add this call's figures to.

    Returns ``(values float32[B, min(k, n)], columns int64[B, min(k, n)])``: best first, ties by the lower
    column; columns of non-finite values (-inf for excluded or missing items, NaN, +inf) are -1.
    """
    if users.dim() != 2 or users.shape[1] != catalog.dim:
        raise ValueError(f"users must have shape [B, {catalog.dim}], got {tuple(users.shape)}")
    if int(k) < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    users = users.detach().to(device=catalog.items.device, dtype=catalog.items.dtype)
    batch, num_items = users.shape[0], catalog.num_items
    k = min(int(k), num_items)
    values = users.new_full((batch, k), float("-inf"))
    columns = torch.full((batch, k), -1, dtype=torch.int64, device=users.device)
    stats = stats if stats is not None else TopKStats()
    stats.rows += batch
    if batch == 0 or k == 0:
        return values, columns
    pairs = _exclusion_pairs(exclude, batch, num_items, users.device)
    use_bf16 = (
        certified
        and catalog.certifiable
        and users.device.type == "cpu"
        and k <= max_candidate_fraction * num_items
        and k * min_items_per_k <= num_items
        and rescoring_is_exact(catalog.dim)
    )
    max_candidates = max(k, int(max_candidate_fraction * num_items))
    fp32_step = max(1, int(chunk_elements) // max(num_items, 1))
    step = 2 * fp32_step if use_bf16 else fp32_step
    for first in range(0, batch, step):
        last = min(first + step, batch)
        chunk_pairs = _chunk_pairs(pairs, first, last)
        if use_bf16:
            top = _certified_chunk(users[first:last], catalog, k, chunk_pairs, max_candidates, stats, fp32_step)
        else:
            top = _fp32_chunk(users[first:last], catalog.items, k, chunk_pairs, catalog.workspace)
            stats.fp32_rows += last - first
        values[first:last], columns[first:last] = top
    return values, columns


def _exclusion_pairs(exclude, batch: int, num_items: int, device) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``exclude`` as (rows, columns) sorted by row, or None."""
    if exclude is None:
        return None
    if isinstance(exclude, torch.Tensor):
        if exclude.shape != (batch, num_items) or exclude.dtype != torch.bool:
            got = f"{exclude.dtype}{list(exclude.shape)}"
            raise ValueError(f"an exclude mask must be bool[{batch}, {num_items}], got {got}")
        rows, cols = exclude.nonzero(as_tuple=True)
    else:
        rows, cols = (torch.as_tensor(x, dtype=torch.int64) for x in exclude)
        if rows.shape != cols.shape or rows.dim() != 1:
            raise ValueError("exclude pairs must be two int64 vectors of the same length")
        if rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= batch):
            raise ValueError(f"exclude rows must lie in [0, {batch})")
        if cols.numel() and (int(cols.min()) < 0 or int(cols.max()) >= num_items):
            raise ValueError(f"exclude columns must lie in [0, {num_items})")
        order = torch.argsort(rows, stable=True)
        rows, cols = rows[order], cols[order]
    return rows.to(device), cols.to(device)


def _chunk_pairs(pairs, first: int, last: int):
    if pairs is None:
        return None
    rows, cols = pairs
    lo, hi = torch.searchsorted(rows, torch.tensor([first, last], device=rows.device)).tolist()
    return rows[lo:hi] - first, cols[lo:hi]


def _fp32_chunk(users, items, k: int, pairs, workspace: Workspace) -> tuple[torch.Tensor, torch.Tensor]:
    """The fp32 path on a chunk of users: :func:`exact_scores`, exclusions, the exact candidates, their top k."""
    scores = exact_scores(users, items, workspace)
    if pairs is not None and pairs[0].numel():
        scores[pairs] = float("-inf")
    columns, values, _ = _select(scores, k)
    return _lexicographic_topk(values, columns, k)


def _certified_chunk(users, catalog: TopKCatalog, k: int, pairs, max_candidates: int, stats, fp32_step: int):
    """bf16 scores, bounds, candidates, fp32 rescoring; rows that cannot be certified go to :func:`_fp32_chunk`,
    ``fp32_step`` at a time (the fp32 chunk's rows: its scores take twice the bytes of bf16 ones)."""
    batch = users.shape[0]
    values = users.new_full((batch, k), float("-inf"))
    columns = torch.full((batch, k), -1, dtype=torch.int64, device=users.device)
    users_bf16 = users.to(torch.bfloat16)
    norms = VectorNorms.of(users, users_bf16)
    ok = (
        torch.isfinite(users).all(dim=1)
        & (norms.norms <= NORM_LIMIT)
        & (norms.norms * catalog.max_norm <= PRODUCT_LIMIT)
    )
    rows = ok.nonzero().squeeze(1)
    fp32_rows = (~ok).nonzero().squeeze(1)
    if rows.numel():
        stats.bf16_rows += rows.numel()
        if rows.numel() < batch:
            users_bf16, norms = users_bf16[rows], VectorNorms(norms.norms[rows], norms.errors[rows])
        row_pairs = _select_pairs(pairs, rows, batch)
        top, fallback = _certified_rows(users[rows], users_bf16, norms, catalog, k, row_pairs, max_candidates, stats)
        certified = rows[~fallback]
        values[certified], columns[certified] = top
        stats.fallback_rows += int(fallback.sum())
        stats.certified_scores += certified.numel() * catalog.num_items
        fp32_rows = torch.cat([fp32_rows, rows[fallback]]).sort().values
    for first in range(0, fp32_rows.numel(), fp32_step):
        rows_here = fp32_rows[first : first + fp32_step]
        stats.fp32_rows += rows_here.numel()
        fp32_pairs = _select_pairs(pairs, rows_here, batch)
        top = _fp32_chunk(users[rows_here], catalog.items, k, fp32_pairs, catalog.workspace)
        values[rows_here], columns[rows_here] = top
    return values, columns


def _select_pairs(pairs, rows: torch.Tensor, batch: int):
    """The exclusion pairs of ``rows`` (sorted row indices of the chunk), renumbered 0..len(rows)-1."""
    if pairs is None or not pairs[0].numel():
        return None
    if rows.numel() == batch:
        return pairs
    position = torch.full((batch,), -1, dtype=torch.int64, device=rows.device)
    position[rows] = torch.arange(rows.numel(), device=rows.device)
    new_rows = position[pairs[0]]
    keep = new_rows >= 0
    return new_rows[keep], pairs[1][keep]


def _certified_rows(users, users_bf16, norms: VectorNorms, catalog: TopKCatalog, k: int, pairs, max_candidates, stats):
    """Certified top k of rows with finite, bounded inputs. Returns ``((values, columns) of the rows kept,
    fallback bool[rows])``: rows with more than ``max_candidates`` candidates are left to the fp32 path."""
    dim = catalog.dim
    out = catalog.workspace.get("bf16", (users_bf16.shape[0], catalog.num_items), torch.bfloat16, users.device)
    scores = torch.matmul(users_bf16, catalog.items_bf16.T, out=out)  # oneDNN: fp32 accumulation, bf16 output
    if pairs is not None:
        scores[pairs] = float("-inf")
    # Stage 1: one bound for the whole row (the largest item norms): every item of the fp32 top k has a bf16
    # score >= _stage_one_threshold(k-th largest group maximum).
    fixed = _score_independent_bound(norms.norms, norms.errors, catalog.max_norm, catalog.max_error, dim)
    cols, bvals, counts = _select(scores, k, lambda group_kth: _stage_one_threshold(group_kth, fixed))
    del scores
    # Stage 2: each candidate's own bound; L = the k-th largest lower bound among the candidates (<= the k-th
    # largest over all items): an item whose upper bound is below L is beaten by k items.
    bvals = bvals.double()
    valid = torch.arange(cols.shape[1], device=cols.device) < counts.unsqueeze(1)
    excluded = torch.isneginf(bvals)  # finite inputs: -inf only where excluded (or padding)
    safe_cols = cols.masked_fill(~valid, 0)
    bound = _score_independent_bound(
        norms.norms.unsqueeze(1),
        norms.errors.unsqueeze(1),
        catalog.norms.norms[safe_cols],
        catalog.norms.errors[safe_cols],
        dim,
    )
    bound += _output_coefficient() * BOUND_SAFETY * bvals.masked_fill(excluded, 0).abs()
    lower = (bvals - bound).masked_fill(excluded | ~valid, float("-inf"))
    upper = (bvals + bound).masked_fill(excluded, float("-inf"))
    threshold = lower.kthvalue(lower.shape[1] - k + 1, dim=1, keepdim=True).values  # the k-th largest
    keep = valid & (upper >= threshold)
    fallback = keep.sum(dim=1) > max_candidates
    keep &= ~fallback.unsqueeze(1)
    row, slot = keep.nonzero(as_tuple=True)  # grouped by row
    stats.rescored += row.numel()
    good = (~fallback).nonzero().squeeze(1)
    if good.numel() == 0:
        return (users.new_empty((0, k)), torch.empty((0, k), dtype=torch.int64, device=users.device)), fallback
    position = torch.full_like(fallback, -1, dtype=torch.int64)
    position[good] = torch.arange(good.numel(), device=good.device)
    packed_cols, packed_excluded, _ = _pack([(position[row], cols[row, slot], excluded[row, slot])], good.numel())
    padding = packed_cols == _NO_COLUMN
    fp32 = rescore(users[good], catalog.items, packed_cols.masked_fill(padding, 0), catalog.workspace)
    fp32 = fp32.masked_fill(packed_excluded | padding, float("-inf"))
    return _lexicographic_topk(fp32, packed_cols, k), fallback


def _select(scores: torch.Tensor, k: int, threshold_of=None):
    """Per row, every column whose score is >= ``threshold_of(g)``, g a lower bound of the k-th largest score.

    The first G * s columns are split into G strided groups of s members (column j in group j mod G,
    s ~ sqrt(n / k)); the k-th largest group maximum g is reached by k distinct entries, so it is <= the k-th
    largest score (``threshold_of`` None: the threshold is g itself, which keeps every entry >= the k-th
    largest). Only the groups whose maximum reaches the threshold are read again, and the last n mod G columns
    are compared directly, so the row is read in full once (for the maxima). Rows with NaN keep every column
    (``torch.topk`` ranks NaN first). Returns ``(columns, values, counts)``: [r, m] padded with ``_NO_COLUMN`` /
    -inf, and the number of candidates of each row.
    """
    rows, width = scores.shape
    members = int(math.sqrt(width / k))
    if members < 2:  # k is a large share of the row: every column is a candidate
        columns = torch.arange(width, device=scores.device).expand(rows, width)
        return columns, scores, torch.full((rows,), width, dtype=torch.int64, device=scores.device)
    groups = width // members
    grouped = scores.as_strided((rows, members, groups), (scores.stride(0), groups, 1))
    maxima = _group_maxima(grouped)
    threshold = _kth_largest(maxima, k).double()
    if threshold_of is not None:
        threshold = threshold_of(threshold)
    has_nan = False  # bf16 scores come from finite inputs (certified rows only)
    if scores.dtype != torch.bfloat16:
        nan_rows = torch.isnan(maxima).any(dim=1)
        has_nan = bool(nan_rows.any())
        if has_nan:
            threshold = threshold.masked_fill(nan_rows, float("-inf"))
    # Compare in the scores' dtype (no promoted copies) against the threshold rounded down: never too tight.
    limit = threshold.to(scores.dtype)
    limit = torch.where(limit.double() > threshold, torch.nextafter(limit, limit.new_tensor(float("-inf"))), limit)
    limit = limit.unsqueeze(1)
    chosen = maxima >= limit
    if scores.dtype == torch.bfloat16 and bool((limit <= 0).any()):  # _group_maxima: < 0 may stand for more
        chosen |= (limit <= 0) & (maxima < 0)
    if has_nan:
        chosen |= torch.isnan(maxima)
    group_row, group = chosen.nonzero(as_tuple=True)  # grouped by row
    member_values = grouped[group_row, :, group]  # [P, s]: the members of each chosen group
    hit = member_values >= limit[group_row]
    if has_nan:
        hit |= torch.isnan(member_values)
    pair, member = hit.nonzero(as_tuple=True)  # still grouped by row
    parts = [(group_row[pair], group[pair] + groups * member, member_values[pair, member])]
    tail = scores[:, members * groups :]
    if tail.shape[1]:
        hit = tail >= limit
        if has_nan:
            hit |= torch.isnan(tail)
        tail_row, tail_column = hit.nonzero(as_tuple=True)
        parts.append((tail_row, tail_column + members * groups, tail[tail_row, tail_column]))
    return _pack(parts, rows)


def _kth_largest(maxima: torch.Tensor, k: int, sample_step: int = 8) -> torch.Tensor:
    """The k-th largest entry of each row of ``maxima`` [r, G] (NaN counted largest), without a top k over all
    G: a guess v (the ``1.25 k / sample_step``-th largest of every ``sample_step``-th entry) with at least k
    entries >= v, checked by counting, then the k-th largest of those entries; rows whose guess falls short
    (small k, NaN) take ``topk`` over the whole row."""
    sample = maxima[:, ::sample_step]
    width = min(sample.shape[1], math.ceil(1.25 * k / sample_step) + 2)
    guess = sample.topk(width, dim=1, sorted=False).values.amin(dim=1, keepdim=True)
    above = maxima >= guess  # NaN guesses and NaN entries: never above, so those rows fall short
    row, column = above.nonzero(as_tuple=True)
    _, values, counts = _pack([(row, column, maxima[row, column])], maxima.shape[0])
    short = counts < k
    kth = values.topk(k, dim=1, sorted=False).values.amin(dim=1) if values.shape[1] >= k else values[:, 0]
    if bool(short.any()):
        kth[short] = maxima[short].topk(k, dim=1, sorted=False).values.amin(dim=1)
    return kth


def _group_maxima(grouped: torch.Tensor) -> torch.Tensor:
    """Maxima over dim 1 of ``grouped`` [r, s, G]: exact for float32 (NaN propagates); for (finite) bf16, the
    maximum of the bit patterns read as int16 (2.5x faster than a bf16 ``amax``), which is the true maximum
    when that is >= +0, and the group's minimum otherwise (negative bf16 numbers order backwards as int16). So
    it never exceeds the true maximum (the k-th largest of them is still <= the k-th largest score) and equals
    it whenever it could reach a positive threshold; :func:`_select` keeps every negative group when the
    threshold is <= 0."""
    if grouped.dtype != torch.bfloat16:
        return grouped.amax(dim=1)
    return grouped.view(torch.int16).amax(dim=1).view(torch.bfloat16)


def _pack(parts, num_rows: int):
    """Entries ``parts = [(rows, columns, values), ...]``, each part grouped by row, as padded per-row arrays
    ``(columns [r, m], values [r, m], counts [r])``: a row's entries of the first part first. Padding columns are
    ``_NO_COLUMN`` and padding values -inf (False for bool values)."""
    device = parts[0][0].device
    counts = torch.zeros(num_rows, dtype=torch.int64, device=device)
    slots = []
    for rows, _, _ in parts:
        part_counts = torch.bincount(rows, minlength=num_rows)
        first_of_row = torch.cumsum(part_counts, 0) - part_counts
        slots.append(counts[rows] + torch.arange(rows.numel(), device=device) - first_of_row[rows])
        counts = counts + part_counts
    width = int(counts.max()) if num_rows else 0
    dtype = parts[0][2].dtype
    packed_columns = torch.full((num_rows, width), _NO_COLUMN, dtype=torch.int64, device=device)
    packed_values = torch.full(
        (num_rows, width), False if dtype == torch.bool else float("-inf"), dtype=dtype, device=device
    )
    for (rows, columns, values), slot in zip(parts, slots, strict=True):
        packed_columns[rows, slot] = columns
        packed_values[rows, slot] = values
    return packed_columns, packed_values, counts


def _lexicographic_topk(values: torch.Tensor, columns: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first k entries of each row by (value descending, column ascending), NaN first as in ``torch.topk``;
    columns of non-finite values are -1.

    One ``topk`` over a unique int64 key: the float32 bits mapped to an order-preserving integer (-0 counted as
    +0, every NaN as the positive quiet NaN) in the high half, ``2^32 - 1 - column`` in the low half.
    """
    if values.dtype != torch.float32:  # other dtypes (float64 in tests): by column, then stably by value
        by_column = torch.argsort(columns, dim=1)
        values, columns = values.gather(1, by_column), columns.gather(1, by_column)
        order = torch.argsort(values, dim=1, descending=True, stable=True)[:, :k]
        top_values, top_columns = values.gather(1, order), columns.gather(1, order)
        return top_values, torch.where(torch.isfinite(top_values), top_columns, -1)
    canonical = torch.where(torch.isnan(values), float("nan"), values + 0.0)  # -0 + 0 = +0 (round to nearest)
    bits = canonical.view(torch.int32).long()
    ordered = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    key = (ordered << 32) | (_NO_COLUMN - columns)
    order = key.topk(k, dim=1).indices
    top_values, top_columns = values.gather(1, order), columns.gather(1, order)
    return top_values, torch.where(torch.isfinite(top_values), top_columns, -1)


# -------------------------------------------------------------------------------------------------- ranks
@torch.no_grad()
def merge_topk(
    values: torch.Tensor,
    columns: torch.Tensor,
    k: int,
    *,
    offset: int,
    num_local: int,
    group: dist.ProcessGroup | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Global top-``k`` of a catalog split over the ranks of ``group`` from each rank's exact local top-k.

    Args:
        values, columns: this rank's :func:`exact_topk` result ([B, min(k, num_local)], local columns, -1 for
            none) over its rows ``[offset, offset + num_local)``.
    Returns ``(values [B, min(k, N)], ids [B, min(k, N)])`` with global ids, replicated on every rank, sorted
    by (value descending, id ascending), ids of non-finite values -1 — the gather and sort of
    ``bigrank.model.catalog.distributed_topk``. Collective (``no_grad``: gloo fails in inference mode).
    """
    batch = values.shape[0]
    counts = (
        all_gather_no_grad(torch.tensor([num_local], device=values.device), group)
        if is_distributed(group)
        else torch.tensor([num_local])
    )
    k = min(int(k), int(counts.sum()))
    ids = torch.where(columns >= 0, columns + offset, -1)
    width = values.shape[1]
    if width < k:  # a shard smaller than k: pad to the common width of the gather
        values = torch.cat([values, values.new_full((batch, k - width), float("-inf"))], dim=1)
        ids = torch.cat([ids, ids.new_full((batch, k - width), -1)], dim=1)
    values, ids = values[:, :k], ids[:, :k]
    if is_distributed(group):
        world = group_size(group)
        values = all_gather_no_grad(values.contiguous(), group).view(world, batch, k)
        ids = all_gather_no_grad(ids.contiguous(), group).view(world, batch, k)
        values, ids = values.permute(1, 0, 2).reshape(batch, -1), ids.permute(1, 0, 2).reshape(batch, -1)
    # One top-k over (value, id) keys rather than two stable sorts (~2 s of an ML-1B evaluation of 10K users);
    # "no item" (-1) sorts after every id of an equal value.
    return _lexicographic_topk(values, torch.where(ids < 0, _NO_COLUMN, ids), k)
