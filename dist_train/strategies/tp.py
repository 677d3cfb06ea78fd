"""Tensor parallelism (Megatron-style) on DTensor: every rank holds a slice of each block's matmul weights.

Per block, attention's query/key/value projection and the MLP's first projection are split by output
column (each rank computes its own heads and its own slice of the intermediate), attention's output
projection and the MLP's second projection by input row; the partial outputs of the row-parallel
projections are summed by one all-reduce each in forward, and the gradients of the column-parallel inputs
by one all-reduce each in backward. The token embedding and the LM head are split by vocabulary row (Megatron's
VocabParallelEmbedding; the loss under torch's `loss_parallel`, on each rank's slice of the logits). Everything
else (norms, GPT-2's positions, row-parallel biases) is replicated: a `Replicate` DTensor, so one optimizer and
one gradient norm cover all parameters.

Every rank sees the whole batch (data-parallel size 1): the ranks of a TP group compute one model together.

An MoE model's experts are not split by tensor parallelism: `strategy.ep` splits them by expert over the ranks
(expert parallelism, dist_train/parallel/experts.py). Attention and the router run as above on every rank; each rank
then sends its own 1/tp share of the tokens to the experts by all-to-all and all-gathers the results over tp
(backward: the shares' input gradients all-gathered, so the router's gradient is whole on every rank).

- Llama (`nn.Linear`): torch's `ColwiseParallel` / `RowwiseParallel` on q/k/v, gate/up and o, down.
- GPT-2 (transformers' `Conv1D`, weight stored as in x out): the same two styles, with the weight's split
  dimension swapped. Its query/key/value projection is one fused `c_attn` whose output is [q | k | v]: a rank
  must hold its heads of each of the three, which `_StridedShard(1, split_factor=3)` describes (rank r holds
  columns r of q, r of k and r of v), so the full tensor keeps transformers' layout. That projection runs on
  the local shard, with DTensor doing its backward all-reduce.

With `sequence_parallel` (Megatron's sequence parallelism) the residual stream between the projections is
split by sequence: the norms run on each rank's tokens, attention and the MLP all-gather their input, and the
row-parallel projections reduce-scatter their output instead of all-reducing it; the gathered input stays a
DTensor into the column-parallel projections, whose input gradients are summed locally and reduce-scattered.

A preset of degrees (tp = world) over dist_train.parallel.apply; the machinery is parallel/tensor_parallel.py,
imported only by a run that applies it (DTensor is slow to import).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar


from dist_train.config import RunConfig, StrategyConfig
from dist_train.parallel_dims import ParallelDims, layout_dims
from dist_train.contracts import StrategyFamily
from dist_train.strategies.base import StrategyContext, check_expert_parallel, check_tensor_parallel
from dist_train.strategies.parallelized import MeshWrapper
from dist_train.strategies.torch_strategy import TorchStrategy


@dataclass
class TPConfig(StrategyConfig):
    """Tensor parallelism across all processes (TP degree = world size, data-parallel size 1)."""

    name: str = "tp"
    # Megatron's sequence parallelism: norms on each rank's share of the sequence; all-gather before and
    # reduce-scatter after each attention and MLP instead of one all-reduce.
    sequence_parallel: bool = False
    # an MoE model's experts split over `ep` of the ranks (expert parallelism; the tokens travel to them by
    # all-to-all, each rank sending its share): tensor parallelism here does not split experts. 1: a dense model
    ep: int = 1

    splits_projections: ClassVar[bool] = True  # DTensor-sharded projections (config.StrategyConfig)
    transforms_in_parallelize: ClassVar[bool] = True  # parallel/apply.py: TP, checkpointing, compile, FSDP2
    loads_own_shard: ClassVar[bool] = True  # parallelized on meta, then each rank fills its part

    def parallel_dims(self, world_size: int) -> ParallelDims:
        return layout_dims("tp", world_size, ep=self.ep)

    def check(self, world_size: int) -> None:
        check_expert_parallel(self, ranks=world_size, sequence_parallel=self.sequence_parallel)

    def check_run(self, run: RunConfig, world_size: int) -> None:
        super().check_run(run, world_size)
        check_tensor_parallel(run, world_size, what="strategy=tp", ep=self.ep)


def build(cfg: TPConfig, ctx: StrategyContext) -> TorchStrategy:
    from dist_train.strategies._tensor_parallel import TPStrategy

    return TPStrategy(cfg.name, ctx, MeshWrapper(cfg, ctx, sharding=None, sequence_parallel=cfg.sequence_parallel))


FAMILY = StrategyFamily(family="tp", schema=TPConfig, names={"tp": {}}, build=build)
