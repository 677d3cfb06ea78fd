"""The dry run's stand-ins: the few places where the real strategy code needs a real tensor, or a value a collective
carried, or would spend its time cutting fake tensors into views. Each is one function, swapped in while a rank runs
(`under_fake_group`) and put back after; each makes the dry run do what a real run does (tests/launched/test_dryrun.py
compares its figures with real runs)."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any, Iterator

# (owner, attribute, replacement): what the dry run swaps in while a rank runs (`under_fake_group`)
Patch = tuple[Any, str, Any]


@contextlib.contextmanager
def under_fake_group(*, zero: bool) -> Iterator[None]:
    """The places where the real code needs a real tensor or a value a collective carried, swapped for the dry
    run's answer while a rank runs (each function below says why), and put back after."""
    from unittest import mock

    patches = [*_meshes_outside_fake_mode(), *_pipeline_shapes_given(), *_moves_in_place(), *_ddp_replicas_agree(),
               *_fsdp_chunks_on_demand(), *_expert_parallel_routes_balanced(), *_sequences_unpacked(),
               *_dtensor_shapes_apart(),
               *(_deepspeed_checks_pass() if zero else [])]
    with contextlib.ExitStack() as stack:
        for owner, name, replacement in patches:
            stack.enter_context(mock.patch.object(owner, name, replacement))
        yield


