"""``model.params`` of ``model.kind: item_item`` and the settings the kind trains with (torch-free: a config loads
without torch; the model is ``bigrank.model.item_item``, its training ``bigrank.train.item_item``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from bigrank.errors import ConfigError
from bigrank.losses.registry import parse_params

__all__ = ["ItemItemParams"]


def _check(condition: bool, key: str, message: str) -> None:
    if not condition:
        raise ConfigError(f"{key} {message}")


@dataclass(frozen=True)
class ItemItemParams:
    """The item-item model's parameters (``model.params``; ``model.dim`` is the rank of its low-rank term)."""

    l2: float = field(
        default=1.0,
        metadata={
            "doc": "L2 penalty lambda (‖W‖² + ‖P‖² + ‖Q‖²) / (train rows), added to each step's mean row loss "
            "(lambda in EASE's sum-over-the-data units; model.item_item_l2 before model.params)"
        },
    )

    def check(self, config) -> None:
        """The parameter's value and what the kind trains with (``bigrank.train.item_item``): a full-catalog loss of
        every train item of a user at once (Rankmax with k = 1, or softmax), dense Adam, float32, its own L2, no
        history bag and no table layouts. Raises ConfigError naming the key."""
        _check(self.l2 >= 0, "model.params.l2", "must be >= 0")
        loss = config.loss
        _check(
            loss.name in ("rankmax", "softmax"),
            "loss.name",
            f"must be rankmax or softmax with model.kind item_item, got {loss.name!r}",
        )
        params = parse_params(loss.name, loss.params, "loss.params")
        if loss.name == "rankmax":
            _check(params.get("k", 1) == 1, "loss.params.k", "must be 1 with model.kind item_item")
            _check(not params.get("k_fraction"), "loss.params.k_fraction", "must be 0 with model.kind item_item")
        _check(
            config.optim.item_optimizer == "adam",
            "optim.item_optimizer",
            "must be adam with model.kind item_item (its matrices are dense; item_lr is Adam's rate)",
        )
        _check(
            not config.model.history, "model.history", "must be false with model.kind item_item (x W is its history)"
        )
        for key, value in (("user_l2", config.optim.user_l2), ("weight_decay", config.optim.weight_decay)):
            _check(value == 0, f"optim.{key}", "must be 0 with model.kind item_item: its L2 is model.params.l2")
        _check(config.model.layout == "auto", "model.layout", "is for model.kind towers (item_item is replicated)")
        _check(
            config.train.precision in ("auto", "fp32"),
            "train.precision",
            f"must be auto or fp32 with model.kind item_item (it trains in float32), got {config.train.precision!r}",
        )
