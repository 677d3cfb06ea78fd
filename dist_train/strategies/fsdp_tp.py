"""2-D parallelism: tensor parallelism inside groups of `strategy.tp` ranks, FSDP2 across those groups.

The processes form a (dp, tp) device mesh, rank = dp_index * tp + tp_index (torchtitan's layout: a TP group
is consecutive ranks, i.e. one node's GPUs). Each block is first split Megatron-style over the `tp` dimension
(as strategy=tp does), then every parameter, already a TP shard or replica, is sharded again by FSDP2 over
the `dp` dimension. The TP ranks of one group train on the same slice of the global batch; the dp groups
split it. Collectives are counted per mesh dimension too: `comm/tp/all_reduce/...` (activations) and
`comm/dp/all_gather/...`, `comm/dp/reduce_scatter/...` (parameters and gradients).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, ContextManager

import torch
from torch import nn

from dist_train.config import RunConfig, StrategyConfig, require
from dist_train.contracts import StrategyFamily
from dist_train.strategies.base import StrategyContext, check_tensor_parallel, onto
from dist_train.strategies.torch_strategy import TorchStrategy


@dataclass
class FSDPTPConfig(StrategyConfig):
    """FSDP2 over data-parallel groups, tensor parallelism of degree `tp` inside each."""

    name: str = "fsdp_tp"
    # ranks per tensor-parallel group; world size / tp is the data-parallel (FSDP) size
    tp: int = 2
    reshard_after_forward: bool = True

    splits_projections: ClassVar[bool] = True  # DTensor-sharded projections (config.StrategyConfig)
    loads_own_shard: ClassVar[bool] = True  # parallelized and sharded on meta, then each rank fills its part

    def data_parallel_size(self, world_size: int) -> int:
        return max(world_size // self.tp, 1)

    def data_parallel_rank(self, rank: int, world_size: int) -> int:
        return rank // self.tp

    def check(self, world_size: int) -> None:
        require(self.tp >= 1, f"strategy.tp={self.tp} must be >= 1")
        require(
            world_size % self.tp == 0,
            f"strategy.tp={self.tp} must divide the number of processes ({world_size}): the mesh is "
            f"(data-parallel {world_size}/{self.tp}) x (tensor-parallel {self.tp})",
        )

    def check_run(self, run: RunConfig, world_size: int) -> None:
        super().check_run(run, world_size)
        check_tensor_parallel(run, self.tp, what=f"strategy=fsdp_tp with strategy.tp={self.tp}")


class FSDPTPWrapper:
    def __init__(self, cfg: FSDPTPConfig, ctx: StrategyContext) -> None:
        self.cfg, self.ctx = cfg, ctx
        self.mesh: Any = None

    def wrap(self, model: nn.Module) -> nn.Module:
        # DTensor, torch's parallel styles and FSDP2 are imported only by a run that uses them (start-up).
        from torch.distributed.device_mesh import init_device_mesh

        from dist_train.strategies._fsdp import shard
        from dist_train.strategies._tensor_parallel import parallelize

        rt, tp = self.ctx.runtime, self.cfg.tp
        self.mesh = init_device_mesh(rt.device.type, (rt.world_size // tp, tp), mesh_dim_names=("dp", "tp"))
        # One group over the whole mesh, so that the gradient norm (partial on both dimensions) is one
        # all-reduce, not two in sequence whose reduction order could differ between ranks (torch warns).
        self.mesh["dp", "tp"]._flatten("dp_tp")
        parallelize(onto(model, rt.device), self.mesh["tp"])
        return shard(model, self.mesh["dp"], reshard_after_forward=self.cfg.reshard_after_forward,
                     precision=self.ctx.precision)

    def no_sync(self, wrapped: nn.Module) -> ContextManager[Any]:
        from dist_train.strategies._fsdp import no_sync

        return no_sync(wrapped)

    def devices(self) -> list[torch.device]:
        return [self.ctx.runtime.device]

    def mesh_groups(self) -> dict[str, list[int]]:
        """This rank's row (its TP group) and column (its FSDP group) of the mesh."""
        import torch.distributed as dist

        return {dim: dist.get_process_group_ranks(self.mesh[dim].get_group()) for dim in ("dp", "tp")}


def build(cfg: FSDPTPConfig, ctx: StrategyContext) -> TorchStrategy:
    from dist_train.strategies._tensor_parallel import TPStrategy

    return TPStrategy(cfg.name, ctx, FSDPTPWrapper(cfg, ctx))


FAMILY = StrategyFamily(family="fsdp_tp", schema=FSDPTPConfig, names={"fsdp_tp": {}}, build=build)
