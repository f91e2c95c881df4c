"""Stable hashes of original ids: the order of dense ids and the buckets of the cluster engine.

A dense id is the rank of its original id by ``(xxh64(id bytes), id)``, so the numbering depends on the set of ids
only, never on the order of the input rows, the number of buckets, the process or the engine's version: XXH64 is a
specified algorithm (seed 0), unlike Python's per-process salted ``hash()`` or a database's internal hash. The id
bytes are the UTF-8 bytes of the id's text, an integer's in decimal: so a text id ``"42"`` that becomes the integer
42 (CSV ids are text until every one is seen to be an integer) hashes the same either way.

The cluster engine (``bigrank.data.ingest.cluster``) gives a user to bucket ``(h * B) >> 64`` of ``B``: buckets are
contiguous ranges of hash values, so bucket ``b``'s users, ranked by ``(h, id)`` and offset by the sizes of buckets
``< b``, get exactly the ids one machine gives them (``bucket_of``).

Ids are hashed by a vectorised XXH64 in numpy (:func:`xxh64_texts`: the specification's steps applied to every id
of a chunk at once, in chunks of ``CHUNK_IDS`` ids, so that its memory stays bounded whatever the number of ids),
each distinct value of an array once (dictionary encoding first); the ``xxhash`` package is the reference its test
holds it to. (One ``xxhash`` call per Python string took ~0.7 us an id, single-threaded, and made every id a
Python object outside DuckDB's memory limit.)

The random split's key of a pair (:func:`split_keys`) is XXH64's final avalanche (its specified shifts and primes)
of the pair's dense ids and the seed: a fixed function, so "the same input and options, the same dataset" holds
on any install (DuckDB's ``hash()``, used before, is not specified across DuckDB versions).
"""

from __future__ import annotations

import numpy as np

__all__ = [
    "PRIME64_1",
    "PRIME64_2",
    "PRIME64_3",
    "bucket_of",
    "id_array",
    "id_hashes",
    "rank_ids",
    "split_keys",
    "wide_text",
    "xxh64_texts",
]

# XXH64's primes (the XXH64 specification, https://github.com/Cyan4973/xxHash/blob/dev/doc/xxhash_spec.md).
PRIME64_1 = 0x9E3779B185EBCA87
PRIME64_2 = 0xC2B2AE3D27D4EB4F
PRIME64_3 = 0x165667B19E3779F9
PRIME64_4 = 0x85EBCA77C2B2AE63
PRIME64_5 = 0x27D4EB2F165667C5
MASK64 = (1 << 64) - 1
CHUNK_IDS = 1 << 18  # ids hashed at once: ~10 uint64 temporaries of this length (~20 MB)
LONG_ID = 256  # bytes from which an id is hashed on its own (xxhash's C loop): few, and each worth a call
_U64 = {name: np.uint64(value) for name, value in
        (("p1", PRIME64_1), ("p2", PRIME64_2), ("p3", PRIME64_3), ("p4", PRIME64_4), ("p5", PRIME64_5))}  # fmt: skip


def _rotl(x: np.ndarray, bits: int) -> np.ndarray:
    """``x`` rotated left by ``bits``, in place."""
    high = x >> np.uint64(64 - bits)
    x <<= np.uint64(bits)
    x |= high
    return x


def _round(acc: np.ndarray, lane: np.ndarray) -> np.ndarray:
    """XXH64's round, in place on ``acc``: ``rotl(acc + lane * P2, 31) * P1``."""
    acc += lane * _U64["p2"]
    _rotl(acc, 31)
    acc *= _U64["p1"]
    return acc


def _lane(block: np.ndarray, offset: int, size: int) -> np.ndarray:
    """The little-endian ``size``-byte numbers (8 or 4) at byte ``offset`` of every row of ``block``: uint64[k]."""
    dtype = "<u8" if size == 8 else "<u4"
    return np.ascontiguousarray(block[:, offset : offset + size]).view(dtype).ravel().astype(np.uint64, copy=False)


def _xxh64_block(block: np.ndarray) -> np.ndarray:
    """XXH64 (seed 0) of every row of ``block`` (uint8[k, L]: k byte strings of one length L): uint64[k].

    The specification's steps on all rows at once, at the same byte offsets: 32-byte stripes into four
    accumulators (L >= 32), the 8-byte lanes, a 4-byte lane and the single bytes left, and the avalanche."""
    count, length = block.shape
    offset = 0
    if length >= 32:
        v = [np.full(count, value & MASK64, dtype=np.uint64) for value in
             (PRIME64_1 + PRIME64_2, PRIME64_2, 0, -PRIME64_1)]  # fmt: skip
        while offset + 32 <= length:
            for lane in range(4):
                _round(v[lane], _lane(block, offset + 8 * lane, 8))
            offset += 32
        h = _rotl(v[0].copy(), 1) + _rotl(v[1].copy(), 7) + _rotl(v[2].copy(), 12) + _rotl(v[3].copy(), 18)
        for lane in range(4):
            h ^= _round(np.zeros(count, dtype=np.uint64), v[lane])
            h *= _U64["p1"]
            h += _U64["p4"]
    else:
        h = np.full(count, PRIME64_5, dtype=np.uint64)
    h += np.uint64(length)
    while offset + 8 <= length:
        h ^= _round(np.zeros(count, dtype=np.uint64), _lane(block, offset, 8))
        _rotl(h, 27)
        h *= _U64["p1"]
        h += _U64["p4"]
        offset += 8
    if offset + 4 <= length:
        h ^= _lane(block, offset, 4) * _U64["p1"]
        _rotl(h, 23)
        h *= _U64["p2"]
        h += _U64["p3"]
        offset += 4
    while offset < length:
        h ^= block[:, offset].astype(np.uint64) * _U64["p5"]
        _rotl(h, 11)
        h *= _U64["p1"]
        offset += 1
    h ^= h >> np.uint64(33)
    h *= _U64["p2"]
    h ^= h >> np.uint64(29)
    h *= _U64["p3"]
    h ^= h >> np.uint64(32)
    return h


