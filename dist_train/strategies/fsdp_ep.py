"""Expert parallelism: the experts of every MoE layer split over `strategy.ep` ranks, the tokens sent to them by
all-to-all (dist_train/parallel/experts.py), in two layouts of the dense weights (attention, norms, routers,
embeddings, head):

- fsdp_ep (torchtitan's and transformers' layout): FSDP2 over all ranks, as strategy=fsdp shards them. The experts'
  mesh is (efsdp, ep), efsdp = world / ep: each rank's E/ep experts are FSDP2-sharded again over the efsdp ranks that
  hold the same ones (nothing more when ep = world);
- ep (`strategy.dp_mode=replicate`): whole replicas on every rank, as ddp holds them (FSDP2's replicate, each block's
  gradients all-reduced once a step). The experts' mesh is (edp, ep), edp = world / ep: the ranks holding the same
  E/ep experts keep them whole and all-reduce their gradients once a step (nothing more when ep = world).

Both are presets of degrees over dist_train.parallel.apply. Every rank trains on its own slice of the batch
(data-parallel degree = world), and an expert's gradient is divided by that degree, not by its efsdp or edp group.
The gradient norm adds the meshes' norms (strategies/base.py).

The all-to-alls appear in telemetry as `comm/all_to_all/...` and `comm/ep/all_to_all/...`: per MoE layer and
micro-batch, the counts, then the rows forward and back, each mirrored in backward.

The estimator models both (parallel/catalog.py's ep, expert_fsdp and expert_replicate; estimate/comm.py), the dry run
runs them (routing balanced), the advisor searches their ep. Built on meta, split and sharded, then each rank fills
its part, from the seeded init or a directory's files (weights.StackedExperts reads its experts stacked). Expert
parallelism beside tensor parallelism is tp's and fsdp_tp's `strategy.ep`; with a pipeline it is not built.
train.compile compiles each block; the dispatch runs eager between its graphs (parallel/experts.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Optional

from dist_train.config import RunConfig, StrategyConfig, choice, require
from dist_train.contracts import StrategyFamily
from dist_train.parallel.apply import Sharding
from dist_train.parallel_dims import ParallelDims, layout_dims
from dist_train.strategies.base import StrategyContext, check_expert_parallel, check_experts_divide
from dist_train.strategies.parallelized import MeshWrapper
from dist_train.strategies.torch_strategy import TorchStrategy


DP_MODES = ("fsdp", "replicate")


@dataclass
class FSDPEPConfig(StrategyConfig):
    """Experts split over `ep` ranks; the dense weights FSDP2-sharded over every rank (fsdp_ep, and the experts
    again over world / ep) or whole on every rank (ep, and the experts whole over world / ep)."""

    name: str = "fsdp_ep"
    # ranks that split each MoE layer's experts between them; it must divide the world and the number of experts
    ep: int = 2
    reshard_after_forward: bool = True
    # how the data-parallel ranks hold the dense weights: fsdp (sharded, fsdp_ep) | replicate (whole, ep)
    dp_mode: str = "fsdp"
    # fsdp_ep with gradient accumulation, as strategy=fsdp's: False holds the dense weights' and the rank's experts'
    # unsharded fp32 gradients until the last micro-batch, True reduce-scatters after every one, None chooses by
    # the predicted peak (dist_train/accumulation.py). ep holds whole gradients either way: False.
    reduce_every_microbatch: Optional[bool] = None

    compiles_blocks: ClassVar[bool] = True
    transforms_in_parallelize: ClassVar[bool] = True  # parallel/apply.py: checkpointing, compile, experts, FSDP2
    loads_own_shard: ClassVar[bool] = True  # split and sharded on meta, then each rank fills its experts and rows

    @property
    def optimizer_sees_whole_tensors(self) -> bool:
        return False  # DTensor shards

    def parallel_dims(self, world_size: int) -> ParallelDims:
        if self.dp_mode == "replicate":  # ddp_tp's layout at tp 1: whole replicas over dp_replicate
            return layout_dims("ddp_tp", world_size, tp=1, ep=min(self.ep, world_size))
        return layout_dims("fsdp", world_size, ep=min(self.ep, world_size))

    def check(self, world_size: int) -> None:
        choice("strategy.dp_mode", self.dp_mode, DP_MODES)
        check_expert_parallel(self, ranks=world_size, outer="edp" if self.dp_mode == "replicate" else "efsdp")
        require(not (self.dp_mode == "replicate" and self.reduce_every_microbatch),
                f"strategy={self.name}: strategy.reduce_every_microbatch=true applies to sharded gradients (fsdp_ep); "
                "ep's replicas hold whole ones either way: leave it false")

    def check_run(self, run: RunConfig, world_size: int) -> None:
        super().check_run(run, world_size)
        m = run.model
        require(m.num_experts > 0, f"strategy={self.name}: model {m.name} has no experts (model.num_experts=0); "
                                   "expert parallelism needs an MoE model, such as model=tiny_moe")
        check_experts_divide(run, self.ep, what=f"strategy={self.name}")
        require(run.peft.name == "none", f"strategy={self.name} with peft={run.peft.name} is not built yet")


def build(cfg: FSDPEPConfig, ctx: StrategyContext) -> TorchStrategy:
    wrapper = MeshWrapper(cfg, ctx, sharding=Sharding(reshard_after_forward=cfg.reshard_after_forward),
                          reduce_every_microbatch=bool(cfg.reduce_every_microbatch))
    return TorchStrategy(cfg.name, ctx, wrapper)


FAMILY = StrategyFamily(family="fsdp_ep", schema=FSDPEPConfig, build=build,
                        names={"fsdp_ep": {}, "ep": {"dp_mode": "replicate", "reduce_every_microbatch": False}})
