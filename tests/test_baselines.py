"""The benchmark baselines and the paired comparison of ``benchmarks.baselines`` against brute-force references."""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks.baselines import (
    als_factors,
    als_scores,
    ease_scores,
    evaluate_scores,
    export_scores,
    paired_difference,
    per_user_metrics,
    popularity_scores,
    split_matrix,
    tune_als,
)


def _random_splits(users=40, items=30, seed=0):
    """Disjoint binary train / held-out matrices; item 0 is never trained on, user 0 holds nothing out."""
    rng = np.random.default_rng(seed)
    pairs = rng.random((users, items))
    train = (pairs < 0.25).astype(np.float32)
    heldout = ((pairs >= 0.25) & (pairs < 0.35)).astype(np.float32)
    train[:, 0] = 0
    heldout[0] = 0
    return train, heldout


def test_ease_is_a_ridge_regression_of_each_item_on_the_other_items():
    # EASE's zero diagonal means column j is predicted from the other columns only: an independent ridge
    # regression per item (Steck 2019, eq. 1-3), solved here one item at a time.
    train, _ = _random_splits()
    lam = 4.0
    x = train.astype(np.float64)
    expected = np.zeros_like(x)
    for j in range(x.shape[1]):
        others = [i for i in range(x.shape[1]) if i != j and x[:, i].any()]
        if not x[:, j].any():
            continue  # an item without train pairs has no weights: its scores stay 0
        a = x[:, others]
        weights = np.linalg.solve(a.T @ a + lam * np.eye(len(others)), a.T @ x[:, j])
        expected[:, j] = a @ weights
    np.testing.assert_allclose(ease_scores(train, lam), expected, atol=2e-5)
    with pytest.raises(ValueError, match="lambda > 0"):
        ease_scores(train, 0.0)


@pytest.mark.parametrize("shape", [(40, 30), (12, 50)], ids=["more users", "more items"])
def test_ease_from_the_users_side_equals_the_item_inverse(shape):
    # Fewer users than items: the scores come from Woodbury's identity on the m x m side; they equal the n x n
    # inverse's (float64 reference), items without train pairs included (their scores stay 0).
    train, _ = _random_splits(*shape, seed=3)
    x = train.astype(np.float64)
    seen = np.flatnonzero(x.sum(axis=0) > 0)
    for lam in (0.5, 30.0):
        precision = np.linalg.inv(x[:, seen].T @ x[:, seen] + lam * np.eye(len(seen)))
        expected = np.zeros_like(x)
        expected[:, seen] = x[:, seen] - (x[:, seen] @ precision) / np.diag(precision)
        np.testing.assert_allclose(ease_scores(train, lam), expected, atol=2e-5)


def test_als_factors_solve_the_weighted_least_squares_of_hu_koren_volinsky():
    # Each ALS iteration ends with the items solved given the users; at the fixed point (many iterations of a
    # small problem) each item's factors are the exact weighted ridge solution, confidence alpha on the item's
    # train pairs and 1 on the other users, target 1 on train pairs and 0 elsewhere (Hu et al. 2008, eq. 4):
    # y_i = (Xᵀ C_i X + λ I)⁻¹ Xᵀ C_i p_i, solved here item by item from the fitted user factors.
    train, _ = _random_splits(30, 25, seed=4)
    lam, alpha = 0.5, 8.0
    users, items = (f.astype(np.float64) for f in als_factors(train, 4, lam, alpha, 300, seed=1, threads=1))
    for item in range(train.shape[1]):
        liked = train[:, item] > 0
        confidence = np.where(liked, alpha, 1.0)
        exact = np.linalg.solve(
            users.T @ (confidence[:, None] * users) + lam * np.eye(4), users.T @ (confidence * liked)
        )
        np.testing.assert_allclose(items[item], exact, atol=1e-3, err_msg=f"item {item}")


def test_als_picks_at_the_edge_of_the_grid_are_flagged():
    from benchmarks.baselines import als_at_grid_edge

    grid = {"factors": (64, 256), "regularization": (3.0, 10.0, 30.0), "alpha": (3.0,), "iterations": (5, 15)}
    inside = {"factors": 64, "regularization": 10.0, "alpha": 3.0, "iterations": 15}
    assert als_at_grid_edge(inside, grid) == [
        "warning: ALS picked factors = 64, the smallest of the grid [64, 256]; widen it"
    ]
    assert als_at_grid_edge(dict(inside, factors=128), dict(grid, factors=(64, 128, 256))) == []  # a 1-value alpha
    assert "regularization = 30, the largest" in als_at_grid_edge(dict(inside, regularization=30.0), grid)[1]


