"""The user's path through the `bigrank` command, end to end on tiny data, checked against what a user sees.

One shared run (``workflow_run`` in conftest): MovieLens files → ``bigrank ingest`` → ``bigrank train
--launcher local`` (2 workers) → ``bigrank evaluate --workers 3`` → ``bigrank export --workers 3 --index exact``.
The tests below read its files (eval.json, metrics.jsonl, the export's manifest and parts) and run the commands
that follow (``recommend --json``, ``serve``, ``plot``), comparing them with numpy brute force over the
checkpoint's parameters (read by ``checkpoint_parameters``, the one reader of the checkpoint layout).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import urllib.request

import numpy as np
import pytest

from tests.conftest import (
    REPO,
    TINY_ITEMS,
    TINY_USERS,
    bigrank,
    brute_force_metrics,
    checkpoint_parameters,
    read_pairs,
)


def latest_checkpoint(run):
    return sorted((run / "checkpoints").iterdir())[-1]


def exported_tables(export):
    from bigrank.export.recommend import load_export, read_table

    manifest = load_export(export)
    return manifest, read_table(export, manifest, "items"), read_table(export, manifest, "users")


def brute_force_top(export, data, user: int, k: int) -> list[tuple[int, float]]:
    """The top ``k`` (item, score) of ``user`` over the exported tables, every item the user rated left out."""
    _, items, users = exported_tables(export)
    scores = items["embedding"].astype(np.float64) @ users["embedding"][user].astype(np.float64)
    seen = set().union(*(read_pairs(data, split).get(user, set()) for split in ("train", "valid", "test")))
    ranking = sorted((i for i in range(len(scores)) if i not in seen), key=lambda i: (-scores[i], i))
    return [(i, scores[i]) for i in ranking[:k]]


def test_ingest_keeps_every_rating_and_the_original_ids(workflow_run):
    from bigrank.data.manifest import load_manifest

    ratings = (workflow_run.movielens / "ratings.csv").read_text().splitlines()[1:]
    manifest = load_manifest(workflow_run.data)
    assert (manifest["num_users"], manifest["num_items"]) == (TINY_USERS, TINY_ITEMS)
    assert sum(split["rows"] for split in manifest["splits"].values()) == len(ratings)
    pairs = {(int(line.split(",")[0]), int(line.split(",")[1])) for line in ratings}
    dense = set()
    for split in ("train", "valid", "test"):
        dense |= {(u, i) for u, items in read_pairs(workflow_run.data, split).items() for i in items}
    # users.parquet / items.parquet map the dense ids back (in hash order, not the original ids' order)
    import pyarrow.parquet as pq

    user_of = pq.read_table(workflow_run.data / "users.parquet").column("original_id").to_pylist()
    item_of = pq.read_table(workflow_run.data / "items.parquet").column("original_id").to_pylist()
    assert {(user_of[u], item_of[i]) for u, i in dense} == pairs
    _, items, users = exported_tables(workflow_run.export)
    assert users["original_id"].tolist() == user_of  # the export carries them, in dense-id order
    assert items["original_id"].tolist() == item_of
    assert items["title"][item_of.index(1000 + 7 * 5)] == "Movie 5"


def test_training_learns_and_evaluate_with_three_workers_finds_the_same_figures(workflow_run):
    run = workflow_run.run
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["type"] == "train"]
    steps_per_epoch = len(train) // workflow_run.epochs
    assert [r["step"] for r in train] == list(range(1, workflow_run.epochs * steps_per_epoch + 1))
    first = np.mean([r["loss"] for r in train[:steps_per_epoch]])
    last = np.mean([r["loss"] for r in train[-steps_per_epoch:]])
    assert last < 0.7 * first, (first, last)
    assert all(r["examples_per_s"] > 0 and r["lr"] == 0.05 and r["user_lr"] == 0.1 for r in train)
    assert f"steps          {len(train)} ({workflow_run.epochs:.2f} epochs, 2 workers)" in workflow_run.train_out
    for name in ("config.yaml", "plan.txt", "plan.json"):
        assert (run / name).is_file()
    plan = (run / "plan.txt").read_text()  # the layout the cost model chose (a tiny catalog: replicated)
    assert "<- chosen" in plan and "data_parallel" in plan
    assert list((run / "tensorboard").iterdir())
    checkpoints = sorted(p.name for p in (run / "checkpoints").iterdir())  # the last two epoch ends are kept
    assert checkpoints == [f"step-{e * steps_per_epoch:08d}" for e in (workflow_run.epochs - 1, workflow_run.epochs)]
    valid_steps = [r["step"] for r in records if r["type"] == "eval" and r["split"] == "valid"]
    assert valid_steps == [2 * steps_per_epoch, 4 * steps_per_epoch, 6 * steps_per_epoch]
    # A random ranking finds about 10/101 of a user's held-out items in its top 10; the model learned the topics.
    for split in ("valid", "test"):
        assert workflow_run.train_eval[split]["recall@10"] > 3 * 10 / TINY_ITEMS, workflow_run.train_eval
    # `bigrank evaluate --workers 3` reshards the 2-worker checkpoint and finds the same figures, reading the
    # items from the user indexes it built first (training's evaluations read the split files).
    built = sorted(path.name.split("-")[0] for path in (workflow_run.data / "user_index").glob("*.csr"))
    assert built == ["test", "train", "valid"]
    evaluated = json.loads((run / "eval.json").read_text())
    assert "recall@10" in workflow_run.evaluate_out
    for split in ("valid", "test"):
        for key in ("recall@10", "ap@10", "accuracy"):
            assert evaluated[split][key] == pytest.approx(workflow_run.train_eval[split][key], abs=1e-6), key
        assert evaluated[split]["users"] == workflow_run.train_eval[split]["users"]
        assert evaluated[split]["checkpoint"] == str(latest_checkpoint(run))


def test_evaluating_a_copied_run_reads_and_writes_the_copy_and_leaves_the_original(workflow_run, tmp_path):
    """`bigrank evaluate COPY`: the copy's checkpoint, and eval.json written into COPY. The run_dir recorded in
    COPY/config.yaml is the original's: it is history, and the original's results stay as they were."""
    copy = tmp_path / "copy"
    shutil.copytree(workflow_run.run, copy)
    original = (workflow_run.run / "eval.json").read_bytes()
    (copy / "eval.json").unlink()
    out = bigrank("evaluate", copy, "--split", "valid", "--workers", 1, "--no-index")
    assert f"written to {copy / 'eval.json'}" in out.stdout, out.stdout
    evaluated = json.loads((copy / "eval.json").read_text())
    assert evaluated["valid"]["checkpoint"] == str(latest_checkpoint(copy))
    assert evaluated["valid"]["recall@10"] == pytest.approx(workflow_run.train_eval["valid"]["recall@10"], abs=1e-6)
    assert (workflow_run.run / "eval.json").read_bytes() == original


def test_evaluation_equals_brute_force_over_the_checkpoint(workflow_run):
    """The real sharded TorchRec tower and catalog, evaluated by `bigrank evaluate`, against a numpy ranking of
    the checkpoint's tables."""
    catalog, user_table = checkpoint_parameters(latest_checkpoint(workflow_run.run))[:2]
    evaluated = json.loads((workflow_run.run / "eval.json").read_text())
    for split in ("valid", "test"):
        users, items = user_table.double().numpy(), catalog.double().numpy()
        expected = brute_force_metrics(workflow_run.data, split, users, items, [10])
        for key in ("recall@10", "ndcg@10", "ap@10", "accuracy", "users"):
            assert evaluated[split][key] == pytest.approx(expected[key], abs=1e-6), (split, key)


