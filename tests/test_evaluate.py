"""Distributed full-catalog evaluation equals a brute-force numpy ranking (real Parquet files, real gloo ranks)."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
import torch.distributed as dist

from bigrank.data import manifest as layout
from bigrank.data.stream import iter_row_groups
from bigrank.data.user_index import ensure_index
from bigrank.model.catalog import CatalogShard
from bigrank.train.evaluate import (
    evaluate_model,
    evaluation_data,
    evaluation_users,
    format_eval_table,
    ranked_batches,
    write_eval_json,
)
from tests.conftest import brute_force_metrics, read_pairs
from tests.distributed_utils import run_distributed
from tests.helpers import SMALL_ITEMS as NUM_ITEMS
from tests.helpers import SMALL_USERS as NUM_USERS
from tests.helpers import write_bad_dataset, write_small_dataset

DIM = 6
KS = (1, 5, 40)  # 40 > NUM_ITEMS: the lists are shorter than K and padded after the excluded items


def tables(seed: int = 1):
    generator = torch.Generator().manual_seed(seed)
    user_table = torch.randn(NUM_USERS, DIM, generator=generator, dtype=torch.float64)
    item_table = torch.randn(NUM_ITEMS, DIM, generator=generator, dtype=torch.float64)
    return user_table, item_table


def make_shard(item_table, group) -> CatalogShard:
    shard = CatalogShard(NUM_ITEMS, DIM, group, dtype=torch.float64)
    with torch.no_grad():
        shard.weight.copy_(item_table[shard.start : shard.stop])
    return shard


def embedding_fn(user_table, group, calls: list):
    """A plain nn.Embedding user tower that, like a sharded tower, runs a collective on every call: the batch
    sizes of all ranks must agree, or the all-reduce pairs calls up wrongly and the check fails (or hangs)."""
    embedding = torch.nn.Embedding.from_pretrained(user_table)

    def user_vectors(user_ids: torch.Tensor) -> torch.Tensor:
        assert user_ids.dtype == torch.int64 and not torch.is_grad_enabled()
        if group is not None:
            largest = torch.tensor([len(user_ids)])
            dist.all_reduce(largest, op=dist.ReduceOp.MAX, group=group)
            assert int(largest) == len(user_ids)
        calls.append(len(user_ids))
        return embedding(user_ids)

    return user_vectors


def _evaluate_body(rank, world_size, group, root, user_table, item_table, sample, bad_root, indexed_root):
    shard = make_shard(item_table, group)
    calls: list[int] = []
    fn = embedding_fn(user_table, group, calls)
    results = {
        "valid": evaluate_model(fn, shard, root, "valid", KS, group=group, batch_size=7),
        "test": evaluate_model(fn, shard, root, "test", KS, group=group, batch_size=1000, max_score_elements=100),
        "sample": evaluate_model(fn, shard, root, "valid", KS, group=group, sample_users=sample, seed=3),
    }
    # An uneven split of the catalog, rank 0 owning no item at all, gives the same answer.
    uneven = CatalogShard(NUM_ITEMS, DIM, group, dtype=torch.float64, bounds=[(0, 0), (0, NUM_ITEMS)][rank])
    with torch.no_grad():
        uneven.weight.copy_(item_table[uneven.start : uneven.stop])
    results["uneven"] = evaluate_model(fn, uneven, root, "valid", KS, group=group, batch_size=7)
    users = evaluation_users(root, "valid")
    ranked = [top.numpy() for _, _, top in ranked_batches(fn, shard, root, users, NUM_ITEMS, group=group)]
    # The ranks read disjoint row groups: each rank's data equals what one process reading every file finds.
    shared = evaluation_data(root, "test", (shard.start, shard.stop), sample_users=9, group=group)
    alone = evaluation_data(root, "test", (shard.start, shard.stop), sample_users=9)
    arrays = [(data.users, *data.relevant, *data.excluded) for data in (shared, alone)]
    same_data = all(np.array_equal(a, b) for a, b in zip(*arrays, strict=True))
    # ``indexed_root``: the same dataset with its user indexes (bigrank.data.user_index). The ranks read them
    # (no exchange) and evaluate as from the files; when only rank 0 has them (rank 1 reads ``root``), both read
    # the files (else the collective read that only rank 1 joined would hang).
    indexed = evaluate_model(embedding_fn(user_table, group, []), shard, indexed_root, "valid", KS, group=group)
    for data_root in (indexed_root, [indexed_root, root][rank]):
        data = evaluation_data(data_root, "test", (shard.start, shard.stop), sample_users=9, group=group)
        arrays = [(data.users, *data.relevant, *data.excluded), arrays[1]]
        same_data = same_data and all(np.array_equal(a, b) for a, b in zip(*arrays, strict=True))
    # A bad file only rank 0 reads: rank 0 raises its error, rank 1 a ValueError quoting it (none waits forever).
    try:
        evaluation_data(bad_root, "valid", (shard.start, shard.stop), group=group)
        error = None
    except ValueError as caught:
        error = str(caught)
    return {
        "results": results,
        "indexed": indexed,
        "ranked": np.concatenate(ranked),
        "users": users,
        "calls": calls,
        "same_data": same_data,
        "excluded_rows": (shared.item_range, len(shared.excluded[1])),
        "error": error,
    }


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    write_small_dataset(root)
    return root


def test_row_group_shares_partition_the_split(tiny):
    whole = list(iter_row_groups(tiny, "train"))
    assert len(whole) > 4  # several files and row groups
    shares = [list(iter_row_groups(tiny, "train", share=(index, 3))) for index in range(3)]
    assert [len(share) for share in shares] == [len(whole[i::3]) for i in range(3)]
    for index, share in enumerate(shares):  # group g of the split's list goes to reader g % 3, in file order
        for got, want in zip(share, whole[index::3], strict=True):
            assert all(np.array_equal(got[c], want[c]) for c in ("user_id", "item_id"))
    with pytest.raises(ValueError, match="share"):
        next(iter_row_groups(tiny, "train", share=(3, 3)))


def test_two_ranks_equal_brute_force(tiny, tmp_path):
    user_table, item_table = tables()
    sample = 13
    write_bad_dataset(tmp_path)
    indexed = tmp_path / "indexed"
    indexed.mkdir()
    write_small_dataset(indexed)
    manifest = layout.DatasetManifest.load(indexed)
    assert all(ensure_index(manifest, split) is not None for split in ("valid", "test", "train"))
    args = (tiny, user_table, item_table, sample, tmp_path, indexed)
    outputs = run_distributed(_evaluate_body, 2, args=args)
    assert outputs[0]["results"] == outputs[1]["results"], "results must be replicated on every rank"
    results = outputs[0]["results"]
    users, items = user_table.numpy(), item_table.numpy()
    sampled_users = evaluation_users(tiny, "valid", sample, seed=3)
    expected = {
        "valid": brute_force_metrics(tiny, "valid", users, items, KS),
        "test": brute_force_metrics(tiny, "test", users, items, KS),
        "sample": brute_force_metrics(tiny, "valid", users, items, KS, users=sampled_users),
    }
    for part, reference in expected.items():
        assert results[part]["users"] == reference["users"], part
        for name, value in reference.items():
            assert results[part][name] == pytest.approx(value, rel=1e-9, abs=1e-12), (part, name)
    assert results["uneven"] == results["valid"]
    assert outputs[0]["indexed"] == outputs[1]["indexed"] == results["valid"]  # read from the user indexes
    assert results["sample"]["sampled"] and not results["valid"]["sampled"]
    assert results["sample"]["users"] == sample < results["valid"]["users"]

    # Batches: valid in 7s; test capped at 100 scores per rank -> 2 * 100 // ceil(37 / 2) = 10 users; the sample and the
    # ranking in one batch each. Both ranks made the same calls (the all-reduce inside the tower checked it).
    def chunks(total, size):
        return [size] * (total // size) + ([total % size] if total % size else [])

    n_valid, n_test = results["valid"]["users"], results["test"]["users"]
    assert outputs[0]["calls"] == chunks(n_valid, 7) + chunks(n_test, 10) + [sample] + chunks(n_valid, 7) + [n_valid]
    assert outputs[1]["calls"] == outputs[0]["calls"]

    # Data read in shares and exchanged equals a single reader's; each rank keeps only its catalog rows.
    assert outputs[0]["same_data"] and outputs[1]["same_data"]
    assert outputs[0]["excluded_rows"][0] != outputs[1]["excluded_rows"][0]
    assert outputs[0]["error"] == f"split 'train' of {tmp_path} has item_id values outside [0, 37) (manifest)"
    assert (
        outputs[1]["error"]
        == f"rank 0 could not read splits ['train'] of {tmp_path}: ValueError: " + (outputs[0]["error"])
    )

    # Exclusion: no train item is ever ranked, and every other item is (k = the whole catalog).
    train = read_pairs(tiny, "train")
    ranked, ranked_users = outputs[0]["ranked"], outputs[0]["users"]
    assert (outputs[1]["ranked"] == ranked).all()
    for row, user in zip(ranked, ranked_users, strict=True):
        listed = set(row[row >= 0].tolist())
        assert not listed & train.get(int(user), set())
        assert listed | train.get(int(user), set()) == set(range(NUM_ITEMS))


def test_exclusion_changes_the_answer_when_train_items_score_highest(tiny):
    # One-hot items and users pointing at their own train items: without exclusion the train items (score ~10)
    # fill the top of every list; the small random part orders the other items.
    generator = torch.Generator().manual_seed(2)
    item_table = torch.eye(NUM_ITEMS, dtype=torch.float64)
    user_table = torch.rand(NUM_USERS, NUM_ITEMS, generator=generator, dtype=torch.float64)
    train = read_pairs(tiny, "train")
    for user, items in train.items():
        user_table[user, sorted(items)] += 10.0
    shard = CatalogShard(NUM_ITEMS, NUM_ITEMS, dtype=torch.float64)
    with torch.no_grad():
        shard.weight.copy_(item_table)
    fn = embedding_fn(user_table, None, [])
    excluded = evaluate_model(fn, shard, tiny, "valid", KS)
    reference = brute_force_metrics(tiny, "valid", user_table.numpy(), item_table.numpy(), KS)
    for name in ("accuracy", "recall@5", "ap@5"):
        assert excluded[name] == pytest.approx(reference[name], rel=1e-9, abs=1e-12)
    included = evaluate_model(fn, shard, tiny, "valid", KS, exclude_splits=())
    assert included["recall@5"] < excluded["recall@5"]
    users = evaluation_users(tiny, "valid")
    top = np.concatenate([t.numpy() for *_, t in ranked_batches(fn, shard, tiny, users, 1, exclude_splits=())])
    with_train = [(int(t), int(u)) for t, u in zip(top[:, 0], users, strict=True) if int(u) in train]
    assert len(with_train) > 20 and all(t in train[u] for t, u in with_train)


def test_certified_and_fp32_rankings_run_the_same_batches_and_metrics(tiny):
    # A float32 catalog (what training exports): the certified bf16 path may take it, and the batches must not
    # depend on the path, or the metric sums add up in another order and differ in the last bit.
    user_table, item_table = (table.float() for table in tables(seed=4))
    shard = CatalogShard(NUM_ITEMS, DIM)
    with torch.no_grad():
        shard.weight.copy_(item_table)
    fn = embedding_fn(user_table, None, [])
    users = evaluation_users(tiny, "valid")
    runs = {}
    for certified in (True, False):
        batches = ranked_batches(fn, shard, tiny, users, 5, max_score_elements=3 * NUM_ITEMS, certified_bf16=certified)
        runs[certified] = [(first, last, top.numpy()) for first, last, top in batches]
    assert [(first, last) for first, last, _ in runs[True]] == [(first, last) for first, last, _ in runs[False]]
    assert [(first, last) for first, last, _ in runs[True]][0] == (0, 6)  # 2 x 3 x NUM_ITEMS scores a batch
    assert all(np.array_equal(a, b) for (*_, a), (*_, b) in zip(runs[True], runs[False], strict=True))
    metrics = [
        evaluate_model(fn, shard, tiny, "valid", KS, max_score_elements=3 * NUM_ITEMS, certified_bf16=c)
        for c in (True, False)
    ]
    assert metrics[0] == metrics[1]


def test_bad_inputs(tiny):
    user_table, item_table = tables()
    fn = embedding_fn(user_table, None, [])
    shard = make_shard(item_table, None)
    with pytest.raises(ValueError, match="no split 'dev'"):
        evaluate_model(fn, shard, tiny, "dev", KS)
    with pytest.raises(ValueError, match="no split 'extra'"):
        evaluate_model(fn, shard, tiny, "valid", KS, exclude_splits=("extra",))
    with pytest.raises(ValueError, match="catalog has 40 items"):
        evaluate_model(fn, CatalogShard(40, DIM), tiny, "valid", KS)
    with pytest.raises(ValueError, match="returned shape"):
        evaluate_model(lambda ids: torch.zeros(len(ids), DIM + 1), shard, tiny, "valid", KS)
    with pytest.raises(ValueError, match="sample_users"):
        evaluate_model(fn, shard, tiny, "valid", KS, sample_users=0)
    with pytest.raises(FileNotFoundError):
        evaluate_model(fn, shard, tiny / "missing", "valid", KS)


def test_ids_outside_the_manifest_are_an_error(tmp_path):
    write_bad_dataset(tmp_path)
    user_table, item_table = tables()
    with pytest.raises(ValueError, match=r"item_id values outside \[0, 37\)"):
        evaluate_model(embedding_fn(user_table, None, []), make_shard(item_table, None), tmp_path, "valid", KS)


def test_eval_json_and_table(tmp_path):
    valid = {"accuracy": 0.25, "recall@10": 0.5, "ap@10": 0.125, "users": 1200, "split": "valid"}
    path = write_eval_json(tmp_path, {"valid": valid})
    assert json.loads(path.read_text()) == {"valid": valid}
    test = {"accuracy": float("nan"), "recall@10": np.float64(0.75), "ap@10": 0.5, "users": np.int64(3)}
    write_eval_json(tmp_path, {"test": test})
    written = json.loads(path.read_text())
    assert written["valid"] == valid  # kept
    assert written["test"] == {"accuracy": None, "recall@10": 0.75, "ap@10": 0.5, "users": 3}
    # No temporary left behind; the update lock's file stays (it means something only while locked).
    assert sorted(p.name for p in tmp_path.iterdir()) == [".eval.json.lock", "eval.json"]
    table = format_eval_table(written)
    lines = table.splitlines()
    assert lines[0].split() == ["split", "accuracy", "recall@10", "ap@10", "users"]
    assert lines[1].split() == ["valid", "0.2500", "0.5000", "0.1250", "1,200"]
    assert lines[2].split() == ["test", "-", "0.7500", "0.5000", "3"]
    with pytest.raises(FileNotFoundError):
        write_eval_json(tmp_path / "nope", {"valid": valid})


def test_test_split_leaves_out_valid_items_where_the_dataset_says_so(tiny, tmp_path):
    # Users pointing at their own valid items: on a dataset without an eval_exclude entry (random split), test's
    # lists are topped by them (they count as misses); where the manifest records the given split's rule (test
    # leaves out train and valid), none is listed, and the metrics equal the brute-force ranking without them.
    given = tmp_path / "given"
    shutil.copytree(tiny, given)
    manifest = json.loads((given / layout.MANIFEST_NAME).read_text())
    manifest["eval_exclude"] = {"valid": ["train"], "test": ["train", "valid"]}
    (given / layout.MANIFEST_NAME).write_text(json.dumps(manifest))
    assert layout.DatasetManifest.load(given).excluded_splits("test") == ("train", "valid")
    assert layout.DatasetManifest.load(tiny).excluded_splits("test") == ("train",)

    generator = torch.Generator().manual_seed(5)
    item_table = torch.eye(NUM_ITEMS, dtype=torch.float64)
    user_table = torch.rand(NUM_USERS, NUM_ITEMS, generator=generator, dtype=torch.float64)
    valid = read_pairs(tiny, "valid")
    for user, items in valid.items():
        user_table[user, sorted(items)] += 10.0
    shard = CatalogShard(NUM_ITEMS, NUM_ITEMS, dtype=torch.float64)
    with torch.no_grad():
        shard.weight.copy_(item_table)
    fn = embedding_fn(user_table, None, [])
    users = evaluation_users(tiny, "test")
    with_valid = [u for u in users if int(u) in valid]
    assert len(with_valid) > 10

    def first_items(root):
        data = evaluation_data(root, "test", (0, NUM_ITEMS))
        batches = ranked_batches(fn, shard, root, data.users, 1, exclude_splits=data.exclude_splits)
        first = np.concatenate([t.numpy() for *_, t in batches])[:, 0]
        return dict(zip(data.users.tolist(), first.tolist(), strict=True))

    plain, ruled = first_items(tiny), first_items(given)
    assert all(plain[int(u)] in valid[int(u)] for u in with_valid)
    assert not any(ruled[int(u)] in valid[int(u)] for u in with_valid)
    result = evaluate_model(fn, shard, given, "test", KS)
    reference = brute_force_metrics(
        tiny, "test", user_table.numpy(), item_table.numpy(), KS, exclude=("train", "valid")
    )
    for name, value in reference.items():
        assert result[name] == pytest.approx(value, rel=1e-9, abs=1e-12), name
    assert result == evaluate_model(fn, shard, tiny, "test", KS, exclude_splits=("train", "valid"))
