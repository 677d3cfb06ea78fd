"""A strategy that drives a torch optimizer itself; single, dp, ddp and fsdp differ only in their `Wrapper`."""

from __future__ import annotations

from typing import Any, ContextManager, Protocol

import torch
from torch import nn

from dist_train.checkpoint.dcp_io import DcpIO
from dist_train.contracts import Batch, ModelState, StepOutput
from dist_train.strategies.base import (
    LocalOptimizer,
    StrategyContext,
    accumulate,
    evaluate,
    load_torch_state_dict,
    torch_state_dict,
)


class Wrapper(Protocol):
    """How one parallelism wraps a model and silences gradient sync during accumulation."""

    def wrap(self, model: nn.Module) -> nn.Module: ...

    def no_sync(self, wrapped: nn.Module) -> ContextManager[Any]: ...

    def devices(self) -> list[torch.device]: ...


class TorchStrategy:
    def __init__(self, name: str, ctx: StrategyContext, wrapper: Wrapper) -> None:
        self.name, self.ctx, self.wrapper = name, ctx, wrapper
        self.model: nn.Module | None = None  # as built, no wrapper around it
        self.wrapped: nn.Module | None = None
        self.opt: LocalOptimizer | None = None

    def empty_model_context(self) -> ContextManager[Any]:
        return torch.device("meta")  # fully_shard on meta; materialize gives each rank its rows

    def setup(self, model: nn.Module) -> None:
        self.model = model
        self.wrapped = self.wrapper.wrap(model)
        if self.ctx.materialize is not None:  # built on meta: storage and weights now that it is sharded
            self.ctx.materialize(self.wrapped)
        # After wrapping: FSDP2's parameters are DTensor shards only from here on.
        self.opt = LocalOptimizer(self.ctx, list(self.wrapped.parameters()),
                                  zero_in_place=bool(getattr(self.wrapped, "gradient_as_bucket_view", False)))

    def train_step(self, batch: Batch) -> StepOutput:
        assert self.wrapped is not None and self.opt is not None, "setup() first"
        self.opt.zero_grad()
        device = self.ctx.runtime.device
        loss_sum, n = accumulate(
            self.wrapped,
            batch.to(device),
            micro_batch_size=self.ctx.train.micro_batch_size,
            opt=self.opt,
            precision=self.ctx.precision,
            device=device,
            no_sync=lambda: self.wrapper.no_sync(self.wrapped),
        )
        grad_norm = self.opt.step()
        return StepOutput(loss_sum=loss_sum, num_microbatches=n, grad_norm=grad_norm)

    def eval_step(self, batch: Batch) -> StepOutput:
        assert self.wrapped is not None, "setup() first"
        device = self.ctx.runtime.device
        return evaluate(self.wrapped, batch.to(device), micro_batch_size=self.ctx.train.micro_batch_size,
                        precision=self.ctx.precision, device=device)

    def model_state(self) -> ModelState:
        assert self.wrapped is not None and self.opt is not None
        return self.opt.model_state(self.wrapped)

    # The model as built, not its wrapper: DDP and DataParallel hold it as `.module` (whose `module.` prefix
    # would make the keys differ between strategies), FSDP2 shards it in place. Same parameters either way.
    def state_dict(self) -> dict[str, Any]:
        assert self.model is not None and self.opt is not None
        return torch_state_dict(self.model, self.opt)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        assert self.model is not None and self.opt is not None
        load_torch_state_dict(self.model, self.opt, state)

    def checkpoint_io(self) -> DcpIO:
        return DcpIO(self)

    @property
    def lr(self) -> float:
        assert self.opt is not None
        return self.opt.lr

    @property
    def devices(self) -> list[torch.device]:
        return self.wrapper.devices()

    def extra_metrics(self) -> dict[str, float]:
        return {}

    def mesh_groups(self) -> dict[str, list[int]]:
        """This rank's process group per named device-mesh dimension ({"tp": [0, 1]}); {} without a mesh."""
        return getattr(self.wrapper, "mesh_groups", dict)()
