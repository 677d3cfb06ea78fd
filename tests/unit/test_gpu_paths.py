"""The lines a GPU run takes, run on the CPU (issue 21): device choice, and what each strategy is handed. FSDP's
fp16 overflow on one rank, launched: tests/launched/test_gpu_paths.py."""

from __future__ import annotations

import pytest
import torch

from dist_train.config import ConfigError
from dist_train.runtime import pick_device


@pytest.fixture
def gpus(monkeypatch):
    """`gpus(n)`: this process sees n CUDA GPUs (torch.cuda's answers patched; nothing touches a device)."""
    def see(n: int) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
    return see


def test_each_local_rank_gets_its_own_gpu(gpus):
    gpus(8)
    assert [pick_device(want="auto", local_rank=r, local_world_size=8, env={}) for r in range(8)] == [
        torch.device("cuda", r) for r in range(8)]


def test_more_local_ranks_than_gpus_is_one_line_naming_both_numbers(gpus):
    gpus(1)  # `make test` or `compare.nproc=2` on a one-GPU workstation: both ranks would share cuda:0
    with pytest.raises(ConfigError) as err:
        pick_device(want="auto", local_rank=1, local_world_size=2, env={"CUDA_VISIBLE_DEVICES": "0"})
    message = str(err.value)
    assert "2 processes on this node" in message and "1 visible GPU" in message and "runtime.device=cpu" in message
    assert "\n" not in message


def test_srun_gpus_per_task_gives_each_task_its_one_visible_gpu(gpus):
    gpus(1)  # Slurm set CUDA_VISIBLE_DEVICES to this task's own GPU; LOCAL_RANK is still 0..3
    env = {"SLURM_GPUS_PER_TASK": "1"}
    assert pick_device(want="auto", local_rank=3, local_world_size=4, env=env) == torch.device("cuda", 0)


def test_runtime_device_cpu_stays_on_the_cpu_of_a_gpu_machine_and_cuda_refuses_without_one(gpus):
    gpus(4)
    assert pick_device(want="cpu", local_rank=1, local_world_size=2, env={}) == torch.device("cpu")
    gpus(0)
    assert pick_device(want="auto", local_rank=1, local_world_size=2, env={}) == torch.device("cpu")
    with pytest.raises(ConfigError, match="runtime.device=cuda but no CUDA GPU"):
        pick_device(want="cuda", local_rank=0, local_world_size=1, env={})


def test_deepspeed_is_handed_the_runtimes_device(monkeypatch):
    """DeepSpeed would take cuda:LOCAL_RANK; under srun --gpus-per-task=1 the runtime's GPU is cuda:0."""
    import deepspeed

    from dist_train.contracts import Runtime
    from dist_train.strategies._deepspeed import ZeroStrategy
    from dist_train.strategies.base import StrategyContext

    seen = {}

    def initialize(**kwargs):
        seen.update(kwargs)
        return (None, None, None, None)

    monkeypatch.setattr(deepspeed, "initialize", initialize)
    runtime = Runtime(rank=3, local_rank=3, world_size=4, local_world_size=4, device=torch.device("cuda", 0),
                      backend="nccl")
    strategy = ZeroStrategy.__new__(ZeroStrategy)
    strategy.ctx = StrategyContext(runtime=runtime, train=None, precision=None, optimizer=None)
    strategy._initialize(torch.nn.Linear(2, 2), None, None, {})
    assert seen["args"].device_rank == 0


def test_the_suites_launches_see_no_gpu():
    """`make test` on a GPU workstation: every launch but the CUDA tests' runs on the CPU (tests/conftest.py)."""
    import os

    from tests.helpers import env

    assert os.environ["CUDA_VISIBLE_DEVICES"] == ""
    assert env()["CUDA_VISIBLE_DEVICES"] == ""


def test_a_checkpoint_keeps_the_cuda_generator_of_this_ranks_device_only(monkeypatch):
    """Saved: this rank's GPU's state, not every visible GPU's; restored onto this rank's GPU whatever is visible."""
    from dist_train.checkpoint import manager

    saved_from, restored = [], []
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device: saved_from.append(device) or torch.tensor([7]))
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: pytest.fail("every GPU's state saved"))
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state, device: restored.append((int(state[0]), device)))
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", lambda states: pytest.fail("every GPU's state restored"))
    state = manager.rng_state(torch.device("cuda", 3))
    assert saved_from == [torch.device("cuda", 3)]
    manager.set_rng_state(state, torch.device("cuda", 0))  # resumed where this rank sees one GPU
    assert restored == [(7, torch.device("cuda", 0))]
    old = {**state, "cuda": [torch.tensor([1]), torch.tensor([2])]}  # an earlier checkpoint: every GPU's
    manager.set_rng_state(old, torch.device("cuda", 1))
    manager.set_rng_state(old, torch.device("cuda", 5))  # not saved: left alone
    assert restored[1:] == [(2, torch.device("cuda", 1))]
    cpu = manager.rng_state(torch.device("cpu"))
    assert "cuda" not in cpu