def test_als_after_n_iterations_equals_a_fit_of_n_iterations():
    train, _ = _random_splits(seed=5)
    seen = {}
    als_scores(train, 8, 0.1, 5.0, 6, seed=2, after={3: lambda s: seen.setdefault(3, s)})
    np.testing.assert_allclose(seen[3], als_scores(train, 8, 0.1, 5.0, 3, seed=2), rtol=1e-5, atol=1e-6)


def test_tune_als_picks_the_grid_point_with_the_best_validation_metric():
    train, valid = _random_splits(60, 40, seed=6)
    grid = {"factors": (4, 8), "regularization": (0.1, 10.0), "alpha": (1.0, 10.0), "iterations": (2, 5)}
    params, by_point = tune_als(train, valid, grid, metric="ndcg@20")
    assert len(by_point) == 16
    best = max(by_point, key=lambda key: by_point[key]["ndcg@20"])
    assert "/".join(f"{v:g}" for v in params.values()) == best
    assert by_point[best] == evaluate_scores(als_scores(train, **params), train, valid)


def _explicit_metrics(scores, train, heldout, k):
    """Accuracy, recall@k and AP@k (normalised by min(k, |R|)) by explicit loops over the users."""
    rows = []
    for user in range(scores.shape[0]):
        relevant = set(np.flatnonzero(heldout[user]))
        if not relevant:
            continue
        ranked = [i for i in np.argsort(-scores[user], kind="stable") if not train[user, i]][:k]
        hits = [item in relevant for item in ranked]
        precision_sum = sum(sum(hits[: r + 1]) / (r + 1) for r in range(k) if hits[r])
        rows.append((float(hits[0]), sum(hits) / len(relevant), precision_sum / min(k, len(relevant))))
    return np.array(rows)


def test_evaluate_and_per_user_metrics_match_explicit_loops():
    train, heldout = _random_splits()
    scores = np.random.default_rng(1).standard_normal(train.shape).astype(np.float32)
    expected = _explicit_metrics(scores, train, heldout, k=5)
    per_user = per_user_metrics(scores, train, heldout, ks=(5,))
    np.testing.assert_allclose(per_user["accuracy"], expected[:, 0])
    np.testing.assert_allclose(per_user["recall@5"], expected[:, 1])
    np.testing.assert_allclose(per_user["ap@5"], expected[:, 2])
    overall = evaluate_scores(scores, train, heldout, ks=(5,))
    assert overall["users"] == len(expected) == int((heldout.sum(axis=1) > 0).sum()) < train.shape[0]
    for name, column in (("accuracy", 0), ("recall@5", 1), ("ap@5", 2)):
        assert overall[name] == pytest.approx(expected[:, column].mean())


def test_paired_difference_is_the_mean_difference_with_a_bootstrap_interval():
    rng = np.random.default_rng(2)
    first = [rng.random(50), rng.random(80)]
    assert paired_difference(first, first) == (0.0, 0.0, 0.0)
    shifted = [a - 0.1 for a in first]
    np.testing.assert_allclose(paired_difference(first, shifted), (0.1, 0.1, 0.1))
    second = [rng.random(50), rng.random(80)]
    mean, low, high = paired_difference(first, second, resamples=4000)
    assert mean == pytest.approx(np.mean([(a - b).mean() for a, b in zip(first, second, strict=True)]))
    assert low < mean < high
    # The interval of the mean over 2 seeds: about 1.96 * sqrt(mean_s var_s / n_s) / sqrt(2), drawn from the pairs.
    spread = np.sqrt(np.mean([(a - b).var() / a.size for a, b in zip(first, second, strict=True)]) / 2)
    assert (high - low) == pytest.approx(2 * 1.96 * spread, rel=0.15)
    assert paired_difference(first, second, resamples=4000) == (mean, low, high)  # seeded
    with pytest.raises(ValueError, match="same number"):
        paired_difference(first, second[:1])
    with pytest.raises(ValueError, match="paired 1-D arrays"):
        paired_difference([first[0]], [second[1]])


