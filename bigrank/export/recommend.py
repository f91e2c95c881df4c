"""Read an export back (with checksum verification) and recommend items from it.

``load_export`` checks the manifest against the files (presence, byte size, sha256, Parquet row counts) so a
truncated or replaced part is reported by name instead of producing wrong recommendations. ``Recommender``
holds the item and user vectors and a FAISS index and returns the top-k items of a user by inner product

    top-k_i  <users[u], items[i]>,   i not in the excluded (e.g. already seen) items

or of a new user given as a list of items when the export holds the history table of the user tower
(fold-in: the tower's vector of a user with an empty user-id bag is the mean of the history rows of its
items, ``f(H) = (1/|H|) sum_{i in H} E_hist[i]``; see ``bigrank.model.towers``).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

from bigrank.export.writer import EXPORT_FORMAT_VERSION, EXPORT_KIND, MANIFEST_NAME, sha256_file

PRELOAD_MAX_RATINGS = 50_000_000


def load_export(export_dir: str | Path, verify: bool = True) -> dict:
    """Read ``<export_dir>/manifest.json`` and check the files it lists; returns the manifest.

    Always checks that every part and index file exists and has the recorded byte size; ``verify=True``
    also checks each file's sha256 and each part's Parquet row count. Raises FileNotFoundError for a missing
    directory, manifest or file and ValueError naming the file for a truncated, modified or corrupt one.
    """
    export_dir = Path(export_dir)
    if not export_dir.is_dir():
        raise FileNotFoundError(f"export directory does not exist: {export_dir}")
    path = export_dir / MANIFEST_NAME
    if not path.is_file():
        raise FileNotFoundError(
            f"no {MANIFEST_NAME} in {export_dir}: not a bigrank export, or the export did not finish (run it again)"
        )
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{path} is not valid JSON: {error}") from error
    if not isinstance(manifest, dict) or manifest.get("kind") != EXPORT_KIND:
        raise ValueError(f"{path} is not the manifest of a bigrank embeddings export")
    if manifest.get("format_version") != EXPORT_FORMAT_VERSION:
        raise ValueError(f"{path} has format_version {manifest.get('format_version')}; this bigrank reads 1")
    for name, table in manifest["tables"].items():
        for part in table["parts"]:
            _check_file(export_dir / part["file"], part, verify, f"part of table {name!r}")
            if verify:
                _check_rows(export_dir / part["file"], part["rows"])
    for kind, entry in manifest.get("indexes", {}).items():
        _check_file(export_dir / entry["file"], entry, verify, f"{kind} index")
    return manifest


def _check_file(path: Path, entry: dict, verify: bool, what: str) -> None:
    if not path.is_file():
        raise FileNotFoundError(f"export file listed in the manifest is missing ({what}): {path}")
    size = path.stat().st_size
    if size != entry["bytes"]:
        raise ValueError(
            f"export file is truncated or was modified ({what}): {path} has {size} bytes, "
            f"the manifest records {entry['bytes']}"
        )
    if verify and sha256_file(path) != entry["sha256"]:
        raise ValueError(f"export file is corrupt ({what}): {path} does not match its sha256 in the manifest")


def _check_rows(path: Path, rows: int) -> None:
    import pyarrow.parquet as pq

    try:
        found = pq.ParquetFile(path).metadata.num_rows
    except Exception as error:  # pyarrow raises ArrowInvalid / OSError for a bad footer
        raise ValueError(f"export file is corrupt (unreadable Parquet footer): {path}: {error}") from error
    if found != rows:
        raise ValueError(f"export file {path} holds {found} rows, the manifest records {rows}")


def read_table(export_dir: str | Path, manifest: dict, name: str) -> dict[str, np.ndarray]:
    """All rows of table ``name`` ("items", "users", "history", "items_float16", …) in id order.

    Returns ``{"ids": int32[n], "embedding": [n, d] (float32, float16 or int8), "original_id": int64[n]?,
    "title": object[n]?, "scale": float32[n]?}`` (optional keys when the parts have those columns).
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    if name not in manifest["tables"]:
        raise ValueError(f"the export has no table {name!r}; it has {sorted(manifest['tables'])}")
    entry = manifest["tables"][name]
    parts = sorted(entry["parts"], key=lambda p: p["row_start"])
    pieces = []
    for part in parts:
        path = Path(export_dir) / part["file"]
        try:
            pieces.append(pq.read_table(path))
        except Exception as error:
            raise ValueError(f"export file is corrupt (cannot decode): {path}: {error}") from error
    table = pa.concat_tables(pieces)
    ids = table.column(entry["id_column"]).to_numpy()
    if not np.array_equal(ids, np.arange(entry["rows"])):
        raise ValueError(f"table {name!r} of {export_dir}: the parts' ids are not 0 … {entry['rows'] - 1} in order")
    embedding = table.column("embedding").combine_chunks()
    if isinstance(embedding, pa.ChunkedArray):  # an empty table has no chunk to combine
        embedding = pa.concat_arrays(embedding.chunks) if embedding.num_chunks else None
    dim = int(entry["dim"])
    flat = embedding.flatten().to_numpy(zero_copy_only=False) if embedding is not None else np.empty(0)
    out = {"ids": ids.astype(np.int32), "embedding": flat.reshape(len(ids), dim)}
    if "original_id" in table.column_names:
        out["original_id"] = table.column("original_id").to_numpy().astype(np.int64)
    if "title" in table.column_names:
        out["title"] = np.asarray(table.column("title").to_pylist(), dtype=object)
    if "scale" in table.column_names:
        out["scale"] = table.column("scale").to_numpy()
    return out


