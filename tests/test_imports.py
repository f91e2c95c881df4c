"""The bigrank package has no import cycles, counting function-local and type-only imports too.

The graph is built from the source (``ast``), not by importing: every ``import`` / ``from ... import`` anywhere
in a module (module level, inside functions, inside ``try``, under ``if TYPE_CHECKING:``), resolved to bigrank
modules, is an edge ``importer -> imported``. ``import a.b`` and ``from a.b import c`` depend on ``a.b`` (and on
``a.b.c`` when that is a module); a package's ``__init__`` counts as the module of the package. A type-only
import never runs, but it still ties the two modules together (the evaluator once named a model kind's class
that way, and that kind's trainer imported the evaluator): a protocol breaks such a knot. A cycle is printed as
``a -> b -> a`` with the file and line of each edge.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parents[1] / "bigrank"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(path): path for path in sorted(PACKAGE_DIR.rglob("*.py"))}


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The longest bigrank module that ``name`` (a dotted name) is or lies in."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def import_graph() -> dict[str, dict[str, str]]:
    """``{importer: {imported: "file:line"}}`` over the bigrank modules."""
    modules = _modules()
    graph: dict[str, dict[str, str]] = {name: {} for name in modules}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        is_package = path.name == "__init__.py"
        for node in ast.walk(tree):
            if not isinstance(node, ast.Import | ast.ImportFrom):
                continue
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = node.module or ""
                if node.level:  # relative import: resolve against this module's package
                    package = name if is_package else name.rpartition(".")[0]
                    for _ in range(node.level - 1):
                        package = package.rpartition(".")[0]
                    base = f"{package}.{base}" if base else package
                targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
            where = f"{path.relative_to(PACKAGE_DIR.parent)}:{node.lineno}"
            for target in targets:
                resolved = _resolve(target, modules)
                if resolved is not None and resolved != name:
                    graph[name].setdefault(resolved, where)
    return graph


def find_cycles(graph: dict[str, dict[str, str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each as a cycle through them."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return [_cycle_in(graph, set(component)) for component in components]


def _cycle_in(graph: dict[str, dict[str, str]], members: set[str]) -> list[str]:
    """One closed path through a strongly connected component (shortest back to its first module)."""
    start = min(members)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        nxt_frontier = []
        for node in frontier:
            for nxt in sorted(graph[node]):
                if nxt == start:
                    return paths[node] + [start]
                if nxt in members and nxt not in paths:
                    paths[nxt] = paths[node] + [nxt]
                    nxt_frontier.append(nxt)
        frontier = nxt_frontier
    return [start]


def describe(graph: dict[str, dict[str, str]], cycle: list[str]) -> str:
    """The cycle, each edge's file:line, and every import between the modules of its component."""
    members = set(cycle)
    for node in list(members):  # the whole strongly connected component: what reaches back to the cycle
        members |= {
            m for m in graph if m not in members and node in _reachable(graph, m) and m in _reachable(graph, node)
        }
    edges = [f"  {a} -> {b}  ({graph[a][b]})" for a, b in zip(cycle, cycle[1:], strict=False)]
    inside = [
        f"    {a} -> {b}  ({where})" for a in sorted(members) for b, where in sorted(graph[a].items()) if b in members
    ]
    return " -> ".join(cycle) + "\n" + "\n".join(edges) + "\n  all imports inside the component:\n" + "\n".join(inside)


def _reachable(graph: dict[str, dict[str, str]], start: str) -> set[str]:
    seen, todo = {start}, [start]
    while todo:
        for nxt in graph[todo.pop()]:
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def test_the_cycle_finder_finds_a_planted_cycle_and_accepts_a_tree():
    graph = {"a": {"b": "x:1"}, "b": {"c": "x:2"}, "c": {"a": "x:3"}, "d": {"a": "x:4"}}
    (cycle,) = find_cycles(graph)
    assert cycle == ["a", "b", "c", "a"]
    assert "a -> b -> c -> a" in describe(graph, cycle)
    assert find_cycles({"a": {"b": "x:1"}, "b": {}, "c": {"a": "x:2", "b": "x:3"}}) == []


def test_the_graph_sees_function_local_type_only_and_dotted_imports():
    graph = import_graph()
    assert "bigrank.errors" in graph["bigrank.cli"]  # module level
    assert graph["bigrank.errors"] == {}  # the leaf
    assert "bigrank.losses.registry" in graph["bigrank.config"]
    assert "bigrank.train.bootstrap" in graph["bigrank.train.kind"]  # under `if TYPE_CHECKING:` only


