"""Classic baselines on a bigrank dataset: popularity, EASE and ALS, scored with bigrank's own metric code.

Each ranks every item of the catalog for every user of the held-out split, leaves out the user's items of the
splits ``bigrank evaluate`` leaves out (the train items; on a given split, test also leaves out valid's:
``bigrank.data.manifest.excluded_splits``) and scores the lists with ``bigrank.train.metrics.ranking_metrics``
(AP@K normalised by min(K, |relevant|); NDCG@K with binary gains), so their figures sit in the same table as the
trained models.

* popularity: ``score(u, i) = number of train pairs of item i`` (the same list for every user);
* EASE (Steck, "Embarrassingly Shallow Autoencoders for Sparse Data", WWW 2019, eq. 8): with the binary train
  matrix ``X`` [users, items] and ``P = (XᵀX + λI)⁻¹``, the item-item weights are ``B = I − P·diag(1/diag P)``
  (zero diagonal) and ``score(u, ·) = X[u] B``. ``λ`` is picked on the validation split from a grid. With fewer
  users than items (Last.fm: 1.9K users, 17.6K artists) the scores come from the users' side of the same
  inverse (Woodbury), without the n × n matrix;
* ALS (Hu, Koren & Volinsky, "Collaborative Filtering for Implicit Feedback Datasets", ICDM 2008; the
  ``implicit`` package's conjugate-gradient solver, Takács et al. 2011): user and item factors minimising
  ``Σ_ui c_ui (p_ui − x_uᵀ y_i)² + λ (Σ‖x_u‖² + Σ‖y_i‖²)`` with ``p_ui = 1`` on the train pairs, 0 elsewhere, and
  confidence ``c_ui = α`` on the train pairs, 1 elsewhere (implicit's ``alpha`` scales the input matrix: Hu et
  al.'s ``1 + α``); ``score(u, i) = x_uᵀ y_i``. Factors, λ, α and the iterations are picked on the validation
  split from ``ALS_GRID`` (3 × 3 × 3 fits of the largest iteration count, each evaluated after 5, 10 and 15
  iterations: 81 points), the library users of implicit feedback reach for.

A trained bigrank model enters the same code through its export (``export_scores``). Because every model
scores the same users, two models are compared user by user: ``per_user_metrics`` gives each user's figures
and ``paired_difference`` the mean difference over split seeds with a bootstrap interval over the users — on
~600 users the spread between two good models is often as large as their difference.

Dense matrices: meant for ml-latest-small scale catalogs (9.7K items: a 9.7K² Gram matrix, ~0.4 GB in
float32), not for ML-1B.

    .venv/bin/python -m benchmarks.baselines DATA_ROOT [DATA_ROOT ...] [--lambdas 100 300 1000] [--no-als]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

from bigrank.data.manifest import excluded_splits, load_manifest
from bigrank.data.stream import read_user_items
from bigrank.train.metrics import ranking_metrics

__all__ = [
    "ALS_GRID",
    "als_factors",
    "als_scores",
    "ease_scores",
    "evaluate_scores",
    "export_scores",
    "paired_difference",
    "per_user_metrics",
    "popularity_scores",
    "split_matrix",
    "tune_als",
    "tune_ease",
]

DEFAULT_LAMBDAS = (30.0, 100.0, 300.0, 1000.0, 3000.0)
KS = (10, 20, 100)
# The ALS grid searched on the validation split: factors, regularisation λ, confidence α of a train pair, and the
# iterations (one fit per (factors, λ, α) of the largest count, evaluated after each count).
# λ and α trade off: on ml-latest-small and Last.fm the best valid AP@10 sat near λ/α ≈ 3 (λ 30, α 10 on both;
# λ ≤ 1 trailed by 10-40 %; measured 2026-11-28 with 64 and 256 factors), so the grid spans λ/α from 1/3 to 33
# around it. implicit's λ is not scaled by the counts.
ALS_GRID = {
    "factors": (64, 128, 256),
    "regularization": (10.0, 30.0, 100.0),
    "alpha": (3.0, 10.0, 30.0),
    "iterations": (5, 10, 15),
}


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

    With fewer users ``m`` than such items ``n``, the same figures from the users' side (Woodbury's identity,
    in float64): ``P = (I − Xᵀ M⁻¹ X) / λ`` with ``M = XXᵀ + λI`` (m × m), so ``X P = M⁻¹ X`` and
    ``diag P = (1 − Σ_u X_ui (M⁻¹X)_ui) / λ``: an m × m factorisation and 2 m² n flops instead of n³ / 3 + …
    """
    if not lam > 0:
        raise ValueError(f"EASE needs lambda > 0, got {lam}")
    seen = np.flatnonzero(train.sum(axis=0) > 0)
    scores = np.zeros(train.shape, dtype=np.float32)
    if train.shape[0] < len(seen):
        x = torch.from_numpy(np.ascontiguousarray(train[:, seen])).to(torch.float64)
        gram = x @ x.T
        gram.diagonal().add_(float(lam))
        solved = torch.cholesky_solve(x, torch.linalg.cholesky(gram))  # M⁻¹ X = X P
        diagonal = (1.0 - (x * solved).sum(dim=0)) / float(lam)
        scores[:, seen] = (x - solved / diagonal).to(torch.float32).numpy()
        return scores
    seen, x, precision = _ease_precision(train, lam, dtype)
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
        scores: float[users, items]; train: the binary matrix of the items left out (the train matrix, or its
        union with valid's: ``excluded_matrix``); heldout: the binary matrix of the split scored.
    """
    top, relevant = _ranked_lists(scores, train, heldout, max(ks))
    return ranking_metrics(top, relevant, ks)


def _ranked_lists(scores: np.ndarray, train: np.ndarray, heldout: np.ndarray, width: int):
    """``(top int64[U, width], relevant)`` of the U users with held-out items (in user order), train items out."""
    users = np.flatnonzero(heldout.sum(axis=1) > 0)
    masked = np.where(train[users] > 0, -np.inf, scores[users]).astype(np.float32)
    width = min(width, masked.shape[1])  # a catalog smaller than K: shorter lists, as bigrank evaluate ranks them
    top = np.argpartition(-masked, width - 1, axis=1)[:, :width]
    order = np.argsort(-np.take_along_axis(masked, top, axis=1), axis=1, kind="stable")
    top = np.take_along_axis(top, order, axis=1)
    top[np.isneginf(np.take_along_axis(masked, top, axis=1))] = -1  # excluded items pad the list, never listed
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


def als_factors(
    train: np.ndarray,
    factors: int,
    regularization: float,
    alpha: float,
    iterations: int,
    *,
    seed: int = 0,
    threads: int = 0,
    after=None,
) -> tuple[np.ndarray, np.ndarray]:
    """User and item factors ``(float32[users, factors], float32[items, factors])`` of ``implicit``'s
    ``AlternatingLeastSquares`` fitted on the binary ``train`` matrix (the module docstring; ``seed`` its random
    start, ``threads`` 0: every core). Each iteration solves the users given the items, then the items given
    the users (a few conjugate-gradient steps from the last solution each).

    ``after``: ``{iteration count: callback(scores)}`` called with the scores ``x_uᵀ y_i`` float32[users, items]
    after that many iterations of the same fit (a fit of fewer iterations from the same start gives the same
    factors): what ``tune_als`` uses."""
    from implicit.cpu.als import AlternatingLeastSquares
    from scipy.sparse import csr_matrix
    from threadpoolctl import threadpool_limits

    # One BLAS thread inside implicit's OpenMP loop over users (its own advice, checked when the model is made:
    # OpenBLAS's threads in each of them oversubscribe the cores, and OpenBLAS warns that it may hang).
    limits = threadpool_limits(1, "blas")
    try:
        model = AlternatingLeastSquares(
            factors=int(factors), regularization=float(regularization), alpha=float(alpha),
            iterations=int(iterations), random_state=int(seed), num_threads=int(threads),
        )  # fmt: skip
        after = dict(after or {})

        def callback(iteration: int, *_) -> None:
            if iteration + 1 in after:
                after.pop(iteration + 1)(_scores(model.user_factors, model.item_factors))

        model.fit(csr_matrix(train, dtype=np.float32), show_progress=False, callback=callback)
    finally:
        limits.restore_original_limits()
    return np.asarray(model.user_factors), np.asarray(model.item_factors)


def _scores(users: np.ndarray, items: np.ndarray) -> np.ndarray:
    return (np.asarray(users) @ np.asarray(items).T).astype(np.float32)


def als_scores(train: np.ndarray, factors: int, regularization: float, alpha: float, iterations: int, **kw):
    """ALS scores ``x_uᵀ y_i`` float32[users, items] of ``als_factors`` (the same arguments)."""
    return _scores(*als_factors(train, factors, regularization, alpha, iterations, **kw))


def tune_als(
    train: np.ndarray, valid: np.ndarray, grid=None, metric: str = "ap@10", seed: int = 0, excluded=None
) -> tuple[dict, dict]:
    """The ``ALS_GRID`` point (``grid``: another) with the best validation ``metric``: ``(params, {key: valid
    metrics})``, ``key`` the point as ``factors/regularization/alpha/iterations``. ``excluded``: the matrix of the
    items valid's rankings leave out (default ``train``)."""
    grid = dict(ALS_GRID, **(grid or {}))
    excluded = train if excluded is None else excluded
    by_point: dict[str, dict] = {}
    best = None
    for factors in grid["factors"]:
        for regularization in grid["regularization"]:
            for alpha in grid["alpha"]:
                params = {"factors": int(factors), "regularization": float(regularization), "alpha": float(alpha)}

                def record(scores, iterations, params=params) -> None:
                    nonlocal best
                    result = evaluate_scores(scores, excluded, valid)
                    point = dict(params, iterations=int(iterations))
                    by_point["/".join(f"{value:g}" for value in point.values())] = result
                    if best is None or result[metric] > best[0]:
                        best = (result[metric], point)

                counts = sorted(int(i) for i in grid["iterations"])
                als_scores(
                    train, factors, regularization, alpha, counts[-1], seed=seed,
                    after={count: (lambda scores, count=count: record(scores, count)) for count in counts},
                )  # fmt: skip
    return best[1], by_point


def als_at_grid_edge(params: dict, grid=None) -> list[str]:
    """A warning for each of ALS's factors, λ and α that the validation pick took at the smallest or largest value
    of a grid of 2+ values: the best value may lie beyond it. (The iterations are not flagged: ALS converges.)"""
    grid = dict(ALS_GRID, **(grid or {}))
    warnings = []
    for key in ("factors", "regularization", "alpha"):
        values = sorted(grid[key])
        if len(values) > 1 and params[key] in (values[0], values[-1]):
            side = "smallest" if params[key] == values[0] else "largest"
            warnings.append(f"warning: ALS picked {key} = {params[key]:g}, the {side} of the grid {values}; widen it")
    return warnings


def excluded_matrix(root: str | Path, split: str, matrices: dict[str, np.ndarray]) -> np.ndarray:
    """The binary matrix of the items left out of ``split``'s rankings on the dataset at ``root``: the union of
    ``matrices`` of its ``excluded_splits`` (train; on a given split, test's adds valid's)."""
    names = excluded_splits(load_manifest(root), split)
    union = matrices[names[0]]
    for name in names[1:]:
        union = np.maximum(union, matrices[name])
    return union


def tune_ease(train: np.ndarray, valid: np.ndarray, lambdas=DEFAULT_LAMBDAS, metric: str = "ap@10", excluded=None):
    """λ of ``lambdas`` with the best validation ``metric``: ``(lam, scores, {lam: valid metrics})``. ``excluded``:
    the matrix of the items valid's rankings leave out (default ``train``)."""
    best, by_lambda = None, {}
    for lam in lambdas:
        scores = ease_scores(train, lam)
        result = evaluate_scores(scores, train if excluded is None else excluded, valid)
        by_lambda[float(lam)] = result
        if best is None or result[metric] > best[0]:
            best = (result[metric], float(lam), scores)
    return best[1], best[2], by_lambda


def baselines(root: str | Path, lambdas=DEFAULT_LAMBDAS, als_grid=None, als: bool = True) -> dict:
    """Test (and valid) metrics of popularity, λ-tuned EASE and grid-tuned ALS (``als_grid``: ``ALS_GRID`` with
    these entries replaced; ``als=False``: no ALS) on the dataset at ``root``; ``seconds`` of each."""
    matrices = {split: split_matrix(root, split) for split in ("train", "valid", "test")}
    train, valid, test = matrices["train"], matrices["valid"], matrices["test"]
    out_valid, out_test = excluded_matrix(root, "valid", matrices), excluded_matrix(root, "test", matrices)
    started = time.perf_counter()
    popularity = popularity_scores(train)
    out = {
        "popularity": {
            "valid": evaluate_scores(popularity, out_valid, valid),
            "test": evaluate_scores(popularity, out_test, test),
        }
    }
    lam, scores, by_lambda = tune_ease(train, valid, lambdas, excluded=out_valid)
    out["ease"] = {
        "lambda": lam,
        "valid": by_lambda[lam],
        "test": evaluate_scores(scores, out_test, test),
        "valid_by_lambda": {str(k): v["ap@10"] for k, v in by_lambda.items()},
    }
    out["seconds"] = {"popularity and ease": time.perf_counter() - started}
    if als:
        tick = time.perf_counter()
        params, by_point = tune_als(train, valid, als_grid, excluded=out_valid)
        key = "/".join(f"{value:g}" for value in params.values())
        out["als"] = dict(
            params, valid=by_point[key], test=evaluate_scores(als_scores(train, **params), out_test, test)
        )
        out["als"]["valid_by_point"] = {point: result["ap@10"] for point, result in by_point.items()}
        out["seconds"]["als"] = time.perf_counter() - tick
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("roots", nargs="+", metavar="DATA_ROOT", help="bigrank datasets (e.g. one per split seed)")
    parser.add_argument("--lambdas", type=float, nargs="+", default=list(DEFAULT_LAMBDAS))
    for key, values in ALS_GRID.items():
        kind = int if key in ("factors", "iterations") else float
        parser.add_argument(
            f"--als-{key}", type=kind, nargs="+", default=list(values), help=f"ALS grid: {key} (default {values})"
        )
    parser.add_argument("--no-als", dest="als", action="store_false", help="popularity and EASE only")
    parser.add_argument("--json", default=None, help="also write the results to this file")
    args = parser.parse_args()
    grid = {key: tuple(getattr(args, f"als_{key}")) for key in ALS_GRID}
    results = {}
    for root in args.roots:
        results[root] = baselines(root, args.lambdas, grid, als=args.als)
        for name in ("popularity", "ease", "als"):
            if name not in results[root]:
                continue
            test = results[root][name]["test"]
            extra = {
                "ease": lambda r: f" lambda={r['lambda']:g}",
                "als": lambda r: " " + " ".join(f"{key}={r[key]:g}" for key in ALS_GRID),
            }.get(name, lambda r: "")(results[root][name])
            print(
                f"{root} {name:<11} AP@10 {test['ap@10']:.4f}  NDCG@20 {test['ndcg@20']:.4f}  "
                f"R@20 {test['recall@20']:.4f}  R@100 {test['recall@100']:.4f}  Acc {test['accuracy']:.4f}{extra}",
                flush=True,
            )
        if "als" in results[root]:
            for warning in als_at_grid_edge(results[root]["als"], grid):
                print(f"{root} {warning}")
        print(f"{root} seconds: " + ", ".join(f"{k} {v:.0f}" for k, v in results[root]["seconds"].items()))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1, default=float))


if __name__ == "__main__":
    main()
