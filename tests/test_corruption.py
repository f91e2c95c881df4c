"""Corruption named early (``bigrank.integrity``), on real files: a flipped byte in a dataset part, an export part or
a checkpoint file is an error or a report naming the file, never wrong data used in silence.

The flips are chosen to be the dangerous kind: ``silent_flip`` changes one byte of a row group's data so that the
file still decodes without page-checksum verification, to other in-range ids (what trained silently before).
"""

from __future__ import annotations

import json
import shutil
import zlib
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from bigrank.cli import main
from bigrank.data import manifest as layout
from bigrank.data.stream import ParquetStream
from bigrank.errors import CorruptFileError
from bigrank.export.format import load_export
from bigrank.export.recommend import Recommender
from bigrank.train.checkpoint import Checkpointer, checkpoint_path, latest_checkpoint
from tests.conftest import bigrank, tiny_run_yaml
from tests.helpers import random_split, random_tables, write_dataset, write_export

NUM_USERS, NUM_ITEMS = 500, 300
GROUP_ROWS = 2_000  # several row groups a part, so that the error can name one


def make_dataset(root: Path, rows: int = 12_000) -> dict:
    """A random dataset of ``rows`` ratings (80/10/10), row groups of ``GROUP_ROWS`` rows, written by bigrank."""
    rng = np.random.default_rng(7)
    users = rng.integers(0, NUM_USERS, rows, dtype=np.int32)
    items = rng.integers(0, NUM_ITEMS, rows, dtype=np.int32)
    splits = random_split(rng, users, items)
    return write_dataset(root, splits, NUM_USERS, NUM_ITEMS, rows_per_file=5_000, row_group_size=GROUP_ROWS)


def silent_flip(path: Path, row_group: int, column: int = 0, limit: int | None = None) -> int:
    """Flip one byte in the data of column ``column`` of ``row_group`` such that the file still reads without
    page-checksum verification, to other values within ``[0, limit)`` (``limit``: None, any values); the file
    is left modified. Returns the offset. Fails the test when no such byte exists (the test would prove nothing).
    """
    original = path.read_bytes()
    reference = pq.ParquetFile(path).read_row_group(row_group)
    chunk = pq.ParquetFile(path).metadata.row_group(row_group).column(column)
    start = chunk.dictionary_page_offset or chunk.data_page_offset
    end = start + chunk.total_compressed_size
    for offset in range(end - 1, start + 40, -5):  # from the end of the chunk: page payload, not its header
        data = bytearray(original)
        data[offset] ^= 0x04
        path.write_bytes(bytes(data))
        try:
            table = pq.ParquetFile(path, page_checksum_verification=False).read_row_group(row_group)
        except Exception:  # noqa: BLE001 - this flip breaks decoding: not the silent kind
            continue
        values = table.column(column).to_numpy()
        in_range = limit is None or (values.min() >= 0 and values.max() < limit)
        if not table.equals(reference) and in_range:
            return offset
    path.write_bytes(original)
    pytest.fail(f"no byte of row group {row_group} of {path} flips silently")


# --------------------------------------------------------------------------------------------------- datasets
def test_every_written_file_is_recorded_with_size_and_crc32(tmp_path):
    manifest = make_dataset(tmp_path)
    recorded = manifest["integrity"]
    assert recorded["checksum"] == "crc32" and recorded["page_checksums"] is True
    parts = [name for split in manifest["splits"].values() for name in split["files"]]
    assert sorted(recorded["files"]) == sorted(parts)
    for name, entry in recorded["files"].items():
        data = (tmp_path / name).read_bytes()
        assert entry["bytes"] == len(data)
        assert entry["crc32"] == f"{zlib.crc32(data):08x}"


def test_silent_flip_in_a_train_part_is_named_with_its_row_group_when_streamed(tmp_path):
    make_dataset(tmp_path)
    victim = tmp_path / "train/part-00000.parquet"
    silent_flip(victim, row_group=1, limit=NUM_USERS)
    stream = ParquetStream(tmp_path, "train", 500, shuffle=False)  # sizes and footers are intact
    with pytest.raises(
        CorruptFileError, match=r"train/part-00000\.parquet is corrupt: .* row group 1 fails its checksum"
    ) as caught:
        for _ in stream:
            pass
    assert caught.value.row_group == 1 and "bigrank verify" in str(caught.value)
    # the deep check (every row group decoded, ids in range) names it too: it reads with verification
    with pytest.raises(CorruptFileError, match="part-00000"):
        layout.validate_dataset(tmp_path, deep=True)


