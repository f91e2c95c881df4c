"""``bigrank ingest --split given`` (one input per split, or a split column; valid carved from train) and the
one-line-per-user files the graph-CF benchmarks ship (``--format user-lines``), on real files, DuckDB and the CLI;
then train, evaluate at K = 20 and check the figures against a brute-force ranking that leaves out train and valid."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import yaml

from bigrank.cli import main
from bigrank.data import manifest as layout
from bigrank.data.ingest import IngestOptions
from bigrank.data.ingest.user_lines import user_lines_to_parquet
from bigrank.data.stream import iter_row_groups
from bigrank.train.checkpoint import latest_checkpoint
from tests.conftest import TINY_ITEMS, TINY_TOPICS, TINY_USERS, bigrank, brute_force_metrics, checkpoint_parameters


def benchmark_lines(seed: int = 0, users: int = TINY_USERS, test_items: int = 3) -> tuple[dict, dict]:
    """A benchmark's split as ``{user: [items]}`` of train and of test (disjoint per user): the tiny topic data
    (12 items of the user's topic, 3 random ones), sparse original ids (user ``5 + 2u``, item ``100 + 3i``)."""
    rng = np.random.default_rng(seed)
    train, test = {}, {}
    for user in range(users):
        topic = rng.choice(np.arange(user % TINY_TOPICS, TINY_ITEMS, TINY_TOPICS), 12, replace=False)
        items = list(dict.fromkeys([*topic.tolist(), *rng.choice(TINY_ITEMS, 3, replace=False).tolist()]))
        rng.shuffle(items)
        original = [100 + 3 * int(i) for i in items]
        train[5 + 2 * user], test[5 + 2 * user] = original[test_items:], original[:test_items]
    return train, test


def write_lines(path: Path, lists: dict) -> Path:
    path.write_text("".join(f"{user} {' '.join(map(str, items))}\n" for user, items in lists.items()))
    return path


def ingest_benchmark_files(tmp_path: Path, seed: int = 1) -> Path:
    """A benchmark's ``train.txt``/``test.txt`` (``benchmark_lines(seed)``) ingested with ``--split given
    --format user-lines`` into ``tmp_path/data``; returns that dataset."""
    train, test = benchmark_lines(seed=seed)
    data = tmp_path / "data"
    bigrank(
        "ingest", "--split", "given", "--train", write_lines(tmp_path / "train.txt", train),
        "--test", write_lines(tmp_path / "test.txt", test), "--format", "user-lines", "--out", data, "--no-progress",
    )  # fmt: skip
    return data


def pairs_by_original_ids(root: Path) -> dict[str, set]:
    """Each split's (original user, original item) pairs."""
    users = pq.read_table(root / "users.parquet").column("original_id").to_pylist()
    items = pq.read_table(root / "items.parquet").column("original_id").to_pylist()
    out = {}
    for split in layout.SPLITS:
        out[split] = set()
        for group in iter_row_groups(root, split):
            out[split].update((users[u], items[i]) for u, i in zip(group["user_id"], group["item_id"], strict=True))
    return out


def flat(lists: dict) -> set:
    return {(user, item) for user, items in lists.items() for item in items}


def _cli(capsys, *args) -> tuple[int, str, str]:
    code = main(["ingest", *map(str, args), "--no-progress"])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


# ---------------------------------------------------------------------------------------------- user-lines
def test_user_lines_become_pairs_typed_like_csv_ids(tmp_path):
    path = tmp_path / "train.txt"
    path.write_text("0 10 11 12\n\n1 11\n2\n  3 12  10\t13 \n1 14 11\n")  # blank, item-less, repeats, tabs
    lines, pairs = user_lines_to_parquet(path, tmp_path / "pairs.parquet", chunk_pairs=2)  # several chunks
    table = pq.read_table(tmp_path / "pairs.parquet")
    assert (lines, pairs) == (5, 9) and table.schema.field("user").type == "int64"
    got = zip(table.column("user").to_pylist(), table.column("item").to_pylist(), strict=True)
    assert sorted(got) == sorted([(0, 10), (0, 11), (0, 12), (1, 11), (3, 12), (3, 10), (3, 13), (1, 14), (1, 11)])
    text = tmp_path / "text.txt"
    text.write_text("alice a b\nbob 007\n")  # a non-canonical integer keeps every id text, as CSV ids are typed
    user_lines_to_parquet(text, tmp_path / "text.parquet")
    table = pq.read_table(tmp_path / "text.parquet")
    assert table.schema.field("item").type == "string" and table.column("item").to_pylist() == ["a", "b", "007"]


def test_user_lines_ingest_with_a_random_split(tmp_path, capsys):
    train, test = benchmark_lines()
    lines = write_lines(tmp_path / "all.txt", {u: train[u] + test[u] for u in train})
    code, out, err = _cli(capsys, lines, "--format", "user-lines", "--out", tmp_path / "data")
    assert code == 0, err
    got = pairs_by_original_ids(tmp_path / "data")
    assert set().union(*got.values()) == flat(train) | flat(test)
    manifest = layout.load_manifest(tmp_path / "data")
    assert manifest["ingest"]["inputs"]["format"] == "user-lines" and manifest["source"] == f"ingest:{lines}"
    assert "eval_exclude" not in manifest and manifest["ingest"]["id_types"] == {"user": "int64", "item": "int64"}
    assert "user-lines" in out and sorted(p.name for p in (tmp_path / "data").iterdir()) == [
        "items.parquet", "manifest.json", "test", "train", "user_index", "users.parquet", "valid",
    ]  # fmt: skip
    layout.validate_dataset(tmp_path / "data", deep=True)


# --------------------------------------------------------------------------------------------- given split
def test_given_train_and_test_keep_their_pairs_and_valid_is_the_random_splits_carve(tmp_path, capsys):
    train, test = benchmark_lines()
    paths = write_lines(tmp_path / "train.txt", train), write_lines(tmp_path / "test.txt", test)
    args = ["--split", "given", "--train", paths[0], "--test", paths[1], "--format", "user-lines", "--seed", "4"]
    code, out, err = _cli(capsys, *args, "--out", tmp_path / "data")
    assert code == 0, err
    got = pairs_by_original_ids(tmp_path / "data")
    assert got["test"] == flat(test)
    assert got["train"] | got["valid"] == flat(train) and not got["train"] & got["valid"]
    assert 0.07 < len(got["valid"]) / len(flat(train)) < 0.13  # about --valid-fraction 0.1 of the train pairs

    # valid holds exactly the train pairs that the random split's key, over every pair, puts in its valid share.
    union = write_lines(tmp_path / "union.txt", {u: train[u] + test[u] for u in train})
    reference = tmp_path / "reference"
    assert (
        _cli(capsys, union, "--format", "user-lines", "--fractions", "0.9,0.1,0", "--seed", "4", "--out", reference)[0]
        == 0
    )
    assert got["valid"] == pairs_by_original_ids(reference)["valid"] & flat(train)

    manifest = layout.load_manifest(tmp_path / "data")
    assert manifest["eval_exclude"] == {"valid": ["train"], "test": ["train", "valid"]}
    assert manifest["ingest"]["split"] == {
        "mode": "given", "by": "inputs", "valid": "carved", "valid_fraction": 0.1, "seed": 4,
        "rows": {name: len(got[name]) for name in layout.SPLITS},
        "pairs_in_several_splits": 0, "test_users_without_train": 0,
    }  # fmt: skip
    assert manifest["ingest"]["inputs"]["splits"] == {"train": [str(paths[0])], "test": [str(paths[1])]}
    assert "given (by input; valid carved from train: fraction 0.1, seed 4)" in out
    layout.validate_dataset(tmp_path / "data", deep=True)
    assert layout.DatasetManifest.load(tmp_path / "data").excluded_splits("test") == ("train", "valid")

    # The same command gives the same dataset (files byte for byte); --valid-fraction 0 carves nothing.
    assert _cli(capsys, *args, "--out", tmp_path / "again")[0] == 0
    for split in layout.SPLITS:
        for name in manifest["splits"][split]["files"]:
            assert (tmp_path / "data" / name).read_bytes() == (tmp_path / "again" / name).read_bytes()
    assert _cli(capsys, *args, "--valid-fraction", "0", "--out", tmp_path / "none")[0] == 0
    none = pairs_by_original_ids(tmp_path / "none")
    assert none["train"] == flat(train) and not none["valid"] and none["test"] == flat(test)


def test_three_given_csv_inputs_and_a_pair_given_twice(tmp_path):
    def csv(name: str, pairs) -> Path:
        path = tmp_path / f"{name}.csv"
        path.write_text("user,item,rating\n" + "".join(f"{u},{i},{r}\n" for u, i, r in pairs))
        return path

    train = [("a", "x", 5.0), ("a", "y", 4.0), ("b", "x", 3.0), ("b", "z", 1.0)]
    valid = [("a", "z", 2.0), ("c", "x", 1.5)]
    test = [("b", "y", 4.5), ("a", "x", 3.5), ("c", "y", 1.0)]  # (a, x) is in train too: it stays in train
    options = IngestOptions(user="user", item="item", rating="rating")
    from bigrank.data.ingest.given import GivenSplit, ingest_prepared

    given = GivenSplit(
        inputs={"train": [str(csv("train", train))], "valid": [csv("valid", valid)], "test": [csv("test", test)]}
    )
    manifest = ingest_prepared([], tmp_path / "data", options, given=given)
    got = pairs_by_original_ids(tmp_path / "data")
    assert got == {
        "train": {("a", "x"), ("a", "y"), ("b", "x"), ("b", "z")},
        "valid": {("a", "z"), ("c", "x")},
        "test": {("b", "y"), ("c", "y")},
    }
    record = manifest["ingest"]["split"]
    assert record["valid"] == "given" and record["pairs_in_several_splits"] == 1
    assert record["test_users_without_train"] == 1  # c
    # The pair kept in train keeps the value the dedup merged (max of 5.0 and 3.5), as any ingest would.
    ratings = {}
    users = pq.read_table(tmp_path / "data" / "users.parquet").column("original_id").to_pylist()
    items = pq.read_table(tmp_path / "data" / "items.parquet").column("original_id").to_pylist()
    for group in iter_row_groups(tmp_path / "data", "train", columns=("user_id", "item_id", "rating")):
        for u, i, r in zip(group["user_id"], group["item_id"], group["rating"], strict=True):
            ratings[(users[u], items[i])] = float(r)
    assert ratings[("a", "x")] == 5.0
    assert manifest["schema"] == {"user_id": "int32", "item_id": "int32", "rating": "float"}


def test_a_split_column(tmp_path, capsys):
    rows = ["user,item,fold"]
    rows += [
        f"u{u},i{i},{'train' if i < 6 else 'test' if i == 8 else ' Validation'}" for u in range(30) for i in range(9)
    ]
    log = tmp_path / "log.csv"
    log.write_text("\n".join(rows) + "\n")
    base = [log, "--user", "user", "--item", "item", "--split", "given", "--split-column", "fold"]
    assert _cli(capsys, *base, "--out", tmp_path / "data")[0] == 0
    got = pairs_by_original_ids(tmp_path / "data")
    assert len(got["train"]) == 30 * 6 and len(got["valid"]) == 30 * 2 and len(got["test"]) == 30
    assert all(item == "i8" for _, item in got["test"])
    assert layout.load_manifest(tmp_path / "data")["ingest"]["split"]["valid"] == "given"
    # Without valid rows, valid is carved from the train rows.
    log.write_text("\n".join(row.replace(" Validation", "0") for row in rows) + "\n")
    assert _cli(capsys, *base, "--out", tmp_path / "carved")[0] == 0
    carved = pairs_by_original_ids(tmp_path / "carved")
    assert len(carved["test"]) == 30 and 0 < len(carved["valid"]) < len(carved["train"])
    assert carved["train"] | carved["valid"] == {(u, i) for u, i in got["train"] | got["valid"]}
    # A value that names no split is one error line naming it, and nothing is left behind.
    log.write_text("\n".join([*rows, "u1,i7,holdout"]) + "\n")
    code, _, err = _cli(capsys, *base, "--out", tmp_path / "bad")
    assert code == 2 and "1 row(s) hold 'holdout'" in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "bad").exists() or not any((tmp_path / "bad").iterdir())


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--split", "given", "--train", "T"], "--split given needs --test PATH"),
        (["--split", "given"], "--train PATH --test PATH [--valid PATH], or --split-column COL"),
        (["--train", "T", "--test", "T"], "go with --split given"),
        (["--split", "given", "--train", "T", "--test", "T", "--fractions", "0.8,0.1,0.1"], "--fractions goes with"),
        (["--split", "given", "--train", "T", "--test", "T", "--valid-fraction", "1"], "--valid-fraction must lie"),
        (
            ["--split", "given", "--train", "T", "--test", "T", "--valid", "T", "--valid-fraction", "0.2"],
            "a --valid input",
        ),
        (["T", "--split", "given", "--train", "T", "--test", "T"], "give no other PATH"),
        (["--split", "given", "--split-column", "fold"], "give its PATH"),
        (["T", "--format", "user-lines", "--user", "0"], "drop --user"),
        (["--user", "a", "--item", "b"], "give the input PATH"),
    ],
)
def test_options_that_do_not_go_together_are_one_error_line(tmp_path, capsys, args, message):
    lines = write_lines(tmp_path / "t.txt", {1: [2, 3]})
    out = tmp_path / "out"
    code, _, err = _cli(capsys, *[str(lines) if a == "T" else a for a in args], "--out", out)
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err
    assert not out.exists() or not any(out.iterdir())


