"""bench/gpu_check.py's report, which otherwise runs only on a CUDA machine: fed a real CPU run and the
estimator's real prediction for it, it must show predicted beside measured with the error of each."""

from __future__ import annotations

import contextlib
import io
import json
import sys

import pytest
import torch

from tests.helpers import ROOT

pytestmark = pytest.mark.multiproc  # the shared one-process run


def _gpu_check():
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import gpu_check
    finally:
        sys.path.remove(str(ROOT / "bench"))
    return gpu_check


def _prediction(args) -> dict:
    """The estimator's figures for single_run's configuration (tests.helpers.FAST), as gpu_check asks for its own."""
    from dist_train.estimate.cli import main as estimate_main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = estimate_main(["strategy=single", "model=tiny", "train.global_batch_size=8", "train.micro_batch_size=2",
                              "world_size=1", "format=json"])
    assert code == 0
    return json.loads(out.getvalue())["memory_per_rank"][0]


@pytest.mark.parametrize("compiled", [False, True])
def test_gpu_check_reports_predicted_beside_measured(single_run, monkeypatch, compiled):
    gpu_check = _gpu_check()
    sections: dict[str, str] = {}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(gpu_check, "train", lambda args, run_dir: single_run[1])
    monkeypatch.setattr(gpu_check, "predicted", _prediction)
    monkeypatch.setattr(gpu_check, "write_section", lambda key, title, body, command: sections.update({key: body}))
    monkeypatch.setattr(sys, "argv", ["gpu_check.py", "--skip-tests", "--compile" if compiled else "--no-compile"])
    assert gpu_check.main() == 0
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
            for line in sections["gpu"].splitlines() if line.startswith("| ") and "|---" not in line}
    assert float(rows["tokens/s"][0].replace(",", "")) > 0
    for category in ("params", "grads", "optimizer"):
        assert abs(float(rows[category][2].rstrip("%"))) < 10, (category, rows[category])
    if compiled:  # inductor decides what is saved: the eager formula is not offered
        assert rows["activations"][0] == "(compiled: not predicted)"
    else:
        assert abs(float(rows["activations"][2].rstrip("%"))) < 10, rows["activations"]
