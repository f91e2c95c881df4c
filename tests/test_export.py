"""Embeddings export: per-rank Parquet parts + manifest, verified loading, FAISS indexes, recommend."""

from __future__ import annotations

import json

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from bigrank.cli import main as cli_main
from bigrank.data import manifest as layout
from bigrank.data.synthetic import generate
from bigrank.export.index import brute_force_top_k, build_export_index, build_index, search
from bigrank.export.recommend import Recommender, SeenItems, load_export, read_table
from bigrank.export.writer import export_embeddings, quantize_int8
from tests.distributed_utils import run_distributed
from tests.helpers import random_tables, write_export, write_ingested_dataset

DIM = 8
NUM_ITEMS = 301
NUM_USERS = 157


def _export_rank(rank, world_size, group, out_dir, dataset_root, tables, ranges):
    """Each rank exports only its row ranges of the known tables."""
    rows = {}
    for name, table in tables.items():
        start, stop = ranges[name][rank]
        rows[name] = (start, stop, table[start:stop].clone())
    return export_embeddings(
        out_dir,
        rank=rank,
        world_size=world_size,
        group=group,
        item_rows=rows["items"],
        user_rows=rows["users"],
        history_rows=rows["history"],
        dataset_root=dataset_root,
        model_info={"loss": "softmax", "dim": DIM, "has_history": True},
        quantize=("float16", "int8"),
    )


