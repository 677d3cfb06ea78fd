"""Under torchrun: dist_train's memory/peak_live_bytes of an fsdp run against torch's own FSDPMemTracker.

1. Builds the fsdp strategy as train.py does and trains its first step (lazy init, the optimizer's state); its
   second step runs under `FSDPMemTracker(root, optimizer)`: the tracker's peak of all live tensors of step 2.
2. Trains a real 2-step run (session.build_session and the training loop, telemetry on, as launch/train.py runs
   them) in <hydra.run.dir>/two: its summary.json's memory/peak_live_bytes is the one it reports.
3. Trains a real 1-step run in <hydra.run.dir>/one: too short for a step that holds the optimizer's state.

Rank 0 prints one JSON line per rank: the tracker's peak and its composition, and the steps whose records in the
2-step run carry memory/peak_live_bytes. The runs' own figures are in their directories (summary.json, logs/).
"""

from __future__ import annotations

import gc
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch.distributed as dist  # noqa: E402
from hydra import compose, initialize_config_dir  # noqa: E402
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker  # noqa: E402

from dist_train.checks import validate  # noqa: E402
from dist_train.config import world_size_from_env  # noqa: E402
from dist_train.data import GlobalBatches, build_dataset  # noqa: E402
from dist_train.model import build_model  # noqa: E402
from dist_train.optim import OptimizerFactory  # noqa: E402
from dist_train.rundir import register_resolvers  # noqa: E402
from dist_train.runtime import init_runtime, leave, shutdown  # noqa: E402
from dist_train.session import build_session  # noqa: E402
from dist_train.strategies.base import StrategyContext  # noqa: E402
from dist_train.strategies.registry import build_strategy, register_configs  # noqa: E402
from dist_train.train import _fit, to_run_config  # noqa: E402


def config(overrides: list[str]):  # type: ignore[no-untyped-def]
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=["strategy=fsdp", *overrides])
    run = to_run_config(cfg)
    validate(run, world_size_from_env())
    return run, cfg


def tracked_second_step(run, runtime) -> dict[str, int]:  # type: ignore[no-untyped-def]
    """FSDPMemTracker's peak of all live tensors over step 2 of a fresh fsdp strategy, by its categories."""
    t = run.train
    dp = run.strategy.data_parallel_size(runtime.world_size)
    batches = GlobalBatches(build_dataset(run.data, vocab_size=run.model.vocab_size, seq_len=t.seq_len, seed=t.seed),
                            global_batch_size=t.global_batch_size, dp_rank=runtime.rank % dp, dp_size=dp)
    ctx = StrategyContext(runtime=runtime, train=t, precision=run.precision, optimizer=OptimizerFactory(run.optimizer, t),
                          model=run.model)
    strategy = build_strategy(run.strategy, ctx)
    strategy.setup(build_model(run.model, seed=t.seed))
    strategy.train_step(batches.local_batch(0))
    tracker = FSDPMemTracker(strategy.wrapped, strategy.opt.optimizer)
    tracker.track_inputs(())
    with tracker:  # one micro-batch per step: FSDPMemTracker refuses a second root forward in one region
        strategy.train_step(batches.local_batch(1))
    peak = tracker.get_tracker_snapshot("peak")
    peak = next(iter(peak.values())) if peak else {}
    del strategy, tracker
    gc.collect()
    return {getattr(k, "value", str(k)): int(v) for k, v in peak.items()}  # "OptState", "Total", ...


def real_run(run, cfg, runtime, run_dir: Path):  # type: ignore[no-untyped-def]
    """A training run as launch/train.py makes it (train._run, with its own run directory): its session."""
    session = build_session(run, cfg, runtime, resume=None, fault=None, run_dir=run_dir)
    try:
        _fit(session)
    finally:
        if session.telemetry.tracker is not None:
            session.telemetry.tracker.uninstall()
        if hasattr(session.batches, "close"):  # the prefetch thread
            session.batches.close()
    return session


def main() -> None:
    register_configs()
    register_resolvers()
    overrides = sys.argv[1:]
    base = Path(next(a.split("=", 1)[1] for a in overrides if a.startswith("hydra.run.dir=")))
    run, cfg = config(overrides)
    runtime = init_runtime(needs_group=True)
    theirs = tracked_second_step(run, runtime)

    two = real_run(*config([*overrides, "train.steps=2"]), runtime, base / "two")
    # The steps whose records carry a peak of live tensors, per rank (rank 0 holds every rank's records).
    with_peak = {}
    for records in two.telemetry.history:
        for r in records:
            with_peak.setdefault(r["rank"], [])
            if "memory/peak_live_bytes" in r:
                with_peak[r["rank"]].append(r["step"])
    del two
    gc.collect()
    real_run(*config([*overrides, "train.steps=1"]), runtime, base / "one")

    # Rank 0 prints every rank's row: two ranks printing to torchrun's one stdout can run their lines together.
    rows = [None] * runtime.world_size
    dist.all_gather_object(rows, {"rank": runtime.rank, "tracker_peak": theirs.get("Total", 0), "tracker": theirs})
    if runtime.rank == 0:
        for row in rows:
            row["steps_with_peak_live"] = with_peak.get(row["rank"])
        print("\n".join(json.dumps(r) for r in rows), flush=True)
    shutdown(runtime)
    leave(0)


if __name__ == "__main__":
    main()
