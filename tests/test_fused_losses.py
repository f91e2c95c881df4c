"""The fused Triton kernels of the full-catalog step (``bigrank.losses.fused``) equal the chunked losses.

The kernels run under Triton's interpreter (``TRITON_INTERPRET=1``) on CPU tensors, in one subprocess
(``tests/fused_cases.py``): the variable must be set before Triton is imported, and this pytest process may
have imported it already without it. Tolerances, relative to the largest entry of the chunked gradient (and
to the loss): float32 1e-5 for dU and dV, 1e-6 for the loss (seen: ~1e-6 and exact); bfloat16 2e-2 for dU and
dV (5 bf16 ulps: G is rounded to bf16 per entry on both paths, at slightly different places; seen: 0.5%),
1e-4 for the loss (seen: exact).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
import torch

from bigrank.config import config_from_dict
from bigrank.errors import ConfigError
from bigrank.losses import rankmax_loss, sparsemax_loss
from bigrank.losses.fused.losses import unfused_reason
from bigrank.losses.fused.select import loss_without_fused_kernel, resolve_kernel
from bigrank.losses.fused.source import kernel_scores
from bigrank.losses.rankmax import _RankmaxImpl
from bigrank.losses.softmax import _SoftmaxImpl
from bigrank.losses.sparsemax import _SparsemaxImpl
from tests.helpers import REPO

# Not imported here: the interpreter must be switched on before Triton's import (the subprocess does it).
pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="triton is pinned in requirements.txt (make setup)"
)

GRAD_TOLERANCE = {"fp32": 1e-5, "bf16": 2e-2}
LOSS_TOLERANCE = {"fp32": 1e-6, "bf16": 1e-4}
CASES = [
    *(
        f"single/{name}/{dtype}"
        for name in ("softmax", "softmax_t0.5", "rankmax", "rankmax_margin0.3")
        for dtype in ("fp32", "bf16")
    ),
    *(f"parallel{world}/{name}/fp32" for world in (2, 3) for name in ("softmax", "rankmax")),
]


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory):
    """Every case's (loss, dU, dV), fused and chunked, computed in one interpreted subprocess."""
    out = tmp_path_factory.mktemp("fused") / "cases.pt"
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(REPO))
    done = subprocess.run(
        [sys.executable, "-m", "tests.fused_cases", str(out)], cwd=REPO, env=env, capture_output=True, text=True,
        timeout=600,
    )  # fmt: skip
    if done.returncode != 0:
        pytest.fail(f"tests.fused_cases exited {done.returncode}\n{done.stdout}\n{done.stderr}")
    return torch.load(out)


@pytest.mark.parametrize("case", CASES)
def test_fused_step_equals_chunked(interpreted, case):
    dtype = case.rsplit("/", 1)[1]
    (loss, grad_users, grad_items), (ref_loss, ref_users, ref_items) = (
        interpreted[case]["fused"],
        interpreted[case]["chunked"],
    )
    assert torch.isfinite(ref_loss) and ref_users.abs().max() > 0 and ref_items.abs().max() > 0
    torch.testing.assert_close(loss, ref_loss, rtol=LOSS_TOLERANCE[dtype], atol=0)
    for name, fused, chunked in (("dU", grad_users, ref_users), ("dV", grad_items, ref_items)):
        error = float((fused - chunked).abs().max() / chunked.abs().max())
        assert error <= GRAD_TOLERANCE[dtype], f"{case} {name}: max error {error:.2e} of the largest entry"


def test_the_cases_cover_every_interpreted_result(interpreted):
    assert sorted(interpreted) == sorted(CASES)


@pytest.mark.parametrize(
    "loss_fn, message",
    [
        (lambda s, y: rankmax_loss(s, y, k=3), "rankmax with k = 3 has no fused kernel"),
        (lambda s, y: rankmax_loss(s, y, k=torch.ones(4, dtype=torch.int64)), "per-row k"),
        (lambda s, y: sparsemax_loss(s, y), "sparsemax has no fused kernel"),
    ],
)
def test_a_loss_without_a_fused_kernel_is_refused(loss_fn, message):
    users, items, target = torch.randn(4, 8), torch.randn(20, 8), torch.tensor([0, 5, 9, 19])
    with pytest.raises(ValueError, match=message):
        loss_fn(kernel_scores(users, items, kernel="fused"), target)


def _loss_section(name, **params):
    return config_from_dict({"data": {"root": "/d"}, "run_dir": "/r", "loss": {"name": name, "params": params}}).loss


@pytest.mark.parametrize(
    "name, params, impl",
    [
        ("softmax", {}, _SoftmaxImpl()),
        ("rankmax", {"k": 1}, _RankmaxImpl(1, 1.0)),
        ("rankmax", {"k": 4}, _RankmaxImpl(4, 1.0)),
        ("rankmax", {"k": 1, "k_fraction": 0.5}, _RankmaxImpl(1, 1.0, torch.ones(3, dtype=torch.int64))),
        ("sparsemax", {}, _SparsemaxImpl(2)),
    ],
)
def test_plan_time_and_run_time_agree_on_which_losses_fuse(name, params, impl):
    assert (loss_without_fused_kernel(_loss_section(name, **params)) is None) == (unfused_reason(impl) is None)


def test_kernel_choice():
    softmax, rankmax5 = _loss_section("softmax"), _loss_section("rankmax", k=5)
    assert resolve_kernel("auto", "cpu", softmax).name == "chunked"
    assert "training on cpu" in resolve_kernel("auto", "cpu", softmax).describe()
    assert resolve_kernel("chunked", "cuda", softmax).name == "chunked"
    assert resolve_kernel("auto", "cuda", rankmax5).name == "chunked"
    assert resolve_kernel("auto", "cuda", softmax).name == "fused"  # triton is installed here
    assert resolve_kernel("fused", "cuda", softmax).name == "fused"
    with pytest.raises(ConfigError, match="the fused kernels run on CUDA"):
        resolve_kernel("fused", "cpu", softmax)
    with pytest.raises(ConfigError, match="k = 5 has no fused kernel"):
        resolve_kernel("fused", "cuda", rankmax5)


def test_fused_on_cpu_is_a_config_error():
    with pytest.raises(ConfigError, match="train.kernel"):
        config_from_dict({"data": {"root": "/d"}, "run_dir": "/r", "train": {"device": "cpu", "kernel": "fused"}})


def test_temperature_keeps_the_fused_source():
    """A softmax temperature divides U and keeps the kernels (the loss itself: the softmax_t0.5 cases)."""
    from bigrank.losses.fused.source import FusedScores
    from bigrank.losses.scores import divide_scores

    divided = divide_scores(kernel_scores(torch.randn(4, 8), torch.randn(20, 8), kernel="fused"), 0.5)
    assert isinstance(divided, FusedScores)
