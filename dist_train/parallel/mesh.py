"""The run's one device mesh, built once from its ParallelDims, and what telemetry reads from it."""

from __future__ import annotations

from typing import Any

from dist_train.parallel_dims import ParallelDims


def build_mesh(dims: ParallelDims, device_type: str) -> Any:
    """A DeviceMesh with one named dimension per degree of `dims` (`dims.mesh_dim_names`), or None where there is
    none (one process, or every degree 1). Where data parallelism and tensor parallelism both shard a parameter
    (fsdp_tp, hsdp), one flattened group over those dimensions too, so that a gradient norm partial on both is one
    all-reduce, not two in sequence whose order could differ between ranks (torch warns)."""
    names = dims.mesh_dim_names
    if not names:
        return None
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device_type, dims.mesh_shape, mesh_dim_names=names)
    sharded = tuple(n for n in names if n != "pp")
    if len(sharded) > 1:
        mesh[sharded]._flatten("_".join(sharded))
    return mesh


def build_expert_mesh(dims: ParallelDims, device_type: str) -> Any:
    """The experts' mesh over the same ranks as the run's mesh: (efsdp, ep), efsdp = data-parallel ranks / ep (the
    ranks that hold the same experts, which FSDP2 shards them over: fsdp_ep), or (edp, ep) where the dense weights
    are whole replicas (strategy=ep: edp ranks hold the same experts whole and all-reduce their gradients); None
    where dims.ep is 1. torchtitan and transformers lay expert parallelism out the same way."""
    if dims.ep <= 1:
        return None
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device_type, (dims.world_size // dims.ep, dims.ep), mesh_dim_names=dims.expert_dims)
    # the experts' gradient norm, partial over both dimensions where FSDP2 shards them again (efsdp), is then one
    # all-reduce over the flattened group rather than two in sequence, whose order could differ between ranks
    mesh[dims.expert_dims]._flatten("_".join(dims.expert_dims))
    return mesh


def mesh_groups(mesh: Any) -> dict[str, list[int]]:
    """This rank's process group per named mesh dimension ({"dp_shard": [0, 1], "tp": [0, 2]}); {} without a mesh.
    Telemetry counts each collective under the dimension whose group it ran on (comm/<dim>/<op>/...)."""
    if mesh is None:
        return {}
    import torch.distributed as dist

    return {name: dist.get_process_group_ranks(mesh[name].get_group()) for name in mesh.mesh_dim_names}