def _xxh64_chunk(data: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """XXH64 (seed 0) of the byte strings ``data[starts[k]:starts[k] + lengths[k]]``: uint64[n]. Strings of one
    length are hashed together (:func:`_xxh64_block`); when every string has the same length and they follow
    each other (zero-padded ids), ``data`` is that block already. Strings of ``LONG_ID`` bytes or more are hashed
    one at a time by the ``xxhash`` package (lengths that many are rarely shared)."""
    out = np.empty(len(starts), dtype=np.uint64)
    if not len(starts):
        return out
    first = int(lengths[0])
    if (lengths == first).all() and int(starts[0]) == 0 and len(data) == first * len(starts):
        return _xxh64_block(data.reshape(len(starts), first))
    long = np.flatnonzero(lengths >= LONG_ID)
    if len(long):
        import xxhash

        view = memoryview(data)
        for k in long:
            out[k] = xxhash.xxh64_intdigest(view[int(starts[k]) : int(starts[k]) + int(lengths[k])])
    for length in np.unique(lengths[lengths < LONG_ID]):
        chosen = np.flatnonzero(lengths == length)
        block = data[starts[chosen][:, None] + np.arange(int(length))]  # one gather: a string a row
        out[chosen] = _xxh64_block(block.reshape(len(chosen), int(length)))
    return out


def xxh64_texts(texts) -> np.ndarray:
    """XXH64 (seed 0) of the UTF-8 bytes of every string of ``texts`` (a pyarrow string or large_string array
    without nulls): uint64[n], equal to ``xxhash.xxh64_intdigest`` of each; in chunks of ``CHUNK_IDS`` ids."""
    import pyarrow as pa

    out = np.empty(len(texts), dtype=np.uint64)
    with np.errstate(over="ignore"):
        for start in range(0, len(texts), CHUNK_IDS):
            chunk = texts.slice(start, CHUNK_IDS)
            if not pa.types.is_large_string(chunk.type):
                chunk = chunk.cast(pa.large_string())  # int64 offsets: any size of text
            offsets = np.frombuffer(chunk.buffers()[1], dtype=np.int64, count=len(chunk) + 1, offset=8 * chunk.offset)
            data = chunk.buffers()[2]
            first, last = int(offsets[0]), int(offsets[-1])
            data = (
                np.frombuffer(data, dtype=np.uint8, count=last - first, offset=first)
                if data is not None and last > first
                else np.zeros(0, dtype=np.uint8)
            )
            out[start : start + len(chunk)] = _xxh64_chunk(data, offsets[:-1] - first, np.diff(offsets))
    return out


def wide_text(ids):
    """``ids`` (a pyarrow Array or ChunkedArray) with text as ``large_string``: a column of original ids may hold
    more than 2 GiB of text (100M ids of 22 bytes), beyond ``string``'s 32-bit offsets, where joining its chunks
    (or taking rows from them) would fail. Integers are returned as they are; chunks stay chunks."""
    import pyarrow as pa

    return ids.cast(pa.large_string()) if pa.types.is_string(ids.type) else ids


def id_array(ids):
    """``ids`` (a pyarrow Array or ChunkedArray of integers or text) as one Array, text as ``large_string``
    (:func:`wide_text`)."""
    import pyarrow as pa

    ids = wide_text(ids)
    if isinstance(ids, pa.ChunkedArray):
        ids = ids.combine_chunks() if ids.num_chunks else pa.array([], ids.type)
    return ids


def id_hashes(ids, distinct: bool = False) -> np.ndarray:
    """XXH64 of the text of every id of ``ids`` (a pyarrow or numpy array of integers or strings, chunked or not;
    an integer's text is its decimal digits): uint64[n]. Each distinct id is hashed once: through a dictionary of
    the ids, unless they are ``distinct`` already (a vocabulary)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if isinstance(ids, np.ndarray):
        ids = pa.array(ids)
    if isinstance(ids, pa.ChunkedArray):  # a chunk at a time: the chunks' text may pass 2 GiB in all
        parts = [id_hashes(chunk, distinct) for chunk in ids.chunks]
        return np.concatenate(parts) if parts else np.empty(0, dtype=np.uint64)
    if not (pa.types.is_integer(ids.type) or pa.types.is_string(ids.type) or pa.types.is_large_string(ids.type)):
        raise TypeError(f"ids must be integers or strings, got {ids.type}")
    if ids.null_count:
        raise ValueError(f"ids to hash hold {ids.null_count} nulls")
    encoded = None if distinct else pc.dictionary_encode(ids)
    texts = ids if distinct else encoded.dictionary
    if pa.types.is_integer(texts.type):
        texts = texts.cast(pa.large_string())  # decimal digits
    hashes = xxh64_texts(texts)
    return hashes if distinct else hashes[encoded.indices.to_numpy(zero_copy_only=False)]


def rank_ids(ids) -> np.ndarray:
    """The order of ``ids`` (distinct; pyarrow or numpy, int64 or strings) by ``(xxh64, id)``: int64[n] positions,
    so that ``ids[rank_ids(ids)]`` lists them in dense-id order."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if isinstance(ids, np.ndarray):
        ids = pa.array(ids)
    hashes = id_hashes(ids, distinct=True)
    table = pa.table({"h": pa.array(hashes, type=pa.uint64()), "id": wide_text(ids)})  # chunks are not joined
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
