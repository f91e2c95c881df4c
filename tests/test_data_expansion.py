"""Fractal expansion: shape, per-block keep rates, id ranges, no duplicates, determinism and resume."""

from __future__ import annotations

import hashlib
import signal
import subprocess
import sys
import time

import numpy as np
import pyarrow.parquet as pq
import pytest

from bigrank.data import expansion
from bigrank.data import manifest as layout
from bigrank.data.synthetic import SeedSpec, make_seed

SPEC = SeedSpec(300, 200, 40.0, max_ratings_fraction=0.3, num_topics=8)
MULTIPLIER = (3, 4)


@pytest.fixture(scope="module")
def seed():
    return make_seed(SPEC, seed=0)


def expand(seed_ratings, out, **options):
    return expansion.expand_ratings(
        seed_ratings.users,
        seed_ratings.items,
        SPEC.num_users,
        SPEC.num_items,
        out,
        multiplier=MULTIPLIER,
        progress=False,
        **options,
    )


def read_block_pairs(root, block):
    users, items = [], []
    for split in layout.SPLITS:
        path = root / layout.part_name(split, block)
        if path.exists():
            table = pq.read_table(path)
            users.append(table.column("user_id").to_numpy())
            items.append(table.column("item_id").to_numpy())
    return np.concatenate(users), np.concatenate(items)


def test_randomized_svd_matches_dense_svd(seed):
    dense = np.zeros((SPEC.num_users, SPEC.num_items))
    dense[seed.users, seed.items] = 1.0
    _, s, vt = expansion.randomized_svd(seed.users, seed.items, SPEC.num_users, SPEC.num_items, 5)
    exact = np.linalg.svd(dense, compute_uv=False)[:5]
    np.testing.assert_allclose(s, exact, rtol=1e-3)
    assert vt.shape == (5, SPEC.num_items)


def test_reduced_matrix_is_a_probability_grid(seed):
    reduced = expansion.reduced_matrix(seed.users, seed.items, SPEC.num_users, SPEC.num_items, (16, 32))
    assert reduced.shape == (16, 32)
    assert reduced.min() >= 0.05 and reduced.max() <= 0.99
    scaled = expansion.reduced_matrix(
        seed.users, seed.items, SPEC.num_users, SPEC.num_items, (16, 32), target_ratings=80 * len(seed.users)
    )
    assert abs(scaled.sum() * len(seed.users) - 80 * len(seed.users)) < 1e-3 * 80 * len(seed.users)
    with pytest.raises(ValueError, match="outside"):
        expansion.scale_to_target(reduced, len(seed.users), 1.0)


def test_expansion_shape_keep_rates_and_uniqueness(seed, tmp_path):
    manifest = expand(seed, tmp_path)
    rows, cols = MULTIPLIER
    assert manifest["num_users"] == rows * SPEC.num_users and manifest["num_items"] == cols * SPEC.num_items
    assert not (tmp_path / expansion.WORK_DIR).exists()
    layout.validate_dataset(tmp_path, deep=True)
    reduced = np.asarray(manifest["generator"]["reduced_matrix"])
    nnz = len(seed.users)
    all_keys = []
    for block in range(rows * cols):
        i, j = divmod(block, cols)
        users, items = read_block_pairs(tmp_path, block)
        # ids stay inside the block's row and column ranges
        assert users.min() >= i * SPEC.num_users and users.max() < (i + 1) * SPEC.num_users
        assert items.min() >= j * SPEC.num_items and items.max() < (j + 1) * SPEC.num_items
        # keep rate: binomial(nnz, R_hat[i, j]) within 5 standard deviations
        p = reduced[i, j]
        assert abs(len(users) - nnz * p) < 5 * np.sqrt(nnz * p * (1 - p)) + 1, (block, len(users), nnz * p)
        # a block is the seed with rows/columns permuted: row and column degree multisets are thinned seed ones
        assert len(np.unique(users)) <= SPEC.num_users and len(np.unique(items)) <= SPEC.num_items
        all_keys.append(users.astype(np.int64) * manifest["num_items"] + items)
    all_keys = np.concatenate(all_keys)
    assert len(np.unique(all_keys)) == len(all_keys) == manifest["num_ratings"]
    splits = np.array([manifest["splits"][s]["rows"] for s in layout.SPLITS]) / manifest["num_ratings"]
    np.testing.assert_allclose(splits, [0.8, 0.1, 0.1], atol=0.01)
    assert manifest["num_rated_items"] <= manifest["num_items"]


