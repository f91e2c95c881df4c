"""The catalog shard's optimizer: one class for sparse (touched rows) and dense (every row) updates.

Candidate losses touch ~B + N of the shard's rows a step (sampled negatives plus the batch's positives);
full-catalog losses touch every row. ``RowOptimizer`` serves both with row-aligned state: every state
tensor has the shard's rows as its first dimension (``[n_local, ...]``), plus a scalar step count, so a
checkpoint of it can be split and re-joined by rows like the shard itself (``row_state()`` lists them).

* ``step_rows(ids, grads)``: reads and writes only rows ``ids`` (int64[u], unique, local) of the weight and
  of the state — no allocation proportional to the shard (the cost of a dense gradient plus a dense Adagrad
  over 428K rows was most of a sampled step on ML-1B; see ``benchmarks/bench_train.py``).
* ``step_dense(grad)``: every row, the same arithmetic as ``torch.optim.SGD`` / ``Adagrad`` (single-tensor
  implementations) / ``Adam`` (its fused kernel, ``fused=True``, when every row is at one count: one pass over the
  rows, ~10x the single-tensor ops on a CPU core; else the single-tensor arithmetic) — bit-compatible with their
  checkpoints (``state_dict`` keeps torch's ``{"state": {0: {...}}, "param_groups": [...]}`` layout, and loads
  theirs).

Optimizers (per element, g the gradient, w the weight; L2 weight decay ``g <- g + wd * w`` as torch):

* ``sgd``: ``w -= lr * g``.
* ``adagrad`` (Duchi et al. 2011; torch's): ``sum += g^2``, ``w -= lr * g / (sqrt(sum) + eps)``.
* ``rowwise_adagrad`` (fbgemm's EXACT_ROWWISE_ADAGRAD): one accumulator per row,
  ``acc_r += mean_k g_rk^2``, ``w_r -= lr * g_r / (sqrt(acc_r) + eps)``; state ``[n_local]`` (4 bytes a row).
* ``adam`` (Kingma & Ba 2015), **lazy**: only touched rows update their moments; each row keeps its own
  update count ``row_step`` and its bias correction uses it, ``w -= lr / (1 - b1^t_r) * m / (sqrt(v) /
  sqrt(1 - b2^t_r) + eps)`` with ``t_r`` the row's count — a row touched k times is exactly dense Adam run
  on its k gradients (TensorFlow's LazyAdam uses the global step instead). ``step_dense`` updates every row,
  so there ``t_r`` is the global step and the update is ``torch.optim.Adam``'s.

Sparse weight decay: ``step_rows`` decays the touched rows only (the untouched rows have no gradient, so
nothing is computed for them). Dense and sparse updates are therefore identical for ``sgd``, ``adagrad``
and ``rowwise_adagrad`` **without** weight decay (an untouched row's dense update is exactly zero), and
differ by design with decay (dense decays every row every step) and for lazy Adam (dense Adam moves rows
with a zero gradient through their momentum).
"""

from __future__ import annotations

import torch

__all__ = ["ITEM_OPTIMIZERS", "RowOptimizer", "catalog_optimizer"]

ITEM_OPTIMIZERS = ("sgd", "adagrad", "rowwise_adagrad", "adam")
_DEFAULT_EPS = {"sgd": 0.0, "adagrad": 1e-10, "rowwise_adagrad": 1e-8, "adam": 1e-8}
_ROW_STATE = {
    "sgd": (),
    "adagrad": ("sum",),
    "rowwise_adagrad": ("sum",),
    "adam": ("exp_avg", "exp_avg_sq", "row_step"),
}


