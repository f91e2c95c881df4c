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

The random split's key of a pair (:func:`split_keys`) is XXH64's final avalanche (its specified shifts and primes)
of the pair's dense ids and the seed: a fixed function, so "the same input and options, the same dataset" holds
on any install (DuckDB's ``hash()``, used before, is not specified across DuckDB versions).
"""

from __future__ import annotations

import numpy as np

__all__ = ["PRIME64_1", "PRIME64_2", "PRIME64_3", "bucket_of", "id_hashes", "rank_ids", "split_keys"]

# XXH64's primes (the XXH64 specification, https://github.com/Cyan4973/xxHash/blob/dev/doc/xxhash_spec.md).
PRIME64_1 = 0x9E3779B185EBCA87
PRIME64_2 = 0xC2B2AE3D27D4EB4F
PRIME64_3 = 0x165667B19E3779F9
MASK64 = (1 << 64) - 1


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


def split_seed_term(seed: int) -> int:
    """The seed's part of a split key: ``seed * PRIME64_1 mod 2^64``."""
    return (int(seed) * PRIME64_1) & MASK64


def split_keys(user_ids, item_ids, seed: int) -> np.ndarray:
    """The random split's key of each pair (``user_ids``, ``item_ids``: dense ids, int[n] each): uint64[n].

    ``x = (user_id << 32 | item_id) XOR (seed * PRIME64_1 mod 2^64)``, then XXH64's avalanche ``x ^= x >> 33;
    x *= PRIME64_2; x ^= x >> 29; x *= PRIME64_3; x ^= x >> 32`` (mod 2^64). Every step is invertible, so no two
    pairs of one seed share a key. The stores compute the same in SQL (``store.with_split_key``)."""
    x = (np.asarray(user_ids).astype(np.uint64) << np.uint64(32)) | np.asarray(item_ids).astype(np.uint64)
    x ^= np.uint64(split_seed_term(seed))
    with np.errstate(over="ignore"):
        x ^= x >> np.uint64(33)
        x *= np.uint64(PRIME64_2)
        x ^= x >> np.uint64(29)
        x *= np.uint64(PRIME64_3)
        x ^= x >> np.uint64(32)
    return x


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
