"""Smoke test of the pinned sparse stack: torchrec + fbgemm load, and a row-wise sharded table trains on CPU/gloo."""

from __future__ import annotations

import json

import numpy as np
import torch
from distributed_utils import run_distributed

NUM_USERS, DIM, STEPS = 64, 8, 6


def test_torchrec_and_fbgemm_import_and_run_an_fbgemm_cpu_op():
    from bigrank.model.sharding import quiet_torchrec

    with quiet_torchrec():  # fbgemm prints deprecation notices for modules it does not ship on CPU
        import fbgemm_gpu  # noqa: F401 - registers torch.ops.fbgemm
        import torchrec

    assert torchrec.__version__.startswith("1.8")
    lengths = torch.tensor([2, 0, 3], dtype=torch.int64)
    offsets = torch.ops.fbgemm.asynchronous_complete_cumsum(lengths)
    assert offsets.tolist() == [0, 2, 2, 5]


def _train_row_wise(rank, world_size, group, plan_dir):
    from torchrec import EmbeddingCollection, EmbeddingConfig

    from bigrank.model.sharding import format_plan, plan_to_dict, shard_row_wise, write_plan
    from bigrank.model.tables import local_user_rows
    from bigrank.model.towers import UserTower
    from bigrank.train.bootstrap import silence_torchrec_step_warnings

    silence_torchrec_step_warnings()
    tower = UserTower(NUM_USERS, DIM, seed=0, device="meta")
    dmp, plan = shard_row_wise(tower, optimizer="sgd", lr=2.0)
    targets = torch.randn(NUM_USERS, DIM, generator=torch.Generator().manual_seed(1))
    batch = torch.randperm(NUM_USERS, generator=torch.Generator().manual_seed(2 + rank))[:16]
    features = tower.features(batch)
    losses = []
    for _ in range(STEPS):
        vectors = dmp(features)
        loss = (vectors - targets[batch]).pow(2).sum(dim=1).mean()
        loss.backward()  # the fused SGD updates the owners' rows inside backward
        losses.append(loss.item())
    row_start, row_stop, rows = local_user_rows(dmp)

    # The sequence collection (EmbeddingCollection) shards row-wise on CPU too; its rows come back unpooled.
    table = EmbeddingCollection(
        tables=[EmbeddingConfig(name="seq_table", embedding_dim=4, num_embeddings=10, feature_names=["f"])],
        device=torch.device("meta"),
    )
    seq_dmp, seq_plan = shard_row_wise(table, optimizer="sgd", lr=0.1)
    from torchrec import KeyedJaggedTensor

    ids = torch.tensor([rank, 9 - rank, 5], dtype=torch.int64)
    kjt = KeyedJaggedTensor.from_lengths_sync(keys=["f"], values=ids, lengths=torch.tensor([1, 2]))
    out = seq_dmp(kjt)
    out = out.wait() if hasattr(out, "wait") else out
    seq_rows = out["f"].values().detach()
    seq_weight = seq_dmp.state_dict()["embeddings.seq_table.weight"]
    write_plan(plan, f"{plan_dir}/plan-{rank}.json")
    return {
        "losses": losses,
        "plan_text": format_plan(plan),
        "plan": plan_to_dict(plan),
        "seq_plan": plan_to_dict(seq_plan),
        "rows": (row_start, row_stop, rows.shape[0]),
        "seq_ids": ids.numpy(),
        "seq_rows": seq_rows.numpy(),
        "seq_local": (
            int(seq_weight.local_shards()[0].metadata.shard_offsets[0]),
            seq_weight.local_shards()[0].tensor.detach().clone().numpy(),
        ),
    }


def test_row_wise_sharded_table_trains_under_two_gloo_processes(tmp_path):
    results = run_distributed(_train_row_wise, world_size=2, args=(str(tmp_path),), timeout=120)
    for result in results:
        losses = result["losses"]
        assert losses[-1] < 0.5 * losses[0], losses
        assert all(b < a for a, b in zip(losses, losses[1:], strict=False)), losses
        for entry in list(result["plan"].values()) + list(result["seq_plan"].values()):
            assert entry["sharding_type"] == "row_wise"
            assert entry["ranks"] == [0, 1]
    assert [r["rows"] for r in results] == [(0, 32, 32), (32, 64, 32)]
    # The plan printed at start-up and saved with the run: the same on every rank, one line per shard.
    assert results[0]["plan_text"] == results[1]["plan_text"]
    lines = results[0]["plan_text"].splitlines()[1:]
    assert lines == [
        f"{'tables.user_table':<28} {'row_wise':<14} {'fused':<8} {'[0, 32)':<22} {'[0, 8)':<10} rank:0/cpu",
        f"{'tables.user_table':<28} {'row_wise':<14} {'fused':<8} {'[32, 64)':<22} {'[0, 8)':<10} rank:1/cpu",
    ]
    for rank, result in enumerate(results):
        assert json.loads((tmp_path / f"plan-{rank}.json").read_text()) == result["plan"]

    # EmbeddingCollection: every looked-up row equals the owner's stored row (before the unused update).
    table = np.zeros((10, 4), dtype=np.float32)
    for result in results:
        start, local = result["seq_local"]
        table[start : start + len(local)] = local
    for result in results:
        np.testing.assert_array_equal(result["seq_rows"], table[result["seq_ids"]])
