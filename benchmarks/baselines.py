"""Classic baselines on a bigrank dataset: popularity and EASE, scored with bigrank's own metric code.

Both rank every item of the catalog for every user of the held-out split, leave out the user's train items
(the protocol of ``bigrank evaluate``) and score the lists with ``bigrank.train.metrics.ranking_metrics``
(AP@K normalised by min(K, |relevant|)), so their figures sit in the same table as the trained models.

* popularity: ``score(u, i) = number of train pairs of item i`` (the same list for every user);
* EASE (Steck, "Embarrassingly Shallow Autoencoders for Sparse Data", WWW 2019, eq. 8): with the binary train
  matrix ``X`` [users, items] and ``P = (XᵀX + λI)⁻¹``, the item-item weights are ``B = I − P·diag(1/diag P)``
  (zero diagonal) and ``score(u, ·) = X[u] B``. ``λ`` is picked on the validation split from a grid.

A trained bigrank model enters the same code through its export (``export_scores``). Because every model
scores the same users, two models are compared user by user: ``per_user_metrics`` gives each user's figures
and ``paired_difference`` the mean difference over split seeds with a bootstrap interval over the users — on
~600 users the spread between two good models is often as large as their difference.

Dense matrices: meant for ml-latest-small scale catalogs (9.7K items: a 9.7K² Gram matrix, ~0.4 GB in
float32), not for ML-1B.

    .venv/bin/python -m benchmarks.baselines DATA_ROOT [DATA_ROOT ...] [--lambdas 100 300 1000]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

from bigrank.data.manifest import load_manifest
from bigrank.data.stream import read_user_items
from bigrank.train.metrics import ranking_metrics

__all__ = [
    "ease_scores",
    "evaluate_scores",
    "export_scores",
    "paired_difference",
    "per_user_metrics",
    "popularity_scores",
    "split_matrix",
    "tune_ease",
]

DEFAULT_LAMBDAS = (30.0, 100.0, 300.0, 1000.0, 3000.0)
KS = (10, 100)


def split_matrix(root: str | Path, split: str) -> np.ndarray:
    """The binary interaction matrix of ``split``: float32[num_users, num_items] (1 where the pair occurs)."""
    manifest = load_manifest(root)
    num_users, num_items = int(manifest["num_users"]), int(manifest["num_items"])
    indptr, items = read_user_items(root, split, num_users)
    matrix = np.zeros((num_users, num_items), dtype=np.float32)
    rows = np.repeat(np.arange(num_users), np.diff(indptr))
    matrix[rows, items] = 1.0
    return matrix


def popularity_scores(train: np.ndarray) -> np.ndarray:
    """float32[users, items]: every user gets the items' train counts."""
    counts = train.sum(axis=0, dtype=np.float64).astype(np.float32)
    return np.broadcast_to(counts, train.shape)


def ease_scores(train: np.ndarray, lam: float, dtype=torch.float32) -> np.ndarray:
    """EASE scores ``X B`` float32[users, items] (Steck 2019, eq. 8; see the module docstring).

    ``X B = X − (X P)·diag(1/diag P)`` because ``B = I − P·diag(1/diag P)`` with its diagonal forced to 0
    (the diagonal of ``P·diag(1/diag P)`` is 1). ``P`` comes from a Cholesky factorisation of ``XᵀX + λI``
    (symmetric positive definite for ``λ > 0``) in ``dtype``. Items without train pairs have a zero row and
    column in ``XᵀX``, so they decouple (their weights are 0): the inverse is taken over the other items only.
    """
    seen, x, precision = _ease_precision(train, lam, dtype)
    scores = np.zeros(train.shape, dtype=np.float32)
    scores[:, seen] = (x - (x @ precision) / precision.diagonal()).to(torch.float32).numpy()
    return scores


