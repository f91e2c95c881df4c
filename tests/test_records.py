"""bigrank.records: the run directory's records written and read back through one schema."""

from __future__ import annotations

import json

import pytest

from bigrank.records import (
    EvalRecord,
    TrainRecord,
    append_record,
    read_eval_json,
    read_metrics,
    truncate_metrics,
    write_eval_json,
)


def test_records_round_trip_through_metrics_jsonl(tmp_path):
    train = TrainRecord(step=10, epoch=0.5, loss=2.5, examples_per_s=1000.0, lr=0.1, user_lr=0.05)
    evaluation = EvalRecord.from_results("valid", 10, 0.5, {"accuracy": 0.3, "ap@10": 0.12, "users": 40})
    append_record(tmp_path, train)
    append_record(tmp_path, evaluation)
    assert read_metrics(tmp_path) == [train, evaluation]
    assert evaluation.metrics == {"accuracy": 0.3, "ap@10": 0.12} and evaluation.extra == {"users": 40}
    line = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])
    assert line == {
        "type": "train",
        "step": 10,
        "epoch": 0.5,
        "loss": 2.5,
        "examples_per_s": 1000.0,
        "lr": 0.1,
        "user_lr": 0.05,
    }  # fmt: skip  (no temperature: None fields are left out)


def test_a_cut_short_last_line_is_skipped_and_a_bad_middle_line_named(tmp_path):
    path = tmp_path / "metrics.jsonl"
    good = json.dumps({"type": "train", "step": 1, "epoch": 0.1, "loss": 1.0})
    path.write_text(good + "\n" + '{"type": "train", "st')
    assert [r.step for r in read_metrics(tmp_path)] == [1]
    path.write_text('{"type": "tr\n' + good + "\n")
    with pytest.raises(ValueError, match=r"metrics.jsonl, line 1: not valid JSON"):
        read_metrics(tmp_path)
    path.write_text(json.dumps({"type": "eval", "step": 1, "epoch": 0.1}) + "\n")
    with pytest.raises(ValueError, match=r"line 1: a eval record needs 'split'"):
        read_metrics(tmp_path)
    with pytest.raises(FileNotFoundError, match="no metrics.jsonl"):
        read_metrics(tmp_path / "nowhere")


def test_older_kind_records_read_and_other_types_are_skipped(tmp_path):
    lines = [{"kind": "eval", "split": "test", "step": 4, "epoch": 1, "recall@100": 0.5}, {"step": 2, "epoch": 0.5,
             "loss": 3.0}, {"type": "note", "step": 3}]  # fmt: skip
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    first, second = read_metrics(tmp_path)
    assert isinstance(first, EvalRecord) and first.metrics == {"recall@100": 0.5}
    assert isinstance(second, TrainRecord) and second.loss == 3.0


def test_truncate_keeps_the_records_up_to_the_resumed_step(tmp_path):
    for step in (10, 20, 30):
        append_record(tmp_path, TrainRecord(step=step, epoch=step / 10, loss=1.0))
    with open(tmp_path / "metrics.jsonl", "a") as handle:
        handle.write('{"type": "train", "st')
    truncate_metrics(tmp_path, 20)
    assert [r.step for r in read_metrics(tmp_path)] == [10, 20]


def test_eval_json_keeps_other_splits_and_writes_nan_as_null(tmp_path):
    write_eval_json(tmp_path, {"valid": {"accuracy": 0.25, "step": 5}})
    write_eval_json(tmp_path, {"test": {"accuracy": float("nan"), "step": 5}})
    assert read_eval_json(tmp_path) == {"valid": {"accuracy": 0.25, "step": 5}, "test": {"accuracy": None, "step": 5}}
    with pytest.raises(FileNotFoundError, match="no eval.json"):
        read_eval_json(tmp_path / "nowhere")
