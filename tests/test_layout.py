"""Table layouts (``model.layout``): the cost model's choices, and training on real gloo workers with each table
replicated or row-sharded — the same model either way, replicas that stay equal, checkpoints that resume in
the other layout."""

from __future__ import annotations

import logging
import shutil

import pytest
import torch

from bigrank.config import ConfigError, config_from_dict
from bigrank.model.layout import Link, StepShape, choose_layouts, format_layout_plan, measure_link, predict_step
from bigrank.train.launcher import launch_local
from tests.conftest import read_checkpoint, tiny_config

# An order of magnitude of this machine (measure_link on 2 local gloo workers): 175 µs-1 ms a collective, ~1 GB/s.
LINK = Link(latency_s=175e-6, bandwidth_bytes_s=1e9, update_s_per_element=2e-9)
ALL = {"catalog": "auto", "user_table": "auto", "history_table": "auto"}


def _shape(**changes) -> StepShape:
    values = dict(world_size=2, batch_size=512, dim=32, num_items=1_500, num_users=2_000)
    values.update(changes)
    return StepShape(**values)


# ------------------------------------------------------------------------------------------------ cost model
def test_replicated_bytes_grow_with_the_table_and_sharded_bytes_with_the_batch():
    small, large = _shape(), _shape(num_items=850_000, num_users=2_200_000)
    replicated = {"catalog": "replicated", "user_table": "replicated"}
    sharded = {"catalog": "sharded", "user_table": "sharded"}
    assert predict_step(large, replicated).bytes > 100 * predict_step(small, replicated).bytes
    assert predict_step(large, sharded).bytes == predict_step(small, sharded).bytes
    assert predict_step(small, replicated).collectives < predict_step(small, sharded).collectives
    wider = _shape(batch_size=4096)
    assert predict_step(wider, sharded).bytes == pytest.approx(8 * predict_step(small, sharded).bytes)


def test_auto_replicates_a_small_catalog_and_shards_an_ml1b_sized_one():
    assert choose_layouts(_shape(), ALL, LINK) == {"catalog": "replicated", "user_table": "replicated"}
    ml1b = _shape(num_items=849_000, num_users=2_200_000, dim=64, batch_size=256)
    assert choose_layouts(ml1b, ALL, LINK) == {"catalog": "sharded", "user_table": "sharded"}
    # Sampled candidates send only the touched rows when replicated, so a big catalog may stay replicated
    # while the 2.2M-row user table (a dense gradient) is sharded.
    sampled = _shape(num_items=849_000, num_users=2_200_000, dim=64, batch_size=4096, full_catalog=False,
                     num_negatives=8192)  # fmt: skip
    assert choose_layouts(sampled, ALL, LINK)["user_table"] == "sharded"


def test_a_requested_layout_is_kept_and_one_worker_is_one_shard():
    requested = {"catalog": "sharded", "user_table": "auto"}
    assert choose_layouts(_shape(), requested, LINK) == {"catalog": "sharded", "user_table": "replicated"}
    assert choose_layouts(_shape(world_size=1), {"catalog": "replicated"}, LINK) == {
        "catalog": "sharded",
        "user_table": "sharded",
    }
    with pytest.raises(ValueError, match="layout of catalog"):
        choose_layouts(_shape(), {"catalog": "everywhere"}, LINK)


def test_the_plan_lists_every_assignment_and_marks_the_chosen_one():
    shape = _shape(history=True, mean_history=40.0)
    chosen = choose_layouts(shape, ALL, LINK)
    text = format_layout_plan(shape, ALL, chosen, LINK)
    rows = [line for line in text.splitlines() if line.startswith("  catalog ")]
    assert text.count("<- chosen") == 1 and len(rows) == 8
    assert "collective wait 175 µs" in text


def test_each_table_is_charged_its_own_optimizers_update():
    # A replicated catalog is updated with the catalog's optimizer, a replicated tower table with the tower's:
    # an Adagrad catalog with weight decay (~2 ns/element here) against row-wise Adagrad users (~0.6 ns).
    shape = _shape(history=True, mean_history=40.0)
    catalog_only = {"catalog": "replicated", "user_table": "sharded", "history_table": "sharded"}
    tower_only = {"catalog": "sharded", "user_table": "replicated", "history_table": "replicated"}
    slow_catalog = Link(175e-6, 1e9, update_s_per_element=2e-9, tower_update_s_per_element=0.5e-9)
    cost = predict_step(shape, catalog_only)
    assert cost.update_elements == shape.num_items * shape.dim and cost.tower_update_elements == 0
    assert cost.seconds(slow_catalog) - cost.seconds(LINK) == pytest.approx(0.0)  # LINK charges 2e-9 for all
    tower = predict_step(shape, tower_only)
    assert tower.tower_update_elements == (shape.num_users + shape.num_items) * shape.dim
    saved = tower.tower_update_elements * (2e-9 - 0.5e-9)
    assert tower.seconds(LINK) - tower.seconds(slow_catalog) == pytest.approx(saved)
    assert "dense update 2.00 ns/element (catalog), 0.50 (user tower)" in slow_catalog.describe()


