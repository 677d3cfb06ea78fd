"""Optimizer and learning-rate schedule, built from config over whatever parameters a strategy hands in.

Strategies call these after wrapping (FSDP2's parameters are DTensors only after `fully_shard`), and
DeepSpeed receives the same torch optimizer, so one config means one optimizer everywhere.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from dist_train.config import OptimizerConfig, TrainConfig


@dataclass(frozen=True)
class OptimizerFactory:
    optimizer: OptimizerConfig
    train: TrainConfig

    def build(self, params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
        o, lr = self.optimizer, self.train.lr
        params = [p for p in params if p.requires_grad]
        if o.name in ("adamw", "adam"):
            cls = torch.optim.AdamW if o.name == "adamw" else torch.optim.Adam
            return cls(params, lr=lr, betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay)
        if o.name == "sgd":
            return torch.optim.SGD(params, lr=lr, momentum=o.momentum, weight_decay=o.weight_decay)
        raise AssertionError(f"unvalidated optimizer {o.name!r}")

    def scheduler(self, optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
        schedule = LRSchedule(self.train)
        # A plain function, not the object: LambdaLR's state dict (which DeepSpeed checkpoints) would pickle
        # an object's fields, and loading it would bring back the saved config over the current one.
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda=lambda step: schedule(step))


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
