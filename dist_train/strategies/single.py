"""One process, one device: the baseline every other strategy must agree with."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, ClassVar, ContextManager

import torch
from torch import nn

from dist_train.config import StrategyConfig, require
from dist_train.parallel_dims import ParallelDims, layout_dims
from dist_train.contracts import StrategyFamily
from dist_train.strategies.base import StrategyContext
from dist_train.strategies.torch_strategy import TorchStrategy


@dataclass
class SingleConfig(StrategyConfig):
    name: str = "single"

    compiles_blocks: ClassVar[bool] = True
    keeps_packed_weights: ClassVar[bool] = True

    @property
    def needs_process_group(self) -> bool:
        return False

    def parallel_dims(self, world_size: int) -> ParallelDims:
        return layout_dims("one", world_size)  # one process (check() refuses more)

    @property
    def updates_in_backward(self) -> bool:
        return True

    def check(self, world_size: int) -> None:
        require(
            world_size == 1,
            f"strategy=single runs one process but WORLD_SIZE={world_size}; "
            "run it with plain `python launch/train.py` or pick strategy=ddp|fsdp|...",
        )


class SingleWrapper:
    def __init__(self, device: torch.device) -> None:
        self.device = device

    def wrap(self, model: nn.Module) -> nn.Module:
        return model.to(self.device)

    def no_sync(self, wrapped: nn.Module) -> ContextManager[Any]:
        return contextlib.nullcontext()  # nothing to sync

    def devices(self) -> list[torch.device]:
        return [self.device]


def build(cfg: SingleConfig, ctx: StrategyContext) -> TorchStrategy:
    return TorchStrategy(cfg.name, ctx, SingleWrapper(ctx.runtime.device))


FAMILY = StrategyFamily(family="single", schema=SingleConfig, names={"single": {}}, build=build)
