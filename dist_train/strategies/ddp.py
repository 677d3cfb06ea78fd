"""DistributedDataParallel: a full replica per rank and one bucketed gradient all-reduce per step."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, ContextManager

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from dist_train.config import StrategyConfig, require
from dist_train.contracts import StrategyFamily
from dist_train.strategies.base import StrategyContext, onto, wrap_ddp
from dist_train.strategies.torch_strategy import TorchStrategy


@dataclass
class DDPConfig(StrategyConfig):
    name: str = "ddp"
    bucket_cap_mb: float = 25.0
    # Gradients live inside DDP's all-reduce buckets instead of beside them: one copy, not two.
    gradient_as_bucket_view: bool = True

    compiles_blocks: ClassVar[bool] = True
    keeps_packed_weights: ClassVar[bool] = True  # replicas: every rank holds every parameter whole

    def check(self, world_size: int) -> None:
        require(self.bucket_cap_mb > 0, f"strategy.bucket_cap_mb={self.bucket_cap_mb} must be > 0")


class DDPWrapper:
    def __init__(self, cfg: DDPConfig, ctx: StrategyContext) -> None:
        self.cfg, self.ctx = cfg, ctx

    def wrap(self, model: nn.Module) -> nn.Module:
        return wrap_ddp(onto(model, self.ctx.runtime.device), self.ctx, bucket_cap_mb=self.cfg.bucket_cap_mb,
                        gradient_as_bucket_view=self.cfg.gradient_as_bucket_view)

    def no_sync(self, wrapped: nn.Module) -> ContextManager[Any]:
        assert isinstance(wrapped, DistributedDataParallel)
        return wrapped.no_sync()

    def devices(self) -> list[torch.device]:
        return [self.ctx.runtime.device]


def build(cfg: DDPConfig, ctx: StrategyContext) -> TorchStrategy:
    return TorchStrategy(cfg.name, ctx, DDPWrapper(cfg, ctx))


FAMILY = StrategyFamily(family="ddp", schema=DDPConfig, names={"ddp": {}}, build=build)
