"""The suite's own rules, checked by the suite so that no merge undoes them: a broken install fails instead of
skipping (no ``pytest.importorskip`` of a pinned dependency). That Ray's files stay in a directory of the suite
(``ray_keeps_its_files_in_a_directory_of_the_suite`` in conftest) is checked where a test starts a runtime anyway
(tests/test_loopback.py)."""

from __future__ import annotations

import ast
import re
from importlib import metadata
from pathlib import Path

from tests.helpers import REPO

TESTS = Path(__file__).resolve().parent
# The pinned stack: both requirements files, and torchrec (installed with --no-deps by the Makefile).
REQUIREMENTS = ("requirements.txt", "requirements-cuda.txt")
ALSO_PINNED = ("torchrec",)


def pinned_modules() -> dict[str, str]:
    """``{import name: distribution}`` of every pinned distribution: the top-level modules it installs (from its
    metadata), and its name as a module name (``fbgemm-gpu-cpu`` -> ``fbgemm_gpu_cpu``) for one not installed."""
    names = list(ALSO_PINNED)
    for requirements in REQUIREMENTS:
        for line in (REPO / requirements).read_text().splitlines():
            line = line.split("#", 1)[0].strip()
            if line:
                names.append(re.split(r"[\[=<>!~ ;]", line, maxsplit=1)[0])
    wanted = {re.sub(r"[-_.]+", "-", name).lower(): name for name in names}
    modules = {re.sub(r"[-.]+", "_", name).lower(): name for name in names}
    for module, distributions in metadata.packages_distributions().items():
        for distribution in distributions:
            normalized = re.sub(r"[-_.]+", "-", distribution).lower()
            if normalized in wanted:
                modules[module] = wanted[normalized]
    return modules


def importorskips() -> list[tuple[str, str]]:
    """``(file:line, the module's top-level name)`` of every ``importorskip`` call in the tests (a name that is not
    a string literal is reported as written)."""
    found = []
    for path in sorted(TESTS.rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if name != "importorskip" or not node.args:
                continue
            arg = node.args[0]
            module = arg.value.split(".")[0] if isinstance(arg, ast.Constant) else ast.unparse(arg)
            found.append((f"{path.relative_to(REPO)}:{node.lineno}", module))
    return found


def test_the_pinned_modules_include_the_stack_by_import_name():
    modules = pinned_modules()
    for module in ("ray", "torch", "torchrec", "pyarrow", "duckdb", "faiss", "yaml", "fbgemm_gpu", "triton"):
        assert module in modules, module


def test_no_test_skips_on_a_missing_pinned_dependency():
    """A broken install of the pinned stack must fail the suite, not turn into skips (issue 43, and issue 49: three
    came back with the loopback tests). Import a pinned module plainly; skip only on what the machine lacks (a GPU,
    a dataset under ../shared/datasets)."""
    pinned = pinned_modules()
    offending = [f"{where}: importorskip({module!r}) ({pinned[module]} is pinned)" for where, module in importorskips()
                 if module in pinned]  # fmt: skip
    assert not offending, "\n".join(offending)
