"""Maximum-inner-product item indexes (FAISS): exact ``IndexFlatIP`` by default, IVF and HNSW as options.

The score of a user vector ``u`` and an item vector ``v`` is ``<u, v>`` (the trained model's score), so the
indexes search by inner product (``faiss.METRIC_INNER_PRODUCT``). The position of an item in an index is its
dense item id (an export's parts tile ``[0, num_items)`` in order).

* ``exact`` — ``IndexFlatIP``: brute force, exact top-k; O(n·d) per query.
* ``ivf`` — ``IndexIVFFlat`` (Jégou et al., 2011, inverted file): k-means on a sample splits the catalog into
  ``nlist`` cells; a query scans the ``nprobe`` cells whose centroids score highest. Approximate.
* ``hnsw`` — ``IndexHNSWFlat`` (Malkov & Yashunin, 2018, hierarchical navigable small-world graph) with
  ``M`` links per node, ``efConstruction`` / ``efSearch`` candidate lists. Approximate.

Each kind can also store its vectors scalar-quantised (FAISS ``ScalarQuantizer``: per dimension, the
range seen in training is split into 2^8 levels for ``int8``, or the value rounded to IEEE half for
``float16``): ``IndexScalarQuantizer``, ``IndexIVFScalarQuantizer``, ``IndexHNSWSQ``. That halves
(float16) or quarters (int8) the index memory; scores are computed on the decoded vectors, so they are
approximate too. An index is named ``kind`` or ``kind-quantisation`` (``"ivf-int8"``; see
``bigrank.export.format.index_name``).

Every index other than float32 ``exact`` is reported with its recall@k against the exact top-k
(``recall_at_k``), measured when it is built into an export and recorded in its manifest.

On a CPU with bf16 units the float32 ``exact`` index is searched by :class:`CertifiedExactIndex` instead of
``IndexFlatIP``: the catalog is scored in bf16 and the exact fp32 top-k is certified and rescored
(``bigrank.model.topk``), the same items in the same order as fp32 brute force (scores can differ from
FAISS's in the last bit: another summation order), at a fraction of the fp32 GEMM time.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import numpy as np

from bigrank.atomic import write_atomic, write_json_atomic
from bigrank.export.format import (
    INDEX_KINDS,
    MANIFEST_NAME,
    index_file,
    index_name,
    load_export,
    parse_index_name,
    read_table,
    sha256_file,
)

RECALL_K = 10
RECALL_QUERIES = 1000
SQ_TRAIN_ROWS = 65536


def default_params(kind: str, num_items: int) -> dict:
    """Default build/search parameters of ``kind`` for a catalog of ``num_items`` rows.

    IVF: ``nlist ≈ sqrt(n)`` cells (k-means on ``64 · nlist`` sampled rows keeps training to seconds on a
    CPU), ``nprobe = nlist / 16`` (at least 8). HNSW: ``M = 16``, ``efConstruction = 40`` (FAISS's default),
    ``efSearch = 128``.
    """
    if kind == "exact":
        return {}
    if kind == "ivf":
        nlist = max(1, min(int(round(math.sqrt(num_items))), num_items // 39 or 1))
        return {"nlist": nlist, "nprobe": min(nlist, max(8, nlist // 16)), "train_rows": min(num_items, 64 * nlist)}
    if kind == "hnsw":
        return {"M": 16, "efConstruction": 40, "efSearch": 128}
    raise ValueError(f"unknown index kind {kind!r}; choose one of {INDEX_KINDS}")


def build_index(
    vectors: np.ndarray, kind: str = "exact", params: dict | None = None, seed: int = 0, quantize: str | None = None
):
    """Build a FAISS inner-product index over the rows of ``vectors`` (float32[n, d]).

    ``params`` overrides ``default_params(kind, n)``; ``quantize`` (None/"float32", "float16", "int8")
    stores the vectors scalar-quantised. Returns the index; position ``i`` is row ``i``.
    """
    import faiss

    index_name(kind, quantize)  # validates the pair
    vectors = np.ascontiguousarray(vectors, dtype=np.float32)
    if vectors.ndim != 2 or vectors.shape[0] == 0:
        raise ValueError(f"cannot index an empty or non-2-D matrix of shape {vectors.shape}")
    n, d = vectors.shape
    settings = {**default_params(kind, n), **(params or {})}
    qtype = {"float16": faiss.ScalarQuantizer.QT_fp16, "int8": faiss.ScalarQuantizer.QT_8bit}.get(quantize or "")
    ip = faiss.METRIC_INNER_PRODUCT
    rng = np.random.default_rng(seed)
    train_rows = SQ_TRAIN_ROWS
    if kind == "exact":
        index = faiss.IndexFlatIP(d) if qtype is None else faiss.IndexScalarQuantizer(d, qtype, ip)
    elif kind == "ivf":
        quantizer = faiss.IndexFlatIP(d)
        nlist = int(settings["nlist"])
        if qtype is None:
            index = faiss.IndexIVFFlat(quantizer, d, nlist, ip)
        else:
            index = faiss.IndexIVFScalarQuantizer(quantizer, d, nlist, qtype, ip)
        index.cp.seed = seed
        index.nprobe = int(settings["nprobe"])
        train_rows = int(settings["train_rows"])
    elif kind == "hnsw":
        if qtype is None:
            index = faiss.IndexHNSWFlat(d, int(settings["M"]), ip)
        else:
            index = faiss.IndexHNSWSQ(d, qtype, int(settings["M"]), ip)
        index.hnsw.efConstruction = int(settings["efConstruction"])
        index.hnsw.efSearch = int(settings["efSearch"])
    else:
        raise ValueError(f"unknown index kind {kind!r}; choose one of {INDEX_KINDS}")
    if not index.is_trained:  # IVF centroids (k-means) and the scalar quantiser's ranges
        sample = vectors[np.sort(rng.choice(n, size=min(n, train_rows), replace=False))]
        index.train(sample)
    index.add(vectors)
    return index


class CertifiedExactIndex:
    """Exact maximum-inner-product search by the certified bf16 top-K (``bigrank.model.topk.exact_topk``).

    The answer of fp32 brute force (ties: lower id first) from a bf16 scoring pass plus fp32 rescoring of the
    few candidates the bf16 error bound cannot rule out; the bf16 copy of ``vectors`` (float32[n, d], kept
    as given) is made once here. Speaks ``IndexFlatIP``'s ``ntotal`` / ``d`` / ``search`` and answers queries
    with per-query exclusions directly (``search_excluding``), so they need not widen the search.
    ``certified=False``: the same answers from fp32 scores (the reference the tests compare with). Keeps its
    score buffers between searches (up to ~200 MB at ML-1B size); not for concurrent searches (``Recommender``
    serialises them with its lock).
    """

    def __init__(self, vectors: np.ndarray, certified: bool = True):

        from bigrank.model.topk import TopKCatalog

        vectors = np.ascontiguousarray(vectors, dtype=np.float32)
        if vectors.ndim != 2 or vectors.shape[0] == 0:
            raise ValueError(f"cannot index an empty or non-2-D matrix of shape {vectors.shape}")
        self.ntotal, self.d = int(vectors.shape[0]), int(vectors.shape[1])
        self.certified = bool(certified)
        self.catalog = TopKCatalog.build(_as_tensor(vectors), certified=self.certified)
        self.stats = None  # a bigrank.model.topk.TopKStats to count into, when set

    def search(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """``(scores float32[q, k], ids int64[q, k])``, best first (FAISS's ``search``)."""
        values, columns = self._topk(queries, k, None)
        return values.numpy(), columns.numpy()

    def search_excluding(self, queries: np.ndarray, ks, excluded) -> list[tuple[np.ndarray, np.ndarray]]:
        """Per query j, ``(ids int64[<= ks[j]], scores float32[...])`` of its top ``ks[j]`` items other than
        ``excluded[j]`` (int ids), best first: fewer when fewer items remain."""
        import torch

        lengths = [len(e) for e in excluded]
        rows = torch.from_numpy(np.repeat(np.arange(len(lengths), dtype=np.int64), lengths))
        columns = torch.from_numpy(np.concatenate([np.asarray(e, dtype=np.int64) for e in excluded] or [[]]))
        values, ids = self._topk(queries, max(int(k) for k in ks), (rows, columns.long()))
        out = []
        for row, k in enumerate(ks):
            keep = ids[row, : int(k)] >= 0  # -1: excluded, or fewer items left
            out.append((ids[row, : int(k)][keep].numpy(), values[row, : int(k)][keep].numpy()))
        return out

    def _topk(self, queries, k: int, exclude):

        from bigrank.model.topk import exact_topk

        queries = _as_tensor(np.ascontiguousarray(np.atleast_2d(queries), dtype=np.float32))
        if int(k) < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        return exact_topk(queries, self.catalog, int(k), exclude=exclude, certified=self.certified, stats=self.stats)


def _as_tensor(array: np.ndarray):
    """A torch view of ``array`` without a copy; read-only arrays (Arrow-backed exports) are only ever read."""
    import warnings

    import torch

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(array)


def set_search_params(index, params: dict) -> None:
    """Apply search-time parameters (``nprobe`` for IVF, ``efSearch`` for HNSW) to a loaded index."""
    if isinstance(index, CertifiedExactIndex):
        return  # exact: nothing to tune
    import faiss

    if "nprobe" in params and hasattr(index, "nprobe"):
        index.nprobe = int(params["nprobe"])
    if "efSearch" in params:
        hnsw = faiss.downcast_index(index)
        if hasattr(hnsw, "hnsw"):
            hnsw.hnsw.efSearch = int(params["efSearch"])


def search(index, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Top-``k`` items of each query: ``(scores float32[q, k], ids int64[q, k])``, best first.

    ``k`` is capped at the index size; missing results (possible with approximate indexes) have id -1.
    """
    queries = np.ascontiguousarray(np.atleast_2d(queries), dtype=np.float32)
    k = min(int(k), index.ntotal)
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    return index.search(queries, k)


def brute_force_top_k(
    items: np.ndarray, queries: np.ndarray, k: int, chunk_elements: int = 1 << 25
) -> tuple[np.ndarray, np.ndarray]:
    """Reference top-``k`` by inner product in numpy: ``(scores float32[q, k], ids int64[q, k])``, best first.

    Ties are broken by the smaller item id. ``items``: float32[n, d], ``queries``: float32[q, d]. Queries
    are scored in chunks so at most ``chunk_elements`` scores exist at once.
    """
    items = np.asarray(items, dtype=np.float32)
    queries = np.atleast_2d(np.asarray(queries, dtype=np.float32))
    k = min(int(k), items.shape[0])
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    out_scores = np.empty((len(queries), k), dtype=np.float32)
    out_ids = np.empty((len(queries), k), dtype=np.int64)
    step = max(1, chunk_elements // max(1, items.shape[0]))
    for lo in range(0, len(queries), step):
        scores = queries[lo : lo + step] @ items.T
        part = np.argpartition(-scores, k - 1, axis=1)[:, :k]
        for row in range(scores.shape[0]):
            cand = part[row]
            order = cand[np.lexsort((cand, -scores[row, cand]))]
            out_ids[lo + row] = order
            out_scores[lo + row] = scores[row, order]
    return out_scores, out_ids


def recall_at_k(approx_ids: np.ndarray, exact_ids: np.ndarray) -> float:
    """Mean over queries of ``|approx top-k ∩ exact top-k| / k`` (both int[q, k])."""
    approx_ids, exact_ids = np.atleast_2d(approx_ids), np.atleast_2d(exact_ids)
    k = exact_ids.shape[1]
    hits = sum(len(np.intersect1d(a[a >= 0], e)) for a, e in zip(approx_ids, exact_ids, strict=True))
    return hits / (k * exact_ids.shape[0])


def write_index_atomic(index, path: str | Path) -> Path:
    """Save ``index`` to ``path`` via a temporary file and ``os.replace``."""
    import faiss

    return write_atomic(path, lambda tmp: faiss.write_index(index, str(tmp)))


def read_index(path: str | Path):
    """Load a FAISS index written by ``write_index_atomic``."""
    import faiss

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"index file is missing: {path}")
    return faiss.read_index(str(path))


def build_export_index(
    export_dir: str | Path,
    name: str = "exact",
    params: dict | None = None,
    num_queries: int = RECALL_QUERIES,
    quantize: str | None = None,
) -> dict:
    """Build the index ``name`` of an export's items, save it beside the parts and record it in the manifest.

    ``name`` is a kind (``"exact"``, ``"ivf"``, ``"hnsw"``) or ``kind-quantisation`` (``"ivf-int8"``);
    ``quantize`` is another way to give the quantisation. Except for float32 ``exact``, the recall@10
    against the exact top-k is measured on ``num_queries`` user vectors of the export (items when it has
    no users) and recorded with the build parameters and time. The index file is written atomically
    before the manifest (rewritten atomically) names it. Returns the manifest entry of the index.
    """
    kind, quantization = parse_index_name(name)
    if quantize is not None and quantization != "float32" and quantize != quantization:
        raise ValueError(f"index {name!r} and quantize={quantize!r} disagree")
    name = index_name(kind, quantize or quantization)
    quantization = quantize or quantization
    export_dir = Path(export_dir)
    manifest = load_export(export_dir)
    items = read_table(export_dir, manifest, "items")["embedding"]
    settings = {**default_params(kind, len(items)), **(params or {})}
    started = time.perf_counter()
    index = build_index(items, kind, settings, quantize=quantization)
    build_seconds = time.perf_counter() - started
    entry = {
        "file": index_file(name),
        "kind": kind,
        "quantize": quantization,
        "params": settings,
        "build_seconds": round(build_seconds, 3),
    }
    if name != "exact":
        queries = _recall_queries(export_dir, manifest, items, num_queries)
        _, exact = brute_force_top_k(items, queries, RECALL_K)
        _, approx = search(index, queries, RECALL_K)
        entry[f"recall_at_{RECALL_K}_vs_exact"] = round(recall_at_k(approx, exact), 4)
        entry["recall_queries"] = len(queries)
    path = write_index_atomic(index, export_dir / entry["file"])
    entry.update(bytes=path.stat().st_size, sha256=sha256_file(path))
    manifest = json.loads((export_dir / MANIFEST_NAME).read_text())
    manifest.setdefault("indexes", {})[name] = entry
    write_json_atomic(export_dir / MANIFEST_NAME, manifest)
    return entry


def _recall_queries(export_dir: Path, manifest: dict, items: np.ndarray, num_queries: int) -> np.ndarray:
    users = read_table(export_dir, manifest, "users")["embedding"] if manifest["num_users"] else items
    rng = np.random.default_rng(0)
    rows = np.sort(rng.choice(len(users), size=min(num_queries, len(users)), replace=False))
    return users[rows]
