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


def read_checkpoint(checkpoint) -> dict:
    """The whole state of a trainer checkpoint as one nested dict of full (unsharded) tensors, read in this
    process: the one place the tests know the checkpoint layout (``bigrank.train.checkpoint``)."""
    import tempfile

    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as tmp:
        flat = f"{tmp}/checkpoint.pt"
        dcp_to_torch_save(checkpoint, flat)
        return torch.load(flat, weights_only=False)


def checkpoint_parameters(checkpoint):
    """(catalog [n, d], user table [users, d], user Adagrad states, item optimizer states (one dict of full
    tensors), data-stream position) of a trainer checkpoint, read in this process."""
    state = read_checkpoint(checkpoint)
    tower = state["tower"]
    user_table = tower["model"]["tables.embedding_bags.user_table.weight"]
    accumulators = [v for k, v in _flatten(tower["optimizer"]) if k.endswith("momentum1")]
    optimizer = state["catalog"]["optimizer"]
    item_states = [dict(optimizer["rows"], step=optimizer["step"])]
    return state["catalog"]["weight"], user_table, accumulators, item_states, [state["stream"]["position"]]


def _flatten(tree, prefix=""):
    for key, value in tree.items():
        if isinstance(value, dict):
            yield from _flatten(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value
