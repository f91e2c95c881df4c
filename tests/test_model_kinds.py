"""Model kinds are registered units (bigrank.model.registry): a toy kind written and registered here alone — no
edit anywhere else — is checked by the config, trained by the one Trainer loop on 2 gloo workers (checkpoints,
the NaN guard, resume on another worker count), evaluated and exported by bigrank's own workers; no module
outside a kind's own names it; configs written before ``model.params`` still load and resume unchanged.

The toy: a user table and an item table, both replicated, scores their dot product times ``model.params.scale``,
trained on (user, item) rows with the softmax cross-entropy over the whole catalog; each rank takes its rows'
loss and the ranks sum the gradients (data parallel).
"""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
import torch

from bigrank.config import config_from_dict, resume_changes, validate
from bigrank.errors import ConfigError
from bigrank.model.registry import MODEL_KINDS, ModelSpec, markdown_table, register_model_kind
from bigrank.train.kind import ExportRows, ModelKind, StepResult
from bigrank.train.launcher import launch_local
from tests.conftest import brute_force_metrics, read_checkpoint

REPO = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------------------------------------- the toy kind
@dataclass(frozen=True)
class ToyParams:
    """``model.params`` of the toy kind."""

    scale: float = field(default=1.0, metadata={"doc": "multiplies the dot product"})

    def check(self, config) -> None:
        if self.scale <= 0:
            raise ConfigError(f"model.params.scale must be > 0, got {self.scale}")
        if config.loss.name != "softmax":
            raise ConfigError("loss.name must be softmax with model.kind toy")


class ToyModel:
    """Both tables whole on every rank; ``owned``: the catalog rows this rank ranks and exports."""

    def __init__(self, num_users: int, num_items: int, dim: int, seed: int, scale: float, owned: tuple[int, int]):
        generator = torch.Generator().manual_seed(seed)
        self.users = (torch.randn(num_users, dim, generator=generator) * 0.1).requires_grad_()
        self.items = (torch.randn(num_items, dim, generator=generator) * 0.1).requires_grad_()
        self.num_users, self.num_items, self.scale, self.owned = num_users, num_items, scale, owned

    def user_vectors(self, user_ids: torch.Tensor) -> torch.Tensor:
        return self.users.detach()[torch.as_tensor(user_ids, dtype=torch.int64)] * self.scale

    def ranking_view(self, known_splits=("train",)):
        from bigrank.model.catalog import CatalogView

        start, stop = self.owned
        return self.user_vectors, CatalogView(
            start, stop, self.num_items, self.items.shape[1], self.items.detach()[start:stop]
        )


class ToyState:
    """The two tables and, when training, Adagrad's sums and step counts (all replicated: DCP keeps one copy),
    loaded in place."""

    def __init__(self, model: ToyModel, optimizer=None):
        self.model, self.optimizer = model, optimizer

    def state_dict(self) -> dict:
        state = {"users": self.model.users.data, "items": self.model.items.data}
        if self.optimizer is not None:
            for name in ("users", "items"):
                state.update({f"{name}.{k}": v for k, v in self.optimizer.state[getattr(self.model, name)].items()})
        return state

    def load_state_dict(self, state: dict) -> None:
        pass


def _build(config, group, manifest) -> ToyModel:
    from bigrank.config import model_params
    from bigrank.model.catalog import owned_range

    scale = model_params(config).scale
    owned = owned_range(manifest.num_items, group)
    return ToyModel(manifest.num_users, manifest.num_items, config.model.dim, config.seed, scale, owned)


class ToyTraining:
    def __init__(self, run):
        from bigrank.data.stream import ParquetStream

        config, worker = run.config, run.worker
        self.config, self.group, self.world_size = config, worker.group, worker.world_size
        self.model = _build(config, worker.group, run.manifest)
        local = config.train.batch_size // worker.world_size
        self.stream = ParquetStream(run.manifest, "train", local, worker.rank, worker.world_size, seed=config.seed)
        self.optimizer = torch.optim.Adagrad([self.model.users, self.model.items], lr=config.optim.item_lr)
        self.parts = {"toy": ToyState(self.model, self.optimizer)}

    temperature = None

    def set_lr_factor(self, factor: float) -> None:
        self.optimizer.param_groups[0]["lr"] = self.config.optim.item_lr * factor

    def step(self, batch, context) -> StepResult:
        import torch.distributed as dist

        model, users, items = self.model, batch["user_id"].long(), batch["item_id"].long()
        scores = (model.users[users] @ model.items.T) * model.scale
        loss_sum = context.poison(torch.nn.functional.cross_entropy(scores, items, reduction="sum"))
        totals = torch.tensor([float(loss_sum.detach()), float(len(items)), float(context.stop_requested)])
        dist.all_reduce(totals, group=self.group)
        total_loss, rows, stops = totals.tolist()
        context.check_finite(total_loss / rows)
        self.optimizer.zero_grad()
        (loss_sum / rows).backward()
        for tensor in (model.users, model.items):
            dist.all_reduce(tensor.grad, group=self.group)
        self.optimizer.step()
        return StepResult(total_loss / rows, int(rows), stops > 0)


