"""An nccl-tests-style microbenchmark of torch.distributed collectives on the run's backend.

    torchrun --standalone --nproc_per_node=2 bench/collectives.py all_reduce:964096 all_gather:1928192

For each `op:bytes`: 5 warm-up calls, then `--iterations` timed calls, each alone (a barrier first, the call
blocking), timed from issue to completion as dist_train times a collective. On a GPU (NCCL, one GPU per local rank,
the buffers on it) a call returns once queued: the device is synchronised before the clock is read at either end,
so the clock reads finished work. Bus bandwidth follows nccl-tests:
size / time x 2(n-1)/n for all_reduce, x (n-1)/n for all_gather and reduce_scatter (size = the full buffer).
Prints one JSON line on rank 0: {op: {"bytes", "median_s", "busbw_gbps"}}; with `--by-case`, keyed by each
`op:bytes` as given, so that one launch can time an op at several sizes (plan.calibrate's latency and bandwidth fit).

`--beside-compute`: each rank keeps a thread multiplying matrices while the calls are timed, as training
does when a collective overlaps the computation (FSDP's prefetched all-gathers and its reduce-scatters in
backward). On a CPU the collective and the computation share the cores, so this bounds from below what a
collective can reach in training; alone bounds it from above.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from common import end_process, init_group, local_device, synchronize  # noqa: E402

from dist_train.telemetry.bandwidth import busbw_gbps  # noqa: E402


def call(op: str, nbytes: int, world: int, *, device: torch.device):  # noqa: ANN201
    """A zero-argument function issuing `op` on a buffer of `nbytes` on `device` (nccl-tests' size convention)."""
    numel = max(world, nbytes // 4 // world * world)
    full = torch.ones(numel, device=device)
    part = torch.ones(numel // world, device=device)
    if op == "all_reduce":
        return lambda: dist.all_reduce(full)
    if op == "all_gather":
        return lambda: dist.all_gather_into_tensor(full, part)
    if op == "reduce_scatter":
        return lambda: dist.reduce_scatter_tensor(part, full)
    raise ValueError(f"{op}: all_reduce, all_gather or reduce_scatter")


def timed(fn, *, device: torch.device, iterations: int) -> list[float]:  # noqa: ANN001
    """Seconds of each of `iterations` calls of `fn`, alone: after a barrier, from issue to completion."""
    times = []
    for _ in range(iterations):
        dist.barrier()
        synchronize(device)  # the barrier's own work done: the clock starts on an idle device
        start = time.perf_counter()
        fn()
        synchronize(device)  # a GPU collective returns once queued: read the clock when it has finished
        times.append(time.perf_counter() - start)
    return times


class Compute:
    """A thread multiplying 256 x 256 matrices on `device` until stopped (matmul releases the GIL)."""

    def __init__(self, device: torch.device) -> None:
        self._device = device
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        # on a GPU a stream of its own (training's compute is apart from NCCL's too): the timed calls' synchronisation
        # of the main thread's stream then waits for the collective, not for this thread's queue of matmuls
        with torch.Stream(device=self._device):
            a, b = torch.randn(256, 256, device=self._device), torch.randn(256, 256, device=self._device)
            while not self._stop.is_set():
                torch.mm(a, b)

    def __enter__(self) -> "Compute":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("cases", nargs="+", help="op:bytes")
    parser.add_argument("--iterations", type=int, default=50)
    parser.add_argument("--beside-compute", action="store_true", help="time the calls while a thread computes")
    parser.add_argument("--by-case", action="store_true", help="key the results by op:bytes, not by op")
    args = parser.parse_args()
    device = local_device()
    init_group(device)
    world = dist.get_world_size()
    out = {}
    for case in args.cases:
        op, nbytes = case.split(":")
        fn = call(op, int(float(nbytes)), world, device=device)
        for _ in range(5):
            fn()
        with Compute(device) if args.beside_compute else contextlib.nullcontext():
            times = timed(fn, device=device, iterations=args.iterations)
        median = statistics.median(times)
        out[case if args.by_case else op] = {"bytes": int(float(nbytes)), "median_s": median,
                                             "busbw_gbps": busbw_gbps(op, int(float(nbytes)), median, world)}
    if dist.get_rank() == 0:
        print(json.dumps(out), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    end_process()  # after the results are out: no interpreter teardown for gloo's threads to abort