def ease_matrix(train: np.ndarray, lam: float, dtype=torch.float32) -> torch.Tensor:
    """EASE's item-item weights ``B`` float32[items, items] (``ease_scores`` is ``X B``), zero diagonal; items
    without train pairs have zero rows and columns."""
    seen, _, precision = _ease_precision(train, lam, dtype)
    weights = torch.zeros(train.shape[1], train.shape[1], dtype=torch.float32)
    block = (-precision / precision.diagonal()).to(torch.float32)
    block.fill_diagonal_(0.0)
    index = torch.from_numpy(seen)
    weights[index.unsqueeze(1), index.unsqueeze(0)] = block
    return weights


def _ease_precision(train: np.ndarray, lam: float, dtype) -> tuple[np.ndarray, torch.Tensor, torch.Tensor]:
    """``(seen items, X over them, P = (XᵀX + λI)⁻¹)`` by a Cholesky factorisation in ``dtype``."""
    if not lam > 0:
        raise ValueError(f"EASE needs lambda > 0, got {lam}")
    seen = np.flatnonzero(train.sum(axis=0) > 0)
    x = torch.from_numpy(np.ascontiguousarray(train[:, seen])).to(dtype)
    gram = x.T @ x
    gram.diagonal().add_(float(lam))
    return seen, x, torch.cholesky_inverse(torch.linalg.cholesky(gram))


def evaluate_scores(scores: np.ndarray, train: np.ndarray, heldout: np.ndarray, ks=KS) -> dict:
    """``ranking_metrics`` of the top ``max(ks)`` items of each user with held-out items, train items left out.

    Args:
        scores: float[users, items]; train: the binary train matrix (excluded); heldout: the binary matrix of
        the split scored.
    """
    top, relevant = _ranked_lists(scores, train, heldout, max(ks))
    return ranking_metrics(top, relevant, ks)


def _ranked_lists(scores: np.ndarray, train: np.ndarray, heldout: np.ndarray, width: int):
    """``(top int64[U, width], relevant)`` of the U users with held-out items (in user order), train items out."""
    users = np.flatnonzero(heldout.sum(axis=1) > 0)
    masked = np.where(train[users] > 0, -np.inf, scores[users]).astype(np.float32)
    top = np.argpartition(-masked, width - 1, axis=1)[:, :width]
    order = np.argsort(-np.take_along_axis(masked, top, axis=1), axis=1, kind="stable")
    top = np.take_along_axis(top, order, axis=1)
    return top, [np.flatnonzero(heldout[u]) for u in users]


def per_user_metrics(scores: np.ndarray, train: np.ndarray, heldout: np.ndarray, ks=KS) -> dict[str, np.ndarray]:
    """Each user's figures: ``{metric: float64[U]}`` for the U users with held-out items, in user order.

    The same lists and metric code as ``evaluate_scores`` (``ranking_metrics`` of one user at a time), so the
    means of the arrays are its figures.
    """
    top, relevant = _ranked_lists(scores, train, heldout, max(ks))
    rows = [ranking_metrics(top[u : u + 1], [relevant[u]], ks)["sums"] for u in range(len(relevant))]
    names = list(rows[0]) if rows else []
    return {name: np.array([row[name] for row in rows], dtype=np.float64) for name in names}


def paired_difference(
    first: list[np.ndarray], second: list[np.ndarray], *, resamples: int = 2000, seed: int = 0
) -> tuple[float, float, float]:
    """Mean difference of two models over split seeds, with a 95 % bootstrap interval.

    Args:
        first, second: per split seed, one metric's per-user values float[U_s] of the two models on the same
            users (``per_user_metrics``).

    Returns ``(difference, low, high)``: ``difference = mean_s mean_u (first - second)`` — the difference of
    the table's means over the seeds — and the 2.5 / 97.5 percentiles of that statistic when each seed's users
    are resampled with replacement (pairs kept together: the paired bootstrap, Efron & Tibshirani 1993, ch. 6).
    """
    if len(first) != len(second) or not first:
        raise ValueError(f"need the same number (>= 1) of seeds for both models, got {len(first)} and {len(second)}")
    rng = np.random.default_rng(seed)
    point, draws = 0.0, np.zeros(resamples)
    for a, b in zip(first, second, strict=True):
        a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
        if a.shape != b.shape or a.ndim != 1 or a.size == 0:
            raise ValueError(f"per-user values must be paired 1-D arrays, got shapes {a.shape} and {b.shape}")
        delta = a - b
        point += delta.mean()
        draws += delta[rng.integers(0, delta.size, size=(resamples, delta.size))].mean(axis=1)
    seeds = len(first)
    low, high = np.percentile(draws / seeds, [2.5, 97.5])
    return point / seeds, float(low), float(high)


