"""The updates of the replicated tables: their gradients summed over the workers in one collective, then the
same optimizer step on every worker, so the replicas stay equal.

A replicated (data-parallel) table gets in backward the gradient of this worker's part of the step's loss;
the sum over workers is the gradient of the whole step (``bigrank.model.layout``). Per step:

* dense gradients (a replicated catalog under a full-catalog loss, the tower's data-parallel tables) are
  copied into one persistent flat buffer and all-reduced together (one collective, no per-step allocation);
* a replicated catalog under a sampled loss sends only the rows it touched: each worker's ``(ids, rows)``,
  padded to the step's bound, in one all-gather; duplicates are summed.

The tower's data-parallel tables are updated by :class:`~bigrank.train.item_optim.RowOptimizer` with the
user optimizer's rule and fbgemm's ``eps`` (1e-8), the update the fused row-wise kernels apply to the rows a
step touched (a row with a zero gradient does not move under sgd/adagrad/rowwise_adagrad, so a dense step
equals the fused sparse one).
"""

from __future__ import annotations

import torch

from bigrank.distributed.collectives import all_gather_no_grad, all_reduce_inplace, group_size, is_distributed
from bigrank.train.item_optim import RowOptimizer

__all__ = ["ReplicaSync", "tower_optimizer"]

_FUSED_EPS = 1e-8  # bigrank.model.sharding.fused_params: the eps of the fused user-table updates


def tower_optimizer(weight: torch.Tensor, user_optimizer: str, user_lr: float) -> RowOptimizer:
    """The dense optimizer of a replicated tower table: ``optim.user_optimizer`` with fbgemm's ``eps``, the
    update its fused row-wise kernels apply (what :class:`ReplicaSync` steps, and what the cost model times)."""
    return RowOptimizer(weight, user_optimizer, user_lr, eps=_FUSED_EPS)


