"""Each parallelism declared once: the mesh dimension it runs over, the model state it partitions there, and the
collectives it issues, per block, per micro-batch or per step. Pure data: no torch.

A run is a composition of these, read from its degrees (`composition`): a pipeline over `pp`, tensor parallelism over
`tp`, the experts over `ep` (each TP rank sending its share of the tokens, gathered back over `tp`) and their FSDP
over `efsdp` (or their replicas over `edp`), FSDP or a ZeRO stage over
`dp_shard`, replicas over `dp_replicate`. fsdp_tp is tensor parallelism then FSDP,
hsdp is FSDP then replicas, pp_dp a pipeline then replicas or FSDP of each stage: no combination has an entry of
its own. The estimator sizes every declared collective (dist_train/estimate/comm.py has one sizer per entry here, and
a test checks that it has no other), its memory model divides the state each one partitions, its step-time model
hides what each one says can overlap, and the dry run compares the collectives a rank really issues with them.

What the training code does is the reference: each entry says what strategies/ and parallel/ were measured to send
(tests/launched/test_dryrun.py compares the two per op, per mesh dimension and per byte).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from dist_train.parallel_dims import ParallelDims

# The categories of model state a data-parallel dimension can partition (the ZeRO paper's P_os, P_os+g, P_os+g+p).
STATE_CATEGORIES = ("weights", "grads", "optimizer")


@dataclass(frozen=True)
class Traffic:
    """One kind of collective a parallelism issues."""

    op: str  # all_reduce | all_gather | reduce_scatter | send | recv
    moves: str  # what travels: parameters, gradients, activations, vocabulary, norm gradients, boundary
    per: str  # the unit of calls: block (one per transformer block), module, bucket, micro-batch
    passes: str  # when, in words: forward, backward, after the step, ...
    # Whether it runs while forward or backward compute goes on, so that compute can hide it (FSDP's gathers and
    # reductions, DDP's buckets); False where it sits on the critical path (tensor parallelism's activations, a
    # pipeline's boundary, ZeRO-1's reduction after the last backward, every update after the step).
    overlaps: bool
    # The ZeRO paper's op where DeepSpeed issues another (the estimator's regime=mixed): "" = the same.
    paper_op: str = ""


@dataclass(frozen=True)
class Parallelism:
    name: str
    dim: str  # the mesh dimension (parallel_dims.ORDER)
    partitions: tuple[str, ...]  # STATE_CATEGORIES split over `dim`; the others are whole on every rank of it
    scope: str  # what `partitions` covers, in words
    traffic: tuple[Traffic, ...]
    summary: str


def _t(op: str, moves: str, per: str, passes: str, overlaps: bool, paper_op: str = "") -> Traffic:
    return Traffic(op, moves, per, passes, overlaps, paper_op)


_GATHER = _t("all_gather", "parameters", "block", "forward, and again in backward when resharded after forward", True)
_REDUCE_SCATTER = _t("reduce_scatter", "gradients", "block", "backward: once a step, or every micro-batch", True)
_UPDATE = _t("all_gather", "parameters", "bucket", "after the optimizer step (the updated partitions)", False)
# Where gradients are split over ranks, their global norm (clipping, the log) takes one all-reduce a step. A rank
# whose gradients several parallelisms split issues one, over all their dimensions together (fsdp_tp: tp x dp_shard;
# pp_dp with FSDP-sharded stages: pp x dp_shard), which its telemetry counts under no single dimension.
GRADIENT_NORM = _t("all_reduce", "gradient norm", "step", "after the last backward", False)
# Under expert parallelism the experts' gradients are DTensors on their own (efsdp, ep) mesh: their partial norm is
# all-reduced over the dimensions that split them, at once (the mesh flattens them: parallel/mesh.py), apart from the
# dense one's (strategies/base.py takes the norm mesh by mesh).
EXPERT_NORM = _t("all_reduce", "expert gradient norm", "step", "after the last backward", False)

PARALLELISMS: dict[str, Parallelism] = {p.name: p for p in (
    Parallelism(
        "replicate", "dp_replicate", (), "nothing: every rank holds a whole replica",
        (_t("all_reduce", "gradients", "bucket", "backward, once a step (held back while accumulating)", True),),
        "DDP; HSDP's outer dimension, where each rank all-reduces its gradient shard with the other replicas"),
    Parallelism(
        "fsdp", "dp_shard", STATE_CATEGORIES, "the whole model state",
        (_GATHER, _REDUCE_SCATTER, GRADIENT_NORM),
        "FSDP2: each block is one all-gather unit, gathered in the compute dtype; fp32 gradients reduce-scattered"),
    Parallelism(
        "zero1", "dp_shard", ("optimizer",), "the optimizer's state and its fp32 master weights",
        (_t("all_reduce", "gradients", "bucket", "after the last micro-batch's backward", False,
            paper_op="reduce_scatter"), _UPDATE, GRADIENT_NORM),
        "DeepSpeed ZeRO stage 1"),
    Parallelism(
        "zero2", "dp_shard", ("grads", "optimizer"), "gradients, optimizer state and master weights",
        (_t("all_reduce", "gradients", "bucket", "backward, every micro-batch", True, paper_op="reduce_scatter"),
         _UPDATE, GRADIENT_NORM),
        "DeepSpeed ZeRO stage 2"),
    Parallelism(
        "zero3", "dp_shard", STATE_CATEGORIES, "the whole model state",
        (_t("all_gather", "parameters", "module", "forward, and backward unless kept (stage3_max_reuse_distance)",
            True),
         _t("reduce_scatter", "gradients", "bucket", "backward, every micro-batch", True), GRADIENT_NORM),
        "DeepSpeed ZeRO stage 3"),
    Parallelism(
        "tp", "tp", STATE_CATEGORIES, "the blocks' projections and the vocabulary (embedding, head)",
        (_t("all_reduce", "activations", "block", "forward: each row-parallel output; backward: each column-parallel "
            "input gradient", False),
         _t("all_reduce", "vocabulary", "micro-batch", "the embedding's rows, the head's input gradient, "
            "loss_parallel's 3 reductions", False),
         _t("all_reduce", "norm gradients", "block", "backward: each per-head q/k norm's weight gradient (Qwen3's), "
            "partial over the ranks' heads", False), GRADIENT_NORM),
        "Megatron tensor parallelism on DTensor (transformers' per-architecture plan)"),
    Parallelism(
        "sequence_parallel", "tp", STATE_CATEGORIES, "as tp; activations between blocks split by sequence",
        (_t("all_gather", "activations", "block", "the norms' outputs before attention and the MLP, and back", False),
         _t("reduce_scatter", "activations", "block", "the row-parallel outputs, and back", False),
         _t("all_reduce", "norm gradients", "micro-batch", "every norm weight's gradient, partial by sequence, and "
            "each per-head q/k norm's, partial over the ranks' heads", False),
         _t("all_reduce", "vocabulary", "micro-batch", "as tp's", False), GRADIENT_NORM),
        "tensor parallelism with Megatron's sequence parallelism (strategy.sequence_parallel=true)"),
    Parallelism(
        "ep", "ep", STATE_CATEGORIES, "each MoE layer's experts: E / ep of them on each rank",
        (_t("all_to_all", "tokens", "block", "forward: the counts, then the routed rows there and back; backward: "
            "the rows' gradients both ways (a checkpointed block's recomputation, full or selective: its forward's three "
            "again)", False),
         EXPERT_NORM),
        "expert parallelism (fsdp_ep, ep): dist_train's own dispatch, dist.all_to_all_single"),
    Parallelism(
        "expert_shares", "tp", (), "nothing: each TP rank dispatches its 1/tp share of an MoE layer's tokens",
        (_t("all_gather", "expert outputs", "block", "forward: the TP ranks' shares of the experts' outputs; backward: "
            "the shares' input and routing-weight gradients", False),),
        "tensor parallelism with expert parallelism (tp, fsdp_tp with strategy.ep): the ranks of a TP group hold the "
        "same tokens, so each sends its share to the experts and the results are gathered"),
    Parallelism(
        "expert_fsdp", "efsdp", STATE_CATEGORIES, "a rank's E / ep experts, sharded again over the ranks holding them",
        (_t("all_gather", "expert parameters", "block", "forward, and again in backward when resharded after forward",
            True),
         _t("reduce_scatter", "expert gradients", "block", "backward: once a step", True), EXPERT_NORM),
        "FSDP2 of the experts over efsdp = dp_shard / ep (fsdp_ep), each layer's experts their own unit"),
    Parallelism(
        "expert_replicate", "edp", (), "nothing: the ranks holding the same E / ep experts hold them whole",
        (_t("all_reduce", "expert gradients", "block", "backward, once a step (held back while accumulating)", True),),
        "FSDP2's replicate of the experts over edp = dp_replicate / ep (ep), each layer's experts their own unit"),
    Parallelism(
        "pipeline", "pp", STATE_CATEGORIES, "each stage's blocks (and the embedding or head it owns)",
        (_t("send", "boundary", "micro-batch", "activations forward, their gradients backward", False),
         _t("recv", "boundary", "micro-batch", "activations forward, their gradients backward", False), GRADIENT_NORM),
        "GPipe or 1F1B over torch.distributed.pipelining"),
)}

# Where each parallelism is applied, innermost first: a pipeline cuts the model, tensor parallelism splits each
# stage's blocks, then the data-parallel dimensions shard and replicate what a rank holds (parallel/apply.py's order).
APPLICATION_ORDER = ("pipeline", "tp", "sequence_parallel", "ep", "expert_shares", "expert_fsdp", "expert_replicate",
                     "fsdp", "zero1", "zero2", "zero3", "replicate")
SHARDERS = ("fsdp", "zero1", "zero2", "zero3")


def composition(dims: ParallelDims, *, shard_with: Optional[str] = None,
                sequence_parallel: bool = False) -> tuple[Parallelism, ...]:
    """The parallelisms of a run with degrees `dims`, in APPLICATION_ORDER: one per dimension above 1 (or kept in the
    mesh at 1), `dp_shard` by `shard_with` (fsdp or a ZeRO stage)."""
    if shard_with is not None and shard_with not in SHARDERS:
        raise ValueError(f"shard_with={shard_with!r} unknown; known: {', '.join(SHARDERS)}")
    used = set(dims.mesh_dim_names)
    names = []
    if "pp" in used:
        names.append("pipeline")
    if "tp" in used:
        names.append("sequence_parallel" if sequence_parallel else "tp")
    if dims.ep > 1:  # the experts' split, then their FSDP2 or replicas (parallel/apply.py's experts step), before
        names.append("ep")  # the dense ones
        if "tp" in used:  # each TP rank dispatches its share of the tokens
            names.append("expert_shares")
        names.append("expert_replicate" if dims.expert_dims[0] == "edp" else "expert_fsdp")
    if "dp_shard" in used:
        if shard_with is None:
            raise ValueError(f"degrees {dims.describe()} shard over dp_shard: say with what ({', '.join(SHARDERS)})")
        names.append(shard_with)
    if "dp_replicate" in used:
        names.append("replicate")
    return tuple(PARALLELISMS[n] for n in names)

