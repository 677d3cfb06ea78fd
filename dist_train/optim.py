"""Optimizer and learning-rate schedule, built from config over whatever parameters a strategy hands in.

Strategies call these after wrapping (FSDP2's parameters are DTensors only after `fully_shard`), and
DeepSpeed receives the same torch optimizer, so one config means one optimizer everywhere.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from dist_train.config import OptimizerConfig, TrainConfig


@dataclass(frozen=True)
class OptimizerFactory:
    optimizer: OptimizerConfig
    train: TrainConfig
    # Where the optimizer steps: the runtime's device. It decides the fused kernel, not where the parameters
    # happen to be when the optimizer is built (DeepSpeed and Accelerate move them afterwards). None: the
    # parameters' device.
    device: torch.device | None = None

    def build(self, params: Iterable[torch.nn.Parameter], *, on_device: bool = True) -> torch.optim.Optimizer:
        """on_device=False: the step runs on host copies (DeepSpeed's optimizer offload), never fused."""
        o, lr = self.optimizer, self.train.lr
        params = [p for p in params if p.requires_grad]
        if o.name in ("adamw", "adam"):
            cls = torch.optim.AdamW if o.name == "adamw" else torch.optim.Adam
            fused = on_device and fused_on_device(params, device=self.device)
            return cls(params, lr=lr, betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay,
                       fused=fused or None)
        if o.name == "sgd":
            return torch.optim.SGD(params, lr=lr, momentum=o.momentum, weight_decay=o.weight_decay)
        if o.name == "adafactor":
            # torch's own (Shazeer & Stern 2018, with its relative step off: train.lr is the step size)
            return torch.optim.Adafactor(params, lr=lr, weight_decay=o.weight_decay)
        if o.name == "lion":
            from lion_pytorch import Lion

            return Lion(params, lr=lr, betas=tuple(o.betas), weight_decay=o.weight_decay)
        if o.name == "adam8bit":
            import bitsandbytes as bnb

            return bnb.optim.AdamW8bit(params, lr=lr, betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay)
        if o.name == "lomo":
            return LOMO(params, lr=lr, weight_decay=o.weight_decay)
        raise AssertionError(f"unvalidated optimizer {o.name!r}")

    def scheduler(self, optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
        schedule = LRSchedule(self.train)
        # A plain function, not the object: LambdaLR's state dict (which DeepSpeed checkpoints) would pickle
        # an object's fields, and loading it would bring back the saved config over the current one.
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda=lambda step: schedule(step))


def fused_on_device(params: list[torch.Tensor], *, device: torch.device | None = None) -> bool:
    """Whether Adam(W) takes its fused kernel: one launch per step for every tensor, where torch's default
    (foreach) issues several per group. Only when every parameter is floating-point and the step runs on CUDA
    (`device`, else the parameters' own; a DTensor shard included), so that every strategy of a GPU comparison
    runs the same kernel; on the CPU the default stays, so that CPU runs are the same arithmetic everywhere."""
    on_cuda = (lambda p: device.type == "cuda") if device is not None else (lambda p: p.device.type == "cuda")
    return bool(params) and all(on_cuda(p) and p.is_floating_point() for p in params)


class LOMO(torch.optim.Optimizer):
    """LOMO (Lv et al. 2023, "Full Parameter Fine-tuning for Large Language Models with Limited Resources"):
    SGD fused into backward. As soon as a parameter's gradient is complete, the parameter takes its step and
    the gradient is freed, so at most one parameter's gradient exists at a time and there is no optimizer
    state. The price: no accumulation and no clipping by the global norm (it is known only after every
    update), and one process (no gradient to reduce first); dist_train.checks refuses the rest.

    `step()` does nothing; `take_grad_norm()` gives the global norm of the step's gradients, summed as they
    went by (the figure other optimizers clip by)."""

    updates_in_backward = True

    def __init__(self, params: Iterable[torch.nn.Parameter], *, lr: float, weight_decay: float = 0.0) -> None:
        super().__init__(list(params), {"lr": lr, "weight_decay": weight_decay})
        self._squares: list[torch.Tensor] = []
        for group in self.param_groups:
            for p in group["params"]:
                p.register_post_accumulate_grad_hook(lambda param, group=group: self._update(param, group))

    @torch.no_grad()
    def _update(self, p: torch.nn.Parameter, group: dict) -> None:
        grad = p.grad
        self._squares.append(grad.float().pow(2).sum())
        if group["weight_decay"]:
            grad = grad.add(p, alpha=group["weight_decay"])  # as torch's SGD applies it
        p.add_(grad, alpha=-group["lr"])
        p.grad = None

    def step(self, closure: Any = None) -> None:  # the updates happened in backward
        return None

    def take_grad_norm(self) -> torch.Tensor:
        squares, self._squares = self._squares, []
        return torch.stack(squares).sum().sqrt() if squares else torch.zeros(())


@dataclass(frozen=True)
class LRSchedule:
    """Multiplier of train.lr at a step: linear warm-up, then constant or cosine down to min_lr_ratio."""

    train: TrainConfig

    def __call__(self, step: int) -> float:
        t = self.train
        if step < t.lr_warmup_steps:
            return (step + 1) / t.lr_warmup_steps
        if t.lr_schedule == "constant":
            return 1.0
        span = max(1, t.steps - t.lr_warmup_steps)
        progress = min(1.0, (step - t.lr_warmup_steps) / span)
        return t.min_lr_ratio + (1 - t.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