class SeenItems:
    """The items each user has rated in a dataset (``bigrank.data`` layout), for excluding them.

    ``splits`` (default all three) are the interactions counted as seen. Datasets of at most
    ``PRELOAD_MAX_RATINGS`` ratings are loaded once into a CSR array (user -> sorted items); larger ones are
    scanned per user with a Parquet filter on ``user_id`` (row groups are skipped by their statistics).
    """

    def __init__(self, data_root: str | Path, splits: Sequence[str] = ("train", "valid", "test")):
        from bigrank.data import manifest as layout

        self.root = Path(data_root)
        self.manifest = layout.validate_dataset(self.root, splits)
        self.splits = tuple(splits)
        self.files = [self.root / f for s in self.splits for f in layout.split_info(self.manifest, s)["files"]]
        self.num_users = int(self.manifest["num_users"])
        self.num_items = int(self.manifest["num_items"])
        rows = sum(layout.split_info(self.manifest, s)["rows"] for s in self.splits)
        self._indptr = self._items = None
        if rows <= PRELOAD_MAX_RATINGS:
            self._preload()

    def _preload(self) -> None:
        import pyarrow.parquet as pq

        users, items = [np.empty(0, np.int32)], [np.empty(0, np.int32)]
        for path in self.files:
            table = pq.read_table(path, columns=["user_id", "item_id"])
            users.append(table.column("user_id").to_numpy())
            items.append(table.column("item_id").to_numpy())
        users, items = np.concatenate(users), np.concatenate(items)
        order = np.lexsort((items, users))
        self._items = items[order]
        self._indptr = np.concatenate([[0], np.cumsum(np.bincount(users, minlength=self.num_users))])

    def items_of(self, user_id: int) -> np.ndarray:
        """Sorted unique item ids (int32) that ``user_id`` rated in the chosen splits."""
        if not 0 <= int(user_id) < self.num_users:
            raise ValueError(f"user id {user_id} is outside [0, {self.num_users}) of the dataset {self.root}")
        if self._indptr is not None:
            return np.unique(self._items[self._indptr[user_id] : self._indptr[user_id + 1]])
        import pyarrow.parquet as pq

        found = [np.empty(0, np.int32)]
        for path in self.files:
            table = pq.read_table(path, columns=["item_id"], filters=[("user_id", "==", int(user_id))])
            found.append(table.column("item_id").to_numpy())
        return np.unique(np.concatenate(found))


