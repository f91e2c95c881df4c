"""The errors a user can fix, shared by every layer (a leaf module: it imports nothing from bigrank).

The ``bigrank`` command prints them without a traceback and exits with status 2. :class:`Terminated` is no
error: it carries a SIGTERM up to the command, which exits with status 143 as a process killed by it would.
"""

from __future__ import annotations

__all__ = ["CommandError", "ConfigError", "CorruptFileError", "Terminated"]


class CommandError(Exception):
    """An error the user can fix (a bad option, an unreachable cluster, a failed worker's message)."""


class ConfigError(ValueError):
    """A configuration problem; the message names the dotted key (``loss.params.k``)."""


class CorruptFileError(ValueError):
    """A file bigrank wrote no longer holds the bytes it wrote (``bigrank.integrity``): the message names the
    file, the row group where known, and what to do; ``path`` and ``row_group`` (or None) say the same."""

    def __init__(self, message: str, path=None, row_group: int | None = None):
        super().__init__(message)
        self.path = path
        self.row_group = row_group


class Terminated(BaseException):
    """SIGTERM reached a process that stops its workers before it exits (``bigrank.train.launcher``); like
    KeyboardInterrupt for SIGINT, a BaseException, so that no ``except Exception`` swallows it."""

    def __init__(self, signum: int = 15):
        super().__init__(signum)  # args = (signum,): pickles and copies as it is
        self.signum = signum

    def __str__(self) -> str:
        return f"terminated by signal {self.signum}"
