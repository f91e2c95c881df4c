"""The user tower: a torchrec user-id table, optionally plus a mean-pooled bag of the user's train items.

The user vector of user ``u`` with train items ``H(u)`` is

    f(u) = E_user[u] + (1 / |H(u)|) * sum_{i in H(u)} E_hist[i]        (second term only with ``history``)

where both tables live in one torchrec ``EmbeddingBagCollection``. A bag per feature is the natural shape for
both terms: the user-id bag holds one id (SUM pooling of one row is the row itself) and the history bag holds
the user's items (MEAN pooling), so one module and one row-wise sharded lookup serve both. A user unseen at
training time gets an empty user-id bag (SUM of nothing is 0) and is folded in by its history alone — the
"fold-in" of implicit-feedback factor models (Hu, Koren & Volinsky 2008, sec. 5).

Initial weights are a pure function of ``(seed, table, global row)`` (``bigrank.model.tables``), the same
whatever the world size.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn

from bigrank.model.sharding import quiet_torchrec
from bigrank.model.tables import (  # noqa: F401 - re-exported: the tower's public names
    HISTORY_FEATURE,
    HISTORY_TABLE,
    INIT_BLOCK_ROWS,
    USER_FEATURE,
    USER_TABLE,
    deterministic_rows,
    local_table_rows,
)


class UserTower(nn.Module):
    """User-id table (+ optional mean-pooled history bag) → user vector float32[B, dim].

    Args:
        num_users: rows of the user-id table (ids ``0 … num_users-1``).
        dim: embedding dimension ``d``.
        num_items: rows of the history table (item ids); required when ``history`` is true.
        history: add the mean-pooled bag of the user's train items (fold-in for unseen users).
        init_std: standard deviation of the initial rows; default ``1/sqrt(dim)`` (unit-norm vectors on
            average, so initial dot products with unit-scale item vectors are O(1)).
        seed: seed of the deterministic, world-size independent initialisation.
        device: ``"meta"`` builds the tables without memory (use before sharding: the sharded module
            allocates only its own rows, then :meth:`reset_parameters` fills them); default CPU.

    ``forward(features)`` takes the ``KeyedJaggedTensor`` of :meth:`features` (one entry per user of the
    local batch) and returns float32[B, dim]. Works unchanged after row-wise sharding with
    :func:`bigrank.model.sharding.shard_row_wise` (the ``tables`` child is replaced by its sharded twin).
    """

    def __init__(
        self,
        num_users: int,
        dim: int,
        *,
        num_items: int | None = None,
        history: bool = False,
        init_std: float | None = None,
        seed: int = 0,
        device: str | torch.device | None = None,
    ) -> None:
        super().__init__()
        with quiet_torchrec():  # the first torchrec import prints fbgemm deprecation notices
            from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, PoolingType

        if num_users < 1:
            raise ValueError(f"num_users must be >= 1, got {num_users}")
        if dim < 1:
            raise ValueError(f"dim must be >= 1, got {dim}")
        if history and (num_items is None or num_items < 1):
            raise ValueError(f"history=True needs num_items >= 1, got num_items={num_items}")
        if init_std is not None and not init_std > 0:
            raise ValueError(f"init_std must be > 0, got {init_std}")
        self.num_users = int(num_users)
        self.dim = int(dim)
        self.num_items = int(num_items) if num_items is not None else None
        self.history = bool(history)
        self.init_std = float(init_std) if init_std is not None else 1.0 / math.sqrt(dim)
        self.seed = int(seed)
        tables = [
            EmbeddingBagConfig(
                name=USER_TABLE,
                embedding_dim=self.dim,
                num_embeddings=self.num_users,
                feature_names=[USER_FEATURE],
                pooling=PoolingType.SUM,
            )
        ]
        if self.history:
            tables.append(
                EmbeddingBagConfig(
                    name=HISTORY_TABLE,
                    embedding_dim=self.dim,
                    num_embeddings=self.num_items,
                    feature_names=[HISTORY_FEATURE],
                    pooling=PoolingType.MEAN,
                )
            )
        device = torch.device(device) if device is not None else torch.device("cpu")
        self.tables = EmbeddingBagCollection(tables=tables, device=device)
        if device.type != "meta":
            self.reset_parameters()

    def table_rows(self) -> dict[str, int]:
        """Number of rows of each table, by table name."""
        rows = {USER_TABLE: self.num_users}
        if self.history:
            rows[HISTORY_TABLE] = self.num_items
        return rows

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Fill every locally held row with :func:`deterministic_rows` (plain or row-wise sharded tables)."""
        rows = self.table_rows()
        for table, num_rows in rows.items():
            row_start, row_stop, weight = local_table_rows(self, table)
            rows_here = deterministic_rows(self.seed, table, num_rows, self.dim, row_start, row_stop, self.init_std)
            weight.copy_(rows_here)  # drawn on the CPU, copied to the table's device (CUDA after sharding)

    def features(
        self,
        user_ids: torch.Tensor,
        history: Sequence[Sequence[int] | torch.Tensor] | tuple[torch.Tensor, torch.Tensor] | None = None,
        *,
        pad_to: int | None = None,
        device: torch.device | str | None = None,
    ):
        """Validated input of :meth:`forward` for one local batch; see :func:`user_features`.

        The ids are checked on the CPU (where the data stream delivers them); ``device`` (the tables' device,
        e.g. ``cuda:0``) is where the returned ``KeyedJaggedTensor`` goes (non-blocking copy from the CPU).

        Raises ValueError when a user id is ``>= num_users``, a history item is outside
        ``[0, num_items)``, or history is given/missing against the tower's ``history`` flag.
        """
        user_ids = _as_ids(user_ids, "user_ids")
        if user_ids.numel() and int(user_ids.max()) >= self.num_users:
            raise ValueError(f"user id {int(user_ids.max())} out of range [0, {self.num_users})")
        if self.history and history is None:
            raise ValueError("this tower has a history table: pass history for every user (may be empty)")
        if not self.history and history is not None:
            raise ValueError("history given, but the tower was built with history=False")
        kjt = user_features(user_ids, history, pad_to=pad_to)
        if self.history:
            values = kjt[HISTORY_FEATURE].values()
            if values.numel() and (int(values.min()) < 0 or int(values.max()) >= self.num_items):
                raise ValueError(
                    f"history item ids must lie in [0, {self.num_items}), got "
                    f"[{int(values.min())}, {int(values.max())}]"
                )
        if device is not None and torch.device(device).type != "cpu":
            kjt = kjt.to(torch.device(device), non_blocking=True)
        return kjt

    def forward(self, features) -> torch.Tensor:
        """User vectors float32[B, dim] for the ``KeyedJaggedTensor`` of :meth:`features`.

        Sharded: collective (every rank calls it with the same batch size, see ``pad_to``), and evaluate
        under ``torch.no_grad()``, not ``torch.inference_mode()`` (fbgemm's CPU lookup has no kernel there).
        """
        pooled = self.tables(features)
        if hasattr(pooled, "wait"):  # the sharded collection returns an awaitable KeyedTensor
            pooled = pooled.wait()
        vectors = pooled[USER_FEATURE]
        if self.history:
            vectors = vectors + pooled[HISTORY_FEATURE]
        return vectors


