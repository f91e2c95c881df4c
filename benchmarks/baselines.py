"""Classic baselines on a bigrank dataset: popularity and EASE, scored with bigrank's own metric code.

Both rank every item of the catalog for every user of the held-out split, leave out the user's train items
(the protocol of ``bigrank evaluate``) and score the lists with ``bigrank.train.metrics.ranking_metrics``
(AP@K normalised by min(K, |relevant|)), so their figures sit in the same table as the trained models.

* popularity: ``score(u, i) = number of train pairs of item i`` (the same list for every user);
* EASE (Steck, "Embarrassingly Shallow Autoencoders for Sparse Data", WWW 2019, eq. 8): with the binary train
  matrix ``X`` [users, items] and ``P = (XᵀX + λI)⁻¹``, the item-item weights are ``B = I − P·diag(1/diag P)``
  (zero diagonal) and ``score(u, ·) = X[u] B``. ``λ`` is picked on the validation split from a grid.

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

__all__ = ["ease_scores", "evaluate_scores", "popularity_scores", "split_matrix", "tune_ease"]

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
    if not lam > 0:
        raise ValueError(f"EASE needs lambda > 0, got {lam}")
    seen = np.flatnonzero(train.sum(axis=0) > 0)
    x = torch.from_numpy(np.ascontiguousarray(train[:, seen])).to(dtype)
    gram = x.T @ x
    gram.diagonal().add_(float(lam))
    precision = torch.cholesky_inverse(torch.linalg.cholesky(gram))
    scores = np.zeros(train.shape, dtype=np.float32)
    scores[:, seen] = (x - (x @ precision) / precision.diagonal()).to(torch.float32).numpy()
    return scores


def evaluate_scores(scores: np.ndarray, train: np.ndarray, heldout: np.ndarray, ks=KS) -> dict:
    """``ranking_metrics`` of the top ``max(ks)`` items of each user with held-out items, train items left out.

    Args:
        scores: float[users, items]; train: the binary train matrix (excluded); heldout: the binary matrix of
        the split scored.
    """
    users = np.flatnonzero(heldout.sum(axis=1) > 0)
    masked = np.where(train[users] > 0, -np.inf, scores[users]).astype(np.float32)
    width = max(ks)
    top = np.argpartition(-masked, width - 1, axis=1)[:, :width]
    order = np.argsort(-np.take_along_axis(masked, top, axis=1), axis=1, kind="stable")
    top = np.take_along_axis(top, order, axis=1)
    relevant = [np.flatnonzero(heldout[u]) for u in users]
    return ranking_metrics(top, relevant, ks)


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
