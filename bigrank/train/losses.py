"""The training loss named by the config, applied to one step of the item-parallel model.

Every rank holds the all-gathered user vectors of the global batch ``U: float[B, d]``, the global positive
items ``target: int64[B]`` and its catalog shard (rows ``[start, stop)``). :class:`StepLoss` turns these into
the (replicated) loss of the global batch:

* full-catalog losses (``rankmax``, ``softmax``, ``sparsemax``): ``loss(shard.scores(U, chunk_size), target,
  group=group, offset=start)`` — every item is scored, only per-row statistics cross ranks;
* candidate losses (``smooth_ap``, ``recall_at_quantile``, ``pauc_at_budget``, ``softrank_ndcg``,
  ``sampled_softmax``) over ``loss.candidates``:

  - ``catalog``: the columns are the whole local shard and ``labels[b, j] = (start + j == target[b])``;
  - ``sampled``: the columns are this rank's share of ``loss.num_negatives`` negatives drawn from its own
    shard (uniform, or ∝ (train count + 1)^beta) plus the shard's positives of the batch; a positive column
    is valid only in its own row (no in-batch negatives), a row's positive drawn again as a negative is an
    accidental hit (labelled positive). ``log_q`` is the expected number of draws of each column under the
    rank's proposal (Yi et al. RecSys 2019), used by ``sampled_softmax`` only.

Optional warm-up (``loss.warmup``): :class:`bigrank.losses.warmup.LossWarmupWrapper` from the warm-up loss to
the main loss with a geometric temperature schedule; its step counter is checkpointed (``state_dict``).
"""

from __future__ import annotations

import torch
from torch import nn

from bigrank.config import FULL_CATALOG_LOSSES, ConfigError, LossConfig, check_loss_params

__all__ = ["CandidateLoss", "StepLoss", "check_loss_config"]


def _full_catalog_module(name: str, params: dict) -> nn.Module:
    from bigrank.losses import RankmaxLoss, SoftmaxLoss, SparsemaxLoss

    if name == "rankmax":
        return RankmaxLoss(k=params["k"], margin=params["margin"])
    if name == "softmax":
        return SoftmaxLoss(temperature=params["temperature"])
    return SparsemaxLoss(support_guess=params["support_guess"])


class CandidateLoss(nn.Module):
    """A candidate loss with the common call ``(scores [B, C], labels bool [B, C], mask, *, group, log_q)``.

    ``log_q`` reaches ``sampled_softmax`` only (the soft-rank losses take no proposal correction);
    ``temperature`` is the wrapped loss's (the one ``LossWarmupWrapper`` anneals).
    """

    def __init__(self, name: str, params: dict):
        super().__init__()
        from bigrank.losses.sampled import SampledSoftmaxLoss
        from bigrank.losses.softndcg import SoftNDCGLoss
        from bigrank.losses.softrank import PAUCAtBudgetLoss, RecallAtQuantileLoss, SmoothAPLoss

        classes = {
            "smooth_ap": SmoothAPLoss,
            "recall_at_quantile": RecallAtQuantileLoss,
            "pauc_at_budget": PAUCAtBudgetLoss,
            "softrank_ndcg": SoftNDCGLoss,
            "sampled_softmax": SampledSoftmaxLoss,
        }
        self.name = name
        self.inner = classes[name](**params)

    @property
    def temperature(self) -> float:
        return float(self.inner.temperature)

    @temperature.setter
    def temperature(self, value: float) -> None:
        self.inner.temperature = value

    def forward(self, scores, labels, mask=None, *, group=None, log_q=None):
        if self.name == "sampled_softmax":
            return self.inner(scores, labels, mask, group=group, log_q=log_q)
        return self.inner(scores, labels, mask, group=group)