def test_export_scores_of_a_history_tower_follow_the_recommenders_user_vectors(tmp_path):
    from bigrank.export.recommend import Recommender
    from tests.helpers import random_tables, write_export, write_ingested_dataset

    dataset = tmp_path / "data"
    num_users, num_items = 157, 301
    write_ingested_dataset(dataset, num_users, num_items)
    tables = random_tables(num_items, num_users)
    write_export(tmp_path / "export", tables, dataset_root=dataset, user_vectors=None)  # a history tower's rows
    train = split_matrix(dataset, "train")
    scores = export_scores(tmp_path / "export", train)
    recommender = Recommender(tmp_path / "export")
    assert recommender.user_vector_rule == "table+history_mean"
    expected = np.stack([recommender.user_vector(u) for u in range(num_users)]) @ tables["items"].numpy().T
    assert scores.shape == (num_users, num_items)
    np.testing.assert_allclose(scores, expected, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="the dataset"):
        export_scores(tmp_path / "export", train[:, :-1])


def test_export_scores_reproduce_the_trainers_test_figures(workflow_run):
    # The trained workflow run, exported and scored by the baselines' code, gives the figures `bigrank train`
    # logged: the table's trained rows and its baselines are measured the same way.
    train, test = split_matrix(workflow_run.data, "train"), split_matrix(workflow_run.data, "test")
    figures = evaluate_scores(export_scores(workflow_run.export, train), train, test, ks=(10,))
    logged = workflow_run.train_eval["test"]
    assert figures["users"] == logged["users"]
    for name in ("accuracy", "recall@10", "ap@10"):
        assert figures[name] == pytest.approx(logged[name], abs=1e-6), name


def test_reproduce_table2_prints_each_losss_paired_differences():
    from benchmarks.reproduce_table2 import format_differences

    rng = np.random.default_rng(3)
    models = ("EASE", "rankmax", "softmax")
    metrics = ("ap@10", "accuracy", "recall@100")
    per_user = {name: [{key: rng.random(30) for key in metrics} for _ in range(2)] for name in models}
    per_user["rankmax"] = [{key: values + 0.5 for key, values in seed.items()} for seed in per_user["EASE"]]
    lines = format_differences(per_user).splitlines()
    assert [line.split()[0:3] for line in lines[1:]] == [
        ["rankmax", "-", "EASE"],
        ["softmax", "-", "EASE"],
        ["rankmax", "-", "softmax"],
    ]
    assert lines[1].split()[3:] == ["+0.500", "[+0.500,", "+0.500]"] * 3  # a constant shift has no spread
    mean, low, high = paired_difference(
        [s["accuracy"] for s in per_user["softmax"]], [s["accuracy"] for s in per_user["EASE"]]
    )
    assert f"{mean:+.3f} [{low:+.3f}, {high:+.3f}]" in lines[2]


def test_reproduce_table2_pairs_each_bf16_run_with_its_fp32_twin():
    from benchmarks.reproduce_table2 import format_differences, variant_name

    rng = np.random.default_rng(4)
    names = ("EASE", "rankmax", variant_name("rankmax", "bf16"), "sampled_softmax", "sampled_softmax-bf16")
    per_user = {name: [{key: rng.random(20) for key in ("ap@10", "accuracy", "recall@100")}] for name in names}
    per_user["rankmax-bf16"] = [{key: values - 0.25 for key, values in seed.items()} for seed in per_user["rankmax"]]
    lines = format_differences(per_user).splitlines()
    assert [line.split()[0:3] for line in lines[1:]] == [
        ["rankmax", "-", "EASE"],
        ["sampled_softmax", "-", "EASE"],
        ["rankmax", "-", "sampled_softmax"],
        ["rankmax-bf16", "-", "rankmax"],
        ["sampled_softmax-bf16", "-", "sampled_softmax"],
    ]
    assert lines[4].split()[3:] == ["-0.250", "[-0.250,", "-0.250]"] * 3
    assert variant_name("softmax", "fp32") == "softmax"


