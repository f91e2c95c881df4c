"""`bigrank plot` draws loss and evaluation metrics of several runs from their metrics.jsonl."""

from __future__ import annotations

import json

import pytest

from bigrank.cli import main
from bigrank.train.plot import metric_keys, panel_title, read_run, run_label


def fake_run(root, name: str, loss: str, scale: float, resumed: bool = False):
    """A run dir in the trainer's format: train records every 5 steps (10 steps per epoch), evaluation of valid at
    each epoch end and of valid + test at the end; ``resumed`` repeats steps 15-20 with other values."""
    run_dir = root / name
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text(f"run_dir: {run_dir}\nloss:\n  name: {loss}\n  params: {{}}\n")
    lines = []
    for step in range(5, 41, 5):
        lines.append({"type": "train", "step": step, "epoch": step / 10, "loss": scale * 5 / step, "lr": 0.05})
        if step % 10 == 0:
            for split in ["valid"] + (["test"] if step == 40 else []):
                lines.append(
                    {
                        "type": "eval",
                        "split": split,
                        "step": step,
                        "epoch": step // 10,
                        "recall@100": 0.1 * step / 10 / scale,
                        "ap@10": 0.02 * step / 10 / scale,
                        "ndcg@20": 0.03 * step / 10 / scale,
                        "accuracy": 0.05 * step / 10,
                        "users": 100,
                        "sampled": False,
                    }
                )
    if resumed:
        lines.append({"type": "train", "step": 20, "epoch": 2.0, "loss": 123.0})
    text = "".join(json.dumps(line) + "\n" for line in lines)
    (run_dir / "metrics.jsonl").write_text(text + ('{"type": "train", "st' if resumed else ""))
    return run_dir


def test_plot_two_runs(tmp_path, capsys):
    first = fake_run(tmp_path, "run-a", "rankmax", 1.0, resumed=True)
    second = fake_run(tmp_path, "run-b", "softmax", 1.5)
    out = tmp_path / "figs" / "compare.png"
    assert main(["plot", str(first), str(second), "--out", str(out), "--title", "demo"]) == 0
    assert f"wrote {out}" in capsys.readouterr().out
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 20_000
    assert sorted(p.name for p in out.parent.iterdir()) == ["compare.png"]

    run = read_run(first)
    assert run["label"] == "run-a (rankmax)"
    assert [r["step"] for r in run["train"]] == [5, 10, 15, 20, 25, 30, 35, 40]
    assert run["train"][3]["loss"] == 123.0  # the later (resumed) line wins; the cut-short last line is skipped
    assert [(r["split"], r["epoch"]) for r in run["eval"]] == [("test", 4)] + [("valid", e) for e in (1, 2, 3, 4)]
    assert metric_keys(run["eval"]) == ["ap@10", "accuracy", "recall@100", "ndcg@20"]
    assert [panel_title(key) for key in metric_keys(run["eval"])] == ["AP@10", "Accuracy", "R@100", "NDCG@20"]


def test_plot_errors(tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["plot", str(empty), "--out", str(tmp_path / "x.png")]) == 2
    assert "no metrics.jsonl in" in capsys.readouterr().err
    assert main(["plot", str(tmp_path / "missing"), "--out", str(tmp_path / "x.png")]) == 2
    assert "does not exist" in capsys.readouterr().err
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "metrics.jsonl").write_text('{"type": "train", "step": 1}\n{"type": "train", "step": 2, "epoch": 0.2, ')
    with pytest.raises(ValueError, match="line 1: a train record needs 'epoch'"):
        read_run(bad)
    (bad / "metrics.jsonl").write_text('oops\n{"type": "train", "step": 1, "epoch": 0.1, "loss": 1.0}\n')
    with pytest.raises(ValueError, match="line 1: not valid JSON"):
        read_run(bad)
    assert not (tmp_path / "x.png").exists()


def test_label_without_config(tmp_path):
    (tmp_path / "plain").mkdir()
    assert run_label(tmp_path / "plain") == "plain"
    (tmp_path / "plain" / "config.yaml").write_text("loss: sparsemax\n")
    assert run_label(tmp_path / "plain") == "plain (sparsemax)"
    (tmp_path / "softmax").mkdir()
    (tmp_path / "softmax" / "config.yaml").write_text("loss: {name: softmax}\n")
    assert run_label(tmp_path / "softmax") == "softmax"