def _meshes_outside_fake_mode() -> list[Patch]:
    """Device meshes compute their coordinates from real rank tensors: FakeTensorMode is lifted while one is made
    (init_device_mesh, DeviceMesh(...), or slicing a mesh into a dimension)."""
    import torch.distributed.device_mesh as device_mesh
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    def lifted(fn: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            with unset_fake_temporarily():
                return fn(*args, **kwargs)

        return call

    mesh = device_mesh.DeviceMesh
    return [(owner, name, lifted(getattr(owner, name)))
            for owner, name in [(device_mesh, "init_device_mesh"), (mesh, "__init__"), (mesh, "__getitem__")]]


def _sequences_unpacked() -> list[Patch]:
    """transformers tells packed sequences (several documents in a row, their positions restarting) from one sequence a
    row by reading the position ids' values, which a fake tensor has not: it then takes them as packed and builds the
    whole causal mask, and attention runs masked (without grouped-query attention's kernel: k and v repeated to every
    head, and the mask cast and kept, in every layer), which no real run of dist_train does. Its batches hold one
    sequence a row (positions 0..s-1), which a real run reads as unpacked: here that is the answer. Measured on
    Qwen3-30B-A3B's shape at 64 ranks (fsdp_ep): the masked path held 22,808 bytes more a token and layer (the
    difference between 8- and 16-layer dry runs)."""
    import transformers.masking_utils as masking
    from torch._subclasses.fake_tensor import is_fake

    find = getattr(masking, "find_packed_sequence_indices", None)
    if find is None:
        return []

    def unpacked(position_ids: Any) -> Any:
        return None if is_fake(position_ids) else find(position_ids)

    return [(masking, "find_packed_sequence_indices", unpacked)]


def _dtensor_shapes_apart() -> list[Patch]:
    """DTensor works out an op's output shape by running the op on empty tensors of the global shapes, under the
    active fake mode, or a fresh one where none is active (a real run: nothing allocated, nothing tracked). In the dry
    run the active mode is the dry run's own, so MemTracker counted those global-shape tensors as the rank's: under
    loss_parallel the log-softmax and the loss over the whole vocabulary in fp32, where a rank holds its slice
    (Qwen3-30B-A3B's 151,936 at seq 4,096: two of 2.3 GiB alive at fsdp_tp's peak). Here DTensor works them out under a
    mode of its own, as in a real run."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.distributed.tensor._sharding_prop import ShardingPropagator

    propagate = ShardingPropagator._propagate_tensor_meta_non_cached

    def apart(self: Any, op_schema: Any) -> Any:
        with unset_fake_temporarily():
            return propagate(self, op_schema)

    return [(ShardingPropagator, "_propagate_tensor_meta_non_cached", apart)]


def _pipeline_shapes_given() -> list[Patch]:
    """torch's pipeline schedules vote, at the first step, on whether every stage was given its input and output
    shapes (STATIC) or must exchange them (DYNAMIC): a value passed from stage to stage, which the fake process
    group does not carry. dist_train's pipelines give every stage both (PipelineStrategy.setup), so a real run's
    vote is STATIC on every rank: here each of this rank's stages is set so, after checking its own vote."""
    from torch.distributed.pipelining._utils import InferenceMode
    from torch.distributed.pipelining.schedules import _PipelineSchedule

    def vote(self: Any, stages: list[Any], has_backward: bool, p2p_done: bool) -> None:
        for stage in stages:
            if InferenceMode.needs_dynamic(stage._user_meta, has_backward):
                raise RuntimeError(f"pipeline stage {stage.stage_index} was built without its input and output "
                                   "shapes: the dry run cannot exchange them")
            stage._inference_mode = InferenceMode.STATIC

    return [(_PipelineSchedule, "_warmup_p2p", vote)]


def _ddp_replicas_agree() -> list[Patch]:
    """DistributedDataParallel reads tensors' data in three places that a fake tensor has none of:
    - its constructor all-gathers every parameter's shape and checks that the ranks agree, then broadcasts rank 0's
      parameters and buffers. Every rank builds the same model from the same config, so a real run's check passes
      and its broadcast changes nothing the dry run counts (set-up, before the measured step): both are skipped.
    - at the second step its reducer regroups the gradient buckets in the order the first backward made them ready
      (a first bucket of 1 MiB, then `bucket_cap_mb` each), and checks the grouping against rank 0's with a
      broadcast it reads back. Here the buckets are grouped with those sizes from the start, in DDP's reversed
      parameter order, and not regrouped: the same bytes all-reduced; the number of buckets can differ from a real
      run's by where the boundaries fall (the first step groups everything in one bucket, and is not measured)."""
    from torch._C._distributed_c10d import Reducer
    from torch.nn.parallel import distributed

    def agree(*args: Any, **kwargs: Any) -> None:
        return None

    def rebuilt_sizes(self: Any, static_graph: bool, find_unused_parameters: bool) -> tuple[list[int], list[int]]:
        limits = [self.first_bucket_bytes_cap, self.bucket_bytes_cap]
        return (limits if self.first_bucket_bytes_cap < self.bucket_bytes_cap else limits[1:]), []

    return [(distributed, "_verify_param_shape_across_processes", agree), (distributed, "_sync_module_states", agree),
            (distributed._BucketCapacityConfig, "compute_bucket_size_limits", rebuilt_sizes),
            (Reducer, "_rebuild_buckets", lambda self: False)]


class _Chunks(Sequence):  # type: ignore[type-arg]
    """`torch.chunk(tensor, num_chunks, dim)` padded with empty views to `num_chunks` (FSDP2's
    `_chunk_with_empty`), each view made when it is read: the same `narrow`s torch.chunk makes, and the same empty
    ones past the end."""

    def __init__(self, tensor: Any, num_chunks: int, dim: int) -> None:
        self.tensor, self.num_chunks, self.dim = tensor, num_chunks, dim
        size = tensor.size(dim)
        self.step = -(-size // num_chunks) if size else 0  # torch.chunk's: ceil(size / num_chunks)
        self.made = -(-size // self.step) if size else num_chunks  # how many torch.chunk makes

    def __len__(self) -> int:
        return self.num_chunks

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(self.num_chunks))]
        i = range(self.num_chunks)[i]
        if i >= self.made:
            return self[0].new_empty(0)
        if not self.step:
            return self.tensor.narrow(self.dim, 0, 0)
        start = i * self.step
        return self.tensor.narrow(self.dim, start, min(self.step, self.tensor.size(self.dim) - start))


def _fsdp_chunks_on_demand() -> list[Patch]:
    """Not a value but a cost: at set-up FSDP2 cuts every parameter into one view per rank (`torch.chunk`), twice,
    and reads two of them (this rank's and the first, the padded size). Under FakeTensorMode each view is a Python
    object: at 1,024 ranks that is 1.5 million of them for a 70B model, three quarters of the dry run's time
    (profiled). Here the same views are made when read (`_Chunks`)."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param

    def chunk_with_empty(tensor: Any, num_chunks: int, dim: int) -> Any:
        return _Chunks(tensor, num_chunks, dim)

    return [(_fsdp_param, "_chunk_with_empty", chunk_with_empty)]


def _moves_in_place() -> list[Patch]:
    """`module.to(device[, dtype])` where every tensor is there, in that dtype, already returns the module: a fake
    tensor cannot be swapped (torch's _apply swaps tensor subclasses). DeepSpeed's engine moves the model it is
    given; peft moves each new adapter to its base layer's device and dtype."""
    import torch
    from torch import nn

    original = nn.Module.to

    def to(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            device, dtype, *_ = torch._C._nn._parse_to(*args, **kwargs)
        except (TypeError, RuntimeError):
            return original(self, *args, **kwargs)
        tensors = [*self.parameters(), *self.buffers()]
        if device is not None and all(t.device.type == device.type for t in tensors) and (
                dtype is None or all(t.dtype == dtype for t in tensors if t.is_floating_point())):
            return self
        return original(self, *args, **kwargs)

    return [(nn.Module, "to", to)]


def _deepspeed_checks_pass() -> list[Patch]:
    """DeepSpeed reads values back after some collectives: ZeRO-3 broadcasts rank 0's module and parameter order to
    check that every rank traces the same one, and all-reduces an inf/NaN flag before each step. The fake process
    group carries no value, so the `.item()` that follows fails. The collectives themselves run (and are counted);
    the read-back takes the answer of a healthy run: the ranks agree, no overflow."""
    from deepspeed.runtime.zero import partitioned_param_coordinator, stage3, stage_1_and_2
    from torch._subclasses.fake_tensor import DataDependentOutputException

    def passing(fn: Any, answer: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            try:
                return fn(*args, **kwargs)
            except DataDependentOutputException:
                return answer

        return call

    def same_ints_as_rank0(ints: list[int]) -> None:
        """assert_ints_same_as_other_ranks' two broadcasts (the length, then rank 0's list), not read back: a fake
        tensor made from a literal keeps that literal through the fake broadcast, so the check would compare each
        rank's own placeholder with rank 0's list."""
        import torch
        from deepspeed import comm

        comm.broadcast(torch.tensor(len(ints), dtype=int), src=0, async_op=False)
        comm.broadcast(torch.tensor(ints, dtype=int), src=0, async_op=False)

    return [*_zero3_reduce_scatter_by_shape(), *_zero3_gathered_by_shape(), *_zero3_gather_buffer_views_on_demand(),
            (partitioned_param_coordinator, "assert_ints_same_as_other_ranks", same_ints_as_rank0),
            (stage3, "assert_ints_same_as_other_ranks", same_ints_as_rank0),
            (stage3.DeepSpeedZeroOptimizer_Stage3, "has_overflow",
             passing(stage3.DeepSpeedZeroOptimizer_Stage3.has_overflow, False)),
            (stage3, "is_invalid_grad_norm", passing(stage3.is_invalid_grad_norm, False)),
            (stage_1_and_2.DeepSpeedZeroOptimizer, "has_overflow",
             passing(stage_1_and_2.DeepSpeedZeroOptimizer.has_overflow, False)),
            (stage_1_and_2, "is_invalid_grad_norm", passing(stage_1_and_2.is_invalid_grad_norm, False))]


def _zero3_reduce_scatter_by_shape() -> list[Patch]:
    """Not a value but a cost: ZeRO-3's gradient reduce-scatter (`reduce_scatter_coalesced`) interleaves every
    rank's slice of every gradient of a bucket into one buffer, one view per rank and gradient (at 1,024 ranks,
    hundreds of thousands per bucket; as fake tensors, minutes per step). Here the same buffer (its size, dtype and
    division), the same reduce-scatter into this rank's part, and the same outputs (this rank's slice of each
    gradient, as views of its part) are made directly; only the copy of values into the buffer, which a fake
    tensor has none of, is left out."""
    import math

    import torch
    from deepspeed.runtime.comm import coalesced_collectives
    from deepspeed.runtime.zero import stage3

    @torch.no_grad()
    def reduce_scatter_coalesced(tensors: list[torch.Tensor], group: Any = None) -> list[torch.Tensor]:
        rank, world = coalesced_collectives.dist.get_rank(group), coalesced_collectives.dist.get_world_size(group)
        padded = [math.ceil(t.numel() / world) for t in tensors]
        if len(tensors) == 1 and tensors[0].numel() % world == 0:
            flat = tensors[0].view(-1)
        else:
            flat = torch.empty(world * sum(padded), dtype=tensors[0].dtype, device=tensors[0].device)
        flat.div_(world)
        mine = flat.narrow(0, rank * sum(padded), sum(padded))  # torch.chunk(flat, world)[rank]
        coalesced_collectives._torch_reduce_scatter_fn(flat, mine, group=group)
        out, offset = [], 0
        for t, p in zip(tensors, padded):
            out.append(mine.narrow(0, offset, max(0, min(p, t.numel() - rank * p))))
            offset += p
        return out

    return [(stage3, "reduce_scatter_coalesced", reduce_scatter_coalesced)]


def _zero3_gathered_by_shape() -> list[Patch]:
    """Not a value but a cost: after ZeRO-3's coalesced all-gather, DeepSpeed rebuilds each parameter by
    concatenating its slice of every rank's partition (one view per rank and parameter: at 1,024 ranks, 300,000
    per step as fake tensors, several minutes). Here each parameter gets the tensor that concatenation makes (its
    whole size, the gathered dtype cast to the parameter's) directly. Quantized gathers, and devices that need
    stream bookkeeping, keep DeepSpeed's own code."""
    import torch
    from deepspeed.accelerator import get_accelerator
    from deepspeed.runtime.zero import partition_parameters as pp

    original = pp.AllGatherCoalescedHandle.wait

    def wait(self: Any, handle_dependency: bool = True) -> None:
        if self.complete or self.quantization or not get_accelerator().is_synchronized_device():
            return original(self, handle_dependency)
        self.allgather_handle.wait()
        gathered = self.partitions[0]
        for param in self.params:
            assert param.ds_status == pp.ZeroParamStatus.INFLIGHT, f"expected param {param.ds_summary()} inflight"
            param.data = torch.empty(param.ds_numel, dtype=gathered.dtype, device=gathered.device).view(
                param.ds_shape).to(param.ds_tensor.dtype)
            param.ds_status = pp.ZeroParamStatus.AVAILABLE
        self.complete = True
        return None

    return [(pp.AllGatherCoalescedHandle, "wait", wait)]


def _zero3_gather_buffer_views_on_demand() -> list[Patch]:
    """Not a value but a cost: ZeRO-3's coalesced all-gather (`_all_gather_dtype`) cuts its output buffer into one
    view per rank before it gathers into it, and reads this rank's (and, in `wait`, the first). At 1,024 ranks that
    is 490,000 fake views a step of a 70B model, four fifths of the dry run's time (profiled). Here the same buffer,
    the same copy of this rank's partitions into its part, the same all-gather and the same handle are made, with
    the per-rank views made when read (`_Chunks`: the buffer is world_size partitions long, so torch.chunk's views
    are DeepSpeed's). DeepSpeed defines `_all_gather_dtype` inside each parameter's conversion; it is swapped in
    that closure, after the conversion. Gathers through secondary (hpZ) partitions keep DeepSpeed's own code, and
    so does everything if a DeepSpeed release names these functions differently."""
    import torch
    from deepspeed.accelerator import get_accelerator
    from deepspeed.runtime.zero import partition_parameters as pp

    def cell(fn: Any, name: str, depth: int = 2) -> Any:
        """The closure cell of `name` in `fn`, or in a function it closes over (a decorator's wrapper)."""
        code = getattr(fn, "__code__", None)
        if code is None or not fn.__closure__:
            return None
        if name in code.co_freevars:
            return fn.__closure__[code.co_freevars.index(name)]
        inner = (cell(c.cell_contents, name, depth - 1) for c in fn.__closure__ if depth and callable(c.cell_contents))
        return next((c for c in inner if c is not None), None)

    def by_shape(original: Any) -> Any:
        def all_gather_dtype(params: list[Any], world_size: int, rank_in_group: int, ds_process_group: Any,
                             allgather_dtype: torch.dtype) -> Any:
            if params[0].ds_secondary_tensor is not None:
                return original(params, world_size, rank_in_group, ds_process_group, allgather_dtype)
            device = get_accelerator().current_device_name()
            partition_sz = sum(p.ds_tensor.ds_numel for p in params)
            flat = torch.empty(partition_sz * world_size, dtype=allgather_dtype, device=device, requires_grad=False)
            partitions = _Chunks(flat, world_size, 0)
            mine = partitions[rank_in_group]
            torch.cat([p.ds_tensor.to(device).to(allgather_dtype) for p in params], out=mine)
            handle = pp._dist_allgather_fn(mine, flat, ds_process_group)
            return pp.AllGatherCoalescedHandle(allgather_handle=handle, params=params, partitions=partitions,
                                               world_size=world_size, use_secondary_tensor=False)

        return all_gather_dtype

    original_convert = pp.Init._convert_to_deepspeed_param

    def convert(self: Any, param: Any) -> Any:
        out = original_convert(self, param)
        coalesced = cell(getattr(param, "all_gather_coalesced", None), "_all_gather_coalesced")
        dtype_cell = cell(coalesced.cell_contents, "_all_gather_dtype") if coalesced is not None else None
        if dtype_cell is not None:
            dtype_cell.cell_contents = by_shape(dtype_cell.cell_contents)
        return out

    return [(pp.Init, "_convert_to_deepspeed_param", convert)]


# ---------------------------------------------------------------------------------------------- Mixture-of-Experts
# Which expert a token takes depends on the router's values, which a fake tensor does not have: transformers' experts
# loop finds each expert's tokens with aten.nonzero, dist_train's dispatch reads the counts on the host. The dry run
# routes as a perfectly balanced router would: (token, k) pair p to expert p mod E, through the same operations on
# rows of the same sizes. Its bytes and collectives are those of a real run whose routing is balanced; a real run's
# activations and all-to-all bytes per rank follow its own routing (over an EP group the all-to-alls sum the same).
def _balanced_pairs(pairs: int, experts: int) -> list[range]:
    """Expert e's pairs: e, e + E, e + 2E, ..."""
    return [range(e, pairs, experts) for e in range(experts)]


def balanced_experts(model: Any) -> None:
    """Each experts module's forward (transformers' eager loop, which dist_train pins by default) replaced, in place,
    by the same loop over balanced routing. Under fsdp_ep the strategy then replaces it with its dispatch, whose
    router `_expert_parallel_routes_balanced` makes balanced."""
    import types

    from dist_train.architectures import expert_modules

    for module in expert_modules(model):
        module.forward = types.MethodType(_eager_balanced, module)


def _eager_balanced(self: Any, hidden_states: Any, top_k_index: Any, top_k_weights: Any) -> Any:
    """transformers' eager experts forward (Qwen3-MoE, Mixtral, OLMoE and GPT-OSS share its loop; each expert's
    products as its class declares them, parallel/experts.py one_expert), each expert's rows given by the balanced
    routing instead of `where(expert_mask)`: the same gathers, products, weighting and index_add."""
    import torch

    from dist_train.parallel.experts import one_expert

    tokens, k = top_k_index.shape
    weights = dict(self.named_parameters(recurse=False))
    final_hidden_states = torch.zeros_like(hidden_states)
    for expert_idx, pairs in enumerate(_balanced_pairs(tokens * k, self.num_experts)):
        if not len(pairs):
            continue
        pair = torch.arange(pairs.start, pairs.stop, pairs.step)
        top_k_pos, token_idx = pair % k, pair // k
        current_hidden_states = one_expert(self, hidden_states[token_idx], expert_idx, weights)
        current_hidden_states = current_hidden_states * top_k_weights[token_idx, top_k_pos, None]
        final_hidden_states.index_add_(0, token_idx, current_hidden_states.to(final_hidden_states.dtype))
    return final_hidden_states


def _expert_parallel_routes_balanced() -> list[Patch]:
    """fsdp_ep's router (parallel/experts.py `route`): the counts' all-to-all still runs (and is counted), every rank
    routes its pairs balanced, so each rank's experts receive their share from every rank."""
    import torch
    import torch.distributed as dist

    from dist_train.parallel import experts

    def balanced(module: Any, top_k_index: Any) -> Any:
        ep, local, total = module.ep_size, module.num_local_experts, module.num_global_experts
        tokens, k = top_k_index.shape
        by_expert = _balanced_pairs(tokens * k, total)
        counts = [len(r) for r in by_expert]
        order = torch.cat([torch.arange(r.start, r.stop, r.step) for r in by_expert])
        per_expert = torch.tensor(counts)
        with torch.no_grad():
            dist.all_to_all_single(torch.empty_like(per_expert), per_expert, group=module.ep_group)
        me = dist.get_rank(module.ep_group)
        mine = counts[me * local:(me + 1) * local]  # what every rank sends to this one's experts
        arrived, local_rows = sum(mine), []
        for e in range(local):
            start = sum(mine[:e])
            local_rows.append(torch.cat([torch.arange(src * arrived + start, src * arrived + start + mine[e])
                                         for src in range(ep)]))
        return experts.Route(order, [sum(counts[r * local:(r + 1) * local]) for r in range(ep)], [arrived] * ep,
                             local_rows)

    return [(experts, "route", balanced)]
