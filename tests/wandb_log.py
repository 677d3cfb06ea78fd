"""Read an offline W&B run (`run-*.wandb`) back, so tests check the figures W&B would show.

The file is a LevelDB-style log (W&B's `:W&B` header, 32 KiB blocks of typed, length-prefixed chunks)
of `wandb_internal_pb2.Record` protobufs; wandb 0.31 ships no Python reader for it.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

_BLOCK = 32 * 1024
_HEADER = 7  # ":W&B" + magic (2 bytes) + version (1 byte)
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def records(path: Path) -> list[bytes]:
    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B run file"
    out, pending, pos = [], b"", _HEADER
    while pos + 7 <= len(data):
        block_left = _BLOCK - pos % _BLOCK
        if block_left < 7:  # trailer too small for a chunk header: skip to the next block
            pos += block_left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind == 0 and length == 0:
            pos += _BLOCK - pos % _BLOCK if pos % _BLOCK else 0
            continue
        if kind == _FULL:
            out.append(chunk)
        elif kind == _FIRST:
            pending = chunk
        elif kind == _MIDDLE:
            pending += chunk
        elif kind == _LAST:
            out.append(pending + chunk)
            pending = b""
    return out


def read_run(run_file: Path) -> dict[str, Any]:
    """{'history': [ {key: value} per logged step ], 'summary': {...}, 'run': {group, display_name}}."""
    from wandb.proto import wandb_internal_pb2 as pb

    result: dict[str, Any] = {"history": [], "summary": {}, "run": {}}
    for raw in records(run_file):
        rec = pb.Record()
        rec.ParseFromString(raw)
        kind = rec.WhichOneof("record_type")
        if kind == "history":
            result["history"].append({_key(i): json.loads(i.value_json) for i in rec.history.item})
        elif kind == "summary":
            for item in rec.summary.update:
                result["summary"][_key(item)] = json.loads(item.value_json)
        elif kind == "run":
            result["run"] = {"group": rec.run.run_group, "name": rec.run.display_name}
    return result


def _key(item: Any) -> str:
    return item.key or "/".join(item.nested_key)
