"""The `bigrank` command.

Each part of bigrank registers its own sub-commands: a module listed in ``COMMAND_MODULES`` exposes
``register(subparsers)``, which adds parsers whose ``func`` attribute runs the command and returns an exit
code. The commands that start work call the run layer (``bigrank.run``), imported when the command runs:
registering the commands imports no torch, ray or pyarrow, so ``bigrank --help`` starts at once. Errors a user
can fix (``bigrank.errors``) print one line and exit with status 2. A command stopped by SIGINT (Ctrl+C) exits
with status 130, by SIGTERM (the local launcher, tune, submit --wait: ``bigrank.signals``) with 143, as a shell
reports a process killed by those signals; a command whose parser sets ``resumable`` then prints how to resume.
``bigrank serve`` drains and exits 0 instead: stopping is a server's normal end.
"""

from __future__ import annotations

import argparse
import importlib
import shlex
import sys

from bigrank.errors import CommandError, Terminated

COMMAND_MODULES = [
    "bigrank.data.commands",
    "bigrank.train.plot",
    "bigrank.train.commands",
    "bigrank.export.commands",
    "bigrank.launch.commands",
    "bigrank.launch.tune",
    "bigrank.verify",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="bigrank", description=__doc__.splitlines()[0])
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    subparsers.required = True
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(subparsers)
    return parser


def _stopped(args: argparse.Namespace, argv: list[str], why: str) -> str:
    """The line printed when a signal stopped the command: what happened, and how to resume when it can."""
    line = f"bigrank {args.command}: {why}"
    if getattr(args, "resumable", False):
        line += f"; run the same command again to resume:\n  {shlex.join(['bigrank', *argv])}"
    return line


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(argv)
    try:
        code = args.func(args)
    except (CommandError, FileNotFoundError, ValueError) as error:
        print(f"bigrank {args.command}: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(_stopped(args, argv, "interrupted"), file=sys.stderr)
        return 130
    except Terminated:
        print(_stopped(args, argv, "stopped by SIGTERM"), file=sys.stderr)
        return 143
    return int(code or 0)


if __name__ == "__main__":
    sys.exit(main())
