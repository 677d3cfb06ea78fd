"""Step-by-step timing in the same processes: a dist_train step beside another step, alternating.

End-to-end runs on a shared 2-core machine vary by tens of percent from one run to the next; timing two
step functions alternately in the same two processes cancels most of that. Each iteration times one step
of A and one of B (the order alternates), each after a barrier so every rank starts it together, and
records the ratio A/B on rank 0. Prints one JSON line: the median ratio and its interquartile range.

    torchrun --standalone --nproc_per_node=2 bench/interleaved.py --vs reference --strategy ddp
    torchrun --standalone --nproc_per_node=2 bench/interleaved.py --vs telemetry-off --strategy fsdp

--vs reference: dist_train (telemetry as configured) against bench/reference.py's hand-written loop;
--vs telemetry-off: dist_train with telemetry on against the same strategy with comm and activation
telemetry off. B runs with dist_train's collective wrappers suspended, so it pays nothing for them.
--vs accelerate|fabric: dist_train against bench/peers.py's Accelerate or Lightning Fabric loop, both training
peers.py's config (the same weights, batches, optimizer and schedule).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import torch.distributed as dist  # noqa: E402

import peers  # noqa: E402
from common import end_process, synchronize  # noqa: E402
from reference import ReferenceLoop, Shape  # noqa: E402

# the peers whose step runs in this process beside dist_train's (bench/peers.py builds them)
PEER_STEPS = {"accelerate": peers.accelerate_step, "fabric": peers.fabric_step}


def shape_overrides(shape: Shape, steps: int) -> list[str]:
    """dist_train's config for the reference loop's shape."""
    return [
        f"model.num_layers={shape.layers}", f"model.hidden_size={shape.hidden}", f"model.num_heads={shape.heads}",
        f"model.vocab_size={shape.vocab}", f"model.max_seq_len={shape.seq}", f"train.seq_len={shape.seq}",
        f"train.global_batch_size={shape.global_batch}", f"train.micro_batch_size={shape.micro_batch}",
        f"train.steps={steps}", f"train.lr={shape.lr}", "logger=none",
    ]


def dist_train_session(strategy: str, training: list[str], *, telemetry: bool, run_dir: Path, extra: list[str]):
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from dist_train.strategies.registry import register_configs
    from dist_train.rundir import register_resolvers
    from dist_train.runtime import init_runtime
    from dist_train.session import build_session
    from dist_train.train import to_run_config

    register_configs()
    register_resolvers()
    GlobalHydra.instance().clear()
    overrides = [
        f"strategy={strategy}", *training,
        f"telemetry.comm={str(telemetry).lower()}", f"telemetry.activations={str(telemetry).lower()}", *extra,
    ]
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=overrides)
    run = to_run_config(cfg)
    runtime = init_runtime(needs_group=True)
    session = build_session(run, cfg, runtime, resume=None, fault=None, run_dir=run_dir)
    session.telemetry.start()
    return session


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vs", choices=("reference", "telemetry-off", "accelerate", "fabric"), default="reference")
    parser.add_argument("--strategy", choices=("ddp", "fsdp"), default="ddp")
    parser.add_argument("--iterations", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("overrides", nargs="*", help="extra dist_train overrides for A (e.g. train.log_every=1)")
    args = parser.parse_args()
    from dist_train.train import train_one_step

    shape = Shape(layers=args.layers, hidden=args.hidden, seq=args.seq)
    steps = args.warmup + args.iterations
    # against a peer, both train bench/peers.py's config (which the peer's step is written for)
    training = peers.training(steps) if args.vs in PEER_STEPS else shape_overrides(shape, steps)
    tmp = Path(tempfile.mkdtemp(prefix="dist_train_bench_"))
    a = dist_train_session(args.strategy, training, telemetry=True, run_dir=tmp / "a", extra=args.overrides)
    tracker = a.telemetry.tracker
    counter = iter(range(steps))
    with tracker.suspended():
        if args.vs == "reference":
            b_step = ReferenceLoop(args.strategy, shape).step
        elif args.vs in PEER_STEPS:
            peer_step = PEER_STEPS[args.vs](peers.Setup(training), args.strategy)
            b_step = lambda: peer_step(next(counter))  # noqa: E731
        else:
            b = dist_train_session(args.strategy, training, telemetry=False, run_dir=tmp / "b", extra=args.overrides)
            b_step = lambda: train_one_step(b, next(counter) + 1)  # noqa: E731

    device = a.runtime.device  # cuda:LOCAL_RANK (else the CPU), as the reference loop takes it

    def timed(fn, *, inside_tracker: bool) -> float:
        with tracker.suspended():
            dist.barrier()
        synchronize(device)  # the barrier's own work done: the clock starts on an idle device
        start = time.perf_counter()
        if inside_tracker:
            fn()
        else:
            with tracker.suspended():
                fn()
        synchronize(device)  # a GPU step returns once queued: read the clock when it has finished
        return time.perf_counter() - start

    ratios = []
    for i in range(steps):
        step = i + 1
        run_a = lambda: train_one_step(a, step)  # noqa: E731
        if i % 2 == 0:
            ta, tb = timed(run_a, inside_tracker=True), timed(b_step, inside_tracker=False)
        else:
            tb, ta = timed(b_step, inside_tracker=False), timed(run_a, inside_tracker=True)
        if i >= args.warmup:
            ratios.append(ta / tb)
    if dist.get_rank() == 0:
        q = statistics.quantiles(ratios, n=4)
        print(json.dumps({"vs": args.vs, "strategy": args.strategy, "median_ratio": statistics.median(ratios),
                          "q1": q[0], "q3": q[2], "iterations": len(ratios)}), flush=True)
    with tracker.suspended():
        dist.barrier()


if __name__ == "__main__":
    main()
    end_process()  # after the results are out: no interpreter teardown for gloo's threads to abort
