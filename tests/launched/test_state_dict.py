"""The strategy interface's state dicts: save after step 2, load into a perturbed twin, step 3 is identical."""

from __future__ import annotations

import json

import pytest

from tests.helpers import FAST, ROOT, forked


SCRIPT = ROOT / "tests" / "scripts" / "state_dict_roundtrip.py"


@pytest.mark.parametrize(
    ("strategy", "nproc"),
    [("single", 0), ("ddp", 2), ("fsdp", 2), ("zero2", 2), ("zero3", 2), ("gpipe", 2)],
)
def test_state_dict_round_trips_exactly(strategy, nproc, tmp_path):
    overrides = [f"strategy={strategy}", *FAST]
    # forked from tests/forkserver.py (its imports done once): what is read is the script's JSON line
    proc = forked(overrides, run_dir=tmp_path, nproc=nproc, script=SCRIPT, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    result = json.loads([line for line in proc.stdout.splitlines() if line.startswith("{")][-1])
    assert result["loss_a"] == result["loss_b"], result
    assert result["max_param_diff"] == 0.0, result
