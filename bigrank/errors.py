"""The errors a user can fix, shared by every layer (a leaf module: it imports nothing from bigrank).

The ``bigrank`` command prints them without a traceback and exits with status 2.
"""

from __future__ import annotations

__all__ = ["CommandError", "ConfigError"]


class CommandError(Exception):
    """An error the user can fix (a bad option, an unreachable cluster, a failed worker's message)."""


class ConfigError(ValueError):
    """A configuration problem; the message names the dotted key (``loss.params.k``)."""