def test_reproduce_table2_splits_accuracy_by_the_users_train_items():
    from benchmarks.reproduce_table2 import format_by_activity

    rng = np.random.default_rng(4)
    activity = [rng.integers(1, 400, 50), rng.integers(1, 400, 40)]
    per_user = {
        name: [{"accuracy": rng.integers(0, 2, len(a)).astype(float)} for a in activity] for name in ("EASE", "rankmax")
    }
    lines = format_by_activity(per_user, activity, edges=(30, 100)).splitlines()
    assert lines[0].split() == ["train", "items", "users", "EASE", "rankmax"]
    for line, (low, high) in zip(lines[1:], [(0, 30), (30, 100), (100, 10**9)], strict=True):
        users = [(seed, u) for seed, a in enumerate(activity) for u in range(len(a)) if low <= a[u] < high]
        expected = [np.mean([per_user[name][seed]["accuracy"][u] for seed, u in users]) for name in per_user]
        assert line.split()[1:] == [str(len(users))] + [f"{value:.3f}" for value in expected]
    assert [line.split()[0] for line in lines[1:]] == ["0-29", "30-99", "100+"]
    # A bucket without users prints dashes, not NaN.
    empty = format_by_activity(per_user, activity, edges=(30, 100, 1000)).splitlines()[-1]
    assert empty.split() == ["1000+", "0", "-", "-"]


def test_reproduce_table2_picks_the_preset_of_the_data_directory(tmp_path):
    from benchmarks.reproduce_table2 import DATASETS, dataset_preset, format_table

    dense = tmp_path / "ml-1m"
    dense.mkdir()
    (dense / "ratings.csv").write_text("userId,movieId,rating,timestamp\n")
    assert dataset_preset(dense) is DATASETS["ml-1m"]
    assert dataset_preset(dense / "ratings.csv") is DATASETS["ml-1m"]  # a ratings file: its directory's name
    assert dataset_preset(tmp_path / "x" / "ml-latest-small") is DATASETS["ml-latest-small"]
    with pytest.raises(SystemExit, match="no preset for 'ml-25m'.*known data sets: ml-latest-small, ml-1m"):
        dataset_preset(tmp_path / "ml-25m")
    # The dense preset's reference row is the paper's ML-20M column, and its EASE grid spans 100 to 10,000.
    rows = {"rankmax": [{"ap@10": 0.1, "accuracy": 0.2, "recall@100": 0.5}]}
    table = format_table(rows, DATASETS["ml-1m"]).splitlines()
    assert table[-2] == "paper (ML 20M, its own model, protocol and AP normalisation):"
    assert table[-1].split() == ["rankmax", "0.210", "0.397", "0.492"]
    assert min(DATASETS["ml-1m"].lambdas) == 100 and max(DATASETS["ml-1m"].lambdas) == 10000


def test_reproduce_table2_trains_the_starter_config_on_every_preset_and_pairs_it_with_the_item_item_model(tmp_path):
    """``--losses item_bag`` is configs/ml-1m.yaml on every dataset (the claim that its settings carry), Last.fm's
    play counts have a preset with their column mapping, and item_bag is paired with the item-item model."""
    from benchmarks.reproduce_table2 import DATASETS, ROOT, config_path, dataset_preset, format_differences

    for dataset in DATASETS.values():
        assert config_path(dataset, "item_bag") == ROOT / "configs" / "ml-1m.yaml"
        assert config_path(dataset, "rankmax") == ROOT / "configs" / f"{dataset.name}-rankmax.yaml"
    lastfm = dataset_preset(tmp_path / "lastfm-2k" / "user_artists.dat")
    assert lastfm is DATASETS["lastfm-2k"] and lastfm.ingest_args[:4] == ("--user", "userID", "--item", "artistID")
    rng = np.random.default_rng(5)
    names = ("EASE", "item_bag", "item_item-rankmax")
    per_user = {name: [{key: rng.random(20) for key in ("ap@10", "recall@100")}] for name in names}
    per_user["item_bag"] = [
        {key: values - 0.125 for key, values in seed.items()} for seed in per_user["item_item-rankmax"]
    ]
    lines = format_differences(per_user).splitlines()
    assert [line.split()[0:3] for line in lines[1:]][-1] == ["item_bag", "-", "item_item-rankmax"]
    assert lines[-1].split()[3:] == ["-0.125", "[-0.125,", "-0.125]"] * 2


