"""The dry run: the real strategy code for one rank of an N-rank job, in one process here, with no GPU.

    python -m dist_train.estimate strategy=fsdp model=70b world_size=1024 dryrun.ranks=[0,1023] format=json

For each asked rank a fresh process (`python -m dist_train.estimate.dryrun`) joins torch's fake process group
(`backend="fake"`: every collective returns at once, with no peer and no data) as that rank of `world_size`, builds
the model under FakeTensorMode (tensors with shapes and no storage: a 70B model costs no memory), assembles the rank
through training's own builder (session.transform_model and attach_neftune: LoRA, activation checkpointing, the
strategy's set-up, NEFTune), and runs one training step. What the rank would hold and send is read
with the same code a training run uses, on the second step (the first makes the optimizer's state): the strategy's model state by category, the collectives the CommTracker
sees, and the peak of all live tensors that torch's MemTracker follows (it works under FakeTensorMode). The figures
use the keys of summary.json's `ranks[]`.

Strategies: ddp, fsdp, hsdp, tp, fsdp_tp, the pipelines (gpipe, 1f1b, pp_dp) and the DeepSpeed ZeRO stages (without offload,
which needs a GPU). The others are refused with one line saying why (NOT_YET). Where the real code reads a value back
after a collective (a pipeline's shape vote, DeepSpeed's order and overflow checks), the collective still runs and the
read-back takes a healthy run's answer (DDP's shape check and bucket regrouping, likewise); each such place is one
function below.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Iterator

if TYPE_CHECKING:
    from dist_train.estimate.setup import Setup
    from dist_train.estimate.shapes import ModelShape

# Strategy families whose set-up and step run under a fake process group and FakeTensorMode (tested at world
# sizes 2 and 4 against real gloo runs: tests/test_dryrun.py).
DRYRUN_FAMILIES = ("ddp", "fsdp", "tp", "fsdp_tp", "pipeline", "zero")
# Why the others do not run there yet (each found by trying it).
NOT_YET = {
    "dp": "nn.DataParallel is one process",
    "single": "one process: the estimator and a real run need no dry run",
    "accelerate": "Accelerate prepares the model with real tensors",
}


def supported(family: str, strategy: str) -> str | None:
    """None when the dry run covers this strategy, else why not (one line)."""
    if family in DRYRUN_FAMILIES:
        return None
    why = NOT_YET.get(family, "not tried yet")
    return (f"strategy={strategy}: the dry run covers {', '.join(DRYRUN_FAMILIES)} so far ({why}); "
            "the estimator alone still predicts it (drop dryrun.ranks)")


# (owner, attribute, replacement): what the dry run swaps in while a rank runs (`_under_fake_group`)
Patch = tuple[Any, str, Any]


@contextlib.contextmanager
def _under_fake_group(*, zero: bool) -> Iterator[None]:
    """The places where the real code needs a real tensor or a value a collective carried, swapped for the dry
    run's answer while a rank runs (each function below says why), and put back after."""
    from unittest import mock

    patches = [*_meshes_outside_fake_mode(), *_pipeline_shapes_given(), *_moves_in_place(), *_ddp_replicas_agree(),
               *_fsdp_chunks_on_demand(),
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


def training_run(overrides: list[str], *, world_size: int) -> Any:
    """The RunConfig `launch/train.py <overrides>` would train on `world_size` ranks, checked as training checks it
    (batch divisibility, degrees, ...): a ConfigError otherwise."""
    from dist_train.checks import validate
    from dist_train.config import resolve_global_batch
    from dist_train.estimate.compose import compose_run

    run = compose_run(overrides)
    resolve_global_batch(run, world_size)
    validate(run, world_size)
    return run


def run_rank(overrides: list[str], *, world_size: int, rank: int) -> dict[str, Any]:
    """This process as `rank` of `world_size` under the fake process group: set-up and one step; its figures."""
    import torch
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from dist_train.contracts import Batch, Runtime
    from dist_train.model import _constructor
    from dist_train.optim import OptimizerFactory
    from dist_train.session import attach_neftune, transform_model
    from dist_train.strategies.base import StrategyContext
    from dist_train.strategies.registry import build_strategy
    from dist_train.strategies.torch_strategy import TorchStrategy
    from dist_train.strategies.zero import ZeroConfig
    from dist_train.telemetry.comm import CommTracker
    from dist_train.telemetry.memory import HostPeak, LiveMeter

    start = time.perf_counter()
    run = training_run(overrides, world_size=world_size)
    t = run.train
    dist.init_process_group("fake", rank=rank, world_size=world_size, store=FakeStore())
    cpu = torch.device("cpu")
    runtime = Runtime(rank, rank, world_size, world_size, cpu, "fake", 600.0, "dryrun", ("dryrun",) * world_size)
    tracker = CommTracker().install()
    ctx = StrategyContext(runtime=runtime, train=t, precision=run.precision,
                          optimizer=OptimizerFactory(run.optimizer, t, device=cpu), ddp_comm_hook=tracker.ddp_comm_hook)
    strategy = build_strategy(run.strategy, ctx)
    dp = run.strategy.data_parallel_size(world_size)
    local = t.global_batch_size // dp
    with FakeTensorMode(allow_non_fake_inputs=True), _under_fake_group(zero=isinstance(run.strategy, ZeroConfig)):
        model = _constructor(run.model)()
        # training's own assembly of a rank: LoRA, checkpointing, compile, the strategy's set-up, NEFTune's hook
        transform_model(run, model, compute_dtype=run.precision.dtype)
        strategy.setup(model)
        attach_neftune(run, model)
        tracker.name_groups(getattr(strategy, "mesh_groups", dict)())  # comm/<dim>/<op>/... where there is a mesh
        ids = torch.zeros(local, t.seq_len, dtype=torch.long)
        # As a training run measures: a first step makes the optimizer's state (and runs lazy initialisation);
        # the second is the one whose collectives are counted and whose live tensors MemTracker follows. The first
        # takes one micro-batch (its figures are dropped): with accumulation it costs 1/m of a step, not one step.
        # Pipelines' schedules and DeepSpeed's engine are built for their number of micro-batches: the whole batch.
        first = ids[:t.micro_batch_size] if isinstance(strategy, TorchStrategy) else ids
        strategy.train_step(Batch(first, first))
        tracker.drain()
        meter = LiveMeter()
        with meter.measuring(strategy.model_state()):
            strategy.train_step(Batch(ids, ids))
        state = strategy.model_state()
        out: dict[str, Any] = {"rank": rank, **state.bytes()}
    for op, totals in tracker.drain().items():
        if not totals.count:
            continue
        out[f"comm/{op}/count"] = totals.count
        out[f"comm/{op}/bytes"] = totals.bytes
        for dim, (count, nbytes, *_) in totals.by_dim.items():  # [count, bytes, time_s, untimed]
            out[f"comm/{dim}/{op}/count"] = count
            out[f"comm/{dim}/{op}/bytes"] = nbytes
    out["memory/peak_live_bytes"] = meter.peak_bytes
    for category, nbytes in meter.peak_by_category.items():
        out[f"memory/peak_live/{category}_bytes"] = nbytes
    tracker.uninstall()
    # What the dry run itself cost here: this process's wall time and peak resident memory.
    out["dryrun/wall_s"] = time.perf_counter() - start
    out["dryrun/peak_rss_bytes"] = HostPeak().peak_bytes()
    return out


def run_ranks(overrides: list[str], *, world_size: int, ranks: list[int], timeout_s: float) -> list[dict[str, Any]]:
    """Each rank in its own process (a process joins one process group), one after the other."""
    out = []
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                             "MASTER_PORT", "LOCAL_WORLD_SIZE")}
    for rank in ranks:
        proc = subprocess.run([sys.executable, "-m", "dist_train.estimate.dryrun", "--world-size", str(world_size),
                               "--rank", str(rank)], input=json.dumps(overrides), capture_output=True, text=True,
                              timeout=timeout_s, env=env)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith('{"rank"')]
        if proc.returncode != 0 or not lines:
            tail = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
            raise RuntimeError(f"dry run of rank {rank} of {world_size} failed: {tail}")
        out.append(json.loads(lines[-1]))
    return out


