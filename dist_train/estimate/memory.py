"""Per-rank memory by category: model state (ZeRO paper) plus activations and the KV cache.

Model state (Rajbhandari et al. 2020, "ZeRO", section 3.1): with Ψ parameters and N data-parallel ranks,
a replica holds weights, gradients, (master weights) and optimizer state; ZeRO-1 shards the optimizer
state (with the master copy) over N, ZeRO-2 the gradients too, ZeRO-3 and FSDP the weights as well. A
pipeline with K stages holds, on each stage, the model state of that stage's parameters only.

Activations (Korthikanti et al. 2022, "Reducing Activation Recomputation", eq. 1): per transformer layer
s·b·h·(34 + 5·a·s/h) bytes for 16-bit activations with dropout. It counts 16 saved values of s·b·h
(2 bytes each), two 1-byte dropout masks of s·b·h, and 2.5 bytes per attention score (softmax output,
dropout mask, dropout output). Generalised here: the element size e is 4 in fp32, masks only when
dropout > 0, the MLP and q/k/v sizes follow the model (GPT-2's unfused tanh GELU keeps 5 ffn-wide
tensors where Korthikanti's fused GELU keeps 2, SwiGLU keeps 4, GQA has smaller k/v), and attention scores only
when they are materialised: with SDPA / flash attention (what `transformers` uses by default) only the output and
log-sum-exp are kept, so the a·s² term is dropped.
Full activation checkpointing keeps each layer's input (s·b·h·e) plus one layer's activations while it
is recomputed. Selective checkpointing (torchtitan's per-op policy) keeps, beside each layer's input, what its
matrix products and attention return (q/k/v, attention's output and log-sum-exp, the attention and MLP output
projections', the MLP's up (and gate) projection; tensor parallelism's all-reduced outputs) and recomputes the
rest; in backward, one layer's activations are held in full again while it is recomputed, its kept outputs among
them (`selective_kept_bytes`). The LM head adds its input and the fp32 log-softmax of the logits (s·b·V·4).

Under bf16/fp16 autocast over fp32 weights (single, dp, ddp, pipelines) norms run in fp32, so their inputs
are kept in 4 bytes; and every matrix product keeps a 16-bit copy of its weight for backward, counted apart
(`weight_copies`): it grows with the parameters, not with the tokens.

Llama differs from GPT-2 in two ways that matter here (measured with the activation meter, per layer):
- transformers' RMSNorm upcasts its input to fp32 and keeps that, and keeps its normalized output in the
  residual stream's dtype for the weight's gradient: 4 + e' bytes per hidden unit and norm (e' = 4 in fp32
  and under autocast, 2 with 16-bit weights), where LayerNorm keeps only its input (e').
- its projections are separate matrices: under autocast q, k and v each cast the attention input to 16 bits
  and keep their own copy, gate and up the MLP input (GPT-2's fused c_attn and c_fc keep one each).

Transient buffers, beside the model state that stays between steps:
- ZeRO-3 gathers parameters to full size to use them. DeepSpeed keeps a gathered parameter while it will be
  reused within `stage3_max_reuse_distance` parameters (in backward, every parameter is reused: if the
  distance covers the model, nothing is released before backward), and prefetches: every module's entry (one
  without parameters too) gathers up to `stage3_prefetch_bucket_size` elements ahead, at least one parameter,
  while fewer than `stage3_max_live_parameters` are gathered. Prefetching outruns use, so with a prefetch bucket
  the gathered set fills to the live limit, plus at most one module (the last prefetch, or the module in use);
  parameters under `stage3_param_persistence_threshold` stay gathered for good.
  Measured here, a tiny model with the defaults holds every parameter gathered at its peak, with no reuse and no
  prefetch exactly its largest module, and with no reuse and a live limit of 50,000 or 120,000 elements 66,368 and
  133,248 (this model: 66,640 and 136,640); the dry run of 8 of Llama-2-70B's layers on 64 ranks, with a live limit
  of 0.5, 1 and 2 billion, 0.73, 1.19 and 2.21 billion (this model: 0.76, 1.26 and 2.26; DeepSpeed's own count,
  memory/gathered_params_bytes, as a real run reports it).
  Backward also holds the largest module's full-size gradients before they are reduce-scattered.
- ZeRO flattens the rank's gradient partition into a new fp32 buffer for the optimizer step, every stage and
  precision (measured here: 4 B x Psi / N for zero1-3 in fp32 and bf16).
The peak is model state plus the larger of the forward/backward working set (activations, weight copies,
gathered parameters and gradients) and the optimizer step's (the fp32 gradient partition).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, Optional

from dist_train.config import PRECISIONS
from dist_train.parallel.buckets import ZERO_BUCKET_FIELDS, zero_bucket_sizes
from dist_train.parallel.catalog import STATE_CATEGORIES
from dist_train.estimate.setup import Setup
from dist_train.estimate.shapes import ModelShape, stage_layers, stage_params

def element_bytes(precision: str) -> int:
    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r} unknown; allowed: {', '.join(PRECISIONS)}")
    return PRECISIONS[precision][1]


@dataclass(frozen=True)
class StateBytes:
    """Bytes per parameter of each model-state category on a replica (before any sharding)."""

    weights: float
    grads: float
    master: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.weights + self.grads + self.master + self.optimizer


# Optimizers whose state is not a fixed number of tensors per parameter: it depends on the tensors' shapes.
SHAPED_OPTIMIZERS = ("adafactor", "adam8bit")
# bitsandbytes' 8-bit optimizers: tensors under this many elements keep fp32 state; the rest are quantized in
# blocks of 256 with one fp32 scale (absmax) each; one 256-entry fp32 code book per moment is shared.
BNB_MIN_8BIT_SIZE, BNB_BLOCK = 4096, 256


def optimizer_state_count(optimizer: str, *, momentum: float = 0.0) -> int | None:
    """State tensors per parameter: Adam/AdamW two moments, SGD one momentum buffer (none without), Lion one,
    LOMO none; None where the state depends on the tensors' shapes (Adafactor, 8-bit Adam)."""
    if optimizer in ("adam", "adamw"):
        return 2
    if optimizer == "sgd":
        return 1 if momentum else 0
    if optimizer == "lion":
        return 1
    if optimizer == "lomo":
        return 0
    if optimizer in SHAPED_OPTIMIZERS:
        return None
    raise ValueError(f"optimizer={optimizer!r} unknown; allowed: adam, adamw, sgd, lion, lomo, adafactor, adam8bit")


def shaped_optimizer_bytes(shape: ModelShape, optimizer: str) -> float:
    """Optimizer state bytes of a whole replica, tensor by tensor (fp32 state; step counters left out).

    adafactor (torch): a matrix (m x n) keeps a row and a column vector, m + n floats; a stack of them (an MoE
    layer's experts, E x m x n) one pair per matrix, E·(m + n); a vector its full second moment. adam8bit
    (bitsandbytes): two 1-byte moments plus a 4-byte scale per block of 256 for tensors of at least 4096 elements,
    two fp32 moments below that, and the shared code books once."""
    total = 0.0
    for dims in shape.param_shapes():
        n = math.prod(dims)
        if optimizer == "adafactor":
            total += 4 * (math.prod(dims[:-2]) * (dims[-2] + dims[-1]) if len(dims) >= 2 else n)
        elif n >= BNB_MIN_8BIT_SIZE:
            total += 2 * n + 2 * 4 * math.ceil(n / BNB_BLOCK)
        else:
            total += 2 * 4 * n
    if optimizer == "adam8bit":
        total += 4 * BNB_BLOCK * 2
    return total


def with_model(shape: ModelShape, setup: Setup) -> Setup:
    """`setup` with what depends on the model filled in where the run did not set it: DeepSpeed's bucket sizes, from
    the model's width as the training code sizes them (parallel/buckets.py), and the optimizer's bytes per parameter
    where they depend on the model's shapes."""
    auto = zero_bucket_sizes(shape.hidden_size)
    fill: dict[str, Any] = {field: auto[key] for key, field in ZERO_BUCKET_FIELDS.items()
                            if getattr(setup, field) is None}
    if setup.optimizer in SHAPED_OPTIMIZERS and setup.optimizer_bytes_per_param is None:
        fill["optimizer_bytes_per_param"] = shaped_optimizer_bytes(shape, setup.optimizer) / shape.num_params
    return replace(setup, **fill) if fill else setup


