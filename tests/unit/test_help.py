"""Help in this process: the options rendered from the config dataclasses with their defaults, training's defaults
as conf/config.yaml leaves them, and `python -m dist_train.slurm --help`. `--help` and `-h` on every entry point:
tests/launched/test_help.py."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass, field
from typing import Optional

from omegaconf import OmegaConf

from dist_train.config import TrainConfig
from dist_train.entry import config_groups, dataclass_options
from tests.helpers import ROOT, env


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