class ToyKind(ModelKind):
    name = "toy"

    def start_training(self, run) -> ToyTraining:
        return ToyTraining(run)

    def load(self, config, worker, manifest):
        model = _build(config, worker.group, manifest)
        return model, {"toy": ToyState(model)}

    def identity(self, config, model) -> dict:
        return {"model.kind": "toy", "model.dim": config.model.dim, "users": model.num_users}

    def export_rows(self, model: ToyModel, rank: int, world_size: int) -> ExportRows:
        start, stop = model.owned
        first, last = rank * model.num_users // world_size, (rank + 1) * model.num_users // world_size
        items = (start, stop, model.items.detach()[start:stop].clone())
        users = (first, last, model.user_vectors(torch.arange(first, last)).clone())
        return ExportRows(items, users, info={"kind": "toy"})


TOY_KIND = ToyKind()
TOY = ModelSpec("toy", f"{__name__}:ToyParams", f"{__name__}:TOY_KIND", "a toy", renamed=(("toy_scale", "scale"),))


def _registered(function):
    """``function`` in a worker process: the toy registered there first (a worker imports this module, not the
    registrations the test process made)."""

    def run(*args):
        register_model_kind(TOY)
        return function(*args)

    return run


def _train(config):
    from bigrank.train.workers import train_worker

    return _registered(train_worker)(config)


def _evaluate(config):
    from bigrank.train.workers import evaluate_worker

    return _registered(evaluate_worker)(config)


def _export(config, out):
    from bigrank.train.workers import export_worker

    return _registered(export_worker)(config, out)


@pytest.fixture
def toy():
    register_model_kind(TOY)
    try:
        yield TOY
    finally:
        MODEL_KINDS.pop("toy", None)


def _raw(root, run_dir, workers=2, **sections) -> dict:
    raw = {
        "data": {"root": str(root)},
        "run_dir": str(run_dir),
        "seed": 7,
        "workers": workers,
        "model": {"kind": "toy", "dim": 8, "params": {"scale": 2.0}},
        "loss": {"name": "softmax"},
        "optim": {"item_lr": 0.1, "lr_decay": "linear"},
        "train": {"batch_size": 200, "epochs": 4, "checkpoint_every": 5, "keep_checkpoints": 10, "log_every": 1},
        "eval": {"every_epochs": 2, "ks": [10], "splits": ["valid", "test"]},
    }
    for section, values in sections.items():
        raw.setdefault(section, {}).update(values)
    raw["train"]["progress"] = False
    return raw


# ---------------------------------------------------------------------------------------------------------- tests
def test_the_config_checks_a_registered_kind_through_its_params(toy, tmp_path):
    config = validate(config_from_dict(_raw(tmp_path, tmp_path / "run")))
    assert config.model.kind == "toy" and config.model.params == {"scale": 2.0}
    assert config_from_dict(_raw(tmp_path, tmp_path / "r", model={"params": {}})).model.params == {"scale": 1.0}
    old = _raw(tmp_path, tmp_path / "r", model={"params": None, "toy_scale": 3.0})  # a renamed key
    assert config_from_dict(old).model.params == {"scale": 3.0}
    for section, values, message in (
        ("model", {"params": {"scale": -1.0}}, "model.params.scale must be > 0"),
        ("model", {"params": {"size": 1}}, "unknown key 'model.params.size': model.kind 'toy' accepts scale"),
        ("loss", {"name": "rankmax"}, "loss.name must be softmax with model.kind toy"),
    ):
        with pytest.raises(ConfigError, match=re.escape(message)):
            config_from_dict(_raw(tmp_path, tmp_path / "run", **{section: values}))
    with pytest.raises(ValueError, match="registered already"):
        register_model_kind(dataclasses.replace(TOY, summary="another"))
    register_model_kind(TOY)  # the same spec again: nothing happens


