"""Bad input at every entry point: one `config error:` line, exit code 2, no traceback, nothing started.

The cases (tests/bad_input_support.py) are the "Bad input the tests try" table of docs/troubleshooting.md:
tests/unit/test_bad_input.py checks that the two say the same.
Under torchrun every rank finds the error; the line must still appear exactly once whichever rank exits
first (it used to be printed by rank 0 only, and was lost when rank 1 exited first: 2 launches in 6).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from dist_train.checkpoint.verify import manifest
from dist_train.compare.runner import run_strategy
from dist_train.compare.settings import StrategySpec
from tests.bad_input_support import CASES, COMPARE, TRAIN
from tests.helpers import ROOT, env, forked_python, train_ok


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    run_dir = tmp_path_factory.mktemp("ckpt")
    train_ok(["strategy=single", "logger=none", "train.steps=2", "checkpoint.every_steps=2"], run_dir=run_dir)
    ckpt = run_dir / "checkpoints" / "step-00000002"
    partial = run_dir / "interrupted" / "step-00000002"
    shutil.copytree(ckpt, partial)
    (partial / "COMPLETE").unlink()
    zero = run_dir / "zero" / "step-00000002"
    shutil.copytree(ckpt, zero)
    marker = json.loads((zero / "COMPLETE").read_text())
    (zero / "COMPLETE").write_text(json.dumps({**marker, "format": "deepspeed"}))
    state = json.loads((zero / "trainer.json").read_text())
    (zero / "trainer.json").write_text(json.dumps({**state, "strategy": "zero2"}))
    marker = json.loads((zero / "COMPLETE").read_text())  # its list of files as they now are: whole, not damaged
    (zero / "COMPLETE").write_text(json.dumps({**marker, "files": manifest(zero)}))
    return {"ckpt": str(ckpt), "partial": str(partial), "zero": str(zero)}


def _command(entry: str, args: str, run_dir: Path) -> tuple[list[str], dict[str, str]]:
    """(python's argv after the interpreter, the extra environment) of a case."""
    words = args.split()
    extra = dict(w.split("=", 1) for w in words if w.startswith("DIST_TRAIN_FAULT="))
    words = [w for w in words if not w.startswith("DIST_TRAIN_FAULT=")]
    argv = [*entry.split(), *words]
    if entry == TRAIN:
        argv += ["logger=none", f"hydra.run.dir={run_dir}"]
    if entry == COMPARE:
        argv += [f"compare.out_dir={run_dir}"]
    return argv, extra


# The first case of each entry point runs in a fresh interpreter, where a message printed by an import (a library's
# warning) would show beside the line (the test then wants nothing else); the others are forked from
# tests/forkserver.py, whose imports are done (their output is the entry point's own). 25 fresh interpreters took 62 s
# of the suite.
FRESH = sorted({next(i for i, (e, _, _) in enumerate(CASES) if e == entry) for entry, _, _ in CASES})


@pytest.fixture(scope="module")
def outcomes(checkpoints, tmp_path_factory) -> dict[tuple[str, str], tuple[subprocess.CompletedProcess[str], Path]]:
    """Every case launched once: FRESH ones as fresh interpreters, three at a time (each mostly importing torch),
    the rest forked one after another; the tests below judge one case each."""
    root = tmp_path_factory.mktemp("bad-input")

    def prepared(index: int) -> tuple[list[str], dict[str, str], Path]:
        entry, args, _ = CASES[index]
        run_dir = root / str(index) / "run"
        return (*_command(entry, args.format(**checkpoints), run_dir), run_dir)

    def fresh(index: int) -> tuple[subprocess.CompletedProcess[str], Path]:
        argv, extra, run_dir = prepared(index)
        return subprocess.run([sys.executable, *argv], cwd=ROOT, env=env(**extra), capture_output=True, text=True,
                              timeout=180), run_dir

    def forked(index: int) -> tuple[subprocess.CompletedProcess[str], Path]:
        argv, extra, run_dir = prepared(index)
        return forked_python(argv, timeout=180, **extra), run_dir

    with ThreadPoolExecutor(max_workers=3) as pool:
        results = dict(zip(FRESH, pool.map(fresh, FRESH)))
    results.update((i, forked(i)) for i in range(len(CASES)) if i not in results)
    return {(entry, args): results[i] for i, (entry, args, _) in enumerate(CASES)}


@pytest.mark.parametrize(("entry", "args", "says"), CASES, ids=[f"{e.split('/')[-1]} {a}" for e, a, _ in CASES])
def test_bad_input_is_one_line_and_exit_2(entry, args, says, outcomes):
    proc, run_dir = outcomes[(entry, args)]
    ours = [line for line in proc.stderr.splitlines() if line.startswith("config error:")]
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert len(ours) == 1 and says in ours[0], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "HYDRA_FULL_ERROR" not in proc.stderr, proc.stderr[-3000:]
    assert not (run_dir / "metrics.jsonl").exists()
    if CASES.index((entry, args, says)) in FRESH:  # a fresh interpreter: nothing but the line, no import's message
        assert proc.stderr.strip().splitlines() == ours, proc.stderr[-3000:]


@pytest.mark.beside  # balances the two sessions of tests/suite.sh; no fixture shared with the launched session
def test_config_error_shows_exactly_once_in_4_torchrun_launches(tmp_path):
    """Whichever rank exits first: one line, every time, and compare's failure reason is that line.

    Two launches at a time: the machine is loaded as it is in a busy CI, which makes the order in which the
    ranks exit vary more. (Three at a time on 2 cores took longer than two, measured; 20 launches, then 10, then 6
    cost the suite time it no longer has: 80 s, 43 s, 49 s.)"""
    spec = StrategySpec.parse("ddp")

    def launch(attempt: int):
        return run_strategy(spec, training=["train.lr=-1", "logger=none"], nproc=2, out_dir=tmp_path / str(attempt),
                            group="bad", timeout_s=120)

    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(launch, range(4)))
    for attempt, result in enumerate(results):
        log = result.log_path.read_text()
        lines = [line for line in log.splitlines() if line.startswith("config error:")]
        assert result.returncode not in (0, None), log[-3000:]
        assert lines == ["config error: train.lr=-1.0 must be > 0"], f"launch {attempt + 1}: {log[-3000:]}"
        assert result.reason.startswith("config error: train.lr=-1.0 must be > 0"), result.reason