class RowOptimizer:
    """Optimizer of one catalog shard ``weight: float[n_local, d]`` (updated in place).

    Args:
        weight: the shard's rows (an ``nn.Parameter`` or a tensor); only ``weight.data`` is written.
        name: one of ``ITEM_OPTIMIZERS``. lr: learning rate. weight_decay: L2 decay (see the module docstring).
        eps: denominator guard (default: torch's for adagrad/adam, fbgemm's 1e-8 for rowwise_adagrad).
        betas: Adam's (beta1, beta2).
    """

    def __init__(
        self,
        weight: torch.Tensor,
        name: str,
        lr: float,
        *,
        weight_decay: float = 0.0,
        eps: float | None = None,
        betas: tuple[float, float] = (0.9, 0.999),
    ):
        if name not in ITEM_OPTIMIZERS:
            raise ValueError(f"item optimizer must be one of {', '.join(ITEM_OPTIMIZERS)}, got {name!r}")
        if weight.dim() != 2:
            raise ValueError(f"weight must be [n_local, d], got shape {tuple(weight.shape)}")
        if not lr > 0 or weight_decay < 0:
            raise ValueError(f"need lr > 0 and weight_decay >= 0, got lr={lr!r}, weight_decay={weight_decay!r}")
        self.weight = weight
        self.name = name
        self.lr, self.weight_decay = float(lr), float(weight_decay)
        self.eps = float(_DEFAULT_EPS[name] if eps is None else eps)
        self.betas = (float(betas[0]), float(betas[1]))
        self.step_count = 0  # optimizer steps taken (dense or sparse)
        rows = weight.shape[0]
        data = weight.detach()
        self.state: dict[str, torch.Tensor] = {}
        if name == "adagrad":
            self.state["sum"] = torch.zeros_like(data)
        elif name == "rowwise_adagrad":
            self.state["sum"] = data.new_zeros(rows)
        elif name == "adam":
            self.state["exp_avg"] = torch.zeros_like(data)
            self.state["exp_avg_sq"] = torch.zeros_like(data)
            self.state["row_step"] = torch.zeros(rows, dtype=torch.int64, device=data.device)

    # ------------------------------------------------------------------------------------------- state
    def row_state(self) -> dict[str, torch.Tensor]:
        """The row-aligned state tensors by name (first dimension = the shard's rows), for sharded checkpoints."""
        return {name: self.state[name] for name in _ROW_STATE[self.name]}

    def state_dict(self) -> dict:
        """``{"state": {0: {"step": float tensor, <row state>}}, "param_groups": [hyper-parameters]}``: torch's
        optimizer layout (one parameter), so checkpoints of ``torch.optim`` and of this class load into
        either's readers."""
        entry = {"step": torch.tensor(float(self.step_count))}
        entry.update({name: tensor.clone() for name, tensor in self.row_state().items()})
        group = {
            "optimizer": self.name,
            "lr": self.lr,
            "weight_decay": self.weight_decay,
            "eps": self.eps,
            "betas": self.betas,
            "params": [0],
        }
        return {"state": {0: entry}, "param_groups": [group]}

    def load_state_dict(self, state: dict) -> None:
        """Restore from ``state_dict()`` (also a ``torch.optim.SGD/Adagrad/Adam`` state dict of one parameter:
        Adam's missing ``row_step`` is its global step)."""
        group = (state.get("param_groups") or [{}])[0]
        saved_name = group.get("optimizer")
        if saved_name is not None and saved_name != self.name:
            raise ValueError(f"optimizer state is for {saved_name!r}, this optimizer is {self.name!r}")
        entry = (state.get("state") or {}).get(0, {})
        self.step_count = int(float(entry["step"])) if "step" in entry else 0
        for name, tensor in self.state.items():
            if name == "row_step" and name not in entry:
                tensor.fill_(self.step_count)
                continue
            if name not in entry:
                raise ValueError(f"optimizer state has no {name!r} (it holds {sorted(entry)})")
            saved = entry[name]
            if saved.shape != tensor.shape:
                raise ValueError(
                    f"optimizer state {name!r} has shape {tuple(saved.shape)}, expected {tuple(tensor.shape)}"
                )
            tensor.copy_(saved)

    # ------------------------------------------------------------------------------------------- updates
    @torch.no_grad()
    def step_dense(self, grad: torch.Tensor | None) -> None:
        """Update every row with ``grad: float[n_local, d]`` (None: no gradient reached the shard, no-op)."""
        if grad is None:
            return
        if grad.shape != self.weight.shape:
            raise ValueError(f"grad must have the weight's shape {tuple(self.weight.shape)}, got {tuple(grad.shape)}")
        if grad.is_sparse:
            grad = grad.coalesce()
            self.step_rows(grad.indices()[0], grad.values())
            return
        self.step_count += 1
        weight = self.weight.data
        if self.name == "adam" and self._same_row_steps():
            self._fused_adam(weight, grad)
            return
        if self.weight_decay:
            grad = grad.add(weight, alpha=self.weight_decay)
        if self.name == "adam":
            self.state["row_step"].add_(1)
        self._update(weight, grad, self.state, self.state.get("row_step"))

    def _same_row_steps(self) -> bool:
        """Whether every row of Adam has been updated as often (always so when every step is dense). Looked at on
        every dense step (a pass over one int64 a row): a checkpoint load writes the counts in place."""
        row_step = self.state["row_step"]
        return bool((row_step == row_step[0]).all()) if row_step.numel() else True

    def _fused_adam(self, weight: torch.Tensor, grad: torch.Tensor) -> None:
        """A dense Adam step of every row, all at the same count, in torch's fused kernel (one pass over the rows;
        ``torch.optim.Adam(fused=True)``'s arithmetic): ~10x the elementwise ops of ``_update`` on a CPU core."""
        from torch.optim.adam import adam

        row_step = self.state["row_step"]
        step = torch.tensor(float(row_step[0]) if row_step.numel() else 0.0)  # adam counts it up to this step's
        beta1, beta2 = self.betas
        adam(
            [weight], [grad], [self.state["exp_avg"]], [self.state["exp_avg_sq"]], [], [step],
            foreach=False, fused=True, capturable=False, differentiable=False, grad_scale=None, found_inf=None,
            has_complex=False, amsgrad=False, beta1=beta1, beta2=beta2, lr=self.lr,
            weight_decay=self.weight_decay, eps=self.eps, maximize=False,
        )  # fmt: skip
        row_step.add_(1)

    @torch.no_grad()
    def step_rows(self, ids: torch.Tensor, grads: torch.Tensor) -> None:
        """Update rows ``ids`` (int64[u], unique local row indices) with ``grads: float[u, d]``; every other
        row and its state stay untouched. Cost O(u * d)."""
        if ids.dim() != 1 or grads.dim() != 2 or grads.shape != (ids.numel(), self.weight.shape[1]):
            raise ValueError(
                f"step_rows needs ids [u] and grads [u, {self.weight.shape[1]}], got {tuple(ids.shape)} and "
                f"{tuple(grads.shape)}"
            )
        self.step_count += 1
        if ids.numel() == 0:
            return
        ids = ids.to(device=self.weight.device, dtype=torch.int64)
        weight = self.weight.data
        rows = weight.index_select(0, ids)
        if self.weight_decay:
            grads = grads.add(rows, alpha=self.weight_decay)
        state = {name: tensor.index_select(0, ids) for name, tensor in self.state.items()}
        if self.name == "adam":
            state["row_step"].add_(1)
        self._update(rows, grads, state, state.get("row_step"))
        weight.index_copy_(0, ids, rows)
        for name, tensor in self.state.items():
            tensor.index_copy_(0, ids, state[name])

    def _update(self, weight, grad, state, row_step) -> None:
        """The in-place update of ``weight`` rows and their ``state`` (full tensors or gathered rows)."""
        if self.name == "sgd":
            weight.add_(grad, alpha=-self.lr)
        elif self.name == "adagrad":
            total = state["sum"]
            total.addcmul_(grad, grad, value=1)
            weight.addcdiv_(grad, total.sqrt().add_(self.eps), value=-self.lr)
        elif self.name == "rowwise_adagrad":
            total = state["sum"]
            total.add_(grad.square().mean(dim=1))
            weight.addcdiv_(grad, total.sqrt().add_(self.eps).unsqueeze(1), value=-self.lr)
        else:
            beta1, beta2 = self.betas
            exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
            exp_avg.lerp_(grad, 1 - beta1)
            exp_avg_sq.mul_(beta2).addcmul_(grad, grad.conj(), value=1 - beta2)
            if bool((row_step == row_step[0]).all()):
                # One count for every row (always so for dense steps): torch.optim.Adam's scalar arithmetic.
                t = int(row_step[0])
                bias_correction1 = 1 - beta1**t
                bias_correction2_sqrt = (1 - beta2**t) ** 0.5
                denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(self.eps)
                weight.addcdiv_(exp_avg, denom, value=-self.lr / bias_correction1)
                return
            steps = row_step.to(weight.dtype).unsqueeze(1)
            bias_correction1 = 1 - torch.pow(beta1, steps)
            bias_correction2_sqrt = (1 - torch.pow(beta2, steps)).sqrt()
            denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(self.eps)
            weight.addcdiv_(exp_avg / bias_correction1, denom, value=-self.lr)


def catalog_optimizer(weight: torch.Tensor, optim) -> RowOptimizer:
    """The catalog's optimizer as the run's ``optim`` section sets it (``item_optimizer``, ``item_lr``,
    ``weight_decay``): what the trainer steps, and what the layout cost model times."""
    return RowOptimizer(weight, optim.item_optimizer, optim.item_lr, weight_decay=optim.weight_decay)
