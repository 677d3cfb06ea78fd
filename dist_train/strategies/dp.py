"""nn.DataParallel: one process scatters each micro-batch over every local GPU and gathers on the first.

Parameters, gradients and optimizer state live on the first ("master") GPU; replicas and the gathered
outputs make it the fullest, which is why every GPU's memory is reported. On the CPU DataParallel is a
pass-through: it runs, and parallelises nothing.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import Any, ContextManager, Optional

import torch
from torch import nn

from dist_train.config import StrategyConfig, require
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

    def data_parallel_size(self, world_size: int) -> int:
        return 1  # one process; DataParallel scatters each micro-batch over GPUs itself

    def check(self, world_size: int) -> None:
        require(
            world_size == 1,
            f"strategy=dp is single-process nn.DataParallel but WORLD_SIZE={world_size}; "
            "launch it with `python launch/train.py strategy=dp` (no torchrun) or use strategy=ddp",
        )


class DataParallelWrapper:
    def __init__(self, cfg: DPConfig, device: torch.device) -> None:
        if device.type == "cuda":
            self.device_ids = list(cfg.device_ids) if cfg.device_ids is not None else list(range(torch.cuda.device_count()))
        else:
            self.device_ids = []
        self.device = torch.device("cuda", self.device_ids[0]) if self.device_ids else device

    def wrap(self, model: nn.Module) -> nn.Module:
        if len(self.device_ids) < 2:
            log.warning(
                "strategy=dp with %s: nn.DataParallel runs but parallelises nothing (it needs at least 2 GPUs)",
                f"{len(self.device_ids)} GPU" if self.device_ids else "no GPU",
            )
        return nn.DataParallel(model.to(self.device), device_ids=self.device_ids or None)

    def no_sync(self, wrapped: nn.Module) -> ContextManager[Any]:
        return contextlib.nullcontext()  # replicas' gradients are summed on the master GPU in backward

    def devices(self) -> list[torch.device]:
        return [torch.device("cuda", i) for i in self.device_ids] or [self.device]


def build(cfg: DPConfig, ctx: StrategyContext) -> TorchStrategy:
    return TorchStrategy(cfg.name, ctx, DataParallelWrapper(cfg, ctx.runtime.device))


FAMILY = StrategyFamily(family="dp", schema=DPConfig, names={"dp": {}}, build=build)
