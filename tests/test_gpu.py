"""The GPU path: losses, chunked scoring, the catalog's top-K and a short training run on CUDA.

Every test here is marked ``gpu`` and skips with a reason where CUDA is missing (run them alone with
``pytest -m gpu``). References are the CPU computations of the same inputs, in float32 with TF32 off, so the
CUDA results must agree to float32 rounding; the per-row statistics are float64 on both devices.
"""

from __future__ import annotations

import math
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bigrank.losses import kernels, rankmax_loss, softmax_loss, sparsemax_loss
from bigrank.losses.scores import score_matrix
from bigrank.model.catalog import CatalogShard, distributed_topk, shard_range

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() is False)"),
]

ROOT = Path(__file__).resolve().parents[1]
LOSSES = {
    "softmax": softmax_loss,
    "rankmax_k1": lambda s, y, **kw: rankmax_loss(s, y, k=1, **kw),
    "rankmax_k10": lambda s, y, **kw: rankmax_loss(s, y, k=10, **kw),
    "sparsemax": sparsemax_loss,
}
N, B, D = 5003, 64, 32


@pytest.fixture(autouse=True)
def true_fp32():
    """TF32 off: CUDA GEMMs in true float32, comparable with the CPU's."""
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    yield
    torch.set_float32_matmul_precision(before)


def factors(seed=0, device="cpu"):
    generator = torch.Generator().manual_seed(seed)
    users = torch.randn(B, D, generator=generator)
    items = torch.randn(N, D, generator=generator) * 0.5
    target = torch.randint(0, N, (B,), generator=generator)
    target[:4] = torch.topk(users[:4] @ items.T, 1).indices[:, 0]  # positives inside the top k (Rankmax pass 2)
    return users.to(device), items.to(device), target.to(device)


def run(loss_fn, users, items, target, chunk_size=None, dtype=None):
    users = users.clone().requires_grad_(True)
    items = items.clone().requires_grad_(True)
    loss = loss_fn(score_matrix(users, items, chunk_size, dtype), target)
    loss.backward()
    return loss.detach().cpu(), users.grad.cpu(), items.grad.cpu()


