"""Under torchrun: dist_train's memory/peak_live_bytes for an fsdp step against torch's own FSDPMemTracker.

Builds the fsdp strategy as train.py does and trains step 0 (lazy init, optimizer state). Step 1 runs under
`FSDPMemTracker(root, optimizer)`: its peak of all live tensors. Step 2 (same shapes, same state) runs under
dist_train's LiveMeter, as the telemetry runs it. Prints both peaks and their compositions as one JSON line per
rank.
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
from dist_train.strategies.base import StrategyContext  # noqa: E402
from dist_train.strategies.registry import build_strategy, register_configs  # noqa: E402
from dist_train.telemetry.memory import LiveMeter  # noqa: E402
from dist_train.train import to_run_config  # noqa: E402


def main() -> None:
    register_configs()
    register_resolvers()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=["strategy=fsdp", *sys.argv[1:]])
    run = to_run_config(cfg)
    world = world_size_from_env()
    validate(run, world)
    runtime = init_runtime(needs_group=True)
    t = run.train
    dp = run.strategy.data_parallel_size(world)
    batches = GlobalBatches(build_dataset(run.data, vocab_size=run.model.vocab_size, seq_len=t.seq_len, seed=t.seed),
                            global_batch_size=t.global_batch_size, dp_rank=runtime.rank % dp, dp_size=dp)
    ctx = StrategyContext(runtime=runtime, train=t, precision=run.precision, optimizer=OptimizerFactory(run.optimizer, t))
    strategy = build_strategy(run.strategy, ctx)
    strategy.setup(build_model(run.model, seed=t.seed))
    strategy.train_step(batches.local_batch(0))

    tracker = FSDPMemTracker(strategy.wrapped, strategy.opt.optimizer)
    tracker.track_inputs(())
    with tracker:  # one micro-batch per step: FSDPMemTracker refuses a second root forward in one region
        strategy.train_step(batches.local_batch(1))
    theirs = tracker.get_tracker_snapshot("peak")
    theirs = next(iter(theirs.values())) if theirs else {}

    meter = LiveMeter()
    with meter.measuring(strategy.model_state()):
        strategy.train_step(batches.local_batch(2))
    row = {"rank": runtime.rank, "tracker_peak": int(theirs.get("Total", 0)),
           "tracker": {str(k): int(v) for k, v in theirs.items()}, "peak_live": meter.peak_bytes,
           "ours": meter.peak_by_category}
    # Rank 0 prints every rank's row: two ranks printing to torchrun's one stdout can run their lines together.
    rows = [None] * runtime.world_size
    dist.all_gather_object(rows, row)
    if runtime.rank == 0:
        print("\n".join(json.dumps(r) for r in rows), flush=True)
    del strategy, tracker
    gc.collect()
    shutdown(runtime)
    leave(0)


if __name__ == "__main__":
    main()
