"""The tracker's collective times against torch's own records of the same steps (torch.profiler).

    torchrun --standalone --nproc_per_node=2 bench/profile_collectives.py --strategy ddp

Runs dist_train steps under torch.profiler and compares, per op, the time dist_train's tracker reports
(issue to completion, from the Python call) with the profiler's events for the same collectives: gloo's
`gloo:<op>` events on CPU (the operation as the backend ran it), `nccl:<op>` kernels on CUDA. The tracker's
figures come whole (`time_s`) and as the transfer (`transfer_s`: less the time before every peer had issued
the call or the group's previous call had finished, as dist_train computes bus bandwidth); `bytes` are the
timed bytes.

gloo runs a reduce-scatter as an all-reduce of a clone of the whole buffer: the clone is made in the
caller's thread (the `c10d::_reduce_scatter_base_` event: `reduce_scatter_clone` below), then a
`gloo:all_reduce` event runs to completion. Under fsdp, whose only other all-reduce is the gradient norm's
(a functional collective, which the tracker does not time: left out by its buffer size), those events are
FSDP's reduce-scatters; the tracker's time of a reduce-scatter spans both.

Prints one JSON line on rank 0, per step and for rank 0:
{"tracker": {op: {"time_s", "transfer_s", "bytes", "calls"}}, "profiler": {op: {"time_s", "calls"}}}.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from common import end_process  # noqa: E402
from interleaved import dist_train_session  # noqa: E402
from reference import Shape  # noqa: E402

from dist_train.telemetry.comm_analysis import peer_wait  # noqa: E402


# the backends' event names -> dist_train's op names
_OP_NAMES = {"allreduce": "all_reduce", "all_reduce": "all_reduce", "allgather": "all_gather",
             "all_gather": "all_gather", "all_gather_into_tensor": "all_gather", "_allgather_base": "all_gather",
             "reduce_scatter": "reduce_scatter", "reduce_scatter_tensor": "reduce_scatter",
             "_reduce_scatter_base": "reduce_scatter"}


def _numel(shapes: Any) -> int:
    """Elements of an event's first input (0 when the profiler recorded no shape)."""
    first = shapes[0] if shapes else None
    return math.prod(first) if first and isinstance(first[0], int) else 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", choices=("ddp", "fsdp"), default="ddp")
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    from dist_train.train import train_one_step

    warmup = 3
    session = dist_train_session(args.strategy, Shape(), steps=warmup + args.steps, telemetry=True,
                                 run_dir=Path(tempfile.mkdtemp()), extra=[f"train.log_every={warmup + args.steps}"])
    tracker = session.telemetry.tracker
    for step in range(1, warmup + 1):
        train_one_step(session, step)
    tracker.drain()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities, record_shapes=True) as prof:
        for step in range(warmup + 1, warmup + args.steps):
            train_one_step(session, step)
    ours = tracker.drain()
    n = args.steps - 1
    theirs: dict[str, dict[str, float]] = {}

    def add(op: str, seconds: float) -> None:
        entry = theirs.setdefault(op, {"time_s": 0.0, "calls": 0.0})
        entry["time_s"] += seconds / 1e6 / n
        entry["calls"] += 1 / n

    # the buffers of DTensor's functional all-reduces (the gradient norm's), which the tracker does not time
    functional = {_numel(e.input_shapes) for e in prof.events() if e.name == "_c10d_functional::all_reduce"}
    for event in prof.events():
        if event.name == "c10d::_reduce_scatter_base_" and not torch.cuda.is_available():
            add("reduce_scatter_clone", event.cpu_time_total)  # gloo: see below
            continue
        for prefix, seconds in (("gloo:", event.cpu_time_total), ("nccl:", event.device_time_total)):
            if event.name.startswith(prefix):
                op = _OP_NAMES.get(event.name[len(prefix):], event.name[len(prefix):])
                if op == "all_reduce" and _numel(event.input_shapes) in functional:
                    continue
                if op == "all_reduce" and args.strategy == "fsdp" and prefix == "gloo:":
                    op = "reduce_scatter"  # gloo: see below
                add(op, seconds)
    calls: list[Any] = [None] * dist.get_world_size()
    with tracker.suspended():
        dist.all_gather_object(calls, {op: t.calls for op, t in ours.items()})
    transfers = peer_wait(dict(enumerate(calls)), {})[dist.get_rank()]
    tracker_ops = {op: {"time_s": t.time_s / n, "transfer_s": transfers[op].transfer_s / n,
                        "bytes": t.timed_bytes / n, "calls": t.count / n} for op, t in ours.items() if t.count}
    if dist.get_rank() == 0:
        print(json.dumps({"strategy": args.strategy, "tracker": tracker_ops, "profiler": theirs}), flush=True)
    with tracker.suspended():
        dist.barrier()


if __name__ == "__main__":
    main()
    end_process()  # after the results are out: no interpreter teardown for gloo's threads to abort
