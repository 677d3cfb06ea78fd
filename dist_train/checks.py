"""The whole pre-flight check of a run, before any process group starts: one ConfigError line, or nothing.

config.validate_fields judges the values on their own; here they meet what lies outside the config: the
checkpoint that checkpoint.resume names, the number of processes, and the strategy's own checks (asked of
the registry).
"""

from __future__ import annotations

from dist_train.checkpoint.layout import resolve_resume
from dist_train.config import ConfigError, RunConfig, require, validate_fields
from dist_train.strategies.registry import check_strategy


def validate(run: RunConfig, world_size: int) -> None:
    """Raise ConfigError (one line) for the first value that cannot run with `world_size` processes."""
    validate_fields(run)
    _check_resume(run.checkpoint.resume)
    require(world_size >= 1, f"WORLD_SIZE={world_size} must be >= 1")
    check_strategy(run, world_size)


def _check_resume(resume: str) -> None:
    if resume in ("auto", "none"):
        return
    try:
        resolve_resume(resume, default_root=None)
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
