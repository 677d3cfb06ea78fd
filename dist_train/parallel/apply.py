"""The parallelisms of a run applied to a model, in one fixed order (torchtitan's `parallelize_<model>`):

1. tensor parallelism over the mesh's `tp` dimension (parallel/tensor_parallel.py);
2. activation checkpointing of each block (dist_train.model.apply_activation_checkpointing), around the
   tensor-parallel block: `full` recomputation re-runs the split projections and their collectives, `selective`
   keeps their outputs and all-reduces and re-runs the rest;
3. torch.compile of each block (train.compile), the checkpointing with it;
4. FSDP2 over the data-parallel dimensions (parallel/fsdp.py): `dp_shard`, or HSDP over
   (`dp_replicate`, `dp_shard`); each (checkpointed, compiled) block is one all-gather unit. Where the mesh's only
   data-parallel dimension is `dp_replicate` (ddp_tp), FSDP2's replicate instead: whole replicas, each block's
   gradients all-reduced once a step, nothing gathered.

Before step 4, where the degrees have `ep` (fsdp_ep, ep; tp and fsdp_tp with strategy.ep): every MoE layer's experts
split over the experts' mesh's `ep` dimension, the tokens sent to them by all-to-all (parallel/experts.py; under
tensor parallelism each TP rank sends its share and the results are all-gathered over tp, step 1 leaving the experts
whole), and FSDP2 over its `efsdp` dimension (or FSDP2's replicate over `edp`, where the dense weights are replicas:
ep), each experts module its own unit; step 4 then leaves them to it.

fsdp, hsdp, tp, fsdp_tp, ddp_tp, fsdp_ep and ep are presets of degrees over this one function
(strategies/parallelized.py); a pipeline applies it to each of its stages (pp_dp with dp_mode=fsdp). A new axis is one
more step here, in its place in the order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from dist_train.config import PrecisionConfig
from dist_train.parallel_dims import ParallelDims


@dataclass(frozen=True)
class Sharding:
    """How FSDP2 shards: its reshard_after_forward (ZeRO-3-like True, ZeRO-2-like False)."""

    reshard_after_forward: bool = True


def data_parallel_mesh(mesh: Any, dims: ParallelDims) -> Any:
    """The part of `mesh` FSDP shards over: (dp_replicate, dp_shard) for HSDP, else dp_shard."""
    names = tuple(n for n in ("dp_replicate", "dp_shard") if n in dims.mesh_dim_names)
    return mesh[names] if len(names) > 1 else mesh[names[0]]


def parallelize(model: nn.Module, *, mesh: Any, dims: ParallelDims, precision: PrecisionConfig | None,
                sharding: Sharding | None, sequence_parallel: bool = False, checkpointing: str = "none",
                checkpoint_every: int = 1, compile: bool = False, blocks: list[nn.Module] | None = None,
                expert_mesh: Any = None) -> nn.Module:
    """`model` (on this rank's device, or on meta) parallelized in place over `mesh` by the degrees of `dims`, in the
    order above: tensor parallelism where the mesh has `tp`, checkpointing and compile where asked, then FSDP2 where
    `sharding` is given. A pipeline applies it to each stage (`blocks`: the stage's own; precision None: no mixed
    precision policy, the stage computes under autocast)."""
    from dist_train.model import apply_activation_checkpointing, compile_blocks

    if "tp" in dims.mesh_dim_names:
        from dist_train.parallel.tensor_parallel import parallelize as apply_tensor_parallel

        apply_tensor_parallel(model, mesh["tp"], sequence_parallel=sequence_parallel,
                              experts_by_ep=expert_mesh is not None)
    apply_activation_checkpointing(model, checkpointing, every=checkpoint_every)  # none | full | selective
    if compile:
        compile_blocks(model)
    if expert_mesh is not None:
        from dist_train.parallel.experts import parallelize_experts

        parallelize_experts(model, expert_mesh, precision=precision, divide_by=dims.data_parallel,
                            reshard_after_forward=sharding.reshard_after_forward if sharding else True,
                            tp_mesh=mesh["tp"] if "tp" in dims.mesh_dim_names else None)
    if sharding is not None and "dp_shard" not in dims.mesh_dim_names:
        from dist_train.parallel.fsdp import replicate

        assert blocks is None, "a pipeline's stages replicate through the schedule (strategies/pipeline.py)"
        replicate(model, mesh["dp_replicate"], precision=precision)
    elif sharding is not None:
        from dist_train.parallel.fsdp import shard

        shard(model, data_parallel_mesh(mesh, dims), reshard_after_forward=sharding.reshard_after_forward,
              precision=precision, blocks=blocks)
    return model
