"""What a token file holds, read without trusting it: whether it is text, and its largest token id.

config.py judges these facts against the model before anything starts (a token id >= the model's vocabulary
fails at step 1; text read as ids may fit a large vocabulary and train on garbage); this module only reads the
file. It imports nothing of the project.
"""

from __future__ import annotations

import os
from typing import Callable

# The scan reads a fresh memory map of each chunk and drops it before the next: mapping the whole file would
# count every page it touched in the process's VmHWM (the set-up peak the telemetry reports), tens of GB for a
# large file. Measured here (2 cores, local disk) on a 1 GiB uint16 file: 0.08-0.14 s from the page cache,
# 0.8 s from disk (VmHWM +64 MiB either way); so 10B tokens (20 GB) take about 2 s cached and 16 s cold, more
# on a network filesystem.
CHUNK_BYTES = 64 * 2**20
# A scan this large is announced first, so that a pause before step 1 has its reason on the console.
LONG_SCAN_BYTES = 4 * 2**30
TEXT_HEAD_BYTES = 4096

ITEM_BYTES = {"uint16": 2, "uint32": 4}  # the dtypes a token file may hold, and their bytes per id
_scanned: dict[tuple[str, str, int, int], int] = {}  # (real path, dtype, size, mtime_ns) -> largest id


def scan_max_id(path: str, *, dtype: str, chunk_bytes: int = CHUNK_BYTES) -> int:
    """The largest token id in a whole file of `dtype` ids (-1 if it holds none), read chunk by chunk."""
    import numpy as np

    itemsize = ITEM_BYTES[dtype]
    chunk = max(chunk_bytes // itemsize, 1) * itemsize
    size = os.path.getsize(path) // itemsize * itemsize  # a trailing partial id is not an id
    largest = -1
    for offset in range(0, size, chunk):
        ids = np.memmap(path, dtype=dtype, mode="r", offset=offset, shape=(min(chunk, size - offset) // itemsize,))
        largest = max(largest, int(ids.max()))
        del ids  # unmapped before the next chunk is mapped
    return largest


def max_token_id(path: str, *, dtype: str, announce: Callable[[str], None] | None = None) -> int:
    """scan_max_id, once per file and dtype in this process (the checks may run more than once: train,
    compare's rows); a file changed since (size or mtime) is scanned again. A scan of LONG_SCAN_BYTES or more
    is announced first through `announce`."""
    stat = os.stat(path)
    key = (os.path.realpath(path), dtype, stat.st_size, stat.st_mtime_ns)
    if key not in _scanned:
        if announce is not None and stat.st_size >= LONG_SCAN_BYTES:
            announce(f"data: {path} has no max_id in a sidecar (.json); reading all {stat.st_size / 2**30:.1f} GiB "
                     "for its largest token id (about 1 s per GiB from disk; launch/prepare_tokens.py records it)")
        _scanned[key] = scan_max_id(path, dtype=dtype)
    return _scanned[key]


def looks_like_text(path: str, *, head_bytes: int = TEXT_HEAD_BYTES) -> bool:
    """Whether the file's first bytes read as text: UTF-8, no NUL byte, and at least 95% printable characters
    or whitespace. Token ids almost never do: ids below 256 have a NUL byte (uint16's high byte, uint32's top
    two), and other ids put control bytes among the rest within a few tokens."""
    with open(path, "rb") as f:
        head = f.read(head_bytes)
    if not head or b"\0" in head:
        return False
    try:
        text = head.decode("utf-8")
    except UnicodeDecodeError as exc:
        if exc.start < len(head) - 3:  # not merely a character cut at the end of the head
            return False
        text = head[: exc.start].decode("utf-8")
    readable = sum(c.isprintable() or c in "\t\n\r\f\v" for c in text)
    return readable >= 0.95 * len(text)
