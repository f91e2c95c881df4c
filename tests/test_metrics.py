"""Recall@K, NDCG@K, AP@K and Accuracy equal a brute-force pure-Python computation; combine is exact."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from bigrank.train.metrics import combine, metric_names, ranking_metrics

KS = (1, 3, 5, 8)


def brute_force(ranking: list[int], relevant: set[int], k: int) -> tuple[float, float, float, float]:
    """(recall@k, ap@k, accuracy, ndcg@k) of one user, straight from the definitions (Rankmax paper, Section 4;
    NDCG as the graph-CF papers' code computes it, ``NDCGatK_r``)."""
    hits = [1 if (i < len(ranking) and ranking[i] in relevant) else 0 for i in range(k)]
    recall = sum(hits) / len(relevant)
    ap = sum(sum(hits[: i + 1]) / (i + 1) * hits[i] for i in range(k)) / min(k, len(relevant))
    accuracy = float(bool(ranking) and ranking[0] in relevant)
    return recall, ap, accuracy, ndcg_graph_cf(hits, len(relevant), k)


def ndcg_graph_cf(hits: list[int], relevant: int, k: int) -> float:
    """NDCG@k as LightGCN's ``NDCGatK_r`` computes it for one user: an ideal row of ``min(|test|, k)`` ones,
    ``idcg = sum(ideal / log2(rank + 1))``, ``dcg = sum(hits / log2(rank + 1))`` over ranks 1..k."""
    ideal = [1.0 if i < min(relevant, k) else 0.0 for i in range(k)]
    idcg = sum(ideal[i] / math.log2(i + 2) for i in range(k))
    dcg = sum(hits[i] / math.log2(i + 2) for i in range(k))
    return dcg / idcg


def random_case(seed: int, users: int = 40, items: int = 30, width: int = 8):
    rng = random.Random(seed)
    top, relevant = [], []
    for u in range(users):
        top.append(rng.sample(range(items), width))
        # 0 to 12 relevant items: some users have none (skipped), many fewer than K, some more.
        size = 0 if u % 7 == 0 else rng.randint(1, 12)
        relevant.append(set(rng.sample(range(items), size)))
    return np.array(top, dtype=np.int64), relevant


def expected_means(top, relevant, ks):
    scored = [(list(row), rel) for row, rel in zip(top.tolist(), relevant, strict=True) if rel]
    expected = {"accuracy": sum(brute_force(r, rel, 1)[2] for r, rel in scored) / len(scored)}
    for k in ks:
        expected[f"recall@{k}"] = sum(brute_force(r, rel, k)[0] for r, rel in scored) / len(scored)
        expected[f"ap@{k}"] = sum(brute_force(r, rel, k)[1] for r, rel in scored) / len(scored)
        expected[f"ndcg@{k}"] = sum(brute_force(r, rel, k)[3] for r, rel in scored) / len(scored)
    return expected, len(scored)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_metrics_equal_brute_force(seed):
    top, relevant = random_case(seed)
    result = ranking_metrics(top, [sorted(r) for r in relevant], KS)
    expected, users = expected_means(top, relevant, KS)
    assert result["users"] == users and result["skipped_users"] == len(relevant) - users
    assert set(metric_names(KS)) == set(expected)
    for name, value in expected.items():
        assert result[name] == pytest.approx(value, rel=1e-12), name
    # The CSR form gives the same answer.
    indptr = np.cumsum([0] + [len(r) for r in relevant])
    items = np.array([i for r in relevant for i in sorted(r)], dtype=np.int32)
    csr = ranking_metrics(top, (indptr, items), KS)
    assert {k: csr[k] for k in expected} == {k: result[k] for k in expected}


def test_hand_computed_case():
    # User 0: relevant {3, 9}; ranking 3, 5, 9 -> hits at ranks 1 and 3.
    # AP@3 = (1/1 + 2/3) / min(3, 2) = 5/6; recall@1 = 1/2; accuracy 1.
    # User 1: relevant {4, 6, 7, 8}; ranking 5, 4, -1 (padding) -> hit at rank 2; AP@3 = (1/2) / 3.
    top = np.array([[3, 5, 9], [5, 4, -1]])
    result = ranking_metrics(top, [[3, 9], [4, 6, 7, 8]], (1, 3))
    assert result["accuracy"] == pytest.approx(0.5)
    assert result["recall@1"] == pytest.approx((0.5 + 0.0) / 2)
    assert result["recall@3"] == pytest.approx((1.0 + 0.25) / 2)
    assert result["ap@3"] == pytest.approx((5 / 6 + 1 / 6) / 2)
    assert result["ap@1"] == pytest.approx((1.0 + 0.0) / 2)
    # NDCG@3: user 0 DCG 1 + 1/log2(4) = 1.5 over IDCG 1 + 1/log2(3) (two relevant items); user 1 DCG 1/log2(3)
    # over IDCG 1 + 1/log2(3) + 1/2 (three of its four relevant items fit in the top 3).
    ndcg_0 = 1.5 / (1 + 1 / math.log2(3))
    ndcg_1 = (1 / math.log2(3)) / (1 + 1 / math.log2(3) + 0.5)
    assert result["ndcg@3"] == pytest.approx((ndcg_0 + ndcg_1) / 2)
    assert result["ndcg@1"] == pytest.approx(result["accuracy"])  # one rank: NDCG@1 is the top item's hit


def test_metric_names_order_and_any_cut_off():
    assert metric_names([20, 10]) == ["accuracy", "recall@10", "recall@20", "ndcg@10", "ndcg@20", "ap@10", "ap@20"]
    # K = 20 (the graph-CF papers' cut-off) with lists of 20, and K past the list's length (a small catalog).
    top, relevant = random_case(11, users=30, items=60, width=20)
    for ks in ((20,), (7, 20, 25)):
        result = ranking_metrics(top, [sorted(r) for r in relevant], ks)
        expected, _ = expected_means(top, relevant, ks)
        for name, value in expected.items():
            assert result[name] == pytest.approx(value, rel=1e-12), name


def test_short_lists_padding_and_perfect_rankings():
    # A list shorter than K (small catalog) counts the missing ranks as misses; padding -1 never hits even when
    # the relevant set holds the largest id; a perfect list has AP@K = 1 whatever |R| versus K.
    top = np.array([[2, 0], [1, -1]])
    result = ranking_metrics(top, [[0, 2], [1]], (5,))
    assert result["recall@5"] == 1.0 and result["ap@5"] == 1.0 and result["accuracy"] == 1.0
    assert result["ndcg@5"] == pytest.approx(1.0)
    many = ranking_metrics(np.array([[0, 1, 2]]), [list(range(10))], (3,))
    assert many["ap@3"] == 1.0 and many["recall@3"] == pytest.approx(0.3) and many["ndcg@3"] == pytest.approx(1.0)
    assert ranking_metrics(np.array([[-1, -1]]), [[0, 1]], (2,))["recall@2"] == 0.0


def test_combine_is_exact_over_batches():
    top, relevant = random_case(5, users=50)
    lists = [sorted(r) for r in relevant]
    whole = ranking_metrics(top, lists, KS)
    parts = [ranking_metrics(top[a:b], lists[a:b], KS) for a, b in [(0, 7), (7, 30), (30, 50)]]
    combined = combine(parts)
    for name in metric_names(KS):
        assert combined[name] == pytest.approx(whole[name], rel=1e-12)
    assert (combined["users"], combined["skipped_users"]) == (whole["users"], whole["skipped_users"])
    # The mean of the batch means differs (unequal batches): combine must not average means.
    assert not math.isclose(np.mean([p["recall@8"] for p in parts]), whole["recall@8"], rel_tol=1e-9)


def test_no_relevant_users_and_bad_input():
    empty = ranking_metrics(np.array([[0, 1]]), [[]], (1,))
    assert empty["users"] == 0 and empty["skipped_users"] == 1 and math.isnan(empty["recall@1"])
    with pytest.raises(ValueError, match="more than once"):
        ranking_metrics(np.array([[1, 1]]), [[1]], (2,))
    with pytest.raises(ValueError, match="rows"):
        ranking_metrics(np.array([[1, 2]]), [[1], [2]], (2,))
    with pytest.raises(ValueError, match="positive"):
        ranking_metrics(np.array([[1, 2]]), [[1]], (0,))
    with pytest.raises(ValueError, match="indptr"):
        ranking_metrics(np.array([[1, 2]]), (np.array([0, 1, 1]), np.array([1])), (2,))
