"""Paths as users type them: `~`, `$HOME` and relative paths in every path option (dist_train/paths.py). Through
the entry points: tests/launched/test_paths.py."""

from __future__ import annotations

import os
from types import SimpleNamespace

from dist_train.checkpoint.compat import _saved
from dist_train.paths import PATH_KEYS, expand_overrides, normalize_paths, user_path


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


def test_what_was_typed_is_the_latest_entry_calls_value(tmp_path, monkeypatch):
    """as_typed answers for the entry call at hand: an earlier call in the same process (a test session, a sweep)
    that typed the same path otherwise does not decide for it (a hub name's hint, dist_train/pretrained.py)."""
    from dist_train.paths import as_typed

    monkeypatch.chdir(tmp_path)

    def typed(value: str) -> str:
        run = SimpleNamespace(model=SimpleNamespace(path=value))
        normalize_paths(run)
        return as_typed(run.model.path)

    assert typed("org/model") == "org/model"
    assert typed(str(tmp_path / "org" / "model")) == str(tmp_path / "org" / "model")
    assert typed("org/model") == "org/model"
