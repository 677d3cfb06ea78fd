"""Pipeline parallelism on `torch.distributed.pipelining`: GPipe or 1F1B, one stage per rank, or pipelines
that are themselves data-parallel (strategy=pp_dp).

The model (built identically on every rank) is cut into K stages of contiguous transformer blocks,
balanced by parameter count unless `split_points` is given; the first stage also runs the embeddings, the
last the final norm, the LM head and the loss. K is the world size (gpipe, 1f1b), or `strategy.pp`: then
D = world / K replicas of the pipeline each train on 1/D of the global batch, on a (pp, dp) mesh with
rank = stage * D + replica (torchtitan's order: pipeline groups strided, a stage's replicas consecutive,
one node's GPUs). Each stage is data-parallel over its D copies, `strategy.dp_mode` says how: `replicate`
(DistributedDataParallel: one bucketed all-reduce of the stage's gradients per step) or `fsdp` (FSDP2
shards each block and the stage root over the replicas). Both run through the schedule's own support:
gradients are reduced once, after the last micro-batch's backward.

Each replica's schedule cuts its batch into `num_microbatches` micro-batches, stage 0 feeds the token
ids, the last stage the labels, and activations / their gradients travel by send/recv between
neighbours.

Matching one process (the same-loss promise):
- each micro-batch's loss is divided by M inside the loss function and the schedule does not rescale
  (`scale_grads=False`): the accumulated gradient is the gradient of the mean over the global batch,
  computed exactly as `accumulate` does for the other strategies;
- the gradient norm is global: every stage's squared norm is all-reduced before clipping, so every
  stage clips by the same coefficient a single process would use (over the pipeline's stages once the
  replicas agree, over every rank when FSDP shards them);
- data-parallel replicas average their gradients, so the step is the gradient of the global batch's mean;
- tied input/output embeddings: the first stage holds the embedding, the last its own copy as the head.
  Their gradients are summed across the two stages after backward (what autograd does in one process),
  so both copies take the same optimizer step and stay equal; the norm counts the weight once.

Bubble telemetry: each stage's busy compute (its forward, the loss, its backward, its local gradient
norm) is timed; the span runs from the start of the schedule's `step()` until the gradient-norm
all-reduce returns, which is the first moment every stage has drained (so a stage that finishes early
still counts its wait for the others). `1 - busy / span` is the fraction of that span the stage spent
idle: waiting for its neighbours, in send/recv and the all-reduce, in schedule bookkeeping. It sits
next to the GPipe formula (K-1)/(M+K-1), which assumes equal stages and free communication. The
optimizer step is outside the span (no pipeline there).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, ClassVar, Optional

import torch
import torch.distributed as dist
from torch import nn

from dist_train.checkpoint.dcp_io import DcpIO
from dist_train.config import RunConfig, StrategyConfig, TrainConfig, choice, require
from dist_train.parallel_dims import ParallelDims, layout_dims
from dist_train.contracts import Batch, ModelState, StepOutput, StrategyFamily, local_tensor
from dist_train.model import causal_lm_loss, layout_of, model_layout
from dist_train.strategies.base import (
    LocalOptimizer,
    StrategyContext,
    autocast,
    load_torch_state_dict,
    onto,
    reshard,
    torch_state_dict,
    wrap_ddp,
)
from dist_train.strategies.pipeline_stages import (
    Stage,
    build_stage,
    is_tied,
    param_counts,
    split_layers,
    stage_ranges,
)

log = logging.getLogger("dist_train")


def check_splittable(run: RunConfig, *, what: str) -> None:
    """ConfigError, saying why, unless the model can be cut into stages (the presets can: GPT-2 and Llama)."""
    if run.model.path is None:
        return
    from dist_train.config import ConfigError
    from dist_train.pretrained import ModelDir

    config = ModelDir.open(run.model.path).config(trust_remote_code=run.model.trust_remote_code)
    try:
        layout_of(config)
    except ValueError as exc:
        raise ConfigError(f"{what}: {exc}; use fsdp, ddp or a ZeRO stage") from exc


def _schedule_class(name: str) -> Any:
    # torch.distributed.pipelining (with dynamo) is imported only by a pipeline run: importing it costs every
    # run about 0.8 s of start-up, and the registry imports this module for its schema whatever the strategy.
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

    return {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[name]


@dataclass
class PipelineConfig(StrategyConfig):
    """torch.distributed.pipelining: one stage per rank, `schedule` picks GPipe or 1F1B."""

    name: str = "gpipe"
    schedule: str = "gpipe"
    # Micro-batches per step; None = train.global_batch_size // train.micro_batch_size.
    num_microbatches: Optional[int] = None
    # Index of the first transformer block of stages 1..K-1; None = balance by parameter count.
    split_points: Optional[list[int]] = None
    # Pipeline stages K; None = one per process. Fewer stages than processes: world / K data-parallel
    # replicas of the pipeline (strategy=pp_dp), each stage replicated or sharded over them (dp_mode).
    pp: Optional[int] = None
    dp_mode: str = "replicate"

    loads_own_shard: ClassVar[bool] = True  # split on meta, then each stage loads its own layers

    @property
    def optimizer_sees_whole_tensors(self) -> bool:
        return self.pp is None or self.dp_mode == "replicate"  # FSDP-sharded stages (pp_dp) hold DTensor shards

    def num_stages(self, world_size: int) -> int:
        return self.pp if self.pp is not None else world_size

    def parallel_dims(self, world_size: int) -> ParallelDims:
        """K stages, and world / K replicas of the pipeline: whole (replicate) or sharding each stage (fsdp)."""
        return layout_dims("pipeline", world_size, stages=self.num_stages(world_size),
                           stage_dp="dp_shard" if self.dp_mode == "fsdp" else "dp_replicate")

    def check(self, world_size: int) -> None:
        choice("strategy.schedule", self.schedule, ("gpipe", "1f1b"))
        choice("strategy.dp_mode", self.dp_mode, DP_MODES)
        if self.pp is not None:
            require(self.pp >= 2, f"strategy.pp={self.pp} must be >= 2 (pipeline stages)")
            require(
                world_size % self.pp == 0,
                f"strategy.pp={self.pp} must divide the number of processes ({world_size}): the mesh is "
                f"(pipeline {self.pp}) x (data-parallel {world_size}/{self.pp})",
            )
        require(
            self.name not in ("gpipe", "1f1b") or self.name == self.schedule,
            f"strategy.schedule={self.schedule!r} contradicts strategy={self.name}; "
            f"pick the schedule by name: strategy={self.schedule}",
        )
        require(
            world_size >= 2,
            f"strategy={self.name} needs at least 2 processes (one pipeline stage each), got WORLD_SIZE={world_size}",
        )
        if self.num_microbatches is not None:
            require(self.num_microbatches >= 1, f"strategy.num_microbatches={self.num_microbatches} must be >= 1")

    # ---------------------------------------------------------------- pipeline: checks needing run values
    def microbatches(self, train: "TrainConfig", world_size: int) -> int:
        """Micro-batches per step and replica: strategy.num_microbatches, else (global_batch_size / replicas)
        // micro_batch_size."""
        return self.parallel_dims(world_size).microbatches(
            global_batch_size=train.global_batch_size, micro_batch_size=train.micro_batch_size,
            num_microbatches=self.num_microbatches)

    def microbatches_per_step(self, train: "TrainConfig", world_size: int) -> int:
        return self.microbatches(train, world_size)

    def check_run(self, run: "RunConfig", world_size: int) -> None:
        check_splittable(run, what=f"strategy={self.name}")
        stages, layers = self.num_stages(world_size), run.model.num_layers
        dp = self.data_parallel_size(world_size)
        require(
            layers >= stages,
            f"model.num_layers={layers} is fewer than the {stages} pipeline stages "
            + (f"(strategy.pp={stages})" if self.pp is not None else f"(one per process, WORLD_SIZE={stages})")
            + f"; strategy={self.name} needs model.num_layers >= {'strategy.pp' if self.pp is not None else 'WORLD_SIZE'}",
        )
        require(
            run.train.global_batch_size % dp == 0,
            f"train.global_batch_size={run.train.global_batch_size} must be divisible by the {dp} data-parallel "
            f"replicas of the pipeline (WORLD_SIZE={world_size} / strategy.pp={stages})",
        )
        batch = run.train.global_batch_size // dp
        per = "train.global_batch_size" if dp == 1 else f"the {batch} samples per replica"
        if self.num_microbatches is None:
            require(
                batch % run.train.micro_batch_size == 0,
                f"{per} ({batch}) must be divisible by train.micro_batch_size="
                f"{run.train.micro_batch_size} (or set strategy.num_microbatches)",
            )
        micro = self.microbatches(run.train, world_size)
        require(
            batch % micro == 0,
            f"strategy.num_microbatches={micro} must divide {per} ({batch}) (every micro-batch the same size)",
        )
        if self.schedule == "1f1b":
            require(
                micro >= stages,
                f"strategy.num_microbatches={micro} must be >= the {stages} pipeline stages for strategy=1f1b",
            )
        if self.split_points is not None:
            points = list(self.split_points)
            edges = [0, *points, layers]  # every stage needs at least one block
            ok = len(points) == stages - 1 and all(a < b for a, b in zip(edges, edges[1:]))
            require(
                ok,
                f"strategy.split_points={points} must be a list of {stages - 1} strictly increasing block "
                f"index(es) in [1, {layers - 1}] "
                f"(the first block of stages 1..{stages - 1}; {stages} stages, model.num_layers={layers})",
            )
        require(
            not run.precision.loss_scaling,
            f"precision=fp16 is not supported with strategy={self.name} (each stage would skip steps on its own "
            "overflows); use precision=bf16 or precision=fp32",
        )


