"""Certified bf16 top-K (bigrank.model.topk) equals fp32 brute force bit for bit, on adversarial data.

The reference is fp32 brute force: the GEMM ``users @ items.T`` (for fewer than 16 users or items, the same
GEMM padded to 16, ``exact_scores``: MKL takes another kernel for 1-2 rows), excluded items set to -inf, and
the rows sorted by (score descending, column ascending), NaN first as ``torch.topk`` ranks it; columns of
non-finite values are -1. "Equal" means the same bits for the values and the same columns.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from bigrank.devices import cpu_bf16_gemm, use_certified_bf16
from bigrank.model import topk as topk_module
from bigrank.model.topk import (
    TopKCatalog,
    TopKStats,
    bf16_error_bound,
    exact_scores,
    merge_topk,
    rescore,
    rescoring_is_exact,
)
from tests.distributed_utils import run_distributed

# Whether exact_topk takes its bf16 pass here for 64-d vectors: wherever its fp32 rescoring is bit-exact on this
# BLAS (bf16 units only make the pass fast). Either way the answer is fp32's; each test asserts which path ran.
BF16_PASS = rescoring_is_exact(64)


def assert_fp32_path(stats: TopKStats, rows: int) -> None:
    """Every one of ``rows`` was ranked by the fp32 path: what a machine without the bf16 pass must do."""
    assert stats.bf16_rows == 0 and stats.fp32_rows == rows, stats


def exact_topk(*args, min_items_per_k=1, **kwargs):
    """``exact_topk`` trying the bf16 pass on catalogs of any size (by default only from 300 items per k, where
    it pays): the tests' catalogs are small."""
    return topk_module.exact_topk(*args, min_items_per_k=min_items_per_k, **kwargs)


def brute_force(users, items, k, exclude=None):
    """fp32 brute force top-k: (values [B, min(k, n)], columns), ties by the lower column, NaN first."""
    if users.shape[0] >= 16 and items.shape[0] >= 16:
        scores = users @ items.T
    else:
        scores = exact_scores(users, items)
    if exclude is not None:
        scores = scores.masked_fill(exclude, float("-inf"))
    order = torch.sort(scores, dim=1, descending=True, stable=True).indices[:, : min(k, items.shape[0])]
    values = scores.gather(1, order)
    return values, torch.where(torch.isfinite(values), order, -1)


def assert_same(got, want):
    (values, columns), (want_values, want_columns) = got, want
    assert values.shape == want_values.shape and values.dtype == want_values.dtype
    assert torch.equal(values.view(torch.int32), want_values.view(torch.int32)), "values differ in their bits"
    assert torch.equal(columns, want_columns), "columns differ"


