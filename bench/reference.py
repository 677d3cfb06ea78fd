"""A minimal hand-written PyTorch training loop: what dist_train's overhead is measured against.

Only torch and transformers: a GPT-2 built from a config with a fixed seed, DDP (no_sync during
accumulation) or FSDP2 (fully_shard per block, gradient sync off until the last micro-batch), AdamW,
clip_grad_norm_, random token batches. Each process runs where dist_train's would (bench/common.py's
`local_device`): its local rank's GPU with NCCL, else the CPU with gloo. Run alone (end to end) it prints one
JSON line on rank 0:

    torchrun --standalone --nproc_per_node=2 bench/reference.py --strategy ddp --steps 30

bench/interleaved.py imports `ReferenceLoop` to time its steps beside dist_train's in the same processes.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import end_process, init_group, local_device, synchronize  # noqa: E402


@dataclass
class Shape:
    layers: int = 4
    hidden: int = 256
    heads: int = 4
    vocab: int = 256
    seq: int = 128
    global_batch: int = 8
    micro_batch: int = 2
    lr: float = 1e-3
    seed: int = 1234


class ReferenceLoop:
    def __init__(self, strategy: str, shape: Shape, *, device: torch.device | None = None) -> None:
        """`device`: this process's (bench/common.py's `local_device()` when None)."""
        from transformers import GPT2Config, GPT2LMHeadModel

        self.shape, self.strategy = shape, strategy
        self.device = local_device() if device is None else device
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        torch.manual_seed(shape.seed)
        model = GPT2LMHeadModel(GPT2Config(
            vocab_size=shape.vocab, n_positions=shape.seq, n_embd=shape.hidden, n_layer=shape.layers,
            n_head=shape.heads, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
            bos_token_id=None, eos_token_id=None,
        )).to(self.device)
        if strategy == "ddp":
            self.model = torch.nn.parallel.DistributedDataParallel(model)
        elif strategy == "fsdp":
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            mesh = init_device_mesh(self.device.type, (self.world,))
            for block in model.transformer.h:
                fully_shard(block, mesh=mesh)
            self.model = fully_shard(model, mesh=mesh)
        else:
            raise ValueError(f"--strategy {strategy}: ddp or fsdp")
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=shape.lr, betas=(0.9, 0.95))
        self.gen = torch.Generator().manual_seed(shape.seed + (dist.get_rank() if dist.is_initialized() else 0))
        self.micro = shape.global_batch // (shape.micro_batch * self.world)

    def _no_sync(self, last: bool):  # noqa: ANN202
        if last:
            return contextlib.nullcontext()
        if self.strategy == "ddp":
            return self.model.no_sync()
        self.model.set_requires_gradient_sync(False)
        return contextlib.nullcontext()

    def step(self) -> None:
        """One optimizer step; the loss stays on the device (no host sync), as dist_train's does."""
        s = self.shape
        tokens = torch.randint(s.vocab, (self.micro, s.micro_batch, s.seq + 1), generator=self.gen).to(self.device)
        self.opt.zero_grad(set_to_none=True)
        for i in range(self.micro):
            last = i == self.micro - 1
            if self.strategy == "fsdp" and last:
                self.model.set_requires_gradient_sync(True)
            with self._no_sync(last):
                logits = self.model(input_ids=tokens[i, :, :-1]).logits
                loss = F.cross_entropy(logits.float().reshape(-1, s.vocab), tokens[i, :, 1:].reshape(-1))
                (loss / self.micro).backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()


def measure(step: Callable[[], None], *, device: torch.device, steps: int, warmup: int) -> dict[str, float]:
    """Run `steps` steps: the mean step time after `warmup` of them, and the wall-clock time at the end of the
    first. The device is synchronised only where the clock is read (step 1, the last warm-up step, the last
    step), as dist_train's telemetry synchronises at its logging windows' ends, never inside a step."""
    first = max(warmup, 1)
    ends: dict[int, float] = {}
    first_wall = 0.0
    for i in range(1, steps + 1):
        step()
        if i in (1, first, steps):
            synchronize(device)  # a GPU step returns once queued: read the clock when it has finished
            ends[i] = time.perf_counter()
            if i == 1:
                first_wall = time.time()
    return {"mean_step_s": (ends[steps] - ends[first]) / (steps - first), "first_step_wall": first_wall}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", default="ddp")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    for name, value in vars(Shape()).items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=type(value), default=value)
    args = parser.parse_args()
    shape = Shape(**{k: getattr(args, k) for k in vars(Shape())})
    device = local_device()
    init_group(device)
    loop = ReferenceLoop(args.strategy, shape, device=device)
    got = measure(loop.step, device=device, steps=args.steps, warmup=args.warmup)
    dist.barrier()
    if dist.get_rank() == 0:
        import psutil

        print(json.dumps({
            "mean_step_s": got["mean_step_s"],
            "time_to_first_step_s": got["first_step_wall"] - psutil.Process(os.getpid()).create_time(),
        }), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    end_process()  # after the results are out: no interpreter teardown for gloo's threads to abort