def test_truncated_part_is_named_by_the_size_check_at_stream_start(tmp_path):
    manifest = make_dataset(tmp_path)
    victim = tmp_path / manifest["splits"]["train"]["files"][1]
    victim.write_bytes(victim.read_bytes()[:-10])  # the footer goes too, but the size check comes first
    with pytest.raises(ValueError, match=r"truncated or was modified: .*part-00001\.parquet has \d+ bytes"):
        ParquetStream(tmp_path, "train", 100)


def test_verify_reports_every_damaged_file_and_exits_1(tmp_path, capsys):
    manifest = make_dataset(tmp_path)
    assert main(["verify", str(tmp_path)]) == 0
    assert f"OK  dataset {tmp_path}: {len(manifest['integrity']['files'])} files" in capsys.readouterr().out

    silent_flip(tmp_path / "valid/part-00000.parquet", row_group=0, column=1)
    footer_flip = tmp_path / "test/part-00000.parquet"
    data = bytearray(footer_flip.read_bytes())
    data[-20] ^= 0x01  # inside the footer: no page checksum covers it, the file checksum does
    footer_flip.write_bytes(bytes(data))
    truncated = tmp_path / "train/part-00001.parquet"
    truncated.write_bytes(truncated.read_bytes()[:100])
    assert main(["verify", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    damaged = [line for line in out.splitlines() if line.startswith("  DAMAGED")]
    assert len(damaged) == 3, out
    assert "valid/part-00000.parquet: corrupt: crc32" in out and "test/part-00000.parquet: corrupt: crc32" in out
    assert "train/part-00001.parquet: truncated or modified: 100 bytes" in out
    assert "FAILED" in out and "re-generate" in out


def test_verify_from_a_fresh_process_and_a_path_that_is_nothing(tmp_path):
    make_dataset(tmp_path / "data")
    (tmp_path / "data/train/part-00000.parquet").unlink()
    done = bigrank("verify", tmp_path / "data", check=False)
    assert done.returncode == 1 and "train/part-00000.parquet: missing" in done.stdout
    (tmp_path / "empty").mkdir()
    done = bigrank("verify", tmp_path / "empty", check=False)
    assert done.returncode == 2 and "is not a bigrank dataset" in done.stderr


def test_a_dataset_without_checksums_still_loads_and_verifies_what_it_can(tmp_path, capsys):
    """A dataset as bigrank wrote it before checksums: parts without page checksums, no ``integrity`` entry."""
    rng = np.random.default_rng(3)
    files = {}
    for split in layout.SPLITS:
        name = layout.part_name(split, 0)
        (tmp_path / split).mkdir()
        table = layout.arrow_table(
            {"user_id": rng.integers(0, NUM_USERS, 3000), "item_id": rng.integers(0, NUM_ITEMS, 3000)}
        )
        pq.write_table(table, tmp_path / name, row_group_size=1000, compression="zstd")  # no page checksums
        files[split] = [name]
    manifest = layout.write_manifest(
        tmp_path, num_users=NUM_USERS, num_items=NUM_ITEMS, split_files=files, seed=0, source="old", generator={}
    )
    del manifest["integrity"]
    (tmp_path / layout.MANIFEST_NAME).write_text(json.dumps(manifest))

    assert sum(len(batch["user_id"]) for batch in ParquetStream(tmp_path, "train", 256)) == 3000
    assert main(["data-info", str(tmp_path), "--check"]) == 0
    assert "none recorded" in capsys.readouterr().out
    assert main(["verify", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "records no checksums" in out and f"OK  dataset {tmp_path}: 3 files" in out
    victim = tmp_path / "train/part-00000.parquet"
    victim.write_bytes(victim.read_bytes()[:-1])
    assert main(["verify", str(tmp_path)]) == 1  # sizes are still checked
    assert "train/part-00000.parquet: truncated" in capsys.readouterr().out


def test_the_ranks_check_disjoint_shares_of_about_equal_bytes():
    from bigrank import integrity

    entries = {f"part-{i:02d}": {"bytes": size} for i, size in enumerate([90, 10, 40, 40, 30, 30, 30, 5])}
    shares = integrity.share_files(entries, 3)
    assert sorted(name for share in shares for name in share) == sorted(entries)  # each file exactly once
    loads = [sum(entries[name]["bytes"] for name in share) for share in shares]
    assert max(loads) <= 4 / 3 * sum(loads) / 3, loads  # largest first: within 4/3 of an even split
    assert integrity.share_files(entries, 1) == [sorted(entries)]
    assert integrity.share_files({"a": {"bytes": 1}}, 4)[1:] == [[], [], []]  # more ranks than files


def _train_records(run: Path) -> list[dict]:
    metrics = run / "metrics.jsonl"
    records = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.is_file() else []
    return [record for record in records if record.get("type") == "train"]


def test_a_flip_in_a_row_group_read_late_is_named_before_the_first_step(tmp_path):
    """The page checksums name a flip when its row group is read, which can be late in an epoch; the run's
    CRC-32 check before step 1 (``data.verify: full``, the default) names it before anything is trained."""
    data = tmp_path / "data"
    make_dataset(data)
    victim = data / "train/part-00001.parquet"
    silent_flip(victim, row_group=1, limit=NUM_USERS)
    # The flip is in a row group the run reads late: each rank's first batch reads fine (what the run's streams
    # read before step 1, with data.prefetch 0 as below), reading the whole epoch names the row group.
    streams = [
        ParquetStream(data, "train", 256, rank=rank, world_size=2, seed=3, shuffle_buffer=256, prefetch=0)
        for rank in range(2)
    ]
    for stream in streams:
        next(iter(stream))
    with pytest.raises(CorruptFileError, match="row group 1"):
        for stream in streams:
            for _ in stream:
                pass

    config = tmp_path / "run.yaml"
    train = "{batch_size: 512, epochs: 1, log_every: 1, progress: false}"
    config.write_text(tiny_run_yaml(data, tmp_path / "run", train=train, eval="{every_epochs: null, at_end: false}"))
    done = bigrank("train", config, "--launcher", "local", "--set", "data.prefetch=0", check=False, timeout=300)
    output = done.stdout + done.stderr
    assert done.returncode != 0, output
    assert not _train_records(tmp_path / "run") and latest_checkpoint(tmp_path / "run") is None, output
    assert f"failed: CorruptFileError: dataset file {victim} is corrupt: crc32" in output, output
    assert "the damage is in row group 1" in output and "bigrank verify" in output, output


# ---------------------------------------------------------------------------------------------------- exports
def test_export_with_a_flipped_byte_is_named_by_verify_and_by_its_page_checksums(tmp_path, capsys):
    out = tmp_path / "export"
    write_export(out, random_tables(NUM_ITEMS, NUM_USERS), history=False)
    assert main(["verify", str(out)]) == 0
    assert f"OK  export {out}" in capsys.readouterr().out
    part = out / "items/part-r00000.parquet"
    silent_flip(part, row_group=0, column=1)  # an embedding value: decodes to another float
    assert main(["verify", str(out)]) == 1
    out_text = capsys.readouterr().out
    assert "DAMAGED  items/part-r00000.parquet" in out_text and "sha256" in out_text
    with pytest.raises(ValueError, match=r"items/part-r00000\.parquet does not match its sha256"):
        load_export(out)
    # without the sha256 pass (sizes only), reading the part verifies its pages
    with pytest.raises(CorruptFileError, match=r"export file .*items/part-r00000\.parquet is corrupt: .*row group 0"):
        Recommender(out, verify=False)


# ------------------------------------------------------------------------------------------------ checkpoints
class _Weights:
    """A stateful part of one tensor (the ``Stateful`` protocol a Checkpointer saves)."""

    def __init__(self, value: float):
        self.weight = torch.full((64, 16), value)

    def state_dict(self):
        return {"weight": self.weight}

    def load_state_dict(self, state):
        self.weight.copy_(state["weight"])


def test_checkpoint_files_are_recorded_and_a_truncated_one_is_named_at_load(tmp_path, capsys):
    weights = _Weights(1.0)
    checkpointer = Checkpointer(tmp_path, {"weights": weights}, every=None, keep=3, identity={"dim": 16})
    checkpointer.save(1, {})
    weights.weight.fill_(2.0)
    latest = checkpointer.save(2, {})
    files = json.loads((latest / "trainer.json").read_text())["files"]
    assert ".metadata" in files and any(name.endswith(".distcp") for name in files)
    assert all(entry["bytes"] == (latest / name).stat().st_size for name, entry in files.items())
    assert main(["verify", str(tmp_path)]) == 0  # a run directory: all its checkpoints
    assert capsys.readouterr().out.count("OK  checkpoint") == 2

    shard = next(latest / name for name in files if name.endswith(".distcp"))
    data = shard.read_bytes()
    shard.write_bytes(data[:-8])
    with pytest.raises(
        ValueError, match=rf"{shard.name} is truncated or modified.*delete the directory {latest}.*step-00000001"
    ):
        checkpointer.load(latest)

    flipped = bytearray(data)
    flipped[len(data) // 2] ^= 0x01  # same size: only the checksum tells
    shard.write_bytes(bytes(flipped))
    with pytest.raises(
        CorruptFileError, match=rf"{shard.name} is corrupt: crc32 .*delete the directory {latest}.*step-00000001"
    ):
        checkpointer.load(latest)
    assert main(["verify", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert f"DAMAGED  {shard.name}: corrupt: crc32" in out and "OK  checkpoint" in out  # step 1 is fine
    assert main(["verify", str(checkpoint_path(tmp_path, 1))]) == 0


def test_a_flip_in_a_checkpoint_shard_is_named_at_resume(workflow_run, tmp_path):
    """A same-size change of a DCP file loads as wrong weights unless its CRC-32 is checked: the resume (the same
    command again on the run, 2 workers) names it before DCP reads a tensor."""
    run = tmp_path / "run"
    shutil.copytree(workflow_run.run, run)
    latest = latest_checkpoint(run)
    shard = sorted(latest.glob("*.distcp"))[-1]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    done = bigrank("train", run / "config.yaml", "--launcher", "local", "--set", f"run_dir={run}", check=False)
    output = done.stdout + done.stderr
    assert done.returncode != 0, output
    assert f"failed: CorruptFileError: checkpoint file {shard} is corrupt: crc32" in output, output
    assert f"delete the directory {latest} and run the same command again" in output, output


def _load_flipped(rank, world_size, group, run_dir):
    """Each rank: save a checkpoint (collective), rank 0 flips a byte of the file in rank 1's share of the
    checksum check, every rank loads; returns the error each rank raised (None: it loaded)."""
    import torch.distributed as dist

    from bigrank import integrity

    checkpointer = Checkpointer(
        run_dir, {"weights": _Weights(float(rank))}, every=None, keep=1, identity={}, group=group
    )
    path = checkpointer.save(1, {})
    if rank == 0:
        files = json.loads((path / "trainer.json").read_text())["files"]
        shard = path / integrity.share_files(files, world_size)[1][0]
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0x01
        shard.write_bytes(bytes(data))
    dist.barrier(group)
    try:
        checkpointer.load(path)
    except CorruptFileError as error:
        return str(error)
    return None


def test_every_rank_names_a_flip_that_another_rank_checked():
    """The ranks share the checksum work: the error of the rank that read the damaged file reaches every rank,
    so none goes on into the collective load while another stops."""
    import tempfile

    from tests.distributed_utils import run_distributed

    with tempfile.TemporaryDirectory() as run_dir:
        errors = run_distributed(_load_flipped, 2, args=(run_dir,), timeout=90)
    assert errors[0] is not None and errors[0] == errors[1], errors
    assert "is corrupt: crc32" in errors[0] and "delete the directory" in errors[0]
