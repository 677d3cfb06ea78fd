"""`launch/train.py --check-config ARGS` run in this process (tests/launched/test_setup_memory.py): whether Python's
collector is on when the training's `main` starts, and how many objects were frozen out of its collections by then
(launch/train.py turns it off for its imports; dist_train.runtime.imports_done turns it on again). One JSON line."""

import gc
import json
import runpy
import sys
from pathlib import Path

import dist_train.train

ROOT = Path(__file__).resolve().parent.parent
seen = {"frozen_before": gc.get_freeze_count()}
main = dist_train.train.main


def watched(*args, **kwargs):
    seen.update(enabled=gc.isenabled(), frozen=gc.get_freeze_count())
    return main(*args, **kwargs)


dist_train.train.main = watched
sys.argv = [str(ROOT / "launch" / "train.py"), "--check-config", *sys.argv[1:]]
try:
    runpy.run_path(sys.argv[0], run_name="__main__")
except SystemExit as stop:
    seen["exit"] = stop.code
print(json.dumps(seen))
