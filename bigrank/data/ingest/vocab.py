"""Stable ids across ingests (``bigrank ingest NEW… --vocab-from OLD``): the parent dataset's vocabularies, extended.

Every user and item of the parent keeps its dense id; ids first seen in the new data are appended after the
parent's, in the order a fresh ingest gives them (``(xxh64, id)``, ``bigrank.data.ingest.hashing``). Ids of the
parent that have no rows in the new data stay reserved (``count`` 0): a vocabulary never shrinks, so a model
trained on the parent has a row for every id of the child at the same place (``bigrank train --init-from``).

The child's manifest records where its ids come from::

    "parent": {"root": "/data/day-1", "id": "9f…", "checksum": "sha256 of its manifest.json",
               "num_users": 610, "num_items": 9724}
    "lineage": ["9f…", "3a…"]          # the ids of the parent, its parent, …: newest first
    "vocabulary": {"users": {"before": 610, "after": 625}, "items": {"before": 9724, "after": 9802}}

A dataset's id (:func:`dataset_id`) is a digest of its data files' sizes and CRC-32s as its manifest records them:
the same files give the same id wherever the dataset lies.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bigrank.errors import CommandError

__all__ = ["ParentVocabulary", "dataset_id", "extend_ids", "lineage_of", "manifest_checksum"]


def dataset_id(manifest: dict) -> str:
    """The id of the dataset whose manifest is ``manifest``: 16 hex digits of the sha256 of its files' recorded
    sizes and CRC-32s (the ``integrity`` entry), else of the whole manifest (datasets written before checksums)."""
    files = (manifest.get("integrity") or {}).get("files")
    basis = files if files else {k: v for k, v in manifest.items() if k not in ("parent", "lineage")}
    return hashlib.sha256(json.dumps(basis, sort_keys=True).encode()).hexdigest()[:16]


def manifest_checksum(root: str | Path) -> str:
    """sha256 (hex) of ``root/manifest.json``'s bytes."""
    from bigrank.data.manifest import MANIFEST_NAME

    return hashlib.sha256((Path(root) / MANIFEST_NAME).read_bytes()).hexdigest()


def lineage_of(manifest: dict) -> list[str]:
    """The ids of the dataset's ancestors, newest first (empty for a dataset ingested without ``--vocab-from``)."""
    return list(manifest.get("lineage") or [])


def _check_dense_order(table, id_name: str, path: Path) -> None:
    ids = table.column(id_name).to_numpy()
    if not np.array_equal(ids, np.arange(len(ids))):
        raise CommandError(f"--vocab-from: {path} does not list the dense ids 0..{len(ids) - 1} in order")


@dataclass(frozen=True)
class ParentVocabulary:
    """The vocabularies of the dataset ``--vocab-from`` names: its users' and items' original ids in dense-id order
    (pyarrow arrays), their ``first_seen`` (epoch seconds, int64 with nulls; None without times) and the record the
    child's manifest keeps (:meth:`record`)."""

    root: Path
    manifest: dict
    users: object
    items: object
    user_firsts: object
    item_firsts: object

    @classmethod
    def load(cls, root: str | Path) -> ParentVocabulary:
        """Read ``root``'s manifest and vocabularies; CommandError naming what is missing (not a dataset, or one
        without ``users.parquet`` / ``items.parquet``: a generated one)."""
        import pyarrow.parquet as pq

        from bigrank.data.manifest import load_manifest

        root = Path(root)
        try:
            manifest = load_manifest(root)
        except (FileNotFoundError, ValueError) as error:
            raise CommandError(f"--vocab-from {root}: {error}") from None
        tables = {}
        for name, id_name in (("users", "user_id"), ("items", "item_id")):
            path = root / f"{name}.parquet"
            if not path.is_file():
                raise CommandError(
                    f"--vocab-from {root} has no {path.name}: only an ingested dataset has original ids to keep"
                )
            columns = [id_name, "original_id"] + (["first_seen"] if "first_seen" in pq.read_schema(path).names else [])
            tables[name] = pq.read_table(path, columns=columns)
            _check_dense_order(tables[name], id_name, path)
        firsts = {
            name: table.column("first_seen").combine_chunks() if "first_seen" in table.column_names else None
            for name, table in tables.items()
        }
        from bigrank.data.ingest.hashing import wide_text

        return cls(
            root,
            manifest,
            wide_text(tables["users"].column("original_id")),  # text as large_string: it may pass 2 GiB
            wide_text(tables["items"].column("original_id")),
            firsts["users"],
            firsts["items"],
        )

    def split_files(self) -> list[list[str]]:
        """The paths of the parent's part files of each split (train, valid, test)."""
        from bigrank.data.manifest import SPLITS

        splits = self.manifest.get("splits", {})
        return [[str(self.root / name) for name in splits.get(split, {}).get("files", [])] for split in SPLITS]

    def check_types(self, integer_users: bool, integer_items: bool) -> None:
        """CommandError when the new data's id types (int64 or string) differ from the parent's."""
        import pyarrow as pa

        for what, old, integer in (("user", self.users, integer_users), ("item", self.items, integer_items)):
            old_integer = pa.types.is_integer(old.type)
            if old_integer != integer:
                raise CommandError(
                    f"--vocab-from {self.root}: its {what} ids are {'int64' if old_integer else 'strings'}, the new "
                    f"data's are {'int64' if integer else 'strings'}; ids of one type cannot keep ids of the other"
                )

    def record(self, num_users: int, num_items: int) -> dict:
        """The child's manifest entries ``parent``, ``lineage`` and ``vocabulary`` (module docstring)."""
        own = dataset_id(self.manifest)
        return {
            "parent": {
                "root": str(self.root.resolve()),
                "id": own,
                "checksum": manifest_checksum(self.root),
                "num_users": int(self.manifest["num_users"]),
                "num_items": int(self.manifest["num_items"]),
            },
            "lineage": [own, *lineage_of(self.manifest)],
            "vocabulary": {
                "users": {"before": int(self.manifest["num_users"]), "after": int(num_users)},
                "items": {"before": int(self.manifest["num_items"]), "after": int(num_items)},
            },
        }