def test_a_kind_registered_in_the_test_suite_trains_evaluates_and_exports(toy, tiny_dataset, tmp_path):
    """2 workers, 4 epochs (32 steps, checkpoints every 5); the run resumed from its step-15 checkpoint ends with the
    same tables and optimizer state; ``bigrank evaluate``'s worker (on 1 worker) and the export (2) agree with
    brute force over the exported vectors."""
    from bigrank.export.recommend import load_export, read_table

    config = validate(config_from_dict(_raw(tiny_dataset, tmp_path / "two")))
    summary = launch_local(_train, 2, (config,), timeout=300)[0]
    assert summary["steps"] == 32 and summary["last_loss"] < summary["first_loss"]
    assert len(summary["eval_history"]) == 1  # after epoch 2; epoch 4 is the final evaluation
    assert summary["eval"]["test"]["recall@10"] > 0.3  # topic data: a random ranking gets ~0.1
    saved = yaml_model(tmp_path / "two" / "config.yaml")
    assert saved == {**saved, "kind": "toy", "params": {"scale": 2.0}}

    shutil.copytree(tmp_path / "two", tmp_path / "resumed")
    for checkpoint in (tmp_path / "resumed" / "checkpoints").iterdir():
        if int(checkpoint.name.split("-")[1]) > 15:
            shutil.rmtree(checkpoint)
    resumed = validate(config_from_dict(_raw(tiny_dataset, tmp_path / "resumed")))
    after = launch_local(_train, 2, (resumed,), timeout=300)[0]
    assert after["resumed_from"].endswith("step-00000015") and after["steps"] == 32
    two, one = (
        read_checkpoint(path / "checkpoints" / "step-00000032")["toy"]
        for path in (tmp_path / "two", tmp_path / "resumed")
    )
    assert sorted(two) == ["items", "items.step", "items.sum", "users", "users.step", "users.sum"]
    for name in two:
        torch.testing.assert_close(one[name], two[name], rtol=0, atol=0)

    evaluated = launch_local(_evaluate, 1, (config,), timeout=300)[0]
    assert evaluated["test"]["recall@10"] == pytest.approx(summary["eval"]["test"]["recall@10"], abs=1e-9)
    launch_local(_export, 2, (config, str(tmp_path / "export")), timeout=300)
    manifest = load_export(tmp_path / "export")
    assert manifest["model"]["kind"] == "toy" and manifest["fold_in"] == "mean"
    items, users = (
        read_table(tmp_path / "export", manifest, t)["embedding"].astype(np.float64) for t in ("items", "users")
    )
    expected = brute_force_metrics(tiny_dataset, "test", users, items, [10])
    for name in ("accuracy", "recall@10", "ap@10"):
        assert evaluated["test"][name] == pytest.approx(expected[name], abs=1e-6), name


def test_the_nan_guard_of_the_loop_stops_a_kind_before_it_updates(toy, tiny_dataset, tmp_path):
    from bigrank.train.launcher import WorkerError

    config = validate(config_from_dict(_raw(tiny_dataset, tmp_path / "nan", workers=1, debug={"nan_at_step": 3})))
    with pytest.raises(WorkerError, match="loss is nan at step 3"):
        launch_local(_train, 1, (config,), timeout=300)


def yaml_model(path) -> dict:
    import yaml

    return yaml.safe_load(Path(path).read_text())["model"]


def test_no_module_outside_a_kinds_own_names_the_kind():
    """Every kind but the default (whose name is everyday vocabulary: 'towers') is named only in its own modules
    (their path holds its name) and in its registry entry."""
    for name in MODEL_KINDS:
        if name == "towers":
            continue
        camel = "".join(part.title() for part in name.split("_"))
        pattern = re.compile(rf"\b{name}\b|{camel}")
        named = sorted(
            str(path.relative_to(REPO))
            for path in (REPO / "bigrank").rglob("*.py")
            if name not in path.stem and pattern.search(path.read_text())
        )
        assert named == ["bigrank/model/registry.py"], f"{name} is named in {named}"


def test_the_docs_list_the_kinds():
    text = (REPO / "docs" / "architecture.md").read_text()
    assert markdown_table() in text, "docs/architecture.md: paste bigrank.model.registry.markdown_table()"


def test_configs_written_before_model_params_load_and_resume_as_they_were(tmp_path):
    """Saved runs hold ``model.item_item_l2`` (every kind's config.yaml had it): an item-item run's becomes
    ``model.params.l2``, a towers run's is dropped (it never did anything there), and a resume compares equal."""
    for kind, params in (("item_item", {"l2": 0.25}), ("towers", {})):
        saved = {"data": {"root": "d"}, "run_dir": "r", "model": {"kind": kind, "dim": 8, "item_item_l2": 0.25}}
        if kind == "item_item":
            saved.update(loss={"name": "rankmax"}, optim={"item_optimizer": "adam"})
        config = config_from_dict(saved, base_dir=tmp_path)
        assert config.model.params == params and "item_item_l2" in saved["model"]  # the caller's dict is left as is
        today = json.loads(json.dumps(saved))
        today["model"] = {"kind": kind, "dim": 8, "params": params}
        assert resume_changes(config.to_dict(), config_from_dict(today, base_dir=tmp_path).to_dict()) == ({}, {})
