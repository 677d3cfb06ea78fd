"""Where checkpoints live on disk and which of them count: pure path logic, no torch, no process group.

    <checkpoint.dir>/
      step-00000004/            a complete checkpoint: renamed from .partial once every rank's part was
        COMPLETE                written; this marker is written last, after the rename
        trainer.json            step, losses so far, W&B run id, the resolved config (rank 0)
        rng/rank<r>.pt          each rank's random-number generator states
        dcp/ | deepspeed/       the strategy's own state: torch.distributed.checkpoint or DeepSpeed's format
      step-00000006.partial/    a save in progress, or one a crash interrupted: never resumed from

Only a directory named `step-<8 digits>` holding `COMPLETE` is a checkpoint. A save killed at any moment
leaves either a `.partial` directory or a complete one, never something that looks complete and is not.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Callable, Optional

MARKER = "COMPLETE"
TRAINER_STATE = "trainer.json"
PARTIAL_SUFFIX = ".partial"
_STEP_DIR = re.compile(r"^step-(\d{8})$")


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def partial_dir(root: Path, step: int) -> Path:
    return root / (step_dir_name(step) + PARTIAL_SUFFIX)


def is_complete(path: Path) -> bool:
    return _STEP_DIR.match(path.name) is not None and (path / MARKER).is_file()


def complete_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """(step, path) of every complete checkpoint under `root`, oldest first."""
    if not root.is_dir():
        return []
    found = []
    for path in root.iterdir():
        match = _STEP_DIR.match(path.name)
        if match and (path / MARKER).is_file():
            found.append((int(match.group(1)), path))
    return sorted(found)


def partial_checkpoints(root: Path) -> list[Path]:
    """Saves that never completed (interrupted, or in progress)."""
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.name.endswith(PARTIAL_SUFFIX) and p.is_dir())


def latest(root: Path) -> Optional[Path]:
    found = complete_checkpoints(root)
    return found[-1][1] if found else None


def resolve_resume(
    resume: str, *, default_root: Optional[Path], key: str = "checkpoint.resume",
    verify: Optional[Callable[[Path], Optional[str]]] = None, warn: Optional[Callable[[str], None]] = None,
) -> Optional[Path]:
    """The checkpoint `checkpoint.resume` names, or None to start fresh. Raises ValueError with one line.

    auto: the newest complete checkpoint in `default_root` (None if there is none); none: None; a path: that
    checkpoint, or the newest complete one in that directory.

    verify: what is wrong with a complete checkpoint, or None (verify.problem). With it, `auto` and a directory
    skip a damaged checkpoint for the newest whole one, telling `warn` once per skipped checkpoint (nothing is
    deleted); a damaged checkpoint named itself, or a directory whose every checkpoint is damaged, is refused.
    """
    if resume == "none":
        return None
    if resume == "auto":
        if not default_root:
            return None
        newest = _newest_whole(default_root, key=f"{key}=auto", verify=verify, warn=warn)
        unmarked = _unmarked(default_root)
        if newest is None and unmarked and warn is not None:  # said now, not only when a save sets them aside
            warn(f"{key}=auto: no complete checkpoint in {default_root}: {', '.join(unmarked)} lack their {MARKER} "
                 "marker (a save that did not finish, or a marker removed); training starts from step 1")
        return newest
    path = Path(resume).expanduser()
    key = f"{key}={resume}"
    if not path.exists():
        raise ValueError(f"{key}: no such file or directory")
    if is_complete(path):
        why = verify(path) if verify is not None else None
        if why:
            raise ValueError(f"{key} is damaged and cannot be resumed from: {why}; complete checkpoints beside it: "
                             f"{_names(complete_checkpoints(path.parent))}")
        return path.resolve()
    if _STEP_DIR.match(path.name) or path.name.endswith(PARTIAL_SUFFIX):
        raise ValueError(
            f"{key} is incomplete (no {MARKER} marker: its save was interrupted) and cannot be resumed from; "
            f"complete checkpoints beside it: {_names(complete_checkpoints(path.parent))}"
        )
    newest = _newest_whole(path, key=key, verify=verify, warn=warn)
    if newest is None:
        inside = path / "checkpoints"  # a run directory named in place of its checkpoints
        hint = (f"; did you mean {inside}?" if complete_checkpoints(inside) else
                f" ({', '.join(_unmarked(path))} lack their {MARKER} marker)" if _unmarked(path) else "")
        raise ValueError(f"{key} holds no complete checkpoint (step-NNNNNNNN/{MARKER}){hint}")
    return newest.resolve()


def _unmarked(root: Path) -> list[str]:
    """Names of the step directories under `root` without their marker: not checkpoints (a save that stopped
    between its rename and the marker, or a marker removed)."""
    if not root.is_dir():
        return []
    return sorted(p.name for p in root.iterdir() if _STEP_DIR.match(p.name) and p.is_dir() and not is_complete(p))


def _newest_whole(root: Path, *, key: str, verify: Optional[Callable[[Path], Optional[str]]],
                  warn: Optional[Callable[[str], None]]) -> Optional[Path]:
    """The newest complete checkpoint under `root` that `verify` finds whole (None: there is no complete one)."""
    found = complete_checkpoints(root)
    damaged: list[str] = []
    for _, path in reversed(found):
        why = verify(path) if verify is not None else None
        if not why:
            return path
        damaged.append(why)
        if warn is not None:
            older = [p.name for _, p in found if p.name < path.name]
            then = f"trying {older[-1]}" if older else "no older checkpoint"
            warn(f"{key}: skipping {path.name}, which is damaged: {why}; {then}")
    if damaged:
        raise ValueError(f"{key}: every checkpoint in {root} is damaged ({_names(found)}; the newest: {damaged[0]}); "
                         "a new hydra.run.dir starts from step 1")
    return None


def _names(found: list[tuple[int, Path]]) -> str:
    return ", ".join(p.name for _, p in found) or "none"


def read_marker(path: Path) -> dict[str, Any]:
    return json.loads((path / MARKER).read_text())


def read_trainer_state(path: Path) -> dict[str, Any]:
    return json.loads((path / TRAINER_STATE).read_text())
