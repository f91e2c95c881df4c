"""Training throughput: bigrank (2 workers, sharded user table, item-parallel catalog) vs a plain loop.

Both train the same model (user-id embeddings x item embeddings, d from the config) with the same loss and
global batch on the same Parquet data for ``--steps`` steps: bigrank through ``bigrank train --launcher local``
(examples/s from its metrics.jsonl, the first logging window dropped), the plain loop as one process with an
``nn.Embedding`` user table, a dense item matrix, Adagrad and ``bigrank.losses`` (the same loss function).

    .venv/bin/python -m benchmarks.bench_train [--config configs/demo.yaml] [--steps 200] [--data data/demo]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import torch

from bigrank.config import load_config
from bigrank.data.manifest import load_manifest
from bigrank.losses import rankmax_loss, softmax_loss, sparsemax_loss

ROOT = Path(__file__).resolve().parents[1]
FULL_CATALOG = {"rankmax": rankmax_loss, "softmax": softmax_loss, "sparsemax": sparsemax_loss}


def bigrank_examples_per_s(config_path: str, data: str, steps: int, log_every: int) -> float:
    with tempfile.TemporaryDirectory() as run_dir:
        command = [
            sys.executable, "-m", "bigrank.cli", "train", config_path, "--launcher", "local",
            "--set", f"data.root={data}", "--set", f"run_dir={run_dir}", "--set", f"train.max_steps={steps}",
            "--set", f"train.log_every={log_every}", "--set", "eval.every_epochs=0", "--set", "eval.at_end=false",
            "--set", "train.progress=false", "--set", f"train.checkpoint_every={steps}",
        ]  # fmt: skip
        subprocess.run(command, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
        records = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    rates = [r["examples_per_s"] for r in records if r.get("type") == "train"][1:]  # drop the warm-up window
    return float(np.median(rates))


def plain_examples_per_s(config, data: str, steps: int) -> float:
    manifest = load_manifest(data)
    table = pq.read_table(Path(data) / "train", columns=["user_id", "item_id"])
    users = torch.from_numpy(table["user_id"].to_numpy().astype(np.int64))
    items = torch.from_numpy(table["item_id"].to_numpy().astype(np.int64))
    dim, batch = config.model.dim, config.train.batch_size
    generator = torch.Generator().manual_seed(0)
    user_table = torch.nn.Embedding(manifest["num_users"], dim)
    item_matrix = torch.nn.Parameter(torch.randn(manifest["num_items"], dim, generator=generator) * 0.1)
    optimizer = torch.optim.Adagrad([*user_table.parameters(), item_matrix], lr=config.optim.item_lr)
    loss_fn = FULL_CATALOG[config.loss.name]
    params = dict(config.loss.params or {})
    order = torch.randperm(users.numel(), generator=generator)
    started = None
    for step in range(steps):
        if step == steps // 10:  # warm-up steps are not timed
            started = time.perf_counter()
        rows = order[(step * batch) % users.numel() :][:batch]
        scores = user_table(users[rows]) @ item_matrix.T
        loss = loss_fn(scores, items[rows], **params)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    return (steps - steps // 10) * batch / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/demo.yaml")
    parser.add_argument("--data", default="data/demo", help="dataset root (generated with the demo preset if absent)")
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    torch.set_num_threads(2)
    config = load_config(ROOT / args.config)
    if config.loss.name not in FULL_CATALOG:
        sys.exit(f"bench_train: the plain loop covers the full-catalog losses {list(FULL_CATALOG)}")
    data = str((ROOT / args.data).resolve())
    if not (Path(data) / "manifest.json").exists():
        subprocess.run([sys.executable, "-m", "bigrank.cli", "generate", "--preset", "demo", "--out", data], check=True)
    plain = plain_examples_per_s(config, data, args.steps)
    ours = bigrank_examples_per_s(args.config, data, args.steps, log_every=max(args.steps // 10, 1))
    print(f"{config.loss.name} loss, d={config.model.dim}, global batch {config.train.batch_size}, {args.steps} steps")
    print(f"{'trainer':<44}{'examples/s':>12}{'ratio':>8}")
    print(f"{'plain PyTorch loop (1 process, nn.Embedding)':<44}{plain:>12,.0f}{1.0:>8.2f}")
    print(f"{'bigrank (2 workers, torchrec + catalog shard)':<44}{ours:>12,.0f}{ours / plain:>8.2f}")


if __name__ == "__main__":
    main()