def export_scores(export_dir: str | Path, train: np.ndarray) -> np.ndarray:
    """Scores float32[users, items] of a ``bigrank export``: ``score(u, i) = f(u) · E_item[i]``.

    ``f(u)`` is the user tower's vector (``bigrank.model.towers``): the user row, plus the mean of the history
    rows of the user's train items (``train``, the binary matrix) when the export's ``user_vector`` rule is
    ``table+history_mean`` (the rule ``bigrank.export.recommend.Recommender`` follows).
    """
    from bigrank.export.format import load_export, read_table

    manifest = load_export(export_dir, verify=False)
    users = read_table(export_dir, manifest, "users")["embedding"].astype(np.float32)
    items = read_table(export_dir, manifest, "items")["embedding"].astype(np.float32)
    if users.shape[0] != train.shape[0] or items.shape[0] != train.shape[1]:
        raise ValueError(
            f"the export {export_dir} has {users.shape[0]} users x {items.shape[0]} items, the dataset "
            f"{train.shape[0]} x {train.shape[1]}"
        )
    if manifest.get("user_vector") == "table+history_mean":  # else the user rows are the whole vector
        history = read_table(export_dir, manifest, "history")["embedding"].astype(np.float32)
        bag = train.sum(axis=1, keepdims=True)
        users = users + (train @ history) / np.maximum(bag, 1)  # an empty bag adds nothing
    return users @ items.T


def tune_ease(train: np.ndarray, valid: np.ndarray, lambdas=DEFAULT_LAMBDAS, metric: str = "ap@10"):
    """λ of ``lambdas`` with the best validation ``metric``: ``(lam, scores, {lam: valid metrics})``."""
    best, by_lambda = None, {}
    for lam in lambdas:
        scores = ease_scores(train, lam)
        result = evaluate_scores(scores, train, valid)
        by_lambda[float(lam)] = result
        if best is None or result[metric] > best[0]:
            best = (result[metric], float(lam), scores)
    return best[1], best[2], by_lambda


def baselines(root: str | Path, lambdas=DEFAULT_LAMBDAS) -> dict:
    """Test (and valid) metrics of popularity and λ-tuned EASE on the dataset at ``root``."""
    train, valid, test = (split_matrix(root, split) for split in ("train", "valid", "test"))
    started = time.perf_counter()
    popularity = popularity_scores(train)
    out = {
        "popularity": {
            "valid": evaluate_scores(popularity, train, valid),
            "test": evaluate_scores(popularity, train, test),
        }
    }
    lam, scores, by_lambda = tune_ease(train, valid, lambdas)
    out["ease"] = {
        "lambda": lam,
        "valid": by_lambda[lam],
        "test": evaluate_scores(scores, train, test),
        "valid_by_lambda": {str(k): v["ap@10"] for k, v in by_lambda.items()},
    }
    out["seconds"] = time.perf_counter() - started
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("roots", nargs="+", metavar="DATA_ROOT", help="bigrank datasets (e.g. one per split seed)")
    parser.add_argument("--lambdas", type=float, nargs="+", default=list(DEFAULT_LAMBDAS))
    parser.add_argument("--json", default=None, help="also write the results to this file")
    args = parser.parse_args()
    results = {}
    for root in args.roots:
        results[root] = baselines(root, args.lambdas)
        for name in ("popularity", "ease"):
            test = results[root][name]["test"]
            extra = f" lambda={results[root][name]['lambda']:g}" if name == "ease" else ""
            print(
                f"{root} {name:<11} AP@10 {test['ap@10']:.4f}  Acc {test['accuracy']:.4f}  "
                f"R@100 {test['recall@100']:.4f}{extra}",
                flush=True,
            )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1, default=float))


if __name__ == "__main__":
    main()
