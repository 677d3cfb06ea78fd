"""FSDP2: `fully_shard` on each transformer block, then on the root.

Parameters, gradients and optimizer state are sharded across ranks (DTensors). In forward each block's
parameters are all-gathered; `reshard_after_forward` frees them again (ZeRO-3-like) or keeps them until
backward (ZeRO-2-like); the root's are always kept from forward to backward. Gradients are reduce-scattered
once per step: sync is off for all but the last micro-batch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from dist_train.config import PrecisionConfig, StrategyConfig
from dist_train.contracts import StrategyFamily
from dist_train.model import transformer_blocks
from dist_train.strategies.base import StrategyContext
from dist_train.strategies.torch_strategy import TorchStrategy


@dataclass
class FSDPConfig(StrategyConfig):
    """FSDP2 (`fully_shard`) per transformer block, then the root."""

    name: str = "fsdp"
    # True: free gathered parameters after forward and gather again in backward (ZeRO-3-like).
    # False: keep them from forward to backward (ZeRO-2-like: more memory, one all-gather fewer).
    reshard_after_forward: bool = True


# torch.distributed.fsdp is imported where it is used: importing it (with DTensor and dynamo) costs every run
# about 0.8 s of start-up, and the registry imports this module for its schema whatever the strategy.
def mixed_precision(precision: PrecisionConfig) -> Any:
    """Compute in the chosen dtype; keep fp32 shards and reduce gradients in fp32."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=precision.dtype if precision.mixed else None, reduce_dtype=torch.float32)


class FSDPWrapper:
    def __init__(self, cfg: FSDPConfig, ctx: StrategyContext) -> None:
        self.cfg, self.ctx = cfg, ctx

    def wrap(self, model: nn.Module) -> nn.Module:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        rt = self.ctx.runtime
        mesh = init_device_mesh(rt.device.type, (rt.world_size,))
        kwargs = dict(
            mesh=mesh,
            reshard_after_forward=self.cfg.reshard_after_forward,
            mp_policy=mixed_precision(self.ctx.precision),
        )
        # Blocks first, then the root (embeddings, final norm, head): each block is one all-gather unit.
        for block in transformer_blocks(model):
            fully_shard(block, **kwargs)
        # The root's parameters are needed again as soon as backward starts, so FSDP2's default (None) keeps them
        # gathered after forward; passing True would gather them twice per micro-batch for nothing (measured:
        # 2 extra all-gathers per step on the tiny model). With reshard_after_forward=false nothing reshards.
        fully_shard(model, **{**kwargs, "reshard_after_forward": None if self.cfg.reshard_after_forward else False})
        return model

    @contextlib.contextmanager
    def no_sync(self, wrapped: nn.Module) -> Iterator[None]:
        from torch.distributed.fsdp import FSDPModule

        assert isinstance(wrapped, FSDPModule)
        wrapped.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            wrapped.set_requires_gradient_sync(True)

    def devices(self) -> list[torch.device]:
        return [self.ctx.runtime.device]


def build(cfg: FSDPConfig, ctx: StrategyContext) -> TorchStrategy:
    return TorchStrategy(cfg.name, ctx, FSDPWrapper(cfg, ctx))


FAMILY = StrategyFamily(family="fsdp", schema=FSDPConfig, names={"fsdp": {}}, build=build)
