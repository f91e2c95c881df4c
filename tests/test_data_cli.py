"""`bigrank generate` and `bigrank data-info` through the real CLI entry point (`bigrank ingest` of MovieLens
files is run by the workflow test, tests/test_workflow.py)."""

from __future__ import annotations

from bigrank.cli import main
from bigrank.data import manifest as layout


def test_generate_info_and_corrupt_file(tmp_path, capsys):
    root = tmp_path / "demo"
    assert main(["generate", "--preset", "demo", "--out", str(root), "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "users        2,000" in out and "train" in out
    assert main(["data-info", str(root), "--check"]) == 0
    assert "all present" in capsys.readouterr().out
    # rerunning into the same directory is refused, --resume returns the finished dataset
    assert main(["generate", "--preset", "demo", "--out", str(root), "--no-progress"]) == 2
    assert "already holds a dataset" in capsys.readouterr().err
    assert main(["generate", "--preset", "demo", "--out", str(root), "--resume", "--no-progress"]) == 0
    victim = root / layout.load_manifest(root)["splits"]["test"]["files"][0]
    victim.write_bytes(victim.read_bytes()[:50])
    assert main(["data-info", str(root), "--check"]) == 2
    assert victim.name in capsys.readouterr().err


def test_expand_a_dataset_from_the_cli(tmp_path, capsys):
    seed = tmp_path / "seed"
    assert main(["generate", "--preset", "demo", "--out", str(seed), "--no-progress"]) == 0
    out = tmp_path / "expanded"
    code = main(["generate", "--seed-ratings", str(seed), "--expand", "2x3", "--out", str(out), "--no-progress"])
    assert code == 0
    manifest = layout.validate_dataset(out)
    assert (manifest["num_users"], manifest["num_items"]) == (4000, 4500)
    capsys.readouterr()
    assert main(["generate", "--seed-ratings", str(seed), "--out", str(tmp_path / "x")]) == 2
    assert "--expand" in capsys.readouterr().err
