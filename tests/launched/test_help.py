"""`--help` and `-h` on every entry point: what it does, its options with their defaults, three examples; exit 0."""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Optional

import pytest
from omegaconf import OmegaConf

from dist_train.config import TrainConfig
from dist_train.entry import config_groups, dataclass_options
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


@pytest.mark.multiproc
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


@pytest.mark.multiproc
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


@dataclass
class _Example:
    # Where it goes, e.g. a path. More words.
    from_: list[str] = field(default_factory=lambda: ["a", "b"])
    out: Optional[str] = None  # None: a directory of its own
    fast: bool = True
    rtol: float = 1e-4


def test_dataclass_options_render_defaults_and_notes():
    lines = dataclass_options(_Example, "x.")
    text = "\n".join(lines)
    assert lines[0].startswith("  x.from=[a,b]") and lines[0].endswith("Where it goes, e.g. a path.")
    assert "More words" not in text  # the first sentence only
    assert "  x.out=null" in text and text.splitlines()[1].endswith("null: a directory of its own")
    assert "  x.fast=true" in lines and "  x.rtol=0.0001" in lines


def test_help_defaults_are_the_ones_training_uses():
    """train.py's help shows TrainConfig's defaults: conf/config.yaml must not set others."""
    yaml_train = OmegaConf.to_container(OmegaConf.load(ROOT / "conf" / "config.yaml"))["train"]
    for key, value in yaml_train.items():
        assert getattr(TrainConfig(), key) == value, key
    groups = {name: (options, default) for name, options, default in config_groups(ROOT / "conf")}
    assert "fsdp" in groups["strategy"][0] and groups["strategy"][1] == "ddp" and groups["model"][1] == "tiny"


def test_the_slurm_entry_point_has_help_and_says_where_it_runs():
    """`python -m dist_train.slurm` (what launch/slurm.sbatch runs): help anywhere; outside a job one line, exit 2."""
    job_free = {k: v for k, v in env().items() if not k.startswith("SLURM_")}
    helped = subprocess.run([sys.executable, "-m", "dist_train.slurm", "--help"], cwd=ROOT, env=job_free,
                            capture_output=True, text=True, timeout=60)
    assert helped.returncode == 0 and "one torchrun per node" in helped.stdout and "--signal" in helped.stdout
    outside = subprocess.run([sys.executable, "-m", "dist_train.slurm", "strategy=ddp"], cwd=ROOT, env=job_free,
                             capture_output=True, text=True, timeout=60)
    assert outside.returncode == 2 and outside.stderr.splitlines() == [
        "dist_train.slurm runs inside a Slurm job: submit it with sbatch launch/slurm.sbatch ... (--help says more)"]
