"""Synthetic seed and presets: the demo's shape, determinism, no duplicates, disjoint splits, and latent
structure that an oracle ranking can exploit."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest

from bigrank.data import manifest as layout
from bigrank.data.stream import read_user_items
from bigrank.data.synthetic import PRESETS, generate, load_truth, make_seed


def digest(root) -> str:
    manifest = layout.load_manifest(root)
    h = hashlib.sha256()
    for split in layout.SPLITS:
        for name in manifest["splits"][split]["files"]:
            h.update((root / name).read_bytes())
    return h.hexdigest()


def test_demo_is_small_and_complete(demo_data):
    manifest = layout.validate_dataset(demo_data, deep=True)
    assert manifest["num_users"] == 2000 and 1000 <= manifest["num_items"] <= 3000
    assert 100_000 <= manifest["num_ratings"] <= 200_000
    rows = {s: manifest["splits"][s]["rows"] for s in layout.SPLITS}
    assert abs(rows["train"] - 0.8 * manifest["num_ratings"]) <= 1
    assert abs(rows["valid"] - 0.1 * manifest["num_ratings"]) <= 1
    assert manifest["truth"] == "truth.npz" and manifest["generator"]["preset"] == "demo"


def test_pairs_unique_splits_disjoint_min_activity(demo_data):
    keys = {}
    for split in layout.SPLITS:
        indptr, items = read_user_items(demo_data, split)
        users = np.repeat(np.arange(len(indptr) - 1), np.diff(indptr))
        keys[split] = users.astype(np.int64) * 10_000 + items
    everything = np.concatenate(list(keys.values()))
    assert len(np.unique(everything)) == len(everything)  # no duplicate pair within or across splits
    per_user = np.bincount(everything // 10_000, minlength=2000)
    assert per_user.min() >= 20


def test_same_seed_same_bytes_other_seed_differs(demo_data, tmp_path):
    generate("demo", tmp_path / "again", seed=0, progress=False)
    generate("demo", tmp_path / "other", seed=1, progress=False)
    assert digest(tmp_path / "again") == digest(demo_data)
    assert digest(tmp_path / "other") != digest(demo_data)


def test_existing_output_is_refused_or_resumed(demo_data):
    with pytest.raises(ValueError, match="already holds a dataset"):
        generate("demo", demo_data, progress=False)
    assert generate("demo", demo_data, resume=True, progress=False) == layout.load_manifest(demo_data)
    with pytest.raises(ValueError, match="unknown preset"):
        generate("ml2b", demo_data)


def recall_at(scores: np.ndarray, train, test, k: int) -> float:
    """Mean over users with test items of |top-k (train excluded) ∩ test| / min(k, |test|)."""
    (t_ptr, t_items), (h_ptr, h_items) = train, test
    hits = []
    for user in range(len(t_ptr) - 1):
        held = h_items[h_ptr[user] : h_ptr[user + 1]]
        if len(held) == 0:
            continue
        row = scores[user].copy()
        row[t_items[t_ptr[user] : t_ptr[user + 1]]] = -np.inf
        top = np.argpartition(-row, k)[:k]
        hits.append(len(np.intersect1d(top, held)) / min(k, len(held)))
    return float(np.mean(hits))


def test_oracle_ranking_beats_popularity(demo_data):
    """There is something to learn: the true factors rank held-out items far better than popularity."""
    user_factors, item_factors = load_truth(demo_data)
    assert user_factors.shape == (2000, 17) and item_factors.shape[1] == 17
    np.testing.assert_allclose(item_factors.sum(axis=0), 1.0, rtol=1e-4)  # each topic is a distribution
    train, test = read_user_items(demo_data, "train"), read_user_items(demo_data, "test")
    popularity = np.bincount(train[1], minlength=item_factors.shape[0]).astype(float)
    oracle = recall_at(user_factors @ item_factors.T, train, test, 20)
    popular = recall_at(np.tile(popularity, (2000, 1)), train, test, 20)
    assert oracle > 1.5 * popular, (oracle, popular)


def test_seed_is_heavy_tailed_and_meets_minimum():
    spec = PRESETS["demo"]["seed"]
    seed = make_seed(spec, seed=3)
    per_user = np.bincount(seed.users, minlength=spec.num_users)
    per_item = np.bincount(seed.items, minlength=spec.num_items)
    assert per_user.min() >= spec.min_ratings_per_user
    assert per_user.max() > 3 * np.median(per_user)  # heavy-tailed activity
    top = np.sort(per_item)[::-1]
    assert top[: len(top) // 10].sum() > 0.3 * top.sum()  # top 10% of items hold > 30% of ratings
    keys = seed.users.astype(np.int64) * spec.num_items + seed.items
    assert np.all(np.diff(keys) > 0)  # sorted and unique


def test_manifest_is_json_with_contract_keys(demo_data):
    manifest = json.loads((demo_data / "manifest.json").read_text())
    for key in ("format_version", "num_users", "num_items", "splits", "schema", "seed", "source", "generator"):
        assert key in manifest
