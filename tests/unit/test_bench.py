"""The benchmarks' processes (bench/collectives.py, bench/reference.py) on a machine with GPUs, faked: each takes its
local rank's GPU and NCCL, and reads the clock on finished work; on the CPU, the same lines run for real.
bench/gpu_check.py's report and bench/peers.py's launches: tests/launched/test_bench.py."""

from __future__ import annotations

import json
import socket
import sys

import pytest
import torch

from tests.bench_support import bench_module


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
    collectives = bench_module("collectives")
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
    reference = bench_module("reference")
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
        bench_module("common").local_device()


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
    bench_module("collectives").main()
    got = json.loads(capsys.readouterr().out)
    assert set(got) == {"all_reduce", "all_gather"} and all(g["median_s"] > 0 for g in got.values())

    # --by-case: one op at two sizes in one process group, each kept (plan.calibrate's one launch)
    _one_process_group(monkeypatch)
    monkeypatch.setattr(sys, "argv", ["collectives.py", "all_reduce:4096", "all_reduce:65536", "--iterations=3",
                                      "--by-case"])
    bench_module("collectives").main()
    got = json.loads(capsys.readouterr().out)
    assert {k: g["bytes"] for k, g in got.items()} == {"all_reduce:4096": 4096, "all_reduce:65536": 65536}

    _one_process_group(monkeypatch)
    monkeypatch.setattr(sys, "argv", ["reference.py", "--strategy=fsdp", "--steps=4", "--warmup=2", "--layers=1",
                                      "--hidden=32", "--heads=2", "--seq=16"])
    bench_module("reference").main()
    assert json.loads(capsys.readouterr().out)["mean_step_s"] > 0
