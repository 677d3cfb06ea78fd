"""DeepSpeed ZeRO stages 1-3 behind the strategy interface; `strategy.stage` picks the stage.

The engine, its DeepSpeed config (derived from the run's own config; `strategy.extra` is deep-merged over
it) and what this rank holds live in `_deepspeed.py`, shared with strategy=accelerate's DeepSpeed plugin.
DeepSpeed's engine owns backward (loss scaling by 1/accumulation), gradient reduction, clipping and the
optimizer step; the optimizer and LR schedule are ours (`OptimizerFactory`), handed to DeepSpeed.

What each stage partitions across the data-parallel ranks (fp32 Adam, N ranks, Psi parameters):
  stage 1: optimizer state                      params 4Psi, grads 4Psi,   optimizer 12Psi/N
  stage 2: + gradients                          params 4Psi, grads 4Psi/N, optimizer 12Psi/N
  stage 3: + parameters                         params 4Psi/N, grads 4Psi/N, optimizer 8Psi/N
The optimizer's 12Psi/N are Adam's two moments (8Psi/N) plus DeepSpeed's fp32 master copy of the
partition (4Psi/N), which stages 1 and 2 keep even when training in fp32. Stage 3 in fp32 uses the
parameters' own partition as its master (strategies/_zero3_setup.py); in bf16 it keeps the copy.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from dist_train.config import RunConfig, StrategyConfig
from dist_train.parallel_dims import ParallelDims, layout_dims
from dist_train.contracts import StrategyFamily
from dist_train.strategies._deepspeed import ZeroStrategy, check_run_settings, check_settings
from dist_train.strategies.base import StrategyContext


@dataclass
class ZeroConfig(StrategyConfig):
    """DeepSpeed ZeRO; zero1/zero2/zero3 differ only in `stage` (and the offload variants)."""

    name: str = "zero2"
    stage: int = 2
    offload_optimizer: bool = False
    offload_params: bool = False
    # Extra DeepSpeed config keys merged over the ones derived from the run's own config.
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def checkpoint_format(self) -> str:
        return "deepspeed"

    @property
    def loads_own_shard(self) -> bool:  # type: ignore[override]
        return self.stage == 3  # built under zero.Init, then each rank loads its partitions

    @property
    def optimizer_sees_whole_tensors(self) -> bool:
        return False  # DeepSpeed's flat partitions

    def parallel_dims(self, world_size: int) -> ParallelDims:
        return layout_dims("shard", world_size)  # ZeRO partitions over every rank

    def check(self, world_size: int) -> None:
        check_settings(self, world_size)

    def check_run(self, run: RunConfig, world_size: int) -> None:
        super().check_run(run, world_size)
        check_run_settings(self, run)


def build(cfg: ZeroConfig, ctx: StrategyContext) -> ZeroStrategy:
    return ZeroStrategy(cfg, ctx)


FAMILY = StrategyFamily(
    family="zero",
    schema=ZeroConfig,
    names={
        "zero1": {"stage": 1},
        "zero2": {"stage": 2},
        "zero3": {"stage": 3},
        "zero2_offload": {"stage": 2, "offload_optimizer": True},
        "zero3_offload": {"stage": 3, "offload_optimizer": True, "offload_params": True},
    },
    build=build,
)
