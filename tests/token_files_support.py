"""Token files to test with: a page of text, ids with a known largest one, launch/prepare_tokens.py's writer; for
tests/unit/test_token_files.py (the scan and the checks) and tests/launched/test_token_files.py (through the
launcher)."""

from __future__ import annotations

import importlib.util
from types import ModuleType

import numpy as np

from tests.helpers import ROOT

NOTES = "Meeting notes, Tuesday: we agreed to train the small model first. Café at 10 €.\n" * 60


def prepare_tokens_module() -> ModuleType:
    """launch/prepare_tokens.py as a module: its write() makes the sidecar training reads."""
    spec = importlib.util.spec_from_file_location("prepare_tokens", ROOT / "launch" / "prepare_tokens.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def token_ids(*, largest: int, count: int = 500, seed: int = 0) -> np.ndarray:
    """`count` ids below 200 with `largest` once, near the end (the last chunk of a chunked scan)."""
    ids = np.random.default_rng(seed).integers(0, 200, size=count)
    ids[count - 7] = largest
    return ids