def test_the_bigrank_package_has_no_import_cycles():
    graph = import_graph()
    cycles = find_cycles(graph)
    report = "\n\n".join(describe(graph, cycle) for cycle in cycles)
    assert not cycles, f"{len(cycles)} import cycle(s) in bigrank:\n{report}"


def test_the_cli_parser_and_a_config_load_without_torch(tmp_path):
    """`bigrank --help`, `bigrank submit/status` only parse arguments and configs: they must not pay torch's
    import (seconds); the loss registry and its parameter dataclasses are torch-free for that reason."""
    config = tmp_path / "run.yaml"
    config.write_text("data: {root: data/x}\nrun_dir: runs/x\nloss: {name: rankmax, params: {k: 3}}\n")
    code = (
        "import sys; from bigrank.cli import build_parser; from bigrank.config import load_config; "
        f"build_parser(); c = load_config({str(config)!r}); assert c.loss.params['k'] == 3; "
        "heavy = sorted(m for m in ('torch', 'ray', 'pyarrow', 'torchrec', 'faiss') if m in sys.modules); "
        "print(heavy)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


# The layers of the package, top to bottom (docs/architecture.md, "Layers and imports"): a module imports from its own
# layer or from those below it, never from one above. The commands at the top, the run layer under them, the packages
# under that, and at the bottom the pieces every layer needs (Ray's start-up, signals, records, errors, ...). A
# module's layer is the one of the longest prefix naming it (a prefix names itself and its submodules).
LAYERS = (
    ("bigrank.cli",),  # the commands: their arguments and the function each runs
    ("bigrank.tune",),  # searches: each trial runs the run layer's pre-flight, as a command does
    ("bigrank.run",),  # one pre-flight and one way to start each job
    ("bigrank.launch",),  # Ray Train and Ray Jobs: they take the worker function
    ("bigrank.train",),
    ("bigrank.export",),
    ("bigrank.data",),
    ("bigrank.devices",),
    ("bigrank.config",),  # checks the settings against the losses' and the model's registries and choices
    ("bigrank.model",),
    ("bigrank.losses",),
    ("bigrank.distributed",),
    ("bigrank.ray_runtime", "bigrank.signals", "bigrank.runlock", "bigrank.records", "bigrank.integrity",
     "bigrank.atomic", "bigrank.scalars", "bigrank.errors"),
)  # fmt: skip
ROOT = "bigrank"  # the package's own __init__ (its version): the bottom


def layer_of(module: str) -> int | None:
    """The index in :data:`LAYERS` of ``module`` (0 = the top), None when no layer names it."""
    if module == ROOT:
        return len(LAYERS) - 1
    best = None
    for index, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and (best is None or len(prefix) > best[1]):
                best = (index, len(prefix))
    return None if best is None else best[0]


def upward_imports(graph: dict[str, dict[str, str]]) -> list[str]:
    """Every import of ``graph`` into a layer above the importer's, as ``importer -> imported (file:line)``."""
    return [
        f"{importer} -> {imported}  ({where})"
        for importer, targets in sorted(graph.items())
        for imported, where in sorted(targets.items())
        if layer_of(imported) < layer_of(importer)
    ]


def test_the_layer_check_finds_a_planted_upward_import():
    graph = {
        "bigrank.losses.x": {"bigrank.config": "x:1", "bigrank.errors": "x:2"},
        "bigrank.cli.y": {"bigrank.run": "y:1"},
    }
    assert upward_imports(graph) == ["bigrank.losses.x -> bigrank.config  (x:1)"]
    assert layer_of("bigrank.launch.jobs") == layer_of("bigrank.launch") < layer_of("bigrank.train.bootstrap")
    assert layer_of("bigrank") == layer_of("bigrank.errors") and layer_of("bigrankish") is None


def test_every_module_has_a_layer():
    assert [module for module in import_graph() if layer_of(module) is None] == []


def test_every_import_runs_down_the_layers():
    """The commands sit above the run layer they call, tune's trials above the run layer whose pre-flight they
    run, Ray's start-up below launch, data and export, and the losses' and the model's choices (``KERNELS``,
    ``LAYOUTS``) with the code that decides them, below the config that checks them. Function-local and type-only
    imports count (on main 14fc091: 7 imports ran up, e.g. ``bigrank.train.commands -> bigrank.run``)."""
    upward = upward_imports(import_graph())
    assert not upward, f"{len(upward)} import(s) run up a layer:\n" + "\n".join(upward)
