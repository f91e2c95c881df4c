"""Stable hashes of original ids: the order of dense ids and the buckets of the cluster engine.

A dense id is the rank of its original id by ``(xxh64(id bytes), id)``, so the numbering depends on the set of ids
only, never on the order of the input rows, the number of buckets, the process or the engine's version: XXH64 is a
specified algorithm (seed 0), unlike Python's per-process salted ``hash()`` or a database's internal hash. The id
bytes are the UTF-8 bytes of the id's text, an integer's in decimal: so a text id ``"42"`` that becomes the integer
42 (CSV ids are text until every one is seen to be an integer) hashes the same either way.

The cluster engine (``bigrank.data.ingest.cluster``) gives a user to bucket ``(h * B) >> 64`` of ``B``: buckets are
contiguous ranges of hash values, so bucket ``b``'s users, ranked by ``(h, id)`` and offset by the sizes of buckets
``< b``, get exactly the ids one machine gives them (``bucket_of``).

Ids are hashed with the ``xxhash`` package, each distinct value of an array once (dictionary encoding first).
"""

from __future__ import annotations

import numpy as np

__all__ = ["bucket_of", "id_hashes", "rank_ids"]


def _xxh64_texts(values) -> np.ndarray:
    import xxhash

    digest = xxhash.xxh64_intdigest
    return np.fromiter((digest(str(v).encode("utf-8")) for v in values), dtype=np.uint64, count=len(values))


def id_hashes(ids) -> np.ndarray:
    """XXH64 of the text of every id of ``ids`` (a pyarrow or numpy array of integers or strings): uint64[n]."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if isinstance(ids, np.ndarray):
        ids = pa.array(ids)
    if isinstance(ids, pa.ChunkedArray):
        ids = ids.combine_chunks()
    if not (pa.types.is_integer(ids.type) or pa.types.is_string(ids.type) or pa.types.is_large_string(ids.type)):
        raise TypeError(f"ids must be integers or strings, got {ids.type}")
    encoded = pc.dictionary_encode(ids)
    hashes = _xxh64_texts(encoded.dictionary.to_pylist())
    return hashes[encoded.indices.to_numpy(zero_copy_only=False)]


def rank_ids(ids) -> np.ndarray:
    """The order of ``ids`` (distinct; pyarrow or numpy, int64 or strings) by ``(xxh64, id)``: int64[n] positions,
    so that ``ids[rank_ids(ids)]`` lists them in dense-id order."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if isinstance(ids, np.ndarray):
        ids = pa.array(ids)
    hashes = id_hashes(ids)
    table = pa.table({"h": pa.array(hashes, type=pa.uint64()), "id": ids})
    return pc.sort_indices(table, sort_keys=[("h", "ascending"), ("id", "ascending")]).to_numpy()


def bucket_of(hashes: np.ndarray, buckets: int) -> np.ndarray:
    """Bucket ``(h * buckets) >> 64`` of each hash (uint64[n]) among ``buckets``: int64[n], contiguous hash ranges."""
    hashes = np.asarray(hashes, dtype=np.uint64)
    if buckets == 1:
        return np.zeros(len(hashes), dtype=np.int64)
    # (h * B) >> 64 without 128-bit integers: split h into 32-bit halves.
    high, low = hashes >> np.uint64(32), hashes & np.uint64(0xFFFFFFFF)
    b = np.uint64(buckets)
    with np.errstate(over="ignore"):
        return ((high * b + ((low * b) >> np.uint64(32))) >> np.uint64(32)).astype(np.int64)
