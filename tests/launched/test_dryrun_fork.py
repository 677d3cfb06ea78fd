"""The dry run's ranks forked from the estimator's process (estimate/dryrun/rows.py), through
`python -m dist_train.estimate`: the same figures as a fresh interpreter per rank. A forked rank's failures and
output: tests/unit/test_dryrun_fork.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.helpers import FAST, ROOT, forked_python


def test_the_estimator_forks_its_ranks_and_they_give_a_fresh_interpreters_figures():
    """`python -m dist_train.estimate` sets OMP_NUM_THREADS=1 (unless given), so that after the imports it is one
    thread and forks its ranks; with DIST_TRAIN_DRYRUN_FORK=0 each rank is a fresh interpreter. Rank 1 of 2 of a
    ddp run, both ways: the same figures."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    probe = ("import runpy, sys; sys.argv = ['x', '--help']\n"
             "try: runpy.run_module('dist_train.estimate', run_name='__main__')\n"
             "except SystemExit: pass\n"
             "from dist_train.estimate.dryrun.rows import _preload, _single_threaded\n"
             "_preload(); print('single-threaded', _single_threaded())")
    proc = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.stdout.strip().endswith("single-threaded True"), proc.stdout[-2000:] + proc.stderr[-2000:]
    argv = ["-m", "dist_train.estimate", "strategy=ddp", *FAST, "world_size=2", "dryrun.ranks=[1]", "format=json"]
    forked, fresh = forked_python(argv), forked_python(argv, DIST_TRAIN_DRYRUN_FORK="0")
    assert forked.returncode == fresh.returncode == 0, forked.stderr[-2000:] + fresh.stderr[-2000:]
    a, b = (json.loads(p.stdout)["dryrun"]["ranks"][0]["measured"] for p in (forked, fresh))
    keys = {k for k in b if k.startswith(("memory/", "comm/"))}
    assert keys and {k: a[k] for k in keys} == {k: b[k] for k in keys}
