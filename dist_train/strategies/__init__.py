"""Strategy registry: `strategy.name` -> builder. The loop asks here and nowhere else."""

from __future__ import annotations

import importlib
from collections.abc import Callable

from dist_train.config import StrategyConfig
from dist_train.strategies.base import Strategy, StepOutput, StrategyContext

# name -> module holding `build(cfg, ctx)`; imported lazily so deepspeed is only imported when asked for.
_BUILDERS: dict[str, str] = {
    "single": "dist_train.strategies.single",
    "dp": "dist_train.strategies.dp",
    "ddp": "dist_train.strategies.ddp",
    "fsdp": "dist_train.strategies.fsdp",
    # Pipeline parallelism: one module, `strategy.schedule` tells GPipe and 1F1B apart.
    "gpipe": "dist_train.strategies.pipeline",
    "1f1b": "dist_train.strategies.pipeline",
    # DeepSpeed ZeRO: one module, `strategy.stage` (and offload flags) tell the names apart.
    "zero1": "dist_train.strategies.zero",
    "zero2": "dist_train.strategies.zero",
    "zero3": "dist_train.strategies.zero",
    "zero2_offload": "dist_train.strategies.zero",
    "zero3_offload": "dist_train.strategies.zero",
}


def available() -> list[str]:
    return sorted(_BUILDERS)


def build_strategy(cfg: StrategyConfig, ctx: StrategyContext) -> Strategy:
    module = importlib.import_module(_BUILDERS[cfg.name])
    builder: Callable[[StrategyConfig, StrategyContext], Strategy] = module.build
    return builder(cfg, ctx)


__all__ = ["Strategy", "StepOutput", "StrategyContext", "available", "build_strategy"]