def state_bytes(*, precision: str, optimizer: str, momentum: float = 0.0, regime: str,
                optimizer_per_param: float | None = None) -> StateBytes:
    """Bytes per parameter for `regime` (see setup.REGIMES; `auto` must be resolved first).

    `optimizer_per_param`: the optimizer state's bytes per parameter where a count of tensors cannot say it
    (see `with_model`)."""
    p = element_bytes(precision)
    states = optimizer_state_count(optimizer, momentum=momentum)
    if states is None and optimizer_per_param is None:
        raise ValueError(f"optimizer={optimizer}: its state depends on the model's tensor shapes (give a model)")

    def moments(elem: int) -> float:
        return optimizer_per_param if optimizer_per_param is not None else elem * states

    if regime == "autocast":
        return StateBytes(weights=4, grads=4, master=0, optimizer=moments(4))
    if regime == "mixed":
        return StateBytes(weights=p, grads=p, master=4 if p < 4 else 0, optimizer=moments(4))
    if regime == "deepspeed":
        return StateBytes(weights=p, grads=p, master=4, optimizer=moments(4))
    if regime == "pure":
        return StateBytes(weights=p, grads=p, master=0, optimizer=moments(p))
    raise ValueError(f"regime={regime!r} cannot be used here; resolve `auto` with Setup.resolved_regime")


def setup_state_bytes(setup: Setup) -> StateBytes:
    """`state_bytes` for a Setup (LOMO keeps no gradient beyond the one being applied: 0 at rest). strategy=zero3's
    engine uses an fp32 partition as its own master copy (strategies/_zero3_setup.py); Accelerate's DeepSpeed engine
    and stages 1 and 2 keep a copy."""
    b = state_bytes(precision=setup.precision, optimizer=setup.optimizer, momentum=setup.momentum,
                    regime=setup.resolved_regime, optimizer_per_param=setup.optimizer_bytes_per_param)
    if setup.resolved_regime == "deepspeed" and setup.zero3_shares_master and b.weights == b.master:
        b = replace(b, master=0)
    return replace(b, grads=0) if setup.optimizer == "lomo" else b


@dataclass(frozen=True)
class Shards:
    """Over how many ranks each category is split (1 = replicated)."""

    weights: int
    grads: int
    optimizer: int  # optimizer state and master weights together (ZeRO's P_os)


def shards(setup: Setup) -> Shards:
    """Each category over the run's dp_shard ranks where the parallelism over that dimension partitions it
    (parallel/catalog.py's `partitions`; HSDP: within a replica only), else whole."""
    sharded = next((p.partitions for p in setup.parallelisms if p.dim == "dp_shard"), ())
    n = setup.dims.dp_shard
    return Shards(**{c: n if c in sharded else 1 for c in STATE_CATEGORIES})


@dataclass(frozen=True)
class RankMemory:
    """Predicted bytes one rank holds, by category."""

    params: float
    grads: float
    master: float
    optimizer: float
    activations: float = 0.0
    weight_copies: float = 0.0  # autocast's 16-bit copies of the matmul weights, kept for backward
    gathered_params: float = 0.0  # ZeRO-3: parameters gathered to full size at the peak
    gathered_grads: float = 0.0  # ZeRO-3: the largest module's full-size gradients before reduce-scatter
    step_grads: float = 0.0  # ZeRO: the fp32 gradient partition built for the optimizer step
    # The peak of all live tensors (memory/peak_live_bytes), where the estimator models what the strategy holds
    # beside the categories (see predict_peak_live); None where it does not.
    peak_live: Optional[float] = None

    @property
    def model_state(self) -> float:
        return self.params + self.grads + self.master + self.optimizer

    @property
    def working_set(self) -> float:
        """Transient bytes at the peak: forward/backward's or the optimizer step's, whichever is larger."""
        forward_backward = self.activations + self.weight_copies + self.gathered_params + self.gathered_grads
        return max(forward_backward, self.step_grads)

    @property
    def total(self) -> float:
        return self.model_state + self.working_set

    @property
    def peak(self) -> float:
        """What decides out-of-memory: the peak of all live tensors where it is modelled, else the categories'."""
        return self.total if self.peak_live is None else self.peak_live


# The telemetry's memory categories (memory/<category>_bytes) that the estimator predicts.
MEASURED_CATEGORIES = ("params", "grads", "optimizer", "activations", "weight_copies", "gathered_params", "step_grads")


# Under train.compile inductor decides what a block saves for backward (it recomputes cheap ops, and casts
# inside its kernels): the eager counts of these do not apply.
EAGER_ONLY = ("activations", "weight_copies")


def predicted_categories(train: Mapping[str, Any]) -> tuple[str, ...]:
    """The MEASURED_CATEGORIES the estimator speaks for in a run with this `train` config group."""
    if train.get("compile", False):
        return tuple(c for c in MEASURED_CATEGORIES if c not in EAGER_ONLY)
    return MEASURED_CATEGORIES


def category_bytes(rank: RankMemory, category: str) -> float:
    """A rank's predicted bytes in one of MEASURED_CATEGORIES; optimizer is state plus master copy, which is
    where the strategies count DeepSpeed's fp32 master partition."""
    if category == "optimizer":
        return rank.optimizer + rank.master
    return float(getattr(rank, category))


def model_state_bytes(num_params: float, setup: Setup, *, persistent: float = 0.0) -> RankMemory:
    """Model state of `num_params` parameters on one rank (all of them, or a pipeline stage's).

    `persistent`: ZeRO-3 parameters under the persistence threshold, whose weights every rank keeps whole."""
    b = setup_state_bytes(setup)
    sh = shards(setup)
    return RankMemory(
        params=(num_params - persistent) * b.weights / sh.weights + persistent * b.weights,
        grads=num_params * b.grads / sh.grads,
        master=num_params * b.master / sh.optimizer,
        optimizer=num_params * b.optimizer / sh.optimizer,
    )