class Recommender:
    """Top-k items by inner product from an export directory.

    Args:
        export_dir: a directory written by ``bigrank export`` (``export_embeddings``).
        index: ``"exact"`` (FAISS ``IndexFlatIP``; built in memory when the export has none saved), ``"ivf"``
            or ``"hnsw"`` (must have been built into the export: ``bigrank build-index DIR --kind ivf``).
        verify: check the files' sha256 checksums on load (``load_export``).
        search_params: search-time overrides, ``{"nprobe": …}`` (IVF) or ``{"efSearch": …}`` (HNSW).
        data_root: the training dataset, needed when the manifest's ``user_vector`` is
            ``"table+history_mean"`` (history-tower models): a known user's vector is then
            ``E_user[u] + mean_{i in H(u)} E_hist[i]`` over its train items ``H(u)``. Default: the dataset
            recorded in the manifest.

    Results are lists of ``{"item_id", "score"}`` dicts (plus ``"original_id"`` / ``"title"`` when the export
    has them), best first. Searches are serialised by a lock, so one instance can serve many threads.
    """

    def __init__(
        self,
        export_dir,
        index: str = "exact",
        verify: bool = True,
        search_params: dict | None = None,
        data_root=None,
    ):
        from bigrank.export.index import INDEX_KINDS, build_index, read_index, set_search_params

        if index not in INDEX_KINDS:
            raise ValueError(f"unknown index {index!r}; choose one of {INDEX_KINDS}")
        self.export_dir = Path(export_dir)
        self.manifest = load_export(self.export_dir, verify=verify)
        items = read_table(self.export_dir, self.manifest, "items")
        self.item_vectors = items["embedding"]
        self.item_original_ids = items.get("original_id")
        self.item_titles = items.get("title")
        users = read_table(self.export_dir, self.manifest, "users")
        self.user_vectors = users["embedding"]
        self.user_original_ids = users.get("original_id")
        self.history_vectors = None
        if "history" in self.manifest["tables"]:
            self.history_vectors = read_table(self.export_dir, self.manifest, "history")["embedding"]
        self.index_kind = index
        saved = self.manifest.get("indexes", {}).get(index)
        if saved is not None:
            self.index = read_index(self.export_dir / saved["file"])
            if self.index.ntotal != len(self.item_vectors) or self.index.d != self.item_vectors.shape[1]:
                raise ValueError(f"the saved {index} index does not match the export's items")
        elif index == "exact":
            self.index = build_index(self.item_vectors, "exact")
        else:
            raise ValueError(
                f"the export {self.export_dir} has no {index} index; build it with "
                f"`bigrank build-index {self.export_dir} --kind {index}`"
            )
        if search_params:
            set_search_params(self.index, search_params)
        self.user_vector_rule = self.manifest.get("user_vector", "table")
        dataset = self.manifest.get("dataset") or {}
        self.data_root = data_root if data_root is not None else dataset.get("root")
        self._train_items = None
        self._lock = threading.Lock()

    @property
    def num_items(self) -> int:
        return len(self.item_vectors)

    @property
    def num_users(self) -> int:
        return len(self.user_vectors)

    @property
    def has_history(self) -> bool:
        return self.history_vectors is not None

    def user_from_original(self, original_id: int) -> int:
        """Dense user id of the original (MovieLens) user id; ValueError when unknown or unavailable."""
        return _dense_id(self.user_original_ids, original_id, "user")

    def item_from_original(self, original_id: int) -> int:
        """Dense item id of the original (MovieLens) item id; ValueError when unknown or unavailable."""
        return _dense_id(self.item_original_ids, original_id, "item")

    def user_vector(self, user_id: int) -> np.ndarray:
        """The exported vector float32[d] of dense user ``user_id``."""
        user_id = _as_int(user_id, "user id")
        if not 0 <= user_id < self.num_users:
            raise ValueError(f"user id {user_id} is outside [0, {self.num_users})")
        if self.user_vector_rule == "table":
            return self.user_vectors[user_id]
        # History tower: f(u) = E_user[u] + mean of the history rows of u's train items (empty bag: 0).
        history = self.train_items().items_of(user_id)
        if len(history) == 0:
            return self.user_vectors[user_id]
        mean = self.history_vectors[history].mean(axis=0, dtype=np.float64)
        return (self.user_vectors[user_id] + mean).astype(np.float32)

    def train_items(self) -> SeenItems:
        """The users' train items (history bags) of the dataset, loaded on first use."""
        with self._lock:
            if self._train_items is None:
                if self.data_root is None or not Path(self.data_root).is_dir():
                    raise ValueError(
                        "this export comes from a history-tower model: a user's vector needs the user's train "
                        f"items, but the dataset {self.data_root!r} is not available; pass its directory "
                        "(--data DATA_ROOT)"
                    )
                train = SeenItems(self.data_root, ("train",))
                if train.num_items != self.num_items or train.num_users != self.num_users:
                    raise ValueError(f"the dataset {self.data_root} does not match the export's users and items")
                self._train_items = train
            return self._train_items

    def fold_in_vector(self, item_ids: Iterable[int]) -> np.ndarray:
        """User vector of a user known only by the items ``item_ids``: mean of their history rows, float32[d]."""
        if self.history_vectors is None:
            raise ValueError(
                "this export has no history table (the model was trained without the history tower), so a user "
                "given as a list of items cannot be folded in; recommend for a known user id instead"
            )
        items = self._check_items(item_ids)
        if len(items) == 0:
            raise ValueError("fold-in needs at least one item id")
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
        items = self._check_items(item_ids)
        excluded = self._check_items([] if exclude_item_ids is None else exclude_item_ids)
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
        from bigrank.export.index import search

        k = _as_int(k, "k")
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        excluded = np.unique(self._check_items([] if exclude_item_ids is None else exclude_item_ids))
        want = min(self.num_items, k + len(excluded))
        query = np.asarray(vector, dtype=np.float32).reshape(1, -1)
        while True:
            with self._lock:
                scores, ids = search(self.index, query, want)
            keep = (ids[0] >= 0) & ~np.isin(ids[0], excluded)
            chosen_ids, chosen_scores = ids[0][keep][:k], scores[0][keep][:k]
            # Approximate indexes may return fewer hits than asked: widen the search until k are found.
            if len(chosen_ids) >= k or want >= self.num_items:
                break
            want = min(self.num_items, 2 * want)
        return [self._describe(int(item), float(score)) for item, score in zip(chosen_ids, chosen_scores, strict=True)]

    def _describe(self, item: int, score: float) -> dict:
        row = {"item_id": item, "score": score}
        if self.item_original_ids is not None:
            row["original_id"] = int(self.item_original_ids[item])
        if self.item_titles is not None and self.item_titles[item] is not None:
            row["title"] = str(self.item_titles[item])
        return row

    def _check_items(self, item_ids: Iterable[int]) -> np.ndarray:
        if isinstance(item_ids, np.ndarray) and item_ids.dtype.kind in "iu":
            items = item_ids.astype(np.int64).reshape(-1)
        else:
            items = np.asarray([_as_int(i, "item id") for i in item_ids], dtype=np.int64)
        bad = items[(items < 0) | (items >= self.num_items)]
        if len(bad):
            raise ValueError(f"item ids {bad[:5].tolist()} are outside [0, {self.num_items})")
        return items


def _as_int(value, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        try:
            if isinstance(value, str):
                return int(value.strip())
            if float(value) == int(value):
                return int(value)
        except (TypeError, ValueError):
            pass
        raise ValueError(f"{what} must be an integer, got {value!r}")
    return int(value)


def _dense_id(original_ids: np.ndarray | None, original_id: int, what: str) -> int:
    if original_ids is None:
        raise ValueError(f"this export has no original {what} ids (the dataset was synthetic); use dense ids")
    matches = np.flatnonzero(original_ids == _as_int(original_id, f"original {what} id"))
    if len(matches) == 0:
        raise ValueError(f"original {what} id {original_id} is not in the export")
    return int(matches[0])
