"""launch/export.py's --merge of a run without adapters: refused in one line from the checkpoint's stored config,
before anything is read or written. Exports of real LoRA and QLoRA runs: tests/launched/test_export_lora.py."""

from __future__ import annotations

import json

import pytest

from dist_train.checkpoint.layout import step_dir_name


def test_merge_of_a_run_without_adapters_is_refused_in_one_line(tmp_path):
    """Refused from the checkpoint's stored config (peft=none), before any weight is read or anything written."""
    from dist_train.checkpoint.layout import MARKER, TRAINER_STATE
    from dist_train.export import export_pretrained

    checkpoint = tmp_path / step_dir_name(4)
    checkpoint.mkdir()
    (checkpoint / MARKER).write_text(json.dumps({"step": 4, "format": "dcp", "world_size": 1}))
    (checkpoint / TRAINER_STATE).write_text(json.dumps({"step": 4, "config": {"peft": {"name": "none"}}}))
    out = tmp_path / "out"
    with pytest.raises(ValueError) as err:
        export_pretrained(checkpoint, out, merge=True)
    assert "--merge folds LoRA adapters" in str(err.value) and "peft=none" in str(err.value)
    assert "\n" not in str(err.value) and not out.exists()


def test_an_export_into_a_directory_that_holds_files_is_refused_before_anything_is_read(tmp_path):
    """A directory that holds another model (the run's own base model, say) is not written over without
    --overwrite: one line naming it, checked before the checkpoint is even looked at (here it does not exist)."""
    from dist_train.export import export_pretrained

    base = tmp_path / "base-model"
    base.mkdir()
    for name in ("config.json", "model.safetensors", "generation_config.json", "tokenizer.json"):
        (base / name).write_text("theirs")
    with pytest.raises(ValueError) as err:
        export_pretrained(tmp_path / "no-such-checkpoint", base)
    message = str(err.value)
    assert f"{base} already holds 4 file(s) (config.json, generation_config.json, model.safetensors, ...)" in message
    assert "--overwrite" in message and "\n" not in message
    assert all((base / n).read_text() == "theirs" for n in ("config.json", "model.safetensors"))
    # with --overwrite the directory is accepted: the next thing refused is the missing checkpoint
    with pytest.raises(ValueError) as missing:
        export_pretrained(tmp_path / "no-such-checkpoint", base, overwrite=True)
    assert "no-such-checkpoint" in str(missing.value)
    (tmp_path / "a-file").write_text("x")
    with pytest.raises(ValueError, match="is a file: name a new or empty directory"):
        export_pretrained(tmp_path / "no-such-checkpoint", tmp_path / "a-file")
