"""The per-user index of a split (``bigrank.data.user_index``): equal to the split's files, used by evaluation with
the same result, never read when the dataset changed, a damaged file named or rebuilt, one of two concurrent
builders building (real Parquet files, real processes; with gloo ranks in ``tests/test_evaluate.py``)."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from bigrank.data import manifest as layout
from bigrank.data import user_index
from bigrank.data.manifest import DatasetManifest
from bigrank.data.stream import read_user_items
from bigrank.data.user_index import INDEX_DIR, ensure_index, index_path, open_index
from bigrank.errors import CorruptFileError
from bigrank.train.evaluate import evaluation_data
from tests.conftest import REPO
from tests.helpers import write_bad_dataset, write_small_dataset

ITEM_RANGE = (5, 30)  # a rank's catalog rows: the excluded items are cut to them


def data_arrays(data) -> list[np.ndarray]:
    return [data.users, *data.relevant, *data.excluded, np.array([data.candidate_users])]


def same_data(a, b) -> bool:
    return all(np.array_equal(x, y) for x, y in zip(data_arrays(a), data_arrays(b), strict=True))


def read_both(root, **options):
    """``evaluation_data`` of test, 9 sampled users, from the index (where there is one) and from the files."""
    kwargs = dict(sample_users=9, seed=2, **options)
    return (
        evaluation_data(root, "test", ITEM_RANGE, **kwargs),
        evaluation_data(root, "test", ITEM_RANGE, use_index=False, **kwargs),
    )


def all_items(index) -> tuple[np.ndarray, np.ndarray]:
    """The whole index as CSR arrays (every user's items)."""
    indptr, items = index.items_of(np.arange(index.num_users))
    return indptr, items.astype(np.int32)


def build(root, *splits, **options):
    manifest = DatasetManifest.load(root)
    return [ensure_index(manifest, split, **options) for split in splits]


@pytest.fixture
def tiny(tmp_path):
    write_small_dataset(tmp_path)
    return tmp_path


def test_index_holds_the_split_and_evaluation_reads_it(tiny):
    # block_ratings=50: the train split (~500 pairs) goes through the spill files and several sorted blocks
    splits = ("train", "valid", "test")
    for index, split in zip(build(tiny, *splits, block_ratings=50), splits, strict=True):
        indptr, items = read_user_items(tiny, split)
        assert np.array_equal(index.indptr, indptr)
        assert all(np.array_equal(a, b) for a, b in zip(all_items(index), (indptr, items), strict=True))
    with_index, from_files = read_both(tiny)
    assert same_data(with_index, from_files) and len(with_index.excluded[1]) > 0
    union, from_files = read_both(tiny, exclude_splits=("train", "valid"))  # the union of two indexes
    assert same_data(union, from_files)
    nothing, from_files = read_both(tiny, exclude_splits=())
    assert same_data(nothing, from_files) and len(nothing.excluded[1]) == 0
    # The index is what is read: a train file overwritten with other bytes of the same size and time (which the
    # index's key cannot see; `bigrank verify` can) fails the read of the files, not the one of the index.
    manifest = DatasetManifest.load(tiny)
    part = manifest.files("train")[0]
    stat = part.stat()
    part.write_bytes(b"\0" * stat.st_size)
    os.utime(part, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert same_data(evaluation_data(tiny, "test", ITEM_RANGE, sample_users=9, seed=2), with_index)
    with pytest.raises(Exception, match="part-00000"):
        evaluation_data(tiny, "test", ITEM_RANGE, sample_users=9, seed=2, use_index=False)


def test_ids_outside_the_manifest_are_an_error(tmp_path):
    # Out-of-range ids would make keys of other users (items) or be dropped by the user-range filter (users).
    write_bad_dataset(tmp_path)  # an item id 99 of 37 in train
    with pytest.raises(ValueError, match=r"item_id values outside \[0, 37\)"):
        build(tmp_path, "train")
    write_small_dataset(tmp_path / "users")
    manifest = DatasetManifest.load(tmp_path / "users")
    name = manifest.raw["splits"]["test"]["files"][0]
    layout.write_parquet_atomic(
        tmp_path / "users" / name, {"user_id": np.array([60, 1], np.int32), "item_id": np.array([0, 1], np.int32)}
    )
    layout.write_manifest(
        tmp_path / "users",
        num_users=60,
        num_items=37,
        seed=0,
        source="test",
        generator={},
        split_files={s: manifest.raw["splits"][s]["files"] for s in layout.SPLITS},
    )
    with pytest.raises(ValueError, match=r"user_id values outside \[0, 60\)"):
        build(tmp_path / "users", "test")


@pytest.mark.parametrize("gap, run", [(0, 1), (0, 40), (30, 40), (4096, 1 << 24)])
def test_users_slices_read_in_ranges_of_any_size(tiny, monkeypatch, gap, run):
    # Slices read one by one, in ranges bridging small gaps, or whole; a range never exceeds ``run`` items
    # unless one slice alone does.
    monkeypatch.setattr(user_index, "READ_GAP_ITEMS", gap)
    monkeypatch.setattr(user_index, "READ_RUN_ITEMS", run)
    (index,) = build(tiny, "train")
    indptr, items = read_user_items(tiny, "train")
    users = np.array([0, 1, 2, 7, 8, 30, 31, 59])
    got_indptr, got_items = index.items_of(users)
    want = [items[indptr[u] : indptr[u + 1]] for u in users]
    assert np.array_equal(got_indptr, np.concatenate([[0], np.cumsum([len(w) for w in want])]))
    assert np.array_equal(got_items, np.concatenate(want))
    cut_indptr, cut_items = index.items_of(users, item_range=ITEM_RANGE)
    cut = [w[(w >= ITEM_RANGE[0]) & (w < ITEM_RANGE[1])] for w in want]
    assert np.array_equal(cut_items, np.concatenate(cut)) and np.array_equal(np.diff(cut_indptr), [len(c) for c in cut])
    with pytest.raises(ValueError, match="ascending"):
        index.items_of(users[::-1])


def test_a_changed_dataset_is_never_read_through_a_stale_index(tiny):
    build(tiny, "train", "test")
    write_small_dataset(tiny, seed=5)  # other pairs, same file names
    manifest = DatasetManifest.load(tiny)
    assert open_index(manifest, "train") is None and open_index(manifest, "test") is None
    with_index, from_files = read_both(tiny)
    assert same_data(with_index, from_files)
    (index,) = build(tiny, "train")  # rebuilt for the new files; the stale one is deleted
    assert np.array_equal(all_items(index)[1], read_user_items(tiny, "train")[1])
    assert [p.name for p in (tiny / INDEX_DIR).glob("train-*.csr")] == [index.path.name]


def test_a_damaged_index_is_named_and_rebuilt(tiny, capsys):
    (index,) = build(tiny, "train")
    build(tiny, "test")
    path, size = index.path, index.path.stat().st_size
    manifest = DatasetManifest.load(tiny)
    with open(path, "r+b") as handle:
        handle.truncate(size - 4)  # the last item gone
    with pytest.raises(CorruptFileError, match="truncated") as caught:
        open_index(manifest, "train")
    assert caught.value.path == path
    # Evaluation says so and reads the files instead: the same data.
    with_index, from_files = read_both(tiny)
    assert same_data(with_index, from_files)
    assert f"{path}" in capsys.readouterr().err
    # What a builder killed mid-way left (its temporary file and spill directory) goes with the next build.
    (path.parent / f".{path.name}.tmp-999999").write_bytes(b"partial")
    (path.parent / ".spill-train-x").mkdir()
    (rebuilt,) = build(tiny, "train", progress=print)
    assert sorted(p.name for p in path.parent.glob("*train*")) == [".train.lock", path.name]
    assert "rebuilding" in capsys.readouterr().out and rebuilt.path.stat().st_size == size
    # A changed byte in the user offsets fails their checksum.
    with open(path, "r+b") as handle:
        handle.seek(4096 + 8 * 3)
        handle.write(b"\x07")
    with pytest.raises(CorruptFileError, match="checksum"):
        open_index(manifest, "train")


BUILD = """
import sys
from bigrank.data.manifest import DatasetManifest
from bigrank.data.user_index import ensure_index
index = ensure_index(DatasetManifest.load(sys.argv[1]), "train", progress=print, block_ratings=20)
print("path", index.path)
"""


def test_two_processes_building_at_once_build_once(tiny):
    env = dict(os.environ, PYTHONPATH=str(REPO))
    command = [sys.executable, "-c", BUILD, str(tiny)]
    processes = [subprocess.Popen(command, env=env, stdout=subprocess.PIPE, text=True) for _ in range(2)]
    outputs = [process.communicate(timeout=120)[0] for process in processes]
    assert [process.returncode for process in processes] == [0, 0]
    assert sum("building the user index" in output for output in outputs) == 1  # the other waited, then opened it
    path = index_path(DatasetManifest.load(tiny), "train")
    assert all(f"path {path}" in output for output in outputs)
    assert sorted(p.name for p in (tiny / INDEX_DIR).iterdir()) == [".train.lock", path.name]  # no temporary left
    items = all_items(open_index(DatasetManifest.load(tiny), "train"))[1]
    assert np.array_equal(items, read_user_items(tiny, "train")[1])
