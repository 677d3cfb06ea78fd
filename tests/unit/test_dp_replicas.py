"""strategy=dp (nn.DataParallel) on a machine with GPUs, faked where it must be: the replicas' compute dtype,
the micro-batch that leaves GPUs idle, and the GPU the batch and the loss go to. On the CPU the same lines run."""

from __future__ import annotations

import logging
import threading
from typing import Any

import pytest
import torch
from torch import nn

from dist_train.config import OptimizerConfig, PrecisionConfig, TrainConfig
from dist_train.contracts import Runtime, StepOutput
from dist_train.optim import OptimizerFactory
from dist_train.strategies import dp, torch_strategy
from dist_train.strategies.base import StrategyContext, autocast


def _ctx(device: torch.device, *, precision: str = "fp32", micro_batch_size: int = 2) -> StrategyContext:
    t = TrainConfig(micro_batch_size=micro_batch_size)
    return StrategyContext(runtime=Runtime(0, 0, 1, 1, device, None), train=t, precision=PrecisionConfig(precision),
                           optimizer=OptimizerFactory(OptimizerConfig(name="sgd"), t))


@pytest.fixture
def gpus(monkeypatch):
    """`gpus(n)`: torch.cuda answers that n GPUs are visible; nn.DataParallel and moves to a GPU are recorded,
    not done."""
    seen: dict[str, Any] = {}

    class DataParallel(nn.Module):
        def __init__(self, module, device_ids=None, output_device=None):
            super().__init__()
            self.module = module
            seen["device_ids"], seen["output_device"] = device_ids, output_device

    def see(n: int) -> dict[str, Any]:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
        monkeypatch.setattr(nn, "DataParallel", DataParallel)
        return seen
    return see


class Model(nn.Module):
    """One matmul; records the dtype it computed in, and where it was moved (staying on the CPU)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.computed_in: torch.dtype | None = None
        self.moved_to: torch.device | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.proj(x)
        self.computed_in = y.dtype
        return y

    def to(self, device: Any) -> Model:  # type: ignore[override]
        self.moved_to = torch.device(device)
        return self


def _on_replica_thread(replica: nn.Module, x: torch.Tensor, *, device_type: str,
                       thread_default: torch.dtype | None) -> None:
    """What torch's parallel_apply does for each replica when there are several: on a thread of its own, autocast
    entered with the caller's `enabled` flag and no dtype, so the thread's own autocast dtype applies.
    `thread_default`: that dtype (CUDA's is fp16); None keeps the device's default (bf16 on the CPU)."""
    enabled = torch.is_autocast_enabled(device_type)  # read on the caller's thread, as parallel_apply does
    failure: list[BaseException] = []

    def worker() -> None:
        try:
            if thread_default is not None:
                torch.set_autocast_dtype(device_type, thread_default)  # this thread's only: autocast state is per thread
            with torch.amp.autocast(device_type, enabled=enabled):
                replica(x)
        except BaseException as e:  # noqa: BLE001 - re-raised on the test's thread
            failure.append(e)

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    if failure:
        raise failure[0]


@pytest.mark.parametrize(("precision", "thread_default"), [
    ("bf16", torch.float16),  # the issue: a bf16 run, on a replica thread whose default is CUDA's fp16
    ("fp16", None),  # the same loss of the dtype, for real on the CPU: an fp16 run, the thread's default bf16
])
def test_each_replica_computes_in_the_runs_dtype_whatever_its_thread_defaults_to(precision, thread_default):
    cpu = torch.device("cpu")
    ctx = _ctx(cpu, precision=precision)
    strategy = dp.build(dp.DPConfig(), ctx)
    model = Model()
    strategy.setup(model)
    replica = strategy.wrapped.module  # what DataParallel copies onto each GPU
    with autocast(ctx.precision, cpu):  # as the training step enters it around the forward
        _on_replica_thread(replica, torch.randn(2, 8), device_type="cpu", thread_default=thread_default)
    assert model.computed_in == ctx.precision.dtype


def test_fp32_replicas_are_the_model_itself():
    strategy = dp.build(dp.DPConfig(), _ctx(torch.device("cpu")))
    model = Model()
    strategy.setup(model)
    assert strategy.wrapped.module is model


def test_a_micro_batch_smaller_than_the_gpus_is_one_warning_naming_both_and_the_fix(gpus, caplog):
    gpus(8)
    strategy = dp.build(dp.DPConfig(), _ctx(torch.device("cuda", 0), micro_batch_size=2))
    with caplog.at_level(logging.WARNING, logger=dp.__name__):
        strategy.setup(Model())
    [record] = [r for r in caplog.records if r.name == dp.__name__]
    message = record.getMessage()
    assert "train.micro_batch_size=2" in message and "8 GPUs" in message
    assert "train.micro_batch_size >= 8" in message


def test_a_micro_batch_that_fills_every_gpu_warns_of_nothing(gpus, caplog):
    gpus(2)
    strategy = dp.build(dp.DPConfig(), _ctx(torch.device("cuda", 0), micro_batch_size=2))
    with caplog.at_level(logging.WARNING, logger=dp.__name__):
        strategy.setup(Model())
    assert not [r for r in caplog.records if r.name == dp.__name__]


class Batch:
    """Records the device the step moves it to."""

    def __init__(self) -> None:
        self.moved_to: torch.device | None = None

    def to(self, device: torch.device) -> Batch:
        self.moved_to = device
        return self


def test_device_ids_not_from_zero_put_the_batch_and_loss_where_the_logits_are_gathered(gpus, monkeypatch):
    """strategy.device_ids=[2,3]: DataParallel gathers the logits on cuda:2 (its output device), while the
    runtime's device is cuda:0 (local rank 0). The labels and the loss buffers must be on cuda:2 too."""
    seen = gpus(4)
    gathered_on = torch.device("cuda", 2)
    strategy = dp.build(dp.DPConfig(device_ids=[2, 3]), _ctx(torch.device("cuda", 0), micro_batch_size=2))
    model = Model()
    strategy.setup(model)
    assert model.moved_to == gathered_on and seen["device_ids"] == [2, 3]
    assert seen["output_device"] in (None, 2)  # None: DataParallel's default, device_ids[0]
    assert strategy.devices == [torch.device("cuda", 2), torch.device("cuda", 3)]  # what telemetry reads

    accumulated: dict[str, Any] = {}

    def accumulate(model, batch, *, device, **kwargs):  # noqa: ANN001, ANN202
        accumulated.update(batch=batch, device=device)
        return torch.zeros(()), 1

    monkeypatch.setattr(torch_strategy, "accumulate", accumulate)
    monkeypatch.setattr(strategy.opt, "step", lambda: torch.zeros(()))
    batch = Batch()
    assert isinstance(strategy.train_step(batch), StepOutput)
    assert batch.moved_to == gathered_on
    assert accumulated["device"] == gathered_on  # the loss buffers, and autocast's device type


def test_on_the_cpu_the_strategy_keeps_the_runtimes_device():
    cpu = torch.device("cpu")
    strategy = dp.build(dp.DPConfig(device_ids=[2, 3]), _ctx(cpu))
    assert strategy.devices == [cpu]
    assert strategy.ctx.runtime.device == cpu
