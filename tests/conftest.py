"""Fixtures shared by the trainer and Ray tests."""

from __future__ import annotations

import numpy as np
import pytest
import torch

TINY_USERS, TINY_ITEMS, TINY_TOPICS = 120, 101, 8  # 101 items: uneven catalog shards [0, 51) and [51, 101)


@pytest.fixture(scope="module")
def tiny_dataset(tmp_path_factory):
    """120 users x 101 items: each user rates 12 items of its topic (items i with i % 8 == user % 8) and 3
    random ones; 80/10/10 random split. Small enough for an epoch in a dozen steps."""
    from bigrank.data.synthetic import SeedRatings, write_seed_dataset

    rng = np.random.default_rng(0)
    pairs = set()
    for user in range(TINY_USERS):
        topic_items = np.arange(user % TINY_TOPICS, TINY_ITEMS, TINY_TOPICS)
        for item in rng.choice(topic_items, 12, replace=False):
            pairs.add((user, int(item)))
        for item in rng.choice(TINY_ITEMS, 3, replace=False):
            pairs.add((user, int(item)))
    users, items = np.array(sorted(pairs), dtype=np.int32).T
    root = tmp_path_factory.mktemp("tiny")
    write_seed_dataset(SeedRatings(users, items, TINY_USERS, TINY_ITEMS), root, 0, "test:tiny", {"preset": "tiny"})
    return root


def checkpoint_parameters(checkpoint):
    """(catalog [n, d], user table [users, d], user Adagrad states, item optimizer states, per-rank data-stream
    states) of a trainer checkpoint, read in this process."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    rank_states = [torch.load(p, weights_only=False) for p in sorted(checkpoint.glob("rank-*.pt"))]
    rank_states.sort(key=lambda s: s["start"])
    catalog = torch.cat([s["catalog"] for s in rank_states])
    flat = checkpoint.parent / f"{checkpoint.name}-tower.pt"
    dcp_to_torch_save(checkpoint / "tower", flat)
    tower = torch.load(flat, weights_only=False)
    flat.unlink()
    user_table = tower["model"]["tables.embedding_bags.user_table.weight"]
    accumulators = [v for k, v in _flatten(tower["optimizer"]) if k.endswith("momentum1")]
    item_states = [s["item_optimizer"]["state"][0] for s in rank_states]
    return catalog, user_table, accumulators, item_states, [s["stream"] for s in rank_states]


def _flatten(tree, prefix=""):
    for key, value in tree.items():
        if isinstance(value, dict):
            yield from _flatten(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value