class ReplicaSync:
    """Gradient sum and update of this worker's replicated tables.

    Args:
        model: ``bigrank.train.model.TowersModel`` (its ``layout``, ``shard`` and ``replicated_tower``).
        item_optimizer: the catalog's :class:`RowOptimizer`.
        user_optimizer, user_lr: ``optim.user_optimizer`` / ``optim.user_lr`` for the tower's replicated tables.
        group: the workers' process group.
        full_catalog: the loss scores every item (a dense catalog gradient) rather than sampled candidates.
        max_touched_rows: sampled losses on a replicated catalog: the most rows one worker's step can touch
            (its batch rows' positives plus its negatives), the all-gather's fixed row count.
    """

    def __init__(self, model, item_optimizer: RowOptimizer, user_optimizer: str, user_lr: float, group, *,
                 full_catalog: bool = True, max_touched_rows: int = 0):  # fmt: skip
        self.group = group
        self.catalog = model.shard if model.shard.replicated and is_distributed(group) else None
        self.item_optimizer = item_optimizer
        self.max_touched_rows = int(max_touched_rows)
        self.tower_optimizers = {
            table: tower_optimizer(parameter, user_optimizer, user_lr)
            for table, parameter in model.replicated_tower.items()
        }
        self._flat: torch.Tensor | None = None
        self._summed: list[torch.Tensor] = []
        self._rows = None
        self._catalog_dense = False
        self._sampled = not full_catalog  # touched rows, all-gathered, instead of a dense catalog gradient
        # A row-wise sharded tower table is updated inside backward (fbgemm's fused optimizer).
        self._fused_tower = any(
            model.layout.get(table) == "sharded" for table in ("user_table", "history_table") if table in model.layout
        )

    def set_user_lr(self, lr: float) -> None:
        for optimizer in self.tower_optimizers.values():
            optimizer.lr = float(lr)

    def zero_grad(self) -> None:
        for optimizer in self.tower_optimizers.values():
            optimizer.weight.grad = None

    @property
    def folds_loss(self) -> bool:
        """Whether the step's loss sum and row count can travel in the gradient all-reduce: the catalog is
        replicated under a full-catalog loss (a dense buffer exists) and no tower table is updated inside
        backward (a fused, row-wise sharded table would need the global row count before backward)."""
        return self.catalog is not None and not self._sampled and not self._fused_tower

    @torch.no_grad()
    def reduce(self, touched=None, stats: torch.Tensor | None = None) -> torch.Tensor | None:
        """After backward: sum the replicated gradients over the workers (one all-reduce of the dense ones,
        ``stats`` float[s] appended; one all-gather of a sampled step's ``touched`` catalog rows). Returns the
        summed ``stats``; :meth:`apply` then updates the tables."""
        dense = [optimizer.weight for optimizer in self.tower_optimizers.values()]
        self._catalog_dense = self.catalog is not None and touched is None
        if self._catalog_dense:
            dense.insert(0, self.catalog.weight)
        grads = [p.grad for p in dense]
        shapes = [p.shape for p in dense]
        if stats is not None:
            grads.append(stats)
            shapes.append(stats.shape)
        like = dense[0] if dense else stats
        self._summed = self._all_reduce(grads, shapes, like)
        summed_stats = self._summed.pop() if stats is not None else None
        self._rows = None
        if self.catalog is not None and touched is not None:
            self._rows = self._all_gather_rows(touched.ids, touched.grad)
        return summed_stats

    @torch.no_grad()
    def apply(self, scale: float = 1.0) -> None:
        """Update every replicated table with its summed gradient times ``scale``."""
        summed = self._summed
        if scale != 1.0:
            for grad in summed:
                grad.mul_(scale)
        if self._catalog_dense:
            self.item_optimizer.step_dense(summed.pop(0))
        for optimizer, grad in zip(self.tower_optimizers.values(), summed, strict=True):
            optimizer.step_dense(grad)
        if self._rows is not None:
            ids, grads = self._rows
            self.item_optimizer.step_rows(ids, grads * scale if scale != 1.0 else grads)

    def step(self, touched=None) -> None:
        """:meth:`reduce` then :meth:`apply`."""
        self.reduce(touched)
        self.apply()

    def _all_reduce(self, grads, shapes, like) -> list[torch.Tensor]:
        """Sum ``grads`` (None: zeros) over the workers in one all-reduce of a persistent flat buffer; returns
        views of the buffer in ``shapes``."""
        if like is None:
            return []
        sizes = [torch.Size(shape).numel() for shape in shapes]
        total = sum(sizes)
        if self._flat is None or self._flat.numel() != total:
            self._flat = torch.zeros(total, dtype=torch.float32, device=like.device)
        views, offset = [], 0
        for grad, shape, size in zip(grads, shapes, sizes, strict=True):
            view = self._flat[offset : offset + size].view(shape)
            if grad is None:
                view.zero_()
            else:
                view.copy_(grad)
            views.append(view)
            offset += size
        all_reduce_inplace(self._flat, self.group)
        return views

    def _all_gather_rows(self, ids: torch.Tensor, grads: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Every worker's touched ``(ids int64[u_r], grads float[u_r, d])`` → the union's unique ids (ascending)
        and summed gradients, the same on every worker."""
        bound = self.max_touched_rows
        if ids.numel() > bound:
            raise RuntimeError(f"a step touched {ids.numel()} catalog rows, more than its bound {bound}")
        dim = grads.shape[1]
        # One float32 buffer per worker: [bound, d + 2], the id's int64 bits in the last two columns.
        packed = grads.new_zeros((bound, dim + 2))
        packed[: ids.numel(), :dim] = grads
        padded_ids = torch.full((bound,), -1, dtype=torch.int64, device=ids.device)
        padded_ids[: ids.numel()] = ids
        packed[:, dim:] = padded_ids.view(torch.float32).view(bound, 2)
        world = group_size(self.group)
        gathered = all_gather_no_grad(packed, self.group, [bound] * world)
        all_ids = gathered[:, dim:].contiguous().view(torch.int64).view(-1)
        keep = all_ids >= 0
        unique, inverse = torch.unique(all_ids[keep], return_inverse=True)
        summed = grads.new_zeros((unique.numel(), dim)).index_add_(0, inverse, gathered[keep, :dim])
        return unique, summed