def test_exported_tables_equal_the_checkpoint_parameters(workflow_run):
    manifest, items, users = exported_tables(workflow_run.export)
    catalog, user_table = checkpoint_parameters(latest_checkpoint(workflow_run.run))[:2]
    np.testing.assert_array_equal(items["embedding"], catalog.numpy())
    np.testing.assert_array_equal(users["embedding"], user_table.numpy())
    # trained with 2 workers, exported with 3: one part per exporting rank
    assert [len(manifest["tables"][name]["parts"]) for name in ("items", "users")] == [3, 3]
    assert manifest["indexes"]["exact"]["file"]


@pytest.mark.parametrize("user", [0, 77])
def test_recommend_json_equals_brute_force_over_the_export(workflow_run, user):
    import pyarrow.parquet as pq

    expected = brute_force_top(workflow_run.export, workflow_run.data, user, 10)
    user_of = pq.read_table(workflow_run.data / "users.parquet").column("original_id").to_pylist()
    item_of = pq.read_table(workflow_run.data / "items.parquet").column("original_id").to_pylist()
    out = bigrank(
        "recommend", workflow_run.export, "--user", user_of[user], "--original-ids", "-k", 10,
        "--exclude-seen", workflow_run.data, "--json",
    )  # fmt: skip
    rows = json.loads(out.stdout)
    assert [row["item_id"] for row in rows] == [item for item, _ in expected]
    np.testing.assert_allclose([row["score"] for row in rows], [score for _, score in expected], rtol=1e-5)
    assert [row["original_id"] for row in rows] == [item_of[item] for item, _ in expected]
    # movie 1000 + 7k is titled "Movie k" (write_movielens_files)
    assert [row["title"] for row in rows] == [f"Movie {(item_of[item] - 1000) // 7}" for item, _ in expected]


