"""Fixtures shared by the trainer, workflow and Ray tests, and the one reader of a checkpoint's layout."""

from __future__ import annotations

import math
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, settings

from tests.helpers import REPO, random_tables, write_export

# Hypothesis profiles of the fuzz tests (tests/test_fuzz_*.py). "ci", the default (`make test`): a few examples,
# drawn the same way on every run (derandomize; no example database), so CI is deterministic. "long"
# (HYPOTHESIS_PROFILE=long): many random examples, failures kept in .hypothesis/ and tried first next time.
settings.register_profile(
    "ci",
    max_examples=40,
    deadline=None,
    derandomize=True,
    database=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("long", max_examples=2000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(scope="session", autouse=True)
def ray_train_polls_its_workers_often():
    """Ray Train's controller looks at its workers every RAY_TRAIN_HEALTH_CHECK_INTERVAL_S (2 s by default): the
    end of every Ray run, and every worker death, is seen up to that late. 0.2 s here, for every Ray run of the
    suite: in this process, the commands it starts and the Ray heads it starts (they inherit the environment; the
    driver passes the variable on to Ray Train's controller and workers). Only the waiting changes."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.2")
        yield


@pytest.fixture(scope="session", autouse=True)
def ray_keeps_its_files_in_a_directory_of_the_suite():
    """Ray writes outside the tests' directories unless told otherwise: every new local runtime (``ray.init``)
    turns token authentication on and, finding no token, writes one to ``~/.ray/auth_token`` in the real home;
    its sessions, logs and sockets go to ``/tmp/ray``, where ``ray start`` also records the cluster it started
    (``ray_current_cluster``), which any later ``ray.init(address="auto")`` on the machine reads (a test run
    once met "multiple active Ray instances" there). For the whole session, in this process, the commands it
    starts and the Ray processes they start (they inherit the environment), Ray's temporary directory is one of
    the suite's own (``RAY_TMPDIR``; short, for Ray's socket paths) and the token a file in it
    (``RAY_AUTH_TOKEN_PATH``). Tests that give a Ray head a home of its own (the token tests) drop the token."""
    directory = Path(tempfile.mkdtemp(prefix="bigrank-ray-", dir="/tmp"))
    token = directory / "auth_token"
    token.write_text(secrets.token_hex(32))  # as `ray get-auth-token --generate` makes one
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("RAY_TMPDIR", str(directory))
            patch.setenv("RAY_AUTH_TOKEN_PATH", str(token))
            yield directory
    finally:
        shutil.rmtree(directory, ignore_errors=True)


TINY_USERS, TINY_ITEMS, TINY_TOPICS = 120, 101, 8  # 101 items: uneven catalog shards [0, 51) and [51, 101)


@pytest.fixture(scope="module")
def tiny_dataset(tmp_path_factory):
    """120 users x 101 items: each user rates 12 items of its topic (items i with i % 8 == user % 8) and 3
    random ones; 80/10/10 random split. Small enough for an epoch in a dozen steps."""
    from bigrank.data.synthetic import SeedRatings, write_seed_dataset

    rng = np.random.default_rng(0)
    pairs = set()
    for user in range(TINY_USERS):
        topic_items = np.arange(user % TINY_TOPICS, TINY_ITEMS, TINY_TOPICS)
        for item in rng.choice(topic_items, 12, replace=False):
            pairs.add((user, int(item)))
        for item in rng.choice(TINY_ITEMS, 3, replace=False):
            pairs.add((user, int(item)))
    users, items = np.array(sorted(pairs), dtype=np.int32).T
    root = tmp_path_factory.mktemp("tiny")
    write_seed_dataset(SeedRatings(users, items, TINY_USERS, TINY_ITEMS), root, 0, "test:tiny", {"preset": "tiny"})
    return root


def tiny_config(root, run_dir, *layers: dict, raw: bool = False, **sections):
    """The config of a run of the dataset at ``root`` into ``run_dir``: what the trainer tests share (seed 3,
    2 workers, dim 8, a record every step, no progress bar), then each of ``layers`` (a module's own settings) and
    ``sections`` (a test's), in that order, merged section by section: a dict updates that section, any other
    value replaces it. ``raw``: the dict, unchecked."""
    from bigrank.config import config_from_dict

    merged = {
        "data": {"root": str(root), "shuffle_buffer": 256},
        "run_dir": str(run_dir),
        "seed": 3,
        "workers": 2,
        "model": {"dim": 8},
        "train": {"log_every": 1, "progress": False},
    }
    for layer in (*layers, sections):
        for section, values in layer.items():
            if isinstance(values, dict):
                merged[section] = {**merged.get(section, {}), **values}
            else:
                merged[section] = values
    return merged if raw else config_from_dict(merged)


@pytest.fixture(scope="module")
def demo_data(tmp_path_factory) -> Path:
    """The demo preset (``bigrank generate --preset demo``, seed 0): 2,000 users, a module's own copy."""
    from bigrank.data.synthetic import generate

    root = tmp_path_factory.mktemp("demo") / "data"
    generate("demo", root, seed=0, progress=False)
    return root


@dataclass
class RandomExport:
    """An export of random tables (what `bigrank export` writes; no training needed)."""

    path: Path
    tables: dict  # name -> float32 tensor, as exported
    dataset: Path  # the dataset it was exported with (seen items, history)


@pytest.fixture(scope="module")
def demo_export(demo_data, tmp_path_factory) -> RandomExport:
    """Random 8-d item, user and history tables of the demo data, exported with it; the user rows are the
    table's (serving adds each user's mean history row)."""
    from bigrank.data.manifest import load_manifest

    manifest = load_manifest(demo_data)
    tables = random_tables(manifest["num_items"], manifest["num_users"])
    out = tmp_path_factory.mktemp("demo-export") / "export"
    write_export(out, tables, dataset_root=demo_data, user_vectors=None)
    return RandomExport(out, tables, demo_data)


def read_checkpoint(checkpoint) -> dict:
    """The whole state of a trainer checkpoint as one nested dict of full (unsharded) tensors, read in this
    process: the one place the tests know the checkpoint layout (``bigrank.train.checkpoint``)."""
    import tempfile

    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as tmp:
        flat = f"{tmp}/checkpoint.pt"
        dcp_to_torch_save(checkpoint, flat)
        return torch.load(flat, weights_only=False)


def checkpoint_parameters(checkpoint):
    """(catalog [n, d], user table [users, d], the user tables' optimizer state (every tensor of it, e.g.
    row-wise Adagrad's ``momentum1``), the item optimizer's state (one dict of full tensors: its row-aligned
    state and ``step``), the data-stream position) of a trainer checkpoint, read in this process."""
    state = read_checkpoint(checkpoint)
    tower = state["tower"]
    user_table = tower["model"]["tables.embedding_bags.user_table.weight"]
    user_optimizer = dict(_flatten(tower.get("optimizer", {})))  # SGD keeps no state (DCP drops empty dicts)
    optimizer = state["catalog"]["optimizer"]
    item_states = [dict(optimizer.get("rows", {}), step=optimizer["step"])]
    return state["catalog"]["weight"], user_table, user_optimizer, item_states, [state["stream"]["position"]]


def _flatten(tree, prefix=""):
    for key, value in tree.items():
        if isinstance(value, dict):
            yield from _flatten(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


# ------------------------------------------------------------------------------------------- brute force
def read_pairs(root, split) -> dict[int, set[int]]:
    """``{user: {items}}`` of one split of a dataset, read with plain pyarrow."""
    import pyarrow.parquet as pq

    from bigrank.data import manifest as layout

    manifest = layout.load_manifest(root)
    pairs: dict[int, set[int]] = {}
    for name in manifest["splits"][split]["files"]:
        table = pq.read_table(Path(root) / name)
        for user, item in zip(table["user_id"].to_pylist(), table["item_id"].to_pylist(), strict=True):
            pairs.setdefault(user, set()).add(item)
    return pairs


def brute_force_metrics(root, split, user_table, item_table, ks, users=None, exclude=("train",)) -> dict:
    """Full scores, the user's items of ``exclude`` removed, sort by (score desc, id asc), then the metric
    definitions per user (NDCG: binary gains over an ideal list of min(|R|, K) hits, log2(rank + 1) discounts)."""
    excluded = [read_pairs(root, name) for name in exclude]
    held_out = read_pairs(root, split)
    users = sorted(held_out) if users is None else [int(u) for u in users]
    num_items = len(item_table)
    sums = dict.fromkeys(["accuracy"] + [f"{m}@{k}" for k in ks for m in ("recall", "ndcg", "ap")], 0.0)
    for user in users:
        scores = item_table @ user_table[user]
        seen = set().union(*(pairs.get(user, set()) for pairs in excluded))
        eligible = [i for i in range(num_items) if i not in seen]
        ranking = sorted(eligible, key=lambda i: (-scores[i], i))
        relevant = held_out[user]
        sums["accuracy"] += ranking[0] in relevant
        for k in ks:
            hits = [1 if i < len(ranking) and ranking[i] in relevant else 0 for i in range(k)]
            sums[f"recall@{k}"] += sum(hits) / len(relevant)
            sums[f"ap@{k}"] += sum(sum(hits[: i + 1]) / (i + 1) * hits[i] for i in range(k)) / min(k, len(relevant))
            ideal = sum(1 / math.log2(i + 2) for i in range(min(k, len(relevant))))
            sums[f"ndcg@{k}"] += sum(hits[i] / math.log2(i + 2) for i in range(k)) / ideal
    return {name: value / len(users) for name, value in sums.items()} | {"users": len(users)}


# --------------------------------------------------------------------------------------------------- CLI
def bigrank(*args, timeout: float = 600, check: bool = True) -> subprocess.CompletedProcess:
    """Run ``python -m bigrank.cli ARGS`` in a fresh process, as a user would (this checkout first on the
    path, also for the workers it spawns). ``check``: fail the test, with the command's output, on a non-zero
    exit. ``timeout`` is a hang guard, not a speed check."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    command = [sys.executable, "-m", "bigrank.cli", *map(str, args)]
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=timeout, cwd=REPO)
    if check and done.returncode != 0:
        pytest.fail(f"{' '.join(command[2:])} exited {done.returncode}\n{done.stdout}\n{done.stderr}")
    return done


def write_movielens_files(directory: Path) -> tuple[np.ndarray, np.ndarray]:
    """``ratings.csv`` and ``movies.csv`` in MovieLens' format for the tiny topic data (see ``tiny_dataset``)
    with sparse original ids: user u is ``10 + 3 u``, item i is movie ``1000 + 7 i`` titled ``Movie i``.
    Returns the original (user ids, movie ids) of the ratings."""
    rng = np.random.default_rng(0)
    pairs = set()
    for user in range(TINY_USERS):
        topic_items = np.arange(user % TINY_TOPICS, TINY_ITEMS, TINY_TOPICS)
        pairs.update((user, int(i)) for i in rng.choice(topic_items, 12, replace=False))
        pairs.update((user, int(i)) for i in rng.choice(TINY_ITEMS, 3, replace=False))
    users, items = (np.array(column) for column in zip(*sorted(pairs), strict=True))
    users, movies = 10 + 3 * users, 1000 + 7 * items
    directory.mkdir(parents=True, exist_ok=True)
    lines = ["userId,movieId,rating,timestamp"]
    lines += [f"{u},{m},4.0,{964_982_703 + k}" for k, (u, m) in enumerate(zip(users, movies, strict=True))]
    (directory / "ratings.csv").write_text("\n".join(lines) + "\n")
    titles = ["movieId,title,genres"] + [f"{1000 + 7 * i},Movie {i},Drama" for i in range(TINY_ITEMS)]
    (directory / "movies.csv").write_text("\n".join(titles) + "\n")
    return users, movies


def tiny_run_yaml(data, run, *, train: str, eval: str) -> str:
    """The YAML of a 2-worker rankmax run of the tiny data at ``data`` into ``run``; ``train`` and ``eval`` are
    the flow mappings of those sections (``"{batch_size: 64, ...}"``), the part a test is about."""
    return (
        f"data: {{root: {data}, shuffle_buffer: 256}}\nrun_dir: {run}\nseed: 3\nworkers: 2\nmodel: {{dim: 8}}\n"
        f"loss: {{name: rankmax}}\noptim: {{user_lr: 0.1, item_lr: 0.1}}\ntrain: {train}\neval: {eval}\n"
    )


WORKFLOW_CONFIG = """\
# the tiny workflow run: 2 local workers, Rankmax, evaluation every 2 epochs and at the end
data: {{root: {data}, shuffle_buffer: 256}}
run_dir: {run}
seed: 3
workers: 2
model: {{dim: 8}}
loss: {{name: rankmax}}
optim: {{user_optimizer: rowwise_adagrad, user_lr: 0.1, item_optimizer: adam, item_lr: 0.05}}
train: {{batch_size: 128, epochs: 1, log_every: 1, progress: false}}
eval: {{every_epochs: 2, ks: [10], splits: [valid, test]}}
"""


@dataclass
class WorkflowRun:
    """What a user has after ``ingest`` → ``train`` → ``evaluate`` → ``export`` (see ``workflow_run``)."""

    movielens: Path  # the MovieLens-format input files
    data: Path  # the ingested dataset
    run: Path  # the run directory
    export: Path  # the export (3 parts per table, an exact FAISS index)
    train_out: str  # stdout of `bigrank train`
    train_eval: dict  # eval.json as `bigrank train` wrote it
    evaluate_out: str  # stdout of `bigrank evaluate --workers 3`
    epochs: int


@pytest.fixture(scope="session")
def workflow_run(tmp_path_factory) -> WorkflowRun:
    """One tiny run through the CLI, shared by the workflow tests: MovieLens files → ``bigrank ingest`` →
    ``bigrank train --launcher local`` (2 workers, 6 epochs) → ``bigrank evaluate --workers 3`` →
    ``bigrank export --workers 3 --index exact``."""
    import json

    root = tmp_path_factory.mktemp("workflow")
    movielens, data, run, export = root / "ml", root / "data", root / "run", root / "export"
    write_movielens_files(movielens)
    bigrank("ingest", movielens, "--out", data)
    config = root / "tiny.yaml"
    config.write_text(WORKFLOW_CONFIG.format(data=data, run=run))
    epochs = 6
    train = bigrank("train", config, "--launcher", "local", "--set", f"train.epochs={epochs}")
    train_eval = json.loads((run / "eval.json").read_text())
    evaluate = bigrank("evaluate", run, "--workers", 3)
    bigrank("export", run, "--out", export, "--workers", 3, "--index", "exact")
    return WorkflowRun(movielens, data, run, export, train.stdout, train_eval, evaluate.stdout, epochs)
