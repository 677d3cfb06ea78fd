"""Step time of one configuration: compute, exposed communication, pipeline bubble, optimizer step, framework.

- **Compute**: the busiest rank's micro-batches, operation by operation (estimate/ops.py: matrix products by shape,
  causal attention by sequence length, memory-bound kernels at the memory bandwidth, the loss over the vocabulary;
  forward, backward and what checkpointing recomputes), divided by the profile's `efficiency` (1 on the GPU
  profiles; what a CPU step loses beyond its kernels), plus eager PyTorch's own cost per block and micro-batch
  (`layer_overhead_s`: measured on a CPU by plan.calibrate, 0 on a GPU, which runs it ahead of its kernels).
- **Communication**: each collective of the estimator's per-step list (estimate/comm.py), as a ring: its
  latency per call, which grows with the steps of the ring (or of NCCL's tree for an all-reduce) over the group's
  ranks and nodes, plus the bytes the rank sends (buffer x nccl-tests bus factor) at the bus bandwidth of the
  link its group uses: within a node, or between nodes where the group spans them.
- **Overlap**: what each parallelism declares can run beside compute (parallel/catalog.py's `overlaps`: DDP's
  bucketed all-reduce, FSDP's and ZeRO-3's gathers and reduce-scatters, ZeRO-2's per-micro-batch reduction) hides
  behind up to `overlap` x the compute; tensor-parallel all-reduces, pipeline sends, ZeRO-1's reduction after the
  last backward and ZeRO-1/2's all-gather after the step sit on the critical path.
- **Bubble**: a pipeline runs M micro-batches through K stages in M x the busiest stage's micro-batch plus one
  micro-batch of every other stage (filling and draining; GPipe and 1F1B alike): (K - 1) / M of the stage's compute
  when the stages are balanced, less when the busiest one (the LM head's) outweighs the rest.
- **Optimizer step**: the rank's model state read and written once at the memory bandwidth.
- **Framework**: the strategy's own work per block and micro-batch where it hooks every block (FSDP's and
  ZeRO-3's gathers, DTensor's dispatch, a pipeline's schedule): the profile's `overhead_s` for the strategy,
  which dominates a small model on a CPU, and which plan.verify fits from real runs.

MFU uses telemetry's definition (6 N + 12 L H T per token, N without embedding lookups, no recompute), so the
predicted and the measured MFU of a run mean the same thing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from dist_train.estimate.comm import Collective, bus_factor, predict_comm
from dist_train.estimate.memory import experts_in_fp32, predict_memory
from dist_train.estimate.setup import Setup
from dist_train.estimate.shapes import ModelShape, stage_layers
from dist_train.estimate.hardware import Hardware
from dist_train.estimate.ops import MicroBatchCompute, head_compute, layer_compute, recompute_mode
from dist_train.telemetry.flops import flops_per_token


@dataclass(frozen=True)
class StepTime:
    compute_s: float
    comm_s: float  # every collective of the busiest rank, one after another
    exposed_comm_s: float  # what the step waits for
    bubble_s: float
    optimizer_s: float
    framework_s: float
    tokens_per_step: int
    world_size: int
    model_flops_per_token: float
    peak_flops: float  # per device
    overhead_key: str = ""  # which of the profile's overhead_s applies ("": none)
    overhead_units: int = 0  # blocks x micro-batches it applies to
    ops: Optional[MicroBatchCompute] = None  # compute_s by kind of operation (estimate/ops.py), a step's worth
    layer_units: int = 0  # blocks x micro-batches the busiest rank runs: what layer_overhead_s applies to

    @property
    def step_s(self) -> float:
        return self.compute_s + self.exposed_comm_s + self.bubble_s + self.optimizer_s + self.framework_s

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.step_s

    @property
    def mfu(self) -> float:
        return self.model_flops_per_token * self.tokens_per_s / (self.world_size * self.peak_flops)


def model_flops_per_token(shape: ModelShape, seq_len: int) -> float:
    """telemetry.flops.flops_per_token for a shape, of its active parameters (an MoE model's top-k experts, as
    training's MFU counts them): what MFU divides by."""
    return flops_per_token(num_params=shape.active_params, num_embedding_params=shape.embedding_params(),
                           num_layers=shape.num_layers, hidden_size=shape.hidden_size, seq_len=seq_len)


def _matmul_flops_per_token(shape: ModelShape, *, layers: int, head: bool, seq_len: int, recompute: bool) -> float:
    """Forward + backward FLOPs per token of `layers` blocks (and the LM head): 2 per weight forward, 4 backward,
    2 more where checkpointing recomputes the forward; attention's scores and values 4 L H T forward. What
    bench/gpu_calibrate.py divides its measured times by (the time model itself counts by operation, ops.py)."""
    per_pass = 2.0 * (layers * shape.layer_matmul_weights() + (shape.head_matmul_weights() if head else 0))
    per_pass += 4.0 * layers * shape.q_dim * seq_len
    return per_pass * (4 if recompute else 3)


def tokens_per_step(setup: Setup) -> int:
    return setup.micro_batch_size * setup.seq_len * setup.microbatches_per_step * setup.data_parallel_size


def spans_nodes(c: Collective, setup: Setup, *, gpus_per_node: int) -> bool:
    """Ranks are laid out tensor-parallel innermost, then data-parallel, then pipeline stages (rank = stage x D
    + replica): a group spans nodes unless its ranks fit in one node's consecutive devices."""
    if setup.world_size <= gpus_per_node:
        return False
    if c.dim == "tp" or setup.family == "tp":
        return setup.tensor_parallel_size > gpus_per_node
    if c.dim in ("dp_shard", "dp_replicate") and setup.family != "pipeline":  # HSDP's, fsdp_tp's: rank 0's group
        ranks = setup.dims.group_ranks(0, c.dim)
        return ranks[0] // gpus_per_node != ranks[-1] // gpus_per_node
    if setup.family == "pipeline":
        if c.op in ("send", "recv"):  # a neighbour stage is D ranks away
            return setup.data_parallel_size >= gpus_per_node or gpus_per_node % setup.data_parallel_size != 0
        return setup.data_parallel_size > gpus_per_node
    return True  # data parallel over every node


def group_nodes(c: Collective, setup: Setup, *, gpus_per_node: int) -> int:
    """The nodes rank 0's group for `c` spans (1 where it stays within one)."""
    group = c.group_size or setup.comm_group_size
    if not spans_nodes(c, setup, gpus_per_node=gpus_per_node):
        return 1
    if c.dim in ("dp_shard", "dp_replicate") and setup.family != "pipeline":  # HSDP's replicas: one rank a node
        return len({r // gpus_per_node for r in setup.dims.group_ranks(0, c.dim)})
    return max(2, -(-group // gpus_per_node))  # consecutive ranks


def collective_latency_s(op: str, *, group_size: int, num_nodes: int, hw: Hardware) -> float:
    """One call's latency, NCCL's model of it (src/graph/tuning.cc): the steps of its ring, each a hop within a node
    or between nodes: n - 1 for an all-gather or a reduce-scatter over n ranks on N nodes (N - 1 of them between
    nodes), twice that for an all-reduce, or a tree's 2 x (n / N - 1) + 2 x ceil(log2 N) where that is less. The
    link's `latency_s` is a two-rank call's (one step); each step beyond it adds its hop's `step_latency_s`.
    all-to-all, send and recv: one step (their peers are reached at once)."""
    link = hw.link(spans_nodes=num_nodes > 1)
    if group_size <= 2 or op not in ("all_gather", "reduce_scatter", "all_reduce"):
        return link.latency_s
    intra, inter = group_size - num_nodes, num_nodes - 1
    if op == "all_reduce":
        ring = (2 * intra, 2 * inter)
        tree = (2 * (group_size // num_nodes - 1), 2 * math.ceil(math.log2(num_nodes)))
        intra, inter = min(ring, tree, key=lambda s: s[0] * hw.intra.step_latency_s + s[1] * hw.inter.step_latency_s)
    steps = intra * hw.intra.step_latency_s + inter * hw.inter.step_latency_s
    return link.latency_s + max(0.0, steps - link.step_latency_s)


def collective_s(c: Collective, setup: Setup, hw: Hardware) -> float:
    group = c.group_size or setup.comm_group_size
    ring = c.bytes * bus_factor(c.op, group) if c.op != "recv" else c.bytes  # a recv waits for the peer's send
    nodes = group_nodes(c, setup, gpus_per_node=hw.gpus_per_node)
    return (c.calls * collective_latency_s(c.op, group_size=group, num_nodes=nodes, hw=hw)
            + ring / hw.link(spans_nodes=nodes > 1).busbw)


def element_bytes(precision: str) -> int:
    """Bytes of an activation element: 2 under bf16/fp16 (autocast's and FSDP's compute dtype), 4 in fp32."""
    return 4 if precision == "fp32" else 2


def micro_batch_compute(shape: ModelShape, setup: Setup, hw: Hardware, *, peak: float, layers: int,
                        head: bool, first_layer: int = 0) -> MicroBatchCompute:
    """One micro-batch of `layers` blocks (and the LM head and loss) on one rank, operation by operation."""
    tp = setup.tensor_parallel_size
    common = dict(batch=setup.micro_batch_size, seq_len=setup.seq_len, hw=hw, peak=peak,
                  element_bytes=element_bytes(setup.precision))
    per_layer = dict(tp=tp, sequence_parallel=setup.sequence_parallel, ep=setup.ep,
                     experts_fp32=experts_in_fp32(shape, setup),
                     ep_overload=setup.ep_overload, **common)
    recomputed = setup.checkpointed_layers(layers, first_layer)  # train.checkpoint_every: the others run once
    out = MicroBatchCompute(0.0, 0.0, 0.0, 0.0)
    for mode, n in ((recompute_mode(setup.activation_checkpointing), recomputed), ("none", layers - recomputed)):
        if n:  # each kind of block priced once, where the rank has some
            out = out + layer_compute(shape, recompute=mode, **per_layer).scaled(n)
    return out + head_compute(shape, tp=tp, **common) if head else out


def predict_step(shape: ModelShape, setup: Setup, hw: Hardware, *, allow_tf32: bool = False,
                 model_state_bytes: Optional[float] = None,
                 overlapped_activations: tuple[str, ...] = ()) -> StepTime:
    """`model_state_bytes`: the busiest rank's (estimate.predict_memory's), when the caller has it already.
    `overlapped_activations`: mesh dimensions whose activation collectives another stack hides behind compute,
    where dist_train's code runs them on the critical path (Megatron-LM's --tp-comm-overlap: "tp"); for
    bench/published.py's Megatron rows, never a dist_train run."""
    peak = hw.peak(setup.precision, allow_tf32=allow_tf32)
    tokens = tokens_per_step(setup)
    m = setup.microbatches_per_step
    if setup.family == "pipeline":
        k = setup.num_stages
        split = list(setup.split_points) if setup.split_points else None
        layers = stage_layers(shape, num_stages=k, split_points=split)
        per_stage = [micro_batch_compute(shape, setup, hw, peak=peak, layers=n, head=i == k - 1,
                                         first_layer=sum(layers[:i])) for i, n in enumerate(layers)]
        one = [c.total_s / hw.efficiency + n * hw.layer_overhead_s for c, n in zip(per_stage, layers)]
        busiest = max(range(k), key=lambda i: one[i])
        ops = per_stage[busiest].scaled(m / hw.efficiency)
        layer_units = m * layers[busiest]
        compute = ops.total_s + layer_units * hw.layer_overhead_s
        bubble = sum(one) - one[busiest]  # filling and draining: one micro-batch of every other stage
    else:
        ops = micro_batch_compute(shape, setup, hw, peak=peak, layers=shape.num_layers, head=True)
        ops = ops.scaled(m / hw.efficiency)
        layer_units = m * shape.num_layers
        compute = ops.total_s + layer_units * hw.layer_overhead_s
        bubble = 0.0
    # Ranks share their lists (one per pipeline stage, one for everyone else): time each distinct list once.
    distinct = {id(colls): colls for colls in predict_comm(shape, setup)}.values()
    timed = [[(c, collective_s(c, setup, hw)) for c in colls] for colls in distinct]
    colls = max(timed, key=lambda cs: sum(t for _, t in cs), default=[])
    hides = [c.overlaps or (c.dim in overlapped_activations and c.moves == "activations") for c, _ in colls]
    hidden = sum(t for (_, t), h in zip(colls, hides) if h)
    exposed = sum(t for (_, t), h in zip(colls, hides) if not h) + max(0.0, hidden - hw.overlap * compute)
    state = model_state_bytes if model_state_bytes is not None else \
        max(r.model_state for r in predict_memory(shape, setup))
    key = overhead_key(setup)
    units = shape.num_layers * m if key else 0
    return StepTime(
        compute_s=compute, comm_s=sum(t for _, t in colls), exposed_comm_s=exposed, bubble_s=bubble,
        optimizer_s=2 * state / hw.memory_bw, framework_s=units * hw.overhead_s.get(key, 0.0), tokens_per_step=tokens,
        world_size=setup.world_size, model_flops_per_token=model_flops_per_token(shape, setup.seq_len),
        peak_flops=peak, overhead_key=key, overhead_units=units, ops=ops, layer_units=layer_units,
    )


def overhead_key(setup: Setup) -> str:
    """The strategies with work of their own beside the bytes they move: fsdp, fsdp_tp, tp (DTensor), zero1-3
    (DeepSpeed's engine: its gradient hooks, buckets and partitioned step; ZeRO-3's gathers), the pipelines by
    schedule (gpipe, 1f1b: on 2 CPU ranks gpipe's step was 13% above 1f1b's at the same micro-batches, model=tiny, 16
    of them); "" for the rest (ddp, single: a bucketed reduction after backward, nothing per block)."""
    if setup.family == "zero":
        return f"zero{setup.zero_stage}"
    if setup.family == "pipeline":
        return setup.schedule or "gpipe"
    if setup.family in ("fsdp", "fsdp_tp", "tp"):
        return setup.family
    return "fsdp" if setup.kind == "fsdp" else ""
