"""Expert parallelism with FSDP2 (torchtitan's and transformers' layout): the experts of every MoE layer split over
`strategy.ep` ranks, the tokens sent to them by all-to-all (dist_train/parallel/experts.py); everything else
(attention, norms, routers, embeddings, head) sharded by FSDP2 over all ranks, as strategy=fsdp shards it.

Two meshes over the same ranks: the dense one, (dp_shard) of the whole world, and the experts', (efsdp, ep) with
efsdp = world / ep: each rank holds E/ep experts of every MoE layer, FSDP2-sharded again over the efsdp ranks that
hold the same ones (nothing more when ep = world). Every rank trains on its own slice of the batch (data-parallel
degree = world). An expert's gradient sums what every rank's tokens contributed, so FSDP2 divides it by the world
(the number of distinct batches), not by its efsdp group: `set_gradient_divide_factor(world)`, with a plain sum on the
wire where efsdp > 1 (FSDP2 would otherwise pre-multiply, which gloo rejects, and NCCL zeroes in bf16 up to torch
2.13: pytorch/pytorch#190747). The gradient norm adds the two meshes' norms.

The all-to-alls appear in telemetry as `comm/all_to_all/...` (and `comm/ep/all_to_all/...`): per MoE layer and
micro-batch, the counts, then the rows forward and back, each mirrored in backward.

Not built yet: the model is built whole on each rank and then sharded (no meta build, so a model must fit one rank's
memory before sharding); the dry run (routing depends on values); ep with tensor parallelism or a pipeline.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ContextManager

import torch
from torch import nn

from dist_train.config import RunConfig, StrategyConfig, require
from dist_train.contracts import Batch, StepOutput, StrategyFamily
from dist_train.parallel_dims import ParallelDims
from dist_train.strategies.base import StrategyContext, accumulate, onto
from dist_train.strategies.torch_strategy import TorchStrategy


@dataclass
class FSDPEPConfig(StrategyConfig):
    """FSDP2 over every rank for the dense weights, experts split over `ep` ranks (and FSDP2 over world / ep)."""

    name: str = "fsdp_ep"
    # ranks that split each MoE layer's experts between them; it must divide the world and the number of experts
    ep: int = 2
    reshard_after_forward: bool = True

    @property
    def optimizer_sees_whole_tensors(self) -> bool:
        return False  # DTensor shards

    def parallel_dims(self, world_size: int) -> ParallelDims:
        return ParallelDims(world_size, dp_shard=world_size, ep=min(self.ep, world_size), kept=("dp_shard",))

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


class ExpertWrapper:
    """The experts sharded over ep and FSDP2 over efsdp, then FSDP2 over every rank for each block and the root."""

    def __init__(self, cfg: FSDPEPConfig, ctx: StrategyContext) -> None:
        self.cfg, self.ctx = cfg, ctx
        self.world = ctx.runtime.world_size
        self.mesh: Any = None
        self.expert_mesh: Any = None

    def wrap(self, model: nn.Module) -> nn.Module:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        from dist_train.parallel.experts import expert_modules, shard_experts
        from dist_train.parallel.fsdp import mixed_precision, shard
        from dist_train.parallel.mesh import build_mesh

        device = self.ctx.runtime.device
        model = onto(model, device)
        self.mesh = build_mesh(self.cfg.parallel_dims(self.world), device.type)
        ep = self.cfg.ep
        self.expert_mesh = init_device_mesh(device.type, (self.world // ep, ep), mesh_dim_names=("efsdp", "ep"))
        shard_experts(model, self.expert_mesh["ep"])
        policy = mixed_precision(self.ctx.precision)
        for experts in expert_modules(model):
            fully_shard(experts, mesh=self.expert_mesh["efsdp"], mp_policy=policy,
                        reshard_after_forward=self.cfg.reshard_after_forward)
            experts.set_gradient_divide_factor(float(self.world))  # distinct batches, not the efsdp group
            if self.world // ep > 1:
                experts.set_force_sum_reduction_for_comms(True)
        return shard(model, self.mesh["dp_shard"], reshard_after_forward=self.cfg.reshard_after_forward,
                     precision=self.ctx.precision)

    def no_sync(self, wrapped: nn.Module) -> ContextManager[Any]:
        from dist_train.parallel.fsdp import no_sync

        return no_sync(wrapped)

    def devices(self) -> list[torch.device]:
        return [self.ctx.runtime.device]

    def mesh_groups(self) -> dict[str, list[int]]:
        """This rank's group along each mesh dimension, the experts' included (comm/ep/all_to_all/...)."""
        from dist_train.parallel.mesh import mesh_groups

        return {**mesh_groups(self.mesh), **mesh_groups(self.expert_mesh)}


class ExpertParallelStrategy(TorchStrategy):
    """A TorchStrategy whose gradient norm adds the dense mesh's and the experts' mesh's."""

    def train_step(self, batch: Batch) -> StepOutput:
        assert self.wrapped is not None and self.opt is not None, "setup() first"
        self.opt.zero_grad()
        device = self.ctx.runtime.device
        loss_sum, n = accumulate(self.wrapped, batch.to(device), micro_batch_size=self.ctx.train.micro_batch_size,
                                 opt=self.opt, precision=self.ctx.precision, device=device,
                                 no_sync=lambda: self.wrapper.no_sync(self.wrapped))
        grad_norm = self.opt.step(total_norm=self._grad_norm())
        return StepOutput(loss_sum=loss_sum, num_microbatches=n, grad_norm=grad_norm)

    def _grad_norm(self) -> torch.Tensor:
        """sqrt(dense^2 + experts^2): each a DTensor norm over its own mesh, made whole."""
        from dist_train.parallel.experts import is_expert_param

        assert self.model is not None
        parts = []
        for expert in (False, True):
            grads = [p.grad for n, p in self.model.named_parameters()
                     if p.grad is not None and is_expert_param(n) == expert]
            if grads:
                norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0)
                parts.append(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
        return torch.stack(parts).norm() if parts else torch.zeros(())


def build(cfg: FSDPEPConfig, ctx: StrategyContext) -> TorchStrategy:
    return ExpertParallelStrategy(cfg.name, ctx, ExpertWrapper(cfg, ctx))


FAMILY = StrategyFamily(family="fsdp_ep", schema=FSDPEPConfig, names={"fsdp_ep": {}}, build=build)
