"""The parallel degrees of a run, in one object: how the world's ranks are laid out and how a global batch splits.

torchtitan's and torchtune's `ParallelDims`, for this project. Every strategy states its degrees here
(`StrategyConfig.parallel_dims(world_size)`), and everything else asks this object: the loop and the data (which
slice of the batch a rank trains on), the strategies (the one device mesh, built from it), telemetry (collectives
per mesh dimension), the estimator, the dry run and the advisor.

The dimensions, outermost first (a rank's coordinates are its index in that row-major order, torchtitan's
layout: a tensor-parallel group is consecutive ranks, one node's GPUs; pipeline stages are the farthest apart):

    pp            pipeline stages
    dp_replicate  whole replicas of the model state (DDP; HSDP's outer dimension)
    dp_shard      ranks that shard one replica's state (FSDP, ZeRO; HSDP's inner dimension)
    cp            context parallelism: ranks that split a sequence (room for it; no strategy sets it yet)
    tp            tensor parallelism: ranks that split each projection

The data-parallel degree, the number of distinct slices of a global batch, is dp_replicate x dp_shard
(`data_parallel`). Plain `dp` is never a dimension: it names strategy=dp, nn.DataParallel in one process.
Expert parallelism (`ep`) borrows its ranks from dp_shard x cp x tp, as in torchtitan (strategy=fsdp_ep; tp and
fsdp_tp with strategy.ep): the experts' own mesh is (efsdp, ep), efsdp = dp_shard x cp x tp / ep ranks that shard the
same experts again. The ranks of a tensor-parallel group share a batch: each sends its own share of the tokens to the
experts. Where nothing shards and nothing splits (dp_shard x cp x tp = 1: strategy=ep, whole replicas of the dense
weights) it borrows from dp_replicate instead: the experts' mesh is (edp, ep), edp = dp_replicate / ep ranks that hold
the same experts whole.

This module is pure arithmetic; the mesh itself is built by dist_train.parallel.mesh.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Optional

from dist_train.errors import ConfigError, require

ORDER = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


def share_bounds(rows: int, *, size: int, rank: int) -> tuple[int, int]:
    """The rows [start, end) of `rows` that rank `rank` of a tensor-parallel group of `size` takes as its share
    (an MoE layer's tokens under expert parallelism, which every rank of the group holds): contiguous chunks of
    ceil(rows / size), the last ones shorter (or empty)."""
    per = -(-rows // size)
    return min(rank * per, rows), min((rank + 1) * per, rows)


def nodes_of_launch(world_size: int) -> int:
    """How many nodes a launch of `world_size` processes spans, as torchrun and Slurm's steps say it
    (WORLD_SIZE / LOCAL_WORLD_SIZE; one node where LOCAL_WORLD_SIZE is unset): hsdp's default replicas."""
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world_size) or world_size)
    return max(world_size // max(per_node, 1), 1)


@dataclass(frozen=True)
class ParallelDims:
    world_size: int
    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1
    ep: int = 1
    # Dimensions that stay in the mesh at degree 1, where the strategy applies its parallelism over them anyway
    # (fsdp_tp on as many ranks as its tp degree: FSDP over a one-rank dp_shard dimension).
    kept: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for name in (*ORDER, "ep"):
            require(getattr(self, name) >= 1, f"parallel degree {name}={getattr(self, name)} must be >= 1")
        product = math.prod(getattr(self, name) for name in ORDER)
        if product != self.world_size:
            used = " x ".join(f"{name} {getattr(self, name)}" for name in ORDER if getattr(self, name) > 1) or "1"
            raise ConfigError(f"the parallel degrees ({used} = {product}) must multiply to the number of processes "
                              f"({self.world_size})")
        lender, ranks = self.expert_lender
        require(ranks % self.ep == 0, f"expert-parallel degree ep={self.ep} must divide {lender} = {ranks}")
        unknown = set(self.kept) - set(ORDER)
        require(not unknown, f"unknown mesh dimension(s) {sorted(unknown)}; known: {', '.join(ORDER)}")

    # ------------------------------------------------------------------ degrees
    def degree(self, name: str) -> int:
        if name == "efsdp":  # the experts' FSDP: the ranks of dp_shard x cp x tp that hold the same experts
            return 1 if self.expert_dims[0] == "edp" else self.expert_lender[1] // self.ep
        if name == "edp":  # the experts' replicas: the ranks of dp_replicate that hold the same experts whole
            return self.dp_replicate // self.ep if self.expert_dims[0] == "edp" else 1
        return int(getattr(self, name))

    @property
    def expert_lender(self) -> tuple[str, int]:
        """The ranks expert parallelism borrows its `ep` ranks from, and how many: dp_shard x cp (x tp where tensor
        parallelism splits the dense weights), or dp_replicate where nothing shards (strategy=ep)."""
        if self.dp_shard * self.cp * self.tp == 1 and self.dp_replicate > 1:
            return "dp_replicate", self.dp_replicate
        if self.tp > 1:
            return "dp_shard x cp x tp", self.dp_shard * self.cp * self.tp
        return "dp_shard x cp", self.dp_shard * self.cp

    @property
    def expert_dims(self) -> tuple[str, str]:
        """The experts' mesh dimensions, outer first: (efsdp, ep) where ep borrows from dp_shard x cp, (edp, ep)
        where it borrows from dp_replicate."""
        return ("edp" if self.expert_lender[0] == "dp_replicate" else "efsdp"), "ep"

    @property
    def data_parallel(self) -> int:
        """Data-parallel degree: how many distinct slices of each global batch are trained at once (dp_replicate x
        dp_shard). Not `dp`, which names strategy=dp, nn.DataParallel in one process."""
        return self.dp_replicate * self.dp_shard

    @property
    def model_split(self) -> int:
        """Ranks that compute one replica's micro-batch together (pipeline stages x context x tensor parallel)."""
        return self.pp * self.cp * self.tp

    @property
    def mesh_dim_names(self) -> tuple[str, ...]:
        """The named dimensions of this run's device mesh, outermost first: every degree above 1, and `kept`."""
        return tuple(name for name in ORDER if self.degree(name) > 1 or name in self.kept)

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        return tuple(self.degree(name) for name in self.mesh_dim_names)

    # ------------------------------------------------------------------ where a rank sits
    def coordinates(self, rank: int) -> dict[str, int]:
        """`rank`'s index along every dimension (row-major over ORDER)."""
        require(0 <= rank < self.world_size, f"rank {rank} is outside the world of {self.world_size}")
        out: dict[str, int] = {}
        for name in reversed(ORDER):
            rank, out[name] = divmod(rank, self.degree(name))
        return {name: out[name] for name in ORDER}

    def data_parallel_rank(self, rank: int) -> int:
        """Which slice of the global batch `rank` trains on (the ranks of one replica's model share a slice)."""
        c = self.coordinates(rank)
        return c["dp_replicate"] * self.dp_shard + c["dp_shard"]

    def group_ranks(self, rank: int, name: str) -> list[int]:
        """The ranks of `rank`'s group along dimension `name` (those that differ from it only there)."""
        c = self.coordinates(rank)
        stride = math.prod(self.degree(n) for n in ORDER[ORDER.index(name) + 1:])
        first = rank - c[name] * stride
        return [first + i * stride for i in range(self.degree(name))]

    # ------------------------------------------------------------------ the batch
    def check_batch(self, *, global_batch_size: int, micro_batch_size: int) -> None:
        """ConfigError unless the global batch splits into whole micro-batches on every data-parallel slice."""
        per_step = micro_batch_size * self.data_parallel
        require(
            global_batch_size % per_step == 0,
            f"train.global_batch_size={global_batch_size} must be divisible by train.micro_batch_size "
            f"({micro_batch_size}) x data-parallel size ({self.data_parallel}) = {per_step}",
        )

    def samples_per_replica(self, global_batch_size: int) -> int:
        return global_batch_size // self.data_parallel

    def microbatches(self, *, global_batch_size: int, micro_batch_size: int,
                     num_microbatches: Optional[int] = None) -> int:
        """Micro-batches a rank runs per optimizer step: gradient accumulation, or a pipeline schedule's micro-batches
        (`num_microbatches` when it sets them)."""
        if num_microbatches is not None:
            return num_microbatches
        return self.samples_per_replica(global_batch_size) // micro_batch_size

    def describe(self) -> str:
        """`dp_replicate 2 x dp_shard 2` (the dimensions above 1, or `1`)."""
        return " x ".join(f"{n} {self.degree(n)}" for n in ORDER if self.degree(n) > 1) or "1"


# ---------------------------------------------------------------------------------------------- the layouts, declared
# How each kind of strategy lays its ranks out, declared once: the strategies' `parallel_dims` and the estimator's
# `Setup.dims` (which must not import torch) both return `layout_dims(...)`, so the two cannot drift apart.
LAYOUTS = ("one", "replicate", "shard", "fsdp", "tp", "fsdp_tp", "ddp_tp", "pipeline")


def layout_dims(layout: str, world_size: int, *, replicas: int = 1, tp: int = 1, stages: int = 1,
                stage_dp: str = "dp_replicate", ep: int = 1) -> ParallelDims:
    """The degrees of a layout on `world_size` ranks:

        one        one process (single; dp, whose nn.DataParallel scatters over GPUs itself)
        replicate  every rank a whole replica (DDP, Accelerate's DDP)
        shard      the model state partitioned over every rank (ZeRO, Accelerate's FSDP and DeepSpeed)
        fsdp       `replicas` replicas, each sharded over world / replicas ranks (fsdp: 1 replica; hsdp); with `ep`,
                   the experts split over ep of those ranks (fsdp_ep)
        tp         every rank a tensor-parallel slice; with `ep`, the experts split over ep of those ranks
        fsdp_tp    tensor-parallel groups of `tp`, FSDP over the world / tp groups (kept at degree 1); with `ep`, the
                   experts split over ep of the world's ranks (consecutive: a tensor-parallel group's first)
        ddp_tp     tensor-parallel groups of `tp`, whole replicas of each across the world / tp groups (Megatron's
                   TP x DP; kept at degree 1); at tp 1 with `ep`, the experts split over ep of the replicas (ep)
        pipeline   `stages` stages, world / stages replicas of the pipeline over `stage_dp` (dp_replicate: whole
                   stages, DDP; dp_shard: FSDP-sharded stages)
    """
    w = world_size
    if layout == "one":
        return ParallelDims(1)
    if layout == "replicate":
        return ParallelDims(w, dp_replicate=w)
    if layout == "shard":
        return ParallelDims(w, dp_shard=w)
    if layout == "fsdp":
        return ParallelDims(w, dp_replicate=replicas, dp_shard=max(w // replicas, 1), ep=ep, kept=("dp_shard",))
    if layout == "tp":
        return ParallelDims(w, tp=w, ep=ep)
    if layout == "fsdp_tp":
        return ParallelDims(w, dp_shard=max(w // tp, 1), tp=tp, ep=ep, kept=("dp_shard",))
    if layout == "ddp_tp":
        return ParallelDims(w, dp_replicate=max(w // tp, 1), tp=tp, ep=ep, kept=("dp_replicate",))
    if layout == "pipeline":
        require(stage_dp in ("dp_replicate", "dp_shard"), f"a pipeline's replicas run over dp_replicate or dp_shard, "
                                                          f"not {stage_dp!r}")
        return ParallelDims(w, pp=stages, **{stage_dp: max(w // stages, 1)})
    raise ValueError(f"layout {layout!r} unknown; known: {', '.join(LAYOUTS)}")

