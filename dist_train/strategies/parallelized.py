"""The wrapper of every strategy that is a preset of degrees over dist_train.parallel.apply (fsdp, hsdp, tp,
fsdp_tp, ddp_tp, fsdp_ep, ep): the mesh (and the experts' mesh, where there is expert parallelism) is built once from the
strategy's ParallelDims, then `parallelize` applies tensor parallelism, the experts' split and FSDP2 in their fixed
order. Only the degrees and options differ between those strategies."""

from __future__ import annotations

import contextlib
from typing import Any, ContextManager

import torch
from torch import nn

from dist_train.config import StrategyConfig
from dist_train.parallel.apply import Sharding
from dist_train.strategies.base import StrategyContext, onto


class MeshWrapper:
    """A TorchStrategy's Wrapper (torch_strategy.Wrapper) for a model parallelized over the run's device mesh."""

    def __init__(self, cfg: StrategyConfig, ctx: StrategyContext, *, sharding: Sharding | None,
                 sequence_parallel: bool = False, reduce_every_microbatch: bool = False) -> None:
        self.cfg, self.ctx = cfg, ctx
        self.sharding, self.sequence_parallel = sharding, sequence_parallel
        self.reduce_every_microbatch = reduce_every_microbatch
        self.dims = cfg.parallel_dims(ctx.runtime.world_size)
        self.mesh: Any = None
        self.expert_mesh: Any = None  # (efsdp, ep) or (edp, ep) where the degrees have ep (fsdp_ep, ep)

    def wrap(self, model: nn.Module) -> nn.Module:
        # The mesh, DTensor and FSDP2 are imported by the runs that use them only (start-up time).
        from dist_train.parallel.apply import parallelize
        from dist_train.parallel.mesh import build_expert_mesh, build_mesh

        rt = self.ctx.runtime
        self.mesh = build_mesh(self.dims, rt.device.type)
        self.expert_mesh = build_expert_mesh(self.dims, rt.device.type)
        if "tp" in self.dims.mesh_dim_names or self.expert_mesh is not None:
            model = onto(model, rt.device)  # DTensor places each shard where the model is
        return parallelize(model, mesh=self.mesh, dims=self.dims, precision=self.ctx.precision,
                           sharding=self.sharding, sequence_parallel=self.sequence_parallel,
                           checkpointing=self.ctx.train.activation_checkpointing,
                           checkpoint_every=self.ctx.train.checkpoint_every, compile=self.ctx.train.compile,
                           expert_mesh=self.expert_mesh)

    def no_sync(self, wrapped: nn.Module) -> ContextManager[Any]:
        if self.sharding is None or self.reduce_every_microbatch:
            # no data parallelism to hold back, or every micro-batch's backward reduce-scatters into the shards
            return contextlib.nullcontext()
        from dist_train.parallel.fsdp import no_sync

        return no_sync(wrapped)

    def devices(self) -> list[torch.device]:
        return [self.ctx.runtime.device]

    def mesh_groups(self) -> dict[str, list[int]]:
        """This rank's group along each named mesh dimension (telemetry's comm/<dim>/...)."""
        from dist_train.parallel.mesh import mesh_groups

        return {**mesh_groups(self.mesh), **mesh_groups(self.expert_mesh)}