def gaussian(shape, seed, scale=1.0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * scale


# --------------------------------------------------------------------------------------- the fp32 definition
def test_exact_scores_is_the_plain_gemm_from_16_rows_and_columns():
    users, items = gaussian((300, 64), 0), gaussian((5000, 64), 1)
    full = users @ items.T
    for batch, width in [(16, 16), (17, 5000), (300, 23), (64, 4096)]:
        assert torch.equal(exact_scores(users[:batch], items[:width]), full[:batch, :width])
    # Below 16 the padding keeps the kernel of the big product (a bare 1-row product may differ in the last bit).
    assert torch.equal(exact_scores(users[:1], items), full[:1])
    assert torch.equal(exact_scores(users[:3], items[:2]), full[:3, :2])


@pytest.mark.parametrize("dim", [8, 16, 33, 64, 128])
def test_rescoring_gives_the_bits_of_the_gemm(dim):
    assert rescoring_is_exact(dim)
    users, items = gaussian((70, dim), 2), gaussian((3000, dim), 3)
    full = exact_scores(users, items)
    generator = torch.Generator().manual_seed(4)
    for rows, width in [(1, 1), (1, 40), (2, 3), (70, 17), (70, 1200)]:
        columns = torch.randint(0, 3000, (rows, width), generator=generator)
        assert torch.equal(rescore(users[:rows], items, columns), full[:rows].gather(1, columns))


def test_a_bmm_with_other_bits_leaves_the_rescoring_to_the_gemm(monkeypatch):
    """Where ``bmm`` gives other bits than the GEMM (MKL on an AMD EPYC does), the candidates are rescored by
    the GEMM itself and the certified path still runs, with the fp32 answer."""

    bmm = topk_module._rescore_bmm

    def last_bit_off(*args, **kwargs):  # what such a BLAS does: the same products, another rounding
        scores = bmm(*args, **kwargs)
        return torch.nextafter(scores, torch.full_like(scores, float("inf")))

    monkeypatch.setattr(topk_module, "_rescore_bmm", last_bit_off)
    topk_module._rescoring_kernel.cache_clear()
    try:
        dim = 24
        assert topk_module._rescoring_kernel(dim, torch.get_num_threads()) == "gemm" and rescoring_is_exact(dim)
        users, items = gaussian((40, dim), 5), gaussian((3000, dim), 6)
        full = exact_scores(users, items)
        columns = torch.randint(0, 3000, (37, 900), generator=torch.Generator().manual_seed(7))
        assert torch.equal(rescore(users[:37], items, columns), full[:37].gather(1, columns))
        stats = TopKStats()
        got = exact_topk(users, TopKCatalog.build(items), 20, stats=stats)
        assert_same(got, brute_force(users, items, 20))
        if cpu_bf16_gemm():
            assert stats.bf16_rows == users.shape[0] and stats.rescored > 0
    finally:
        monkeypatch.undo()
        topk_module._rescoring_kernel.cache_clear()


# ------------------------------------------------------------------------------------------------ the bound
def worst_case_rounding(rows: int, dim: int, seed: int) -> torch.Tensor:
    """Positive entries 2^e (1 + 2^-8 - 2^-20): just below a bf16 rounding midpoint, so each loses ~2^-8 of
    itself when rounded, all in the same direction (the bound's leading term is reached)."""
    exponents = torch.randint(-2, 3, (rows, dim), generator=torch.Generator().manual_seed(seed))
    return (2.0**exponents) * (1 + 2.0**-8 - 2.0**-20)


def bf16_gemm(users, items):
    return users.to(torch.bfloat16) @ items.to(torch.bfloat16).T


@pytest.mark.parametrize(
    "case",
    ["worst_case_rounding", "gaussian_d16", "gaussian_d64", "gaussian_d1024", "cancelling", "norms_1e3_1e-3"],
)
def test_the_bf16_error_bound_holds(case):
    if case == "worst_case_rounding":
        users, items = worst_case_rounding(64, 64, 0), worst_case_rounding(512, 64, 1)
    elif case.startswith("gaussian"):
        dim = int(case.split("_d")[1])
        users, items = gaussian((64, dim), 2), gaussian((512, dim), 3)
    elif case == "cancelling":  # +x and -x pairs: the exact scores are ~0, every error is relative to the norms
        half = gaussian((64, 32), 4)
        users = torch.cat([half, half], dim=1)
        items = torch.cat([gaussian((512, 32), 5), -gaussian((512, 32), 5) * (1 + 2.0**-10)], dim=1)
    else:
        users, items = gaussian((64, 64), 6, 1e3), gaussian((512, 64), 7, 1e-3)
    scores = bf16_gemm(users, items)
    error = (scores.double() - exact_scores(users, items).double()).abs()
    bound = bf16_error_bound(users, items, scores)
    assert (error <= bound).all(), f"the bound fails: max error / bound = {float((error / bound).max()):.3f}"
    if case == "worst_case_rounding":
        # Near-tight on the data it is built for: the inputs' rounding (2 u_b of the 3 u_b) is reached.
        assert float((error / bound).max()) > 0.6


def test_the_bound_would_catch_a_bf16_accumulator():
    """Summing the bf16 products in bf16 (an accumulator the bound does not assume) breaks the bound on these
    data, while the real GEMM stays inside it: the check above can tell the two apart."""
    generator = torch.Generator().manual_seed(8)
    users = torch.rand((32, 64), generator=generator) + 0.5
    items = torch.rand((256, 64), generator=generator) + 0.5
    real = bf16_gemm(users, items)
    products = users.to(torch.bfloat16).float().unsqueeze(1) * items.to(torch.bfloat16).float().unsqueeze(0)
    accumulator = torch.zeros(32, 256)
    for i in range(64):  # each partial sum rounded to bf16
        accumulator = (accumulator + products[:, :, i]).to(torch.bfloat16).float()
    reference = exact_scores(users, items).double()
    bound = bf16_error_bound(users, items, real)
    assert ((real.double() - reference).abs() <= bound).all()
    assert ((accumulator.double() - reference).abs() > bound).any()


# ---------------------------------------------------------------------------------------- equality with fp32
def near_ties(seed: int):
    """A user and its near copies; 50 items clearly on top, then 300 items whose scores differ only in the last
    bits (one coordinate moved by an ulp) and some exactly equal, around the 100th place; random items below."""
    generator = torch.Generator().manual_seed(seed)
    user = torch.randn(64, generator=generator)
    direction = user / user.norm()
    items = torch.randn(20_000, 64, generator=generator) * 0.1
    top = torch.randperm(20_000, generator=generator)[:350]
    items[top[:50]] = 1.5 * direction + 0.01 * torch.randn(50, 64, generator=generator)
    cluster = direction.repeat(300, 1)
    coordinate = torch.randint(0, 64, (300,), generator=generator)
    steps = torch.randint(-3, 4, (300,), generator=generator)
    for row in range(300):
        for _ in range(abs(int(steps[row]))):
            value = cluster[row, coordinate[row]]
            cluster[row, coordinate[row]] = torch.nextafter(value, value + float(torch.sign(steps[row])))
    items[top[50:]] = cluster
    users = torch.cat([user.unsqueeze(0), user + 1e-7 * torch.randn(7, 64, generator=generator)])
    return torch.cat([users, torch.randn(24, 64, generator=generator)]), items, 100


def duplicates(seed: int):
    """Exact duplicate items (ties) straddling the k-th place of user 0, and duplicates elsewhere."""
    users, items = gaussian((32, 64), seed), gaussian((20_000, 64), seed + 1, 0.1)
    order = torch.sort(users[:1] @ items.T, dim=1, descending=True, stable=True).indices[0]
    generator = torch.Generator().manual_seed(seed)
    spare = order[1000 + torch.randperm(15_000, generator=generator)[:60]]
    for i, source in enumerate(order[45:55].tolist()):  # each of ranks 45..54 gets 3 copies
        items[spare[3 * i : 3 * i + 3]] = items[source].clone()
    items[spare[30:]] = items[order[:30]].clone()  # copies of the very top
    return users, items, 50


def negative(seed: int):
    """Every score negative (the top k are the least negative): items on +e_0, users on -e_0."""
    users, items = gaussian((24, 64), seed, 0.3), gaussian((20_000, 64), seed + 1, 0.3)
    users[:, 0] -= 5.0
    items[:, 0] = items[:, 0].abs() + 5.0
    return users, items, 100


CASES = {
    "gaussian_k1": lambda: (gaussian((40, 64), 10), gaussian((30_000, 64), 11, 0.1), 1),
    "gaussian_k10": lambda: (gaussian((40, 64), 12), gaussian((30_000, 64), 13, 0.1), 10),
    "gaussian_k1000": lambda: (gaussian((40, 64), 14), gaussian((30_000, 64), 15, 0.1), 1000),
    "gaussian_d16": lambda: (gaussian((40, 16), 16), gaussian((10_000, 16), 17), 20),
    "near_ties": lambda: near_ties(18),
    "duplicates": lambda: duplicates(19),
    "norms_1e3": lambda: (gaussian((30, 64), 20, 1e3), gaussian((10_000, 64), 21, 1e3), 30),
    "norms_1e-3": lambda: (gaussian((30, 64), 22, 1e-3), gaussian((10_000, 64), 23, 1e-3), 30),
    "norms_1e3_and_1e-3": lambda: (gaussian((30, 64), 24, 1e3), gaussian((10_000, 64), 25, 1e-3), 30),
    "norms_mixed_per_row": lambda: (
        gaussian((30, 64), 26) * torch.logspace(-3, 3, 30).unsqueeze(1),
        gaussian((10_000, 64), 27) * torch.logspace(-3, 3, 10_000).unsqueeze(1),
        30,
    ),
    "subnormal_scores": lambda: (gaussian((20, 64), 28, 1e-20), gaussian((5_000, 64), 29, 1e-20), 10),
    "negative_scores": lambda: negative(30),
    "k_larger_than_shard": lambda: (gaussian((20, 64), 31), gaussian((7, 64), 32), 20),
    "k_equals_catalog": lambda: (gaussian((20, 64), 33), gaussian((300, 64), 34), 300),
    "one_user": lambda: (gaussian((1, 64), 35), gaussian((10_000, 64), 36), 25),
    "no_users": lambda: (gaussian((0, 64), 37), gaussian((10_000, 64), 38), 25),
}


@pytest.mark.parametrize("certified", [True, False])
@pytest.mark.parametrize("case", sorted(CASES))
def test_equals_fp32_brute_force(case, certified):
    users, items, k = CASES[case]()
    stats = TopKStats()
    got = exact_topk(users, TopKCatalog.build(items), k, certified=certified, stats=stats)
    assert_same(got, brute_force(users, items, k))
    assert stats.rows == users.shape[0]
    if certified and case in ("gaussian_k10", "gaussian_k1000", "near_ties", "duplicates"):
        if BF16_PASS:
            assert stats.bf16_rows == users.shape[0] and stats.fallback_rows == 0, stats
            assert stats.candidate_fraction < 0.05
        else:
            assert_fp32_path(stats, users.shape[0])
    if not certified:
        assert stats.bf16_rows == 0


@pytest.mark.parametrize("certified", [True, False])
def test_exclusions_fully_excluded_rows_and_short_rows(certified):
    users, items = gaussian((30, 64), 40), gaussian((20_000, 64), 41, 0.1)
    exclude = torch.rand((30, 20_000), generator=torch.Generator().manual_seed(42)) < 0.3
    exclude[0] = True  # nothing left: -inf / -1 everywhere
    exclude[1] = True
    exclude[1, [5, 900, 19_999]] = False  # three items left for k = 40
    # The top items of user 2 excluded: its answer starts further down.
    exclude[2, torch.sort(users[2:3] @ items.T, descending=True).indices[0, :40]] = True
    stats = TopKStats()
    got = exact_topk(users, TopKCatalog.build(items), 40, exclude=exclude, certified=certified, stats=stats)
    want = brute_force(users, items, 40, exclude)
    assert_same(got, want)
    assert (got[1][0] == -1).all() and torch.isneginf(got[0][0]).all()
    assert sorted(got[1][1, :3].tolist()) == [5, 900, 19_999] and (got[1][1, 3:] == -1).all()
    # The same exclusions as (row, column) pairs, and in small chunks of users.
    pairs = exclude.nonzero(as_tuple=True)
    permutation = torch.randperm(pairs[0].numel(), generator=torch.Generator().manual_seed(43))
    pairs = (pairs[0][permutation], pairs[1][permutation])
    catalog = TopKCatalog.build(items)
    assert_same(exact_topk(users, catalog, 40, exclude=pairs, certified=certified, chunk_elements=50_000), want)


@pytest.mark.parametrize("certified", [True, False])
def test_nan_and_inf_as_the_fp32_path(certified):
    users, items = gaussian((20, 64), 50), gaussian((10_000, 64), 51, 0.1)
    users[3, 7] = float("nan")  # a NaN row: every score NaN
    users[4, 0] = float("inf")  # +-inf and NaN scores
    stats = TopKStats()
    got = exact_topk(users, TopKCatalog.build(items), 10, certified=certified, stats=stats)
    assert_same(got, brute_force(users, items, 10))
    assert torch.isnan(got[0][3]).all() and (got[1][3] == -1).all()
    if certified and BF16_PASS:
        assert stats.bf16_rows == 18 and stats.fp32_rows == 2  # only the two bad rows left the bf16 path
    else:
        assert_fp32_path(stats, 20)
    bad_items = items.clone()
    bad_items[[11, 500]] = float("nan")  # NaN items: ranked first, with column -1, in every row
    bad_items[77, 0] = float("-inf")
    catalog = TopKCatalog.build(bad_items)
    assert not catalog.certifiable
    exclude = torch.zeros((20, 10_000), dtype=torch.bool)
    exclude[0, 11] = True  # an excluded NaN item is -inf, as in the fp32 path
    got = exact_topk(users, catalog, 10, exclude=exclude, certified=certified)
    assert_same(got, brute_force(users, bad_items, 10, exclude))


def test_the_fp32_fallback_triggers_and_still_equals_fp32():
    users, items, k = near_ties(60)
    stats = TopKStats()
    # The near-tie rows have ~300 candidates for k = 100: over 1% of 20,000 items, so they fall back.
    got = exact_topk(users, TopKCatalog.build(items), k, max_candidate_fraction=0.01, stats=stats)
    assert_same(got, brute_force(users, items, k))
    if BF16_PASS:
        assert 8 <= stats.fallback_rows < stats.bf16_rows == users.shape[0]
        assert stats.fp32_rows == stats.fallback_rows
    else:
        assert_fp32_path(stats, users.shape[0])
    # Chunks of 6 users in bf16, 3 in fp32 (the same bytes): a chunk's fallback rows are ranked 3 at a time.
    stats = TopKStats()
    catalog = TopKCatalog.build(items)
    got = exact_topk(users, catalog, k, max_candidate_fraction=0.01, chunk_elements=3 * 20_000, stats=stats)
    assert_same(got, brute_force(users, items, k))
    if BF16_PASS:
        assert 8 <= stats.fallback_rows == stats.fp32_rows
    else:
        assert_fp32_path(stats, users.shape[0])
    # k above the fraction: every row goes straight to fp32, with the same answer.
    stats = TopKStats()
    got = exact_topk(users, TopKCatalog.build(items), 1500, stats=stats)
    assert_same(got, brute_force(users, items, 1500))
    assert stats.bf16_rows == 0 and stats.fp32_rows == users.shape[0]
    # By default the bf16 pass is tried from 300 items per k only (20,000 / 100 = 200 here): fp32, same answer.
    stats = TopKStats()
    assert_same(topk_module.exact_topk(users, TopKCatalog.build(items), k, stats=stats), brute_force(users, items, k))
    assert stats.bf16_rows == 0
    topk_module.exact_topk(users, TopKCatalog.build(items), 50, stats=stats)
    assert stats.bf16_rows == (users.shape[0] if BF16_PASS else 0)


def test_float64_catalogs_are_ranked_in_float64():
    users = gaussian((20, 8), 70).double()
    items = gaussian((500, 8), 71).double()
    items[100] = items[3]  # a tie
    values, columns = exact_topk(users, TopKCatalog.build(items), 30)
    scores = users @ items.T
    order = torch.sort(scores, dim=1, descending=True, stable=True).indices[:, :30]
    assert torch.equal(columns, order) and torch.equal(values, scores.gather(1, order))


def test_bad_arguments():
    catalog = TopKCatalog.build(gaussian((50, 8), 80))
    with pytest.raises(ValueError, match="shape"):
        exact_topk(gaussian((3, 9), 81), catalog, 5)
    with pytest.raises(ValueError, match="k must be"):
        exact_topk(gaussian((3, 8), 81), catalog, 0)
    with pytest.raises(ValueError, match="exclude rows"):
        exact_topk(gaussian((3, 8), 81), catalog, 5, exclude=(torch.tensor([3]), torch.tensor([0])))
    with pytest.raises(ValueError, match="exclude mask"):
        exact_topk(gaussian((3, 8), 81), catalog, 5, exclude=torch.zeros((3, 49), dtype=torch.bool))


# --------------------------------------------------------------------------------------------- over ranks
def _ranks_body(rank, world_size, group, users, items, exclude, bounds, k):
    start, stop = bounds[rank]
    stats = TopKStats()
    catalog = TopKCatalog.build(items[start:stop])
    values, columns = exact_topk(users, catalog, k, exclude=exclude[:, start:stop], stats=stats)
    merged = merge_topk(values, columns, k, offset=start, num_local=stop - start, group=group)
    return merged, stats, rescoring_is_exact(64)  # this process's BLAS threads decide the path, not the test's


@pytest.mark.parametrize("bounds", [[(0, 15_000), (15_000, 30_001)], [(0, 40), (40, 30_001)]])
def test_two_gloo_ranks_equal_one_rank(bounds):
    users, items, _ = near_ties(90)
    items = torch.cat([items, gaussian((10_001, 64), 91, 0.1)])
    exclude = torch.rand((users.shape[0], 30_001), generator=torch.Generator().manual_seed(92)) < 0.1
    k = 100  # rank 0 of the uneven split holds 40 items only
    outputs = run_distributed(_ranks_body, 2, args=(users, items, exclude, bounds, k))
    one_rank = exact_topk(users, TopKCatalog.build(items), k, exclude=exclude)
    one_rank = merge_topk(*one_rank, k, offset=0, num_local=items.shape[0])
    assert_same(one_rank, brute_force(users, items, k, exclude))
    for merged, _, _ in outputs:
        assert_same(merged, one_rank)
    _, stats, bf16_pass = outputs[1]  # rank 1 holds 15,001 or 29,961 items: enough for the bf16 pass at k = 100
    if bf16_pass:
        assert stats.bf16_rows == users.shape[0], stats
    else:
        assert_fp32_path(stats, users.shape[0])


def test_merge_pads_when_the_catalog_is_smaller_than_k():
    values, columns = exact_topk(gaussian((4, 8), 95), TopKCatalog.build(gaussian((6, 8), 96)), 10)
    merged_values, ids = merge_topk(values, columns, 10, offset=100, num_local=6)
    assert merged_values.shape == (4, 6) and ((ids >= 100) & (ids < 106)).all()
    empty = TopKCatalog.build(torch.empty((0, 8)))
    values, columns = exact_topk(gaussian((4, 8), 97), empty, 10)
    assert values.shape == (4, 0)
    assert merge_topk(values, columns, 10, offset=0, num_local=0)[0].shape == (4, 0)


# ---------------------------------------------------------------------------------------- in evaluation
@pytest.fixture(scope="module")
def wide_dataset(tmp_path_factory):
    """200 users x 64,000 items, 30 random ratings each (80/10/10): 32,000 items per rank, enough for the bf16
    pass at k = 100 (300 items per k, ``MIN_ITEMS_PER_K``)."""
    from bigrank.data.synthetic import SeedRatings, write_seed_dataset

    rng = np.random.default_rng(0)
    users = np.repeat(np.arange(200), 30).astype(np.int32)
    items = np.concatenate([rng.choice(64_000, 30, replace=False) for _ in range(200)]).astype(np.int32)
    root = tmp_path_factory.mktemp("wide")
    write_seed_dataset(SeedRatings(users, items, 200, 64_000), root, 0, "test:wide", {"preset": "wide"})
    return root


def _evaluate_body(rank, world_size, group, root, user_table, item_table):
    from bigrank.model.catalog import CatalogShard
    from bigrank.train.evaluate import evaluate_model, evaluation_users, ranked_batches

    shard = CatalogShard(item_table.shape[0], item_table.shape[1], group)
    with torch.no_grad():
        shard.weight.copy_(item_table[shard.start : shard.stop])

    def vectors(ids):
        return user_table[ids]

    users = evaluation_users(root, "valid")
    out = {}
    for certified in (True, False):
        stats = TopKStats()
        result = evaluate_model(vectors, shard, root, "valid", (10, 100), group=group, certified_bf16=certified)
        ranked = ranked_batches(vectors, shard, root, users, 100, group=group, certified_bf16=certified, stats=stats)
        out[certified] = (result, torch.cat([top for *_, top in ranked]), stats)
    # Evaluation takes the bf16 pass on CPUs with bf16 units only, where this process's BLAS rescores exactly.
    return out, use_certified_bf16(True) and rescoring_is_exact(item_table.shape[1])


def test_evaluation_is_the_same_with_and_without_certified_bf16(wide_dataset):
    user_table, item_table = gaussian((200, 32), 100), gaussian((64_000, 32), 101, 0.1)
    outputs = run_distributed(_evaluate_body, 2, args=(wide_dataset, user_table, item_table))
    for output, bf16_pass in outputs:
        assert output[True][0] == output[False][0] == outputs[0][0][True][0]
        assert torch.equal(output[True][1], output[False][1])
        assert_fp32_path(output[False][2], output[False][2].rows)
        if bf16_pass:
            assert output[True][2].bf16_rows == output[True][2].rows > 0
        else:
            assert_fp32_path(output[True][2], output[True][2].rows)


# ------------------------------------------------------------------------------------------ recommend, serve
def test_the_certified_exact_index_equals_fp32_and_faiss():
    from bigrank.export.index import CertifiedExactIndex, build_index, search

    items, queries = gaussian((20_000, 64), 110, 0.1).numpy(), gaussian((50, 64), 111).numpy()
    certified, plain = CertifiedExactIndex(items), CertifiedExactIndex(items, certified=False)
    certified.stats = TopKStats()
    scores, ids = certified.search(queries, 50)  # 400 items per k: the bf16 pass is tried
    want = brute_force(torch.from_numpy(queries), torch.from_numpy(items), 50)
    assert_same((torch.from_numpy(scores), torch.from_numpy(ids)), want)
    assert_same(tuple(map(torch.from_numpy, plain.search(queries, 50))), want)
    if BF16_PASS:
        assert certified.stats.bf16_rows == 50 and certified.stats.fallback_rows == 0
    else:
        assert_fp32_path(certified.stats, 50)
    # FAISS's IndexFlatIP sums in another order (last-bit differences), the same items on these data.
    faiss_scores, faiss_ids = search(build_index(items, "exact"), queries, 50)
    assert (faiss_ids == ids).all()
    np.testing.assert_allclose(faiss_scores, scores, rtol=1e-5, atol=1e-6)
    # Exclusions go into the search: the top 5 of the remaining items, fewer when fewer remain.
    excluded = [ids[0, :3], np.array([], dtype=np.int64), np.arange(20_000)[np.arange(20_000) != 7]]
    found = certified.search_excluding(queries[:3], [5, 5, 5], excluded)
    mask = torch.zeros((3, 20_000), dtype=torch.bool)
    mask[0, ids[0, :3]] = True
    mask[2] = True
    mask[2, 7] = False
    _, want_ids = brute_force(torch.from_numpy(queries[:3]), torch.from_numpy(items), 5, mask)
    assert [f[0].tolist() for f in found] == [want_ids[0].tolist(), want_ids[1].tolist(), [7]]


@pytest.mark.parametrize("certified", [True, False])
def test_recommend_gives_the_same_items_with_and_without_certified_bf16(tmp_path, certified):
    from bigrank.export.index import CertifiedExactIndex
    from bigrank.export.recommend import Recommender
    from tests.helpers import random_tables, write_export

    tables = random_tables(301, 157, seed=3)
    write_export(tmp_path / "export", tables)
    rec = Recommender(tmp_path / "export", certified_bf16=certified)
    assert isinstance(rec.index, CertifiedExactIndex) == (certified and cpu_bf16_gemm())
    faiss_rec = Recommender(tmp_path / "export", certified_bf16=False)
    for user in range(0, 150, 7):
        skip = list(range(user, user + 5))
        got, want = rec.recommend(user, 10, skip), faiss_rec.recommend(user, 10, skip)
        assert [r["item_id"] for r in got] == [r["item_id"] for r in want]
        np.testing.assert_allclose([r["score"] for r in got], [r["score"] for r in want], rtol=1e-5, atol=1e-6)
    vectors = tables["users"][:20].numpy()
    batch = rec.search_batch(vectors, [3] * 20, [np.array([], dtype=np.int64)] * 20)
    want_values, want_ids = brute_force(tables["users"][:20], tables["items"], 3)
    assert [ids.tolist() for ids, _ in batch] == want_ids.tolist()
    if certified and cpu_bf16_gemm():  # the certified index: the fp32 brute-force bits
        assert np.array_equal(np.stack([scores for _, scores in batch]), want_values.numpy())
