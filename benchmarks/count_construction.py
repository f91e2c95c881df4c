"""Count the bigrank modules that building a Trainer walks through (issue 29's reading measure).

Someone following the config through ``Trainer(config)`` reads one function after another; every time the
next function lives in another module they switch files, and every time they come back to a file they had
already left, they re-enter it. This script counts that walk on a real construction: one gloo process
(world size 1, set up by the local launcher's ``start_local_process``), the demo config with ``workers: 1``.

How it counts. ``sys.setprofile`` sees every Python ``call`` event of the main thread while ``Trainer(config)``
runs. An event counts when its code is defined in a file of the ``bigrank`` package (functions, methods,
nested functions and lambdas alike); the module is the file's dotted name. Left out:

* comprehensions and generator expressions: part of the expression that holds them, not a call a reader
  follows (Python 3.12 inlines comprehensions, PEP 709: counting their frames would make the figure depend
  on the Python version);
* calls into other packages (torch, torchrec, pyarrow): transparent, but a call they make back into bigrank
  (torchrec's sharding calling ``UserTower.reset_parameters``) counts;
* code run while a module is imported (importlib's and ``<module>`` frames and everything under them): a lazy
  import is not part of the walk;
* the resumption of a generator (it is entered once, when it starts), so the count does not grow with the data;
* code generated at run time (dataclasses' ``__init__``/``__eq__``: their file is not a bigrank file; a
  ``__post_init__`` is) and other threads (the stream's prefetch thread).

The sequence is the module of each counted call in order; consecutive calls in one module are one visit. A
module's *entries* are its visits; a *re-entry* is a visit to a module that had been visited before (the walk
came back to a file it had left). Totals: the distinct modules and the re-entries.

    .venv/bin/bigrank generate --preset demo --out /tmp/demo
    .venv/bin/python -m benchmarks.count_construction --data /tmp/demo [--sequence] [--manifest]

``--manifest``: pass the dataset manifest read beforehand, as the local launcher's workers get it from the
run layer's pre-flight (default: ``Trainer(config)`` reads it, as a Ray worker does). ``--sequence``: also
print the module transitions, each with the function entered.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import tempfile
from collections import Counter
from pathlib import Path

import bigrank

PACKAGE_DIR = str(Path(bigrank.__file__).resolve().parent) + os.sep
GENERATOR_FLAGS = 0x20 | 0x200 | 0x100  # CO_GENERATOR | CO_ASYNC_GENERATOR | CO_COROUTINE
# Part of the expression that holds them, not calls (Python 3.12 inlines the first three: PEP 709).
INLINE_CODE = ("<listcomp>", "<dictcomp>", "<setcomp>", "<genexpr>")


def module_of(filename: str) -> str | None:
    """``bigrank.x.y`` for a file of the package, None for any other file."""
    path = str(Path(filename).resolve()) if filename.endswith(".py") else ""
    if not path.startswith(PACKAGE_DIR):
        return None
    parts = ["bigrank", *Path(path[len(PACKAGE_DIR) :]).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


class Walk:
    """The counted calls as ``(module, function)`` in order (see the module docstring)."""

    def __init__(self):
        self.calls: list[tuple[str, str]] = []
        self._importing = 0  # import frames (importlib's, a module's body) being executed
        # Generator frames already entered, held (not their ids: a finished frame's id can be reused).
        self._started: set = set()
        self._modules: dict[str, str | None] = {}

    def __call__(self, frame, event, arg):
        if event not in ("call", "return"):
            return
        code = frame.f_code
        if code.co_name == "<module>" or code.co_filename.startswith("<frozen importlib"):
            self._importing += 1 if event == "call" else -1
            return
        if event != "call" or self._importing or code.co_name in INLINE_CODE:
            return
        if code.co_filename not in self._modules:
            self._modules[code.co_filename] = module_of(code.co_filename)
        module = self._modules[code.co_filename]
        if module is None:
            return
        if code.co_flags & GENERATOR_FLAGS:
            if frame in self._started:
                return
            self._started.add(frame)
        self.calls.append((module, code.co_qualname))

    def visits(self) -> list[tuple[str, str]]:
        """One ``(module, first function)`` per visit: consecutive calls in one module merged."""
        out: list[tuple[str, str]] = []
        for module, function in self.calls:
            if not out or out[-1][0] != module:
                out.append((module, function))
        return out


def build_trainer(data: str, config_path: str, run_dir: str, pass_manifest: bool, walk: Walk):
    """Start a 1-process gloo group like the local launcher, then build ``Trainer`` under ``walk``."""
    from bigrank.config import load_config
    from bigrank.train.bootstrap import start_local_process
    from bigrank.train.trainer import Trainer

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    start_local_process("gloo", threads=1)
    config = load_config(config_path, [f"data.root={data}", f"run_dir={run_dir}", "workers=1"])
    manifest = None
    if pass_manifest:
        from bigrank.data.manifest import DatasetManifest

        manifest = DatasetManifest.load(config.data.root)
    sys.setprofile(walk)
    try:
        return Trainer(config, manifest)
    finally:
        sys.setprofile(None)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", required=True, help="a dataset directory (bigrank generate --preset demo)")
    parser.add_argument("--config", default=str(Path(__file__).parents[1] / "configs" / "demo.yaml"))
    parser.add_argument("--manifest", action="store_true", help="pass the manifest in, as the local launcher does")
    parser.add_argument("--sequence", action="store_true", help="also print every module transition")
    args = parser.parse_args(argv)

    walk = Walk()
    with tempfile.TemporaryDirectory(prefix="bigrank-count-") as run_dir:
        build_trainer(args.data, args.config, run_dir, args.manifest, walk)
    visits = walk.visits()
    entries = Counter(module for module, _ in visits)
    calls = Counter(module for module, _ in walk.calls)
    order = list(dict.fromkeys(module for module, _ in visits))
    reentries = len(visits) - len(order)

    if args.sequence:
        print("module transitions (module: first function entered):")
        for i, (module, function) in enumerate(visits):
            again = " (re-entry)" if module in dict.fromkeys(m for m, _ in visits[:i]) else ""
            print(f"  {i:3d}  {module}: {function}{again}")
        print()
    width = max(map(len, order))
    print(f"{'module (first-visit order)':<{width}}  entries  calls")
    for module in order:
        print(f"{module:<{width}}  {entries[module]:7d}  {calls[module]:5d}")
    print(f"\n{len(order)} modules, {reentries} re-entries ({len(visits)} visits, {len(walk.calls)} calls)")


if __name__ == "__main__":
    main()
