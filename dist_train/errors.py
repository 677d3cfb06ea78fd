"""The one error a user's input raises before anything runs, in a module that imports nothing: the config, the
parallel degrees and the strategies' own checks all raise it, and the entry points print its one line."""

from __future__ import annotations


class ConfigError(ValueError):
    """A config value that cannot run; the message is one line naming the key and what is allowed."""


def require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)
