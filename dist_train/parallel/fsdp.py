"""FSDP2 (`fully_shard`) applied to a model: one of the functions dist_train.parallel.apply runs in its fixed order
(fsdp, hsdp, fsdp_tp, and pp_dp's sharded stages); and FSDP2's `replicate` (ddp_tp). Imported only by the runs that
use it.

Over a 1-D mesh (dp_shard) each rank holds 1/N of every parameter, gradient and optimizer state. Over a 2-D mesh
(dp_replicate, dp_shard) it is HSDP: each replica shards the state over its dp_shard ranks, and after the
reduce-scatter within a replica, FSDP2 all-reduces the gradient shards across the replicas."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from dist_train.config import PrecisionConfig
from dist_train.model import transformer_blocks


def mixed_precision(precision: PrecisionConfig | None) -> MixedPrecisionPolicy:
    """Compute in the chosen dtype; keep fp32 shards and reduce gradients in fp32. None: no policy (a pipeline's
    stages compute under autocast over their fp32 parameters, so what travels between stages keeps its dtype)."""
    if precision is None:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=precision.dtype if precision.mixed else None, reduce_dtype=torch.float32)


def shard(model: nn.Module, mesh: DeviceMesh, *, reshard_after_forward: bool, precision: PrecisionConfig | None,
          blocks: list[nn.Module] | None = None) -> nn.Module:
    """`fully_shard` each transformer block over `mesh` (dp_shard, or (dp_replicate, dp_shard) for HSDP), then the
    root; in place. `blocks`: the blocks to shard where they are not the model's whole list (a pipeline stage's)."""
    kwargs = dict(mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=mixed_precision(precision))
    # Blocks first, then the root (embeddings, final norm, head): each block is one all-gather unit.
    for block in transformer_blocks(model) if blocks is None else blocks:
        fully_shard(block, **kwargs)
    # The root's parameters are needed again as soon as backward starts, so FSDP2's default (None) keeps them
    # gathered after forward; passing True would gather them twice per micro-batch for nothing (measured:
    # 2 extra all-gathers per step on the tiny model). With reshard_after_forward=false nothing reshards.
    fully_shard(model, **{**kwargs, "reshard_after_forward": None if reshard_after_forward else False})
    return model


def replicate(model: nn.Module, mesh: DeviceMesh, *, precision: PrecisionConfig | None) -> nn.Module:
    """Whole replicas over `mesh` (dp_replicate): DDP on FSDP2's machinery (torch's `replicate_with_fsdp`), which
    takes the DTensor shards tensor parallelism leaves (torch's DDP does not). Each block, then the root, is one
    all-reduce unit: its fp32 gradients are all-reduced as its backward ends, once a step (held back while
    accumulating, as DDP's no_sync), and nothing is gathered. In place."""
    from torch.distributed._composable.replicate_with_fsdp import replicate as replicate_module

    policy = mixed_precision(precision)
    for block in transformer_blocks(model):
        replicate_module(block, mesh=mesh, mp_policy=policy)
    replicate_module(model, mesh=mesh, mp_policy=policy)
    return model


@contextlib.contextmanager
def no_sync(wrapped: nn.Module) -> Iterator[None]:
    """Gradients accumulate unreduced until the context ends (FSDP2's requires_gradient_sync)."""
    assert isinstance(wrapped, FSDPModule)
    wrapped.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        wrapped.set_requires_gradient_sync(True)
