"""The training loss named by the config, applied to one step of the item-parallel model.

Every rank holds the all-gathered user vectors of the global batch ``U: float[B, d]``, the global positive
items ``target: int64[B]`` and its catalog shard (rows ``[start, stop)``). :class:`StepLoss` turns these into
the (replicated) loss of the global batch:

* full-catalog losses (``rankmax``, ``softmax``, ``sparsemax``): ``loss(score_matrix(U, shard.weight,
  chunk_size), target, group=group, offset=start)`` — every item is scored, only per-row statistics cross
  ranks;
* candidate losses (``smooth_ap``, ``recall_at_quantile``, ``pauc_at_budget``, ``softrank_ndcg``,
  ``sampled_softmax``) over ``loss.candidates``:

  - ``catalog``: the columns are the whole local shard and ``labels[b, j] = (start + j == target[b])``;
  - ``sampled``: the columns are this rank's share of ``loss.num_negatives`` negatives drawn from its own
    shard (uniform, or ∝ (train count + 1)^beta) plus the shard's positives of the batch; a positive column
    is valid only in its own row (no in-batch negatives), a row's positive drawn again as a negative is an
    accidental hit (labelled positive). ``log_q`` is the expected number of draws of each column under the
    rank's proposal (Yi et al. RecSys 2019), used by ``sampled_softmax`` only.

Sampled softmax, Smooth-AP, Recall@quantile and pAUC@budget over ``sampled`` candidates take fused paths
(``bigrank.losses.sampled`` / ``sampled_softrank``: shared negatives in one [B, N_r] buffer, no [B, C] labels,
mask or log_q), also inside a warm-up wrapper; SoftNDCG takes the materialised columns.

The loss module comes from the loss registry (``bigrank.losses.build.build_loss``).
Optional warm-up (``loss.warmup``): :class:`bigrank.losses.warmup.LossWarmupWrapper` from the warm-up loss to
the main loss with a geometric temperature schedule; its step counter is checkpointed (``state_dict``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from bigrank.config import LossConfig
from bigrank.data.samplers import PopularitySampler, UniformSampler
from bigrank.losses.build import CandidateLoss, build_loss
from bigrank.losses.registry import FULL_CATALOG_LOSSES
from bigrank.losses.warmup import LossWarmupWrapper

__all__ = ["StepLoss", "TouchedRows"]


@dataclass
class TouchedRows:
    """The catalog rows a sampled step read: ``ids`` int64[u] unique local row indices (ascending) and
    ``rows`` float[u, d], a leaf copy of those rows whose ``.grad`` after backward is their gradient."""

    ids: torch.Tensor
    rows: torch.Tensor

    @property
    def grad(self) -> torch.Tensor:
        """dL/drows [u, d] (zeros when the loss did not reach them, e.g. an empty shard)."""
        return self.rows.grad if self.rows.grad is not None else torch.zeros_like(self.rows)


@dataclass
class _Draw:
    """One step's sampled candidates on this rank (global ids; log_q float64)."""

    owned_rows: torch.Tensor  # int64[p]: batch rows whose target is in this shard
    positives: torch.Tensor  # int64[p]: their targets
    pos_log_q: torch.Tensor
    negatives: torch.Tensor  # int64[N_r], with repeats
    neg_log_q: torch.Tensor


@dataclass
class _SampledStep:
    """The inputs of one sampled step's loss, and its materialised columns once built (generic path)."""

    user_vectors: torch.Tensor
    target: torch.Tensor
    rows: torch.Tensor
    inverse: torch.Tensor
    draw: _Draw
    group: object
    columns: tuple | None = None

    def arguments(self) -> tuple:
        return self.user_vectors, self.target, self.rows, self.inverse, self.draw, self.group


# Candidate losses with a fused shared-negatives path besides sampled softmax.
_FUSED_SOFT_RANK = ("smooth_ap", "recall_at_quantile", "pauc_at_budget")