def test_two_rank_export_equals_the_full_tables(tmp_path):
    dataset = tmp_path / "data"
    write_ingested_dataset(dataset, NUM_USERS, NUM_ITEMS)
    tables = random_tables(NUM_ITEMS, NUM_USERS, DIM)
    # Uneven shards, and rank 1 owns no user rows at all.
    ranges = {
        "items": [(0, 120), (120, NUM_ITEMS)],
        "users": [(0, NUM_USERS), (NUM_USERS, NUM_USERS)],
        "history": [(0, 200), (200, NUM_ITEMS)],
    }
    out = tmp_path / "export"
    results = run_distributed(_export_rank, 2, args=(str(out), str(dataset), tables, ranges), timeout=90)
    assert results[1] is None and results[0]["num_items"] == NUM_ITEMS

    manifest = load_export(out, verify=True)
    assert manifest == json.loads((out / "manifest.json").read_text())
    assert manifest["score"] == "inner_product" and manifest["dim"] == DIM and manifest["world_size"] == 2
    assert [p["file"] for p in manifest["tables"]["items"]["parts"]] == [
        "items/part-r00000.parquet",
        "items/part-r00001.parquet",
    ]
    for name in ("items", "users", "history"):
        back = read_table(out, manifest, name)
        np.testing.assert_array_equal(back["embedding"], tables[name].numpy())
        np.testing.assert_array_equal(back["ids"], np.arange(len(tables[name])))
        half = read_table(out, manifest, f"{name}_float16")["embedding"]
        np.testing.assert_array_equal(half, tables[name].numpy().astype(np.float16))
        int8 = read_table(out, manifest, f"{name}_int8")
        error = np.abs(int8["embedding"] * int8["scale"][:, None] - tables[name].numpy())
        assert (error <= int8["scale"][:, None] / 2 + 1e-6).all()
    items = read_table(out, manifest, "items")
    np.testing.assert_array_equal(items["original_id"], 1000 + 3 * np.arange(NUM_ITEMS))
    assert items["title"][5] == "Movie 5 (1999)"
    np.testing.assert_array_equal(read_table(out, manifest, "users")["original_id"], 10 * np.arange(NUM_USERS) + 7)

    # Each rank wrote the seen items of half the users; together they equal the dataset's.
    assert [part["row_start"] for part in manifest["tables"]["seen"]["parts"]] == [0, NUM_USERS // 2]
    from bigrank.export.seen import SeenItemsFile

    from_export, from_data = SeenItemsFile(out, manifest, ("train",)), SeenItems(dataset, ("train",))
    for user in range(NUM_USERS):
        np.testing.assert_array_equal(from_export.items_of(user), from_data.items_of(user))

    schema = pq.read_schema(out / "items/part-r00001.parquet")
    assert str(schema.field("item_id").type) == "int32"
    assert str(schema.field("embedding").type) == f"fixed_size_list<element: float>[{DIM}]"
    assert str(schema.field("original_id").type) == "int64"


def _failing_rank(rank, world_size, group, out_dir):
    values = torch.zeros(5, DIM)
    if rank == 1:
        values[2, 3] = float("nan")
    try:
        export_embeddings(
            out_dir,
            rank=rank,
            world_size=world_size,
            group=group,
            item_rows=(5 * rank, 5 * rank + 5, values),
            user_rows=(5 * rank, 5 * rank + 5, values),
            model_info={"dim": DIM},
        )
    except ValueError as error:
        return str(error)
    return "no error"


def test_a_bad_rank_fails_every_rank_without_a_manifest(tmp_path):
    out = tmp_path / "export"
    messages = run_distributed(_failing_rank, 2, args=(str(out),), timeout=90)
    assert all("rank 1" in m and "NaN" in m for m in messages), messages
    assert not (out / "manifest.json").exists()


def export_single(out, tables=None, **options):
    """``write_export`` of ``tables`` (random ones by default) from one rank."""
    return write_export(out, tables or random_tables(NUM_ITEMS, NUM_USERS, DIM), **options)


def test_shards_that_do_not_tile_the_table_are_rejected(tmp_path):
    tables = random_tables(NUM_ITEMS, NUM_USERS, DIM)
    with pytest.raises(ValueError, match="do not tile"):
        export_embeddings(
            tmp_path / "export",
            rank=0,
            world_size=1,
            group=None,
            item_rows=(10, NUM_ITEMS, tables["items"][10:]),
            user_rows=(0, NUM_USERS, tables["users"]),
            model_info={},
        )
    with pytest.raises(ValueError, match="different dimensions"):
        export_single(tmp_path / "export2", tables={**tables, "items": tables["items"][:, :4]})
    with pytest.raises(ValueError, match=r"row range \[0, 10\) does not match 20 rows"):
        export_embeddings(
            tmp_path / "export3",
            rank=0,
            world_size=1,
            group=None,
            item_rows=(0, 10, tables["items"][:20]),
            user_rows=(0, NUM_USERS, tables["users"]),
            model_info={},
        )


def test_export_refuses_a_foreign_directory_and_replaces_an_old_export(tmp_path):
    foreign = tmp_path / "home"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    with pytest.raises(ValueError, match="not a bigrank export"):
        export_single(foreign)
    assert (foreign / "notes.txt").read_text() == "keep me"

    out = tmp_path / "export"
    export_single(out, quantize=("int8",))
    assert (out / "items_int8").is_dir()
    second = random_tables(NUM_ITEMS, NUM_USERS, DIM, seed=5)
    export_single(out, tables=second)
    assert not (out / "items_int8").exists()
    np.testing.assert_array_equal(read_table(out, load_export(out), "items")["embedding"], second["items"].numpy())


def test_truncated_or_corrupt_export_is_detected_by_name(tmp_path, capsys):
    out = tmp_path / "export"
    export_single(out)
    part = out / "items/part-r00000.parquet"
    data = part.read_bytes()
    part.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=r"truncated.*items/part-r00000\.parquet"):
        load_export(out)
    with pytest.raises(ValueError, match=r"items/part-r00000\.parquet"):
        Recommender(out)
    assert cli_main(["recommend", str(out), "--user", "1"]) == 2
    assert "part-r00000.parquet" in capsys.readouterr().err

    flipped = bytearray(data)
    flipped[len(data) // 3] ^= 0xFF  # same size, different content: only the checksum can tell
    part.write_bytes(bytes(flipped))
    with pytest.raises(ValueError, match=r"items/part-r00000\.parquet does not match its sha256"):
        load_export(out)

    part.unlink()
    with pytest.raises(FileNotFoundError, match=r"missing.*part-r00000\.parquet"):
        load_export(out, verify=False)
    (out / "manifest.json").unlink()
    with pytest.raises(FileNotFoundError, match="did not finish"):
        load_export(out)


def test_brute_force_reference_matches_a_full_sort():
    rng = np.random.default_rng(3)
    items, queries = rng.standard_normal((500, 6)), rng.standard_normal((7, 6))
    scores, ids = brute_force_top_k(items, queries, 10, chunk_elements=1000)
    full = queries @ items.T
    np.testing.assert_array_equal(ids, np.argsort(-full, axis=1, kind="stable")[:, :10])
    np.testing.assert_allclose(scores, np.sort(full, axis=1)[:, ::-1][:, :10], rtol=1e-5)


def test_exact_index_top_k_equals_numpy_brute_force(tmp_path):
    rng = np.random.default_rng(0)
    items = rng.standard_normal((3000, 16)).astype(np.float32)
    queries = rng.standard_normal((40, 16)).astype(np.float32)
    scores, ids = search(build_index(items, "exact"), queries, 25)
    ref_scores, ref_ids = brute_force_top_k(items, queries, 25)
    np.testing.assert_array_equal(ids, ref_ids)
    np.testing.assert_allclose(scores, ref_scores, rtol=1e-5, atol=1e-5)

    # The same through an export and the Recommender (saved exact index).
    tables = random_tables(NUM_ITEMS, NUM_USERS, DIM)
    out = tmp_path / "export"
    export_single(out, tables=tables, index=("exact",))
    rec = Recommender(out, index="exact")
    users, catalog = tables["users"].numpy(), tables["items"].numpy()
    for user in (0, 17, NUM_USERS - 1):
        got = rec.recommend(user, 10)
        _, ref = brute_force_top_k(catalog, users[user], 10)
        assert [row["item_id"] for row in got] == ref[0].tolist()
        np.testing.assert_allclose([row["score"] for row in got], catalog[ref[0]] @ users[user], rtol=1e-5)


def test_approximate_indexes_record_recall_and_exhaustive_ivf_is_exact(tmp_path):
    out = tmp_path / "export"
    export_single(out)
    entry = build_export_index(out, "ivf", {"nlist": 8, "nprobe": 8}, num_queries=100)
    assert entry["recall_at_10_vs_exact"] == 1.0  # probing every cell is a full scan
    hnsw = build_export_index(out, "hnsw", num_queries=100)
    assert hnsw["recall_queries"] == 100
    # The recorded recall is what the saved HNSW index finds: recomputed here on 100 user vectors against a
    # brute-force top 10 (the same queries: the sorted sample of numpy's default_rng(0)).
    from bigrank.export.index import read_index

    manifest = load_export(out)
    users = read_table(out, manifest, "users")["embedding"]
    items = read_table(out, manifest, "items")["embedding"]
    queries = users[np.sort(np.random.default_rng(0).choice(len(users), size=100, replace=False))]
    _, exact_ids = brute_force_top_k(items, queries, 10)
    _, hnsw_ids = search(read_index(out / hnsw["file"]), queries, 10)
    hits = sum(len(set(a.tolist()) & set(e.tolist())) for a, e in zip(hnsw_ids, exact_ids, strict=True))
    assert hnsw["recall_at_10_vs_exact"] == pytest.approx(hits / 1000, abs=1e-4)
    assert hnsw["recall_at_10_vs_exact"] >= 0.9  # 301 items, efSearch 128: HNSW misses very few
    assert set(manifest["indexes"]) == {"ivf", "hnsw"}
    ivf = [row["item_id"] for row in Recommender(out, index="ivf").recommend(4, 10)]
    exact = [row["item_id"] for row in Recommender(out, index="exact").recommend(4, 10)]
    assert ivf == exact


def _export_without_indexes(tmp_path):
    out = tmp_path / "plain"
    export_single(out)
    return out


def test_missing_approximate_index_is_a_clear_error(tmp_path):
    out = _export_without_indexes(tmp_path)
    with pytest.raises(ValueError, match="bigrank build-index"):
        Recommender(out, index="hnsw")


def popularity_export(tmp_path):
    """Demo dataset; every user vector is e0 and item i's first coordinate is its rating count."""
    data = tmp_path / "demo"
    dataset = generate("demo", data, progress=False)
    seen = SeenItems(data)
    counts = np.diff(seen._indptr)  # ratings per user
    popularity = np.zeros(dataset["num_items"], dtype=np.float32)
    for split in layout.SPLITS:
        for name in layout.split_info(dataset, split)["files"]:
            items = pq.read_table(data / name, columns=["item_id"]).column("item_id").to_numpy()
            popularity += np.bincount(items, minlength=dataset["num_items"])
    rng = np.random.default_rng(0)
    items = torch.tensor(rng.standard_normal((dataset["num_items"], 4)).astype(np.float32) * 1e-3)
    items[:, 0] = torch.from_numpy(popularity)
    users = torch.zeros(dataset["num_users"], 4)
    users[:, 0] = 1.0
    out = tmp_path / "export"
    tables = {"items": items, "users": users, "history": items}
    export_single(out, tables=tables, dataset_root=data, history=False)
    return out, data, seen, int(np.argmax(counts)), items.numpy()


def test_recommend_excludes_seen_items(tmp_path, capsys):
    out, data, seen, heavy_user, items = popularity_export(tmp_path)
    rec = Recommender(out)
    rated = seen.items_of(heavy_user)
    plain = [row["item_id"] for row in rec.recommend(heavy_user, 20)]
    assert set(plain) & set(rated.tolist()), "test premise: the popular items include some the user rated"
    filtered = [row["item_id"] for row in rec.recommend(heavy_user, 20, exclude_item_ids=rated)]
    assert not set(filtered) & set(rated.tolist())
    scores = items @ np.eye(4, dtype=np.float32)[0]
    scores[rated] = -np.inf
    assert filtered == np.argsort(-scores, kind="stable")[:20].tolist()

    assert (
        cli_main(["recommend", str(out), "--user", str(heavy_user), "-k", "20", "--exclude-seen", str(data), "--json"])
        == 0
    )
    rows = json.loads(capsys.readouterr().out)
    assert [row["item_id"] for row in rows] == filtered and all("score" in row for row in rows)
    assert cli_main(["recommend", str(out), "--user", str(heavy_user), "-k", "3"]) == 0
    table = capsys.readouterr().out
    assert "item_id" in table and "score" in table and str(plain[0]) in table


def test_recommend_prints_original_ids_and_titles(tmp_path, capsys):
    dataset = tmp_path / "data"
    write_ingested_dataset(dataset, NUM_USERS, NUM_ITEMS)
    out = tmp_path / "export"
    tables = random_tables(NUM_ITEMS, NUM_USERS, DIM)
    export_single(out, tables=tables, dataset_root=dataset)
    assert cli_main(["recommend", str(out), "--user", "17", "--original-ids", "-k", "4"]) == 0  # user 17 = dense 1
    text = capsys.readouterr().out
    _, ref = brute_force_top_k(tables["items"].numpy(), tables["users"].numpy()[1], 4)
    top = int(ref[0, 0])
    assert f"Movie {top} (1999)" in text and str(1000 + 3 * top) in text
    assert cli_main(["recommend", str(out), "--user", "18", "--original-ids"]) == 2


def test_fold_in_uses_the_mean_history_row(tmp_path):
    tables = random_tables(NUM_ITEMS, NUM_USERS, DIM)
    out = tmp_path / "export"
    export_single(out, tables=tables)
    rec = Recommender(out)
    given = [3, 50, 299]
    got = rec.recommend_items_history(given, 10)
    query = tables["history"].numpy()[given].mean(axis=0)
    scores = tables["items"].numpy() @ query
    scores[given] = -np.inf
    assert [row["item_id"] for row in got] == np.argsort(-scores, kind="stable")[:10].tolist()
    with pytest.raises(ValueError, match="outside"):
        rec.recommend_items_history([NUM_ITEMS], 10)

    plain = tmp_path / "no-history"
    export_single(plain, tables=tables, history=False)
    with pytest.raises(ValueError, match="no history table"):
        Recommender(plain).recommend_items_history(given, 10)


def test_int8_quantisation_error_bound():
    rng = np.random.default_rng(2)
    values = rng.standard_normal((50, 9)).astype(np.float32)
    values[3] = 0.0
    q, scale = quantize_int8(values)
    assert q.dtype == np.int8 and np.abs(q).max() <= 127
    assert (np.abs(q * scale[:, None] - values) <= scale[:, None] / 2 + 1e-7).all()


def test_history_tower_user_vector_adds_the_mean_of_the_train_items(tmp_path, capsys):
    dataset = tmp_path / "data"
    write_ingested_dataset(dataset, NUM_USERS, NUM_ITEMS)
    tables = random_tables(NUM_ITEMS, NUM_USERS, DIM)
    out = tmp_path / "export"
    manifest = export_single(out, tables=tables, dataset_root=dataset, user_vectors=None)
    assert manifest["user_vector"] == "table+history_mean"
    rec = Recommender(out)
    table = pq.read_table(dataset / "train/part-00000.parquet")
    users, items = table.column("user_id").to_numpy(), table.column("item_id").to_numpy()
    for user in (0, 40, NUM_USERS - 1):
        history = np.unique(items[users == user])
        expected = tables["users"].numpy()[user] + tables["history"].numpy()[history].mean(axis=0)
        np.testing.assert_allclose(rec.user_vector(user), expected, rtol=1e-6, atol=1e-6)
        _, ref = brute_force_top_k(tables["items"].numpy(), expected, 5)
        assert [row["item_id"] for row in rec.recommend(user, 5)] == ref[0].tolist()

    # The export's seen-items table carries the train items: serving needs no dataset.
    moved = Recommender(out, data_root=tmp_path / "gone")
    for user in (0, 40):
        np.testing.assert_array_equal(moved.user_vector(user), rec.user_vector(user))
    # Without that table (and without the dataset) the error says what is missing.
    bare = tmp_path / "bare"
    export_single(bare, tables=tables, dataset_root=dataset, user_vectors=None, seen=False)
    with pytest.raises(ValueError, match="history-tower model"):
        Recommender(bare, data_root=tmp_path / "gone").recommend(0, 5)


def test_a_failed_re_export_leaves_no_manifest_behind(tmp_path):
    out = tmp_path / "export"
    export_single(out)
    bad = random_tables(NUM_ITEMS, NUM_USERS, DIM)
    bad["users"][3, 0] = float("inf")
    with pytest.raises(ValueError, match="NaN or infinite"):
        export_single(out, tables=bad)
    with pytest.raises(FileNotFoundError, match="did not finish"):
        load_export(out)


def test_build_index_command_records_recall(tmp_path, capsys):
    out = tmp_path / "export"
    export_single(out)
    assert cli_main(["build-index", str(out), "--kind", "ivf", "--nlist", "4", "--nprobe", "4"]) == 0
    assert "recall@10 vs exact 1.0000" in capsys.readouterr().out
    entry = load_export(out)["indexes"]["ivf"]
    assert entry["params"]["nlist"] == 4 and entry["recall_at_10_vs_exact"] == 1.0
    assert cli_main(["recommend", str(out), "--user", "2", "--index", "ivf", "--json"]) == 0
    ivf_rows = json.loads(capsys.readouterr().out)
    assert [row["item_id"] for row in ivf_rows] == [row["item_id"] for row in Recommender(out).recommend(2, 10)]


SPLIT_CHOICES = [("train",), ("valid", "test"), ("train", "valid", "test")]


def test_seen_items_file_excludes_exactly_what_the_dataset_holds(tmp_path):
    """The export's compact seen table equals ``SeenItems`` over the dataset for every user and split set,
    whether written by one rank in one block or by three ranks in spilled blocks, read whole or by row group."""
    from bigrank.export.seen import SeenItemsFile, write_seen_part
    from bigrank.export.writer import _seen_entry

    data = tmp_path / "demo"
    dataset = generate("demo", data, progress=False)
    num_users = dataset["num_users"]
    references = {splits: SeenItems(data, splits) for splits in SPLIT_CHOICES}
    out = tmp_path / "export"
    export_single(out, tables=_tables_for(dataset), dataset_root=data, history=False)
    manifest = load_export(out)
    assert manifest["tables"]["seen"]["rows"] == num_users and manifest["tables"]["seen"]["splits"] == list(
        layout.SPLITS
    )

    split_out = tmp_path / "split"
    bounds = [0, num_users // 3, num_users // 3, num_users]  # rank 1 owns no users
    parts = [
        write_seen_part(split_out, rank, data, bounds[rank], bounds[rank + 1], block_ratings=97, group_users=7)
        for rank in range(3)
    ]
    split_manifest = {"num_items": dataset["num_items"], "tables": {"seen": _seen_entry(parts, data)}}
    assert not list((split_out / "seen").glob(".seen-spill-*")), "spill files are removed"
    readers = {
        "one block, preloaded": lambda splits: SeenItemsFile(out, manifest, splits),
        "three ranks, row groups": lambda splits: SeenItemsFile(split_out, split_manifest, splits, 0),
    }
    for name, make in readers.items():
        for splits, reference in references.items():
            seen = make(splits)
            for user in range(num_users):
                np.testing.assert_array_equal(seen.items_of(user), reference.items_of(user), err_msg=f"{name} {user}")
        train = make(("valid",))
        for user in range(0, num_users, 7):
            np.testing.assert_array_equal(train.train_items_of(user), references[("train",)].items_of(user))
    with pytest.raises(ValueError, match="outside"):
        SeenItemsFile(out, manifest).items_of(num_users)


def test_seen_items_file_counts_repeated_pairs_once_in_every_split_they_occur(tmp_path):
    from bigrank.export.seen import SeenItemsFile, write_seen_part
    from bigrank.export.writer import _seen_entry

    rng = np.random.default_rng(4)
    root = tmp_path / "repeats"
    pairs = {
        split: (rng.integers(0, 30, 400).astype(np.int32), rng.integers(0, 12, 400).astype(np.int32))
        for split in layout.SPLITS
    }
    files = {
        split: layout.write_split_parts(root, split, {"user_id": u, "item_id": i}) for split, (u, i) in pairs.items()
    }
    layout.write_manifest(root, num_users=30, num_items=12, split_files=files, seed=0, source="test", generator={})
    parts = [write_seen_part(tmp_path / "out", 0, root, 0, 30, block_ratings=100, group_users=4)]
    manifest = {"num_items": 12, "tables": {"seen": _seen_entry(parts, root)}}
    assert manifest["tables"]["seen"]["nnz"] < 1200  # 1,200 ratings of 360 possible pairs: repeats were merged
    for splits in SPLIT_CHOICES:
        seen = SeenItemsFile(tmp_path / "out", manifest, splits, preload_max_ratings=0)
        for user in range(30):
            expected = np.unique(np.concatenate([pairs[s][1][pairs[s][0] == user] for s in splits]))
            np.testing.assert_array_equal(seen.items_of(user), expected)


def _tables_for(dataset) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return {
        "items": torch.randn(dataset["num_items"], 4, generator=gen),
        "users": torch.randn(dataset["num_users"], 4, generator=gen),
        "history": torch.randn(dataset["num_items"], 4, generator=gen),
    }


def test_exclude_seen_from_the_export_equals_exclude_seen_from_the_dataset(tmp_path, capsys):
    out, data, seen, heavy_user, _ = popularity_export(tmp_path)
    assert cli_main(["recommend", str(out), "--user", str(heavy_user), "-k", "20", "--exclude-seen", "--json"]) == 0
    from_export = json.loads(capsys.readouterr().out)
    args = ["recommend", str(out), "--user", str(heavy_user), "-k", "20", "--exclude-seen", str(data), "--json"]
    assert cli_main(args) == 0
    assert from_export == json.loads(capsys.readouterr().out)
    assert not {row["item_id"] for row in from_export} & set(seen.items_of(heavy_user).tolist())


def test_quantised_indexes_record_recall_and_are_searched_by_name(tmp_path, capsys):
    out = tmp_path / "export"
    tables = random_tables(NUM_ITEMS, NUM_USERS, DIM)
    export_single(out, tables=tables, index=("exact-int8",))
    build_export_index(out, "ivf", {"nlist": 8, "nprobe": 8}, num_queries=100, quantize="float16")
    manifest = load_export(out)
    assert set(manifest["indexes"]) == {"exact-int8", "ivf-float16"}
    for name, entry in manifest["indexes"].items():
        assert entry["file"] == f"items/index-{name}.faiss" and 0.0 <= entry["recall_at_10_vs_exact"] <= 1.0
    # float16 keeps ~3 significant digits: with every IVF cell probed the top-10 of random data is intact.
    assert manifest["indexes"]["ivf-float16"]["recall_at_10_vs_exact"] >= 0.95
    assert manifest["indexes"]["exact-int8"]["recall_at_10_vs_exact"] >= 0.8
    int8 = Recommender(out, index="exact", quantize="int8")
    assert int8.index_kind == "exact-int8" and "ScalarQuantizer" in type(int8.index).__name__
    _, ref = brute_force_top_k(tables["items"].numpy(), tables["users"].numpy()[:50], 10)
    got = np.stack([[row["item_id"] for row in int8.recommend(user, 10)] for user in range(50)])
    from bigrank.export.index import recall_at_k

    assert recall_at_k(got, ref) >= 0.8
    with pytest.raises(ValueError, match="--quantize int8"):
        Recommender(out, index="hnsw-int8")
    assert cli_main(["build-index", str(out), "--kind", "hnsw", "--quantize", "int8"]) == 0
    assert "hnsw (int8) index" in capsys.readouterr().out
    assert "hnsw-int8" in load_export(out)["indexes"]


def test_the_export_package_has_no_import_cycles():
    """Every import between ``bigrank.export`` modules, function-local ones included, forms an acyclic graph
    whose leaf is ``format`` (issue 12)."""
    import ast
    from pathlib import Path

    package = Path(__file__).resolve().parents[1] / "bigrank" / "export"
    modules = {path.stem for path in package.glob("*.py")} - {"__init__"}
    graph = {}
    for name in modules:
        tree = ast.parse((package / f"{name}.py").read_text())
        found = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module:
                if node.module == "bigrank.export":
                    found |= {alias.name for alias in node.names}
                elif node.module.startswith("bigrank.export."):
                    found.add(node.module.split(".")[2])
        graph[name] = found & modules
    assert graph["format"] == set()
    done: set[str] = set()

    def visit(name: str, path: tuple[str, ...]) -> None:
        assert name not in path, f"import cycle: {' -> '.join((*path, name))}"
        if name not in done:
            for target in graph[name]:
                visit(target, (*path, name))
            done.add(name)

    for name in sorted(modules):
        visit(name, ())


def test_export_no_seen_writes_no_seen_table_and_serving_takes_the_dataset(workflow_run, tmp_path, capsys):
    """``bigrank export --no-seen`` (the seen table reads the whole dataset once per rank): the same tables
    as the default export, no ``seen`` table, and ``--exclude-seen DATA_ROOT`` then gives the answers the
    default export gives from its table."""
    from bigrank.cli import build_parser
    from tests.conftest import bigrank

    assert build_parser().parse_args(["export", "RUN", "--out", "OUT"]).seen is True
    assert build_parser().parse_args(["export", "RUN", "--out", "OUT", "--no-seen"]).seen is False
    out = tmp_path / "export-no-seen"
    bigrank("export", workflow_run.run, "--out", out, "--workers", 1, "--no-seen")
    without, default = load_export(out), load_export(workflow_run.export)
    assert "seen" not in without["tables"] and "seen" in default["tables"]
    for table in ("items", "users"):
        np.testing.assert_array_equal(
            read_table(out, without, table)["embedding"], read_table(workflow_run.export, default, table)["embedding"]
        )
    with pytest.raises(ValueError, match="no seen-items table"):
        Recommender(out).seen_items()
    for user in (0, 3, 7):
        capsys.readouterr()
        command = ["recommend", "--user", str(user), "--dense-ids", "-k", "5", "--json", "--exclude-seen"]
        assert cli_main([*command[:1], str(out), *command[1:], str(workflow_run.data)]) == 0
        from_dataset = json.loads(capsys.readouterr().out)
        assert cli_main([*command[:1], str(workflow_run.export), *command[1:]]) == 0
        assert from_dataset == json.loads(capsys.readouterr().out)
