"""FSDP2: `fully_shard` on each transformer block, then on the root; HSDP when the shards are replicated.

Parameters, gradients and optimizer state are sharded across ranks (DTensors). In forward each block's
parameters are all-gathered; `reshard_after_forward` frees them again (ZeRO-3-like) or keeps them until
backward (ZeRO-2-like); the root's are always kept from forward to backward. Gradients are reduce-scattered
once per step: sync is off for all but the last micro-batch.

strategy=hsdp (hybrid sharding): `strategy.replicate` replicas of the model state, each sharded over
world / replicate ranks, on a (dp_replicate, dp_shard) mesh (rank = replica x shards + shard: a replica is
consecutive ranks, one node's GPUs). All-gathers and reduce-scatters stay within a replica (the fast links);
across replicas only the gradient shards are all-reduced, once a step. Each rank holds 1/(world/replicate) of
the state instead of 1/world.

Both are presets of degrees over dist_train.parallel.apply (strategies/parallelized.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Optional

from dist_train.config import StrategyConfig, require
from dist_train.contracts import StrategyFamily
from dist_train.parallel.apply import Sharding
from dist_train.parallel_dims import ParallelDims, layout_dims, nodes_of_launch
from dist_train.strategies.base import StrategyContext
from dist_train.strategies.parallelized import MeshWrapper
from dist_train.strategies.torch_strategy import TorchStrategy


@dataclass
class FSDPConfig(StrategyConfig):
    """FSDP2 (`fully_shard`) per transformer block, then the root; over replicas of the shards for hsdp."""

    name: str = "fsdp"
    # True: free gathered parameters after forward and gather again in backward (ZeRO-3-like).
    # False: keep them from forward to backward (ZeRO-2-like: more memory, one all-gather fewer).
    reshard_after_forward: bool = True
    # With gradient accumulation (several micro-batches a step): False keeps every parameter's unsharded fp32
    # gradient from the first micro-batch's backward to the last one's reduce-scatter (4 B/param on every rank,
    # whatever the world size; one reduce-scatter a step). True reduce-scatters after every micro-batch into the
    # sharded gradients, as torchtitan does: it sends the gradients once per micro-batch and holds 4 B/param / N.
    # None: chosen before the model is built by the memory it would take (dist_train/accumulation.py).
    reduce_every_microbatch: Optional[bool] = None
    # Replicas of the sharded state (HSDP's dp_replicate degree): 1 is plain FSDP (strategy=fsdp); None, strategy=hsdp's
    # default, is one replica per node (WORLD_SIZE / LOCAL_WORLD_SIZE, as torchrun and Slurm set them).
    replicate: Optional[int] = 1

    compiles_blocks: ClassVar[bool] = True  # compiled before fully_shard, as torchtitan does
    transforms_in_parallelize: ClassVar[bool] = True  # parallel/apply.py: TP, checkpointing, compile, FSDP2
    loads_own_shard: ClassVar[bool] = True  # fully_shard on meta, then each rank loads its rows

    @property
    def optimizer_sees_whole_tensors(self) -> bool:
        return False  # FSDP2 shards (DTensors)

    def replicas(self, world_size: int) -> int:
        return self.replicate if self.replicate is not None else nodes_of_launch(world_size)

    def parallel_dims(self, world_size: int) -> ParallelDims:
        return layout_dims("fsdp", world_size, replicas=self.replicas(world_size))

    def check(self, world_size: int) -> None:
        replicas = self.replicas(world_size)
        require(replicas >= 1, f"strategy.replicate={replicas} must be >= 1")
        require(
            world_size % replicas == 0,
            f"strategy.replicate={replicas} must divide the number of processes ({world_size}): HSDP's mesh is "
            f"(replicas {replicas}) x (shards {world_size}/{replicas})",
        )
        if self.name == "hsdp":
            how = "strategy.replicate" if self.replicate is not None else "one per node"
            require(
                replicas >= 2 and world_size // replicas >= 2,
                f"strategy=hsdp needs at least 2 replicas of at least 2 ranks; {how} gives {replicas} replica(s) of "
                f"{world_size // replicas} on {world_size} processes: set strategy.replicate (e.g. 2 with 4 "
                "processes) or use strategy=fsdp",
            )


def build(cfg: FSDPConfig, ctx: StrategyContext) -> TorchStrategy:
    wrapper = MeshWrapper(cfg, ctx, sharding=Sharding(reshard_after_forward=cfg.reshard_after_forward),
                          reduce_every_microbatch=bool(cfg.reduce_every_microbatch))
    return TorchStrategy(cfg.name, ctx, wrapper)


FAMILY = StrategyFamily(family="fsdp", schema=FSDPConfig, names={"fsdp": {"replicate": 1}, "hsdp": {"replicate": None}},
                        build=build)