DP_MODES = ("replicate", "fsdp")


def bubble_formula(*, num_stages: int, num_microbatches: int) -> float:
    """GPipe's idle fraction (K-1)/(M+K-1) for K equal stages and M micro-batches (1F1B's is the same)."""
    k, m = num_stages, num_microbatches
    return (k - 1) / (m + k - 1)


class BusyClock:
    """Per step: the schedule's span and the intervals this stage computed, read at window close.

    CPU: wall clock. CUDA: events recorded on the current stream and read only in `drain()` (the loop
    synchronises at window close anyway), so timing adds no synchronisation to the step. An event pair
    around a kernel sequence measures the stream from the first to the last kernel, which excludes the
    time the stream waited for a receive issued before it.
    """

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._steps: list[tuple[Any, Any, list[tuple[Any, Any]]]] = []
        self._begin: Any = None
        self._busy: list[tuple[Any, Any]] = []

    def _stamp(self) -> Any:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def _elapsed_s(self, start: Any, end: Any) -> float:
        if not self.cuda:
            return end - start
        end.synchronize()
        return start.elapsed_time(end) / 1e3

    @contextlib.contextmanager
    def busy(self) -> Iterator[None]:
        start = self._stamp()
        try:
            yield
        finally:
            self._busy.append((start, self._stamp()))

    def step_begin(self) -> None:
        self._begin, self._busy = self._stamp(), []

    def step_end(self) -> None:
        self._steps.append((self._begin, self._stamp(), self._busy))

    def drain(self) -> list[tuple[float, float]]:
        """(busy_s, span_s) of every step since the last drain."""
        steps, self._steps = self._steps, []
        return [
            (sum(self._elapsed_s(a, b) for a, b in busy), self._elapsed_s(begin, end)) for begin, end, busy in steps
        ]