def _as_ids(ids: torch.Tensor, name: str) -> torch.Tensor:
    ids = torch.as_tensor(ids)
    if ids.dim() != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(ids.shape)}")
    if ids.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"{name} must be an integer tensor, got {ids.dtype}")
    return ids.to(torch.int64)


def history_lists_to_jagged(
    lists: Sequence[Sequence[int] | torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(values int64[total], lengths int64[B])`` of a list of per-user item lists."""
    parts = [torch.as_tensor(items, dtype=torch.int64).reshape(-1) for items in lists]
    lengths = torch.tensor([p.numel() for p in parts], dtype=torch.int64)
    values = torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64)
    return values, lengths


def user_features(
    user_ids: torch.Tensor,
    history: Sequence[Sequence[int] | torch.Tensor] | tuple[torch.Tensor, torch.Tensor] | None = None,
    *,
    pad_to: int | None = None,
):
    """``KeyedJaggedTensor`` input of :class:`UserTower` for a local batch of B users.

    Args:
        user_ids: int64[B]; a negative id means "unknown user": its user-id bag is empty (contributes 0),
            so the vector comes from the history bag alone (fold-in at serving time).
        history: optional per-user train items, either a list of B item lists/tensors or a
            ``(values int64[total], lengths int64[B])`` pair (lengths may be 0: the mean of an empty bag is 0).
        pad_to: append empty entries up to this batch size. The row-wise sharded tower needs the same batch
            size on every rank (torchrec's backward all-gathers equal-sized blocks; gloo rejects uneven ones),
            so pad a short last batch and keep the first B output rows: padded rows are 0 and get no update.

    Returns:
        ``KeyedJaggedTensor`` with key ``"user_id"`` (and ``"history"``), stride B (or ``pad_to``).
    """
    from torchrec import KeyedJaggedTensor

    user_ids = _as_ids(user_ids, "user_ids")
    batch = user_ids.numel()
    if pad_to is not None and pad_to < batch:
        raise ValueError(f"pad_to={pad_to} is smaller than the batch of {batch} users")
    padding = 0 if pad_to is None else pad_to - batch
    known = user_ids >= 0
    keys = [USER_FEATURE]
    empty = torch.zeros(padding, dtype=torch.int64)
    values = [user_ids[known]]
    lengths = [known.to(torch.int64), empty]
    if history is not None:
        if isinstance(history, tuple) and len(history) == 2 and isinstance(history[0], torch.Tensor):
            hist_values, hist_lengths = (torch.as_tensor(t, dtype=torch.int64) for t in history)
        else:
            hist_values, hist_lengths = history_lists_to_jagged(history)
        if hist_lengths.shape != user_ids.shape:
            raise ValueError(f"history has {hist_lengths.numel()} bags for {user_ids.numel()} users")
        if int(hist_lengths.sum()) != hist_values.numel():
            raise ValueError(
                f"history lengths sum to {int(hist_lengths.sum())} but there are {hist_values.numel()} values"
            )
        keys.append(HISTORY_FEATURE)
        values.append(hist_values)
        lengths += [hist_lengths, empty]
    return KeyedJaggedTensor.from_lengths_sync(keys=keys, values=torch.cat(values), lengths=torch.cat(lengths))