# ------------------------------------------------------------------------------------ train and evaluate @20
def test_a_benchmarks_train_and_test_files_train_and_evaluate_at_20(tmp_path):
    """The README's example: train.txt/test.txt ingested with --split given, trained, `bigrank evaluate --ks 20`;
    eval.json's Recall@20 and NDCG@20 equal a brute-force ranking of the checkpoint's vectors that leaves out each
    user's train and carved-valid items."""
    data = ingest_benchmark_files(tmp_path)
    run = tmp_path / "run"
    config = {
        "data": {"root": str(data)}, "run_dir": str(run), "seed": 0, "workers": 1, "model": {"dim": 16},
        "train": {"epochs": 3, "batch_size": 64, "progress": False}, "eval": {"ks": [20], "every_epochs": 0},
    }  # fmt: skip
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
    bigrank("train", tmp_path / "config.yaml", "--launcher", "local")
    trained = json.loads((run / "eval.json").read_text())
    assert {"recall@20", "ndcg@20", "ap@20", "accuracy"} <= set(trained["test"])
    done = bigrank("evaluate", run, "--ks", "10", "20", "--split", "test")
    assert "ndcg@20" in done.stdout.splitlines()[0]
    refused = bigrank("evaluate", run, "--ks", "0", check=False)
    assert refused.returncode == 2 and "eval.ks" in refused.stderr, refused.stderr
    evaluated = json.loads((run / "eval.json").read_text())["test"]
    assert evaluated["recall@20"] == pytest.approx(trained["test"]["recall@20"], abs=1e-9)

    catalog, user_table = (t.double().numpy() for t in checkpoint_parameters(latest_checkpoint(run))[:2])
    expected = brute_force_metrics(data, "test", user_table, catalog, [10, 20], exclude=("train", "valid"))
    for name, value in expected.items():
        assert evaluated[name] == pytest.approx(value, abs=1e-6), name
    leaky = brute_force_metrics(data, "test", user_table, catalog, [20])  # valid items left in the rankings
    assert leaky["recall@20"] != pytest.approx(expected["recall@20"], abs=1e-6)
    assert evaluated["recall@20"] > 0.4  # it learned: a random list of 20 finds ~20/88 of a user's test items


def test_a_carve_that_leaves_valid_empty_and_a_test_without_pairs_are_named(tmp_path, capsys):
    train, test = write_lines(tmp_path / "train.txt", {1: [2]}), write_lines(tmp_path / "test.txt", {1: [3]})
    base = ["--split", "given", "--train", train, "--format", "user-lines"]
    code, _, err = _cli(capsys, *base, "--test", test, "--out", tmp_path / "a")
    assert code == 2 and "--valid-fraction 0.1 carved no train pair into valid" in err, err
    code, _, err = _cli(capsys, *base, "--test", train, "--valid-fraction", "0", "--out", tmp_path / "b")
    assert code == 2 and "the test split has no rows" in err, err  # its one pair is train's too: kept in train
    for out in (tmp_path / "a", tmp_path / "b"):
        assert not out.exists() or not any(out.iterdir())
    assert _cli(capsys, *base, "--test", test, "--valid-fraction", "0", "--out", tmp_path / "c")[0] == 0
