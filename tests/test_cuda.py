"""What only a GPU can show (run by bench/gpu_check.py on a CUDA machine; skipped without one)."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import FAST, last_step, train_ok

pytestmark = [
    pytest.mark.multiproc,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (bench/gpu_check.py runs these)"),
]

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0


def test_nccl_collectives_are_timed_and_allocator_peaks_reported(tmp_path):
    summary = train_ok(["strategy=ddp", "logger=none", *FAST], run_dir=tmp_path, nproc=GPUS)
    assert summary["backend"] == "nccl" and summary["device"].startswith("cuda")
    for rec in last_step(tmp_path):
        if GPUS > 1:
            assert rec["comm/all_reduce/time_s"] > 0  # CUDA events recorded around the bucket all-reduce
        assert 0 < rec["memory/peak_allocated_bytes"] <= rec["memory/peak_reserved_bytes"]


@pytest.mark.skipif(GPUS < 2, reason="nn.DataParallel needs at least two GPUs to parallelise anything")
def test_dp_reports_every_gpu(tmp_path):
    train_ok(["strategy=dp", "logger=none", *FAST], run_dir=tmp_path)
    rec = last_step(tmp_path)[0]
    assert all(rec[f"memory/gpu{i}/peak_allocated_bytes"] > 0 for i in range(GPUS))


@pytest.mark.parametrize("strategy", ["zero2_offload", "zero3_offload"])
def test_offload_configs_run(strategy, single_run, tmp_path):
    summary = train_ok([f"strategy={strategy}", "logger=none", *FAST], run_dir=tmp_path, nproc=1)
    assert summary["losses"] == pytest.approx(single_run[1]["losses"], rel=1e-3)  # GPU vs CPU arithmetic


def test_adamw_takes_the_fused_kernel_on_cuda_and_the_default_on_cpu():
    from dist_train.config import OptimizerConfig, TrainConfig
    from dist_train.optim import OptimizerFactory

    factory = OptimizerFactory(OptimizerConfig(), TrainConfig())
    assert factory.build([torch.nn.Parameter(torch.zeros(4, device="cuda"))]).defaults["fused"] is True
    assert not factory.build([torch.nn.Parameter(torch.zeros(4))]).defaults["fused"]
