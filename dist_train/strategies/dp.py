"""nn.DataParallel: one process scatters each micro-batch over every local GPU and gathers on the first.

Parameters, gradients and optimizer state live on the first ("master") GPU; replicas and the gathered
outputs make it the fullest, which is why every GPU's memory is reported. On the CPU DataParallel is a
pass-through: it runs, and parallelises nothing.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from dataclasses import dataclass
from typing import Any, ContextManager, Optional

import torch
from torch import nn

from dist_train.config import StrategyConfig, require
from dist_train.parallel_dims import ParallelDims, layout_dims
from dist_train.contracts import StrategyFamily
from dist_train.strategies.base import StrategyContext
from dist_train.strategies.torch_strategy import TorchStrategy

log = logging.getLogger(__name__)


@dataclass
class DPConfig(StrategyConfig):
    """``nn.DataParallel``: one process drives every local GPU."""

    name: str = "dp"
    # None = all visible GPUs.
    device_ids: Optional[list[int]] = None

    @property
    def needs_process_group(self) -> bool:
        return False

    def parallel_dims(self, world_size: int) -> ParallelDims:
        return layout_dims("one", world_size)  # one process; nn.DataParallel scatters each micro-batch over GPUs itself

    def check(self, world_size: int) -> None:
        require(
            world_size == 1,
            f"strategy=dp is single-process nn.DataParallel but WORLD_SIZE={world_size}; "
            "launch it with `python launch/train.py strategy=dp` (no torchrun) or use strategy=ddp",
        )
        if self.device_ids is not None:
            ids = list(self.device_ids)
            require(
                bool(ids) and all(i >= 0 for i in ids) and len(set(ids)) == len(ids),
                f"strategy.device_ids={ids} must be distinct GPU indices >= 0 (or null: every visible GPU)",
            )
            import torch

            if torch.cuda.is_available():
                count = torch.cuda.device_count()
                require(max(ids) < count, f"strategy.device_ids={ids} names a GPU beyond the {count} visible ones "
                                          f"(indices 0..{count - 1})")


class AutocastReplica(nn.Module):
    """What DataParallel replicates: the model, its forward under autocast at the run's compute dtype.

    parallel_apply re-enters autocast on each replica's thread with the caller's `enabled` flag but not its
    dtype (torch/nn/parallel/parallel_apply.py), and autocast's dtype is per thread: a replica's thread gets
    the device's default, fp16 on CUDA, so a bf16 run computed its replicas in fp16. Entered here, inside the
    replica, the dtype is the run's whatever the thread was handed.
    """

    def __init__(self, model: nn.Module, *, device_type: str, dtype: torch.dtype) -> None:
        super().__init__()
        self.model, self.device_type, self.dtype = model, device_type, dtype

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with torch.autocast(device_type=self.device_type, dtype=self.dtype):
            return self.model(*args, **kwargs)


class DataParallelWrapper:
    def __init__(self, cfg: DPConfig, ctx: StrategyContext) -> None:
        device = ctx.runtime.device
        if device.type == "cuda":
            self.device_ids = list(cfg.device_ids) if cfg.device_ids is not None else list(range(torch.cuda.device_count()))
        else:
            self.device_ids = []
        # DataParallel's output device: the parameters live here, the logits are gathered here.
        self.device = torch.device("cuda", self.device_ids[0]) if self.device_ids else device
        self.precision, self.micro_batch_size = ctx.precision, ctx.train.micro_batch_size

    def wrap(self, model: nn.Module) -> nn.Module:
        num_gpus = len(self.device_ids)
        if num_gpus < 2:
            log.warning(
                "strategy=dp with %s: nn.DataParallel runs but parallelises nothing (it needs at least 2 GPUs)",
                f"{num_gpus} GPU" if self.device_ids else "no GPU",
            )
        elif self.micro_batch_size < num_gpus:
            # DataParallel scatters each micro-batch by sample: the other GPUs idle, while MFU counts them all.
            log.warning(
                "strategy=dp: train.micro_batch_size=%d keeps only %d of the %d GPUs busy (DataParallel splits "
                "each micro-batch by sample) while MFU counts all %d; set train.micro_batch_size >= %d",
                self.micro_batch_size, self.micro_batch_size, num_gpus, num_gpus, num_gpus,
            )
        model = model.to(self.device)
        if self.precision.mixed:
            model = AutocastReplica(model, device_type=self.device.type, dtype=self.precision.dtype)
        return nn.DataParallel(model, device_ids=self.device_ids or None)

    def no_sync(self, wrapped: nn.Module) -> ContextManager[Any]:
        return contextlib.nullcontext()  # replicas' gradients are summed on the master GPU in backward

    def devices(self) -> list[torch.device]:
        return [torch.device("cuda", i) for i in self.device_ids] or [self.device]


def build(cfg: DPConfig, ctx: StrategyContext) -> TorchStrategy:
    wrapper = DataParallelWrapper(cfg, ctx)
    # The batch and the loss go where DataParallel gathers the logits (device_ids[0]), not to the runtime's
    # cuda:LOCAL_RANK: with strategy.device_ids=[2,3] that is cuda:0, a GPU DataParallel does not use.
    runtime = dataclasses.replace(ctx.runtime, device=wrapper.device)
    return TorchStrategy(cfg.name, dataclasses.replace(ctx, runtime=runtime), wrapper)


FAMILY = StrategyFamily(family="dp", schema=DPConfig, names={"dp": {}}, build=build)
