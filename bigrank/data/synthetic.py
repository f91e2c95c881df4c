"""Synthetic rating data: a MovieLens-like seed with known latent factors, and the generate presets.

The seed is drawn from a topic (non-negative latent-factor) model, so there is something to learn and the
best possible ranking is known:

    P(item i | user u) = sum_z theta[u, z] * phi[z, i]                      (z over K topics + 1)

* ``theta[u]`` ~ Dirichlet(alpha_user) over K topics, scaled by ``1 - background``; the last "topic" has
  weight ``background`` and its item distribution is the global popularity (users also follow the crowd).
* ``phi[z, i]`` is proportional to ``popularity[i] * affinity[i, z]``, with popularity log-normal (heavy
  tail) and ``affinity[i]`` ~ Dirichlet(alpha_item): each item belongs mostly to one or two topics.
* User activity is ``min_ratings + LogNormal`` (heavy tail), capped at a fraction of the catalog; each
  user's items are drawn without repetition from ``P(. | u)`` (draw, drop duplicates, redraw the deficit).

The true factors are saved as ``<root>/truth.npz``: ``user_factors`` (num_users x (K+1), theta) and
``item_factors`` (num_items x (K+1), phi transposed); ``user_factors @ item_factors.T`` is the generator's
``P(i | u)``, so ranking its row (minus the train items) is the oracle ranking.

Presets (``generate(preset, out)``):

* ``demo``  — 2,000 users x 1,500 items, ~150K ratings, one second; for tests and ``make demo``.
* ``ml20m`` — ML-20M-like: 138,493 users x 26,744 items, ~20M ratings, >= 20 ratings per user.
* ``ml1b``  — the ``ml20m`` seed expanded 16 x 32 by the randomized fractal expansion (Belletti et al.,
  2019; see ``bigrank.data.expansion``): ~2.2M users x ~850K items, ~1B ratings. The keep probabilities
  are scaled by one common factor so the expected size is 1.0e9 ratings (our seed's spectrum is not
  ML-20M's; unscaled, the folded matrix averages ~0.16 and would give ~1.7B). No ``truth.npz``: the
  expansion mixes seed users, so the seed factors do not describe the expanded users.

Splits: 80/10/10 at random over the (user, item) pairs (the Rankmax paper's protocol).
"""

from __future__ import annotations

import shutil
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from bigrank.data import manifest as layout
from bigrank.data.expansion import expand_ratings
from bigrank.data.user_index import write_manifest_with_indexes

TRUTH_NAME = "truth.npz"


@dataclass(frozen=True)
class SeedSpec:
    """Parameters of the synthetic seed (see the module docstring for the model)."""

    num_users: int
    num_items: int
    mean_ratings_per_user: float
    min_ratings_per_user: int = 20
    max_ratings_fraction: float = 0.3
    num_topics: int = 32
    alpha_user: float = 0.1
    alpha_item: float = 0.1
    background: float = 0.15
    popularity_sigma: float = 2.0
    activity_sigma: float = 1.1


PRESETS = {
    "demo": {"seed": SeedSpec(2_000, 1_500, 75.0, max_ratings_fraction=0.2, num_topics=16), "expand": None},
    "ml20m": {"seed": SeedSpec(138_493, 26_744, 144.4), "expand": None},
    "ml1b": {"seed": SeedSpec(138_493, 26_744, 144.4), "expand": (16, 32), "target_ratings": 1.0e9},
}


@dataclass
class SeedRatings:
    """A seed rating matrix as (user, item) pairs sorted by user then item, with its true factors."""

    users: np.ndarray  # (N,) int32
    items: np.ndarray  # (N,) int32
    num_users: int
    num_items: int
    user_factors: np.ndarray | None = None  # (num_users, K+1) float32
    item_factors: np.ndarray | None = None  # (num_items, K+1) float32


def _dirichlet(rng: np.random.Generator, alpha: float, rows: int, cols: int) -> np.ndarray:
    # Gamma normalisation: numpy's dirichlet is slow per row; the floor avoids all-zero rows.
    gammas = rng.standard_gamma(alpha, size=(rows, cols)) + 1e-12
    return gammas / gammas.sum(axis=1, keepdims=True)


