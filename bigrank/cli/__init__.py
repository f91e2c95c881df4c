"""The `bigrank` command.

Every command lives here, at the top of the package: the argument parsing and the function that runs each one. A
module of this package listed in ``COMMAND_MODULES`` (``data``, ``plot``, ``train``, ``export``, ``jobs``, ``tune``,
``verify``) exposes ``register(subparsers)``, which adds parsers whose ``func`` attribute runs the command and
returns an exit code; nothing below imports this package. The commands that start work call the run layer
(``bigrank.run``), or the search (``bigrank.tune``, above the run layer), imported when the command runs:
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
import signal
import sys

from bigrank.errors import CommandError, Terminated

COMMAND_MODULES = [
    "bigrank.cli.data",
    "bigrank.cli.plot",
    "bigrank.cli.train",
    "bigrank.cli.export",
    "bigrank.cli.jobs",
    "bigrank.cli.tune",
    "bigrank.cli.verify",
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
    the_process = argv is None  # the command line of this process, not a call from Python (tests, notebooks)
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(argv)
    try:
        code = args.func(args)
    except (CommandError, FileNotFoundError, ValueError) as error:
        print(f"bigrank {args.command}: error: {error}", file=sys.stderr)
        return 2
    except (KeyboardInterrupt, Terminated) as stop:
        if the_process:
            _ignore_interrupts_while_exiting()  # before anything else: the exit status is chosen
        if isinstance(stop, KeyboardInterrupt):
            print(_stopped(args, argv, "interrupted"), file=sys.stderr)
            return 130
        print(_stopped(args, argv, "stopped by SIGTERM"), file=sys.stderr)
        return 143
    return int(code or 0)


def _ignore_interrupts_while_exiting() -> None:
    """The stop is reported and the exit status chosen: a later interrupt must not turn that exit into a death by
    SIGINT while Python shuts Ray down (atexit). One came once in CI after `serve --ray` stopped in its start-up
    (exit -2 after "stopped by SIGTERM"): a second Ctrl+C, or Ray's ``_thread.interrupt_main`` (PyErr_SetInterrupt
    does nothing for an ignored SIGINT). SIGTERM keeps its default action: it still ends a stuck exit at once.
    An interrupt already pending runs its handler before the new one is in place: take it, and try again."""
    while True:
        try:
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            return
        except KeyboardInterrupt:
            continue
