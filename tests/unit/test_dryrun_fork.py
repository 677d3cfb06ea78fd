"""The dry run's ranks forked from the estimator's process (estimate/dryrun/rows.py): a failing rank's last line, a
rank that outlives its time killed, output of any size. The same figures as a fresh interpreter per rank, through
`python -m dist_train.estimate`: tests/launched/test_dryrun_fork.py."""

from __future__ import annotations

import os
import subprocess
import time

import pytest

from dist_train.estimate.dryrun import rank as rank_module
from dist_train.estimate.dryrun import rows


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


@pytest.mark.parametrize("fails", [False, True])
def test_the_estimators_objects_are_frozen_while_its_ranks_fork_and_collected_again_after(monkeypatch, fails):
    """run_ranks freezes this process's objects out of the collector while it forks the ranks (a rank's collections
    would copy their pages) and unfreezes them after, a failing rank included: the estimator's own garbage is
    collected again."""
    import gc

    frozen = []

    def forked(overrides, *, world_size, rank, timeout_s):
        frozen.append(gc.get_freeze_count())
        if fails:
            raise RuntimeError(f"dry run of rank {rank} of {world_size} failed: boom")
        return {"rank": rank}

    monkeypatch.setattr(rows, "_preload", lambda: None)
    monkeypatch.setattr(rows, "_single_threaded", lambda: True)
    monkeypatch.setattr(rows, "_forked_rank", forked)
    before = gc.get_freeze_count()
    assert before == 0  # nothing frozen by the test's process (a caller's freeze: the test below)
    if fails:
        with pytest.raises(RuntimeError, match="boom"):
            rows.run_ranks([], world_size=2, ranks=[0, 1], timeout_s=60)
    else:
        assert rows.run_ranks([], world_size=2, ranks=[0, 1], timeout_s=60) == [{"rank": 0}, {"rank": 1}]
    assert frozen and all(count > before for count in frozen)
    assert gc.get_freeze_count() == before


def test_a_callers_own_freeze_is_left_as_it_was(monkeypatch):
    """run_ranks from a process that froze its objects itself neither freezes more nor thaws the caller's after
    (gc.unfreeze would thaw everything)."""
    import gc

    counts = []

    def forked(overrides, *, world_size, rank, timeout_s):
        counts.append(gc.get_freeze_count())
        return {"rank": rank}

    monkeypatch.setattr(rows, "_preload", lambda: None)
    monkeypatch.setattr(rows, "_single_threaded", lambda: True)
    monkeypatch.setattr(rows, "_forked_rank", forked)
    gc.freeze()
    try:
        caller = gc.get_freeze_count()
        assert caller > 0
        young = [[] for _ in range(1000)]  # tracked after the caller's freeze: another gc.freeze() would take them in
        assert rows.run_ranks([], world_size=2, ranks=[0, 1], timeout_s=60) == [{"rank": 0}, {"rank": 1}]
        # A frozen object that dies leaves the permanent generation, so the count may fall by a few meanwhile (by 2
        # once in a suite: 662,319 -> 662,317); it never rises by `young` (no freeze) nor falls to 0 (no thaw).
        for count in [*counts, gc.get_freeze_count()]:
            assert caller - 1000 < count < caller + len(young), (caller, counts, gc.get_freeze_count())
        assert len(counts) == 2
    finally:
        gc.unfreeze()