def test_reproduce_table2_flags_an_ease_lambda_at_the_edge_of_its_grid():
    from benchmarks.reproduce_table2 import lambda_at_grid_edge

    assert lambda_at_grid_edge(400.0, [100.0, 200.0, 400.0]) == (
        "warning: EASE picked λ = 400, the largest of the grid [100.0, 200.0, 400.0]; widen --lambdas"
    )
    assert "the smallest" in lambda_at_grid_edge(100.0, [400.0, 100.0, 200.0])
    assert lambda_at_grid_edge(200.0, [100.0, 200.0, 400.0]) is None
    assert lambda_at_grid_edge(200.0, [200.0]) is None  # one λ (--quick): no grid to widen


def test_the_baselines_leave_out_what_the_dataset_says(tmp_path):
    # On a given split (the manifest's eval_exclude), test's rankings leave out train and valid items, as
    # `bigrank evaluate` does; elsewhere train items only.
    import json

    from benchmarks.baselines import baselines, excluded_matrix
    from bigrank.data import manifest as layout
    from tests.helpers import write_small_dataset

    write_small_dataset(tmp_path)
    matrices = {split: split_matrix(tmp_path, split) for split in ("train", "valid", "test")}
    np.testing.assert_array_equal(excluded_matrix(tmp_path, "test", matrices), matrices["train"])
    plain = baselines(tmp_path, lambdas=(10.0,), als=False)
    manifest = json.loads((tmp_path / layout.MANIFEST_NAME).read_text())
    manifest["eval_exclude"] = {"valid": ["train"], "test": ["train", "valid"]}
    (tmp_path / layout.MANIFEST_NAME).write_text(json.dumps(manifest))
    union = np.maximum(matrices["train"], matrices["valid"])
    np.testing.assert_array_equal(excluded_matrix(tmp_path, "test", matrices), union)
    np.testing.assert_array_equal(excluded_matrix(tmp_path, "valid", matrices), matrices["train"])
    given = baselines(tmp_path, lambdas=(10.0,), als=False)
    popularity = popularity_scores(matrices["train"])
    assert given["popularity"]["test"] == evaluate_scores(popularity, union, matrices["test"])
    assert given["popularity"]["test"] != plain["popularity"]["test"]
    assert given["popularity"]["valid"] == plain["popularity"]["valid"]


def test_reproduce_table2_shows_ndcg_and_recall_at_20_and_a_dash_where_a_run_lacks_them():
    from benchmarks.reproduce_table2 import DATASETS, format_differences, format_table

    full = {"ap@10": 0.1, "ndcg@20": 0.25, "recall@20": 0.3, "accuracy": 0.2, "recall@100": 0.5}
    old = {key: full[key] for key in ("ap@10", "accuracy", "recall@100")}  # a run evaluated before @20 existed
    rows = {"EASE": [full, full], "ALS": [full, full], "rankmax": [old, old]}
    table = format_table(rows, DATASETS["ml-1m"]).splitlines()
    assert table[0].split() == ["model", "seeds", "AP@10", "NDCG@20", "R@20", "Accuracy", "R@100"]
    assert table[1].split()[2:] == ["0.100", "±", "0.000", "0.250", "±", "0.000", "0.300", "±", "0.000"] + [
        "0.200", "±", "0.000", "0.500", "±", "0.000",
    ]  # fmt: skip
    assert table[3].split()[2:6] == ["0.100", "±", "0.000", "-"] and table[3].split()[6] == "-"
    assert table[-1].split() == ["rankmax", "0.210", "-", "-", "0.397", "0.492"]  # the paper reports 3 of them
    rng = np.random.default_rng(7)
    per_user = {name: [{key: rng.random(10) for key in full}] for name in ("EASE", "ALS", "rankmax", "softmax")}
    lines = format_differences(per_user).splitlines()
    assert lines[0].split() == ["difference", "AP@10", "NDCG@20", "R@20", "Accuracy", "R@100"]
    assert [line.split()[0:3] for line in lines[1:]] == [
        ["rankmax", "-", "EASE"], ["softmax", "-", "EASE"], ["rankmax", "-", "ALS"], ["softmax", "-", "ALS"],
        ["rankmax", "-", "softmax"],
    ]  # fmt: skip
