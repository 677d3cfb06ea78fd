"""The strategy interface, and the pieces that strategies using a torch optimizer share.

A strategy owns everything that differs between parallelisms: wrapping, forward + backward over the
micro-batches of a step (a pipeline schedule runs both; DeepSpeed's engine owns backward), gradient
sync during accumulation, clipping and the optimizer step, state dicts and what counts as its
parameters, gradients and optimizer state. The training loop names no strategy.
"""

from __future__ import annotations

import contextlib
import copy
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, ContextManager

import torch
from torch import nn

from dist_train.config import ConfigError, ModelConfig, PrecisionConfig, RunConfig, StrategyConfig, TrainConfig, require
from dist_train.contracts import Batch, ModelState, Runtime, StepOutput
from dist_train.faults import overflow_if_injected
from dist_train.model import forward_loss
from dist_train.optim import OptimizerFactory
from dist_train.parallel.plans import block_tp_plan
from dist_train.telemetry.memory import optimizer_state_tensors


@dataclass(frozen=True)
class StrategyContext:
    """What every strategy may use; built once by the loop."""

    runtime: Runtime
    train: TrainConfig
    precision: PrecisionConfig
    optimizer: OptimizerFactory
    # A DDP comm hook through which telemetry sees the reducer's all-reduces (None: telemetry off).
    ddp_comm_hook: Callable[..., Any] | None = None
    # A model built on meta (strategy trait builds_on_meta): called on the wrapped model to give it storage and
    # weights, before the optimizer is built.
    materialize: Callable[[nn.Module], None] | None = None
    # The model's config, resolved (a directory's config.json read in): what a strategy sizes by the model before
    # the model exists (DeepSpeed's buckets, from its width). None where a test builds a strategy without one.
    model: ModelConfig | None = None


def onto(model: nn.Module, device: torch.device) -> nn.Module:
    """The model on this rank's device; one built on meta stays there (sharded first, then filled), and one already
    there is left as it is (the dry run's fake tensors cannot be swapped by `Module.to`)."""
    params = list(model.parameters())
    if params[0].is_meta or all(p.device == device for p in params):
        return model
    return model.to(device)


def wrap_ddp(module: nn.Module, ctx: StrategyContext, *, group: Any = None, **options: Any) -> nn.Module:
    """`module` under DistributedDataParallel over `group` (None: every rank) on this rank's device, with the
    telemetry's comm hook where it has one: the reducer all-reduces from C++, and the hook issues the same
    all-reduce where telemetry sees it, over the group it is given as its state. `options`: DDP's own."""
    from torch.nn.parallel import DistributedDataParallel

    device = ctx.runtime.device
    ddp = DistributedDataParallel(module, process_group=group,
                                  device_ids=[device.index] if device.type == "cuda" else None, **options)
    if ctx.ddp_comm_hook is not None:
        ddp.register_comm_hook(state=group, hook=ctx.ddp_comm_hook)
    return ddp


def check_expert_parallel(cfg: StrategyConfig, *, ranks: int, sequence_parallel: bool = False,
                          outer: str = "efsdp") -> None:
    """ConfigError unless `cfg.ep` (the strategy's expert-parallel degree) can split the experts over `ranks`
    processes, ep consecutive ranks at a time (the experts' mesh is (`outer`, ep)), and under tensor parallelism the
    residual stream is whole on every TP rank."""
    require(cfg.ep >= 1, f"strategy.ep={cfg.ep} must be >= 1")
    require(ranks % cfg.ep == 0,
            f"strategy.ep={cfg.ep} must divide the number of processes ({ranks}): the experts' mesh is "
            f"({outer} {ranks}/{cfg.ep}) x (ep {cfg.ep})")
    require(cfg.ep == 1 or not sequence_parallel,
            f"strategy={cfg.name} with strategy.ep={cfg.ep} and strategy.sequence_parallel=true is not built yet: the "
            "experts take each rank's share of a whole residual stream; use strategy.sequence_parallel=false")


def check_experts_divide(run: RunConfig, ep: int, *, what: str) -> None:
    """ConfigError unless `ep` ranks can split every MoE layer's experts evenly."""
    require(run.model.num_experts % ep == 0,
            f"{what}: strategy.ep={ep} must divide model.num_experts={run.model.num_experts}: each rank holds "
            "num_experts / ep of every MoE layer's experts")


