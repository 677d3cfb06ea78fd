"""What only a GPU can show (run by bench/gpu_check.py on a CUDA machine; skipped without one)."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import GPUS_SEEN
from tests.helpers import FAST, last_step, train_ok

pytestmark = pytest.mark.skipif(not GPUS_SEEN, reason="needs a CUDA GPU (bench/gpu_check.py runs these)")

GPUS = GPUS_SEEN  # counted before the suite hid the GPUs from its other launches
# No batch keys: the global batch follows the GPU count (micro-batch x processes), so these run on 1 to 8 GPUs.
SHORT = ["model=tiny", "train.steps=5", "train.log_every=1", "logger=none"]


def ddp_overrides(gpus: int) -> list[str]:
    return ["strategy=ddp", *SHORT]


def dp_overrides(gpus: int) -> list[str]:
    return ["strategy=dp", *SHORT, f"train.micro_batch_size={gpus}"]  # one sample per GPU: every replica works


def offload_overrides(strategy: str) -> list[str]:
    return [f"strategy={strategy}", *FAST]  # one process, single_run's batch: the same samples


# What tests/unit/test_config.py validates at 1 to 8 GPUs on a CPU (the overrides, and the process count they run with).
RUNS = {"ddp": (ddp_overrides, "gpus"), "dp": (dp_overrides, 1),
        "zero2_offload": (lambda gpus: offload_overrides("zero2_offload"), 1),
        "zero3_offload": (lambda gpus: offload_overrides("zero3_offload"), 1)}


def test_nccl_collectives_are_timed_and_allocator_peaks_reported(tmp_path):
    summary = train_ok(ddp_overrides(GPUS), run_dir=tmp_path, nproc=GPUS, cuda=True)
    assert summary["backend"] == "nccl" and summary["device"].startswith("cuda")
    for rec in last_step(tmp_path):
        if GPUS > 1:
            assert rec["comm/all_reduce/time_s"] > 0  # CUDA events recorded around the bucket all-reduce
        assert 0 < rec["memory/peak_allocated_bytes"] <= rec["memory/peak_reserved_bytes"]


@pytest.mark.skipif(GPUS < 2, reason="nn.DataParallel needs at least two GPUs to parallelise anything")
def test_dp_reports_every_gpu(tmp_path):
    train_ok(dp_overrides(GPUS), run_dir=tmp_path, cuda=True)
    rec = last_step(tmp_path)[0]
    assert all(rec[f"memory/gpu{i}/peak_allocated_bytes"] > 0 for i in range(GPUS))


@pytest.mark.parametrize("strategy", ["zero2_offload", "zero3_offload"])
def test_offload_configs_run(strategy, single_run, tmp_path):
    summary = train_ok(offload_overrides(strategy), run_dir=tmp_path, nproc=1, cuda=True)
    assert summary["losses"] == pytest.approx(single_run[1]["losses"], rel=1e-3)  # GPU vs CPU arithmetic


def test_adamw_takes_the_fused_kernel_on_cuda_and_the_default_on_cpu():
    from dist_train.config import OptimizerConfig, TrainConfig
    from dist_train.optim import OptimizerFactory

    factory = OptimizerFactory(OptimizerConfig(), TrainConfig())
    assert factory.build([torch.nn.Parameter(torch.zeros(4, device="cuda"))]).defaults["fused"] is True
    assert not factory.build([torch.nn.Parameter(torch.zeros(4))]).defaults["fused"]


@pytest.mark.parametrize("precision,rel", [("fp32", 1e-4), ("bf16", 2e-2)])
def test_moe_grouped_mm_trains_like_eager_experts(precision, rel, tmp_path):
    """model=tiny_moe on one GPU: transformers' grouped_mm experts (one grouped product per projection, what it would
    choose on CUDA) train with the losses of the eager per-expert loop, in fp32 and under bf16 autocast."""
    losses = {}
    for impl in ("eager", "grouped_mm"):
        run_dir = tmp_path / impl
        summary = train_ok(["strategy=single", "model=tiny_moe", f"model.experts_implementation={impl}",
                            f"precision={precision}", *SHORT[1:]], run_dir=run_dir, nproc=1, cuda=True)
        losses[impl] = summary["losses"]
    assert losses["grouped_mm"] == pytest.approx(losses["eager"], rel=rel)