def test_measure_link_times_the_optimizers_it_is_given():
    calls = {"catalog": [], "tower": []}

    def factory(table):
        def make(weight):
            assert isinstance(weight, torch.nn.Parameter) and weight.dim() == 2
            return lambda grad: calls[table].append(grad.shape)

        return make

    link = measure_link(None, "cpu", catalog_update=factory("catalog"), tower_update=factory("tower"))
    assert len(calls["catalog"]) > 1 and len(calls["tower"]) > 1  # a warm-up call, then the timed ones
    assert link.latency_s == 0.0 and link.bandwidth_bytes_s == float("inf")  # one process: no collective
    assert link.update_s_per_element > 0 and link.tower_update_s > 0


def test_bad_layout_keys_and_values_name_the_key():
    base = {"data": {"root": "d"}, "run_dir": "r"}
    with pytest.raises(ConfigError, match="model.layout must be one of"):
        config_from_dict({**base, "model": {"layout": "everywhere"}})
    with pytest.raises(ConfigError, match="model.layout.history_table is not a table of this model"):
        config_from_dict({**base, "model": {"layout": {"history_table": "replicated"}}})
    with pytest.raises(ConfigError, match="model.layout.catalog must be one of"):
        config_from_dict({**base, "model": {"layout": {"catalog": "both"}}})


# ------------------------------------------------------------------------------------------- real training
RUN = {
    "seed": 5,
    "model": {"history": True},
    "loss": {"name": "rankmax"},
    "optim": {
        "user_optimizer": "rowwise_adagrad",
        "user_lr": 0.1,
        "item_lr": 0.1,
        "item_optimizer": "adagrad",
        "user_l2": 0.01,
    },  # fmt: skip
    # fp32: the layouts reduce in other orders, which moves bf16 scores by whole bf16 steps (equal to rounding).
    "train": {"batch_size": 120, "epochs": 2, "max_steps": 8, "precision": "fp32"},
    "eval": {"every_epochs": None, "at_end": False, "ks": [10], "splits": ["valid"]},
}


def _config(root, run_dir, layout, workers=2, **sections):
    return tiny_config(root, run_dir, RUN, {"model": {"layout": layout}}, workers=workers, **sections)


def _train_and_hold(config):
    """Train; return every table as this rank holds it (whole when replicated), the warnings a handler of the root
    logger got (``held["root warnings"]``), every "Sharding spec not found" record made, whether handled or
    filtered, as (logger, level) (``held["spec records"]``) and the run's layout."""
    import logging

    from bigrank.model.tables import local_table_rows
    from bigrank.train.trainer import Trainer

    class Collect(logging.Handler):
        messages: list[str] = []

        def emit(self, record):
            self.messages.append(record.getMessage())

    made, factory = [], logging.getLogRecordFactory()

    def record_factory(*args, **kwargs):  # sees a record as it is made, before any filter
        record = factory(*args, **kwargs)
        if str(record.msg).startswith("Sharding spec not found"):
            made.append((record.name, record.levelno))
        return record

    collect = Collect(logging.WARNING)
    logging.getLogger().addHandler(collect)
    logging.setLogRecordFactory(record_factory)
    trainer = Trainer(config)
    summary = trainer.train()
    logging.setLogRecordFactory(factory)
    logging.getLogger().removeHandler(collect)
    module = trainer.model.user_module
    held = {"catalog": trainer.model.shard.weight.detach().clone(), "root warnings": collect.messages}
    held["spec records"] = made
    for table in ("user_table", "history_table"):
        held[table] = local_table_rows(module, table)[2].detach().clone()
    return summary, trainer.model.layout, held


def _tables(checkpoint) -> dict[str, torch.Tensor]:
    state = read_checkpoint(checkpoint)
    tower = state["tower"]
    tables = {
        "catalog": state["catalog"]["weight"],
        "item sum": state["catalog"]["optimizer"]["rows"]["sum"],
        "users": tower["model"]["tables.embedding_bags.user_table.weight"],
        "history": tower["model"]["tables.embedding_bags.history_table.weight"],
    }
    for table in ("user_table", "history_table"):
        tables[f"{table} momentum"] = tower["optimizer"]["state"][f"tables.embedding_bags.{table}.weight"][
            f"{table}.momentum1"
        ]
    return tables


@pytest.fixture(scope="module")
def layout_runs(tiny_dataset, tmp_path_factory):
    root = tmp_path_factory.mktemp("layouts")
    layouts = {
        "sharded": "sharded",
        "replicated": "replicated",
        "mixed": {"catalog": "replicated", "user_table": "sharded", "history_table": "replicated"},
    }
    runs = {}
    for name, layout in layouts.items():
        results = launch_local(_train_and_hold, 2, (_config(tiny_dataset, root / name, layout),), timeout=300)
        runs[name] = (root / name, results)
    return runs


