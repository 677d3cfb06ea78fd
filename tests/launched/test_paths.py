"""Paths as users type them, through the entry points: `~`, `$HOME` and relative paths reach training's checks
expanded, and compare's own path options take `~`. The expansion itself: tests/unit/test_paths.py."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from tests.helpers import ROOT, TRAIN, env


@pytest.mark.beside
def test_paths_as_the_docs_write_them_reach_the_checks_expanded(tmp_path):
    """`model.path=~/...` used to fail in Hydra's lexer (`token recognition error at: '~'`); relative and `$HOME`
    paths are now checked, and named, as the absolute paths they are."""
    home = tmp_path / "home"
    (home / "corpus").mkdir(parents=True)
    cases = {
        "model.path=~/models/my-llama": f"model.path='{home}/models/my-llama' is not a local directory",
        "data.path=$HOME/nothing.bin": f"data.path='{home}/nothing.bin' is not a readable file",
        "data.path=corpus/none.bin": f"data.path='{home}/corpus/none.bin' is not a readable file",
    }
    for override, says in cases.items():
        group = ["model=hf"] if override.startswith("model.") else ["data=tokens"]
        proc = subprocess.run([sys.executable, str(TRAIN), "--check-config", *group, override], cwd=home,
                              env=env(HOME=str(home)), capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2, proc.stderr
        assert proc.stderr.strip().splitlines() == [f"config error: {says}"], proc.stderr


def test_compare_takes_tilde_paths_for_its_runs_and_its_report(single_run, tmp_path):
    """compare's own path options (compare.from, compare.out_dir) as the docs write paths: `~` expanded, not a
    directory named `~` under the current one."""
    home = tmp_path / "home"
    shutil.copytree(single_run[0], home / "runs" / "single")
    proc = subprocess.run([sys.executable, "launch/compare.py", "compare.from=[~/runs/single]",
                           "compare.out_dir=~/report", "compare.wandb=false"], cwd=ROOT, env=env(HOME=str(home)),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (home / "report" / "table.json").is_file() and not (ROOT / "~").exists()