@pytest.mark.parametrize("name", list(LOSSES))
def test_dense_losses_on_cuda_equal_cpu(name):
    generator = torch.Generator().manual_seed(1)
    scores = torch.randn(B, N, generator=generator) * 2
    target = torch.randint(0, N, (B,), generator=generator)
    results = []
    for device in ("cpu", "cuda"):
        s = scores.to(device, copy=True).requires_grad_(True)  # a fresh leaf on each device
        loss = LOSSES[name](s, target.to(device))
        loss.backward()
        assert loss.device.type == device and s.grad.device.type == device
        results.append((loss.detach().cpu(), s.grad.cpu()))
    torch.testing.assert_close(results[1][0], results[0][0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(results[1][1], results[0][1], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("name", list(LOSSES))
@pytest.mark.parametrize("chunk_size", [None, 777, "auto"])
def test_scored_losses_on_cuda_equal_cpu(name, chunk_size):
    cpu = run(LOSSES[name], *factors(), chunk_size=chunk_size)
    cuda = run(LOSSES[name], *factors(device="cuda"), chunk_size=chunk_size)
    for got, want in zip(cuda, cpu, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", list(LOSSES))
def test_chunked_equals_dense_on_cuda(name):
    dense = run(LOSSES[name], *factors(2, "cuda"))
    chunked = run(LOSSES[name], *factors(2, "cuda"), chunk_size=500)
    for got, want in zip(chunked, dense, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", list(LOSSES))
def test_bf16_on_cuda_stays_close_to_fp32(name):
    fp32 = run(LOSSES[name], *factors(3, "cuda"), chunk_size=1000)
    bf16 = run(LOSSES[name], *factors(3, "cuda"), chunk_size=1000, dtype=torch.bfloat16)
    torch.testing.assert_close(bf16[0], fp32[0], rtol=2e-2, atol=2e-2)
    for got, want in zip(bf16[1:], fp32[1:], strict=True):
        cosine = torch.nn.functional.cosine_similarity(got.flatten(), want.flatten(), dim=0)
        # bf16 rounds scores of ~8 to steps of 0.03: Rankmax's support and top-k ties move (0.977 for k=10
        # on CPU with these inputs; fp32 statistics add no error of their own, see test_precision.py)
        assert float(cosine) > 0.95


def test_compiled_kernels_on_cuda_equal_eager(monkeypatch):
    """Large blocks go through torch.compile (Triton on CUDA); the compiled kernels compute the eager values."""
    block = torch.randn(256, 20_000, device="cuda")
    mu = block.amax(dim=1).double() - 1.5
    monkeypatch.setenv("BIGRANK_COMPILE", "0")
    eager = kernels.support_sum_count(block, mu), kernels.max_and_sum_exp(block)
    monkeypatch.setenv("BIGRANK_COMPILE", "1")
    compiled = kernels.support_sum_count(block, mu), kernels.max_and_sum_exp(block)
    assert not kernels._compile_failed, "torch.compile of the loss kernels failed on CUDA (no Triton?)"
    for got, want in zip(compiled, eager, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_distributed_topk_on_cuda_equals_cpu():
    generator = torch.Generator().manual_seed(4)
    scores = torch.randn(B, N, generator=generator)
    scores[:, 10] = scores[:, 11]  # a tie: the lower id comes first on both devices
    exclude = torch.rand(B, N, generator=generator) < 0.1
    want = distributed_topk(scores, 50, exclude=exclude)
    got = distributed_topk(scores.cuda(), 50, exclude=exclude.cuda())
    assert got[0].device.type == "cuda"
    torch.testing.assert_close(got[0].cpu(), want[0])
    torch.testing.assert_close(got[1].cpu(), want[1])


def test_catalog_shard_lives_on_the_device():
    shard = CatalogShard(N, D, device="cuda")
    cpu_shard = CatalogShard(N, D)
    torch.testing.assert_close(shard.weight.detach().cpu(), cpu_shard.weight.detach())  # same initial rows
    users, _, target = factors(device="cuda")
    loss = softmax_loss(score_matrix(users, shard.weight, "auto"), target)
    loss.backward()
    assert shard.weight.grad.device.type == "cuda"


def _two_gpu_worker(rank, world_size, init_file, inputs, results):
    import torch.distributed as dist

    from bigrank.devices import process_group_backend

    torch.cuda.set_device(rank)
    torch.set_float32_matmul_precision("highest")
    dist.init_process_group(
        process_group_backend("cuda"), rank=rank, world_size=world_size, init_method=f"file://{init_file}"
    )
    try:
        users, items, target = (t.cuda() for t in inputs)
        start, stop = shard_range(items.shape[0], rank, world_size)
        out = {}
        for name, loss_fn in LOSSES.items():
            u = users.clone().requires_grad_(True)
            v = items[start:stop].clone().requires_grad_(True)
            loss = loss_fn(score_matrix(u, v, 600), target, group=dist.group.WORLD, offset=start)
            loss.backward()
            out[name] = (loss.detach().cpu(), u.grad.cpu(), v.grad.cpu())
        scores = users @ items[start:stop].T
        values, ids = distributed_topk(scores, 20, group=dist.group.WORLD, offset=start)
        out["topk"] = (values.cpu(), ids.cpu())
        results.put((rank, pickle.dumps(out)))  # bytes: shared-memory tensors would die with this process
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (nccl: one rank per GPU)")
def test_two_gpus_item_parallel_equals_single_process(tmp_path):
    """2 ranks on 2 GPUs (cpu:gloo,cuda:nccl), uneven shards: losses, gradients and top-K equal one CPU process."""
    import torch.multiprocessing as mp

    inputs = factors(5)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_two_gpu_worker, args=(rank, 2, tmp_path / "pg", inputs, results)) for rank in range(2)]
    for proc in procs:
        proc.start()
    outputs = {rank: pickle.loads(payload) for rank, payload in (results.get(timeout=300) for _ in procs)}
    for proc in procs:
        proc.join(timeout=60)
        assert proc.exitcode == 0
    users, items, target = inputs
    for name, loss_fn in LOSSES.items():
        loss, grad_users, grad_items = run(loss_fn, users, items, target)
        for rank in range(2):
            start, stop = shard_range(N, rank, 2)
            got_loss, got_users, got_items = outputs[rank][name]
            torch.testing.assert_close(got_loss, loss, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(got_items, grad_items[start:stop], rtol=1e-4, atol=1e-5)
        # each rank holds its partial dL/dU; their sum is the full gradient
        torch.testing.assert_close(outputs[0][name][1] + outputs[1][name][1], grad_users, rtol=1e-4, atol=1e-5)
    want = distributed_topk(users @ items.T, 20)
    for rank in range(2):
        torch.testing.assert_close(outputs[rank]["topk"][0], want[0], rtol=1e-5, atol=1e-5)
        assert torch.equal(outputs[rank]["topk"][1], want[1])


def _has_cuda_stack() -> str | None:
    """Why the 1-GPU training run cannot run here (fbgemm's CPU build: the CPU .venv on a GPU machine), or None.
    torchrec, fbgemm and pyarrow are pinned in both venvs: one missing is a failure, not a reason to skip."""
    import fbgemm_gpu  # noqa: F401 - registers torch.ops.fbgemm

    if not hasattr(torch.ops.fbgemm, "asynchronous_complete_cumsum") or "cpu" in str(
        getattr(fbgemm_gpu, "__variant__", "")
    ):
        return "fbgemm_gpu is the CPU build (install fbgemm-gpu 1.8.0, requirements-cuda.txt)"
    return None


def _device_types(tree) -> set[str]:
    """The device types of the tensors in ``tree`` (nested dicts; a ShardedTensor counts by its local shards) that
    have at least one dimension: row state, not a step counter the host may keep."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    if isinstance(tree, dict):
        return set().union(*map(_device_types, tree.values()))
    if isinstance(tree, ShardedTensor):
        return {shard.tensor.device.type for shard in tree.local_shards() if shard.tensor.dim() > 0}
    return {tree.device.type} if torch.is_tensor(tree) and tree.dim() > 0 else set()


def _train_and_place(config):
    """Train; return the run's summary and where its parts are (device types) after the last step."""
    from bigrank.model.sharding import tower_checkpoint_state
    from bigrank.train.trainer import Trainer

    trainer = Trainer(config)
    summary = trainer.train()
    tower = tower_checkpoint_state(trainer.model.tower)  # the DistributedModelParallel and its fused optimizer
    return summary, {
        "catalog": _device_types({"weight": trainer.model.shard.weight}),
        "catalog optimizer": _device_types(trainer.item_optimizer.row_state()),
        "user table": _device_types(tower["model"]),
        "user optimizer": _device_types(tower.get("optimizer", {})),
    }


def test_one_gpu_training_run_of_a_few_steps(tiny_dataset, tmp_path, capfd):
    """The local launcher trains on cuda:0: the trainer reports that device; torchrec's user table (fbgemm-gpu),
    the catalog and both optimizers' states are on the GPU after the last step; the loss is finite and a
    checkpoint is written."""
    from bigrank.config import config_from_dict
    from bigrank.devices import process_group_backend
    from bigrank.train.launcher import launch_local

    reason = _has_cuda_stack()
    if reason:
        pytest.skip(reason)
    config = config_from_dict(
        {
            "data": {"root": str(tiny_dataset)},
            "run_dir": str(tmp_path / "run"),
            "workers": 1,
            "model": {"dim": 16},
            "loss": {"name": "rankmax", "params": {"k": 3}},
            "train": {"batch_size": 64, "max_steps": 5, "log_every": 1, "progress": False, "device": "cuda"},
            "eval": {"at_end": False, "every_epochs": None},
        }
    )
    backend = process_group_backend("cuda")  # as the CLI's local launcher starts GPU workers
    ((summary, placed),) = launch_local(_train_and_place, 1, (config,), backend=backend, timeout=600)
    assert "training on cuda:0 " in capfd.readouterr().out
    assert placed == dict.fromkeys(placed, {"cuda"}), placed
    assert summary["steps"] == 5 and math.isfinite(summary["first_loss"]) and math.isfinite(summary["last_loss"])
    assert list((tmp_path / "run" / "checkpoints").glob("step-*"))


def test_control_group_on_an_nccl_world(tmp_path):
    """An nccl-only world cannot carry CPU tensors: init_control_group adds a gloo group that can."""
    script = f"""
import torch, torch.distributed as dist
from bigrank.distributed import groups
torch.cuda.set_device(0)
dist.init_process_group("nccl", rank=0, world_size=1, init_method="file://{tmp_path}/pg")
assert not groups.supports_cpu_tensors() and groups.supports_cuda_tensors()
assert str(groups.collective_device()) == "cuda:0"
control = groups.init_control_group()
assert control is not dist.group.WORLD and groups.control_group() is control
parts = [torch.empty(1, dtype=torch.int64)]
dist.all_gather(parts, torch.tensor([7]), group=control)
assert parts[0].item() == 7
dist.destroy_process_group()
print("ok")
"""
    result = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])},
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().endswith("ok")


@pytest.mark.parametrize("name", ["softmax", "rankmax_k1"])
@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_fused_kernels_on_cuda_equal_chunked(name, dtype, tolerance):
    """train.kernel=fused compiled for the GPU (not interpreted) against the chunked path, on the same device
    (tolerances as in tests/test_fused_losses.py: relative to the largest gradient entry; TF32 off)."""
    from bigrank.losses.fused.source import kernel_scores

    users, items, target = factors(device="cuda")
    results = {}
    for kernel in ("chunked", "fused"):
        u, v = users.clone().requires_grad_(True), items.clone().requires_grad_(True)
        loss = LOSSES[name](kernel_scores(u, v, 1000, dtype, kernel=kernel), target)
        loss.backward()
        results[kernel] = (loss.detach(), u.grad, v.grad)
    (loss, grad_u, grad_v), (ref_loss, ref_u, ref_v) = results["fused"], results["chunked"]
    torch.testing.assert_close(loss, ref_loss, rtol=1e-4, atol=0)
    for fused, chunked in ((grad_u, ref_u), (grad_v, ref_v)):
        assert float((fused - chunked).abs().max() / chunked.abs().max()) <= tolerance
