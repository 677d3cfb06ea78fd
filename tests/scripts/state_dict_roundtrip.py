"""Under torchrun (or python for single): does a strategy's state_dict round-trip exactly?

Strategy A trains 2 steps, its state is saved (cloned), A trains step 3. Strategy B (built fresh, then
perturbed by one step on another batch) loads the saved state and trains step 3. The two step-3 losses
and the parameters after it must be identical. Prints one JSON line on rank 0.
"""

from __future__ import annotations

import gc
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from hydra import compose, initialize_config_dir  # noqa: E402

from dist_train.checks import validate  # noqa: E402
from dist_train.config import world_size_from_env  # noqa: E402
from dist_train.data import GlobalBatches, build_dataset  # noqa: E402
from dist_train.model import build_model  # noqa: E402
from dist_train.optim import OptimizerFactory  # noqa: E402
from dist_train.rundir import register_resolvers  # noqa: E402
from dist_train.runtime import init_runtime, leave, shutdown  # noqa: E402
from dist_train.strategies.base import StrategyContext  # noqa: E402
from dist_train.strategies.registry import build_strategy, register_configs  # noqa: E402
from dist_train.strategies.base import detached_clone  # noqa: E402
from dist_train.contracts import local_tensor  # noqa: E402
from dist_train.train import to_run_config  # noqa: E402


def global_loss(out, runtime) -> float:
    part = torch.tensor(
        [float(out.loss_sum) if out.loss_sum is not None else 0.0, float(out.num_microbatches if out.loss_sum is not None else 0)],
        dtype=torch.float64,
    )
    if runtime.has_group:
        dist.all_reduce(part)
    return float(part[0] / part[1])


def local_params(strategy) -> list[torch.Tensor]:
    return [local_tensor(t).detach().clone().float() for t in strategy.model_state().params]


def main() -> None:
    register_configs()
    register_resolvers()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=sys.argv[1:])
    run = to_run_config(cfg)
    world = world_size_from_env()
    validate(run, world)
    runtime = init_runtime(needs_group=run.strategy.needs_process_group)
    t = run.train
    dp = run.strategy.data_parallel_size(world)
    batches = GlobalBatches(
        build_dataset(run.data, vocab_size=run.model.vocab_size, seq_len=t.seq_len, seed=t.seed),
        global_batch_size=t.global_batch_size, dp_rank=runtime.rank % dp, dp_size=dp,
    )

    def fresh():
        ctx = StrategyContext(runtime=runtime, train=t, precision=run.precision, optimizer=OptimizerFactory(run.optimizer, t),
                              model=run.model)
        strategy = build_strategy(run.strategy, ctx)
        strategy.setup(build_model(run.model, seed=t.seed))
        return strategy

    a = fresh()
    for step in range(2):
        a.train_step(batches.local_batch(step))
    saved = detached_clone(a.state_dict())
    loss_a = global_loss(a.train_step(batches.local_batch(2)), runtime)
    params_a = local_params(a)

    b = fresh()
    b.train_step(batches.local_batch(7))  # move B away from the saved state first
    b.load_state_dict(saved)
    loss_b = global_loss(b.train_step(batches.local_batch(2)), runtime)
    params_b = local_params(b)
    max_diff = max((pa - pb).abs().max().item() for pa, pb in zip(params_a, params_b) if pa.numel())
    if runtime.has_group:
        box = torch.tensor([max_diff], dtype=torch.float64)
        dist.all_reduce(box, op=dist.ReduceOp.MAX)
        max_diff = float(box)
    if runtime.is_main:
        print(json.dumps({"loss_a": loss_a, "loss_b": loss_b, "max_param_diff": max_diff}))
    # Release both strategies (their DDP reducers / engines hold the process group) before destroying it,
    # as train.py does by returning from _train first; destroying it under them can abort at exit.
    del a, b
    gc.collect()
    shutdown(runtime)
    leave(0)  # as launch/train.py ends: no interpreter finalization under gloo's threads (see runtime.leave)


if __name__ == "__main__":
    main()
