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
