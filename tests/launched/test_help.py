"""`--help` and `-h` on every entry point: what it does, its options with their defaults, three examples; exit 0;
and quiet into a closed pipe. The option lines and defaults in this process: tests/unit/test_help.py."""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.helpers import ROOT, env

# entry point -> strings its help must contain
ENTRIES = {
    "launch/train.py": ["Train one model under one strategy", "--check-config", "strategy", "fsdp", "train.steps=20",
                        "train.global_batch_size=null", "checkpoint.resume=auto", "eval.every_steps=0",
                        "hydra.run.dir=PATH", "--multirun", "model=hf model.path=DIR"],
    "launch/compare.py": ["several strategies", "compare.strategies=[single,ddp,", "compare.nproc=2",
                          "compare.from=[]", "compare.sweep", "130"],
    "launch/dashboard.py": ["W&B workspace view", "out=FILE", "dashboard.json"],
    "launch/export.py": ["save_pretrained", "--merge", "CHECKPOINT"],
    "launch/prepare_tokens.py": ["data=tokens", "--tokenizer", "default: train", "default: text"],
    "launch/plan.py": ["cluster.gpu=h100", "cluster.nodes=1", "plan.verify=0", "plan.calibrate=false", "format=text",
                       "h100, h200, a100, l40s, cpu"],
}


@pytest.mark.beside
def test_every_entry_point_has_help():
    from dist_train.dashboard import _OPTIONS  # what the dashboard accepts: its help lists each one

    ENTRIES["launch/dashboard.py"] += [f"{o}=" for o in _OPTIONS]
    runs = [(script, flag) for script in ENTRIES for flag in ("--help", "-h")]

    def run(job: tuple[str, str]) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, job[0], job[1]], cwd=ROOT, env=env(), capture_output=True, text=True,
                              timeout=120)

    with ThreadPoolExecutor(max_workers=2) as pool:
        results = dict(zip(runs, pool.map(run, runs)))
    for (script, flag), proc in results.items():
        said = f"{script} {flag}: rc={proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
        assert proc.returncode == 0, said
        assert "config error" not in proc.stdout + proc.stderr and "Traceback" not in proc.stderr, said
        examples = [ln for ln in proc.stdout.splitlines() if ln.startswith(("python ", "torchrun "))]
        assert len(examples) >= 3, said
        missing = [s for s in ENTRIES[script] if s not in proc.stdout]
        assert not missing, f"{missing} not in {said}"
        assert proc.stdout == results[(script, "--help")].stdout, said
    assert "schema/" not in results[("launch/train.py", "--help")].stdout  # Hydra's internal groups stay hidden


@pytest.mark.beside
def test_help_into_a_closed_pipe_ends_quietly():
    """`--help | head`: once the reader has gone, the next write fails (Python ignores SIGPIPE and raises
    BrokenPipeError). The reader here is gone before the first write, so every entry point meets it, whatever the
    help's length and the timing; each ends with no traceback and the status of a tool that SIGPIPE ended."""
    from dist_train.entry import SIGPIPE_EXIT

    commands = [[script] for script in ENTRIES] + [["-m", "dist_train.estimate"]]

    def run(command: list[str]) -> subprocess.CompletedProcess[str]:
        read, write = os.pipe()
        os.close(read)
        try:
            return subprocess.run([sys.executable, *command, "--help"], cwd=ROOT, env=env(), stdout=write,
                                  stderr=subprocess.PIPE, text=True, timeout=120)
        finally:
            os.close(write)

    with ThreadPoolExecutor(max_workers=2) as pool:
        results = dict(zip(map(" ".join, commands), pool.map(run, commands)))
    for command, proc in results.items():
        said = f"{command} --help: rc={proc.returncode}\n{proc.stderr[-2000:]}"
        assert proc.returncode == SIGPIPE_EXIT, said
        assert not any(s in proc.stderr for s in ("Traceback", "BrokenPipeError", "Exception ignored")), said
