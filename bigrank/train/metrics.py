"""Retrieval metrics of top-K recommendation lists against held-out relevant sets (Rankmax paper, Section 4).

For a user with relevant set ``R`` (its held-out items, ``|R| >= 1``) and a ranked list ``top[1..K]`` with
``rel_i = 1`` when ``top[i]`` is in ``R``:

* ``recall@K   = (sum_{i<=K} rel_i) / |R|``                                   (hits / relevant)
* ``ndcg@K     = DCG@K / IDCG@K``, ``DCG@K = sum_{i<=K} rel_i / log2(i + 1)``, ``IDCG@K = sum_{i<=min(|R|, K)}
  1 / log2(i + 1)`` — binary gains, the ideal list holding ``min(|R|, K)`` hits: the definition of the graph
  collaborative-filtering papers' code (NGCF, Wang et al. SIGIR 2019; LightGCN, He et al. SIGIR 2020:
  ``NDCGatK_r``), so that their Recall@20 / NDCG@20 tables compare with these figures.
* ``ap@K       = (1 / min(K, |R|)) * sum_{i<=K} precision@i * rel_i``,  ``precision@i = (sum_{j<=i} rel_j) / i``
  — the "truncated" normalisation: a perfect list scores 1 even when ``|R| < K`` or ``|R| > K``.
* ``accuracy   = rel_1``                                                        (the top-ranked item is relevant)

Each metric is averaged over the users that have at least one relevant item; users with none are skipped and
counted (``skipped_users``). The functions also return the per-metric **sums** and the user count, so that
results over several batches or ranks combine exactly (``combine``): the mean of the union is the sum of the
sums divided by the sum of the counts, not the mean of the means.

Ids ``< 0`` in a list are padding (the catalog had fewer than K eligible items) and never count as a hit.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import numpy as np

__all__ = ["ranking_metrics", "combine", "metric_names", "relevant_csr"]


def metric_names(ks: Iterable[int]) -> list[str]:
    """The metric keys reported for ``ks``, in display order: ``accuracy, recall@K..., ndcg@K..., ap@K...``."""
    ks = sorted({int(k) for k in ks})
    return ["accuracy"] + [f"{name}@{k}" for name in ("recall", "ndcg", "ap") for k in ks]


def relevant_csr(relevant, num_rows: int) -> tuple[np.ndarray, np.ndarray]:
    """Normalise ``relevant`` to CSR ``(indptr int64[num_rows + 1], items int64[nnz])``.

    ``relevant`` is either a CSR **tuple** ``(indptr, items)`` in the layout of
    ``bigrank.data.stream.read_user_items``, or a **list** (any non-tuple sequence) of ``num_rows`` iterables of
    item ids, row ``u`` holding the relevant items of the user in row ``u`` of the top-K lists. Duplicate ids
    within a row are counted once.
    """
    if isinstance(relevant, tuple):
        if len(relevant) != 2:
            raise ValueError(f"a tuple relevant must be CSR (indptr, items), got a tuple of {len(relevant)}")
        indptr, items = (np.asarray(a) for a in relevant)
        if indptr.ndim != 1 or len(indptr) != num_rows + 1:
            raise ValueError(f"relevant indptr must have shape ({num_rows + 1},), got {indptr.shape}")
        if indptr[0] != 0 or np.any(np.diff(indptr) < 0) or indptr[-1] != len(items):
            raise ValueError("relevant indptr must start at 0, be non-decreasing and end at len(items)")
        return indptr.astype(np.int64), items.astype(np.int64)
    rows = list(relevant)
    if len(rows) != num_rows:
        raise ValueError(f"relevant has {len(rows)} rows, the top-K lists have {num_rows}")
    arrays = [np.asarray(list(r) if not isinstance(r, np.ndarray) else r, dtype=np.int64).ravel() for r in rows]
    indptr = np.zeros(num_rows + 1, dtype=np.int64)
    np.cumsum([len(a) for a in arrays], out=indptr[1:])
    items = np.concatenate(arrays) if arrays else np.empty(0, dtype=np.int64)
    return indptr, items


def _hits(top_ids: np.ndarray, indptr: np.ndarray, items: np.ndarray) -> np.ndarray:
    """bool[U, K]: ``top_ids[u, j]`` is one of row u's relevant items (padding ids < 0 never are)."""
    num_rows, width = top_ids.shape
    if num_rows == 0 or width == 0 or len(items) == 0:
        return np.zeros(top_ids.shape, dtype=bool)
    base = int(max(items.max(), top_ids.max(), 0)) + 1
    rows = np.repeat(np.arange(num_rows, dtype=np.int64), np.diff(indptr))
    relevant_keys = np.unique(rows * base + items)
    top_keys = np.arange(num_rows, dtype=np.int64)[:, None] * base + top_ids
    found = np.isin(top_keys, relevant_keys, assume_unique=False)
    return found & (top_ids >= 0)


