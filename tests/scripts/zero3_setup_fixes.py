"""Under torchrun: DeepSpeed's ZeRO-3 engine built with and without dist_train's set-up fixes
(dist_train/strategies/_zero3_setup.py), on the same model, data and seed.

For each precision (fp32, bf16) and each arm it records the all-gathers made while `deepspeed.initialize` runs,
whether each fp32 master partition shares the parameters' storage, and the losses and parameters of 3 steps.
Rank 0 prints one JSON line.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

from dist_train.runtime import exit_now  # noqa: E402
from dist_train.strategies._deepspeed_env import init_deepspeed_comm, skip_inference_comm_op  # noqa: E402
from dist_train.strategies._zero3_setup import zero3_setup_fixes  # noqa: E402

GATHERS = ("all_gather", "all_gather_into_tensor")


class Counter:
    """Counts torch.distributed's all-gathers (DeepSpeed's comm calls them by name at call time)."""

    def __init__(self) -> None:
        self.calls = 0
        self.originals = {name: getattr(dist, name) for name in GATHERS}
        for name, fn in self.originals.items():
            setattr(dist, name, self._counting(fn))

    def _counting(self, fn):
        def counted(*args, **kwargs):
            self.calls += 1
            return fn(*args, **kwargs)

        return counted


def build(bf16: bool):
    import deepspeed

    config = {
        "train_batch_size": 2 * dist.get_world_size(), "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
        "bf16": {"enabled": bf16}, "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "zero_allow_untested_optimizer": True, "zero_force_ds_cpu_optimizer": False, "steps_per_print": 2**31 - 1,
    }
    torch.manual_seed(0)
    with deepspeed.zero.Init(config_dict_or_path=config):
        model = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 8))
    return model, config


def run(*, bf16: bool, fixed: bool, counter: Counter) -> dict:
    import contextlib

    import deepspeed

    model, config = build(bf16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    before = counter.calls
    with zero3_setup_fixes() if fixed else contextlib.nullcontext([]) as applied:
        engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config, dist_init_required=False)
    gathers = counter.calls - before
    opt = engine.optimizer
    shared = [m.untyped_storage().data_ptr() == p.untyped_storage().data_ptr()
              for m, p in zip(opt.fp32_partitioned_groups_flat, opt.fp16_partitioned_groups_flat)]
    generator = torch.Generator().manual_seed(dist.get_rank())
    dtype = torch.bfloat16 if bf16 else torch.float32
    losses, before = [], counter.calls
    for _ in range(3):
        x = torch.randn(2, 32, generator=generator).to(dtype)
        y = torch.randn(2, 8, generator=generator).to(dtype)
        loss = nn.functional.mse_loss(engine(x).float(), y.float())
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    gathers_in_steps = counter.calls - before
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
        params = [p.detach().float().clone() for p in engine.module.parameters()]
    engine.destroy()
    return {"applied": applied, "gathers_at_setup": gathers, "gathers_in_steps": gathers_in_steps,
            "master_shares_params": shared, "losses": losses, "params": params}


def main() -> None:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    dist.init_process_group("gloo")
    skip_inference_comm_op()
    init_deepspeed_comm("gloo")
    counter = Counter()
    out = {}
    for precision in ("fp32", "bf16"):
        arms = {arm: run(bf16=precision == "bf16", fixed=arm == "fixed", counter=counter) for arm in ("plain", "fixed")}
        diff = max(float((a - b).abs().max()) for a, b in zip(arms["plain"].pop("params"), arms["fixed"].pop("params")))
        out[precision] = {**arms, "max_param_diff": diff}
    if dist.get_rank() == 0:
        print(json.dumps(out), flush=True)
    dist.destroy_process_group()
    exit_now(0)  # gloo's threads can abort interpreter teardown (see dist_train.runtime.leave)


if __name__ == "__main__":
    main()