def predict_memory(shape: ModelShape, setup: Setup) -> list[RankMemory]:
    """One entry per rank: model state, activations of the micro-batches alive at the peak, transient buffers."""
    setup = with_model(shape, setup)
    if setup.family != "pipeline":
        gathered, persistent = zero3_gathered(shape, setup)
        padded = fsdp_rank_elements(shape, setup)
        state = model_state_bytes(tp_rank_params(shape, setup) if padded is None else padded, setup,
                                  persistent=persistent)
        act = activation_bytes(shape, setup=setup, num_layers=shape.num_layers, with_head=True, in_flight=1)
        copies = weight_copy_bytes(shape, setup=setup, num_layers=shape.num_layers, with_head=True, in_flight=1)
        one = RankMemory(
            state.params, state.grads, state.master, state.optimizer, act, copies,
            gathered_params=gathered, gathered_grads=zero3_gathered_grads(shape, setup),
            step_grads=zero_step_grads(shape.num_params, setup),
        )
        return [replace(one, peak_live=predict_peak_live(shape, setup, one))] * setup.world_size
    k = setup.num_stages
    split = list(setup.split_points) if setup.split_points else None
    params = stage_params(shape, num_stages=k, split_points=split)
    layers = stage_layers(shape, num_stages=k, split_points=split)
    out = []
    for stage in range(k):
        state = model_state_bytes(params[stage], setup)
        shared = dict(num_layers=layers[stage], with_head=stage == k - 1,
                      in_flight=pipeline_in_flight(setup, stage=stage), first_layer=sum(layers[:stage]))
        act = activation_bytes(shape, setup=setup, **shared)
        copies = weight_copy_bytes(shape, setup=setup, **shared)
        out.append(RankMemory(state.params, state.grads, state.master, state.optimizer, act, copies))
    return [out[rank // setup.data_parallel_size] for rank in range(setup.world_size)]  # rank = stage * D + replica


# Where the peak of all live tensors is predicted: the strategies whose peak was measured against torch's
# MemTracker here, or against a real run by the dry run (tests/launched/test_peak_live.py,
# tests/launched/test_dryrun.py, docs/BENCHMARKS.md); expert parallelism's layouts (fsdp_ep, ep) against real runs on 2
# and 4 ranks (docs/moe.md); ZeRO-3 against real runs on 2 and 4 ranks and dry runs of Llama-2-70B's shape on 64 and
# 1,024 (2026-11-29, docs/estimator.md). Not yet: the pipelines (send/receive buffers, micro-batches in flight).
PEAK_LIVE_FAMILIES = ("single", "dp", "ddp", "tp", "fsdp", "fsdp_tp", "zero")


def zero2_buffers_beyond_grads(shape: ModelShape, setup: Setup, rank: RankMemory) -> float:
    """ZeRO-2's gradient buffers at the peak, beyond the one the categories count as `grads`
    (predict_peak_live's docstring has the DeepSpeed code and the measurements): accumulating, the first
    micro-batch's buffer kept as the accumulator; the current micro-batch's made only at the first reduction, before
    the peak where the bucket is smaller than the largest parameter or than a block, after it otherwise."""
    if setup.family != "zero" or setup.zero_stage != 2:
        return 0.0
    bucket = setup.zero_reduce_bucket_size
    current_made = bucket < shape.layer_params() or any(n > bucket for module in shape.module_params() for n in module)
    accumulator = setup.microbatches_per_step > 1
    return rank.grads * (int(accumulator) + int(current_made) - 1)


def zero2_oversized_moments(shape: ModelShape, setup: Setup, rank: RankMemory) -> float:
    """ZeRO-2's peak where a gradient larger than the reduction bucket is held, or 0.

    DeepSpeed (0.19.8, stage_1_and_2.py reduce_independent_p_g_buckets_and_remove_grads) copies a gradient into the
    bucket unless it is larger than the bucket; such a one is kept whole (`extra_large_param_to_reduce`) and reduced
    only at the next parameter's hook, or after backward for the last. Two moments follow (dry runs of Llama-2-70B's
    shape, 4 blocks, rank 0 of 64, one micro-batch a step, the bucket hidden^2 as training sizes it):
    - in backward, two oversized gradients side by side (a block's MLP matrices follow each other): every
      activation but the loss's, and the pair. Seq 256: the peak's gradients were two MLP matrices and the bucket,
      exactly, in fp32 and in bf16;
    - after backward, the first parameter of the model (the embedding, vocabulary x hidden), reduced beside a copy
      of its own size, with no activation left: the model state, the bucket and twice that gradient. With Llama 3's
      vocabulary (128,256) at seq 256 this was the whole peak to the byte, in fp32 and in bf16, 22-24% above the
      start of backward, which was all the estimator took before.
    Accumulating micro-batches, each moment held one more tensor of the (larger) oversized gradient's size (2
    micro-batches of seq 256: the pair's moment with Llama-2's vocabulary, -4.8% without it, -0.1% with it; the one
    after backward with Llama 3's, -12.0% and +1.0%; which of DeepSpeed's accumulation paths makes it is not traced).
    The pair is the largest of two parameters adjacent in backward order (forward order reversed) both over the
    bucket; a model whose largest parameters are in the bucket has neither moment."""
    if setup.family != "zero" or setup.zero_stage != 2:
        return 0.0
    bucket = setup.zero_reduce_bucket_size
    size = element_bytes(setup.precision)
    order = [math.prod(dims) for dims in reversed(shape.param_shapes())]
    accumulating = setup.microbatches_per_step > 1
    pairs = [a + b + max(a, b) * accumulating for a, b in zip(order, order[1:]) if a > bucket and b > bucket]
    buffers = zero2_buffers_beyond_grads(shape, setup, rank)
    in_backward = rank.total + bucket * size + buffers + max(pairs) * size if pairs else 0.0
    first = next((n for n in reversed(order) if n > bucket), 0)
    accumulator = rank.grads if accumulating else 0.0
    after_backward = (rank.params + rank.master + rank.optimizer + bucket * size + accumulator
                      + (2 + accumulating) * first * size if first else 0.0)
    return max(in_backward, after_backward)


def predict_peak_live(shape: ModelShape, setup: Setup, rank: RankMemory) -> Optional[float]:
    """The peak of all live tensors on a rank (memory/peak_live_bytes), or None where it is not modelled.

    Every family below: plus, at the start of backward, the loss's two fp32 vocabulary-wide gradients
    (backward_start_extra), which decide the peak of a model with a large vocabulary. The measurements quoted
    below were made with model=tiny, whose vocabulary makes them small.
    ZeRO 1, 2 and 3: the categories at their peak plus DeepSpeed's reduction bucket, reduce_bucket_size elements of
    the training dtype allocated whole (hidden^2 as training sizes it, parallel/buckets.py; DeepSpeed's own default
    would be 2 GB in fp32; measured on 2 CPU ranks, model=tiny, with a
    100,000-element bucket so that the rest shows: zero1 -0.3%, zero2 +1.3%, bench/peak_live.py; dry runs in bf16
    -6.9%, -3.3%).
    ZeRO-2 accumulating micro-batches keeps the first micro-batch's gradient buffer (DeepSpeed 0.19.8,
    runtime/zero/stage_1_and_2.py: `grads_in_partition`, which the epilogue of a micro-batch that is not the last
    keeps in `all_grad_tensors` as the accumulator; each later micro-batch makes its own and adds it in) until the
    step: a partition more in the training dtype, beside the current micro-batch's buffer, which the categories count
    as `grads`. That one is made at the first reduction that copies a gradient of the rank's partition: at the first
    parameter larger than the bucket, or once the bucket fills. When the bucket is smaller than the largest
    parameter or than a block, that comes before the peak and both buffers are at it; with a bucket larger than
    both, after it, and the accumulator stands where the current buffer will be. Measured against one micro-batch a
    step, worst rank (model=tiny: largest parameter 16,384 elements, a block 54,000): buckets of 4,096 (hidden^2,
    as training sizes it), 20,000 and 100,000 elements all +521 KiB, partition 471 (fp32; +260 KiB in bf16,
    partition 235); +2.08 GiB in the dry run of Llama-2-70B's shape on 64 ranks in bf16, partition 2.01. Predicted
    (2026-11-29, worst rank, 2 CPU ranks, model=tiny, seq 64, micro-batch 2, 4 steps), 2 micro-batches a step:
    hidden^2 -0.3% in fp32 and +4.0% in bf16 (-6.7% and -1.4% without the accumulator), 20,000 +0.6% (-5.8% while
    only a parameter larger than the bucket counted), 100,000 +1.3%; one micro-batch: +0.4%, +1.4%, +2.1%; +0.9% in
    that dry run. The buffer is sized by the parameters its partition overlaps, whole (the flat partition cuts
    through two of them): above the partition by up to two parameters' parts, on some ranks (519 KiB on tiny;
    computed, not run, for the 70B shape: 2.75 GiB on rank 1, whose partition cuts two MLP matrices, 2.08 on
    rank 0); the estimator's partition is the ranks' mean. With one micro-batch and a bucket larger than both,
    neither buffer is at the peak: a partition less than the categories (+9.2% without that on tiny, 100,000
    elements; +2.1% with it). `zero2_buffers_beyond_grads` is that arithmetic. Where a gradient is larger than the
    bucket (every MLP matrix and the embedding, with hidden^2), the peak can be later, where DeepSpeed holds it
    whole: `zero2_oversized_moments`, the larger of the two is taken.
    ZeRO-3's categories hold its gathered parameters (zero3_gathered: what it keeps for backward, or the live limit
    and a prefetch) and the largest module's unsharded gradients; its peak, inside the last block's backward, is
    that sum plus the loss's and the bucket: measured 2026-11-29 on 2 and 4 CPU ranks, model=tiny, -0.0% to +2.4% in
    ten configurations (hidden 256, 8 layers, bf16, one micro-batch, tiny_moe, a persistence threshold, no reuse with
    a live limit), -6.3% and -5.7% with full and selective checkpointing (ddp's -5.2% and fsdp's -3.9% there: the
    tiny vocabulary's loss under checkpointing); dry runs of Llama-2-70B's shape: +0.6% and +0.7% at 64 and 1,024
    ranks, +1.9% with full checkpointing.
    single, dp and tp: the categories at their peak, model state plus the working set (`rank.total`; tp's
    micro-batches accumulate into the same sharded gradients; measured on 2 CPU ranks, model=tiny, 4 micro-batches:
    +5.3% over this, backward's temporaries); with one micro-batch a step, the larger end of backward (below, and
    ZeRO-1's the same, beside its bucket).
    ddp: the same. The gradients are views into DDP's all-reduce buckets, and dist_train zeroes them in place
    between steps rather than dropping them, so that micro-batches under no_sync accumulate into the buckets too
    (dropped, they would be accumulated apart and copied in by the last micro-batch's backward: a second copy of
    every gradient at the peak). From the second step on: DDP makes the gradients bucket views at its first
    reduction, and the first step, without optimizer state yet, holds less anyway (fp32 AdamW: 2 B/param less).
    Measured on 2 CPU ranks, model=tiny: +3.7% over this with one micro-batch and with two.
    fsdp (FSDP2), and fsdp_tp, whose FSDP shards each rank's tensor-parallel slice (ddp_tp: FSDP2's replicate, which
    holds it whole and never reshards after forward): at the start of backward it also
    holds gathered parameters, in the compute dtype: the root's (embeddings, final norm, head), kept from forward
    to backward, and the last block's (with reshard_after_forward=false, every parameter); under fsdp and hsdp at
    FSDP2's padded sizes (`fsdp_gathered`), which at 1,024 ranks make an MoE block's 128-row tensors 8 times their
    size. While it accumulates
    gradients (more than one micro-batch a step, gradient sync off until the last), every parameter's unsharded
    gradient is kept in fp32 (the reduce dtype) until the last micro-batch's reduce-scatter, 4 B per parameter (of
    the tensor-parallel slice) on every rank whatever the world size, in place of the sharded gradients, which do
    not exist yet at that point; reduce_every_microbatch holds the sharded ones instead. The peak is the larger of
    that moment and one later in backward, where the collectives' buffers are alive (`fsdp_backward_moment`: it
    decides where a block is large beside one layer's activations), and one in the last block's forward, beside two
    all-gather outputs (it decides accumulating in fp32, and without resharding). Backward's other temporaries are
    not counted (measured 2026-11-28: -2.9% to +1.7% on 2 ranks for fsdp, -0.5% on 4 ranks for fsdp_tp with tp=2;
    bench/peak_live.py, tests/launched/test_peak_live.py, tests/launched/test_dryrun.py).
    Under expert parallelism (fsdp_ep, ep: `_expert_parallel_gathered`) the dense weights are FSDP2's (fsdp_ep) or its
    replicate's (ep) as above, and the experts gather apart, over their own group. The dispatch's buffers are gone
    by the start of backward; what the all-to-alls keep for it is in the activations (`ep_dispatch_bytes`)."""
    if setup.family not in PEAK_LIVE_FAMILIES:
        return None
    loss = backward_start_extra(shape, setup)
    # With one micro-batch a step the start of backward holds no gradient yet: the optimizer drops them between
    # steps (set_to_none), except DDP's, which are views into its buckets. Backward then trades each layer's
    # activations for its gradients, so the peak is at one end: its start (every activation, no gradient, the
    # loss's temporaries) or its last block (every gradient, the first block's activations). Measured, one
    # micro-batch (2026-11-29, worst rank, 2 CPU ranks, model=tiny, seq 64, micro-batch 2; before, both ends were
    # taken as one moment): single -0.3% (+9.7%), tp -2.2% (+7.2%), tp with full checkpointing -0.2% (+3.6%), zero1
    # -0.1% (+14.6%), +0.2% with a 100,000-element bucket (+14.1%); the dry run of Llama-2-70B's shape under zero1 on
    # 64 ranks (seq 1,024, its peak at the end of backward) -0.5% in fp32 and in bf16 (+20.4%, +21.9%).
    fresh = setup.microbatches_per_step == 1 and setup.kind != "ddp"

    def with_loss(base: float) -> float:
        if not fresh:
            return base + loss
        first_block = activation_bytes(shape, setup=setup, num_layers=1, with_head=False, in_flight=1)
        return max(base - rank.grads + loss, base - rank.working_set + first_block)

    if setup.family == "zero":  # DeepSpeed's gradient buffers outlive the step
        bucket = setup.zero_reduce_bucket_size * element_bytes(setup.precision)
        if setup.zero_stage == 1:  # the gradients whole, made by backward as any optimizer's
            return with_loss(rank.total) + bucket
        start = rank.total + loss + bucket + zero2_buffers_beyond_grads(shape, setup, rank)
        return max(start, zero2_oversized_moments(shape, setup, rank))

    if setup.family == "tp" and setup.ep > 1 and shape.num_experts:
        # each layer's experts are an FSDP2 unit (parallel/experts.py), resharded after forward: the last layer's
        # E / ep unsharded at the start of backward, separate storage even over a one-rank efsdp (as under fsdp_ep)
        held = expert_rank_elements(shape, setup) / shape.num_layers
        return with_loss(rank.total + held * element_bytes(setup.precision))
    if setup.family not in ("fsdp", "fsdp_tp"):
        return with_loss(rank.total)
    # all of them without tensor parallelism; under expert parallelism the dense ones and the rank's own experts,
    # whose unsharded fp32 gradients accumulate as the dense ones' do
    slice_params = tp_rank_params(shape, setup)
    # ddp_tp's replicas (FSDP2's replicate) keep every block's compute copy from its forward to its backward
    reshards = setup.reshard_after_forward and setup.shard_with == "fsdp"
    if setup.ep > 1 and shape.num_experts:
        gathered = _expert_parallel_gathered(shape, setup, reshards=reshards)
    elif setup.family == "fsdp" and setup.shard_with == "fsdp":  # fsdp, hsdp: as FSDP2 gathers, padding included
        gathered = fsdp_gathered(shape, setup.dims.dp_shard, reshards=reshards)
    else:
        block = shape.layer_params_tp(setup.tensor_parallel_size)
        gathered = slice_params - (shape.num_layers - 1) * block if reshards else slice_params
    accumulates_unsharded = setup.microbatches_per_step > 1 and not setup.reduce_every_microbatch
    grads = 4.0 * slice_params if accumulates_unsharded else rank.grads
    # FSDP2's start of backward, without a micro-batch before it, counted with its sharded gradients: its peak comes
    # after the first reduce-scatters, beside their temporaries, which that stands for (fsdp with one micro-batch:
    # +0.5%; without them, -3.1%)
    base = rank.params + grads + rank.master + rank.optimizer + rank.working_set + gathered * element_bytes(
        setup.precision)
    start = max(base, base - grads + loss) if fresh else base + loss
    if setup.shard_with != "fsdp" or (setup.ep > 1 and shape.num_experts):
        return start
    # the second-to-last block's backward, and with one micro-batch the second block's, the other end
    blocks = (None, 1) if fresh and shape.num_layers > 3 else (None,)
    backward = max(fsdp_backward_moment(shape, setup, rank, gathered=gathered, grads=grads, reshards=reshards,
                                        accumulates_unsharded=accumulates_unsharded, block_index=k) for k in blocks)
    # the last block's forward: its gathered parameters (every block's without resharding) and beside them two
    # all-gather outputs, the last block's and the one before (the dry run holds both at its peak, inside that block:
    # it decides accumulating in fp32 and without resharding); the activations of the blocks before it (under
    # checkpointing, with the one running held in full); no gradient yet with one micro-batch a step
    forward = (rank.params + (0.0 if fresh else grads) + rank.master + rank.optimizer
               + activation_bytes(shape, setup=setup, num_layers=shape.num_layers - 1, with_head=False, in_flight=1)
               + (gathered + 2 * _fsdp_block(shape, setup)[1]) * element_bytes(setup.precision))
    return max(start, backward, forward)


def _fsdp_block(shape: ModelShape, setup: Setup) -> tuple[float, float]:
    """One block's parameters on a rank before FSDP2 (its tensor-parallel slice), and as FSDP2 gathers and
    reduce-scatters them: padded under fsdp and hsdp, the TP slices over dp_shard unpadded under fsdp_tp (as its
    gathered parameters are counted)."""
    block = shape.layer_params_tp(setup.tensor_parallel_size)
    if setup.family != "fsdp":
        return block, block
    return block, fsdp_block_padded(shape, setup.dims.dp_shard)


def fsdp_backward_moment(shape: ModelShape, setup: Setup, rank: RankMemory, *, gathered: float, grads: float,
                         reshards: bool, accumulates_unsharded: bool, block_index: Optional[int] = None) -> float:
    """Bytes FSDP2 holds at the end of a block's backward (`block_index`, 0 the first; by default the second-to-last):
    the peak of a model whose blocks are large beside one layer's activations (a 70B model's, or an MoE model's
    padded at 1,024 ranks). Beside the activations of the blocks before it, the root's gathered parameters and the
    block's own, three block-sized buffers are alive there:
    - the previous block's all-gather output, prefetched at this block's pre-backward (compute dtype, padded; the
      first block prefetches nothing);
    - the last block's reduce-scatter input, which FSDP2 keeps until the next reduce-scatter (fp32, the reduce
      dtype, padded); accumulating unsharded gradients, it takes the place of that block's fp32 accumulation;
    - the block's unsharded gradients (compute dtype), beside the head's, which the root keeps to the end. Where
      FSDP2 accumulates in the compute dtype (fp32) they are the accumulation itself, in `grads` already.
    `gathered` is what the start of backward holds gathered (the root's and the last block's), `grads` the
    gradients the step holds (sharded, or every unsharded fp32 accumulation). Without resharding after forward
    (`reshards` false) every block is gathered already, so nothing is prefetched, and the last block was resharded
    after its backward. Measured by the dry run (torch 2.13's FSDP2, Llama-2-70B's shape, seq 1,024, fp32 and bf16,
    64 and 1,024 ranks): the peak is inside that block's attention backward, 1-3% above this (its temporaries).
    With one micro-batch a step, the sharded gradients of the blocks after it are there too: going back, each block
    adds its own and frees its activations, so the peak is at one end, the second-to-last block's backward or the
    second block's (block_index 1, the last that prefetches), where under checkpointing, whose blocks keep little,
    it moves (Llama-2-70B's shape on 64 ranks, bf16, seq 1,024, full checkpointing: the dry run's peak in block 1's
    backward; the second-to-last block's moment 4.3% under it, this 1.2% over)."""
    layers = shape.num_layers
    if layers < 2:
        return 0.0
    k = layers - 2 if block_index is None else block_index
    elem = element_bytes(setup.precision)
    tp = setup.tensor_parallel_size
    block, padded = _fsdp_block(shape, setup)
    head = shape.head_matmul_weights() / tp + shape.features.norm_params_per_unit * shape.hidden_size
    if accumulates_unsharded:
        # the last block's padded fp32 reduce-scatter input in place of its unpadded fp32 accumulation
        held, reduce_input = grads, 4.0 * (padded - block)
        unsharded_grads = 0.0 if elem == 4 else (block + head) * elem
    else:
        # one micro-batch a step: the sharded gradients of the blocks after it only; more: every block's, from the
        # micro-batch before
        one_microbatch = setup.microbatches_per_step == 1
        after = layers - 1 - k
        held = grads * min(1.0, after * block / tp_rank_params(shape, setup)) if one_microbatch else grads
        reduce_input = 4.0 * padded
        unsharded_grads = (block + head) * elem
    # the blocks before it, and under checkpointing the block's own layer, recomputed for its backward, in full
    # (measured: the dry run's peak inside that backward, -3.7% to +6.2% of this; +32% without the layer at
    # micro-batch 4 x 4,096 tokens, where one layer's activations and their gradients outweigh the block)
    acts = activation_bytes(shape, setup=setup, num_layers=k, with_head=False, in_flight=1)
    if reshards:  # the previous block's all-gather, which the first block does not prefetch
        prefetched = padded if k > 0 else 0.0
    else:  # every block gathered since forward, but the last, resharded after its backward
        prefetched = -padded
    return (rank.params + held + rank.master + rank.optimizer + acts + reduce_input + unsharded_grads
            + (gathered + prefetched) * elem)


def _expert_parallel_gathered(shape: ModelShape, setup: Setup, *, reshards: bool) -> float:
    """Parameters a rank holds gathered at the start of backward under expert parallelism, beside its own shards.
    The dense ones as plain FSDP2 holds them: under fsdp_ep the root's and the last block's (every block's without
    reshard_after_forward), under ep every dense parameter (replicate's compute copy). The experts as their own
    FSDP2 unit holds them, over efsdp or a one-rank edp, whose unsharded copy is separate storage even on one rank:
    the last block's E / ep (every block's without reshard_after_forward); replicate over an edp of several ranks
    copies every layer's. Measured on model=tiny_moe, 2 and 4 ranks, ep 2, fp32 and bf16, resharding on and off:
    tests/launched/test_moe.py, docs/moe.md."""
    local = expert_rank_elements(shape, setup)  # the rank's E / ep experts of every layer
    dense = dense_rank_params(shape, setup)
    dense_block = shape.layer_params_tp(setup.tensor_parallel_size) - shape.expert_params
    experts = local / shape.num_layers if setup.reshard_after_forward else local
    if setup.shard_with == "fsdp":  # fsdp_ep
        return (dense - (shape.num_layers - 1) * dense_block if reshards else dense) + experts
    return dense + (local if setup.dims.degree("edp") > 1 else experts)  # ep: replicate's copies


def fsdp_padded(dims: tuple[int, ...], n: int) -> int:
    """Elements of one parameter as FSDP2 holds it over n ranks, all shards together: split on dim 0 into
    ceil(d0 / n) rows per rank (torch.chunk's), the last ranks' padded (a parameter with fewer rows than ranks
    takes a padded row on every rank). What it allocates n-ways and all-gathers."""
    return -(-dims[0] // n) * n * math.prod(dims[1:]) if dims else n


def fsdp_gathered(shape: ModelShape, n: int, *, reshards: bool) -> int:
    """Elements FSDP2 holds all-gathered over n ranks at the start of backward: the root's parameters and the last
    block's (every block's without resharding), each at its padded size (`fsdp_padded`), since the unsharded
    parameters are views into the padded all-gather output. A parameter with fewer rows than ranks (an MoE layer's
    E experts, its router, at 1,024 ranks) is gathered n rows long: the dry run of a 128-expert model under plain
    fsdp at 1,024 ranks peaked 64% above the prediction that counted real sizes (37% above this count alone)."""
    every = sum(fsdp_padded(dims, n) for dims in shape.param_shapes())
    if not reshards:
        return every
    return every - (shape.num_layers - 1) * fsdp_block_padded(shape, n)


def fsdp_block_padded(shape: ModelShape, n: int) -> int:
    """Elements of one block as FSDP2 all-gathers and reduce-scatters it over n ranks, padding included."""
    return sum(fsdp_padded(dims, n) for module in shape.layer_modules() for dims in module)


def expert_padded(dims: tuple[int, ...], ep: int, efsdp: int) -> int:
    """Elements of one stacked expert tensor (E x a x b) on one rank's efsdp group under fsdp_ep, all its shards
    together: E/ep experts, split by expert over efsdp, or by rows (dim 1) where efsdp has more ranks than experts
    (parallel/experts.py)."""
    local = dims[0] // ep
    if efsdp > local:
        return local * fsdp_padded(dims[1:], efsdp)
    return fsdp_padded((local, *dims[1:]), efsdp)


def fsdp_rank_elements(shape: ModelShape, setup: Setup) -> Optional[float]:
    """Parameters one rank holds under FSDP2 (fsdp, hsdp, fsdp_ep), padding included, times the dp_shard degree
    (the figure model_state_bytes divides by it); under tensor parallelism with expert parallelism the dense TP slice
    and the experts' FSDP2 shards over efsdp; None where another partitioning applies (ZeRO's flat partitions,
    tensor parallelism's slices, pipeline stages). Exactly params / N where every parameter's dim 0
    divides; at 1,024 ranks an MoE model's routers (E rows) and per-head norms are padded (Qwen3-30B-A3B: +0.6%)."""
    if setup.tensor_parallel_size > 1 and setup.ep > 1:  # tp, fsdp_tp: the dense TP slice, the experts over efsdp
        return dense_rank_params(shape, setup) + expert_rank_stored(shape, setup) * setup.dims.dp_shard
    if setup.family != "fsdp" or setup.shard_with != "fsdp":
        return None
    n, ep = setup.dims.dp_shard, setup.ep
    efsdp = setup.dims.degree("efsdp") if ep > 1 else 1
    per_rank = 0.0
    for dims in shape.param_shapes():
        if ep > 1 and shape.is_experts(dims):  # stacked experts: over efsdp, after ep
            per_rank += expert_padded(dims, ep, efsdp) / efsdp
        else:
            per_rank += fsdp_padded(dims, n) / n
    return per_rank * n


def expert_rank_elements(shape: ModelShape, setup: Setup) -> float:
    """The experts' parameters one rank holds where nothing shards them further: all of them, or E / ep of every
    MoE layer's under expert parallelism (strategy=ep's whole copies over edp)."""
    return shape.num_layers * shape.expert_params / setup.ep if shape.num_experts else 0.0


def expert_rank_stored(shape: ModelShape, setup: Setup, *, rank: int = 0) -> Optional[float]:
    """Elements of the experts' parameters rank `rank` stores: whole under ddp, E / ep of them under ep, FSDP2's
    padded shards under fsdp, fsdp_ep and tensor parallelism with strategy.ep (over efsdp, after ep), ZeRO-3's
    partition of each tensor (ceil(n / N) elements, padding included, as DeepSpeed partitions each parameter on its
    own), a pipeline stage's own layers' (rank = stage x D + replica; pp_dp's FSDP stages: their share, as
    `model_state_bytes` counts a stage); None for a dense model and under ZeRO-1/2, whose flat partitions cut across
    parameters."""
    if not shape.num_experts or (setup.family == "zero" and setup.zero_stage != 3):
        return None
    if setup.family == "pipeline":
        return _stage_experts(shape, setup, rank=rank) / shards(setup).weights
    experts = [d for d in shape.param_shapes() if shape.is_experts(d)]
    if setup.family == "zero":  # each expert tensor's partition (its ds_tensor), what telemetry counts
        n = setup.data_parallel_size
        return float(sum(-(-math.prod(d) // n) for d in experts))
    if setup.ep > 1 and setup.dims.expert_dims[0] == "efsdp":  # fsdp_ep; tp, fsdp_tp with strategy.ep
        efsdp = setup.dims.degree("efsdp")
        return sum(expert_padded(d, setup.ep, efsdp) / efsdp for d in experts)
    if setup.family != "fsdp" or setup.shard_with != "fsdp":
        return expert_rank_elements(shape, setup)
    n = setup.dims.dp_shard
    return sum(fsdp_padded(d, n) / n for d in experts)


def _stage_experts(shape: ModelShape, setup: Setup, *, rank: int) -> float:
    """The experts of the pipeline stage rank `rank` runs (its layers', every layer MoE), whole."""
    split = list(setup.split_points) if setup.split_points else None
    layers = stage_layers(shape, num_stages=setup.num_stages, split_points=split)
    return float(layers[rank // setup.data_parallel_size] * shape.expert_params)


def expert_param_bytes(shape: ModelShape, setup: Setup, *, rank: int = 0) -> Optional[float]:
    """Bytes of the experts' parameters on rank `rank` (telemetry's memory/expert_params_bytes), as
    `expert_rank_stored` counts them."""
    elements = expert_rank_stored(shape, setup, rank=rank)
    return None if elements is None else elements * setup_state_bytes(setup).weights


def expert_state_bytes(shape: ModelShape, setup: Setup, *, rank: int = 0) -> Optional[dict[str, float]]:
    """The experts' parameters, gradients and optimizer state (with any master copy; step counters left out, as in
    the optimizer category) on rank `rank`: telemetry's memory/expert_{params,grads,optimizer}_bytes."""
    elements = expert_rank_stored(shape, setup, rank=rank)
    if elements is None:
        return None
    b = setup_state_bytes(setup)
    if setup.family == "pipeline":  # each category over its own shards, as model_state_bytes counts a stage
        whole, sh = _stage_experts(shape, setup, rank=rank), shards(setup)
        return {"params": elements * b.weights, "grads": whole * b.grads / sh.grads,
                "optimizer": whole * (b.optimizer + b.master) / sh.optimizer}
    return {"params": elements * b.weights, "grads": elements * b.grads,
            "optimizer": elements * (b.optimizer + b.master)}


def dense_rank_params(shape: ModelShape, setup: Setup) -> float:
    """The parameters one rank holds that are not experts (tp_rank_params, less the rank's own experts)."""
    return tp_rank_params(shape, setup) - expert_rank_elements(shape, setup)


def tp_rank_params(shape: ModelShape, setup: Setup) -> float:
    """Parameters one rank holds under tensor parallelism of degree t (all of them when t = 1): each layer's
    matmul weights and column-parallel biases, the token embedding and the untied LM head split t ways (by
    vocabulary), everything else (norms, GPT-2's positions, row-parallel biases) whole; under expert parallelism
    over replicas (ep: t = 1), E / ep of each MoE layer's experts."""
    t = setup.tensor_parallel_size
    layers = shape.num_layers * shape.layer_params_tp(t)
    vocab_split = shape.vocab_size * shape.hidden_size * (1 if shape.tie_embeddings else 2)
    experts_elsewhere = shape.num_layers * shape.expert_params - expert_rank_elements(shape, setup)
    return shape.embedding_params() + layers + shape.head_params() - vocab_split * (1 - 1 / t) - experts_elsewhere


def _param_elem(setup: Setup) -> int:
    """Bytes of a parameter as ZeRO holds it: the training dtype."""
    return element_bytes(setup.precision)


def zero3_partitioned(shape: ModelShape, setup: Setup) -> tuple[float, int]:
    """(elements ZeRO-3 partitions, modules holding any): what it gathers. Parameters under
    stage3_param_persistence_threshold stay whole on every rank and are never gathered."""
    threshold = setup.zero3_persistence_threshold
    modules = shape.module_params()
    persistent = sum(n for m in modules for n in m if n < threshold)
    return float(shape.num_params - persistent), sum(1 for m in modules if any(n >= threshold for n in m))


def zero3_keeps_for_backward(setup: Setup, partitioned: float) -> bool:
    """Whether ZeRO-3 keeps what forward gathered until backward uses it again: all `partitioned` elements (from
    zero3_partitioned) within stage3_max_reuse_distance. One gather per micro-batch instead of two, a whole model
    held at the turn. The memory model and the communication model both ask here."""
    return setup.zero3_max_reuse_distance >= partitioned


def zero3_gathered(shape: ModelShape, setup: Setup) -> tuple[float, float]:
    """(bytes of non-persistent parameters ZeRO-3 holds gathered at its peak, elements of persistent parameters).

    See the module docstring; all counts in elements of the whole model (gathering is not sharded)."""
    if setup.family != "zero" or setup.zero_stage != 3:
        return 0.0, 0.0
    threshold = setup.zero3_persistence_threshold
    partitioned = zero3_partitioned(shape, setup)[0]
    persistent = shape.num_params - partitioned
    largest = max(sum(n for n in m if n >= threshold) for m in shape.module_params())
    kept = partitioned if zero3_keeps_for_backward(setup, partitioned) else largest
    if setup.zero3_prefetch_bucket_size and setup.zero3_max_live_parameters:
        # (a live limit of 0: DeepSpeed's coordinator prefetches nothing, as without a bucket)
        # every module's entry prefetches at least one parameter while fewer than max_live are gathered (modules
        # without parameters too), faster than modules use them up: the gathered set fills to the live limit, and
        # the last prefetch or the module in use goes over it by at most one module
        live = max(kept, setup.zero3_max_live_parameters) + largest
    else:
        live = kept
    return float(min(partitioned, live) * _param_elem(setup)), float(persistent)


def zero3_gathered_grads(shape: ModelShape, setup: Setup) -> float:
    if setup.family != "zero" or setup.zero_stage != 3:
        return 0.0
    return float(max(sum(m) for m in shape.module_params()) * _param_elem(setup))


def zero_step_grads(num_params: float, setup: Setup) -> float:
    """The fp32 copy of this rank's gradient partition that ZeRO builds for the optimizer step."""
    if setup.family != "zero":
        return 0.0
    return 4.0 * num_params / setup.data_parallel_size


def weight_copy_bytes(shape: ModelShape, *, setup: Setup, num_layers: int, with_head: bool, in_flight: int,
                      first_layer: int = 0) -> float:
    """Autocast's 16-bit copies of the matmul weights a rank keeps for backward, per micro-batch in flight."""
    if not setup.autocast_16bit:
        return 0.0
    layer = shape.layer_matmul_weights() / setup.tensor_parallel_size
    if setup.ep > 1 and shape.num_experts:  # tp with strategy.ep: the experts' FSDP2 unit gathers them in the
        whole = shape.router_weight + shape.shared_expert_params  # the router and a shared expert: whole on every rank
        dense = shape.layer_matmul_weights() - shape.expert_matmul_weights - whole
        layer = dense / setup.tensor_parallel_size + whole
    head = shape.head_matmul_weights() / setup.tensor_parallel_size if with_head else 0
    checkpointed = setup.checkpointed_layers(num_layers, first_layer)
    if checkpointed:  # selective recomputes the casts too
        # a checkpointed block's copies exist only while it is recomputed, after its micro-batch's head is
        # released; the blocks train.checkpoint_every leaves out keep theirs (those after the last checkpointed
        # one until backward reaches it)
        plain = in_flight * (num_layers - checkpointed) * layer
        freed = setup.trailing_plain_layers(num_layers, first_layer) * layer
        return float((plain + (in_flight - 1) * head + max(head, layer - freed)) * element_bytes(setup.precision))
    return float(in_flight * (num_layers * layer + head) * element_bytes(setup.precision))


def pipeline_in_flight(setup: Setup, *, stage: int) -> int:
    """Micro-batches whose activations a stage holds at its peak: GPipe all M, 1F1B at most K - stage."""
    m = setup.microbatches_per_step
    if setup.schedule == "1f1b":
        return min(setup.num_stages - stage, m)
    return m


def layer_activation_bytes(shape: ModelShape, *, micro_batch_size: int, seq_len: int, elem: int,
                           attention_scores: bool = False, fused_gelu: bool = False, norm_elem: int = 0,
                           autocast: bool = False, tp: int = 1, sequence_parallel: bool = False,
                           experts_fp32: bool = False) -> float:
    """Bytes one transformer layer saves for backward for one micro-batch (see the module docstring).
    experts_fp32: an MoE layer's grouped experts multiply in fp32 (`experts_in_fp32`).

    attention_scores: eager attention keeps the a·s² scores; fused_gelu: a GELU that saves only its input
    (Korthikanti's assumption) instead of transformers' composed tanh GELU; norm_elem: bytes of a norm's
    saved input when it differs from `elem` (4 under autocast); autocast: each matmul casts its input to
    16 bits itself (Llama's separate q/k/v and gate/up projections then keep one copy each); tp:
    tensor-parallel degree, which splits
    what lies between a column- and a row-parallel projection (q/k/v, attention out, MLP intermediates,
    scores) and leaves the rest whole (Korthikanti et al. without sequence parallelism); sequence_parallel
    splits the norms' inputs too. The gathered inputs of attention and the MLP stay whole: their
    matmuls keep them for the weight gradients (torch's DTensor does not re-gather them in backward)."""
    s, b, h = seq_len, micro_batch_size, shape.hidden_size
    q_k_v = shape.q_dim + 2 * shape.kv_dim
    # GPT-2: fc output, GELU output, and 3 more ffn-wide tensors that transformers' tanh GELU ("gelu_new",
    # composed of pow/tanh/mul ops, not fused) saves: tanh output, 0.5·x and 1 + tanh.
    # Llama (SwiGLU): gate output, SiLU output, up output, their product.
    f = shape.features
    mlp = 4 * shape.routed_ffn if f.gated_mlp else (2 if fused_gelu else 5) * shape.ffn
    # attention in (the q, k and v projections' inputs), MLP in (gate's and up's): one tensor each, except
    # that under autocast separate projections each keep their own 16-bit cast of it
    # (an MoE layer's: the router's, one; each expert's rows are its pairs', moe_routing_bytes)
    mlp_one = f.fused_gate_up or not f.gated_mlp or bool(shape.num_experts)
    attn_in, mlp_in = (1 if f.fused_qkv else 3, 1 if mlp_one else 2) if autocast else (1, 1)
    # attention in, q/k/v, attention out, MLP in, MLP intermediates; and the two norms' saved tensors
    values = attn_in * h + (q_k_v + shape.q_dim + mlp) / tp + mlp_in * h
    norms = 2 * h / (tp if sequence_parallel else 1)
    masks = 2 * h if shape.dropout > 0 else 0  # attention-output and MLP-output dropout (1 byte each)
    per_token = values * elem + norms * norm_saved_bytes(shape, norm_elem or elem) + masks
    per_token += moe_routing_bytes(shape, elem, autocast=autocast, experts_fp32=experts_fp32, tp=tp)
    per_token += shared_expert_bytes(shape, elem, autocast=autocast)
    if shape.qk_norm:  # per-head RMSNorms on q and k: their fp32 input and normalized output, split with the heads
        per_token += (shape.q_dim + shape.kv_dim) * norm_saved_bytes(shape, elem) / tp
    scores = 0.0
    if attention_scores:  # eager attention: softmax output (+ dropout mask and output)
        scores = shape.num_heads / tp * s * s * b * ((2 * elem + 1) if shape.dropout > 0 else elem)
    return s * b * per_token + scores + experts_offsets_bytes(shape)


def ep_dispatch_bytes(shape: ModelShape, setup: Setup) -> float:
    """What expert parallelism's dispatch (parallel/experts.py) saves in one MoE layer for one micro-batch beyond
    transformers' own experts loop, at balanced routing (each rank's experts receive the T x k rows it sends): the
    rows back from the experts, T k h in the compute dtype, which the top-k weighting keeps, and the sorted pairs'
    order (int64). Measured in one process with the experts on a one-rank ep mesh, model=tiny_moe: exactly this
    (tests/unit/test_moe.py); on more ranks the received rows follow the routing: the busiest rank's experts hold
    setup.ep_overload times the balanced share (measured on 2 ranks, every token routed to rank 0's experts:
    tests/launched/test_moe.py)."""
    if setup.ep <= 1 or not shape.num_experts:
        return 0.0
    # under tensor parallelism each rank of a tp group dispatches its 1/tp share of the tokens
    pairs = setup.micro_batch_size * setup.seq_len * shape.experts_per_token / setup.tensor_parallel_size
    elem = element_bytes(setup.precision)
    # the busiest rank (setup.ep_overload): its experts keep what they save for every row they receive beyond
    # the balanced share: the row in and out, the gated MLP's 4 intermediates, the experts loop's int64 row index
    received = (setup.ep_overload - 1) * pairs * ((4 * shape.moe_ffn + 2 * shape.hidden_size) * elem + 8)
    return pairs * (shape.hidden_size * elem + 8) + received


def moe_routing_bytes(shape: ModelShape, elem: int, *, autocast: bool = False, experts_fp32: bool = False,
                      tp: int = 1) -> float:
    """What an MoE layer saves per token beside the experts' own intermediates (counted in the MLP's, k x width),
    by model.experts_implementation. Every one: the router's fp32 softmax (E), its top-k weights (fp32) and indices
    (int64), and their renormalising sum (fp32). Then, for each of the token's k (token, expert) pairs:
    - eager (transformers' loop over experts): the row's token and top-k position (int64, one `where`), its
      routing weight, the row in and the expert's output row, and the weighted output row (fp32 under autocast,
      whose routing weights are fp32);
    - grouped_mm: three int64 indices (the sort and its inverse), the weight, the row in and out (fp32 where
      `experts_fp32`: fp16 autocast leaves torch's grouped product in fp32); and E int32 offsets a layer
      (`experts_offsets_bytes`, which layer_activation_bytes adds);
    - batched_mm: the row in and out, the weight, and a gathered copy of its expert's three matrices (3 h x width
      elements a pair: transformers' batched_mm is built for a few tokens, not training).
    Measured with the activation meter on model=tiny_moe against the same model with a dense MLP of k x width, fp32
    and bf16 autocast, each implementation: exactly this (tests/unit/test_moe.py). Under tensor parallelism (`tp`,
    with strategy.ep) the router runs on every token on every rank, and each rank dispatches a 1/tp share of them."""
    if not shape.num_experts:
        return 0.0
    k, e, h, i = shape.experts_per_token, shape.num_experts, shape.hidden_size, shape.moe_ffn
    router = 4 * e + 12 * k + 4
    impl = shape.experts_implementation
    if impl == "grouped_mm":
        rows = 4 if experts_fp32 else elem
        # the intermediates run at `rows` too: the MLP's term counted them at elem
        pair = 24 + elem + 2 * h * rows + 4 * i * (rows - elem)
    elif impl == "batched_mm":
        pair = elem * (2 * h + 3 * h * i + 1)
    else:
        pair = 16 + elem + 2 * h * elem + h * (4 if autocast else elem)
    return router + k * pair / tp


def shared_expert_bytes(shape: ModelShape, elem: int, *, autocast: bool = False) -> float:
    """What a shared expert (Qwen2-MoE's) saves per token: its SwiGLU's four S-wide tensors (gate and up outputs, the
    activation, their product), its output and its gate's sigmoid (one element), both kept by their product; under
    autocast its three projections' (gate, up and the 1 x h gate) own 16-bit casts of the block's input. Whole on
    every rank under tensor parallelism. Measured with the activation meter on a 2-layer Qwen2-MoE (h 64, S 64 and 96)
    against the same block without it, fp32 and bf16 autocast: exactly this (tests/unit/test_moe.py)."""
    s = shape.shared_expert_ffn_hidden_size if shape.num_experts else 0
    if not s:
        return 0.0
    h = shape.hidden_size
    return (4 * s + h + 1) * elem + (3 * h * elem if autocast else 0)


def experts_in_fp32(shape: ModelShape, setup: Setup) -> bool:
    """Whether the experts' grouped products run in fp32 in a 16-bit run: torch does not autocast
    `aten::_grouped_mm`; a bf16 run registers it (model.autocast_grouped_mm), an fp16 one multiplies in fp32."""
    return (shape.experts_implementation == "grouped_mm" and setup.autocast_16bit
            and setup.precision != "bf16")


def experts_offsets_bytes(shape: ModelShape) -> float:
    """grouped_mm's per-layer offsets: one int32 per expert, whatever the tokens."""
    return 4.0 * shape.num_experts if shape.num_experts and shape.experts_implementation == "grouped_mm" else 0.0


def selective_kept_bytes(shape: ModelShape, *, micro_batch_size: int, seq_len: int, elem: int, tp: int = 1,
                         sequence_parallel: bool = False) -> float:
    """Bytes one layer keeps for one micro-batch under selective checkpointing, beside its input: the outputs of
    its matrix products and attention (dist_train.model._SAVED_OPS), measured with the activation meter. The
    projections into q/k/v, the MLP's up (and gate) projection and attention's output are split by tensor
    parallelism; attention's log-sum-exp (fp32, one per head and token) too; the two output projections return
    whole partial sums, which tensor parallelism then all-reduces into another whole tensor each (sequence
    parallelism reduce-scatters them into the rank's share of the sequence)."""
    f = shape.features
    split = shape.q_dim + 2 * shape.kv_dim + shape.q_dim + (2 if f.gated_mlp else 1) * shape.ffn
    whole = 2 * shape.hidden_size
    if tp > 1:
        whole += 2 * shape.hidden_size / (tp if sequence_parallel else 1)
    per_token = (split / tp + whole) * elem + shape.num_heads / tp * 4
    return seq_len * micro_batch_size * per_token


def norm_saved_bytes(shape: ModelShape, residual_elem: int) -> int:
    """Bytes a norm keeps per hidden unit: LayerNorm its input; Llama's RMSNorm (and the other architectures')
    an fp32 copy of its input and its normalized output in the residual stream's dtype (Gemma's in fp32)."""
    if shape.features.norm_output_fp32:  # Gemma's RMSNorm scales by (1 + weight) in fp32: its output is fp32 too
        return 4 + 4
    return residual_elem if shape.features.layer_norm else 4 + residual_elem


def _layer_and_head_bytes(shape: ModelShape, setup: Setup, *, with_head: bool) -> tuple[float, float]:
    """What one micro-batch saves for backward in one layer, and at the head (0 without it)."""
    elem = element_bytes(setup.precision)
    norm_elem = 4 if setup.autocast_16bit else elem
    s, b = setup.seq_len, setup.micro_batch_size
    tp, sp = setup.tensor_parallel_size, setup.sequence_parallel and setup.tensor_parallel_size > 1
    layer = layer_activation_bytes(shape, micro_batch_size=b, seq_len=s, elem=elem, norm_elem=norm_elem,
                                   autocast=setup.autocast_16bit, tp=tp, sequence_parallel=sp,
                                   experts_fp32=experts_in_fp32(shape, setup))
    layer += ep_dispatch_bytes(shape, setup)
    # the final norm's saved tensors (split by sequence under sequence parallelism), the head's input, the
    # fp32 log-softmax of the logits (split by vocabulary under tensor parallelism)
    final_norm = shape.hidden_size * norm_saved_bytes(shape, norm_elem) / (tp if sp else 1)
    head = s * b * (final_norm + shape.hidden_size * elem + shape.vocab_size * 4 / tp) if with_head else 0.0
    return layer, head


def loss_backward_bytes(shape: ModelShape, setup: Setup) -> float:
    """The loss's backward at the start of backward, beside every saved activation: the gradient of the fp32
    log-probabilities (nll_loss's) and that of the fp32 logits (log_softmax's), s·b·V·4 bytes each, split by
    vocabulary under tensor parallelism. With a 128K vocabulary this is the step's peak: measured on an H200
    (llama_1b, seq 2048, micro-batch 4 and 2) the CUDA allocator's peak was 7.9 and 4.0 GiB above the categories,
    these two tensors' 7.8 and 3.9 (docs/BENCHMARKS.md 'gpu')."""
    return 2.0 * setup.seq_len * setup.micro_batch_size * shape.vocab_size * 4 / setup.tensor_parallel_size


def backward_start_extra(shape: ModelShape, setup: Setup) -> float:
    """What the start of backward holds above the activation category (whose peak is the end of forward, or
    under checkpointing the first recomputed layer): the loss's backward temporaries, with the head's tensors."""
    extra = loss_backward_bytes(shape, setup)
    if setup.activation_checkpointing == "none" or setup.checkpointed_layers(shape.num_layers) == 0:
        return extra
    layer, head = _layer_and_head_bytes(shape, setup, with_head=True)
    return max(0.0, head + extra - max(head, layer - _kept_bytes(shape, setup)))


def _kept_bytes(shape: ModelShape, setup: Setup) -> float:
    """What one layer keeps for one micro-batch beside its input: its selective checkpointing's outputs, nothing
    under full checkpointing."""
    if setup.activation_checkpointing != "selective":
        return 0.0
    tp = setup.tensor_parallel_size
    return selective_kept_bytes(shape, micro_batch_size=setup.micro_batch_size, seq_len=setup.seq_len,
                                elem=element_bytes(setup.precision), tp=tp,
                                sequence_parallel=setup.sequence_parallel and tp > 1)


def activation_bytes(shape: ModelShape, *, setup: Setup, num_layers: int, with_head: bool, in_flight: int,
                     first_layer: int = 0) -> float:
    """Activations a rank holds at its peak: `in_flight` micro-batches through `num_layers` layers from block
    `first_layer` (a pipeline stage's)."""
    norm_elem = 4 if setup.autocast_16bit else element_bytes(setup.precision)
    s, b = setup.seq_len, setup.micro_batch_size
    tp, sp = setup.tensor_parallel_size, setup.sequence_parallel and setup.tensor_parallel_size > 1
    layer, head = _layer_and_head_bytes(shape, setup, with_head=with_head)
    checkpointed = setup.checkpointed_layers(num_layers, first_layer)
    if checkpointed:
        # train.checkpoint_every: the other blocks keep every activation, as without checkpointing; those after the
        # last checkpointed one are freed by the time backward recomputes it
        plain = in_flight * (num_layers - checkpointed) * layer
        freed = setup.trailing_plain_layers(num_layers, first_layer) * layer
        num_layers = checkpointed
        # Each micro-batch in flight keeps its layers' inputs (the residual stream: fp32 under autocast), and under
        # selective checkpointing their kept outputs. The peak is either the end of the last forward (its head's
        # tensors alive) or the first recomputation in backward, by when that micro-batch's head has been
        # released: one layer is then held in full, which takes over that layer's kept outputs.
        # Under sequence parallelism the blocks after the first take (and keep) their rank's share of the
        # sequence; the first block's input is the whole sequence, split inside it.
        kept_layers = 1 + (num_layers - 1) / tp if sp and num_layers > 0 else num_layers
        inputs = in_flight * kept_layers * s * b * shape.hidden_size * norm_elem
        kept = _kept_bytes(shape, setup)
        return (plain + inputs + in_flight * num_layers * kept + (in_flight - 1) * head
                + max(head, layer - kept - freed))
    return in_flight * (num_layers * layer + head)


def kv_cache_bytes(shape: ModelShape, *, batch: int, context: int, elem: int) -> float:
    """2 (K and V) x batch x layers x kv_heads x head_dim x context x bytes; kv_heads = heads without GQA."""
    return 2 * batch * shape.num_layers * shape.kv_heads * shape.head_dim * context * elem
