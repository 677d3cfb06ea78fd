"""Expert parallelism with FSDP2 (torchtitan's and transformers' layout): the experts of every MoE layer split over
`strategy.ep` ranks, the tokens sent to them by all-to-all; everything else (attention, norms, routers, embeddings,
head) sharded by FSDP2 over all ranks, as strategy=fsdp shards it. A preset of degrees over dist_train.parallel.apply,
whose experts step is dist_train/parallel/experts.py.

Two meshes over the same ranks: the dense one, (dp_shard) of the whole world, and the experts', (efsdp, ep) with
efsdp = world / ep: each rank holds E/ep experts of every MoE layer, FSDP2-sharded again over the efsdp ranks that
hold the same ones (nothing more when ep = world). Every rank trains on its own slice of the batch (data-parallel
degree = world), and an expert's gradient is divided by that degree, not by its efsdp group. The gradient norm adds
the two meshes' norms (strategies/base.py).

The all-to-alls appear in telemetry as `comm/all_to_all/...` and `comm/ep/all_to_all/...`: per MoE layer and
micro-batch, the counts, then the rows forward and back, each mirrored in backward.

The estimator models it (parallel/catalog.py's ep and expert_fsdp, estimate/comm.py), the advisor searches its ep.
Not built yet: the model is built whole on each rank and then sharded (no meta build, so a model must fit one rank's
memory before sharding); the dry run (routing depends on values); ep with tensor parallelism or a pipeline.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from dist_train.config import RunConfig, StrategyConfig, require
from dist_train.contracts import StrategyFamily
from dist_train.parallel.apply import Sharding
from dist_train.parallel_dims import ParallelDims, layout_dims
from dist_train.strategies.base import StrategyContext
from dist_train.strategies.parallelized import MeshWrapper
from dist_train.strategies.torch_strategy import TorchStrategy


@dataclass
class FSDPEPConfig(StrategyConfig):
    """FSDP2 over every rank for the dense weights, experts split over `ep` ranks (and FSDP2 over world / ep)."""

    name: str = "fsdp_ep"
    # ranks that split each MoE layer's experts between them; it must divide the world and the number of experts
    ep: int = 2
    reshard_after_forward: bool = True

    transforms_in_parallelize: ClassVar[bool] = True  # parallel/apply.py: checkpointing, compile, experts, FSDP2

    @property
    def optimizer_sees_whole_tensors(self) -> bool:
        return False  # DTensor shards

    def parallel_dims(self, world_size: int) -> ParallelDims:
        return layout_dims("fsdp", world_size, ep=min(self.ep, world_size))

    def check(self, world_size: int) -> None:
        require(self.ep >= 1, f"strategy.ep={self.ep} must be >= 1")
        require(world_size % self.ep == 0,
                f"strategy.ep={self.ep} must divide the number of processes ({world_size}): the experts' mesh is "
                f"(efsdp {world_size}/{self.ep}) x (ep {self.ep})")

    def check_run(self, run: RunConfig, world_size: int) -> None:
        super().check_run(run, world_size)
        m = run.model
        require(m.num_experts > 0, f"strategy={self.name}: model {m.name} has no experts (model.num_experts=0); "
                                   "expert parallelism needs an MoE model, such as model=tiny_moe")
        require(m.num_experts % self.ep == 0,
                f"strategy.ep={self.ep} must divide model.num_experts={m.num_experts}: each rank holds "
                f"num_experts / ep of every MoE layer's experts")
        require(run.peft.name == "none", f"strategy={self.name} with peft={run.peft.name} is not built yet")


def build(cfg: FSDPEPConfig, ctx: StrategyContext) -> TorchStrategy:
    wrapper = MeshWrapper(cfg, ctx, sharding=Sharding(reshard_after_forward=cfg.reshard_after_forward))
    return TorchStrategy(cfg.name, ctx, wrapper)


FAMILY = StrategyFamily(family="fsdp_ep", schema=FSDPEPConfig, names={"fsdp_ep": {}}, build=build)
