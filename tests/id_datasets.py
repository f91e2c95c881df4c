"""Datasets with original ids (string or int64, in shuffled dense order) and item attributes, and random exports of
them: what the serving tests of original ids (issue 38) build on.

The side files follow the ingest's contract: ``users.parquet`` (``user_id: int32``, ``original_id``, ``count``) and
``items.parquet`` (``item_id``, ``original_id``, ``count`` and attribute columns), each id once, rows in no particular
order, written here with pyarrow directly so that these tests do not depend on the ingest.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from bigrank import integrity
from bigrank.data import manifest as layout
from bigrank.export.writer import export_embeddings

DIM = 8
# String user ids that a careless parser would break: digits with leading zeros beside the same number, a comma
# (GET's items= splits there), spaces, non-ASCII, and ids longer than the first width class (16 bytes) and far
# longer, an id that is a prefix of another, and one ending with a NUL byte beside the same id without it.
ODD_USER_IDS = ["00042", "42", "a,b", " spaced ", "ü-ß-用户", "x" * 40, "long-" * 50, "u-0", "u-0\x00", "+7"]
ODD_ITEM_IDS = ["sku-9-A", "00017", "17", "sku-9-A-variant-with-a-long-name", "品-1", "c,d"]


def string_ids(prefix: str, count: int, odd: list[str], rng) -> list[str]:
    """``count`` distinct string ids: ``odd`` first, then ``<prefix>-NNNNNN`` of random numbers."""
    numbers = rng.choice(1_000_000, size=count - len(odd), replace=False)
    return [*odd, *(f"{prefix}-{n:06d}" for n in numbers)]


def int_ids(count: int, rng) -> list[int]:
    """``count`` distinct int64 ids across the whole range (negative, huge), in random order."""
    ids = rng.choice(np.iinfo(np.int64).max // 2, size=count, replace=False).astype(np.int64) * 2 - (1 << 62)
    ids[:3] = [np.iinfo(np.int64).min, np.iinfo(np.int64).max, 42]
    return rng.permutation(ids).tolist()


def _write_side(path: Path, table: pa.Table) -> None:
    pq.write_table(table, path, **integrity.PARQUET_WRITE_OPTIONS)


def write_id_dataset(root, user_ids: list, item_ids: list, seed: int = 0, attributes: bool = True) -> dict:
    """A dataset at ``root``: ``user_ids[u]`` / ``item_ids[i]`` are the original ids of dense user ``u`` / item
    ``i`` (any order), 5 train, 1 valid and 1 test rating a user; side files with their rows shuffled.

    ``attributes``: items.parquet also has ``title`` (string, null for every 7th item), ``price`` (double, null
    for every 5th, NaN or infinite for items 3, 13, 23), ``in_stock`` (bool), ``category`` (dictionary-encoded
    string) and two columns an export leaves out: ``tags`` (list<string>) and ``score`` (a reserved name).
    Returns the dataset manifest."""
    root = Path(root)
    rng = np.random.default_rng(seed)
    num_users, num_items = len(user_ids), len(item_ids)
    files = {}
    for split, per_user in (("train", 5), ("valid", 1), ("test", 1)):
        users = np.repeat(np.arange(num_users, dtype=np.int32), per_user)
        items = rng.integers(0, num_items, size=len(users)).astype(np.int32)
        files[split] = layout.write_split_parts(root, split, {"user_id": users, "item_id": items})
    root.mkdir(parents=True, exist_ok=True)
    order = rng.permutation(num_users)  # rows not in dense order: the export must sort them
    _write_side(
        root / "users.parquet",
        pa.table(
            {
                "user_id": pa.array(order, pa.int32()),
                "original_id": pa.array([user_ids[u] for u in order]),
                "count": pa.array(np.full(num_users, 7), pa.int64()),
            }
        ),
    )
    order = rng.permutation(num_items)
    columns = {
        "item_id": pa.array(order, pa.int32()),
        "original_id": pa.array([item_ids[i] for i in order]),
        "count": pa.array(np.full(num_items, 3), pa.int64()),
    }
    if attributes:
        columns["title"] = pa.array([None if i % 7 == 0 else f"Item {i} «{item_ids[i]}»" for i in order])
        columns["price"] = pa.array([_price(i) for i in order], pa.float64())
        columns["in_stock"] = pa.array([bool(i % 2) for i in order])
        columns["category"] = pa.array([f"cat-{i % 3}" for i in order]).dictionary_encode()
        columns["tags"] = pa.array([[f"t{i}"] for i in order])
        columns["score"] = pa.array(order, pa.int64())
    _write_side(root / "items.parquet", pa.table(columns))
    return layout.write_manifest(
        root, num_users=num_users, num_items=num_items, split_files=files, seed=seed, source="test:ids", generator={}
    )


def _price(item: int) -> float | None:
    """``price`` of item ``item``: null for every 5th, NaN or an infinity for a few (not JSON: left out of replies)."""
    if item % 5 == 0:
        return None
    return {3: float("nan"), 13: float("inf"), 23: float("-inf")}.get(item, 1.5 * item)


def item_attributes(item: int, item_ids: list) -> dict:
    """The attributes a result row of item ``item`` of ``write_id_dataset`` carries (nulls, NaN and infinities
    left out)."""
    row = {"in_stock": bool(item % 2), "category": f"cat-{item % 3}"}
    if item % 7:
        row["title"] = f"Item {item} «{item_ids[item]}»"
    if item % 5 and item not in (3, 13, 23):
        row["price"] = 1.5 * item
    return row


def export_random(out, dataset_root, num_users: int, num_items: int, seed: int = 0, history: bool = True) -> dict:
    """An export of random ``DIM``-d vectors of the dataset at ``dataset_root`` (with a history table, and the
    seen table); returns the tables as numpy ``{"items", "users", "history"}``."""
    gen = torch.Generator().manual_seed(seed)
    items = torch.randn(num_items, DIM, generator=gen)
    users = torch.randn(num_users, DIM, generator=gen)
    hist = torch.randn(num_items, DIM, generator=gen)
    export_embeddings(
        out,
        rank=0,
        world_size=1,
        group=None,
        item_rows=(0, num_items, items),
        user_rows=(0, num_users, users),
        history_rows=(0, num_items, hist) if history else None,
        dataset_root=dataset_root,
        model_info={"dim": DIM, "has_history": history, "user_vectors": "full"},
    )
    return {"items": items.numpy(), "users": users.numpy(), "history": hist.numpy()}