def check_tensor_parallel(run: RunConfig, tp: int, *, what: str, ep: int = 1) -> None:
    """ConfigError unless the model can be split `tp` ways by tensor parallelism: a plan for its blocks, and heads,
    KV heads and MLP width that divide; an MoE model's experts split over `ep` ranks instead (expert parallelism)."""
    m = run.model
    require(not m.num_experts or ep > 1,
            f"{what}: model.num_experts={m.num_experts}: tensor parallelism here does not split experts (transformers' "
            f"moe_tp_experts and packed_colwise are not applied); split them by expert with strategy.ep (it must "
            f"divide {m.num_experts} and the number of processes), or use fsdp_ep, fsdp, ddp, a ZeRO stage or a "
            "pipeline")
    require(ep == 1 or m.num_experts > 0,
            f"{what}: strategy.ep={ep} splits experts, and model {m.name} has none (model.num_experts=0); leave "
            "strategy.ep=1")
    if ep > 1:
        check_experts_divide(run, ep, what=what)
    require(ep == 1 or run.peft.name == "none",
            f"{what} with strategy.ep={ep} and peft={run.peft.name} is not built yet")
    if m.path is not None:
        from dist_train.pretrained import ModelDir

        try:
            block_tp_plan(ModelDir.open(m.path).config(trust_remote_code=m.trust_remote_code), experts_by_ep=ep > 1)
        except ValueError as exc:
            raise ConfigError(f"{what}: {exc}; use fsdp, ddp, a ZeRO stage or a pipeline") from exc
    kv = m.num_kv_heads or m.num_heads
    ffn = m.ffn_hidden_size or 4 * m.hidden_size
    split = [("num_heads", m.num_heads), ("num_kv_heads", kv)]
    if not (m.num_experts and m.moe_layers is None):  # a dense MLP somewhere (every layer MoE: none to split)
        split.append(("ffn_hidden_size", ffn))
    for field, value in split:
        require(
            value % tp == 0,
            f"{what} splits model.{field}={value} {tp} ways (tensor parallelism): it must be divisible by {tp}",
        )


# --------------------------------------------------------------------------------------------------
# Shared pieces for strategies that drive a torch optimizer themselves (single, dp, ddp, fsdp).
# --------------------------------------------------------------------------------------------------

def autocast(precision: PrecisionConfig, device: torch.device) -> ContextManager[Any]:
    """bf16/fp16 autocast on the rank's device; fp32 runs as is."""
    if not precision.mixed:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=precision.dtype)


def reduce_partial_grads(params: list[nn.Parameter]) -> None:
    """Under sequence parallelism a norm's weight gradient is a DTensor partial over the sequence shards, and the
    micro-batches sum into it unreduced. DTensor all-reduces such a tensor on every read that needs its value: the
    gradient norm and each of AdamW's foreach ops, 4 all-reduces of each a step (measured: tiny under strategy=tp).
    Reduced once here, after the last backward, every read finds it whole: the same values, one all-reduce."""
    for p in params:
        grad = p.grad
        placements = getattr(grad, "placements", None)
        if placements and any(pl.is_partial() for pl in placements):
            from torch.distributed.tensor import Replicate

            p.grad = grad.redistribute(grad.device_mesh, [Replicate() if pl.is_partial() else pl for pl in placements])


def grad_norm_and_clip(params: list[nn.Parameter], max_norm: float, *, total: torch.Tensor | None = None) -> torch.Tensor:
    """Global L2 norm of the gradients (DTensor shards are reduced across ranks), then clip if max_norm > 0.

    `total`: the global norm when this process cannot compute it from its own parameters (a pipeline
    stage holds only its share); the gradients are then clipped by it, as one process would clip them.
    """
    # one group per device mesh: DTensor's foreach ops take one mesh (fsdp_ep's experts have a mesh of their own)
    by_mesh: dict[Any, list[nn.Parameter]] = {}  # DeviceMesh compares by its ranks and names: equal ones are one
    for p in params:
        by_mesh.setdefault(getattr(p, "device_mesh", None), []).append(p)
    if total is None:
        norms = []
        for group in by_mesh.values():
            grads = [p.grad for p in group if p.grad is not None]
            if grads:
                norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0)
                full_tensor = getattr(norm, "full_tensor", None)
                norms.append(full_tensor() if callable(full_tensor) else norm)
        if len(norms) == 1:  # one mesh (or none): its norm as it is, bit for bit
            total = norms[0]
        else:
            total = torch.stack(norms).norm() if norms else torch.zeros(())
    if max_norm > 0:
        for group in by_mesh.values():
            torch.nn.utils.clip_grads_with_norm_(group, max_norm, total)
    return total