def test_fused_adamw_is_decided_by_the_runtimes_device_not_where_the_parameters_start():
    """zero and accelerate build the optimizer before their engine moves the parameters to the GPU: they must get
    the fused kernel as ddp and fsdp do, or a GPU comparison compares kernels too."""
    from dist_train.config import OptimizerConfig, TrainConfig
    from dist_train.optim import OptimizerFactory

    params = [torch.nn.Parameter(torch.zeros(4))]  # still on the host, as zero3 builds its optimizer
    on_gpu = OptimizerFactory(OptimizerConfig(), TrainConfig(), device=torch.device("cuda", 1))
    assert on_gpu.build(params).defaults["fused"] is True
    assert not on_gpu.build(params, on_device=False).defaults["fused"]  # DeepSpeed's optimizer offload
    on_cpu = OptimizerFactory(OptimizerConfig(), TrainConfig(), device=torch.device("cpu"))
    assert not on_cpu.build(params).defaults["fused"]


def test_a_pipeline_stage_copies_its_batch_without_blocking_the_host(monkeypatch):
    """On a GPU the first and last stages copy tokens and labels from pinned memory with non_blocking=True."""
    from dist_train.contracts import Batch
    from dist_train.strategies.pipeline import PipelineStrategy

    copies = []

    def to(self, *args, **kwargs):
        copies.append(kwargs.get("non_blocking", False))
        return self

    monkeypatch.setattr(torch.Tensor, "to", to)
    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda self, *a: True)  # what the prefetcher hands over
    batch = Batch(torch.zeros(2, 4, dtype=torch.long), torch.zeros(2, 4, dtype=torch.long))
    stage = PipelineStrategy.__new__(PipelineStrategy)
    stage.device = torch.device("cuda", 1)
    for first, last in ((True, False), (False, True), (False, False)):
        stage.is_first, stage.is_last = first, last
        args, target = stage.stage_inputs(batch)
        assert (len(args) == 1) == first and (target is not None) == last
    assert copies and all(copies)  # every copy asynchronous; the middle stage made none


def _telemetry(devices):
    from types import SimpleNamespace

    from dist_train.telemetry.recorder import Telemetry, Workload

    runtime = SimpleNamespace(rank=0, is_main=True, has_group=False, device=devices[0])
    sink = SimpleNamespace(on_step=lambda step: None)
    return Telemetry(runtime=runtime, strategy=SimpleNamespace(devices=devices), sink=sink, skips_allowed=False,
                     workload=Workload(tokens_per_step=1, samples_per_step=1, flops_per_token=1.0, peak_flops=None,
                                       num_devices=len(devices)))


def test_the_first_steps_end_is_read_after_the_gpus_finished_it_and_later_steps_add_no_sync(monkeypatch):
    from dist_train.contracts import StepOutput

    synced = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: synced.append(device))
    telemetry = _telemetry([torch.device("cuda", 2), torch.device("cuda", 3)])  # dp over two GPUs
    out = StepOutput(loss_sum=None, num_microbatches=1, grad_norm=None)
    telemetry.step_end(1, out)
    assert synced == [torch.device("cuda", 2), torch.device("cuda", 3)] and telemetry.first_step_wall is not None
    telemetry.step_end(2, out)
    telemetry.step_end(3, out)
    assert len(synced) == 2  # no sync in a step: only the first step's end and each window's end wait


def test_a_checkpoints_allocations_are_not_the_next_windows_peak(monkeypatch):
    from types import SimpleNamespace

    resets = []
    telemetry = _telemetry([torch.device("cpu")])
    telemetry._host = SimpleNamespace(reset=lambda: resets.append("host"))
    telemetry.add_checkpoint_time(0.5)
    assert resets == ["host"] and telemetry._checkpoint_s == 0.5


def test_dp_device_ids_beyond_the_visible_gpus_is_one_line(gpus):
    from dist_train.strategies.dp import DPConfig

    gpus(2)
    DPConfig(device_ids=[1, 0]).check(1)
    with pytest.raises(ConfigError, match=r"strategy.device_ids=\[2, 3\] names a GPU beyond the 2 visible"):
        DPConfig(device_ids=[2, 3]).check(1)
