"""Communication per optimizer step of each strategy, per rank.

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
from dataclasses import dataclass, replace

from dist_train.estimate.memory import (element_bytes, state_bytes, tp_rank_params, zero3_keeps_for_backward,
                                        zero3_partitioned)
from dist_train.estimate.setup import Setup
from dist_train.estimate.shapes import ModelShape, stage_layers, stage_params

# Buckets that set how many calls carry the bytes: DDP's bucket_cap_mb where a strategy does not set it (torch's
# default, 25 MiB: pp_dp's replicated stages; strategy=ddp's is Setup.bucket_cap_mb), DeepSpeed ZeRO-1/2's
# allgather_bucket_size (elements, its default). ZeRO's reduce bucket is Setup.zero_reduce_bucket_size, ZeRO-3's
# reuse distance (whether backward gathers again) Setup.zero3_max_reuse_distance, as the memory model reads them.
DDP_BUCKET_BYTES = 25 * 2**20
DS_ALLGATHER_BUCKET_SIZE = 5 * 10**8


def buckets(size: float, bucket: float) -> int:
    """Calls that carry `size` in buckets of at most `bucket` (the same unit)."""
    return max(1, math.ceil(size / bucket))


def bus_factor(op: str, group_size: int) -> float:
    """Bytes a rank sends per buffer byte: nccl-tests' bus factor (as telemetry.bandwidth.busbw_factor, without
    importing torch), except that a recv sends nothing (its bytes are the peer's send)."""
    n = group_size
    if op in ("all_reduce", "all_gather", "reduce_scatter"):
        if n <= 1:
            return 0.0
        return 2 * (n - 1) / n if op == "all_reduce" else (n - 1) / n
    return 0.0 if op == "recv" else 1.0


@dataclass(frozen=True)
class Collective:
    op: str  # all_reduce | all_gather | reduce_scatter | send | recv
    bytes: float  # buffer bytes per step, all calls together
    what: str
    elem: int = 4  # bytes per element moved
    dim: str = ""  # the mesh dimension it runs over (fsdp_tp: tp or dp_shard); "" = the strategy's one group
    group_size: int = 0  # ranks in that group; 0 = the group size the caller passes
    calls: int = 1  # separate calls per step (buckets, one per block, ...): what latency costs (estimate/step_time.py)

    def ring_bytes(self, group_size: int) -> float:
        return self.bytes * bus_factor(self.op, self.group_size or group_size)

    def ring_elements(self, group_size: int) -> float:
        """Elements each rank sends: the ZeRO paper's unit (2Ψ, 3Ψ)."""
        return self.ring_bytes(group_size) / self.elem


def predict_comm(shape: ModelShape, setup: Setup) -> list[list[Collective]]:
    """For every rank, the collectives of one optimizer step."""
    if setup.family == "pipeline":
        stages = [_pipeline(shape, setup, stage=k) for k in range(setup.num_stages)]
        return [stages[rank // setup.data_parallel_size] for rank in range(setup.world_size)]
    if setup.family == "tp":
        return [_tensor_parallel(shape, setup)] * setup.world_size
    if setup.family == "fsdp_tp":
        tp = [replace(c, dim="tp", group_size=setup.tp) for c in _tensor_parallel(shape, setup)]
        # FSDP2 over the dp dimension, of what each TP rank holds (blocks split by tp, the rest whole)
        fsdp = _fsdp(shape, setup, block_params=shape.num_layers * shape.layer_params_tp(setup.tp),
                     num_params=tp_rank_params(shape, setup))
        return [tp + [replace(c, dim="dp_shard", group_size=setup.data_parallel_size) for c in fsdp]] * setup.world_size
    return [_data_parallel(shape, setup)] * setup.world_size


def _data_parallel(shape: ModelShape, setup: Setup) -> list[Collective]:
    num_params = shape.num_params
    n, m = setup.data_parallel_size, setup.microbatches_per_step
    if n == 1 or setup.family in ("single", "dp"):
        return []
    b = state_bytes(  # weights and gradients are what travel; the optimizer's state stays put
        precision=setup.precision, optimizer=setup.optimizer, momentum=setup.momentum, regime=setup.resolved_regime,
        optimizer_per_param=0.0,
    )
    if setup.kind == "ddp":
        return [Collective("all_reduce", num_params * b.grads, "gradients, once per step (no_sync while accumulating)",
                           int(b.grads), calls=buckets(num_params * b.grads, setup.bucket_cap_mb * 2**20))]
    if setup.kind == "fsdp":
        fsdp = _fsdp(shape, setup, block_params=shape.num_layers * shape.layer_params(), num_params=num_params)
        return fsdp if setup.dims.dp_replicate == 1 else _hybrid(fsdp, shape, setup, num_params=num_params)
    stage = setup.zero_stage
    if stage >= 3:
        # The paper gathers every parameter in forward and again in backward. DeepSpeed keeps a parameter
        # gathered when its backward use is within stage3_max_reuse_distance: for partitioned parameters of at
        # most that many elements, one gather per micro-batch (measured: tiny model, 2 gathers per 2
        # micro-batches). For a larger model the blocks near the forward/backward turn are reused too; 2x is an
        # upper bound. Parameters under stage3_param_persistence_threshold stay whole on every rank: never gathered.
        partitioned, modules = zero3_partitioned(shape, setup)
        reused = setup.resolved_regime == "deepspeed" and zero3_keeps_for_backward(setup, partitioned)
        gathers = m if reused else 2 * m
        when = "forward only (kept until backward: stage3_max_reuse_distance)" if reused else "forward + backward"
        return [
            Collective("all_gather", gathers * partitioned * b.weights,
                       f"parameters, {when}, {m} micro-batch(es)", int(b.weights), calls=gathers * modules),
            Collective("reduce_scatter", m * num_params * b.grads, f"gradients, every micro-batch ({m})", int(b.grads),
                       calls=m * buckets(num_params, setup.zero_reduce_bucket_size)),
        ]
    reduces = m if stage == 2 else 1
    # The paper reduce-scatters gradients (Ψ of ring traffic); DeepSpeed 0.19's stage 1/2 all-reduces each
    # gradient bucket and keeps its own partition (use_multi_rank_bucket_allreduce=True by default): 2Ψ.
    op = "all_reduce" if setup.resolved_regime == "deepspeed" else "reduce_scatter"
    return [
        Collective(op, reduces * num_params * b.grads, f"gradients, {reduces}x per step", int(b.grads),
                   calls=reduces * buckets(num_params, setup.zero_reduce_bucket_size)),
        Collective("all_gather", num_params * b.weights, "updated parameters after the step", int(b.weights),
                   calls=buckets(num_params, DS_ALLGATHER_BUCKET_SIZE)),
    ]


def _fsdp(shape: ModelShape, setup: Setup, *, block_params: float, num_params: float) -> list[Collective]:
    """FSDP2 per block, then the root, of `num_params` parameters of which `block_params` are in blocks.

    Each block is gathered in forward and, when resharded after it, again in backward; the root (embeddings,
    final norm, head) is gathered once per micro-batch and kept for backward (FSDP2's default for the root).
    Gradients are reduce-scattered once per step, or after every micro-batch (reduce_every_microbatch)."""
    m = setup.microbatches_per_step
    block_gathers = m * (2 if setup.reshard_after_forward else 1)
    compute = element_bytes(setup.precision)  # MixedPrecisionPolicy(param_dtype) gathers in the compute dtype
    gathered = (block_gathers * block_params + m * (num_params - block_params)) * compute
    reduces = m if setup.reduce_every_microbatch else 1
    when = f"every micro-batch ({m})" if reduces > 1 else "once per step"
    return [
        Collective("all_gather", gathered, f"parameters: blocks {block_gathers}x, root {m}x per step", compute,
                   calls=block_gathers * shape.num_layers + m),
        Collective("reduce_scatter", reduces * num_params * 4, f"fp32 gradients (reduce_dtype), {when}", 4,
                   calls=reduces * (shape.num_layers + 1)),
    ]


def _hybrid(fsdp: list[Collective], shape: ModelShape, setup: Setup, *, num_params: float) -> list[Collective]:
    """HSDP: FSDP's gathers and reduce-scatters within a replica (dp_shard), then each gradient shard all-reduced
    across the replicas (dp_replicate), as often as the reduce-scatter runs."""
    dims = setup.dims
    reduces = setup.microbatches_per_step if setup.reduce_every_microbatch else 1
    inside = [replace(c, dim="dp_shard", group_size=dims.dp_shard) for c in fsdp]
    across = Collective("all_reduce", reduces * num_params * 4 / dims.dp_shard,
                        f"fp32 gradient shards across the {dims.dp_replicate} replicas", 4,
                        dim="dp_replicate", group_size=dims.dp_replicate, calls=reduces * (shape.num_layers + 1))
    return [*inside, across]


def _pipeline(shape: ModelShape, setup: Setup, *, stage: int) -> list[Collective]:
    k, m = setup.num_stages, setup.microbatches_per_step
    # Under autocast the residual stream between blocks stays fp32; otherwise it has the training dtype.
    elem = 4 if setup.resolved_regime == "autocast" else element_bytes(setup.precision)
    boundary = setup.seq_len * setup.micro_batch_size * shape.hidden_size * elem
    sends = (stage < k - 1) + (stage > 0)  # activations forward, gradients backward
    d = setup.data_parallel_size
    dim = "pp" if d > 1 else ""
    out = [
        Collective("send", sends * m * boundary, f"{sends} boundary tensor(s) x {m} micro-batch(es)", elem, dim=dim,
                   calls=sends * m),
        Collective("recv", sends * m * boundary, f"{sends} boundary tensor(s) x {m} micro-batch(es)", elem, dim=dim,
                   calls=sends * m),
    ]
    if d > 1:
        dp_dim = "dp_shard" if setup.dp_mode == "fsdp" else "dp_replicate"
        out += [replace(c, dim=dp_dim, group_size=d) for c in _stage_data_parallel(shape, setup, stage=stage)]
    return out


def _stage_data_parallel(shape: ModelShape, setup: Setup, *, stage: int) -> list[Collective]:
    """A stage's replicas (strategy=pp_dp), reduced once per step after the last micro-batch's backward.

    Parameters stay fp32 (the stage computes under autocast, as a plain pipeline does), so all traffic is
    fp32. FSDP2 inside a schedule (measured, GPipe and 1F1B alike): a block is gathered for each micro-batch's
    forward and once more at the first backward, then kept until the step's last backward (the schedule turns
    off resharding after backward until then): m + 1 gathers; the stage's root is not resharded after forward
    (FSDP2's root default): 1 gather."""
    k, m = setup.num_stages, setup.microbatches_per_step
    split = list(setup.split_points) if setup.split_points else None
    params = stage_params(shape, num_stages=k, split_points=split)[stage]
    if setup.dp_mode == "replicate":
        return [Collective("all_reduce", params * 4, "the stage's fp32 gradients over its replicas, once per step", 4,
                           calls=buckets(params * 4, DDP_BUCKET_BYTES))]
    layers = stage_layers(shape, num_stages=k, split_points=split)[stage]
    blocks = layers * shape.layer_params()
    return [
        Collective("all_gather", ((m + 1) * blocks + (params - blocks)) * 4,
                   f"the stage's parameters: blocks {m + 1}x, root 1x per step", 4, calls=(m + 1) * layers + 1),
        Collective("reduce_scatter", params * 4, "the stage's fp32 gradients, once per step", 4, calls=layers + 1),
    ]


def _tensor_parallel(shape: ModelShape, setup: Setup) -> list[Collective]:
    """Megatron's per-layer all-reduces of an s x b x h activation, per micro-batch: forward, the output of
    each row-parallel projection (attention out, MLP out), in the compute dtype; backward, the input gradient
    of each column-parallel projection, in fp32 under autocast (the cast to 16 bits sits after the split).
    torch's ColwiseParallel reduces each projection's input gradient on its own: Llama's q, k, v, gate and up
    are 5 all-reduces, GPT-2's fused c_attn and c_fc 2."""
    if setup.tensor_parallel_size == 1:
        return []
    m, layers = setup.microbatches_per_step, shape.num_layers
    tokens = setup.seq_len * setup.micro_batch_size * shape.hidden_size
    compute = element_bytes(setup.precision)
    grad = 4 if setup.resolved_regime == "autocast" else compute
    # The vocabulary split, per micro-batch: the embedding's looked-up rows (forward, the parameters' dtype), the
    # head's input gradient (backward), and loss_parallel's fp32 max, sum of exponentials and target logit per token
    vocab = Collective("all_reduce", m * (2 * tokens * grad + 3 * setup.seq_len * setup.micro_batch_size * 4),
                       f"vocabulary split: embedding rows, head input gradient, 3 loss reductions, {m} micro-batch(es)",
                       grad, calls=5 * m)
    if setup.sequence_parallel:
        return [*_sequence_parallel(shape, setup, tokens=tokens, compute=compute, wide=grad), vocab]
    backward = shape.features.column_projections
    return [
        Collective("all_reduce", m * layers * (2 * tokens * compute + backward * tokens * grad),
                   f"activations: 2 forward + {backward} backward per layer, {m} micro-batch(es)", compute,
                   calls=m * layers * (2 + backward)),
        vocab,
    ]


def _sequence_parallel(shape: ModelShape, setup: Setup, *, tokens: int, compute: int, wide: int) -> list[Collective]:
    """Megatron's sequence parallelism, per layer and micro-batch: the all-reduces become all-gathers of the
    norms' outputs (fp32 under autocast: `wide`) before attention and the MLP, and reduce-scatters of the
    row-parallel outputs (compute dtype); backward mirrors them (the column-parallel input gradients are
    summed locally, then reduce-scattered once). Per micro-batch also: the first block's input gradient and
    the final norm's output are all-gathered, and every norm weight's gradient (partial over the sequence
    shards) is all-reduced, fp32."""
    m, layers, h = setup.microbatches_per_step, shape.num_layers, shape.hidden_size
    # norm parameter tensors: GPT-2 LayerNorm weight + bias (2 per block, ln_f), Llama RMSNorm weight
    per_norm = shape.features.norm_params_per_unit
    norm_grads = per_norm * (2 * layers + 1)
    return [
        Collective("all_gather", m * (layers * 2 * tokens * (wide + compute) + 2 * tokens * wide),
                   f"activations: 2 forward + 2 backward per layer, entry and exit, {m} micro-batch(es)", compute,
                   calls=m * (4 * layers + 2)),
        Collective("reduce_scatter", m * layers * 2 * tokens * (compute + wide),
                   f"activations: 2 forward + 2 backward per layer, {m} micro-batch(es)", compute, calls=m * 4 * layers),
        Collective("all_reduce", m * norm_grads * h * 4, f"{norm_grads} norm weight gradients, {m} micro-batch(es)", 4,
                   calls=m * norm_grads),
    ]


def ring_bytes(collectives: list[Collective], *, group_size: int) -> float:
    return sum(c.ring_bytes(group_size) for c in collectives)


def ring_volume_psi(collectives: list[Collective], *, group_size: int, num_params: float) -> float:
    """Elements each rank sends per step in units of Ψ (the ZeRO paper's 2Ψ / 3Ψ, x (N-1)/N)."""
    return sum(c.ring_elements(group_size) for c in collectives) / num_params
