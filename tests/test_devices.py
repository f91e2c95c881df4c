"""Device resolution, the GPU pre-flight errors and the precision set-up, on a machine without a GPU.

The GPU side of these rules (``cuda:LOCAL_RANK``, Ray's device, nccl) runs in ``tests/test_gpu.py`` where CUDA
exists; here every request for a GPU must fail before training with a message that says what to change.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from bigrank.config import ConfigError, config_from_dict
from bigrank.devices import (
    DeviceError,
    check_devices,
    check_ray_gpus,
    cpu_bf16_gemm,
    process_group_backend,
    resolve_device_type,
    resolve_precision,
    setup_precision,
    worker_device,
)

ROOT = Path(__file__).resolve().parents[1]
needs_cpu_only_machine = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")


def make_config(tmp_path, **sections):
    raw = {"data": {"root": str(tmp_path / "data")}, "run_dir": str(tmp_path / "run")}
    for key, value in sections.items():
        raw[key] = value
    return config_from_dict(raw)


@pytest.mark.parametrize(
    ("device", "launcher", "gpus_per_worker", "gpu_count", "expected"),
    [
        ("auto", "ray", 0.0, 8, "cpu"),  # Ray: only gpus_per_worker counts, not the driver's GPUs
        ("auto", "ray", 1.0, 0, "cuda"),
        ("auto", "local", 0.0, 0, "cpu"),
        ("auto", "local", 0.0, 2, "cuda"),
        ("cpu", "local", 0.0, 2, "cpu"),
        ("cuda", "local", 0.0, 0, "cuda"),  # explicit requests are kept (and checked by check_devices)
        ("cpu", "ray", 1.0, 0, "cpu"),
    ],
)
def test_device_resolution_rules(device, launcher, gpus_per_worker, gpu_count, expected):
    assert resolve_device_type(device, launcher, gpus_per_worker, gpu_count) == expected


def test_unknown_device_and_launcher_are_errors():
    with pytest.raises(DeviceError, match="train.device must be one of auto, cpu, cuda; got 'gpu'"):
        resolve_device_type("gpu", "local", 0, 0)
    with pytest.raises(ValueError, match="launcher"):
        resolve_device_type("auto", "slurm", 0, 0)


def test_preflight_names_what_to_change(tmp_path):
    cuda = make_config(tmp_path, train={"device": "cuda"})
    with pytest.raises(DeviceError, match=r"CPU-only build: install the CUDA stack \(make setup-cuda"):
        check_devices(cuda, "local", gpu_count=0, cuda_version=None)
    with pytest.raises(DeviceError, match="this machine has none visible.*set train.device=cpu"):
        check_devices(cuda, "local", gpu_count=0, cuda_version="13.0")
    with pytest.raises(DeviceError, match=r"workers=2 local processes need one GPU each, but this machine has 1"):
        check_devices(cuda, "local", gpu_count=1, cuda_version="13.0")
    assert check_devices(cuda, "local", gpu_count=2, cuda_version="13.0") == "cuda"
    # auto on a 1-GPU machine with 2 workers: the same clear error, not a silent fallback
    auto = make_config(tmp_path)
    with pytest.raises(DeviceError, match="set workers=1"):
        check_devices(auto, "local", gpu_count=1, cuda_version="13.0")
    assert check_devices(auto, "local", gpu_count=0, cuda_version=None) == "cpu"


def test_preflight_under_ray_checks_gpus_per_worker(tmp_path):
    for gpus in (0.0, 0.5, 2.0):
        config = make_config(tmp_path, train={"device": "cuda"}, ray={"gpus_per_worker": gpus})
        with pytest.raises(DeviceError, match="needs ray.gpus_per_worker=1"):
            check_devices(config, "ray")
    # Ray workers run elsewhere: a CPU-only driver may submit GPU work
    gpu_run = make_config(tmp_path, ray={"gpus_per_worker": 1.0})
    assert check_devices(gpu_run, "ray", gpu_count=0, cuda_version=None) == "cuda"
    idle = make_config(tmp_path, train={"device": "cpu"}, ray={"gpus_per_worker": 1.0})
    with pytest.raises(DeviceError, match="reserves GPUs that would stay idle"):
        check_devices(idle, "ray")
    with pytest.raises(DeviceError, match=r"need 2 GPUs, but the Ray cluster has 1"):
        check_ray_gpus(gpu_run, 1.0)
    check_ray_gpus(gpu_run, 2.0)
    check_ray_gpus(make_config(tmp_path), 0.0)


def test_precision_and_optimizer_that_need_cuda_are_refused_on_cpu(tmp_path):
    with pytest.raises(ConfigError, match="train.precision tf32 is a CUDA tensor-core mode"):
        make_config(tmp_path, train={"device": "cpu", "precision": "tf32"})
    with pytest.raises(ConfigError, match="optim.user_optimizer adam runs in fbgemm's fused CUDA kernels only"):
        make_config(tmp_path, train={"device": "cpu"}, optim={"user_optimizer": "adam"})
    with pytest.raises(ConfigError, match="train.precision must be one of auto, fp32, tf32, bf16; got 'fp16'"):
        make_config(tmp_path, train={"precision": "fp16"})
    tf32_auto = make_config(tmp_path, train={"precision": "tf32"})  # auto: known only at pre-flight
    with pytest.raises(DeviceError, match="tf32 is a CUDA tensor-core mode"):
        check_devices(tf32_auto, "local", gpu_count=0, cuda_version=None)
    adam_auto = make_config(tmp_path, optim={"user_optimizer": "adam"})
    with pytest.raises(DeviceError, match="adam runs in fbgemm's fused CUDA kernels only"):
        check_devices(adam_auto, "local", gpu_count=0, cuda_version=None)
    assert check_devices(adam_auto, "local", gpu_count=2, cuda_version="13.0") == "cuda"


@needs_cpu_only_machine
def test_worker_device_on_a_machine_without_gpu(monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert worker_device("auto", launcher="local") == torch.device("cpu")
    assert worker_device("cpu", launcher="local") == torch.device("cpu")
    with pytest.raises(DeviceError, match="asks for a GPU"):
        worker_device("cuda", launcher="local")


def test_setup_precision_sets_the_matmul_mode_and_the_score_dtype():
    before = torch.get_float32_matmul_precision()
    try:
        bf16 = setup_precision("bf16", "cpu")
        assert (bf16.score_dtype, bf16.matmul) == (torch.bfloat16, "highest")
        assert torch.get_float32_matmul_precision() == "highest"
        fp32 = setup_precision("fp32", "cpu")
        assert fp32.score_dtype == torch.float32
        with pytest.raises(DeviceError, match="tf32 is a CUDA tensor-core mode"):
            setup_precision("tf32", "cpu")
        with pytest.raises(DeviceError, match="must be one of auto, fp32, tf32, bf16"):
            setup_precision("fp8", "cpu")
        auto = setup_precision("auto", "cpu")  # this machine's answer, with the reason
        assert auto.name == ("bf16" if cpu_bf16_gemm() else "fp32") and auto.reason.startswith("auto: ")
        assert auto.describe() == f"{auto.name} ({auto.reason})"
        assert setup_precision("fp32", "cpu").describe() == "fp32 (requested)"
    finally:
        torch.set_float32_matmul_precision(before)


def test_auto_precision_is_bf16_only_on_a_cpu_with_bf16_units():
    assert resolve_precision("auto", "cpu", bf16_units=True)[0] == "bf16"
    assert resolve_precision("auto", "cpu", bf16_units=False) == ("fp32", "auto: this CPU has no bf16 GEMM units")
    assert resolve_precision("auto", "cuda", bf16_units=True)[0] == "fp32"  # measured on CPUs only
    for chosen in ("fp32", "bf16", "tf32"):
        assert resolve_precision(chosen, "cpu", bf16_units=True) == (chosen, "requested")
    assert make_config(Path("."), train={}).train.precision == "auto"  # the default


def test_process_group_backend():
    assert process_group_backend("cpu") == "gloo"
    assert process_group_backend("cuda") == "cpu:gloo,cuda:nccl"
    with pytest.raises(ValueError, match="cpu or cuda"):
        process_group_backend("mps")


@needs_cpu_only_machine
def test_cli_train_asking_for_a_gpu_fails_before_any_worker_starts(tmp_path, capsys):
    from bigrank.cli import main

    config = tmp_path / "run.yaml"
    # No dataset at data.root: the device check must come first (no process, no dataset read).
    config.write_text(f"data: {{root: {tmp_path / 'missing'}}}\nrun_dir: {tmp_path / 'run'}\n")
    code = main(["train", str(config), "--launcher", "local", "--set", "train.device=cuda"])
    assert code == 2
    err = capsys.readouterr().err
    assert "bigrank train: error: train.device=cuda asks for a GPU" in err
    assert "train.device=cpu" in err
    assert not (tmp_path / "run").exists()


def test_control_group_on_a_gloo_world(tmp_path):
    """A gloo (or cpu:gloo,…) world carries CPU tensors itself: no extra group, collectives on the CPU."""
    script = textwrap.dedent(
        f"""
        import torch.distributed as dist
        from bigrank.distributed import groups
        dist.init_process_group("cpu:gloo,cuda:gloo", rank=0, world_size=1, init_method="file://{tmp_path}/pg")
        assert groups.supports_cpu_tensors() and not groups.supports_cuda_tensors()
        assert groups.init_control_group() is dist.group.WORLD
        assert groups.control_group() is dist.group.WORLD
        assert str(groups.collective_device()) == "cpu"
        dist.destroy_process_group()
        print("ok")
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=_env())
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def _env():
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}


