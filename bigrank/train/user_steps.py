"""The towers' user-major step (``train.batching: users``): a step takes ``train.batch_size`` users, scores the
catalog once per user and takes the loss of every one of the user's train items against that score vector
(``bigrank.losses.shared``).

One step on rank r of W (global batch of B users, each rank's slice of ``UserBatches``)::

    users           = the rank's slice of the step's users                  UserBatches: any worker count, resume
    P_u             = train items of each user                             the split's per-user index (CSR)
    u_local         = tower(users)           [b, d]                         history bag: split_bags (below)
    U, counts       = all_gather_rows_with_ids(u_local, |P_u|)              one all-gather (backward: reduce-scatter)
    items           = all-gather of the ranks' P_u, padded to the longest  int64
    loss            = L_shared(U @ V_r^T, CSR(counts, items); group) / R    R: the step's (user, item) rows

The loss is the mean over the step's R rows, as a row-wise step's is over its B rows, so an epoch's objective is
the row-wise one: every train row once. The user L2 term weighs each user by its rows (``user_l2_penalty``'s
frequency weighting), as a row-wise epoch does.

The history tower: a row-wise step leaves the row's own item out of the user's bag. Keeping that exactly here
would give every positive its own user vector, hence its own n scores: the row-wise cost. Pooling the whole bag
puts each target in the bag that predicts it, and the model learns to score the bag's own items: on ML-1M's
validation split its AP@10 peaked at 0.092 after 5 epochs and fell to 0.067 by epoch 20. So a users step splits
each user's train items (``split_bags``): every item leaves the bag with probability ``model.history_dropout``
(required > 0), and the items that left are the step's targets. No target is in its own bag, as row-wise, and
each train item is a target in a ``history_dropout`` share of the epochs.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from bigrank.config import Config
from bigrank.data.manifest import DatasetManifest
from bigrank.distributed.collectives import all_gather_equal, all_gather_rows_with_ids
from bigrank.errors import ConfigError
from bigrank.train.kind import STOP_BIT

__all__ = [
    "SHARED_LOSSES",
    "check_user_batching",
    "csr_rows",
    "gather_lists",
    "gather_users",
    "shared_loss_fn",
    "split_bags",
    "split_items",
    "train_items",
]

SHARED_LOSSES = ("rankmax", "softmax")


def check_user_batching(config: Config) -> None:
    """Refuse a ``train.batching: users`` run whose loss cannot share one score vector per user (ConfigError
    naming the setting): rankmax with k = 1 and no per-row k, and softmax, can; the others stay row-wise."""
    if config.train.batching != "users":
        return
    loss = config.loss
    why = None
    if loss.name not in SHARED_LOSSES:
        why = (
            f"loss {loss.name!r} is taken row by row: users batching takes rankmax (k = 1) or softmax "
            "(sparsemax's threshold would share too but is not built; the soft-rank and sampled losses read "
            "each row's own candidates)"
        )
    elif loss.name == "rankmax" and (loss.params.get("k", 1) != 1 or loss.params.get("k_fraction", 0.0)):
        why = "rankmax with k > 1 (or loss.params.k_fraction) is taken row by row: its threshold reads each row's top k"
    if why is not None:
        raise ConfigError(f"train.batching: users: {why}; use train.batching: rows")
    if config.model.history and not config.model.history_dropout > 0:
        raise ConfigError(
            "train.batching: users with model.history needs model.history_dropout > 0: a users step's targets are "
            "the train items the dropout leaves out of the bag (a bag that holds its own targets overfits)"
        )
    if config.train.kernel == "fused":
        raise ConfigError(
            "train.kernel: fused has no user-major kernel (train.batching: users): use train.kernel auto or chunked"
        )


def shared_loss_fn(config: Config) -> Callable[..., torch.Tensor]:
    """``fn(scores, indptr, items, *, group, offset) -> summed loss`` of the configured loss, user-major."""
    from bigrank.losses.shared import rankmax_shared_catalog_loss, softmax_shared_catalog_loss

    params = config.loss.params
    if config.loss.name == "rankmax":
        margin = float(params.get("margin", 1.0))

        def rankmax(scores, indptr, items, *, group, offset):
            return rankmax_shared_catalog_loss(scores, indptr, items, margin, "sum", group=group, offset=offset)

        return rankmax
    temperature = float(params.get("temperature", 1.0))

    def softmax(scores, indptr, items, *, group, offset):
        return softmax_shared_catalog_loss(
            scores, indptr, items, "sum", temperature=temperature, group=group, offset=offset
        )

    return softmax


def train_items(manifest: DatasetManifest, history=None) -> tuple[np.ndarray, Callable[[np.ndarray], tuple]]:
    """``(users, read)``: the ids of the users with a train item (int64, ascending) and ``read(users int64[b]) ->
    (indptr int64[b + 1], items int64)``, the train items of ``users`` (any order). From the in-memory history
    CSR when the model holds one, else as :func:`split_items` reads them."""
    if history is None:
        return split_items(manifest, "train")
    indptr, items = history
    return np.flatnonzero(np.diff(indptr)).astype(np.int64), lambda users: csr_rows(indptr, items, users)


def split_items(manifest: DatasetManifest, split: str) -> tuple[np.ndarray, Callable[[np.ndarray], tuple]]:
    """``(users, read)`` of ``split`` as :func:`train_items` gives train's: from the split's per-user index (built on
    first use), or from the split's files when the dataset's directory cannot hold it."""
    from bigrank.data.user_index import ensure_index

    index = ensure_index(manifest, split)
    if index is not None:
        return index.users_with_items(), _sorted_reader(index.items_of)
    from bigrank.data.stream import read_user_items

    indptr, items = read_user_items(manifest, split, manifest.num_users)
    return np.flatnonzero(np.diff(indptr)).astype(np.int64), lambda users: csr_rows(indptr, items, users)


def csr_rows(indptr: np.ndarray, items: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Rows ``rows`` (any order, repeats allowed) of the CSR ``(indptr, items)``, as a CSR ``(indptr
    int64[len(rows) + 1], items int64)`` in that order, without a Python loop over the rows."""
    starts = indptr[rows].astype(np.int64)
    counts = indptr[np.asarray(rows) + 1].astype(np.int64) - starts
    out = np.zeros(len(counts) + 1, dtype=np.int64)
    np.cumsum(counts, out=out[1:])
    take = np.repeat(starts - out[:-1], counts) + np.arange(out[-1])
    return out, items[take].astype(np.int64)