@functools.cache
def _timed_stage_class() -> type:
    """TimedStage, defined on first use (see `_schedule_class`)."""
    from torch.distributed.pipelining import PipelineStage

    class TimedStage(PipelineStage):
        """A PipelineStage whose forward and backward run under the run's autocast and are timed as busy."""

        def __init__(self, *args: Any, clock: BusyClock, precision: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.clock, self.precision = clock, precision
            sent = kwargs["output_args"]
            self._sent = (tuple(sent.shape), sent.dtype)

        def forward_maybe_with_nosync(self, *args: Any, **kwargs: Any) -> Any:
            with self.clock.busy(), autocast(self.precision, self.device):
                out = super().forward_maybe_with_nosync(*args, **kwargs)
            # The receiver allocated its buffer from the static shape: a mismatch would garble the transfer.
            assert self.is_last or (tuple(out.shape), out.dtype) == self._sent, f"stage output {out.shape} {out.dtype}"
            return out

        def backward_maybe_with_nosync(self, backward_type: Any, bwd_kwargs: dict, last_backward: bool = False) -> Any:
            with self.clock.busy():
                return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward=last_backward)

    return TimedStage


class PipelineStrategy:
    def __init__(self, cfg: PipelineConfig, ctx: StrategyContext) -> None:
        self.name, self.cfg, self.ctx = cfg.name, cfg, ctx
        rt = ctx.runtime
        self.device = rt.device
        self.dims = cfg.parallel_dims(rt.world_size)
        self.num_stages, self.dp_size = self.dims.pp, self.dims.data_parallel
        where = self.dims.coordinates(rt.rank)  # rank = stage * replicas + replica
        self.stage_index, self.dp_rank = where["pp"], self.dims.data_parallel_rank(rt.rank)
        self.is_first, self.is_last = self.stage_index == 0, self.stage_index == self.num_stages - 1
        self.num_microbatches = cfg.microbatches(ctx.train, rt.world_size)
        self.micro_batch_size = ctx.train.global_batch_size // self.dp_size // self.num_microbatches
        self.clock = BusyClock(self.device)
        self.module: Stage | None = None
        self.opt: LocalOptimizer | None = None
        self.schedule: Any = None
        self.mesh: Any = None  # (pp, dp_replicate) or (pp, dp_shard) when the pipeline is replicated
        self.dp_dim = "dp_shard" if cfg.dp_mode == "fsdp" else "dp_replicate"
        self._losses: list[torch.Tensor] = []  # this step's micro-batch losses (last stage), unscaled
        self._tied: nn.Parameter | None = None  # this stage's copy of a tied embedding/head weight
        self._tied_group: Any = None

    # ------------------------------------------------------------------ set-up
    def empty_model_context(self) -> Any:
        return torch.device("meta")  # split on meta; materialize gives each stage its own layers

    def setup(self, model: nn.Module) -> None:
        first_extra, block_params, last_extra = param_counts(model)
        if self.cfg.split_points is not None:
            bounds = list(self.cfg.split_points)
        else:
            bounds = split_layers(
                block_params, num_stages=self.num_stages, first_extra=first_extra, last_extra=last_extra
            )
        self._log_split(bounds, block_params=block_params, first_extra=first_extra, last_extra=last_extra)
        tied = is_tied(model)
        layout = model_layout(model)
        self.module = build_stage(model, bounds=bounds, stage_index=self.stage_index)
        if self.ctx.materialize is None:
            self.module = onto(self.module, self.device)
        pp_group = None  # the default group: one pipeline over every rank
        if self.dp_size > 1:
            pp_group = self._data_parallel(self.module)
        if self.ctx.materialize is not None:  # built on meta: this stage's layers (its shard of them), filled
            self.ctx.materialize(self.module.model)
        submod: nn.Module = self.module
        if self.dp_size > 1 and self.cfg.dp_mode == "replicate":
            submod = self._replicated(self.module)
        if tied:
            self._tied_group = self._tied_pair_group()
            holder = layout.embedding if self.is_first else layout.head if self.is_last else None
            if holder is not None:
                self._tied = self.module.model.get_submodule(holder).weight
        self.opt = LocalOptimizer(self.ctx, list(self.module.parameters()), zero_in_place=submod is not self.module)
        stage = _timed_stage_class()(
            submod, self.stage_index, self.num_stages, self.device,
            input_args=self._example_input(), output_args=self._example_output(),
            clock=self.clock, precision=self.ctx.precision, group=pp_group,
        )
        self.schedule = _schedule_class(self.cfg.schedule)(
            stage, n_microbatches=self.num_microbatches, loss_fn=self._loss, scale_grads=False
        )

    def _data_parallel(self, stage: Stage) -> Any:
        """The run's (pp, dp_replicate|dp_shard) mesh; under dp_mode=fsdp this stage FSDP-sharded over its replicas,
        in place (replicate wraps it once it holds its weights: `_replicated`). Returns this replica's pipeline
        group."""
        from dist_train.parallel.mesh import build_mesh

        self.mesh = build_mesh(self.dims, self.ctx.runtime.device.type)
        if self.cfg.dp_mode == "fsdp":
            from dist_train.parallel.apply import Sharding, parallelize

            # The same function as fsdp's, on this stage: each of its blocks one all-gather unit, then the stage's
            # root (embeddings, norm, head). No mixed-precision policy: the shards stay fp32 and the stage computes
            # under autocast like every pipeline stage, so what travels between stages keeps the dtype its receiver
            # expects.
            parallelize(stage, mesh=self.mesh, dims=self.dims, precision=None, sharding=Sharding(),
                        blocks=stage.blocks())
        return self.mesh["pp"].get_group()

    def _replicated(self, stage: Stage) -> nn.Module:
        """This stage under DistributedDataParallel over its replicas: the schedule runs every micro-batch but the
        last under no_sync and prepares the reducer for the last one's backward (torch's PipelineStage does both),
        so the stage's gradients are all-reduced once a step, in buckets, into the gradients themselves.

        DDP rather than torch's FSDP-based `replicate`, which keeps an unsharded copy of every parameter beside the
        parameter through the step (the schedule keeps it gathered across micro-batches): twice the stage's weights.
        DDP's buckets hold the gradients instead, and the optimizer zeroes them in place (LocalOptimizer's
        zero_in_place), so the micro-batches accumulate into them. Llama-2-70B in 8 fp32 stages, dry run at 64 ranks:
        the first stage's peak of live tensors 271.5 GiB with `replicate`, 253.7 GiB with this; same losses.
        No broadcast at set-up (init_sync=False) and none of buffers per forward: every replica built or loaded
        the same weights, and the stage's buffers (rotary frequencies) are computed, not learned."""
        return wrap_ddp(stage, self.ctx, group=self.mesh["dp_replicate"].get_group(), gradient_as_bucket_view=True,
                        forward_sync_buffers=False, init_sync=False)

    def _tied_pair_group(self) -> Any:
        """The group of each replica's first and last stage (a tied embedding/head weight lives on both).
        new_group is collective: every rank creates every replica's pair, and keeps its own."""
        mine = None
        last = (self.num_stages - 1) * self.dp_size
        for replica in range(self.dp_size):
            group = dist.new_group([replica, last + replica], timeout=self.ctx.runtime.timeout)
            if replica == self.dp_rank:
                mine = group
        return mine

    def mesh_groups(self) -> dict[str, list[int]]:
        """This rank's pipeline (pp) and the replicas of its stage (dp_replicate or dp_shard), when the pipeline is
        replicated."""
        from dist_train.parallel.mesh import mesh_groups

        return mesh_groups(self.mesh)

    def _log_split(self, bounds: list[int], *, block_params: list[int], first_extra: int, last_extra: int) -> None:
        ranges = stage_ranges(bounds, num_layers=len(block_params))
        parts = []
        for s, (lo, hi) in enumerate(ranges):
            n = sum(block_params[lo:hi]) + (first_extra if s == 0 else 0) + (last_extra if s == len(ranges) - 1 else 0)
            parts.append(f"stage{s}: blocks [{lo}, {hi}) {n:,} params")
        how = "strategy.split_points" if self.cfg.split_points is not None else "balanced by parameter count"
        log.info("pipeline %s, %s: %s", self.cfg.schedule, how, " | ".join(parts))
        same = self.micro_batch_size == self.ctx.train.micro_batch_size
        log.info(
            "pipeline: %d micro-batches of %d samples per step (train.micro_batch_size=%d is %s)",
            self.num_microbatches, self.micro_batch_size, self.ctx.train.micro_batch_size,
            "the same" if same else "overridden by strategy.num_microbatches",
        )

    def _hidden_size(self) -> int:
        assert self.module is not None
        return int(self.module.config.hidden_size)

    def _example_input(self) -> torch.Tensor:
        """Static shapes of what a stage receives, so no metadata has to travel at the first step."""
        shape = (self.micro_batch_size, self.ctx.train.seq_len)
        if self.is_first:
            return torch.empty(shape, dtype=torch.long, device="meta")
        # Hidden states stay in the parameters' dtype (fp32) under autocast: each block's residual add
        # promotes its bf16 matmul output back to the fp32 residual stream.
        return torch.empty((*shape, self._hidden_size()), dtype=torch.float32, device="meta", requires_grad=True)

    def _example_output(self) -> torch.Tensor:
        shape = (self.micro_batch_size, self.ctx.train.seq_len)
        if not self.is_last:
            return torch.empty((*shape, self._hidden_size()), dtype=torch.float32, device="meta", requires_grad=True)
        assert self.module is not None
        dtype = self.ctx.precision.dtype  # logits; never sent
        return torch.empty((*shape, int(self.module.config.vocab_size)), dtype=dtype, device="meta", requires_grad=True)

    # ------------------------------------------------------------------ the step
    def _loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Last stage, per micro-batch: record the mean loss, return it / M for backward (see module doc)."""
        with self.clock.busy(), autocast(self.ctx.precision, self.device):
            loss = causal_lm_loss(logits, labels)
        self._losses.append(loss.detach())
        return loss / self.num_microbatches

    def stage_inputs(self, batch: Batch) -> tuple[tuple[torch.Tensor, ...], torch.Tensor | None]:
        """The first stage's tokens and the last stage's labels on this stage's device, copied the way `Batch.to`
        copies (from pinned memory, without blocking the host on a GPU); a middle stage copies nothing."""
        if not (self.is_first or self.is_last):
            return (), None
        moved = batch.to(self.device)
        return ((moved.input_ids,) if self.is_first else ()), (moved.labels if self.is_last else None)

    def train_step(self, batch: Batch) -> StepOutput:
        assert self.opt is not None and self.schedule is not None, "setup() first"
        self.opt.zero_grad()
        self._losses = []
        args, target = self.stage_inputs(batch)
        self.clock.step_begin()
        self.schedule.step(*args, target=target, return_outputs=False)
        if self._tied_group is not None and self._tied is not None:
            # One process accumulates embedding + head gradients into one weight; here they are on two stages.
            # (Replicated or sharded, both copies are laid out alike: their local parts add up elementwise.)
            dist.all_reduce(local_tensor(self._tied.grad), group=self._tied_group)
        grad_norm = self._global_norm()
        # The norm's all-reduce returns once every stage has drained: the end of the pipeline's span. A stage
        # whose schedule finished early (the last one, under GPipe) waited in it: that wait is bubble too.
        self.clock.step_end()
        self.opt.step(total_norm=grad_norm)  # every stage clips by the global norm, as one process would
        loss_sum = None
        if self.is_last:
            assert len(self._losses) == self.num_microbatches, "one loss per micro-batch"
            loss_sum = torch.zeros((), device=self.device)
            for loss in self._losses:  # the same order of additions as `accumulate`
                loss_sum += loss
        return StepOutput(loss_sum=loss_sum, num_microbatches=self.num_microbatches, grad_norm=grad_norm)

    def eval_step(self, batch: Batch) -> StepOutput:
        """Forward only through the pipeline (the schedule's eval: the same micro-batches, no backward), without
        gradients, every stage in eval mode; the loss on the last stage."""
        assert self.module is not None and self.schedule is not None, "setup() first"
        self._losses = []
        args, target = self.stage_inputs(batch)
        self.module.eval()
        try:
            with torch.no_grad():
                self.schedule.eval(*args, target=target)
        finally:
            self.module.train()
            reshard(self.module)  # pp_dp's FSDP stages
        loss_sum = None
        if self.is_last:
            loss_sum = torch.zeros((), device=self.device)
            for loss in self._losses:
                loss_sum += loss
        return StepOutput(loss_sum=loss_sum, num_microbatches=self.num_microbatches, grad_norm=None)

    def _global_norm(self) -> torch.Tensor:
        """L2 norm over every stage's gradients (a tied weight once); all stages clip by it, as one process would."""
        assert self.opt is not None
        duplicate = self._tied if (self._tied is not None and not self.is_first) else None
        grads = [local_tensor(p.grad) for p in self.opt.params if p.grad is not None and p is not duplicate]
        with self.clock.busy():
            local = torch.nn.utils.get_total_norm(grads, norm_type=2.0) if grads else torch.zeros(())
            squared = local.to(self.device).pow(2)
        # The sum over stages (stays on the device, no host sync). Replicas hold equal gradients by now: the
        # pipeline's own stages are enough. FSDP shards hold a part each: every rank's part counts.
        group = self.mesh["pp"].get_group() if self.mesh is not None and self.cfg.dp_mode == "replicate" else None
        dist.all_reduce(squared, group=group)
        return squared.sqrt()

    # ------------------------------------------------------------------ the rest of the interface
    def model_state(self) -> ModelState:
        assert self.opt is not None and self.module is not None
        return self.opt.model_state(self.module)  # this stage's share only (a tied weight: each holder's copy)

    def state_dict(self) -> dict[str, Any]:
        assert self.opt is not None and self.module is not None
        # The pruned HF model: keys are the full model's names, so stage checkpoints fit together.
        return torch_state_dict(self.module.model, self.opt)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        assert self.opt is not None and self.module is not None
        load_torch_state_dict(self.module.model, self.opt, state)

    def checkpoint_io(self) -> DcpIO:
        return DcpIO(self)  # each stage writes its own layers under the full model's names

    @property
    def lr(self) -> float:
        assert self.opt is not None
        return self.opt.lr

    @property
    def devices(self) -> list[torch.device]:
        return [self.device]

    def extra_metrics(self) -> dict[str, float]:
        assert self.module is not None
        steps = self.clock.drain()
        out: dict[str, float] = {
            "pipeline/stage": self.stage_index,
            "pipeline/num_stages": self.num_stages,
            "pipeline/num_replicas": self.dp_size,
            "pipeline/num_microbatches": self.num_microbatches,
            "pipeline/micro_batch_size": self.micro_batch_size,
            "pipeline/first_block": self.module.start,
            "pipeline/num_blocks": self.module.end - self.module.start,
            "pipeline/bubble_fraction_formula": bubble_formula(
                num_stages=self.num_stages, num_microbatches=self.num_microbatches
            ),
        }
        if steps:
            out["pipeline/busy_s"] = sum(b for b, _ in steps) / len(steps)
            out["pipeline/schedule_s"] = sum(s for _, s in steps) / len(steps)
            out["pipeline/bubble_fraction"] = sum(1 - b / s for b, s in steps if s > 0) / len(steps)
        return out


def build(cfg: PipelineConfig, ctx: StrategyContext) -> PipelineStrategy:
    return PipelineStrategy(cfg, ctx)


FAMILY = StrategyFamily(
    family="pipeline",
    schema=PipelineConfig,
    names={"gpipe": {"schedule": "gpipe"}, "1f1b": {"schedule": "1f1b"}, "pp_dp": {"pp": 2}},
    build=build,
)
