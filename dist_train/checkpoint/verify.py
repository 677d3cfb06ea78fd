"""Is a complete checkpoint whole? Checked before a run resumes from it, on every rank, without loading a tensor.

A save that was interrupted never looks complete (layout.py). What the `COMPLETE` marker cannot rule out is damage
after the commit: a copy cut short, a file lost on a shared filesystem, a disk that filled while another job wrote.
So the commit also records every file of the checkpoint and its size in the marker (`files`), and `problem` checks,
naming the first bad file it finds:
- the marker and `trainer.json` read as JSON, and the trainer state has its step and config;
- every recorded file is there, with the size it had when the checkpoint was committed (a truncated `.distcp`,
  a lost `dcp/` or `rng/rank<r>.pt`);
- DCP's `.metadata` is a whole pickle (its first and last bytes), and DeepSpeed's directory is there.
A checkpoint written before the marker recorded its files gets the structural checks instead: DCP's metadata is read
and every byte range it points at must lie inside its file; DeepSpeed needs one optimizer partition per saved rank.

Sizes and structure, not contents: a bit flipped inside a tensor keeps its size (a checksum of every byte would cost
a read of the whole checkpoint, a terabyte for a 70B model with Adam, at every save and every resume). Such damage
is found, if at all, when the load fails, and that failure names the checkpoint (manager.Checkpointer.load).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Optional

from dist_train.checkpoint.layout import MARKER, TRAINER_STATE

DCP_DIR, DCP_METADATA = "dcp", ".metadata"
DEEPSPEED_DIR = "deepspeed"
_PICKLE_PROTO, _PICKLE_STOP = 0x80, ord(".")


def manifest(directory: Path) -> dict[str, int]:
    """{path relative to the checkpoint (posix): size in bytes} of every file under `directory` but its marker."""
    out: dict[str, int] = {}
    for root, _, names in os.walk(directory):
        for name in names:
            path = Path(root) / name
            rel = path.relative_to(directory).as_posix()
            if rel != MARKER:
                out[rel] = path.stat().st_size
    return dict(sorted(out.items()))


def problem(path: Path) -> Optional[str]:
    """What is wrong with the complete checkpoint at `path`, naming the bad file; None when it looks whole."""
    marker, why = _json(path / MARKER)
    if why:
        return why
    state, why = _json(path / TRAINER_STATE)
    if why:
        return why
    if not isinstance(state, dict) or not {"step", "config"} <= state.keys():
        return f"{path / TRAINER_STATE}: not a trainer state (no step or config)"
    files = marker.get("files") if isinstance(marker, dict) else None
    if isinstance(files, dict):
        return _missing_or_resized(path, files) or _dcp_metadata_framing(path)
    fmt = marker.get("format") if isinstance(marker, dict) else None
    if fmt == "deepspeed":
        return _deepspeed_structure(path, marker.get("world_size"))
    return _dcp_structure(path)


def _json(file: Path) -> tuple[Any, Optional[str]]:
    try:
        return json.loads(file.read_text()), None
    except FileNotFoundError:
        return None, f"{file}: missing"
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        return None, f"{file}: not readable JSON ({_short(exc)})"


def _missing_or_resized(path: Path, files: dict[str, Any]) -> Optional[str]:
    for rel, size in files.items():
        file = path / rel
        try:
            actual = file.stat().st_size
        except FileNotFoundError:
            return f"{file}: missing"
        if actual != size:
            return f"{file}: {actual} bytes, {size} when it was saved (cut short or overwritten)"
    return None


def _dcp_metadata_framing(path: Path) -> Optional[str]:
    """DCP's metadata is one pickle: its first byte is the protocol opcode, its last the STOP opcode."""
    file = path / DCP_DIR / DCP_METADATA
    if not file.exists():
        return None  # not a DCP checkpoint (the recorded files were all there)
    with file.open("rb") as f:
        first = f.read(1)
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
    if first != bytes([_PICKLE_PROTO]) or last != bytes([_PICKLE_STOP]):
        return f"{file}: not DCP metadata (not a pickle)"
    return None


def _dcp_structure(path: Path) -> Optional[str]:
    """Without a list of files: DCP's metadata read, and every byte range it points at inside its file."""
    directory = path / DCP_DIR
    file = directory / DCP_METADATA
    if not directory.is_dir():
        return f"{directory}: missing"
    if not file.is_file():
        return f"{file}: missing"
    from torch.distributed.checkpoint import FileSystemReader

    try:
        metadata = FileSystemReader(str(directory)).read_metadata()
    except Exception as exc:  # noqa: BLE001 - any unpickling failure means the same thing here
        return f"{file}: not readable DCP metadata ({_short(exc)})"
    ends: dict[str, int] = {}
    for info in (getattr(metadata, "storage_data", None) or {}).values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    for rel, end in sorted(ends.items()):
        data = directory / rel
        if not data.is_file():
            return f"{data}: missing"
        if data.stat().st_size < end:
            return f"{data}: {data.stat().st_size} bytes, but its metadata points up to byte {end} (cut short)"
    return None


def _deepspeed_structure(path: Path, world_size: Any) -> Optional[str]:
    directory = path / DEEPSPEED_DIR
    if not directory.is_dir():
        return f"{directory}: missing"
    partitions = list(directory.glob("*/*optim_states.pt"))
    if isinstance(world_size, int) and len(partitions) < world_size:
        return f"{directory}: {len(partitions)} optimizer partitions for {world_size} saved ranks"
    return None


def _short(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= 120 else text[:117] + "..."