class StepLoss:
    """The configured loss of one training step on an item-parallel catalog.

    Args:
        config: the ``loss`` section.
        num_items: catalog size n.
        shard_start, shard_stop: this rank's catalog rows.
        item_counts: float/int [stop - start] train interactions of the shard's items (popularity sampler).
        seed, rank: seed of the negative draws; the draw of step t depends only on (seed, rank, t), so a
            resumed run draws the same negatives.
    """

    def __init__(
        self,
        config: LossConfig,
        *,
        num_items: int,
        shard_start: int,
        shard_stop: int,
        item_counts: torch.Tensor | None = None,
        seed: int = 0,
        rank: int = 0,
        score_dtype: torch.dtype | None = None,
        kernel: str = "chunked",
    ):
        self.config = config
        self.kernel = kernel  # train.kernel, resolved: "fused" or "chunked" (full-catalog losses)
        self.module = build_loss(config)
        self.score_dtype = score_dtype  # train.precision: the dtype scores are computed in
        self.full_catalog = config.name in FULL_CATALOG_LOSSES
        self.start, self.stop = int(shard_start), int(shard_stop)
        self.seed, self.rank = int(seed), int(rank)
        self.sampler = None
        self.num_samples = 0
        self.last_rows: TouchedRows | None = None
        if not self.full_catalog and config.candidates == "sampled" and self.stop > self.start:
            local = self.stop - self.start
            # Draws proportional to the shard size keep q_j comparable across ranks (same n_r / s_r).
            self.num_samples = max(1, round(config.num_negatives * local / num_items))
            if config.sampler == "uniform":
                self.sampler = UniformSampler(local, offset=self.start)
            else:
                if item_counts is None or item_counts.numel() != local:
                    raise ValueError(f"the popularity sampler needs the train counts of the {local} shard items")
                # +1 smoothing: every item (a positive that was never seen, too) has a finite log_q.
                self.sampler = PopularitySampler(item_counts, beta=config.beta, offset=self.start, smoothing=1.0)

    @property
    def name(self) -> str:
        return self.config.name

    @property
    def needs_positives(self) -> bool:
        """Whether the loss takes each row's number of positives (rankmax with a per-row k)."""
        return bool(getattr(self.module, "needs_positives", False))

    @property
    def temperature(self) -> float | None:
        """The scheduled temperature (warm-up) or the candidate loss's temperature; None for full-catalog losses."""
        if self.full_catalog:
            return None
        if hasattr(self.module, "current_temperature"):  # a LossWarmupWrapper: its main loss's temperature
            return float(self.module.current_temperature)
        return float(self.module.temperature)

    def __call__(
        self,
        user_vectors: torch.Tensor,
        target: torch.Tensor,
        item_weight: torch.Tensor,
        *,
        group=None,
        chunk_size: int | str | None = None,
        step: int = 0,
        positives: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Loss of the global batch (the same value on every rank).

        Args:
            user_vectors: float[B, d], all-gathered (``all_gather_rows``: its backward reduce-scatters).
            target: int64[B] global positive item ids, the same on every rank.
            item_weight: float[stop - start, d] this rank's catalog rows (a parameter).
            chunk_size: items scored at once by full-catalog losses (None: all at once; "auto": blocks of
                about 2^22 scores).
            step: the global step (seeds the negative draws).
            positives: int64[B] train items of each row's user, for a loss whose k follows them
                (``needs_positives``: rankmax with ``k_fraction`` > 0); ignored otherwise.

        Sampled candidates read only the rows they touch: ``self.last_rows`` then holds them (a
        :class:`TouchedRows` whose ``grad`` after backward is the [u, d] row gradient to pass to
        ``RowOptimizer.step_rows``) and ``item_weight`` gets no gradient. Otherwise ``last_rows`` is None and
        the gradient lands in ``item_weight.grad`` (dense: every row is scored).
        """
        self.last_rows = None
        if self.full_catalog:
            from bigrank.losses.fused.source import kernel_scores

            scores = kernel_scores(user_vectors, item_weight, chunk_size, self.score_dtype, self.kernel)
            if self.needs_positives:
                return self.module(scores, target, group=group, offset=self.start, positives=positives)
            return self.module(scores, target, group=group, offset=self.start)
        if self.config.candidates == "catalog":
            catalog_fn = self._catalog_function()
            if catalog_fn is not None:  # one positive per row: the chunked engine, no [B, n] labels
                from bigrank.losses.scores import score_matrix

                scores = score_matrix(user_vectors, item_weight, chunk_size, dtype=self.score_dtype)
                return catalog_fn(scores, target, group=group, offset=self.start)
            scores = user_vectors @ item_weight.T
            columns = torch.arange(self.start, self.stop, device=target.device)
            labels = target.unsqueeze(1) == columns.unsqueeze(0)
            return self.module(scores, labels, None, group=group)
        draw = self._draw(target, step)
        ids, inverse = torch.unique(torch.cat([draw.positives, draw.negatives]) - self.start, return_inverse=True)
        rows = item_weight.detach().index_select(0, ids).requires_grad_()
        self.last_rows = TouchedRows(ids, rows)
        step = _SampledStep(user_vectors, target, rows, inverse, draw, group)
        if isinstance(self.module, LossWarmupWrapper):  # the wrapper's phases and blend, each loss fused
            return self.module.blend(lambda module: self._sampled_loss(module, step))
        return self._sampled_loss(self.module, step)

    def _sampled_loss(self, module, step: _SampledStep) -> torch.Tensor:
        """``module``'s loss on the step's sampled candidates: the fused shared-negatives path for sampled
        softmax, Smooth-AP, Recall@quantile and pAUC@budget; the materialised [B, C] columns otherwise."""
        if isinstance(module, CandidateLoss):
            if module.name == "sampled_softmax":
                return self._fused_sampled_softmax(module, *step.arguments())
            if module.name in _FUSED_SOFT_RANK:
                return self._fused_soft_rank(module, *step.arguments())
        if step.columns is None:  # built once per step, shared by a blended warm-up
            step.columns = self._sampled_candidates(step.user_vectors, step.target, step.rows, step.inverse, step.draw)
        scores, labels, mask, log_q = step.columns
        return module(scores, labels, mask, group=step.group, log_q=log_q)

    def _catalog_function(self):
        """``loss(scores, target, *, group, offset)`` of ``bigrank.losses.softrank_catalog`` for the configured
        Smooth-AP / Recall@quantile / pAUC@budget without warm-up (None otherwise: the dense path)."""
        if not isinstance(self.module, CandidateLoss):
            return None
        from functools import partial

        from bigrank.losses import softrank_catalog

        inner = self.module.inner
        if self.module.name == "smooth_ap":
            fn, params = softrank_catalog.smooth_ap_catalog_loss, {"temperature": inner.temperature}
        elif self.module.name == "recall_at_quantile":
            fn = softrank_catalog.recall_at_quantile_catalog_loss
            params = {"quantile": inner.quantile, "temperature": inner.temperature}
        elif self.module.name == "pauc_at_budget":
            fn = softrank_catalog.pauc_at_budget_catalog_loss
            params = {
                "alpha": inner.alpha, "beta": inner.beta, "temperature": inner.temperature,
                "tau_scale": inner.tau_scale, "n_knots": inner.n_knots, "scale_sample_size": inner.scale_sample_size,
            }  # fmt: skip
        else:
            return None
        return partial(fn, reduction=inner.reduction, **params)

    def _draw(self, target, step) -> _Draw:
        """This rank's candidates: the shard's positives of the batch (row ``owned`` flags and local targets)
        and the step's negatives (the draw depends only on seed, rank and step)."""
        owned = (target >= self.start) & (target < self.stop)
        owned_rows = owned.nonzero().squeeze(1)
        positives = target[owned_rows]
        if self.sampler is None:  # an empty shard: no columns here
            negatives = torch.empty(0, dtype=torch.int64)
            neg_log_q = torch.empty(0, dtype=torch.float64)
            pos_log_q = torch.zeros(positives.numel(), dtype=torch.float64)
        else:
            # The draw runs on the CPU generator (the same negatives on any device), then moves to the batch's.
            generator = torch.Generator().manual_seed(_step_seed(self.seed, self.rank, step))
            drawn = self.sampler.sample(self.num_samples, generator=generator)
            negatives, neg_log_q = drawn.ids, drawn.log_q
            pos_log_q = self.sampler.log_q(positives.cpu(), self.num_samples)
        device = target.device
        return _Draw(owned_rows, positives, pos_log_q.to(device), negatives.to(device), neg_log_q.to(device))

    def _fused_sampled_softmax(self, module, user_vectors, target, rows, inverse, draw, group):
        """Sampled softmax without the [B, C] candidate tensors (``sampled_softmax_shared_negatives``): each
        row's positive scored as a dot product, the shared negatives in one fused pass."""
        from bigrank.losses.sampled import sampled_softmax_shared_negatives

        inner = module.inner
        temperature = float(inner.temperature)
        count = draw.positives.numel()
        positive_rows, negative_rows = repeat_rows(rows, inverse[:count]), repeat_rows(rows, inverse[count:])
        dtype = user_vectors.dtype
        owned_logits = (user_vectors[draw.owned_rows] * positive_rows).sum(dim=1) / temperature
        owned_logits = owned_logits - draw.pos_log_q.to(dtype)
        positive_logits = user_vectors.new_zeros(target.numel()).index_add(0, draw.owned_rows, owned_logits)
        loss, valid = sampled_softmax_shared_negatives(
            user_vectors, negative_rows, draw.negatives, draw.neg_log_q, target, positive_logits,
            temperature=temperature, reduction=inner.reduction, group=group, return_valid=True,
            compute_dtype=self.score_dtype,
        )  # fmt: skip
        inner.last_excluded_rows = int((~valid).sum())
        return loss

    def _fused_soft_rank(self, module, user_vectors, target, rows, inverse, draw, group):
        """Smooth-AP / Recall@quantile / pAUC@budget over the shared negatives (``bigrank.losses.sampled_softrank``):
        the positive as a dot product, the negatives as one [B, N_r] buffer, no [B, C] labels or mask."""
        from bigrank.losses import sampled_softrank

        inner = module.inner
        count = draw.positives.numel()
        positive_rows, negative_rows = repeat_rows(rows, inverse[:count]), repeat_rows(rows, inverse[count:])
        owned_scores = (user_vectors[draw.owned_rows] * positive_rows).sum(dim=1)
        positive_scores = user_vectors.new_zeros(target.numel()).index_add(0, draw.owned_rows, owned_scores)
        params = {"temperature": float(inner.temperature), "reduction": inner.reduction}
        if module.name == "smooth_ap":
            fn = sampled_softrank.smooth_ap_shared_negatives
        elif module.name == "recall_at_quantile":
            fn, params["quantile"] = sampled_softrank.recall_at_quantile_shared_negatives, inner.quantile
        else:
            fn = sampled_softrank.pauc_at_budget_shared_negatives
            params.update(
                positive_columns=int(torch.unique(draw.positives).numel()), alpha=inner.alpha, beta=inner.beta,
                tau_scale=inner.tau_scale, n_knots=inner.n_knots, scale_sample_size=inner.scale_sample_size,
            )  # fmt: skip
        loss, valid = fn(
            user_vectors, negative_rows, draw.negatives, target, positive_scores, group=group, return_valid=True,
            compute_dtype=self.score_dtype, **params,
        )  # fmt: skip
        inner.last_excluded_rows = int((~valid).sum())
        return loss

    def _sampled_candidates(self, user_vectors, target, rows, inverse, draw):
        """Scores [B, C] of the columns [unique positives | negatives], with labels, mask and log_q."""
        from bigrank.data.samplers import candidate_labels

        positives, index = torch.unique(draw.positives, return_inverse=True)
        first = torch.full((positives.numel(),), draw.positives.numel(), dtype=torch.int64, device=target.device)
        first.scatter_reduce_(0, index, torch.arange(draw.positives.numel(), device=target.device), reduce="amin")
        count = draw.positives.numel()
        columns = torch.cat([inverse[first], inverse[count:]])
        ids = torch.cat([positives, draw.negatives])
        scores = user_vectors @ repeat_rows(rows, columns).T
        labels = candidate_labels(target, ids)
        # A positive column counts only in its own row: the other rows never drew it.
        mask = torch.ones_like(labels)
        mask[:, : positives.numel()] = labels[:, : positives.numel()]
        pos_log_q = draw.pos_log_q[first] if count else draw.pos_log_q
        log_q = torch.cat([pos_log_q, draw.neg_log_q]).to(scores.dtype)
        return scores, labels, mask, log_q

    def after_step(self) -> None:
        """Advance the warm-up/temperature schedule by one optimiser step."""
        if hasattr(self.module, "global_step"):
            self.module.step()

    def state_dict(self) -> dict:
        """Schedule state to checkpoint (empty without warm-up)."""
        if hasattr(self.module, "global_step"):  # a LossWarmupWrapper
            return {"schedule": self.module.get_extra_state()}
        return {}

    def load_state_dict(self, state: dict) -> None:
        if "schedule" in state:
            self.module.set_extra_state(state["schedule"])


def repeat_rows(rows: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``rows[index]`` (float[len(index), d]) whose backward adds the gradients of a row taken several times in a
    fixed order. A step's candidates repeat rows (negatives are drawn with replacement, a positive may be drawn
    again), and the backward of ``rows[index]`` (``index_put_`` with accumulation) runs in parallel on the CPU
    with atomic float adds once it covers 32,768 elements and torch has more than one thread: the order of the
    adds into a repeated row, and so the last bits of its gradient, changed from run to run (two ML-1M sampled
    softmax runs with the same seed parted after their first step; issue 49). ``index_select``'s backward,
    ``index_add_``, adds in the order of ``index``."""
    return rows.index_select(0, index)


def _step_seed(seed: int, rank: int, step: int) -> int:
    return (seed * 1_000_003 + rank * 7_919 + step * 104_729 + 0x5A3B) % (2**63 - 1)