def extend_ids(old_ids, new_ids) -> tuple[np.ndarray, object]:
    """Dense ids for ``new_ids`` (distinct original ids, in ``(xxh64, id)`` order) that keep ``old_ids``'s
    (the parent's original ids in dense order): an id of ``old_ids`` keeps its position, the others are numbered
    ``len(old_ids), …`` in their order. Returns ``(int32[len(new_ids)] dense ids, the extended vocabulary: the
    original ids of every dense id, a pyarrow ChunkedArray)``.

    Text is ``large_string`` and never joined into one array: the vocabularies may hold more than 2 GiB of it.
    The ids are matched through a hash table of the smaller side only."""
    import pyarrow as pa
    import pyarrow.compute as pc

    from bigrank.data.ingest.hashing import id_array, wide_text

    old_ids, new_ids = wide_text(old_ids), wide_text(new_ids)
    new_ids = new_ids.cast(old_ids.type) if new_ids.type != old_ids.type else new_ids
    dense = np.full(len(new_ids), -1, dtype=np.int64)
    if len(new_ids) <= len(old_ids):  # each old id's place among the new ones
        places = pc.fill_null(pc.index_in(old_ids, value_set=id_array(new_ids)), -1)
        places = places.to_numpy() if isinstance(places, pa.Array) else np.asarray(places)
        kept = np.flatnonzero(places >= 0)
        dense[places[kept]] = kept
    else:  # each new id's place among the old ones
        found = pc.fill_null(pc.index_in(new_ids, value_set=id_array(old_ids)), -1)
        dense = (found.to_numpy() if isinstance(found, pa.Array) else np.asarray(found)).astype(np.int64)
    fresh = dense < 0
    dense[fresh] = len(old_ids) + np.arange(int(fresh.sum()))
    appended = new_ids.filter(pa.array(fresh))

    def chunks(ids) -> list:
        return list(ids.chunks) if isinstance(ids, pa.ChunkedArray) else [ids]

    return dense.astype(np.int32), pa.chunked_array([*chunks(old_ids), *chunks(appended)], type=old_ids.type)


def merged_firsts(old_firsts, dense: np.ndarray, new_firsts_ms, size: int):
    """``first_seen`` (epoch seconds, a pyarrow int64 array with nulls) of the extended vocabulary of ``size`` ids:
    the earlier of the parent's and the new data's (``new_firsts_ms``: epoch ms of each new id, aligned with
    ``dense``); None when neither has times."""
    import pyarrow as pa

    if old_firsts is None and new_firsts_ms is None:
        return None
    seconds = np.full(size, np.iinfo(np.int64).max, dtype=np.int64)
    if old_firsts is not None:
        old = old_firsts.to_numpy(zero_copy_only=False)
        known = ~np.isnan(old) if old.dtype.kind == "f" else np.ones(len(old), dtype=bool)
        seconds[: len(old)][known] = old[known].astype(np.int64)
    if new_firsts_ms is not None:
        new = np.floor_divide(np.asarray(new_firsts_ms, dtype=np.int64), 1000)
        np.minimum.at(seconds, dense, new)
    missing = seconds == np.iinfo(np.int64).max
    return pa.array(seconds, mask=missing)
