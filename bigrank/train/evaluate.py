"""Full-catalog evaluation over the item-parallel catalog: Recall@K, NDCG@K, AP@K and Accuracy (Rankmax paper, §4).

For each evaluated user, every item of the catalog is scored, the user's items of ``exclude_splits`` (by default
the dataset's rule, ``DatasetManifest.excluded_splits``: the train items, and the valid items too when test is
evaluated on a given split) are left out, each rank finds the exact top ``max(ks)`` of its own rows (``exact_topk``: by
default scored in bf16 and certified, the same answer as fp32; ``certified_bf16=False`` scores in fp32), the
ranks' lists are merged (``merge_topk``: only per-row top-K values and ids are exchanged, never the B x n
scores), and the list is compared with the user's items of the held-out ``split`` (definitions and AP@K
normalisation in ``bigrank.train.metrics``).

Every rank runs the same user batches: the users to evaluate are derived from the dataset files alone (identical
on all ranks), so the collective ``user_vectors_fn`` (e.g. a row-wise sharded torchrec tower) and the top-K
all-gathers stay in lock-step. The metrics are computed from the replicated top-K lists, so the result is
replicated too.

Reading: the dataset's files are read once per group, not once per rank. Each rank reads a share of the row groups
(``iter_row_groups(..., share=(rank, W))``) and the ranks combine what they found: the users with a held-out item
by an all-reduce, the held-out items of the evaluated users by an all-to-all to every rank, their excluded items
by an all-to-all to the rank whose catalog rows hold them. At ML-1B (10K sampled users, 2 workers) this read was
~40 % of each worker's time in ``bigrank evaluate`` when every rank read every file (py-spy, 2026-11-26); what is
left of it is decoding the Parquet pages (the files are in block order, so every row group holds some users of any
sample). A rank that fails to read makes every rank raise. When every rank finds a per-user index of each split
it needs (``bigrank.data.user_index``, which ``bigrank evaluate`` builds once per dataset), each rank reads the
users' slices of it instead and nothing is exchanged: 10K ML-1B users' items in ~0.4 s instead of 12-18 s.

Memory: the held-out and excluded items are streamed row group by row group and only those of the evaluated users
are kept (for exclusion, only the items of this rank's shard, once exchanged), so sampling users bounds the
memory; the scores of one batch are capped at the bytes of ``max_score_elements`` fp32 scores (a batch's
``[b, n_local]`` block in bf16, or fp32 in two halves).

A trainer that evaluates repeatedly builds each split's :class:`EvaluationData` (users, relevant and excluded
items) once with :func:`evaluation_data` and passes it to every :func:`evaluate_model` call: the dataset files are
then read once per run, not once per evaluation.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from bigrank.data import manifest as layout
from bigrank.data.stream import iter_row_groups
from bigrank.data.user_index import UserItemsIndex, open_index
from bigrank.devices import use_certified_bf16
from bigrank.distributed.collectives import (
    all_gather_equal,
    all_reduce_no_grad,
    all_to_all_no_grad,
    group_rank,
    group_size,
    is_distributed,
)
from bigrank.distributed.groups import collective_device
from bigrank.errors import CorruptFileError
from bigrank.model.catalog import CatalogShard
from bigrank.model.topk import TopKCatalog, TopKStats, exact_topk, merge_topk
from bigrank.train.metrics import combine, metric_names, ranking_metrics

__all__ = [
    "EVAL_NAME",
    "EvaluationData",
    "evaluate_model",
    "evaluation_data",
    "evaluation_users",
    "format_eval_table",
    "ranked_batches",
    "write_eval_json",
]

from bigrank.records import EVAL as EVAL_NAME  # noqa: E402 - re-exported
from bigrank.records import write_eval_json  # noqa: E402 - re-exported

DEFAULT_KS = (10, 100, 1000)
# What the readers below take: the dataset's manifest (read once by the caller), or its directory (read here).
Dataset = layout.DatasetManifest | str | Path
MAX_SCORE_ELEMENTS = 1 << 25  # 128 MiB of scores per batch and rank: 2^25 in fp32, a batch of 2^26 in bf16
_MESSAGE_BYTES = 1024  # of a rank's read error, as the other ranks quote it


def evaluation_users(dataset: Dataset, split: str, sample_users: int | None = None, seed: int = 0) -> np.ndarray:
    """Sorted int64 ids of the users with at least one item in ``split`` of ``dataset`` (a ``DatasetManifest`` or
    its directory), or a uniform sample of ``sample_users`` of them drawn with ``numpy.random.default_rng(seed)``
    (deterministic: the same on every rank and run)."""
    dataset = layout.as_manifest(dataset)
    dataset.split(split)
    return _sample(_users_with_items(dataset, split), sample_users, seed)


def _users_with_items(dataset: layout.DatasetManifest, split: str, group=None) -> np.ndarray:
    """Sorted int64 ids of the users with an item in ``split``; with ``group``, collective: each rank reads its
    share of the row groups and the ranks combine what they saw (one read of every file per group)."""
    num_users = dataset.num_users

    def read(share) -> np.ndarray:
        seen = np.zeros(num_users, dtype=bool)
        for group_ in iter_row_groups(dataset, split, columns=("user_id",), share=share):
            _check_ids(group_["user_id"], num_users, "user_id", dataset.root, split)
            seen[group_["user_id"]] = True
        return seen

    seen = _read_shared(read, group, f"split {split!r} of {dataset.root}")
    if is_distributed(group):  # a count of the ranks that saw the user (int32: no overflow at any group size)
        device = collective_device(group)
        seen = all_reduce_no_grad(torch.from_numpy(seen.view(np.uint8)).to(device, torch.int32), group).cpu().numpy()
    return np.flatnonzero(seen).astype(np.int64)


def _check_ids(ids: np.ndarray, bound: int, column: str, data_root, split: str) -> None:
    if len(ids) and (int(ids.min()) < 0 or int(ids.max()) >= bound):
        raise ValueError(f"split {split!r} of {data_root} has {column} values outside [0, {bound}) (manifest)")


def _sample(users: np.ndarray, sample_users: int | None, seed: int) -> np.ndarray:
    if sample_users is None:
        return users
    if int(sample_users) < 1:
        raise ValueError(f"sample_users must be a positive number of users, got {sample_users}")
    if sample_users >= len(users):
        return users
    return np.sort(np.random.default_rng(seed).choice(users, size=int(sample_users), replace=False))


def _items_of_users(
    dataset: layout.DatasetManifest, splits: Sequence[str], users: np.ndarray, item_range=None, group=None
) -> tuple[np.ndarray, np.ndarray]:
    """CSR ``(indptr int64[len(users) + 1], items int64)`` of the items of ``users`` (row i = ``users[i]``) in
    ``splits``, restricted to ``item_range = (start, stop)`` when given; items sorted and distinct per row.

    With ``group`` (collective; the same ``users`` on every rank, each rank its own ``item_range``), each rank
    reads its share of the row groups and the pairs found are sent to the ranks that keep them (all of them
    without ``item_range``): every file is read once per group instead of once per rank, and a rank never holds
    more pairs than it keeps (memory as without ``group``)."""
    num_users, num_items, data_root = dataset.num_users, dataset.num_items, dataset.root
    # Few users of many (a sample) is the common case: test membership with a byte per user (cache-resident)
    # and look up the row of the matches only.
    selected = np.zeros(num_users, dtype=bool)
    selected[users] = True
    position = np.zeros(num_users, dtype=np.int64)
    position[users] = np.arange(len(users), dtype=np.int64)
    distributed = is_distributed(group)

    def read(share) -> np.ndarray:
        keys = []
        for split in splits:
            for group_ in iter_row_groups(dataset, split, share=share):
                user_ids, item_ids = group_["user_id"], group_["item_id"]
                _check_ids(user_ids, num_users, "user_id", data_root, split)
                _check_ids(item_ids, num_items, "item_id", data_root, split)
                hits = np.flatnonzero(selected[user_ids])
                items = item_ids[hits].astype(np.int64)
                rows = position[user_ids[hits]]
                if item_range is not None and not distributed:  # distributed: the receiving rank filters
                    keep = (items >= item_range[0]) & (items < item_range[1])
                    rows, items = rows[keep], items[keep]
                keys.append(rows * num_items + items)
        return np.concatenate(keys) if keys else np.empty(0, dtype=np.int64)

    keys = _read_shared(read, group, f"splits {list(splits)} of {data_root}")
    if distributed:
        keys = _exchange_keys(keys, num_items, item_range, group)
    return _rows_of_keys(keys, len(users), num_items)


def _rows_of_keys(keys: np.ndarray, num_rows: int, num_items: int) -> tuple[np.ndarray, np.ndarray]:
    """CSR ``(indptr int64[num_rows + 1], items int64)`` of the pair keys ``row * num_items + item`` (any order,
    repeats allowed): items sorted and distinct per row."""
    keys = _sorted_distinct(keys)
    rows = keys // num_items
    indptr = np.zeros(num_rows + 1, dtype=np.int64)
    np.cumsum(np.bincount(rows, minlength=num_rows), out=indptr[1:])
    return indptr, keys - rows * num_items


def _open_indexes(dataset: layout.DatasetManifest, splits: Sequence[str], group) -> dict | None:
    """``{split: UserItemsIndex}`` when each of ``splits`` has a usable index on every rank of ``group`` (then
    collective: the ranks must all take the same path), else None."""
    indexes: dict[str, UserItemsIndex] | None = {}
    try:
        for name in dict.fromkeys(splits):
            indexes[name] = open_index(dataset, name)
            if indexes[name] is None:
                indexes = None
                break
    except (CorruptFileError, OSError) as error:  # OSError: a split file is missing; the read below names it
        if isinstance(error, CorruptFileError):
            print(f"{error}; reading the split files instead", file=sys.stderr, flush=True)
        indexes = None
    if is_distributed(group):
        usable = torch.tensor([int(indexes is not None)], dtype=torch.int32, device=collective_device(group))
        if int(all_gather_equal(usable, group).min()) == 0:
            indexes = None
    return indexes


def _union_rows(
    parts: Sequence[tuple[np.ndarray, np.ndarray]], num_rows: int, num_items: int
) -> tuple[np.ndarray, np.ndarray]:
    """The row-wise union of CSR arrays over the same ``num_rows`` rows (items sorted and distinct per row); one
    part as is, none as empty rows."""
    if len(parts) == 1:
        return parts[0]
    rows = [np.repeat(np.arange(num_rows, dtype=np.int64), np.diff(indptr)) for indptr, _ in parts]
    keys = [row * num_items + items for row, (_, items) in zip(rows, parts, strict=True)]
    return _rows_of_keys(np.concatenate(keys or [np.empty(0, dtype=np.int64)]), num_rows, num_items)


def _sorted_distinct(values: np.ndarray) -> np.ndarray:
    """``np.unique(values)`` for int64 by a sort and a neighbour test: numpy 2.4's ``unique`` hashes first and was
    ~20x slower than ``np.sort`` on the millions of pair keys here (measured 1.9 s vs 0.1 s for 1.8M keys)."""
    values = np.sort(values)
    if len(values) < 2:
        return values
    keep = np.empty(len(values), dtype=bool)
    keep[0] = True
    np.not_equal(values[1:], values[:-1], out=keep[1:])
    return values[keep]


def _read_shared(read: Callable, group, what: str):
    """``read(share)`` over this rank's share ``(rank, world size)`` of the row groups (``read(None)``: all of
    them, without a distributed ``group``). Collective: when any rank fails to read, every rank raises (the
    others a ValueError quoting its error) instead of leaving them waiting in the next collective."""
    if not is_distributed(group):
        return read(None)
    try:
        result, failure = read((group_rank(group), group_size(group))), None
    except Exception as error:  # re-raised below, once every rank knows
        result, failure = None, error
    # Every rank's status as a fixed-size message (empty: read): one small all-gather, no size exchange.
    text = b"" if failure is None else f"{type(failure).__name__}: {failure}".encode()[:_MESSAGE_BYTES]
    status = torch.frombuffer(bytearray(text.ljust(_MESSAGE_BYTES)), dtype=torch.uint8)
    messages = all_gather_equal(status.to(collective_device(group)), group).cpu().view(group_size(group), -1)
    failed = [bytes(row.numpy()).decode(errors="replace").strip() for row in messages]
    if failure is not None:
        raise failure
    for rank, message in enumerate(failed):
        if message:
            raise ValueError(f"rank {rank} could not read {what}: {message}")
    return result


def _exchange_keys(keys: np.ndarray, num_items: int, item_range, group) -> np.ndarray:
    """Send each rank the pair keys ``row * num_items + item`` whose item lies in its ``item_range`` (None: all
    of them) and return the keys this rank received from every rank (collective, all-to-all)."""
    world = group_size(group)
    device = collective_device(group)
    low, high = (0, num_items) if item_range is None else (int(item_range[0]), int(item_range[1]))
    ranges = all_gather_equal(torch.tensor([low, high], dtype=torch.int64, device=device), group).cpu()
    ranges = ranges.view(world, 2).tolist()
    items = keys % num_items
    parts = [keys[(items >= a) & (items < b)] for a, b in ranges]
    counts = torch.tensor([len(part) for part in parts], dtype=torch.int64, device=device)
    matrix = all_gather_equal(counts, group).cpu().view(world, world)  # [sender, receiver]
    rank = group_rank(group)
    received = all_to_all_no_grad(
        torch.from_numpy(np.concatenate(parts)).to(device),
        input_sizes=matrix[rank].tolist(),
        output_sizes=matrix[:, rank].tolist(),
        group=group,
    )
    return received.cpu().numpy()


@dataclass(frozen=True)
class EvaluationData:
    """What the evaluation of one split needs from the dataset, read once (:func:`evaluation_data`).

    ``users`` int64[u] sorted (all users with an item in ``split``, or a sample of them); ``relevant`` the CSR
    ``(indptr int64[u + 1], items int64)`` of their items in ``split``; ``excluded`` the CSR of their items in
    ``exclude_splits`` restricted to the catalog rows ``item_range`` of this rank.
    """

    split: str
    users: np.ndarray
    candidate_users: int
    relevant: tuple[np.ndarray, np.ndarray]
    excluded: tuple[np.ndarray, np.ndarray]
    item_range: tuple[int, int]
    exclude_splits: tuple[str, ...]


def evaluation_data(
    dataset: Dataset,
    split: str,
    item_range: tuple[int, int],
    *,
    sample_users: int | None = None,
    seed: int = 0,
    exclude_splits: Sequence[str] | None = None,
    group: dist.ProcessGroup | None = None,
    use_index: bool = True,
) -> EvaluationData:
    """Read what evaluating ``split`` of ``dataset`` (a ``DatasetManifest`` or its directory) needs (one pass over
    ``split``'s files for the users, one for their items, one over ``exclude_splits``), for this rank's catalog
    rows ``item_range = (start, stop)``.

    ``group``: the ranks the catalog is split over; then collective (every rank calls it with the same arguments
    but its own ``item_range``): each rank reads a share of the row groups and the ranks exchange what they
    found, so each file is read once per group, not once per rank. The result is the same as without ``group``.

    ``exclude_splits``: the splits whose items of a user are never recommended (None: the dataset's rule,
    ``DatasetManifest.excluded_splits``).

    ``use_index``: when every split needed has a user index matching its files (``bigrank.data.user_index``,
    built by ``bigrank evaluate``) on every rank, the items are read as slices of them instead of a decode of
    the splits' files (the same result); a damaged index is reported on stderr and the files are read instead.
    """
    dataset = layout.as_manifest(dataset)
    if exclude_splits is None:
        exclude_splits = dataset.excluded_splits(split)
    for name in (split, *exclude_splits):
        dataset.split(name)  # a missing split is named before any file is read
    indexes = _open_indexes(dataset, [split, *exclude_splits], group) if use_index else None
    if indexes is not None:  # each rank reads the users' slices itself: nothing to exchange
        candidates = indexes[split].users_with_items()
    else:
        candidates = _users_with_items(dataset, split, group)
    users = _sample(candidates, sample_users, seed)
    if len(users) == 0:
        raise ValueError(f"split {split!r} of {dataset.root} has no users to evaluate")
    if indexes is not None:
        relevant = indexes[split].items_of(users)
        parts = [indexes[name].items_of(users, tuple(item_range)) for name in exclude_splits]
        excluded = _union_rows(parts, len(users), dataset.num_items)
    else:
        relevant = _items_of_users(dataset, [split], users, group=group)
        excluded = _items_of_users(dataset, list(exclude_splits), users, item_range=tuple(item_range), group=group)
    return EvaluationData(
        split,
        users,
        len(candidates),
        relevant,
        excluded,
        (int(item_range[0]), int(item_range[1])),
        tuple(exclude_splits),
    )


def evaluate_model(
    user_vectors_fn: Callable[[torch.Tensor], torch.Tensor],
    shard: CatalogShard,
    dataset: Dataset,
    split: str,
    ks: Sequence[int] = DEFAULT_KS,
    *,
    group: dist.ProcessGroup | None = None,
    sample_users: int | None = None,
    seed: int = 0,
    batch_size: int = 1024,
    exclude_splits: Sequence[str] | None = None,
    max_score_elements: int = MAX_SCORE_ELEMENTS,
    data: EvaluationData | None = None,
    certified_bf16: bool = True,
    stats: TopKStats | None = None,
) -> dict:
    """Recall@K, NDCG@K, AP@K and Accuracy of ranking the full catalog for the users of ``split``; collective.

    Call it on every rank of ``group`` with the same arguments.

    Args:
        user_vectors_fn: ``user_ids int64[b] -> float[b, d]``; called on every rank with the same ``b`` (and the
            same ids), so it may run collectives (a sharded tower). Runs under ``torch.no_grad``.
        shard: this rank's rows ``[start, stop)`` of the item matrix (``weight [n_local, d]``).
        dataset: the dataset's ``DatasetManifest`` (read once by the caller), or its directory.
        split: held-out split whose items are the relevant ones (``"valid"`` or ``"test"``).
        ks: cut-offs K (any K >= 1) of Recall@K, NDCG@K and AP@K; the top ``max(ks)`` items are ranked.
        group: process group the catalog is split over (None: one process holds all items).
        sample_users: evaluate a deterministic sample (``seed``) of this many users instead of all users with an
            item in ``split``.
        batch_size: users per batch (lowered when ``b x ceil(n / W)`` scores would exceed ``2 x max_score_elements``:
            see :func:`ranked_batches`).
        exclude_splits: splits whose items of the user are never recommended (None: the dataset's rule,
            ``DatasetManifest.excluded_splits``: its train items, and on a given split its valid items too
            when ``split`` is test).
        data: the split's :class:`EvaluationData` built earlier (then ``sample_users``, ``seed`` and
            ``exclude_splits`` are those it was built with, and no dataset file is read).
        certified_bf16: rank with the certified bf16 top-K where the CPU has bf16 units
            (``bigrank.devices.use_certified_bf16``; the same lists as fp32, faster); False: fp32 scores.
        stats: a ``TopKStats`` to add the ranking's figures to (rows certified, fallbacks, rescored candidates).

    Returns ``{"accuracy", "recall@K", "ndcg@K", "ap@K" (for each K), "users", "skipped_users", "split", "num_items",
    "candidate_users", "sampled"}``, the same on every rank: ``users`` counts the users scored,
    ``candidate_users`` the users with an item in ``split``. The splits of a bigrank dataset hold
    distinct (user, item) pairs, so no relevant item is excluded.
    """
    ks = sorted({int(k) for k in ks})
    if not ks or ks[0] < 1:
        raise ValueError(f"ks must be positive cut-offs, got {ks}")
    dataset = layout.as_manifest(dataset)
    if data is None:
        data = evaluation_data(
            dataset,
            split,
            (shard.start, shard.stop),
            sample_users=sample_users,
            seed=seed,
            exclude_splits=exclude_splits,
            group=group,
        )
    elif (data.split, data.item_range) != (split, (shard.start, shard.stop)):
        raise ValueError(
            f"evaluation data of split {data.split!r}, rows {data.item_range} do not fit split {split!r}, "
            f"rows {(shard.start, shard.stop)}"
        )
    users = data.users
    relevant_indptr, relevant_items = data.relevant
    results = []
    batches = ranked_batches(
        user_vectors_fn,
        shard,
        dataset,
        users,
        max(ks),
        group=group,
        batch_size=batch_size,
        exclude_splits=data.exclude_splits,
        max_score_elements=max_score_elements,
        excluded=data.excluded,
        certified_bf16=certified_bf16,
        stats=stats,
    )
    for first, last, top_ids in batches:
        relevant = (
            relevant_indptr[first : last + 1] - relevant_indptr[first],
            relevant_items[relevant_indptr[first] : relevant_indptr[last]],
        )
        results.append(ranking_metrics(top_ids.cpu().numpy(), relevant, ks))
    total = combine(results)
    summary = {name: total[name] for name in metric_names(ks)}
    summary.update(
        users=total["users"],
        skipped_users=total["skipped_users"],
        split=split,
        num_items=shard.num_items,
        candidate_users=data.candidate_users,
        sampled=len(users) < data.candidate_users,
    )
    return summary


def ranked_batches(
    user_vectors_fn: Callable[[torch.Tensor], torch.Tensor],
    shard: CatalogShard,
    dataset: Dataset,
    users: np.ndarray,
    k: int,
    *,
    group: dist.ProcessGroup | None = None,
    batch_size: int = 1024,
    exclude_splits: Sequence[str] = ("train",),
    max_score_elements: int = MAX_SCORE_ELEMENTS,
    excluded: tuple[np.ndarray, np.ndarray] | None = None,
    certified_bf16: bool = True,
    stats: TopKStats | None = None,
) -> Iterator[tuple[int, int, torch.Tensor]]:
    """Rank the full catalog for ``users`` batch by batch; collective (same arguments on every rank).

    Yields ``(first, last, top_ids)``: ``top_ids`` int64[last - first, min(k, n)] holds the global ids of the best
    items of ``users[first:last]``, best first, without the user's items of ``exclude_splits`` (``-1`` pads rows
    with fewer eligible items), replicated on every rank. Scores are ``user_vectors_fn(ids) @ shard.weight.T``
    on the local rows, ranked exactly by ``exact_topk`` (in bf16 and certified, or in fp32 with
    ``certified_bf16=False``: the same lists) and merged over the ranks by ``merge_topk`` (ties: lower id
    first), all under ``no_grad``. The number of users per batch, ``min(batch_size, 2 * max_score_elements //
    ceil(n / W))`` (bf16 scores, or fp32 ones ranked in two halves: ``max_score_elements`` fp32 scores' bytes at
    a time), depends only on figures every rank shares, so all ranks run the same batches, and not on the
    ranking path, so the certified and the fp32 rankings sum the metrics in the same order. ``excluded``:
    the CSR of the users' excluded items within this rank's rows when already read (``EvaluationData.excluded``).
    ``stats``: a ``TopKStats`` that this rank's ranking figures are added to.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be positive, got {batch_size}")
    if k < 1:
        raise ValueError(f"k must be positive, got {k}")
    dataset = layout.as_manifest(dataset)
    num_users, num_items = dataset.num_users, dataset.num_items
    if shard.num_items != num_items:
        raise ValueError(f"the catalog has {shard.num_items} items but dataset {dataset.root} has {num_items}")
    for name in exclude_splits:
        dataset.split(name)
    users = np.asarray(users, dtype=np.int64)
    if len(users) and (users.min() < 0 or users.max() >= num_users):
        raise ValueError(f"user ids must lie in [0, {num_users}) for dataset {dataset.root}")
    if excluded is None:
        excluded = _items_of_users(
            dataset, list(exclude_splits), users, item_range=(shard.start, shard.stop), group=group
        )
    excluded_indptr, excluded_items = excluded
    widest_shard = math.ceil(num_items / group_size(group))
    weight = shard.weight.detach()
    certified = use_certified_bf16(certified_bf16, weight.device)
    # As many users as 2 x max_score_elements scores: the bf16 chunk of exact_topk (the bytes of max_score_elements
    # fp32 scores), which ranks fp32 rows in halves of it. The same batches whichever path ranks them, so the
    # metric sums add up in the same order and certified and fp32 metrics agree to the last bit.
    rows_per_batch = max(1, min(int(batch_size), 2 * int(max_score_elements) // max(widest_shard, 1)))
    catalog = TopKCatalog.build(weight, certified=certified)  # the bf16 copy, made once per call
    with torch.no_grad():
        for first in range(0, len(users), rows_per_batch):
            last = min(first + rows_per_batch, len(users))
            vectors = user_vectors_fn(torch.from_numpy(users[first:last]))
            if vectors.dim() != 2 or tuple(vectors.shape) != (last - first, shard.dim):
                raise ValueError(
                    f"user_vectors_fn returned shape {tuple(vectors.shape)} for {last - first} users; "
                    f"expected ({last - first}, {shard.dim})"
                )
            exclude = _excluded_pairs(excluded_indptr, excluded_items, first, last, shard.start, weight.device)
            values, columns = exact_topk(
                vectors,
                catalog,
                k,
                exclude=exclude,
                certified=certified,
                chunk_elements=max_score_elements,
                stats=stats,
            )
            _, top_ids = merge_topk(values, columns, k, offset=shard.start, num_local=shard.num_local, group=group)
            yield first, last, top_ids


def _excluded_pairs(indptr, items, first: int, last: int, offset: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, local columns ``item - offset``) of the excluded items of users ``first..last-1``: their scores
    become -inf (ids -1 when listed), without a dense ``[b, n_local]`` mask."""
    lo, hi = int(indptr[first]), int(indptr[last])
    rows = np.repeat(np.arange(last - first, dtype=np.int64), np.diff(indptr[first : last + 1]))
    columns = items[lo:hi] - offset
    return torch.from_numpy(rows).to(device), torch.from_numpy(columns).to(device)


def format_eval_table(results_by_split: Mapping[str, Mapping]) -> str:
    """A plain-text table: one row per split, one column per metric (``accuracy, recall@K..., ndcg@K..., ap@K...``)
    + users."""
    splits = list(results_by_split)
    if not splits:
        return "(no evaluation results)"
    keys = [k for k in results_by_split[splits[0]] if k == "accuracy" or "@" in k]
    ks = sorted({int(k.split("@")[1]) for k in keys if "@" in k})
    columns = [name for name in metric_names(ks) if any(name in r for r in results_by_split.values())]
    header = ["split"] + columns + ["users"]
    rows = [header]
    for split in splits:
        result = results_by_split[split]
        cells = [split]
        for name in columns:
            value = result.get(name)
            cells.append("-" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.4f}")
        cells.append(f"{int(result['users']):,}" if result.get("users") is not None else "-")
        rows.append(cells)
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = []
    for row in rows:
        cells = [row[0].ljust(widths[0])] + [cell.rjust(width) for cell, width in zip(row[1:], widths[1:], strict=True)]
        lines.append("  ".join(cells))
    return "\n".join(lines)