class LocalOptimizer:
    """Optimizer, LR schedule, loss scaling (fp16) and clipping over parameters this process updates."""

    def __init__(self, ctx: StrategyContext, params: list[nn.Parameter], *, zero_in_place: bool = False) -> None:
        """`zero_in_place`: the gradients are views into DDP's all-reduce buckets (gradient_as_bucket_view).
        Zeroed rather than dropped between steps, they stay views: micro-batches accumulate into the buckets under
        no_sync, where dropped gradients would be accumulated apart and copied into the buckets by the last
        micro-batch's backward, a second copy of every gradient at the peak. Zero plus a gradient is that
        gradient, bit for bit: the training is the same."""
        self.params = params
        self.zero_in_place = zero_in_place
        self.max_norm = ctx.train.grad_clip
        self.optimizer = ctx.optimizer.build(params)
        self.scheduler = ctx.optimizer.scheduler(self.optimizer)
        # fp16. Under FSDP and tensor parallelism the gradients are DTensor shards, and DTensor reduces the scaler's
        # found_inf over the mesh (max) when it unscales them: every rank skips the same steps with torch's plain
        # GradScaler (tested with DIST_TRAIN_FAULT=overflow in one rank's shard); a ShardedGradScaler would
        # all-reduce the same verdict a second time.
        self.scaler = torch.amp.GradScaler(ctx.runtime.device.type) if ctx.precision.loss_scaling else None
        self._expert_params: dict[int, list[nn.Parameter]] = {}  # per model: its experts' parameters, found once

    def backward(self, loss: torch.Tensor) -> None:
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=not self.zero_in_place)

    def step(self, *, total_norm: torch.Tensor | None = None) -> torch.Tensor:
        """Clip (by `total_norm` if given, else the norm of these parameters), step, advance the schedule."""
        if getattr(self.optimizer, "updates_in_backward", False):  # LOMO: already updated, nothing to clip
            self.scheduler.step()
            return self.optimizer.take_grad_norm()
        reduce_partial_grads(self.params)
        if self.scaler is not None:
            # A norm computed before unscaling would be in scaled units.
            assert total_norm is None, "a precomputed norm cannot be combined with fp16 loss scaling"
            overflow_if_injected(self.params)  # DIST_TRAIN_FAULT=overflow: a local inf, as a real overflow
            self.scaler.unscale_(self.optimizer)
        norm = grad_norm_and_clip(self.params, self.max_norm, total=total_norm)
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.scheduler.step()
        return norm

    @property
    def lr(self) -> float:
        return float(self.scheduler.get_last_lr()[0])

    def extra_state(self) -> dict[str, Any]:
        """LR schedule (and fp16 loss scaler) state: plain values, saved beside the optimizer's tensors.

        The schedule's multiplier function is rebuilt from the config, not saved: only its position is.
        """
        schedule = {k: v for k, v in self.scheduler.state_dict().items() if k != "lr_lambdas"}
        state: dict[str, Any] = {"schedule": schedule}
        if self.scaler is not None:
            state["scaler"] = self.scaler.state_dict()
        return state

    def load_extra_state(self, state: dict[str, Any]) -> None:
        schedule = dict(state["schedule"])
        schedule["lr_lambdas"] = [None] * len(self.optimizer.param_groups)  # keep ours (see extra_state)
        self.scheduler.load_state_dict(schedule)
        if self.scaler is not None:
            self.scaler.load_state_dict(state["scaler"])

    def model_state(self, model: nn.Module) -> ModelState:
        params = list(model.parameters())
        return ModelState(
            params=params,
            grads=[p.grad for p in params],
            optimizer=optimizer_state_tensors(self.optimizer),
            experts=self._expert_state(model),
        )

    def _expert_state(self, model: nn.Module) -> ModelState | None:
        """The experts' parameters, gradients and optimizer state (this rank's shards), None for a dense model."""
        from dist_train.architectures import expert_modules

        if id(model) not in self._expert_params:
            self._expert_params[id(model)] = [p for module in expert_modules(model) for p in module.parameters()]
        params = self._expert_params[id(model)]
        if not params:
            return None
        state = [v for p in params for v in self.optimizer.state.get(p, {}).values() if isinstance(v, torch.Tensor)]
        return ModelState(params=params, grads=[p.grad for p in params], optimizer=state)


