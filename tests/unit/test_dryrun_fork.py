"""The dry run's ranks forked from the estimator's process (estimate/dryrun/rows.py): the same figures as a fresh
interpreter per rank, a failing rank's last line, a rank that outlives its time killed, output of any size."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from dist_train.estimate.dryrun import rank as rank_module
from dist_train.estimate.dryrun import rows
from tests.helpers import FAST, ROOT, forked_python


def test_a_forked_rank_hands_back_output_larger_than_a_pipe(monkeypatch):
    big = "x" * (3 << 20)  # 3 MiB: many times a pipe's buffer, read while the rank writes
    monkeypatch.setattr(rank_module, "run_rank", lambda overrides, *, world_size, rank: {
        "rank": rank, "pid": os.getpid(), "overrides": overrides, "world_size": world_size, "big": big})
    out = rows._forked_rank(["a=1"], world_size=4, rank=3, timeout_s=60)
    assert out["rank"] == 3 and out["world_size"] == 4 and out["overrides"] == ["a=1"] and out["big"] == big
    assert out["pid"] != os.getpid()


def test_a_forked_rank_that_fails_is_its_last_line(monkeypatch):
    def fails(overrides, *, world_size, rank):
        print("noise on stdout, kept from the estimator's JSON")
        raise ValueError("no such layer: h.9")

    monkeypatch.setattr(rank_module, "run_rank", fails)
    with pytest.raises(RuntimeError, match=r"^dry run of rank 1 of 2 failed: ValueError: no such layer: h\.9$"):
        rows._forked_rank([], world_size=2, rank=1, timeout_s=60)


def test_a_forked_rank_past_its_time_is_killed(monkeypatch):
    monkeypatch.setattr(rank_module, "run_rank", lambda overrides, *, world_size, rank: time.sleep(120))
    start = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        rows._forked_rank([], world_size=2, rank=0, timeout_s=0.5)
    assert time.monotonic() - start < 30  # killed and reaped, not waited for


@pytest.mark.multiproc
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