def test_every_layout_trains_the_same_model(layout_runs):
    sharded = _tables(layout_runs["sharded"][0] / "checkpoints" / "step-00000008")
    initial_gap = None
    for name in ("replicated", "mixed"):
        run_dir, results = layout_runs[name]
        assert results[0][1]["catalog"] == "replicated"
        tables = _tables(run_dir / "checkpoints" / "step-00000008")
        assert set(tables) == set(sharded)
        for key, tensor in sharded.items():
            torch.testing.assert_close(tables[key], tensor, rtol=1e-4, atol=1e-5, msg=f"{name}: {key}")
        losses = [r[0]["last_loss"] for r in results]
        assert losses[0] == losses[1]  # one global loss on every rank
        assert results[0][0]["last_loss"] == pytest.approx(layout_runs["sharded"][1][0][0]["last_loss"], rel=1e-4)
        initial_gap = (tables["catalog"] - sharded["catalog"]).abs().max()
    # Not trivially equal: training moved the rows far more than the layouts differ.
    assert (sharded["item sum"] > 0).any() and initial_gap < 1e-4


def test_replicated_tables_stay_equal_on_every_worker(layout_runs):
    _, results = layout_runs["replicated"]
    (_, layout, first), (_, _, second) = results
    assert layout == {"catalog": "replicated", "user_table": "replicated", "history_table": "replicated"}
    for table in ("catalog", "user_table", "history_table"):
        assert first[table].shape == second[table].shape and torch.equal(first[table], second[table]), table
    _, mixed = layout_runs["mixed"]
    assert mixed[0][2]["user_table"].shape[0] < first["user_table"].shape[0]  # the sharded table: half each


def test_replicated_tables_log_no_missing_sharding_spec(layout_runs):
    # torchrec's plan check warns "Sharding spec not found" for every data-parallel table: by design, not news.
    # It does warn (on rank 0, which plans), on the root logger, whose handlers get warnings: only bigrank's filter
    # keeps it from them.
    for name in ("replicated", "mixed"):
        made = [record for _, _, held in layout_runs[name][1] for record in held["spec records"]]
        assert made, f"{name}: torchrec no longer warns; the filter has nothing to drop"
        assert all(logger == "root" and level >= logging.WARNING for logger, level in made), made
        for _, _, held in layout_runs[name][1]:
            assert not [m for m in held["root warnings"] if "Sharding spec not found" in m], name


def test_the_plan_says_which_layout_and_why(layout_runs):
    plan = (layout_runs["mixed"][0] / "plan.txt").read_text()
    assert "requested: catalog replicated, user_table sharded, history_table replicated" in plan
    assert "<- chosen" in plan and "data_parallel" in plan and "row_wise" in plan
    assert "kernel chunked (auto: training on cpu: the fused kernels run on CUDA)" in plan  # train.kernel


@pytest.mark.parametrize(("first", "then", "workers"), [("replicated", "sharded", 2), ("sharded", "replicated", 3)])
def test_a_checkpoint_resumes_in_the_other_layout(tiny_dataset, layout_runs, tmp_path, first, then, workers):
    """A run stopped at step 4 in one layout and finished in the other ends, to float rounding, where a run that
    goes on in its first layout does: on 2 workers that is the straight sharded run (same data, same global
    batches); 3 workers re-split the rest of the epoch, so there it is the same checkpoint resumed on 3 workers in
    the first layout."""
    run_dir = tmp_path / "run"
    launch_local(_train_and_hold, 2, (_config(tiny_dataset, run_dir, first, train={"max_steps": 4}),), timeout=300)
    if workers == 2:
        reference = layout_runs["sharded"][0]
    else:
        reference = tmp_path / "reference"
        shutil.copytree(run_dir, reference)
        launch_local(_train_and_hold, workers, (_config(tiny_dataset, reference, first, workers),), timeout=300)
    results = launch_local(_train_and_hold, workers, (_config(tiny_dataset, run_dir, then, workers),), timeout=300)
    assert results[0][0]["resumed_from"].endswith("step-00000004") and results[0][0]["steps"] == 8
    assert results[0][1]["catalog"] == then
    expected = _tables(reference / "checkpoints" / "step-00000008")
    resumed = _tables(run_dir / "checkpoints" / "step-00000008")
    for key, tensor in expected.items():
        torch.testing.assert_close(resumed[key], tensor, rtol=1e-4, atol=1e-5, msg=key)


def test_a_sampled_loss_on_a_replicated_catalog_keeps_the_replicas_equal(tiny_dataset, tmp_path):
    config = _config(
        tiny_dataset,
        tmp_path / "sampled",
        {"catalog": "replicated", "user_table": "sharded", "history_table": "sharded"},
        loss={"name": "sampled_softmax", "num_negatives": 16},
        train={"max_steps": 12},
    )
    (summary, layout, first), (_, _, second) = launch_local(_train_and_hold, 2, (config,), timeout=300)
    assert layout["catalog"] == "replicated" and torch.equal(first["catalog"], second["catalog"])
    assert summary["last_loss"] < summary["first_loss"]