def make_seed(spec: SeedSpec, seed: int = 0, progress: bool = False) -> SeedRatings:
    """Draw the seed ratings of ``spec`` (deterministic for ``seed``); see the module docstring.

    Returns pairs sorted by (user, item), without duplicates, every user with at least
    ``min_ratings_per_user`` ratings (when the catalog allows it), and the true factors.
    """
    rng = np.random.default_rng([seed, 0x5EED])
    num_users, num_items, topics = spec.num_users, spec.num_items, spec.num_topics

    popularity = rng.lognormal(0.0, spec.popularity_sigma, size=num_items)
    affinity = _dirichlet(rng, spec.alpha_item, num_items, topics)
    phi = np.empty((topics + 1, num_items))
    phi[:topics] = (popularity[:, None] * affinity).T
    phi[topics] = popularity
    phi /= phi.sum(axis=1, keepdims=True)
    theta = np.empty((num_users, topics + 1))
    theta[:, :topics] = (1.0 - spec.background) * _dirichlet(rng, spec.alpha_user, num_users, topics)
    theta[:, topics] = spec.background

    cap = max(spec.min_ratings_per_user, int(spec.max_ratings_fraction * num_items))
    excess_mean = max(spec.mean_ratings_per_user - spec.min_ratings_per_user, 1.0)
    mu = np.log(excess_mean) - spec.activity_sigma**2 / 2
    activity = spec.min_ratings_per_user + np.floor(rng.lognormal(mu, spec.activity_sigma, size=num_users))
    activity = np.minimum(activity, cap).astype(np.int64)

    cdf = np.cumsum(phi, axis=1)
    cdf /= cdf[:, -1:]
    keys = np.empty(0, dtype=np.int64)
    have = np.zeros(num_users, dtype=np.int64)
    for _round in range(12):
        need = activity - have
        if need.sum() <= 0.0005 * activity.sum():
            break
        keys_new = _draw_pairs(rng, theta, cdf, need, num_items)
        keys_new = sorted_unique(keys_new)
        if len(keys):
            seen = keys[np.minimum(np.searchsorted(keys, keys_new), len(keys) - 1)] == keys_new
            keys_new = keys_new[~seen]
        # Each user drew exactly need[u] items, so after dropping repeats nobody exceeds its activity.
        keys = np.sort(np.concatenate([keys, keys_new]))
        have = np.bincount(keys // num_items, minlength=num_users)
        if progress:
            print(f"seed round {_round}: {len(keys):,} pairs", file=sys.stderr)
    return SeedRatings(
        users=(keys // num_items).astype(np.int32),
        items=(keys % num_items).astype(np.int32),
        num_users=num_users,
        num_items=num_items,
        user_factors=theta.astype(np.float32),
        item_factors=phi.T.astype(np.float32),
    )


def sorted_unique(values: np.ndarray) -> np.ndarray:
    """Sorted distinct values (numpy 2's hash-based ``np.unique`` is ~10x slower on 20M int64 keys)."""
    values = np.sort(values)
    if len(values) == 0:
        return values
    keep = np.empty(len(values), dtype=bool)
    keep[0] = True
    np.not_equal(values[1:], values[:-1], out=keep[1:])
    return values[keep]


def _draw_pairs(rng, theta, cdf, need, num_items) -> np.ndarray:
    """Draw ``need[u]`` items for every user u from P(. | u) with repetition; returns keys u*I + i."""
    users = np.flatnonzero(need > 0)
    counts = rng.multinomial(need[users], theta[users])  # (U', K+1) items per (user, topic)
    topic_of_draw = np.repeat(np.tile(np.arange(theta.shape[1], dtype=np.int8), len(users)), counts.ravel())
    user_of_draw = np.repeat(users, need[users])
    items = np.empty(len(topic_of_draw), dtype=np.int64)
    for topic in range(theta.shape[1]):
        mask = topic_of_draw == topic
        draws = rng.random(int(mask.sum()))
        items[mask] = np.minimum(np.searchsorted(cdf[topic], draws, side="right"), num_items - 1)
    return user_of_draw.astype(np.int64) * num_items + items


def write_seed_dataset(seed_ratings: SeedRatings, out: str | Path, seed: int, source: str, generator: dict):
    """Split the seed 80/10/10 at random, write the splits, ``truth.npz`` and (last) the manifest."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    layout.remove_stale_temporaries(out)
    labels = layout.random_split_labels(np.random.default_rng([seed, 0x5B17]), len(seed_ratings.users))
    split_files = {}
    for label, split in enumerate(layout.SPLITS):
        mask = labels == label
        columns = {"user_id": seed_ratings.users[mask], "item_id": seed_ratings.items[mask]}
        split_files[split] = layout.write_split_parts(out, split, columns)
    if seed_ratings.user_factors is not None:
        tmp = layout.temporary_path(out / TRUTH_NAME)
        with open(tmp, "wb") as handle:
            np.savez(handle, user_factors=seed_ratings.user_factors, item_factors=seed_ratings.item_factors)
        tmp.replace(out / TRUTH_NAME)
    rated_items = int(np.count_nonzero(np.bincount(seed_ratings.items, minlength=seed_ratings.num_items)))
    rated_users = int(np.count_nonzero(np.bincount(seed_ratings.users, minlength=seed_ratings.num_users)))
    return write_manifest_with_indexes(
        out,
        num_users=seed_ratings.num_users,
        num_items=seed_ratings.num_items,
        split_files=split_files,
        seed=seed,
        source=source,
        generator=generator,
        extra={
            "num_rated_users": rated_users,
            "num_rated_items": rated_items,
            "truth": TRUTH_NAME if seed_ratings.user_factors is not None else None,
        },
    )


def load_truth(root: str | Path) -> tuple[np.ndarray, np.ndarray]:
    """``(user_factors, item_factors)`` of a synthetic dataset; their product is the true P(i | u)."""
    path = Path(root) / TRUTH_NAME
    if not path.is_file():
        raise FileNotFoundError(f"no {TRUTH_NAME} in {root}: only un-expanded synthetic datasets have one")
    with np.load(path) as data:
        return data["user_factors"], data["item_factors"]


def _prepare_output(out: Path, generator: dict, resume: bool) -> dict | None:
    """Return the existing manifest when ``out`` already holds this dataset and ``resume`` is set."""
    if (out / layout.MANIFEST_NAME).is_file():
        if not resume:
            raise ValueError(f"{out} already holds a dataset; choose a new --out or pass --resume")
        manifest = layout.load_manifest(out)
        if manifest["generator"] != generator:
            raise ValueError(
                f"{out} holds a dataset generated with other parameters ({manifest['generator']}); choose a new --out"
            )
        return manifest
    if out.exists() and any(out.iterdir()) and not resume:
        raise ValueError(f"{out} is not empty; choose a new --out or pass --resume to continue a run")
    return None


def generate(preset: str, out: str | Path, seed: int = 0, resume: bool = False, progress: bool = True) -> dict:
    """Generate the synthetic dataset ``preset`` (demo | ml20m | ml1b) under ``out``; returns the manifest.

    Deterministic for a given ``seed``. ``resume=True`` continues an interrupted run (for ``ml1b``, from
    the expansion blocks already written) or returns the finished dataset's manifest.
    """
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
    out = Path(out)
    spec = PRESETS[preset]["seed"]
    expand = PRESETS[preset]["expand"]
    generator = {"preset": preset, "seed_spec": asdict(spec), "expand": list(expand) if expand else None}
    if expand is None:
        existing = _prepare_output(out, generator, resume)
        if existing is not None:
            return existing
    started = time.perf_counter()
    seed_ratings = make_seed(spec, seed=seed, progress=progress and spec.num_users > 10_000)
    if progress:
        print(
            f"seed: {seed_ratings.num_users:,} users x {seed_ratings.num_items:,} items, "
            f"{len(seed_ratings.users):,} ratings in {time.perf_counter() - started:.1f}s",
            file=sys.stderr,
        )
    if expand is None:
        return write_seed_dataset(seed_ratings, out, seed, source=f"synthetic:{preset}", generator=generator)
    return expand_ratings(
        seed_ratings.users,
        seed_ratings.items,
        seed_ratings.num_users,
        seed_ratings.num_items,
        out,
        multiplier=expand,
        seed=seed,
        resume=resume,
        progress=progress,
        source=f"synthetic:{preset}",
        generator=generator,
        target_ratings=PRESETS[preset].get("target_ratings"),
    )


def remove_dataset(root: str | Path) -> None:
    """Delete a dataset directory (used by benchmarks and tests for their scratch copies)."""
    shutil.rmtree(root, ignore_errors=True)
