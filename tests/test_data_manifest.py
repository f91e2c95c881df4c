"""Dataset layout: manifest figures equal the rows on disk; missing / truncated / corrupt files are errors
naming the file, raised up front."""

from __future__ import annotations

import json

import numpy as np
import pyarrow.parquet as pq
import pytest

from bigrank.data import manifest as layout


def make_dataset(root, rows=(1000, 200, 100), row_group_size=64, rows_per_file=300, num_users=50, num_items=70):
    """A small real dataset with several files and row groups per split."""
    rng = np.random.default_rng(0)
    files = {}
    for split, count in zip(layout.SPLITS, rows, strict=True):
        columns = {
            "user_id": rng.integers(0, num_users, count),
            "item_id": rng.integers(0, num_items, count),
        }
        files[split] = layout.write_split_parts(
            root, split, columns, rows_per_file=rows_per_file, row_group_size=row_group_size
        )
    return layout.write_manifest(
        root, num_users=num_users, num_items=num_items, split_files=files, seed=0, source="test", generator={}
    )


def test_manifest_counts_equal_rows_on_disk(tmp_path):
    manifest = make_dataset(tmp_path)
    assert manifest == layout.load_manifest(tmp_path)
    for split, info in manifest["splits"].items():
        on_disk = sum(pq.ParquetFile(tmp_path / name).metadata.num_rows for name in info["files"])
        assert info["rows"] == on_disk == sum(info["file_rows"])
        assert [len(g) for g in info["row_groups"]] == [
            pq.ParquetFile(tmp_path / name).metadata.num_row_groups for name in info["files"]
        ]
        assert all(name.startswith(f"{split}/part-") for name in info["files"])
    assert manifest["splits"]["train"]["rows"] == 1000 and len(manifest["splits"]["train"]["files"]) == 4
    assert manifest["schema"] == {"user_id": "int32", "item_id": "int32"}
    assert layout.validate_dataset(tmp_path, deep=True)["num_ratings"] == 1300


def test_no_temporary_files_left_and_stale_ones_removed(tmp_path):
    make_dataset(tmp_path)
    assert not list(tmp_path.rglob(".*.tmp-*"))
    (tmp_path / "train" / ".part-00009.parquet.tmp-123").write_bytes(b"half")
    assert layout.remove_stale_temporaries(tmp_path) == 1


def test_missing_manifest_and_bad_manifest(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        layout.load_manifest(tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match="manifest.json"):
        layout.load_manifest(tmp_path)
    (tmp_path / "manifest.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        layout.load_manifest(tmp_path)
    (tmp_path / "manifest.json").write_text(json.dumps({"format_version": 1}))
    with pytest.raises(ValueError, match="lacks the keys"):
        layout.load_manifest(tmp_path)


def test_missing_file_is_named(tmp_path):
    manifest = make_dataset(tmp_path)
    victim = manifest["splits"]["valid"]["files"][0]
    (tmp_path / victim).unlink()
    with pytest.raises(FileNotFoundError, match=victim):
        layout.validate_dataset(tmp_path)
    layout.validate_dataset(tmp_path, splits=["train"])  # other splits are still fine


def test_truncated_file_is_named(tmp_path):
    manifest = make_dataset(tmp_path)
    victim = tmp_path / manifest["splits"]["train"]["files"][1]
    data = victim.read_bytes()
    victim.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=f"truncated.*{victim.name}"):
        layout.validate_dataset(tmp_path)


def test_corrupt_footer_is_named(tmp_path):
    manifest = make_dataset(tmp_path)
    victim = tmp_path / manifest["splits"]["test"]["files"][0]
    size = victim.stat().st_size
    victim.write_bytes(b"\0" * size)  # same size, garbage content
    with pytest.raises(ValueError, match=f"corrupt.*{victim.name}"):
        layout.validate_dataset(tmp_path)


def test_corrupt_pages_found_by_deep_check(tmp_path):
    manifest = make_dataset(tmp_path)
    victim = tmp_path / manifest["splits"]["train"]["files"][0]
    data = bytearray(victim.read_bytes())
    data[8:400] = b"\xff" * 392  # data pages, footer intact
    victim.write_bytes(bytes(data))
    layout.validate_dataset(tmp_path)  # the cheap check reads footers only
    with pytest.raises(ValueError, match=victim.name):
        layout.validate_dataset(tmp_path, deep=True)


def test_replaced_file_with_other_rows_is_named(tmp_path):
    manifest = make_dataset(tmp_path)
    name = manifest["splits"]["train"]["files"][0]
    layout.write_parquet_atomic(tmp_path / name, {"user_id": np.zeros(5), "item_id": np.zeros(5)})
    with pytest.raises(ValueError, match=name.split("/")[-1]):
        layout.validate_dataset(tmp_path)


def test_random_split_labels_exact_sizes():
    labels = layout.random_split_labels(np.random.default_rng(0), 1001)
    assert np.bincount(labels).tolist() == [801, 100, 100]
    again = layout.random_split_labels(np.random.default_rng(0), 1001)
    assert np.array_equal(labels, again)


def test_a_format_1_dataset_still_loads_and_an_unknown_format_is_named(tmp_path):
    manifest = make_dataset(tmp_path)
    assert manifest["format_version"] == layout.FORMAT_VERSION == 2
    older = dict(manifest, format_version=1)  # written before the ingest engine: no per-user index, int64 ids
    (tmp_path / "manifest.json").write_text(json.dumps(older))
    assert layout.DatasetManifest.load(tmp_path).raw["format_version"] == 1
    layout.validate_dataset(tmp_path, deep=True)
    (tmp_path / "manifest.json").write_text(json.dumps(dict(manifest, format_version=3)))
    with pytest.raises(ValueError, match="format_version 3, this bigrank reads 1 and 2"):
        layout.load_manifest(tmp_path)
