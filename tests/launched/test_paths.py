"""Paths as users type them: `~`, `$HOME` and relative paths in every path option (dist_train/paths.py)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from types import SimpleNamespace

import pytest

from dist_train.checkpoint.compat import _saved
from dist_train.paths import PATH_KEYS, expand_overrides, normalize_paths, user_path
from tests.helpers import ROOT, TRAIN, env


def test_a_tilde_that_starts_a_value_or_list_element_is_expanded_as_the_shell_would():
    home = os.path.expanduser("~")
    assert expand_overrides(["model.path=~/models/llama", "compare.from=[~/a,/b,~/c]", "train.steps=3"]) == [
        f"model.path={home}/models/llama", f"compare.from=[{home}/a,/b,{home}/c]", "train.steps=3"]
    # Hydra's `~key` deletes a key; a flag and a `~` inside a value are not the shell's either
    assert expand_overrides(["~model.path", "--check-config", "data.path=a~b"]) == [
        "~model.path", "--check-config", "data.path=a~b"]


def test_a_path_option_becomes_absolute_with_its_variables_expanded(tmp_path, monkeypatch):
    monkeypatch.setenv("DATA_ROOT", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    assert user_path("$DATA_ROOT/corpus.bin") == str(tmp_path / "corpus.bin")
    assert user_path("data/../corpus.bin") == str(tmp_path / "corpus.bin")
    assert user_path("~") == os.path.expanduser("~")
    run = SimpleNamespace(model=SimpleNamespace(path="m"), data=SimpleNamespace(path="$DATA_ROOT/x.bin"),
                          eval=SimpleNamespace(path=None), checkpoint=SimpleNamespace(dir="ck", resume="auto"))
    normalize_paths(run)
    assert (run.model.path, run.data.path, run.eval.path) == (str(tmp_path / "m"), str(tmp_path / "x.bin"), None)
    assert (run.checkpoint.dir, run.checkpoint.resume) == (str(tmp_path / "ck"), "auto")  # auto is not a path
    assert {group for group, _ in PATH_KEYS} == {"model", "data", "eval", "checkpoint"}


def test_a_checkpoint_that_recorded_a_relative_path_still_matches_the_same_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert _saved({"data": {"path": "corpus.bin"}}, "data", "path") == str(tmp_path / "corpus.bin")
    assert _saved({"train": {"seed": 3}}, "train", "seed") == 3


@pytest.mark.multiproc
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


@pytest.mark.multiproc
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
