"""Failures end cleanly: a rank that dies, raises or hangs ends the whole job fast, naming the rank, with no
process left behind; with a restart allowed the job resumes and finishes on the uninterrupted loss; a NaN
loss stops training at its step, once, on every rank.

Failures are injected with DIST_TRAIN_FAULT at a given step (dist_train/faults.py), so what happens never
depends on when a test manages to send a signal.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from dist_train.checkpoint.layout import complete_checkpoints, partial_checkpoints
from tests.helpers import FAST, ROOT, TRAIN, env, metrics
from tests.wandb_log import read_run


def _torchrun(overrides: list[str], *, run_dir: Path, fault: str, restarts: int = 0) -> tuple[int, str, float, set[int]]:
    """(exit code, stderr, seconds, pids of every process the launch started)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           f"--max-restarts={restarts}", str(TRAIN), *overrides, f"hydra.run.dir={run_dir}"]
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env(DIST_TRAIN_FAULT=fault), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    seen: set[int] = set()
    launcher = psutil.Process(proc.pid)
    while proc.poll() is None and time.perf_counter() - start < 120:
        try:
            seen |= {p.pid for p in launcher.children(recursive=True)}
        except psutil.NoSuchProcess:
            pass
        time.sleep(0.2)
    try:
        _, stderr = proc.communicate(timeout=max(1.0, 120 - (time.perf_counter() - start)))
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    return proc.returncode, stderr, time.perf_counter() - start, seen


def _alive(pids: set[int]) -> list[int]:
    out = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                out.append(pid)
        except psutil.NoSuchProcess:
            pass
    return out


LONG = ["strategy=ddp", *FAST, "train.steps=200"]


@pytest.mark.beside  # balances tests/suite.sh's two sessions
def test_a_killed_rank_ends_the_job_fast_naming_it(tmp_path):
    code, stderr, seconds, pids = _torchrun(LONG, run_dir=tmp_path, fault="kill@3:rank1")
    assert code != 0 and seconds < 60, (code, seconds)
    assert "rank      : 1 (local_rank: 1)" in stderr and "SIGKILL" in stderr, stderr[-3000:]
    assert len(pids) >= 2 and not _alive(pids)


@pytest.mark.beside  # balances tests/suite.sh's two sessions
def test_a_raising_rank_ends_the_job_with_its_exception(tmp_path):
    code, stderr, seconds, pids = _torchrun(LONG, run_dir=tmp_path, fault="raise@3:rank1")
    assert code != 0 and seconds < 60, (code, seconds)
    assert "[dist_train] rank 1 failed at step 3" in stderr, stderr[-3000:]
    assert "InjectedFault: injected failure" in stderr
    assert not _alive(pids)


@pytest.mark.beside
def test_a_hung_rank_ends_the_job_after_runtime_timeout(tmp_path):
    # The hung rank ignores torchrun's SIGTERM until runtime.stop_grace_s (a rank may need it to reach the step every
    # rank stops after, tests/launched/test_interrupt.py); here it has no step to reach.
    code, stderr, seconds, pids = _torchrun([*LONG, "runtime.timeout_s=5", "runtime.stop_grace_s=1"], run_dir=tmp_path,
                                            fault="hang@3:rank1")
    assert code != 0 and seconds < 60, (code, seconds)
    assert "Timed out" in stderr and "rank 0 failed at step 3" in stderr, stderr[-3000:]
    assert "rank 1: not stopped 1 s after SIGTERM (stuck outside a step): exiting" in stderr, stderr[-3000:]
    assert not _alive(pids)


@pytest.mark.beside  # balances tests/suite.sh's two sessions
def test_a_restarted_job_resumes_and_ends_on_the_uninterrupted_loss(straight_run, tmp_path):
    """Rank 1 dies at step 6; torchrun restarts both ranks, which resume from the newest complete checkpoint."""
    _, straight = straight_run("ddp")
    overrides = ["strategy=ddp", *FAST, "logger=wandb", "train.steps=8", "checkpoint.every_steps=2"]
    code, stderr, _, pids = _torchrun(overrides, run_dir=tmp_path, fault="kill@6:rank1", restarts=1)
    assert code == 0, stderr[-4000:]
    assert "resumed from" in stderr
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["losses"] == straight["losses"]  # bit-exact, whichever checkpoint it resumed from
    rows = metrics(tmp_path)
    assert sorted((r["step"], r["rank"]) for r in rows) == [(s, r) for s in range(1, 9) for r in (0, 1)]
    assert [s for s, _ in complete_checkpoints(tmp_path / "checkpoints")][-1] == 8
    assert not partial_checkpoints(tmp_path / "checkpoints")
    # One W&B run, continued: both attempts wrote under the same run id; the second starts after its checkpoint.
    runs = sorted((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 2 and runs[0].name.split("-")[-1] == runs[1].name.split("-")[-1]
    second = read_run(next(runs[1].glob("run-*.wandb")))
    assert second["history"][0]["_step"] == summary["start_step"] + 1
    assert second["history"][-1]["_step"] == 8
    assert not _alive(pids)


@pytest.mark.beside  # balances tests/suite.sh's two sessions
def test_a_nan_loss_stops_at_its_step_once_and_is_never_checkpointed(tmp_path):
    overrides = ["strategy=ddp", *FAST, "train.steps=8", "checkpoint.every_steps=1"]
    code, stderr, _, pids = _torchrun(overrides, run_dir=tmp_path, fault="nan@3")
    assert code != 0
    lines = [ln for ln in stderr.splitlines() if "training stopped at step 3: the loss is nan" in ln]
    assert len(lines) == 1, stderr[-3000:]
    root = tmp_path / "checkpoints"
    assert [s for s, _ in complete_checkpoints(root)] == [1, 2] and not partial_checkpoints(root)
    at_three = [r for r in metrics(tmp_path) if r["step"] == 3]
    assert len(at_three) == 2 and all(r["loss"] is None for r in at_three)  # logged (NaN is JSON null), then stop
    assert not _alive(pids)
