"""Paths as users type them: `~`, `$HOME` and relative paths, in every path option of every entry point.

Two places need it:
- **the command line**, before Hydra reads it. The shell expands `~` only at the start of a word, so
  `model.path=~/models/llama` reaches the program with its `~`, and Hydra's override lexer refuses the character
  (`token recognition error at: '~'`). `expand_overrides` expands a `~` that starts a value or a list element,
  as the shell would have; `~key` (Hydra's "delete this key") is left alone.
- **the config's path options** (`PATH_KEYS`), whatever wrote them (a YAML file, `'$HOME/...'` quoted past the
  shell, an experiment file): `~` and environment variables are expanded and a relative path is made absolute
  against the directory the command ran in. The run's config.yaml, checkpoints and comparison then record where the
  file really is, so a resume or a compare started from another directory finds the same file.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

# (group, key) of every option that names a file or directory on this machine.
PATH_KEYS = (("model", "path"), ("data", "path"), ("eval", "path"), ("checkpoint", "dir"), ("checkpoint", "resume"))
# checkpoint.resume's words that are not paths
_NOT_PATHS = ("auto", "none")
# A `~` that starts a value (`key=~/x`) or a list element (`key=[~/a,~/b]`).
_LEADING_TILDE = re.compile(r"(?<=[=\[,])~[^,\]\s]*")


def expand_overrides(argv: list[str]) -> list[str]:
    """The command line with `~` expanded where it starts a value or a list element of a `key=value` override."""
    return [_LEADING_TILDE.sub(lambda m: os.path.expanduser(m.group(0)), arg)
            if "=" in arg and not arg.startswith("-") else arg for arg in argv]


def user_path(value: str, *, cwd: str | os.PathLike[str] | None = None) -> str:
    """`value` with `~` and `$VARS` expanded, made absolute against `cwd` (the current directory by default)."""
    path = Path(os.path.expandvars(os.path.expanduser(value)))
    if not path.is_absolute():
        path = Path(cwd or os.getcwd()) / path
    return os.path.normpath(path)


# Each path normalize_paths made, by what it was given: a message can judge what the user typed (a hub name). The
# latest call's value wins: the same path typed otherwise by an earlier entry call in this process is not kept.
_TYPED: dict[str, str] = {}


def normalize_paths(run: Any) -> None:
    """Every path option of a RunConfig (or any object with these groups) made a `user_path`, in place."""
    for group, key in PATH_KEYS:
        section = getattr(run, group, None)
        value = getattr(section, key, None)
        if isinstance(value, str) and value and value not in _NOT_PATHS:
            made = user_path(value)
            _TYPED[made] = value
            setattr(section, key, made)


def as_typed(path: str) -> str:
    """The value normalize_paths was given for `path` (a `~` the command line expanded is already absolute there),
    or `path` itself."""
    return _TYPED.get(path, path)
