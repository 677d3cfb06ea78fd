"""Communication per optimizer step of each strategy, per rank: the collectives each of the run's parallelisms
declares (dist_train/parallel/catalog.py), sized here, one sizer per parallelism.

Two views of the same traffic:
- buffer bytes per collective (nccl-tests convention, the one `telemetry/comm.py` records: an all-reduce
  counts its buffer, an all-gather its gathered output, a reduce-scatter its input), to compare with a
  run's `comm/<op>/bytes`;
- ring traffic each rank sends, buffer x nccl-tests bus factor (all-reduce 2(N-1)/N, all-gather and
  reduce-scatter (N-1)/N): the ZeRO paper's volumes, 2Ψ for DDP / ZeRO-1 / ZeRO-2 (a reduce-scatter plus
  an all-gather, or one all-reduce) and 3Ψ for ZeRO-3 / FSDP (parameters gathered in forward and again
  in backward, gradients reduce-scattered), times (N-1)/N. DeepSpeed's ZeRO-1/2 (regime `deepspeed`)
  all-reduce the gradients instead of reduce-scattering them, 3Ψ with the parameter all-gather.

Gradient accumulation over M micro-batches changes the counts, and the prediction follows what the code
does: DDP and FSDP2 (no_sync / set_requires_gradient_sync) reduce once per step, DeepSpeed ZeRO-2/3
reduce gradients on every micro-batch (engine.allreduce_gradients: "ZeRO stage >= 2 communicates during
non gradient accumulation boundaries as well"), ZeRO-1 at the boundary only; ZeRO-3 and FSDP with
reshard_after_forward gather every parameter twice per micro-batch. A pipeline sends one activation
(s x b x h) forward and one gradient backward per micro-batch across each stage boundary. Tensor
parallelism all-reduces s x b x h activations inside every layer, forward and backward (Megatron-LM).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional

from dist_train.parallel.catalog import EXPERT_NORM, GRADIENT_NORM
from dist_train.estimate.memory import (dense_rank_params, element_bytes, expert_padded, expert_rank_elements,
                                        fsdp_padded, state_bytes, tp_rank_params, with_model,
                                        zero3_keeps_for_backward, zero3_partitioned)
from dist_train.estimate.render import human_bytes
from dist_train.estimate.setup import Setup
from dist_train.estimate.shapes import ModelShape, stage_layers, stage_params

# Buckets that set how many calls carry the bytes: DDP's bucket_cap_mb where a strategy does not set it (torch's
# default, 25 MiB: pp_dp's replicated stages; strategy=ddp's is Setup.bucket_cap_mb), DeepSpeed ZeRO-1/2's
# allgather_bucket_size (elements, its default, which the training code keeps: parallel/buckets.py). ZeRO's reduce
# bucket is Setup.zero_reduce_bucket_size (hidden^2 unless the run sets it), ZeRO-3's reuse distance (whether backward
# gathers again) Setup.zero3_max_reuse_distance, as the memory model reads them.
DDP_BUCKET_BYTES = 25 * 2**20
DS_ALLGATHER_BUCKET_SIZE = 5 * 10**8


def buckets(size: float, bucket: float) -> int:
    """Calls that carry `size` in buckets of at most `bucket` (the same unit)."""
    return max(1, math.ceil(size / bucket))


def bus_factor(op: str, group_size: int) -> float:
    """Bytes a rank sends per buffer byte: nccl-tests' bus factor (as telemetry.bandwidth.busbw_factor, without
    importing torch), except that a recv sends nothing (its bytes are the peer's send)."""
    n = group_size
    if op in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all"):
        if n <= 1:
            return 0.0
        return 2 * (n - 1) / n if op == "all_reduce" else (n - 1) / n
    return 0.0 if op == "recv" else 1.0


@dataclass(frozen=True)
class Collective:
    op: str  # all_reduce | all_gather | reduce_scatter | all_to_all | send | recv
    bytes: float  # buffer bytes per step, all calls together
    what: str
    elem: int = 4  # bytes per element moved
    dim: str = ""  # the mesh dimension it runs over (fsdp_tp: tp or dp_shard); "" = the strategy's one group
    group_size: int = 0  # ranks in that group; 0 = the group size the caller passes
    calls: int = 1  # separate calls per step (buckets, one per block, ...): what latency costs (estimate/step_time.py)
    overlaps: bool = True  # whether compute can hide it (the catalog's Traffic.overlaps)
    moves: str = ""  # what travels (the catalog's Traffic.moves): parameters, gradients, gradient norm, ...

    def ring_bytes(self, group_size: int) -> float:
        return self.bytes * bus_factor(self.op, self.group_size or group_size)

    def ring_elements(self, group_size: int) -> float:
        """Elements each rank sends: the ZeRO paper's unit (2Ψ, 3Ψ)."""
        return self.ring_bytes(group_size) / self.elem


def predict_comm(shape: ModelShape, setup: Setup) -> list[list[Collective]]:
    """For every rank, the collectives of one optimizer step: those each of the run's parallelisms declares
    (parallel/catalog.py), sized here, over its mesh dimension. A dimension of one rank sends nothing (FSDP2, DDP and
    DeepSpeed issue no collective in a group of one)."""
    if setup.family == "pipeline":
        stages = [_rank(shape, setup, stage=k) for k in range(setup.num_stages)]
        return [stages[rank // setup.data_parallel_size] for rank in range(setup.world_size)]
    return [_rank(shape, setup, stage=None)] * setup.world_size


def _rank(shape: ModelShape, setup: Setup, *, stage: Optional[int]) -> list[Collective]:
    out: list[Collective] = []
    dims, deepspeed = setup.dims, setup.resolved_regime == "deepspeed"
    # the dimensions whose parallelisms split the gradients (the experts' apart): one norm over them all
    norm_dims: dict[Any, list[str]] = {GRADIENT_NORM: [], EXPERT_NORM: []}
    for p in setup.parallelisms:
        n = dims.degree(p.dim)
        if n == 1:
            continue
        sized = SIZERS[p.name](shape, setup, stage)
        declared = [(t.op, t.moves) for t in p.traffic if t not in norm_dims]
        if list(sized) != declared:  # a sizer for every declared collective, and for nothing else
            raise AssertionError(f"{p.name}: sized {list(sized)}, declared {declared}")
        for t in p.traffic:
            if t in norm_dims:
                norm_dims[t].append(p.dim)
                continue
            size = sized[(t.op, t.moves)]
            if not size.calls:  # declared, but not issued by this model (tp's per-head norms without any)
                continue
            op = t.paper_op if t.paper_op and not deepspeed else t.op
            out.append(Collective(op, size.bytes, size.what, size.elem, dim=p.dim,
                                  group_size=2 if op in ("send", "recv") else n, calls=size.calls,
                                  overlaps=t.overlaps, moves=t.moves))
    for norm, over in norm_dims.items():
        if over:
            size = _gradient_norm(shape, setup) if norm is GRADIENT_NORM else _expert_norm(shape)
            out.append(Collective("all_reduce", size.bytes, size.what, size.elem,
                                  dim=over[0] if len(over) == 1 else "",
                                  group_size=math.prod(dims.degree(d) for d in over), calls=size.calls,
                                  overlaps=norm.overlaps, moves=norm.moves))
    return out


def _gradient_norm(shape: ModelShape, setup: Setup) -> Sized:
    """The global gradient norm's all-reduce (measured): DTensor's (fsdp, hsdp, tp, fsdp_tp) reduces each gradient
    tensor's partial norm, one fp32 value per parameter tensor; a pipeline sums its stages' squared norms, one fp32
    value; DeepSpeed ZeRO-1/2 one fp32 value; ZeRO-3 one fp64 value per sub-group, each its own all-reduce (two at
    Llama-2-70B on 64 ranks: 1.08e9 elements a rank, sub-groups of 1e9)."""
    if setup.family == "zero" and setup.zero_stage >= 3:
        groups = _zero3_sub_groups(shape, setup)
        return Sized(groups * 8, f"the global gradient norm: one fp64 value per sub-group ({groups})", 8, groups)
    if setup.family in ("pipeline", "zero"):
        values = 1
    else:
        values = sum(len(module) for module in shape.module_shapes()) - _expert_tensors(shape, setup)
    return Sized(values * 4, f"the global gradient norm: {values} fp32 value(s)", 4, 1)


def _expert_tensors(shape: ModelShape, setup: Setup) -> int:
    """Under expert parallelism, the experts' gradient tensors (gate_up_proj and down_proj of each MoE layer), whose
    norm is reduced on the experts' own mesh; 0 otherwise."""
    return _num_expert_tensors(shape) if setup.ep > 1 else 0


def _zero3_sub_groups(shape: ModelShape, setup: Setup) -> int:
    """DeepSpeed ZeRO-3's sub-groups (stage3.py `_create_fp16_sub_groups`): the parameters' partitions, in order,
    closed into a sub-group once it holds sub_group_size elements; one all-reduce of the norm per sub-group."""
    n = setup.dims.dp_shard
    sizes = [math.ceil(p / n) for module in shape.module_params() for p in module]
    if setup.zero3_sub_group_size >= sum(sizes):
        return 1
    groups, held = 0, 0
    for i, size in enumerate(sizes):
        held += size
        if held >= setup.zero3_sub_group_size or i == len(sizes) - 1:
            groups, held = groups + 1, 0
    return groups


@dataclass(frozen=True)
class Sized:
    """A declared collective's bytes per step (all calls), in words, its element size and its calls per step."""

    bytes: float
    what: str
    elem: int
    calls: int


Sizes = dict[tuple[str, str], Sized]  # keyed by the declaration's (op, moves)


def _replicate(shape: ModelShape, setup: Setup, stage: Optional[int]) -> Sizes:
    """DDP's gradient all-reduce; a pipeline stage's replicas (its fp32 gradients, torch's default 25 MiB buckets);
    HSDP's replicas (each rank's fp32 gradient shard, as often as the reduce-scatter inside the replica runs);
    ddp_tp's (FSDP2's replicate: each block's, then the root's, fp32 gradients of the TP slice, once a step)."""
    key = ("all_reduce", "gradients")
    if stage is not None:
        params = _stage_params(shape, setup, stage)
        return {key: Sized(params * 4, "the stage's fp32 gradients over its replicas, once per step", 4,
                           buckets(params * 4, DDP_BUCKET_BYTES))}
    dims = setup.dims
    if setup.shard_with == "fsdp":
        reduces = setup.microbatches_per_step if setup.reduce_every_microbatch else 1
        return {key: Sized(reduces * shape.num_params * 4 / dims.dp_shard,
                           f"fp32 gradient shards across the {dims.dp_replicate} replicas", 4,
                           reduces * (shape.num_layers + 1))}
    if setup.family == "fsdp_tp":  # ddp_tp; and ep, whose experts expert_replicate reduces
        if setup.ep > 1:
            params, what = dense_rank_params(shape, setup), "the dense weights'"
        else:
            params, what = tp_rank_params(shape, setup), "the TP slice's"
        return {key: Sized(params * 4, f"{what} fp32 gradients, once per step", 4, shape.num_layers + 1)}
    grads = _moved_bytes(setup).grads
    size = shape.num_params * grads
    return {key: Sized(size, "gradients, once per step (no_sync while accumulating)", int(grads),
                       buckets(size, setup.bucket_cap_mb * 2**20))}


def _fsdp(shape: ModelShape, setup: Setup, stage: Optional[int]) -> Sizes:
    """FSDP2 per block, then the root. Each block is gathered in forward and, when resharded after it, again in
    backward; the root (embeddings, final norm, head) is gathered once per micro-batch and kept for backward (FSDP2's
    default for the root). Gradients are reduce-scattered once per step, or after every micro-batch
    (reduce_every_microbatch). Under tensor parallelism it shards what a TP rank holds."""
    if stage is not None:
        return _stage_fsdp(shape, setup, stage)
    m = setup.microbatches_per_step
    t = setup.tensor_parallel_size
    block_params = shape.num_layers * (shape.layer_params_tp(t) if t > 1 else shape.layer_params())
    num_params = tp_rank_params(shape, setup) if t > 1 else shape.num_params
    if t > 1 and setup.ep > 1:  # the experts are expert_fsdp's
        block_params -= shape.num_layers * shape.expert_params
        num_params = dense_rank_params(shape, setup)
    if t == 1:  # FSDP2's units as it all-gathers and reduce-scatters them: padded where dim 0 does not divide
        n = setup.dims.dp_shard
        dense = [d for d in shape.param_shapes() if not (setup.ep > 1 and shape.is_experts(d))]  # expert_fsdp's
        layer = [d for module in shape.layer_modules() for d in module if not (setup.ep > 1 and shape.is_experts(d))]
        block_params = shape.num_layers * sum(fsdp_padded(d, n) for d in layer)
        num_params = sum(fsdp_padded(d, n) for d in dense)
    block_gathers = m * (2 if setup.reshard_after_forward else 1)
    compute = element_bytes(setup.precision)  # MixedPrecisionPolicy(param_dtype) gathers in the compute dtype
    gathered = (block_gathers * block_params + m * (num_params - block_params)) * compute
    reduces = m if setup.reduce_every_microbatch else 1
    when = f"every micro-batch ({m})" if reduces > 1 else "once per step"
    return {
        ("all_gather", "parameters"): Sized(gathered, f"parameters: blocks {block_gathers}x, root {m}x per step",
                                            compute, block_gathers * shape.num_layers + m),
        ("reduce_scatter", "gradients"): Sized(reduces * num_params * 4, f"fp32 gradients (reduce_dtype), {when}", 4,
                                               reduces * (shape.num_layers + 1)),
    }


def _ep(shape: ModelShape, setup: Setup, stage: Optional[int]) -> Sizes:
    """Expert parallelism's dispatch (parallel/experts.py), per MoE layer and micro-batch, at balanced routing: the
    counts (E int64), the T x k routed rows of h there and back, each mirrored in backward, and under checkpointing
    the forward's three again (full and selective alike recompute the dispatch: measured on 2 ranks): 4 T k h
    elements a layer and micro-batch, 6 with checkpointing (torchtitan's formula), T the rank's share of the tokens
    under tensor parallelism. What a rank sends depends on its routing; over an EP group the sum is exact. (The
    experts' gradient norm is _rank's, over ep and efsdp together.)"""
    m, layers, k = setup.microbatches_per_step, shape.num_layers, shape.experts_per_token
    tokens = setup.micro_batch_size * setup.seq_len / setup.tensor_parallel_size  # a TP rank sends its share
    rows = tokens * k * shape.hidden_size * element_bytes(setup.precision)
    counts = 8 * shape.num_experts
    recomputed = setup.checkpointed_layers(layers)  # their forward's exchanges run again

    def per_layer(forwards: int) -> tuple[int, int]:  # (bytes, exchanges) of one layer and micro-batch
        return forwards * (counts + 2 * rows) + 2 * rows, 3 * forwards + 2

    (again, again_calls), (once, once_calls) = per_layer(2), per_layer(1)
    total = m * (recomputed * again + (layers - recomputed) * once)
    calls = m * (recomputed * again_calls + (layers - recomputed) * once_calls)
    return {
        ("all_to_all", "tokens"): Sized(total, f"routed rows: {calls / (m * layers):g} exchanges a "
                                        "layer and micro-batch (counts, rows there and back, both ways in backward)",
                                        element_bytes(setup.precision), calls),
    }


def _expert_shares(shape: ModelShape, setup: Setup, stage: Optional[int]) -> Sizes:
    """Tensor parallelism beside expert parallelism, per MoE layer and micro-batch: the TP ranks' shares of the
    experts' outputs all-gathered (T x h), and in backward the shares' input gradients (T x h) and routing weights'
    (T x k), all in the compute dtype (the MoE block's input is: measured, bf16 under tp's autocast and fsdp_tp's
    mixed precision alike). A checkpointed block's recomputation does not gather them again: it stops at the block's
    last saved tensor, inside the dispatch (its all-to-alls run again, `_ep`)."""
    m, layers = setup.microbatches_per_step, shape.num_layers
    tokens = setup.micro_batch_size * setup.seq_len
    compute = element_bytes(setup.precision)
    once = (2 * tokens * shape.hidden_size + tokens * shape.experts_per_token) * compute
    return {("all_gather", "expert outputs"): Sized(m * layers * once,
                                                    "the experts' outputs forward, their input and routing weights' "
                                                    "gradients backward, over tp", compute, m * 3 * layers)}


def _expert_fsdp(shape: ModelShape, setup: Setup, stage: Optional[int]) -> Sizes:
    """FSDP2 of each MoE layer's E / ep experts over efsdp: gathered in forward and, resharded, again in backward,
    in the compute dtype; their fp32 gradients reduce-scattered once a step, or after every micro-batch
    (reduce_every_microbatch, with the dense ones)."""
    m, layers = setup.microbatches_per_step, shape.num_layers
    # strategy=tp holds no synchronisation back: FSDP2 of the experts reduce-scatters after every micro-batch
    reduces = m if setup.reduce_every_microbatch or setup.family == "tp" else 1
    efsdp = setup.dims.degree("efsdp")
    local = sum(expert_padded(d, setup.ep, efsdp) for module in shape.layer_modules() for d in module
                if shape.is_experts(d))
    gathers = m * (2 if setup.reshard_after_forward else 1)
    compute = element_bytes(setup.precision)
    return {
        ("all_gather", "expert parameters"): Sized(gathers * layers * local * compute,
                                                   f"each layer's E/ep experts, {gathers}x per step", compute,
                                                   gathers * layers),
        ("reduce_scatter", "expert gradients"): Sized(reduces * layers * local * 4,
                                                      "their fp32 gradients, " + (f"every micro-batch ({m})"
                                                                                  if reduces > 1 else "once per step"),
                                                      4, reduces * layers),
    }


@dataclass(frozen=True)
class ExpertCrossover:
    """Per rank and step, buffer bytes (telemetry's convention): expert parallelism's all-to-alls against FSDP
    gathering every expert instead (strategy=fsdp: gathered in forward and again in backward, their fp32 gradients
    reduce-scattered once a step), and the tokens per rank and micro-batch below which the all-to-alls move less."""

    ep_bytes: float
    gather_bytes: float
    crossover_tokens: float

    def line(self, tokens: int) -> str:
        side = "fewer" if self.ep_bytes < self.gather_bytes else "more"
        return (f"experts: the all-to-alls move {human_bytes(self.ep_bytes)} a step per rank, {side} than FSDP gathering "
                f"every expert ({human_bytes(self.gather_bytes)}); expert parallelism moves fewer bytes below "
                f"{self.crossover_tokens:,.0f} tokens per rank and micro-batch (this run: {tokens:,})")


def _expert_replicate(shape: ModelShape, setup: Setup, stage: Optional[int]) -> Sizes:
    """FSDP2's replicate of each MoE layer's E / ep experts over edp (ep): their fp32 gradients all-reduced once a
    step, one call per layer."""
    return {("all_reduce", "expert gradients"): Sized(expert_rank_elements(shape, setup) * 4,
                                                      "each layer's E/ep experts' fp32 gradients, once per step", 4,
                                                      shape.num_layers)}


def expert_crossover(shape: ModelShape, setup: Setup) -> Optional[ExpertCrossover]:
    """The EP-versus-FSDP trade of an MoE model at this run's batch (None for a dense model). Per MoE layer and
    micro-batch of T tokens on a rank: EP sends 4 T k h elements (6 under checkpointing) of the compute dtype;
    FSDP gathers the layer's E experts twice in it (once with reshard_after_forward=false) and reduce-scatters their
    fp32 gradients once a step, so EP moves less while T < (gathers x E P e + E P 4 / m) / (4|6 k h e)."""
    if not shape.num_experts:
        return None
    m, layers, k, h = setup.microbatches_per_step, shape.num_layers, shape.experts_per_token, shape.hidden_size
    e = element_bytes(setup.precision)
    tokens = setup.micro_batch_size * setup.seq_len
    sends = 4 + 2 * setup.checkpointed_layers(layers) / max(layers, 1)  # 6 where every layer is recomputed
    experts = shape.expert_params
    gathers = 2 if setup.reshard_after_forward else 1
    ep = m * layers * sends * tokens * k * h * e
    gather = layers * (m * gathers * experts * e + experts * 4)
    crossover = (gathers * experts * e + experts * 4 / m) / (sends * k * h * e)
    return ExpertCrossover(ep, gather, crossover)


def _num_expert_tensors(shape: ModelShape) -> int:
    """gate_up_proj and down_proj of each MoE layer."""
    return sum(shape.is_experts(d) for d in shape.param_shapes())


def _expert_norm(shape: ModelShape) -> Sized:
    values = _num_expert_tensors(shape)
    return Sized(values * 4, f"the experts' gradient norm: {values} fp32 values", 4, 1)


def _stage_fsdp(shape: ModelShape, setup: Setup, stage: int) -> Sizes:
    """A pipeline stage's FSDP-sharded replicas (strategy=pp_dp, dp_mode=fsdp), reduced once per step after the last
    micro-batch's backward. Parameters stay fp32 (the stage computes under autocast, as a plain pipeline does), so
    all traffic is fp32. FSDP2 inside a schedule (measured, GPipe and 1F1B alike): a block is gathered for each
    micro-batch's forward and once more at the first backward, then kept until the step's last backward (the
    schedule turns off resharding after backward until then): m + 1 gathers; the stage's root is not resharded
    after forward (FSDP2's root default): 1 gather."""
    k, m = setup.num_stages, setup.microbatches_per_step
    params = _stage_params(shape, setup, stage)
    layers = stage_layers(shape, num_stages=k, split_points=_split(setup))[stage]
    blocks = layers * shape.layer_params()
    return {
        ("all_gather", "parameters"): Sized(((m + 1) * blocks + (params - blocks)) * 4,
                                            f"the stage's parameters: blocks {m + 1}x, root 1x per step", 4,
                                            (m + 1) * layers + 1),
        ("reduce_scatter", "gradients"): Sized(params * 4, "the stage's fp32 gradients, once per step", 4, layers + 1),
    }


def _zero12(shape: ModelShape, setup: Setup, stage: Optional[int]) -> Sizes:
    """ZeRO-1 and 2: gradients reduced (once per step at stage 1, every micro-batch at stage 2), then the updated
    partitions gathered. The paper reduce-scatters them (Ψ of ring traffic); DeepSpeed 0.19's stage 1/2 all-reduces
    each gradient bucket and keeps its own partition (use_multi_rank_bucket_allreduce=True by default): 2Ψ."""
    setup = with_model(shape, setup)  # the reduction bucket as the training code sizes it (unless the run sets it)
    num_params, b = shape.num_params, _moved_bytes(setup)
    reduces = setup.microbatches_per_step if setup.zero_stage == 2 else 1
    return {
        ("all_reduce", "gradients"): Sized(reduces * num_params * b.grads, f"gradients, {reduces}x per step",
                                           int(b.grads), reduces * buckets(num_params, setup.zero_reduce_bucket_size)),
        ("all_gather", "parameters"): Sized(num_params * b.weights, "updated parameters after the step", int(b.weights),
                                            buckets(num_params, DS_ALLGATHER_BUCKET_SIZE)),
    }


def _zero3(shape: ModelShape, setup: Setup, stage: Optional[int]) -> Sizes:
    """The paper gathers every parameter in forward and again in backward. DeepSpeed keeps a parameter gathered when
    its backward use is within stage3_max_reuse_distance: for partitioned parameters of at most that many elements,
    one gather per micro-batch (measured: tiny model, 2 gathers per 2 micro-batches). For a larger model the blocks
    near the forward/backward turn are reused too; 2x is an upper bound. Parameters under
    stage3_param_persistence_threshold stay whole on every rank: never gathered."""
    setup = with_model(shape, setup)  # the reduction bucket as the training code sizes it (unless the run sets it)
    m, b = setup.microbatches_per_step, _moved_bytes(setup)
    partitioned, modules = zero3_partitioned(shape, setup)
    reused = setup.resolved_regime == "deepspeed" and zero3_keeps_for_backward(setup, partitioned)
    gathers = m if reused else 2 * m
    when = "forward only (kept until backward: stage3_max_reuse_distance)" if reused else "forward + backward"
    return {
        ("all_gather", "parameters"): Sized(gathers * partitioned * b.weights,
                                            f"parameters, {when}, {m} micro-batch(es)", int(b.weights),
                                            gathers * modules),
        ("reduce_scatter", "gradients"): Sized(m * shape.num_params * b.grads, f"gradients, every micro-batch ({m})",
                                               int(b.grads),
                                               m * buckets(shape.num_params, setup.zero_reduce_bucket_size)),
    }


def _tokens(shape: ModelShape, setup: Setup) -> tuple[int, int, int]:
    """Elements of one s x b x h activation, the compute dtype's bytes, and the bytes of a gradient (fp32 under
    torch autocast: the cast to 16 bits sits after the split; FSDP2's mixed precision (fsdp_tp) computes backward
    in the compute dtype throughout: measured, bf16 on 4 ranks)."""
    compute = element_bytes(setup.precision)
    grad = 4 if setup.resolved_regime == "autocast" and setup.autocast_16bit else compute
    return setup.seq_len * setup.micro_batch_size * shape.hidden_size, compute, grad


def _vocabulary(shape: ModelShape, setup: Setup) -> Sized:
    """The vocabulary split, per micro-batch: the embedding's looked-up rows (forward, the parameters' dtype), the
    head's input gradient (backward), and loss_parallel's fp32 max, sum of exponentials and target logit per token."""
    m = setup.microbatches_per_step
    tokens, _, grad = _tokens(shape, setup)
    return Sized(m * (2 * tokens * grad + 3 * setup.seq_len * setup.micro_batch_size * 4),
                 f"vocabulary split: embedding rows, head input gradient, 3 loss reductions, {m} micro-batch(es)",
                 grad, 5 * m)


def _tensor_parallel(shape: ModelShape, setup: Setup, stage: Optional[int]) -> Sizes:
    """Megatron's per-layer all-reduces of an s x b x h activation, per micro-batch: forward, the output of each
    row-parallel projection (attention out, MLP out), in the compute dtype; backward, the input gradient of each
    column-parallel projection, in fp32 under autocast. torch's ColwiseParallel reduces each projection's input
    gradient on its own: Llama's q, k, v, gate and up are 5 all-reduces, GPT-2's fused c_attn and c_fc 2."""
    m, layers = setup.microbatches_per_step, shape.num_layers
    tokens, compute, grad = _tokens(shape, setup)
    backward, forward = shape.features.column_projections, 2
    if shape.num_experts:  # an MoE layer's MLP is its experts, which expert parallelism splits: attention's only
        backward, forward = 1 if shape.features.fused_qkv else 3, 1
    # full checkpointing recomputes a block's forward up to its last saved tensor: attention's output all-reduce
    # again, not the MLP's, whose result nothing saves (measured, GPT-2 and Qwen3-MoE on 2 ranks); selective keeps both
    again = m * setup.checkpointed_layers(layers) if setup.activation_checkpointing == "full" else 0
    return {
        ("all_reduce", "activations"): Sized(m * layers * (forward * tokens * compute + backward * tokens * grad)
                                             + again * tokens * compute,
                                             f"activations: {forward} forward + {backward} backward per layer, "
                                             f"{m} micro-batch(es), {again} recomputed", compute,
                                             m * layers * (forward + backward) + again),
        ("all_reduce", "vocabulary"): _vocabulary(shape, setup),
        ("all_reduce", "norm gradients"): _head_norms(shape, setup),
    }


def _head_norms(shape: ModelShape, setup: Setup) -> Sized:
    """The per-head q/k norms' weight gradients (Qwen3's), each partial over the TP ranks' heads and all-reduced in
    backward (tensor_parallel.HeadNorm), per layer and micro-batch, in fp32 (measured: also under fsdp_tp's bf16
    mixed precision, on 4 ranks); nothing for a model without them. Sequence parallelism's too."""
    m, tensors = setup.microbatches_per_step, 2 * shape.num_layers * bool(shape.qk_norm)
    return Sized(m * tensors * shape.head_dim * 4, f"{tensors} per-head norm weight gradients, {m} micro-batch(es)",
                 4, m * tensors)


def _sequence_parallel(shape: ModelShape, setup: Setup, stage: Optional[int]) -> Sizes:
    """Megatron's sequence parallelism, per layer and micro-batch: the all-reduces become all-gathers of the norms'
    outputs (fp32 under autocast: `wide`) before attention and the MLP, and reduce-scatters of the row-parallel
    outputs (compute dtype); backward mirrors them (the column-parallel input gradients are summed locally, then
    reduce-scattered once). Per micro-batch also: the first block's input gradient and the final norm's output are
    all-gathered. Every norm weight's gradient (partial over the sequence shards; the micro-batches sum into it
    unreduced) is all-reduced once a step, fp32: by FSDP2's reduction under fsdp_tp and ddp_tp, before the gradient
    norm under strategy=tp (strategies/base.py reduce_partial_grads). Measured: tiny, one call per norm tensor a step
    whatever the micro-batches (1 to 8 on 2 ranks, 2 on 2 x 2)."""
    m, layers, h = setup.microbatches_per_step, shape.num_layers, shape.hidden_size
    tokens, compute, wide = _tokens(shape, setup)
    # norm parameter tensors: GPT-2 LayerNorm weight + bias (2 per block, ln_f), Llama RMSNorm weight
    norm_grads = shape.features.norm_params_per_unit * (2 * layers + 1)
    heads = _head_norms(shape, setup)
    return {
        ("all_gather", "activations"): Sized(m * (layers * 2 * tokens * (wide + compute) + 2 * tokens * wide),
                                             f"activations: 2 forward + 2 backward per layer, entry and exit, "
                                             f"{m} micro-batch(es)", compute, m * (4 * layers + 2)),
        ("reduce_scatter", "activations"): Sized(m * layers * 2 * tokens * (compute + wide),
                                                 f"activations: 2 forward + 2 backward per layer, {m} micro-batch(es)",
                                                 compute, m * 4 * layers),
        ("all_reduce", "norm gradients"): Sized(norm_grads * h * 4 + heads.bytes,
                                                f"{norm_grads} norm weight gradients, once a step; " + heads.what, 4,
                                                norm_grads + heads.calls),
        ("all_reduce", "vocabulary"): _vocabulary(shape, setup),
    }


def _pipeline(shape: ModelShape, setup: Setup, stage: Optional[int]) -> Sizes:
    """One activation (s x b x h) forward and its gradient backward per micro-batch across each stage boundary."""
    if stage is None:
        raise ValueError("a pipeline's traffic is a stage's")
    k, m = setup.num_stages, setup.microbatches_per_step
    # Under autocast the residual stream between blocks stays fp32; otherwise it has the training dtype.
    elem = 4 if setup.resolved_regime == "autocast" else element_bytes(setup.precision)
    boundary = setup.seq_len * setup.micro_batch_size * shape.hidden_size * elem
    sends = (stage < k - 1) + (stage > 0)  # activations forward, gradients backward
    what = f"{sends} boundary tensor(s) x {m} micro-batch(es)"
    return {(op, "boundary"): Sized(sends * m * boundary, what, elem, sends * m) for op in ("send", "recv")}


# One sizer per parallelism of parallel/catalog.py: the bytes of each collective it declares.
SIZERS: dict[str, Callable[[ModelShape, Setup, Optional[int]], Sizes]] = {
    "replicate": _replicate, "fsdp": _fsdp, "zero1": _zero12, "zero2": _zero12, "zero3": _zero3,
    "tp": _tensor_parallel, "sequence_parallel": _sequence_parallel, "pipeline": _pipeline,
    "ep": _ep, "expert_shares": _expert_shares, "expert_fsdp": _expert_fsdp, "expert_replicate": _expert_replicate,
}


def _moved_bytes(setup: Setup) -> Any:
    """Bytes per parameter of the weights and gradients, which are what travel (the optimizer's state stays put)."""
    return state_bytes(precision=setup.precision, optimizer=setup.optimizer, momentum=setup.momentum,
                       regime=setup.resolved_regime, optimizer_per_param=0.0)


def _split(setup: Setup) -> Optional[list[int]]:
    return list(setup.split_points) if setup.split_points else None


def _stage_params(shape: ModelShape, setup: Setup, stage: int) -> int:
    return stage_params(shape, num_stages=setup.num_stages, split_points=_split(setup))[stage]


def ring_bytes(collectives: list[Collective], *, group_size: int) -> float:
    return sum(c.ring_bytes(group_size) for c in collectives)


def ring_volume_psi(collectives: list[Collective], *, group_size: int, num_params: float) -> float:
    """Elements each rank sends per step in units of Ψ (the ZeRO paper's 2Ψ / 3Ψ, x (N-1)/N)."""
    return sum(c.ring_elements(group_size) for c in collectives) / num_params
