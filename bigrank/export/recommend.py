"""Read an export back (with checksum verification) and recommend items from it.

``load_export`` (``bigrank.export.format``) checks the manifest against the files (presence, byte size,
sha256, Parquet row counts) so a truncated or replaced part is reported by name instead of producing wrong
recommendations. ``Recommender``
holds the item and user vectors and a FAISS index and returns the top-k items of a user by inner product

    top-k_i  <users[u], items[i]>,   i not in the excluded (e.g. already seen) items

or of a new user given as a list of items when the export holds the history table of the user tower
(fold-in: the tower's vector of a user with an empty user-id bag is the mean of the history rows of its
items, ``f(H) = (1/|H|) sum_{i in H} E_hist[i]``; see ``bigrank.model.towers``).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

from bigrank.export.format import TABLE_KEYS, export_id, load_export, parse_index_name, read_table
from bigrank.export.ids import OriginalIdIndex, parse_original_id
from bigrank.export.index import CertifiedExactIndex, build_index, read_index, search, set_search_params
from bigrank.export.seen import SeenItems, SeenItemsFile

__all__ = ["Recommender", "SeenItems", "SeenItemsFile", "load_export", "read_table"]  # readers re-exported


class Recommender:
    """Top-k items by inner product from an export directory.

    Args:
        export_dir: a directory written by ``bigrank export`` (``export_embeddings``).
        index: ``"exact"`` (FAISS ``IndexFlatIP``; built in memory when the export has none saved), ``"ivf"``
            or ``"hnsw"``, or a scalar-quantised one such as ``"ivf-int8"`` / ``"exact-float16"`` (all but
            float32 exact must have been built into the export: ``bigrank build-index DIR --kind ivf``).
        verify: check the files' sha256 checksums on load (``load_export``).
        search_params: search-time overrides, ``{"nprobe": …}`` (IVF) or ``{"efSearch": …}`` (HNSW).
        data_root: the training dataset, for history-tower exports without a ``seen`` table (older
            exports): when the manifest's ``user_vector`` is ``"table+history_mean"``, a known user's
            vector is ``E_user[u] + mean_{i in H(u)} E_hist[i]`` over its train items ``H(u)``, read from
            the export's ``seen`` table when it has one, else from this dataset (default: the manifest's).
        quantize: another way to name a quantised index: ``index="ivf", quantize="int8"``.
        certified_bf16: search the float32 ``exact`` index with the certified bf16 top-K
            (``CertifiedExactIndex``: the items and order of fp32 brute force, faster) where the CPU has bf16
            units (``bigrank.devices.use_certified_bf16``); False, or another CPU: FAISS ``IndexFlatIP``.

    Results are lists of ``{"item_id", "score"}`` dicts, best first, plus the item's ``"original_id"`` and its
    attributes (``"title"`` …; those not null) when the export has them. Original ids (int64 or string) are found
    through ``OriginalIdIndex`` (``user_ids`` / ``item_ids``; None without original ids): ``user_from_original``,
    ``items_from_original``. Index searches are serialised by a lock, so one instance can serve many threads;
    ``search_batch`` answers many queries with one index search.
    """

    def __init__(
        self,
        export_dir,
        index: str = "exact",
        verify: bool = True,
        search_params: dict | None = None,
        data_root=None,
        quantize: str | None = None,
        certified_bf16: bool = True,
    ):
        kind, quantization = parse_index_name(index)
        if quantize not in (None, "float32") and quantization not in ("float32", quantize):
            raise ValueError(f"index {index!r} and quantize={quantize!r} disagree")
        index = kind if (quantize or quantization) == "float32" else f"{kind}-{quantize or quantization}"
        self.export_dir = Path(export_dir)
        self.manifest = load_export(self.export_dir, verify=verify)
        self.export_id = export_id(self.manifest)
        items = read_table(self.export_dir, self.manifest, "items", arrow=True)
        self.item_vectors = items["embedding"]
        # Arrow arrays, not Python objects: a reply converts only its k rows.
        self.item_original_ids = items.get("original_id")
        self.item_attributes = {name: values for name, values in items.items() if name not in TABLE_KEYS}
        self.item_ids = OriginalIdIndex(self.item_original_ids) if self.item_original_ids is not None else None
        users = read_table(self.export_dir, self.manifest, "users", arrow=True)
        self.user_vectors = users["embedding"]
        self.user_ids = OriginalIdIndex(users["original_id"]) if "original_id" in users else None
        del items, users
        self.history_vectors = None
        if "history" in self.manifest["tables"]:
            self.history_vectors = read_table(self.export_dir, self.manifest, "history")["embedding"]
        self.index_kind = index
        saved = self.manifest.get("indexes", {}).get(index)
        if index == "exact" and certified_bf16 and _cpu_bf16():
            self.index = CertifiedExactIndex(self.item_vectors)  # a saved IndexFlatIP holds the same vectors
        elif saved is not None:
            self.index = read_index(self.export_dir / saved["file"])
            if self.index.ntotal != len(self.item_vectors) or self.index.d != self.item_vectors.shape[1]:
                raise ValueError(f"the saved {index} index does not match the export's items")
        elif index == "exact":
            self.index = build_index(self.item_vectors, "exact")
        else:
            quantize_flag = f" --quantize {index.split('-')[1]}" if "-" in index else ""
            raise ValueError(
                f"the export {self.export_dir} has no {index} index; build it with "
                f"`bigrank build-index {self.export_dir} --kind {kind}{quantize_flag}`"
            )
        if search_params:
            set_search_params(self.index, search_params)
        self.index_entry = saved or {"kind": "exact", "quantize": "float32"}
        self.user_vector_rule = self.manifest.get("user_vector", "table")
        dataset = self.manifest.get("dataset") or {}
        self.data_root = data_root if data_root is not None else dataset.get("root")
        self.seen = SeenItemsFile(self.export_dir, self.manifest) if "seen" in self.manifest["tables"] else None
        self._train_items = None
        self._lock = threading.Lock()

    @property
    def num_items(self) -> int:
        return len(self.item_vectors)

    @property
    def num_users(self) -> int:
        return len(self.user_vectors)

    @property
    def dim(self) -> int:
        return int(self.item_vectors.shape[1])

    @property
    def has_history(self) -> bool:
        return self.history_vectors is not None

    @property
    def user_id_kind(self) -> str | None:
        """``"int64"`` or ``"string"``: the type of the export's original user ids; None when it has none."""
        return None if self.user_ids is None else self.user_ids.kind

    @property
    def item_id_kind(self) -> str | None:
        """``"int64"`` or ``"string"``: the type of the export's original item ids; None when it has none."""
        return None if self.item_ids is None else self.item_ids.kind

    def user_from_original(self, original_id: int | str) -> int:
        """Dense user id of one original user id (an int or str; text of an integer for int64 ids); ValueError
        naming the id when it is unknown or of the wrong type, or when the export has no original ids."""
        index = _original_index(self.user_ids, "user")
        return index.dense_id(parse_original_id(original_id, index.kind, "user"), "user")

    def item_from_original(self, original_id: int | str) -> int:
        """Dense item id of one original item id; ValueError as ``user_from_original``."""
        return int(self.items_from_original([original_id])[0])

    def items_from_original(self, original_ids: Sequence) -> np.ndarray:
        """Dense item ids int64[n] of original item ids (ints or strs); ValueError naming the unknown ones."""
        index = _original_index(self.item_ids, "item")
        return index.dense_ids([parse_original_id(value, index.kind, "item") for value in original_ids], "item")

    def user_vector(self, user_id: int) -> np.ndarray:
        """The exported vector float32[d] of dense user ``user_id``."""
        user_id = _as_int(user_id, "user id")
        if not 0 <= user_id < self.num_users:
            raise ValueError(f"user id {user_id} is outside [0, {self.num_users})")
        if self.user_vector_rule == "table":
            return self.user_vectors[user_id]
        # History tower: f(u) = E_user[u] + mean of the history rows of u's train items (empty bag: 0).
        if self.seen is not None:
            history = self.seen.train_items_of(user_id)
        else:
            history = self.train_items().items_of(user_id)
        if len(history) == 0:
            return self.user_vectors[user_id]
        mean = self.history_vectors[history].mean(axis=0, dtype=np.float64)
        return (self.user_vectors[user_id] + mean).astype(np.float32)

    def seen_items(self, splits: Sequence[str] = ("train", "valid", "test")):
        """The export's seen items (``SeenItemsFile``) counting ``splits``; ValueError when it has none."""
        if self.seen is None:
            return SeenItemsFile(self.export_dir, self.manifest, splits)  # raises with a message
        if tuple(splits) == self.seen.splits:
            return self.seen
        return SeenItemsFile(self.export_dir, self.manifest, splits)

    def train_items(self) -> SeenItems:
        """The users' train items (history bags) of the dataset, loaded on first use."""
        with self._lock:
            if self._train_items is None:
                if self.data_root is None or not Path(self.data_root).is_dir():
                    raise ValueError(
                        "this export comes from a history-tower model: a user's vector needs the user's train "
                        f"items, but the export has no seen-items table and the dataset {self.data_root!r} is "
                        "not available; pass its directory (--data DATA_ROOT) or export again with the dataset"
                    )
                train = SeenItems(self.data_root, ("train",))
                if train.num_items != self.num_items or train.num_users != self.num_users:
                    raise ValueError(f"the dataset {self.data_root} does not match the export's users and items")
                self._train_items = train
            return self._train_items

    def fold_in_vector(self, item_ids: Iterable[int]) -> np.ndarray:
        """User vector of a user known only by the items ``item_ids``, float32[d]: the mean of their history rows
        (history towers), or their sum / sqrt(count) for exports whose manifest says ``"fold_in": "sqrt_sum"``
        (a model kind whose user vector is ``|x|^-1/2`` times the sum of its items' history rows)."""
        if self.history_vectors is None:
            raise ValueError(
                "this export has no history table (the model was trained without the history tower), so a user "
                "given as a list of items cannot be folded in; recommend for a known user id instead"
            )
        items = self.check_items(item_ids)
        if len(items) == 0:
            raise ValueError("fold-in needs at least one item id")
        if self.manifest.get("fold_in", "mean") == "sqrt_sum":
            total = self.history_vectors[items].sum(axis=0, dtype=np.float64)
            return (total / np.sqrt(len(items))).astype(np.float32)
        return self.history_vectors[items].mean(axis=0, dtype=np.float64).astype(np.float32)

    def recommend(self, user_id: int, k: int = 10, exclude_item_ids: Iterable[int] | None = None) -> list[dict]:
        """Top-``k`` items of dense user ``user_id`` by inner product, never any of ``exclude_item_ids``."""
        return self.recommend_vector(self.user_vector(user_id), k, exclude_item_ids)

    def recommend_items_history(
        self,
        item_ids: Iterable[int],
        k: int = 10,
        exclude_item_ids: Iterable[int] | None = None,
        exclude_history: bool = True,
    ) -> list[dict]:
        """Top-``k`` items for a user given as the items ``item_ids`` (fold-in through the history table).

        The history items themselves are excluded unless ``exclude_history=False``.
        """
        items = self.check_items(item_ids)
        excluded = self.check_items([] if exclude_item_ids is None else exclude_item_ids)
        if exclude_history:
            excluded = np.concatenate([items, excluded])
        return self.recommend_vector(self.fold_in_vector(items), k, excluded)

    def recommend_vector(
        self, vector: np.ndarray, k: int = 10, exclude_item_ids: Iterable[int] | None = None
    ) -> list[dict]:
        """Top-``k`` items for a query vector float32[d], skipping ``exclude_item_ids``, best first.

        The index is asked for ``k + |excluded|`` items, so with the exact index the result is the exact
        top-k of the remaining items (fewer when fewer remain).
        """
        k = _as_int(k, "k")
        excluded = self.check_items([] if exclude_item_ids is None else exclude_item_ids)
        ((ids, scores),) = self.search_batch(np.asarray(vector, dtype=np.float32).reshape(1, -1), [k], [excluded])
        return self.describe(ids, scores)

    def search_batch(
        self, vectors: np.ndarray, ks: Sequence[int], excluded: Sequence[np.ndarray]
    ) -> list[tuple[np.ndarray, np.ndarray]]:
        """Top-``ks[j]`` items of each query ``vectors[j]`` (float32[q, d]) skipping ``excluded[j]`` (int ids).

        One index search answers the whole batch, asking for ``max_j (ks[j] + |excluded[j]|)`` items; a row
        that an approximate index leaves short of ``ks[j]`` is searched again, alone, with a doubled width.
        Returns per query ``(ids int64[<= k], scores float32[<= k])``, best first.
        """
        vectors = np.ascontiguousarray(np.atleast_2d(vectors), dtype=np.float32)
        if len(vectors) != len(ks) or len(ks) != len(excluded):
            raise ValueError(f"{len(vectors)} vectors, {len(ks)} ks and {len(excluded)} exclusion lists differ")
        for k in ks:
            if int(k) < 1:
                raise ValueError(f"k must be >= 1, got {k}")
        excluded = [np.unique(np.asarray(e, dtype=np.int64)) for e in excluded]
        if isinstance(self.index, CertifiedExactIndex):  # exact, and takes the exclusions itself
            with self._lock:
                return self.index.search_excluding(vectors, ks, excluded)
        wants = [min(self.num_items, int(k) + len(e)) for k, e in zip(ks, excluded, strict=True)]
        with self._lock:
            scores, ids = search(self.index, vectors, max(wants))
        out = []
        for row, (k, skip, want) in enumerate(zip(ks, excluded, wants, strict=True)):
            row_ids, row_scores = ids[row], scores[row]
            while True:
                keep = (row_ids >= 0) & ~np.isin(row_ids, skip)
                chosen_ids, chosen_scores = row_ids[keep][: int(k)], row_scores[keep][: int(k)]
                # Approximate indexes may return fewer hits than asked: widen the search until k are found.
                if len(chosen_ids) >= int(k) or want >= self.num_items:
                    break
                want = min(self.num_items, 2 * want)
                with self._lock:
                    more_scores, more_ids = search(self.index, vectors[row : row + 1], want)
                row_ids, row_scores = more_ids[0], more_scores[0]
            out.append((chosen_ids, chosen_scores))
        return out

    def describe(self, ids: np.ndarray, scores: np.ndarray) -> list[dict]:
        """Result rows ``{"item_id", "score", "original_id"?, <attribute>?…}`` of item ids int[k] and their
        scores float[k]: the original id (int or str) when the export has them, and each item attribute (e.g.
        ``title``) that is not null for the item."""
        ids = np.asarray(ids, dtype=np.int64)
        rows = [{"item_id": int(item), "score": float(score)} for item, score in zip(ids, scores, strict=True)]
        if not len(rows):
            return rows
        columns = dict(self.item_attributes)
        if self.item_original_ids is not None:
            columns = {"original_id": self.item_original_ids, **columns}
        for name, values in columns.items():
            for row, value in zip(rows, values.take(ids).to_pylist(), strict=True):
                # Nulls, NaN and infinities are left out: JSON has no NaN or infinity (Starlette refuses them).
                if value is not None and not (isinstance(value, float) and not math.isfinite(value)):
                    row[name] = value
        return rows

    def check_items(self, item_ids: Iterable[int]) -> np.ndarray:
        """``item_ids`` as int64[n]; ValueError naming the bad ones when not integers in ``[0, num_items)``."""
        if isinstance(item_ids, np.ndarray) and item_ids.dtype.kind in "iu":
            items = item_ids.astype(np.int64).reshape(-1)
        else:
            ids = [_as_int(i, "item id") for i in item_ids]
            outside = [i for i in ids if not 0 <= i < self.num_items]  # before numpy: one past int64 overflows
            if outside:
                raise ValueError(f"item ids {outside[:5]} are outside [0, {self.num_items})")
            items = np.asarray(ids, dtype=np.int64)
        bad = items[(items < 0) | (items >= self.num_items)]
        if len(bad):
            raise ValueError(f"item ids {bad[:5].tolist()} are outside [0, {self.num_items})")
        return items


def _cpu_bf16() -> bool:
    from bigrank.devices import use_certified_bf16  # imports torch: only when the exact index is asked for

    return use_certified_bf16(True, "cpu")


def _as_int(value, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        try:
            if isinstance(value, str):
                return int(value.strip())
            if float(value) == int(value):
                return int(value)
        except (TypeError, ValueError, OverflowError):  # OverflowError: int(inf)
            pass
        raise ValueError(f"{what} must be an integer, got {value!r}")
    return int(value)


def _original_index(index: OriginalIdIndex | None, what: str) -> OriginalIdIndex:
    if index is None:
        raise ValueError(f"this export has no original {what} ids (the dataset was synthetic); use dense ids")
    return index
