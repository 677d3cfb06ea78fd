"""The benchmarks' scripts (bench/*.py) imported into a test's process, for tests/unit/test_bench.py and
tests/launched/test_bench.py."""

from __future__ import annotations

import importlib
import sys
from types import ModuleType

from tests.helpers import ROOT


def bench_module(name: str) -> ModuleType:
    """bench/<name>.py as the module `name`, imported as the scripts import each other (bench/ on sys.path)."""
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(ROOT / "bench"))
