"""FSDP2: `fully_shard` on each transformer block, then on the root.

Parameters, gradients and optimizer state are sharded across ranks (DTensors). In forward each block's
parameters are all-gathered; `reshard_after_forward` frees them again (ZeRO-3-like) or keeps them until
backward (ZeRO-2-like); the root's are always kept from forward to backward. Gradients are reduce-scattered
once per step: sync is off for all but the last micro-batch.
"""

from __future__ import annotations

import contextlib

from dataclasses import dataclass
from typing import Any, ClassVar, ContextManager

import torch
from torch import nn

from dist_train.config import StrategyConfig
from dist_train.contracts import StrategyFamily
from dist_train.strategies.base import StrategyContext
from dist_train.strategies.torch_strategy import TorchStrategy


@dataclass
class FSDPConfig(StrategyConfig):
    """FSDP2 (`fully_shard`) per transformer block, then the root."""

    name: str = "fsdp"
    # True: free gathered parameters after forward and gather again in backward (ZeRO-3-like).
    # False: keep them from forward to backward (ZeRO-2-like: more memory, one all-gather fewer).
    reshard_after_forward: bool = True
    # With gradient accumulation (several micro-batches a step): False keeps every parameter's unsharded fp32
    # gradient from the first micro-batch's backward to the last one's reduce-scatter (4 B/param on every rank,
    # whatever the world size; one reduce-scatter a step). True reduce-scatters after every micro-batch into the
    # sharded gradients, as torchtitan does: it sends the gradients once per micro-batch and holds 4 B/param / N.
    reduce_every_microbatch: bool = False

    compiles_blocks: ClassVar[bool] = True  # compiled before fully_shard, as torchtitan does
    loads_own_shard: ClassVar[bool] = True  # fully_shard on meta, then each rank loads its rows

    @property
    def optimizer_sees_whole_tensors(self) -> bool:
        return False  # FSDP2 shards (DTensors)


class FSDPWrapper:
    # torch.distributed.fsdp (in _fsdp.py) is imported when a model is wrapped: importing it (with DTensor and
    # dynamo) at module level would cost every run start-up time, since the registry imports this module.
    def __init__(self, cfg: FSDPConfig, ctx: StrategyContext) -> None:
        self.cfg, self.ctx = cfg, ctx

    def wrap(self, model: nn.Module) -> nn.Module:
        from torch.distributed.device_mesh import init_device_mesh

        from dist_train.strategies._fsdp import shard

        rt = self.ctx.runtime
        mesh = init_device_mesh(rt.device.type, (rt.world_size,))
        return shard(model, mesh, reshard_after_forward=self.cfg.reshard_after_forward, precision=self.ctx.precision)

    def no_sync(self, wrapped: nn.Module) -> ContextManager[Any]:
        if self.cfg.reduce_every_microbatch:
            return contextlib.nullcontext()  # every micro-batch's backward reduce-scatters into the shards
        from dist_train.strategies._fsdp import no_sync

        return no_sync(wrapped)

    def devices(self) -> list[torch.device]:
        return [self.ctx.runtime.device]


def build(cfg: FSDPConfig, ctx: StrategyContext) -> TorchStrategy:
    return TorchStrategy(cfg.name, ctx, FSDPWrapper(cfg, ctx))


FAMILY = StrategyFamily(family="fsdp", schema=FSDPConfig, names={"fsdp": {}}, build=build)
