"""One rank of a dry run, in its own process (`python -m dist_train.estimate.dryrun`): the run's config checked as
training checks it, the fake process group, the model under FakeTensorMode, assembled by training's own builder,
and two training steps; its figures as JSON on stdout."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

from dist_train.estimate.dryrun.fake import balanced_experts, under_fake_group

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
                          optimizer=OptimizerFactory(run.optimizer, t, device=cpu), ddp_comm_hook=tracker.ddp_comm_hook,
                          model=run.model)
    strategy = build_strategy(run.strategy, ctx)
    dp = run.strategy.data_parallel_size(world_size)
    local = t.global_batch_size // dp
    with FakeTensorMode(allow_non_fake_inputs=True), under_fake_group(zero=isinstance(run.strategy, ZeroConfig)):
        model = _constructor(run.model)()
        balanced_experts(model)  # an MoE model's experts routed balanced (fake.py): the router's values are fake
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
        strategy.extra_metrics()  # the first step's transient peaks, dropped as its collectives are
        meter = LiveMeter()
        with meter.measuring(strategy.model_state()):
            strategy.train_step(Batch(ids, ids))
        state = strategy.model_state()
        # and the measured step's, as a real run reports them: ZeRO-3's gathered parameters (ZeRO's step gradients
        # are found by their storages' addresses, which fake tensors do not have: not reported here)
        transient = {k: v for k, v in strategy.extra_metrics().items() if k.startswith("memory/")}
        out: dict[str, Any] = {"rank": rank, **state.bytes(), **transient}
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

