"""bench/gpu_check.py's report, which otherwise runs only on a CUDA machine: fed a real CPU run and the
estimator's real prediction for it, it must show predicted beside measured with the error of each. And the
benchmarks' processes (bench/collectives.py, bench/reference.py) on a machine with GPUs, faked: each takes its
local rank's GPU and NCCL, and reads the clock on finished work; on the CPU, the same lines run for real."""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import socket
import sys

import pytest
import torch

from tests.helpers import ROOT


def _bench(name: str):  # noqa: ANN202
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(ROOT / "bench"))


def _gpu_check():
    return _bench("gpu_check")


def _prediction(args) -> dict:
    """The estimator's figures for single_run's configuration (tests.helpers.FAST), as gpu_check asks for its own."""
    from dist_train.estimate.cli import main as estimate_main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = estimate_main(["strategy=single", "model=tiny", "train.global_batch_size=8", "train.micro_batch_size=2",
                              "world_size=1", "format=json"])
    assert code == 0
    return json.loads(out.getvalue())["memory_per_rank"][0]


@pytest.mark.multiproc  # the shared one-process run
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


@pytest.fixture
def two_gpus(monkeypatch):
    """A node with 2 GPUs, this process local rank 1 of 2: torch.cuda answers so; set_device and
    init_process_group are recorded, not done."""
    calls: dict[str, list] = {"set_device": [], "init_process_group": []}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", calls["set_device"].append)
    monkeypatch.setattr(torch.distributed, "init_process_group",
                        lambda backend, **kw: calls["init_process_group"].append((backend, kw.get("device_id"))))
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    return calls


def test_collectives_runs_on_its_gpu_and_times_finished_work(two_gpus, monkeypatch, capsys):
    collectives = _bench("collectives")
    gpu = torch.device("cuda", 1)
    events: list = []
    buffers: list = []

    def ones(numel, *, device=None):  # the buffers: where they were asked for, made on the meta device
        buffers.append(torch.device(device) if device is not None else torch.device("cpu"))
        return torch.empty(numel, device="meta")

    monkeypatch.setattr(torch, "ones", ones)
    monkeypatch.setattr(collectives, "synchronize", lambda device: events.append(("synchronize", device)), raising=False)
    for name in ("barrier", "all_reduce"):
        monkeypatch.setattr(torch.distributed, name, lambda *a, name=name, **kw: events.append(name))
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda *a: 2)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda *a: 0)
    monkeypatch.setattr(torch.distributed, "destroy_process_group", lambda *a: None)
    monkeypatch.setattr(sys, "argv", ["collectives.py", "all_reduce:4096", "--iterations=3"])
    collectives.main()
    assert two_gpus == {"set_device": [gpu], "init_process_group": [("nccl", gpu)]}
    assert buffers and set(buffers) == {gpu}
    # 5 warm-up calls, then each timed call after a barrier, the device synchronised before either clock read
    sync = ("synchronize", gpu)
    assert events == ["all_reduce"] * 5 + ["barrier", sync, "all_reduce", sync] * 3
    assert json.loads(capsys.readouterr().out)["all_reduce"]["bytes"] == 4096


def test_reference_runs_on_its_gpu_and_reads_the_clock_on_finished_steps(two_gpus, monkeypatch, capsys):
    reference = _bench("reference")
    gpu = torch.device("cuda", 1)
    events: list = []

    class Loop:  # ReferenceLoop's place: the device it is given, and its steps
        def __init__(self, strategy, shape, *, device=None):
            events.append(("loop", device))

        def step(self):
            events.append("step")

    monkeypatch.setattr(reference, "ReferenceLoop", Loop)
    monkeypatch.setattr(reference, "synchronize", lambda device: events.append(("synchronize", device)), raising=False)
    monkeypatch.setattr(torch.distributed, "barrier", lambda *a: None)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda *a: 0)
    monkeypatch.setattr(torch.distributed, "destroy_process_group", lambda *a: None)
    monkeypatch.setattr(sys, "argv", ["reference.py", "--steps=6", "--warmup=3"])
    reference.main()
    assert two_gpus == {"set_device": [gpu], "init_process_group": [("nccl", gpu)]}
    # synchronised only where the clock is read: after step 1 (time to first step), the last warm-up step, the last
    sync = ("synchronize", gpu)
    assert events == [("loop", gpu), "step", sync, "step", "step", sync, "step", "step", "step", sync]
    assert json.loads(capsys.readouterr().out)["mean_step_s"] >= 0


def test_more_processes_than_gpus_is_an_error_not_a_shared_gpu(two_gpus, monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    with pytest.raises(RuntimeError, match="one GPU per process"):
        _bench("common").local_device()


def _one_process_group(monkeypatch) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for key, value in dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                           MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)).items():
        monkeypatch.setenv(key, value)


def test_collectives_and_reference_on_the_cpu(monkeypatch, capsys):
    """The same lines on the CPU, for real: gloo, CPU buffers and batches, synchronisation a no-op."""
    _one_process_group(monkeypatch)
    monkeypatch.setattr(sys, "argv", ["collectives.py", "all_reduce:4096", "all_gather:4096", "--iterations=3"])
    _bench("collectives").main()
    got = json.loads(capsys.readouterr().out)
    assert set(got) == {"all_reduce", "all_gather"} and all(g["median_s"] > 0 for g in got.values())

    _one_process_group(monkeypatch)
    monkeypatch.setattr(sys, "argv", ["reference.py", "--strategy=fsdp", "--steps=4", "--warmup=2", "--layers=1",
                                      "--hidden=32", "--heads=2", "--seq=16"])
    _bench("reference").main()
    assert json.loads(capsys.readouterr().out)["mean_step_s"] > 0


@pytest.mark.multiproc
@pytest.mark.beside  # a minute of launches that balances the two sessions (tests/suite.sh)
def test_peers_train_the_same_samples_as_dist_train(tmp_path):
    """bench/peers.py: Accelerate's loop and transformers' Trainer, each under torchrun with DDP on 2 processes,
    give dist_train's losses step by step (fp32, 1e-5), so the step-time ratios compare the same work. (Fabric is
    the optional `bench` extra's; its rows run where it is installed.)"""
    peers = _bench("peers")
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
    refused = peers.launch("accelerate", "fsdp", nproc=2, steps=5, out=tmp_path)
    assert "prepares MULTI_CPU (DDP) on a CPU" in refused["error"]
    # the paired comparison: dist_train's step and Accelerate's, alternating in the same two processes
    pair = peers.paired("accelerate", "ddp", nproc=2, iterations=4)
    assert "error" not in pair, pair
    assert pair["iterations"] == 4 and 0 < pair["q1"] <= pair["median_ratio"] <= pair["q3"], pair
