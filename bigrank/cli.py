"""The `bigrank` command.

Each part of bigrank registers its own sub-commands: a module listed in ``COMMAND_MODULES`` exposes
``register(subparsers)``, which adds parsers whose ``func`` attribute runs the command and returns an exit
code. Modules are imported only when the CLI starts, and heavy libraries (torch, ray, pyarrow) are imported
inside the command functions so that `bigrank --help` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys

COMMAND_MODULES = [
    "bigrank.data.commands",
    "bigrank.train.plot",
    "bigrank.train.commands",
    "bigrank.export.commands",
    "bigrank.launch.commands",
    "bigrank.launch.tune",
]


class CommandError(Exception):
    """An error the user can fix; printed without a traceback and exits with status 2."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="bigrank", description=__doc__.splitlines()[0])
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    subparsers.required = True
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        code = args.func(args)
    except (CommandError, FileNotFoundError, ValueError) as error:
        print(f"bigrank {args.command}: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"bigrank {args.command}: interrupted", file=sys.stderr)
        return 130
    return int(code or 0)


if __name__ == "__main__":
    # Under `python -m bigrank.cli` this file runs as __main__, with a CommandError class of its own; the
    # commands raise bigrank.cli.CommandError, so run the imported module's main.
    from bigrank.cli import main as _main

    sys.exit(_main())
