"""The suite's forked launches (tests/forkserver.py) train as torchrun's do, and fail as torchrun's fail."""

from __future__ import annotations

import pytest

from tests.helpers import FAST, ForkServer, forked, launch, summary


def test_a_forked_launch_trains_bit_for_bit_as_a_torchrun_launch(fast_run, tmp_path):
    if ForkServer.get() is None:
        pytest.skip("DIST_TRAIN_TEST_FORK=0: every launch of this session is torchrun's")
    run_dir, ours = fast_run("strategy=ddp", nproc=2)  # forked (tests/helpers.train_ok), shared with other tests
    real = launch(["strategy=ddp", *FAST], run_dir=tmp_path, nproc=2)
    assert real.returncode == 0, real.stderr[-3000:]
    theirs = summary(tmp_path)
    assert ours["losses"] == theirs["losses"] and len(ours["losses"]) == 5
    for a, b in zip(ours["ranks"], theirs["ranks"]):
        for key in ("memory/params_bytes", "memory/grads_bytes", "memory/optimizer_bytes", "comm/all_reduce/count",
                    "comm/all_reduce/bytes"):
            assert a[key] == b[key], key
    assert [r["rank"] for r in ours["ranks"]] == [0, 1]


def test_a_failing_forked_worker_stops_its_peer_and_the_launch_exits_1(tmp_path):
    """Rank 1 raises before step 2; rank 0, waiting in the step's all-reduce, is stopped by the agent as torchrun
    stops it (a hang would raise TimeoutExpired here)."""
    proc = forked(["strategy=ddp", *FAST], run_dir=tmp_path, nproc=2, timeout=300,
                  extra_env={"DIST_TRAIN_FAULT": "raise@2:rank1"})
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "DIST_TRAIN_FAULT" in proc.stderr or "raise" in proc.stderr, proc.stderr[-3000:]


def test_a_forked_launch_that_ends_at_once_is_answered_at_once(tmp_path):
    """A bad override ends the process before any training: the server's two answers (the agent, its exit code)
    arrive together, and the client must not wait for a third (it would raise TimeoutExpired here)."""
    proc = forked(["strategy=fsdpp", "logger=none"], run_dir=tmp_path, timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert [ln for ln in proc.stderr.splitlines() if ln.startswith("config error:")], proc.stderr[-3000:]