def test_expansion_block_is_a_permuted_thinning_of_the_seed(seed, tmp_path):
    """With keep probability 1 everywhere, each block is exactly the seed up to row/column permutations."""
    users, items, _ = expansion._block_pairs(
        seed.users, seed.items, SPEC.num_users, SPEC.num_items, 5, MULTIPLIER, 1.0, 0
    )
    assert len(users) == len(seed.users)
    seed_degrees = np.sort(np.bincount(seed.users, minlength=SPEC.num_users))
    block_degrees = np.sort(
        np.bincount(users - users.min() // SPEC.num_users * SPEC.num_users, minlength=SPEC.num_users)
    )
    assert np.array_equal(seed_degrees, block_degrees)


def digest(root) -> str:
    h = hashlib.sha256()
    manifest = layout.load_manifest(root)
    for split in layout.SPLITS:
        for name in manifest["splits"][split]["files"]:
            h.update(name.encode() + (root / name).read_bytes())
    return h.hexdigest()


def test_deterministic_and_resumes_after_a_kill(seed, tmp_path, monkeypatch):
    reference = expand(seed, tmp_path / "reference")
    original = expansion._block_pairs

    def dies_at_block_7(users, items, num_users, num_items, block, *args):
        if block == 7:
            raise KeyboardInterrupt("killed")
        return original(users, items, num_users, num_items, block, *args)

    monkeypatch.setattr(expansion, "_block_pairs", dies_at_block_7)
    with pytest.raises(KeyboardInterrupt):
        expand(seed, tmp_path / "resumed")
    assert not (tmp_path / "resumed" / layout.MANIFEST_NAME).exists()  # unfinished: no manifest
    done = sorted((tmp_path / "resumed" / expansion.WORK_DIR / "blocks").glob("block-*.json"))
    assert len(done) == 7
    with pytest.raises(ValueError, match="--resume"):
        expand(seed, tmp_path / "resumed")
    monkeypatch.setattr(expansion, "_block_pairs", original)
    resumed = expand(seed, tmp_path / "resumed", resume=True)
    assert digest(tmp_path / "resumed") == digest(tmp_path / "reference")
    assert resumed["splits"] == reference["splits"]
    other = expand(seed, tmp_path / "other", seed=1)
    assert digest(tmp_path / "other") != digest(tmp_path / "reference") and other["num_ratings"] > 0


def test_parse_multiplier():
    assert expansion.parse_multiplier("16x32") == (16, 32)
    for bad in ("16", "0x3", "ax2", "2x3x4"):
        with pytest.raises(ValueError, match="ROWSxCOLS"):
            expansion.parse_multiplier(bad)


def test_sigkilled_cli_run_resumes_to_identical_files(tmp_path):
    """A real `bigrank generate` process killed with SIGKILL mid-expansion (3 of its 256 blocks done) resumes with
    --resume to the files of an uninterrupted run."""
    from bigrank.cli import main
    from bigrank.data.synthetic import generate

    seed_root = tmp_path / "seed"
    generate("demo", seed_root, progress=False)
    args = ["generate", "--seed-ratings", str(seed_root), "--expand", "16x16", "--no-progress"]
    killed, log = tmp_path / "killed", tmp_path / "killed.log"
    with open(log, "w") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "bigrank.cli", *args, "--out", str(killed)], stdout=out, stderr=subprocess.STDOUT
        )
    markers = killed / expansion.WORK_DIR / "blocks"
    while process.poll() is None and len(list(markers.glob("block-*.json"))) < 3:
        time.sleep(0.005)
    assert process.poll() is None, f"bigrank generate ended before the kill ({process.returncode}):\n{log.read_text()}"
    process.kill()
    assert process.wait() == -signal.SIGKILL, log.read_text()
    assert 3 <= len(list(markers.glob("block-*.json"))) < 256  # killed mid-run
    with pytest.raises(FileNotFoundError, match="did not finish"):
        layout.load_manifest(killed)
    assert main([*args, "--out", str(killed), "--resume"]) == 0
    assert main([*args, "--out", str(tmp_path / "reference")]) == 0
    assert digest(killed) == digest(tmp_path / "reference")
    assert not list(killed.rglob(".*.tmp-*")) and not (killed / expansion.WORK_DIR).exists()
