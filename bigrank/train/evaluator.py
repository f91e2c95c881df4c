"""When and how the trainer evaluates: full-catalog ranking metrics, with each split's data read once per run."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from bigrank.config import Config
from bigrank.data.manifest import DatasetManifest
from bigrank.train.evaluate import EvaluationData, evaluate_model, evaluation_data

if TYPE_CHECKING:
    import torch

    from bigrank.model.catalog import CatalogView

__all__ = ["Evaluator", "RankingModel"]


class RankingModel(Protocol):
    """What evaluation ranks with, whatever the model kind (``bigrank.train.kind``): the dataset's user and item
    counts and ``ranking_view()``, ``(user_vectors_fn, catalog)`` — ``user_vectors_fn(user_ids int64[b]) ->
    float[b, d]`` (collective: every rank calls it with the same ``b``; no grad) and the
    :class:`~bigrank.model.catalog.CatalogView` of the item vectors float[stop - start, d] of the rows this rank
    owns (together the ranks own the catalog once). A user's score of item ``j`` is their dot product.
    ``known_splits``: the splits whose items the evaluation leaves out of the ranking, i.e. what the evaluated users
    are known by (``DatasetManifest.excluded_splits``: train, and for a given split's test also valid); a kind
    whose user vectors are made of the user's items pools them all, the others may ignore it."""

    num_users: int
    num_items: int

    def ranking_view(
        self, known_splits: tuple[str, ...] = ("train",)
    ) -> tuple[Callable[[torch.Tensor], torch.Tensor], CatalogView]: ...


class Evaluator:
    """Runs ``evaluate_model`` on the model of this rank (collective) and decides when it is due. ``model``: a
    :class:`RankingModel` (user vectors and this rank's catalog rows), of any kind.

    The users, relevant items and excluded (train) items of a split are read from the dataset the first time
    the split is evaluated and reused afterwards (keyed by the user sample), so evaluating every epoch costs
    the scoring only; the ranks of ``group`` read disjoint shares of the files and exchange what they found.
    ``manifest``: the run's dataset (``bigrank.data.manifest.dataset_manifest``). ``use_index``: read the items
    from the dataset's user indexes where every rank has them (``evaluation_data``; the same data, faster).
    """

    def __init__(self, config: Config, model: RankingModel, group, manifest: DatasetManifest, use_index: bool = True):
        self.config, self.model, self.group = config, model, group
        # eval.ks, and the cut-off train.early_stopping's metric reads (a config whose eval.ks are changed keeps
        # stopping on the metric it was tuned with).
        stopping = config.train.early_stopping
        extra = [stopping.k] if stopping is not None and stopping.k is not None else []
        self.ks = sorted(set(config.eval.ks) | set(extra))
        self.manifest = manifest
        self.use_index = use_index
        self._data: dict[tuple[str, int | None], EvaluationData] = {}

    def due(self, epoch: int, *, epoch_end: bool, last: bool) -> bool:
        """Evaluate during training after epoch ``epoch`` (1-based count of finished epochs) every
        ``eval.every_epochs`` epochs, except after the last step (the final evaluation covers it)."""
        every = self.config.eval.every_epochs
        return bool(every) and epoch_end and not last and epoch % every == 0

    def data(self, split: str, sample_users: int | None, item_range: tuple[int, int]) -> EvaluationData:
        """The evaluation data of ``split`` for the catalog rows ``item_range`` this rank ranks (read once)."""
        key = (split, sample_users)
        if key not in self._data:
            self._data[key] = evaluation_data(
                self.manifest,
                split,
                item_range,
                sample_users=sample_users,
                seed=self.config.seed,
                group=self.group,  # the ranks read disjoint shares of the files (collective, as evaluate is)
                use_index=self.use_index,
            )
        return self._data[key]

    def evaluate(self, split: str, sample_users: int | None | str = "config") -> dict[str, Any]:
        """Recall@K, NDCG@K, AP@K and Accuracy of ``split`` (``eval.sample_users`` unless given)."""
        sample = self.config.eval.sample_users if sample_users == "config" else sample_users
        # Whatever the layout, each rank ranks the rows it owns. The splits left out of the ranking are what the users
        # are known by: a model whose user vectors are made of the user's items pools them all.
        vectors_fn, catalog = self.model.ranking_view(self.manifest.excluded_splits(split))
        return evaluate_model(
            vectors_fn,
            catalog,
            self.manifest,
            split,
            self.ks,
            group=self.group,
            batch_size=self.config.eval.batch_size,
            data=self.data(split, sample, (catalog.start, catalog.stop)),
            certified_bf16=self.config.eval.certified_bf16,
        )