def test_serve_answers_the_same_over_http(workflow_run):
    env = dict(os.environ, PYTHONPATH=str(REPO))
    command = [sys.executable, "-m", "bigrank.cli", "serve", str(workflow_run.export), "--port", "0"]
    command += ["--exclude-seen", str(workflow_run.data), "--quiet"]
    server = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO)
    try:
        line = server.stderr.readline()  # "serving DIR (… items, … users, exact index) on http://HOST:PORT/…"
        assert " on http://127.0.0.1:" in line, line + server.stderr.read()
        base = line.split(" on ")[-1].split("/recommend")[0]
        with urllib.request.urlopen(f"{base}/health", timeout=30) as response:
            health = json.loads(response.read())
        assert health | {"status": "ok"} == health and (health["num_items"], health["num_users"]) == (101, 120)
        assert health["exclude_seen"] is True
        assert (health["user_ids"], health["item_ids"]) == ("int64", "int64")  # MovieLens's ids, by default
        import pyarrow.parquet as pq

        user_of = pq.read_table(workflow_run.data / "users.parquet").column("original_id").to_pylist()
        item_of = pq.read_table(workflow_run.data / "items.parquet").column("original_id").to_pylist()
        for user in (3, 119):
            original = user_of[user]
            with urllib.request.urlopen(f"{base}/recommend?user={original}&k=5&exclude_seen=1", timeout=30) as response:
                answer = json.loads(response.read())
            expected = brute_force_top(workflow_run.export, workflow_run.data, user, 5)
            assert answer["user"] == original
            assert [row["item_id"] for row in answer["items"]] == [item for item, _ in expected]
            assert [row["original_id"] for row in answer["items"]] == [item_of[item] for item, _ in expected]
            np.testing.assert_allclose([r["score"] for r in answer["items"]], [s for _, s in expected], rtol=1e-5)
    finally:
        server.terminate()
        server.wait(timeout=60)
        server.stderr.close()


def test_a_corrupted_index_file_is_refused_by_name(workflow_run, tmp_path):
    export = tmp_path / "export"
    shutil.copytree(workflow_run.export, export)
    manifest = json.loads((export / "manifest.json").read_text())
    index = export / manifest["indexes"]["exact"]["file"]
    data = bytearray(index.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte, same size: only the checksum can tell
    index.write_bytes(bytes(data))
    out = bigrank("recommend", export, "--user", 0, check=False)
    assert out.returncode == 2, out.stdout + out.stderr
    assert "export file is corrupt (exact index)" in out.stderr and str(index) in out.stderr, out.stderr
    index.write_bytes(bytes(data[:-10]))  # truncated: refused even without the checksum pass
    out = bigrank("recommend", export, "--user", 0, "--no-verify", check=False)
    assert out.returncode == 2 and "truncated" in out.stderr and str(index) in out.stderr, out.stderr


def test_plot_of_the_real_run(workflow_run, tmp_path):
    from bigrank.train.plot import metric_keys, read_run

    png = tmp_path / "run.png"
    out = bigrank("plot", workflow_run.run, "--out", png)
    assert f"wrote {png}" in out.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000
    run = read_run(workflow_run.run)
    assert run["label"] == "run (rankmax)"
    steps = len(run["train"])
    assert [r["step"] for r in run["train"]] == list(range(1, steps + 1))
    # valid after epochs 2 and 4 while training, then valid and test at the end
    assert sorted((r["split"], r["epoch"]) for r in run["eval"]) == [
        ("test", workflow_run.epochs), ("valid", 2), ("valid", 4), ("valid", workflow_run.epochs)
    ]  # fmt: skip
    assert "recall@10" in metric_keys(run["eval"])