def accumulate(
    model: nn.Module,
    batch: Batch,
    *,
    micro_batch_size: int,
    opt: LocalOptimizer,
    precision: PrecisionConfig,
    device: torch.device,
    no_sync: Callable[[], ContextManager[Any]],
) -> tuple[torch.Tensor, int]:
    """Forward + backward over the micro-batches of `batch`; gradients sync only on the last one.

    Each micro-batch loss is divided by the number of micro-batches, so the accumulated gradient is
    the gradient of the mean loss whatever the split (and, after DDP/FSDP average over ranks, the mean
    over the global batch).
    """
    micro = batch.split(micro_batch_size)
    loss_sum = torch.zeros((), device=device)
    for i, mb in enumerate(micro):
        sync = contextlib.nullcontext() if i == len(micro) - 1 else no_sync()
        with sync:
            with autocast(precision, device):
                loss = forward_loss(model, mb.input_ids, mb.labels)
            opt.backward(loss / len(micro))
        loss_sum += loss.detach()
    return loss_sum, len(micro)


def evaluate(model: nn.Module, batch: Batch, *, micro_batch_size: int, precision: PrecisionConfig | None,
             device: torch.device) -> StepOutput:
    """Forward only over the micro-batches of `batch`, without gradients, the model in eval mode (no dropout, no
    NEFTune noise), then back in train mode: the loss summed over the micro-batches. The same autocast as
    training (`precision`; None: the model computes in its own dtype, as DeepSpeed's engine does)."""
    was_training = model.training
    model.eval()
    micro = batch.split(micro_batch_size)
    loss_sum = torch.zeros((), device=device)
    try:
        with torch.no_grad(), autocast(precision, device) if precision is not None else contextlib.nullcontext():
            for mb in micro:
                loss_sum += forward_loss(model, mb.input_ids, mb.labels)
    finally:
        model.train(was_training)
        reshard(model)
    return StepOutput(loss_sum=loss_sum, num_microbatches=len(micro), grad_norm=None)


def reshard(model: nn.Module) -> None:
    """Free what FSDP2 keeps gathered after a forward that no backward follows (an evaluation): the root module
    stays unsharded after forward, for its backward, and would otherwise hold its whole parameters until the next
    training step (measured: the embeddings, on every rank)."""
    if "torch.distributed.fsdp" not in sys.modules:  # nothing can be sharded by FSDP2 in this process
        return
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


@contextlib.contextmanager
def nothing() -> Iterator[None]:
    yield


def detached_clone(obj: Any) -> Any:
    """A copy of nested containers whose tensors are detached clones (a state dict that training won't move)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: detached_clone(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(detached_clone(v) for v in obj)
    return copy.deepcopy(obj)


def _dcp_options() -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    # Optimizer state keyed by parameter name (`state.<fqn>.exp_avg`, `param_groups.<fqn>.lr`) rather than
    # by position: pipeline stages then hold disjoint keys, and any strategy can read what another wrote.
    return StateDictOptions(flatten_optimizer_state_dict=True)


def torch_state_dict(model: nn.Module, opt: LocalOptimizer) -> dict[str, Any]:
    """The whole training state in torch.distributed.checkpoint's layout (DTensor shards stay sharded).

    Keys are the unwrapped model's parameter names (DDP's `module.` is dropped, FSDP2 keeps the names, a
    pipeline stage holds its share under the full model's names), so one strategy's checkpoint loads into
    another at any world size where the format allows it.
    """
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, opt.optimizer, options=_dcp_options())
    return {"model": model_sd, "optimizer": optim_sd, **opt.extra_state()}


def load_torch_state_dict(model: nn.Module, opt: LocalOptimizer, state: dict[str, Any]) -> None:
    from torch.distributed.checkpoint.state_dict import set_state_dict

    set_state_dict(
        model, opt.optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"],
        options=_dcp_options(),
    )
    opt.load_extra_state(state)
