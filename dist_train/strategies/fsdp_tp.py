"""2-D parallelism: tensor parallelism inside groups of `strategy.tp` ranks, FSDP2 across those groups (fsdp_tp), or
whole replicas across them (ddp_tp: `strategy.dp_mode=replicate`, Megatron-LM's TP x DP).

The processes form a (dp_shard, tp) device mesh, rank = dp_index * tp + tp_index (torchtitan's layout: a TP
group is consecutive ranks, i.e. one node's GPUs). Each block is first split Megatron-style over the `tp`
dimension (as strategy=tp does), then every parameter, already a TP shard or replica, is sharded again by FSDP2
over the `dp_shard` dimension: a preset of degrees over dist_train.parallel.apply, which applies the two in that
order. The TP ranks of one group train on the same slice of the global batch; the dp_shard groups split it.
`strategy.sequence_parallel=true` splits the residual stream between the projections by sequence inside each TP
group, as strategy=tp's does (its docstring says how).
Collectives are counted per mesh dimension too: `comm/tp/all_reduce/...` (activations) and
`comm/dp_shard/all_gather/...`, `comm/dp_shard/reduce_scatter/...` (parameters and gradients).

ddp_tp keeps each TP rank's slice whole on every replica, a (dp_replicate, tp) mesh: FSDP2's replicate all-reduces
each block's gradients over `dp_replicate` once a step (`comm/dp_replicate/all_reduce/...`) and gathers nothing.
It holds tp-times less than ddp and moves a TP slice's gradients once a step, where fsdp_tp gathers every
block's parameters every micro-batch: the layout of Megatron-LM's published TP x DP runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar


from dist_train.config import RunConfig, StrategyConfig, choice, require
from dist_train.parallel_dims import ParallelDims, layout_dims
from dist_train.contracts import StrategyFamily
from dist_train.parallel.apply import Sharding
from dist_train.strategies.base import StrategyContext, check_expert_parallel, check_tensor_parallel
from dist_train.strategies.parallelized import MeshWrapper
from dist_train.strategies.torch_strategy import TorchStrategy

DP_MODES = ("fsdp", "replicate")


@dataclass
class FSDPTPConfig(StrategyConfig):
    """FSDP2 (or replicas) over data-parallel groups, tensor parallelism of degree `tp` inside each."""

    name: str = "fsdp_tp"
    # ranks per tensor-parallel group; world size / tp is the data-parallel size
    tp: int = 2
    reshard_after_forward: bool = True
    # how the data-parallel groups hold each TP slice: fsdp (sharded, fsdp_tp) | replicate (whole, ddp_tp)
    dp_mode: str = "fsdp"
    # Megatron's sequence parallelism inside each TP group, as strategy=tp's (torchtitan's 2-D default): norms on each
    # rank's share of the sequence; all-gather before and reduce-scatter after each attention and MLP
    sequence_parallel: bool = False
    # an MoE model's experts split over `ep` consecutive ranks (expert parallelism, as strategy=tp's ep); each
    # rank's E/ep experts FSDP2-sharded again over the world / ep ranks holding the same ones. 1: a dense model
    ep: int = 1

    splits_projections: ClassVar[bool] = True  # DTensor-sharded projections (config.StrategyConfig)
    transforms_in_parallelize: ClassVar[bool] = True  # parallel/apply.py: TP, checkpointing, compile, FSDP2
    loads_own_shard: ClassVar[bool] = True  # parallelized and sharded on meta, then each rank fills its part

    def parallel_dims(self, world_size: int) -> ParallelDims:
        # FSDP over dp_shard even where it is one rank (world = tp): the same wrapping at every size
        return layout_dims("ddp_tp" if self.dp_mode == "replicate" else "fsdp_tp", world_size, tp=self.tp, ep=self.ep)

    def check(self, world_size: int) -> None:
        choice("strategy.dp_mode", self.dp_mode, DP_MODES)
        require(self.tp >= 1, f"strategy.tp={self.tp} must be >= 1")
        require(
            world_size % self.tp == 0,
            f"strategy.tp={self.tp} must divide the number of processes ({world_size}): the mesh is "
            f"(data-parallel {world_size}/{self.tp}) x (tensor-parallel {self.tp})",
        )
        require(self.ep == 1 or self.dp_mode == "fsdp",
                f"strategy={self.name} with strategy.ep={self.ep}: expert parallelism beside tensor parallelism is "
                "built with FSDP2 (fsdp_tp), not with whole replicas (ddp_tp); use strategy=fsdp_tp, or strategy=ep "
                "without tensor parallelism")
        check_expert_parallel(self, ranks=world_size, sequence_parallel=self.sequence_parallel)

    def check_run(self, run: RunConfig, world_size: int) -> None:
        super().check_run(run, world_size)
        check_tensor_parallel(run, self.tp, what=f"strategy={self.name} with strategy.tp={self.tp}", ep=self.ep)


def build(cfg: FSDPTPConfig, ctx: StrategyContext) -> TorchStrategy:
    from dist_train.strategies._tensor_parallel import TPStrategy

    wrapper = MeshWrapper(cfg, ctx, sharding=Sharding(reshard_after_forward=cfg.reshard_after_forward),
                          sequence_parallel=cfg.sequence_parallel)
    return TPStrategy(cfg.name, ctx, wrapper)


FAMILY = StrategyFamily(family="fsdp_tp", schema=FSDPTPConfig,
                        names={"fsdp_tp": {}, "ddp_tp": {"dp_mode": "replicate"}}, build=build)