def _relevant_counts(indptr: np.ndarray, items: np.ndarray) -> np.ndarray:
    """int64[U]: number of *distinct* relevant items of each row."""
    num_rows = len(indptr) - 1
    if len(items) == 0:
        return np.zeros(num_rows, dtype=np.int64)
    rows = np.repeat(np.arange(num_rows, dtype=np.int64), np.diff(indptr))
    base = int(items.max()) + 1
    unique_rows = np.unique(rows * base + items) // base
    return np.bincount(unique_rows, minlength=num_rows).astype(np.int64)


def ranking_metrics(top_ids, relevant, ks: Sequence[int]) -> dict:
    """Recall@K, NDCG@K, AP@K and Accuracy of ranked lists (see the module docstring for the definitions).

    Args:
        top_ids: int[U, L] item ids of each user's ranking, best first (``L >= max(ks)`` normally; a shorter
            list — a catalog smaller than K — is scored as if padded with non-relevant ids). Ids must be
            distinct within a row, apart from padding ids ``< 0``.
        relevant: the held-out items of each of the U rows, as a list of iterables or CSR ``(indptr, items)``.
        ks: cut-offs K (positive ints).

    Returns a dict with the means ``accuracy``, ``recall@K``, ``ndcg@K`` and ``ap@K`` for each K (NaN when no user has a
    relevant item), ``users`` (users scored), ``skipped_users`` (users without relevant items) and ``sums``
    (the per-metric sums over the scored users, for ``combine``).
    """
    ks = sorted({int(k) for k in ks})
    if not ks or ks[0] < 1:
        raise ValueError(f"ks must be positive cut-offs, got {ks}")
    top_ids = np.asarray(top_ids)
    if top_ids.ndim != 2 or not np.issubdtype(top_ids.dtype, np.integer):
        raise ValueError(f"top_ids must be an integer array of shape [U, K], got {top_ids.dtype} {top_ids.shape}")
    top_ids = top_ids.astype(np.int64)
    _check_distinct(top_ids)
    num_rows = top_ids.shape[0]
    indptr, items = relevant_csr(relevant, num_rows)
    counts = _relevant_counts(indptr, items)
    scored = counts > 0

    width = max(ks)
    hits = np.zeros((num_rows, width), dtype=np.float64)
    columns = min(width, top_ids.shape[1])
    hits[:, :columns] = _hits(top_ids[:, :columns], indptr, items)
    hits, counts = hits[scored], counts[scored].astype(np.float64)
    cumulative = np.cumsum(hits, axis=1)
    ranks = np.arange(1, width + 1, dtype=np.float64)
    precision_at_hits = np.cumsum(cumulative / ranks * hits, axis=1)  # sum_{i<=K} precision@i * rel_i
    discounts = 1.0 / np.log2(ranks + 1.0)  # 1 / log2(i + 1), i = 1..width
    dcg = np.cumsum(hits * discounts, axis=1)
    ideal = np.concatenate([[0.0], np.cumsum(discounts)])  # ideal[m]: the DCG of m hits at the top

    sums = {"accuracy": float(hits[:, 0].sum())}
    for k in ks:
        sums[f"recall@{k}"] = float((cumulative[:, k - 1] / counts).sum())
    for k in ks:
        sums[f"ndcg@{k}"] = float((dcg[:, k - 1] / ideal[np.minimum(counts, k).astype(np.int64)]).sum())
    for k in ks:
        sums[f"ap@{k}"] = float((precision_at_hits[:, k - 1] / np.minimum(counts, k)).sum())
    return _finish(sums, users=int(scored.sum()), skipped=int(num_rows - scored.sum()))


def _check_distinct(top_ids: np.ndarray) -> None:
    ordered = np.sort(top_ids, axis=1)
    repeated = (ordered[:, 1:] == ordered[:, :-1]) & (ordered[:, 1:] >= 0)
    if repeated.any():
        row = int(np.flatnonzero(repeated.any(axis=1))[0])
        raise ValueError(f"top_ids row {row} lists an item more than once; rankings must hold distinct items")


def _finish(sums: Mapping[str, float], users: int, skipped: int) -> dict:
    result = {name: (value / users if users else float("nan")) for name, value in sums.items()}
    result.update(users=users, skipped_users=skipped, sums=dict(sums))
    return result


def combine(results: Iterable[Mapping]) -> dict:
    """Exact union of ``ranking_metrics`` results over disjoint sets of users (batches, ranks).

    The results must report the same metrics. Returns a dict in the format of ``ranking_metrics``.
    """
    results = list(results)
    if not results:
        raise ValueError("combine needs at least one result")
    names = list(results[0]["sums"])
    sums = dict.fromkeys(names, 0.0)
    users = skipped = 0
    for result in results:
        if list(result["sums"]) != names:
            raise ValueError(f"cannot combine results with metrics {list(result['sums'])} and {names}")
        for name in names:
            sums[name] += result["sums"][name]
        users += int(result["users"])
        skipped += int(result["skipped_users"])
    return _finish(sums, users=users, skipped=skipped)