def dryrun_rows(overrides: list[str], shape: ModelShape, setup: Setup, *, ranks: list[int],
                timeout_s: float, predict: bool = True) -> list[dict[str, Any]]:
    """Per asked rank: the dry run's figures (summary.json's ranks[] keys), the prediction for the same keys, and
    their relative difference (dry run / predicted - 1). predict=False (LoRA, which the estimator does not model):
    the dry run's figures alone."""
    from dist_train.estimate.comm import predict_comm
    from dist_train.estimate.memory import category_bytes, predict_memory

    measured = run_ranks(overrides, world_size=setup.world_size, ranks=ranks, timeout_s=timeout_s)
    if not predict:
        return [{"rank": m["rank"], "measured": {k: v for k, v in m.items() if k != "rank"}, "predicted": {},
                 "diff": {}} for m in measured]
    predicted_ranks, comm = predict_memory(shape, setup), predict_comm(shape, setup)
    rows = []
    for m in measured:
        r = m["rank"]
        predicted: dict[str, float] = {f"memory/{c}_bytes": category_bytes(predicted_ranks[r], c)
                                       for c in ("params", "grads", "optimizer")}
        if predicted_ranks[r].peak_live is not None:
            predicted["memory/peak_live_bytes"] = predicted_ranks[r].peak_live
        for c in comm[r] if r < len(comm) else comm[0]:
            key = f"comm/{c.op}/bytes"
            predicted[key] = predicted.get(key, 0.0) + c.bytes
        diff = {k: (m[k] / v - 1 if v else None) for k, v in predicted.items() if k in m}
        rows.append({"rank": r, "measured": {k: v for k, v in m.items() if k != "rank"}, "predicted": predicted,
                     "diff": diff})
    return rows