def test_losses_catalog_and_benchmark_import_without_torchrec_ray_or_fbgemm():
    """The GPU benchmark machine may have only PyTorch: these modules must not need the rest of the stack."""
    script = textwrap.dedent(
        """
        import sys
        class Block:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in ("torchrec", "ray", "fbgemm_gpu", "pyarrow"):
                    raise ImportError(f"blocked: {name}")
        sys.meta_path.insert(0, Block())
        import bigrank.losses, bigrank.model.catalog, bigrank.devices, bigrank.distributed.groups
        import benchmarks.bench_losses
        print("ok")
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=_env(), cwd=ROOT
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def test_model_sharding_does_not_import_the_tower_module():
    """Issue 12: no import cycle between model/sharding.py and model/towers.py (shared names: model/tables.py)."""
    script = "import sys, bigrank.model.sharding; print('bigrank.model.towers' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=_env())
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"


def test_cuda_planner_topology_uses_the_device_memory_and_stock_sharders():
    """What shard_row_wise builds on CUDA, checked without a GPU: a cuda topology with the given HBM and the
    stock torchrec sharders (the row-wise CPU subclasses stay for CPU); adam is a fused optimizer on CUDA only."""
    from torchrec.distributed.embedding import EmbeddingCollectionSharder
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder

    from bigrank.model.sharding import fused_params, planner_topology, row_wise_sharders

    hbm = 80 * 1024**3
    topology = planner_topology("cuda", 4, local_world_size=2, hbm_cap_bytes=hbm)
    assert topology.compute_device == "cuda"
    assert topology.world_size == 4 and topology.local_world_size == 2
    assert [device.storage.hbm for device in topology.devices] == [hbm] * 4
    cpu_topology = planner_topology("cpu", 2, local_world_size=2)
    assert cpu_topology.compute_device == "cpu"

    adam = fused_params("adam", 0.01, weight_decay=1e-4, device_type="cuda")
    assert adam["optimizer"].name == "ADAM" and adam["weight_decay"] == 1e-4
    with pytest.raises(ValueError, match="not supported by fbgemm on CPU"):
        fused_params("adam", 0.01, device_type="cpu")
    cuda_sharders = row_wise_sharders(adam, "cuda")
    assert [type(s) for s in cuda_sharders] == [EmbeddingBagCollectionSharder, EmbeddingCollectionSharder]
    cpu_sharders = row_wise_sharders(fused_params("sgd", 0.01), "cpu")
    assert all(type(s) not in (EmbeddingBagCollectionSharder, EmbeddingCollectionSharder) for s in cpu_sharders)
    assert all("row_wise" in s.sharding_types("cpu") for s in cpu_sharders)
