"""One process, one device: the baseline every other strategy must agree with."""

from __future__ import annotations

import contextlib
from typing import Any, ContextManager

import torch
from torch import nn

from dist_train.config import SingleConfig
from dist_train.strategies.base import StrategyContext
from dist_train.strategies.torch_strategy import TorchStrategy


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