def dryrun_section(rows: list[dict[str, Any]], *, world_size: int) -> str:
    """The dry run's rows as a text table: per rank, what it measured, the prediction and the difference."""
    from dist_train.estimate.render import human_bytes, text_table

    keys = list(dict.fromkeys(k for row in rows for k in (*row["measured"], *row["predicted"])))
    table = []
    for key in keys:
        cells: list[object] = [key]
        for row in rows:
            m, p, d = row["measured"].get(key), row["predicted"].get(key), row["diff"].get(key)
            fmt = (lambda v: f"{v:,.0f}") if key.endswith("/count") else (
                (lambda v: f"{v:,.1f} s") if key.endswith("_s") else human_bytes)
            cells += [fmt(m) if m is not None else "-", human_bytes(p) if p is not None else "-",
                      f"{d:+.1%}" if d is not None else "-"]
        table.append(cells)
    headers = ["figure", *(h for row in rows for h in (f"rank {row['rank']} dry run", "predicted", "diff"))]
    return "\n".join([
        f"dry run: the real strategy code as each rank of {world_size}, one process each here (fake process group, "
        "FakeTensorMode: no data, no GPU); comm per step",
        text_table(headers, table),
    ])


def main() -> None:
    parser = argparse.ArgumentParser(description="one rank of a dry run (its training overrides, a JSON list, on stdin)")
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--rank", type=int, required=True)
    args = parser.parse_args()
    from dist_train.quiet import quiet_deepspeed_on_cpu

    quiet_deepspeed_on_cpu()
    overrides = json.loads(sys.stdin.read())
    print(json.dumps(run_rank(overrides, world_size=args.world_size, rank=args.rank)), flush=True)
    sys.stdout.flush()
    os._exit(0)  # no interpreter teardown under the fake group's threads


if __name__ == "__main__":
    main()