def _sorted_reader(items_of) -> Callable[[np.ndarray], tuple]:
    """``items_of`` (which takes ascending users) for users in any order."""

    def read(users: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        order = np.argsort(users, kind="stable")
        indptr, items = items_of(users[order])
        back = np.empty_like(order)
        back[order] = np.arange(len(order))
        return csr_rows(indptr, items, back)

    return read


def split_bags(
    indptr: np.ndarray, items: np.ndarray, dropout: float, rng: np.random.Generator, sample_size: int | None = None
) -> tuple[tuple[torch.Tensor, torch.Tensor], np.ndarray, np.ndarray]:
    """A user-major step's history bags and targets from each user's train items (CSR ``indptr``, ``items``):
    every item leaves its user's bag with probability ``dropout`` (``model.history_dropout``), and the items
    that left are the user's targets, so that no target is in the bag that predicts it (the row-wise step's
    exclusion, for all of a user's rows at once). A bag longer than ``sample_size`` keeps a uniform random subset.

    Returns ``((bag values int64, bag lengths int64[b]), target indptr int64[b + 1], target items int64)``.
    """
    users = len(indptr) - 1
    row = np.repeat(np.arange(users), np.diff(indptr))
    target = rng.random(len(items)) < dropout
    kept_rows, kept = row[~target], items[~target]
    if sample_size is not None:
        keys = rng.random(len(kept))
        order = np.lexsort((keys, kept_rows))  # by user, then at random
        rank = np.arange(len(order)) - np.searchsorted(kept_rows[order], kept_rows[order])
        keep = np.sort(order[rank < sample_size])
        kept_rows, kept = kept_rows[keep], kept[keep]
    lengths = np.bincount(kept_rows, minlength=users)
    target_indptr = np.zeros(users + 1, dtype=np.int64)
    np.cumsum(np.bincount(row[target], minlength=users), out=target_indptr[1:])
    bags = (torch.from_numpy(kept.astype(np.int64)), torch.from_numpy(lengths.astype(np.int64)))
    return bags, target_indptr, items[target].astype(np.int64)


def gather_users(
    local_vectors: torch.Tensor,
    indptr: np.ndarray,
    items: np.ndarray,
    pad_to: int,
    group,
    stop_requested: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, bool]:
    """The step's users from every rank: ``(vectors float[U, d], indptr int64[U + 1], items int64[R], stopping)``
    in rank order (collective; each rank's b <= ``pad_to`` users padded to it). The vectors' backward
    reduce-scatters to their ranks; the items travel in a second all-gather, padded to the longest rank's."""
    device = local_vectors.device
    counts = torch.from_numpy(np.diff(indptr)).to(device=device, dtype=torch.int64)
    if stop_requested:
        counts = counts | STOP_BIT
    vectors, gathered = all_gather_rows_with_ids(local_vectors, counts, pad_to, group)
    stopping = bool((gathered >= STOP_BIT).any())
    gathered = torch.where(gathered >= STOP_BIT, gathered - STOP_BIT, gathered)
    valid = gathered >= 0
    per_rank = gathered.clamp_min(0).view(-1, pad_to).sum(dim=1)
    longest = max(int(per_rank.max()), 1)
    mine = torch.full((longest,), -1, dtype=torch.int64)
    mine[: len(items)] = torch.from_numpy(np.asarray(items, dtype=np.int64))
    every = all_gather_equal(mine.to(device), group).view(-1, longest)
    keep = torch.arange(longest, device=device).unsqueeze(0) < per_rank.unsqueeze(1)
    lengths = gathered[valid]
    global_indptr = torch.zeros(lengths.numel() + 1, dtype=torch.int64, device=device)
    torch.cumsum(lengths, 0, out=global_indptr[1:])
    return vectors[valid], global_indptr, every[keep], stopping


def gather_lists(
    lists: list[tuple[np.ndarray, np.ndarray]], pad_to: int, group, stop_requested: bool, device=None
) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], bool]:
    """The step's users' item lists from every rank, in rank order: ``lists`` holds L CSRs ``(indptr int64[b + 1],
    items int64)`` of this rank's b <= ``pad_to`` users (e.g. their bags and their targets); returns the L CSRs of
    the global batch's users as int64 tensors on ``device``, and whether any rank asked to stop (its counts carry
    ``STOP_BIT``). Collective: two all-gathers without autograd (the counts, then the items padded to the longest
    rank's)."""
    device = torch.device("cpu") if device is None else device
    users = len(lists[0][0]) - 1
    counts = torch.full((pad_to, len(lists)), -1, dtype=torch.int64)
    for column, (indptr, _) in enumerate(lists):
        counts[:users, column] = torch.from_numpy(np.diff(indptr).astype(np.int64))
    if stop_requested:
        counts[:users] |= STOP_BIT
    gathered = all_gather_equal(counts.to(device), group)
    stopping = bool((gathered >= STOP_BIT).any())
    gathered = torch.where(gathered >= STOP_BIT, gathered - STOP_BIT, gathered)
    valid = gathered[:, 0] >= 0
    sizes = gathered.clamp_min(0).view(-1, pad_to, len(lists)).sum(dim=1)  # [W, L]: each rank's items per list
    longest = max(int(sizes.sum(dim=1).max()), 1)
    mine = torch.full((longest,), -1, dtype=torch.int64)
    local = np.concatenate([np.asarray(items, dtype=np.int64) for _, items in lists])
    mine[: len(local)] = torch.from_numpy(local)
    every = all_gather_equal(mine.to(device), group).view(-1, longest)
    out = []
    for column in range(len(lists)):
        before = sizes[:, :column].sum(dim=1, keepdim=True)  # where this list starts in each rank's items
        position = torch.arange(longest, device=every.device).unsqueeze(0)
        keep = (position >= before) & (position < before + sizes[:, column : column + 1])
        lengths = gathered[valid, column]
        indptr = torch.zeros(lengths.numel() + 1, dtype=torch.int64, device=every.device)
        torch.cumsum(lengths, 0, out=indptr[1:])
        out.append((indptr, every[keep]))
    return out, stopping