def _build_module(config: LossConfig) -> nn.Module:
    """The loss module of ``config`` (constructor errors are re-raised as ConfigError naming the key)."""
    try:
        if config.name in FULL_CATALOG_LOSSES:
            return _full_catalog_module(config.name, config.params)
        main = CandidateLoss(config.name, config.params)
    except ValueError as error:
        raise ConfigError(f"loss.params ({config.name}): {error}") from None
    if config.warmup is None:
        return main
    from bigrank.losses.warmup import LossWarmupWrapper

    warm = config.warmup
    try:
        warmup_loss = CandidateLoss(warm.loss, warm.params)
    except ValueError as error:
        raise ConfigError(f"loss.warmup.params ({warm.loss}): {error}") from None
    try:
        return LossWarmupWrapper(
            warmup_loss,
            main,
            warmup_steps=warm.steps,
            temp_start=warm.temp_start,
            temp_end=warm.temp_end,
            temp_decay_steps=warm.temp_decay_steps,
            blend_steps=warm.blend_steps,
        )
    except ValueError as error:
        raise ConfigError(f"loss.warmup: {error}") from None


def check_loss_config(config: LossConfig) -> None:
    """Build the loss once to surface bad parameter values (ConfigError naming the key) before any spawn."""
    config.params = check_loss_params(config.name, config.params, "loss.params")
    _build_module(config)


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
    ):
        self.config = config
        self.module = _build_module(config)
        self.full_catalog = config.name in FULL_CATALOG_LOSSES
        self.start, self.stop = int(shard_start), int(shard_stop)
        self.seed, self.rank = int(seed), int(rank)
        self.sampler = None
        self.num_samples = 0
        if not self.full_catalog and config.candidates == "sampled" and self.stop > self.start:
            from bigrank.data.samplers import PopularitySampler, UniformSampler

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
    ) -> torch.Tensor:
        """Loss of the global batch (the same value on every rank).

        Args:
            user_vectors: float[B, d], all-gathered (``all_gather_rows``: its backward reduce-scatters).
            target: int64[B] global positive item ids, the same on every rank.
            item_weight: float[stop - start, d] this rank's catalog rows (a parameter).
            chunk_size: items scored at once by full-catalog losses (None: all at once; "auto": blocks of
                about 2^22 scores).
            step: the global step (seeds the negative draws).
        """
        if self.full_catalog:
            from bigrank.losses.scores import score_matrix

            scores = score_matrix(user_vectors, item_weight, chunk_size)
            return self.module(scores, target, group=group, offset=self.start)
        if self.config.candidates == "catalog":
            scores = user_vectors @ item_weight.T
            columns = torch.arange(self.start, self.stop, device=target.device)
            labels = target.unsqueeze(1) == columns.unsqueeze(0)
            return self.module(scores, labels, None, group=group)
        scores, labels, mask, log_q = self._sampled_candidates(user_vectors, target, item_weight, step)
        return self.module(scores, labels, mask, group=group, log_q=log_q)

    def _sampled_candidates(self, user_vectors, target, item_weight, step):
        from bigrank.data.samplers import candidate_labels

        in_shard = (target >= self.start) & (target < self.stop)
        positives = torch.unique(target[in_shard])
        if self.sampler is None:  # an empty shard: no columns here
            negatives = torch.empty(0, dtype=torch.int64)
            neg_log_q = torch.empty(0, dtype=torch.float64)
            pos_log_q = torch.zeros(positives.numel(), dtype=torch.float64)
        else:
            generator = torch.Generator().manual_seed(_step_seed(self.seed, self.rank, step))
            drawn = self.sampler.sample(self.num_samples, generator=generator)
            negatives, neg_log_q = drawn.ids, drawn.log_q
            pos_log_q = self.sampler.log_q(positives, self.num_samples)
        ids = torch.cat([positives, negatives])
        scores = user_vectors @ item_weight[ids - self.start].T
        labels = candidate_labels(target, ids)
        # A positive column counts only in its own row: the other rows never drew it.
        mask = torch.ones_like(labels)
        mask[:, : positives.numel()] = labels[:, : positives.numel()]
        log_q = torch.cat([pos_log_q, neg_log_q]).to(scores.dtype)
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


def _step_seed(seed: int, rank: int, step: int) -> int:
    return (seed * 1_000_003 + rank * 7_919 + step * 104_729 + 0x5A3B) % (2**63 - 1)
