"""bench/gpu_check.py's report, which otherwise runs only on a CUDA machine: fed a real CPU run (the session's
one-process run) and the estimator's real prediction for it, it must show predicted beside measured with the error
of each. And bench/peers.py: Accelerate's loop and transformers' Trainer under torchrun train the same samples as
dist_train. The benchmarks' processes on faked GPUs: tests/unit/test_bench.py."""

from __future__ import annotations

import contextlib
import io
import json
import sys

import pytest
import torch

from tests.bench_support import bench_module


def _gpu_check():
    return bench_module("gpu_check")


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


def test_peers_train_the_same_samples_as_dist_train(tmp_path):
    """bench/peers.py: Accelerate's loop and transformers' Trainer, each under torchrun with DDP on 2 processes,
    give dist_train's losses step by step (fp32, 1e-5), so the step-time ratios compare the same work. (Fabric is
    the optional `bench` extra's; its rows run where it is installed.)"""
    peers = bench_module("peers")
    ours = peers.launch("dist_train", "ddp", nproc=2, steps=5, out=tmp_path)
    assert "error" not in ours, ours
    for peer in ("accelerate", "trainer"):
        got = peers.launch(peer, "ddp", nproc=2, steps=5, out=tmp_path)
        assert "error" not in got, (peer, got)
        assert len(got["losses"]) == len(ours["losses"]) == 5
        for a, b in zip(got["losses"], ours["losses"]):
            assert a == pytest.approx(b, rel=1e-5), (peer, got["losses"], ours["losses"])
        assert got["mean_step_s"] > 0 and got["time_to_first_step_s"] > 0
        # VmHWM since exec, the worst rank's: at least the model and torch's import (over 100 MiB)
        assert got["peak_rss_bytes"] > 100 * 2**20, got
    assert ours["peak_rss_bytes"] >= ours["memory"]["memory/peak_rss_bytes"] > 100 * 2**20, ours
    # the paired comparison: dist_train's step and Accelerate's, alternating in the same two processes
    pair = peers.paired("accelerate", "ddp", nproc=2, iterations=4)
    assert "error" not in pair, pair
    assert pair["iterations"] == 4 and 0 < pair["q1"] <= pair["median_ratio"] <= pair["q3"], pair
