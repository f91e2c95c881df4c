"""``model.params`` of ``model.kind: item_bag`` and the settings the kind trains with (torch-free: a config loads
without torch; the model and its training are ``bigrank.train.item_bag``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from bigrank.errors import ConfigError
from bigrank.losses.registry import parse_params

__all__ = ["ItemBagParams"]


def _check(condition: bool, key: str, message: str) -> None:
    if not condition:
        raise ConfigError(f"{key} {message}")


@dataclass(frozen=True)
class ItemBagParams:
    """The item-bag model's parameters (``model.params``; ``model.dim`` is the size of its item vectors)."""

    l2: float = field(
        default=1.0,
        metadata={
            "doc": "L2 penalty lambda / (train rows) on the input rows a step reads and on every output row, added "
            "to each step's mean row loss (lambda in EASE's sum-over-the-data units, as the item-item model's l2)"
        },
    )
    bag_dropout: float = field(
        default=0.0,
        metadata={
            "doc": "training only: each of a user's items leaves the input bag with this probability (every train "
            "item stays a target; a denoising autoencoder's input dropout, an L2 scaled by item counts)"
        },
    )
    init_std: float = field(
        default=0.01,
        metadata={"doc": "the input and output rows start N(0, init_std^2) (small: the scores start near 0)"},
    )

    def check(self, config) -> None:
        """The parameters' values and what the kind trains with (``bigrank.train.item_bag``): a full-catalog loss of
        every train item of a user at once (Rankmax with k = 1, or softmax), its own L2, no history tower or user
        table settings, the item-parallel layout. Raises ConfigError naming the key."""
        _check(self.l2 >= 0, "model.params.l2", "must be >= 0")
        _check(0 <= self.bag_dropout < 1, "model.params.bag_dropout", "must be in [0, 1)")
        _check(self.init_std > 0, "model.params.init_std", "must be > 0")
        loss = config.loss
        _check(
            loss.name in ("rankmax", "softmax"),
            "loss.name",
            f"must be rankmax or softmax with model.kind item_bag (a user's items share one score vector), got "
            f"{loss.name!r}",
        )
        params = parse_params(loss.name, loss.params, "loss.params")
        if loss.name == "rankmax":
            _check(params.get("k", 1) == 1, "loss.params.k", "must be 1 with model.kind item_bag")
            _check(not params.get("k_fraction"), "loss.params.k_fraction", "must be 0 with model.kind item_bag")
        _check(not loss.warmup, "loss.warmup", "is for row-wise towers (model.kind item_bag has no warm-up loss)")
        _check(
            not config.model.history,
            "model.history",
            "must be false with model.kind item_bag (its user vector is the bag of the user's items already)",
        )
        for key, value in (("user_l2", config.optim.user_l2), ("weight_decay", config.optim.weight_decay)):
            _check(value == 0, f"optim.{key}", "must be 0 with model.kind item_bag: its L2 is model.params.l2")
        _check(
            config.model.layout in ("auto", "sharded"),
            "model.layout",
            "must be auto or sharded with model.kind item_bag (its tables are item-parallel: each worker holds the "
            "input and output rows of its share of the catalog)",
        )
        _check(
            config.train.kernel != "fused",
            "train.kernel",
            "fused has no kernel for model.kind item_bag (its scores carry a per-item correction): use auto or chunked",
        )
