"""DeepSpeed's engine behind the strategy interface, shared by strategy=zero<N> and strategy=accelerate with
DeepSpeed (Accelerate builds the same engine through its DeepSpeedPlugin).

The DeepSpeed config is derived from the run's own config (:func:`deepspeed_config`), so one Hydra
config trains the same way under every strategy; `extra` is deep-merged over it. DeepSpeed's engine owns
backward (loss scaling by 1/accumulation), gradient reduction, clipping and the optimizer step; the
optimizer and LR schedule are ours (`OptimizerFactory`), handed to DeepSpeed.

Nothing here imports DeepSpeed at module level: the registry imports strategy modules in every run. DeepSpeed's
set-up in this process is _deepspeed_env.py, its checkpoint format checkpoint/deepspeed_io.py.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from dist_train.config import PrecisionConfig, RunConfig, TrainConfig, importable, require
from dist_train.contracts import Batch, ModelState, StepOutput, dtype_name, tensor_bytes
from dist_train.model import forward_loss
from dist_train.parallel.buckets import zero_bucket_sizes
from dist_train.parallel_dims import ParallelDims, layout_dims
from dist_train.checkpoint.deepspeed_io import DeepSpeedIO
from dist_train.strategies._deepspeed_env import (
    init_deepspeed_comm,
    skip_inference_comm_op,
    unmap_large_frees,
    use_extensions_cache,
)
from dist_train.strategies._zero3_setup import zero3_setup_fixes
from dist_train.strategies.base import StrategyContext, detached_clone, evaluate
from dist_train.telemetry.memory import optimizer_state_tensors

log = logging.getLogger("dist_train")


@dataclass
class DeepSpeedSettings:
    """What the engine is built from: the ZeRO stage and offloads (strategy=zero<N>'s schema has the same fields)."""

    name: str
    stage: int
    offload_optimizer: bool = False
    offload_params: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    def parallel_dims(self, world_size: int) -> ParallelDims:
        return layout_dims("shard", world_size)  # ZeRO partitions over every rank

    def data_parallel_size(self, world_size: int) -> int:
        return self.parallel_dims(world_size).data_parallel


def check_settings(s: Any, world_size: int) -> None:
    """Checks before any process group: the stage, the offloads, DeepSpeed itself."""
    require(s.stage in (1, 2, 3), f"strategy.stage={s.stage} is not a ZeRO stage; allowed: 1, 2, 3")
    require(
        not s.offload_params or s.stage == 3,
        f"strategy.offload_params=true needs strategy.stage=3 (got {s.stage})",
    )
    require(
        importable("deepspeed"),
        f"strategy={s.name} needs DeepSpeed, which is not importable in this environment; "
        "`pip install deepspeed` or pick strategy=ddp|fsdp",
    )
    if s.offload_optimizer or s.offload_params:
        what = "optimizer and parameters" if s.offload_params else "optimizer"
        require(
            torch.cuda.is_available(),
            f"strategy={s.name} offloads the {what} from GPU to CPU memory, but no CUDA GPU is visible; "
            f"on CPU use strategy=zero{s.stage} (no offload)",
        )


def check_run_settings(s: Any, run: RunConfig) -> None:
    """Checks that need the run's values."""
    if run.precision.loss_scaling:
        require(
            torch.cuda.is_available(),
            f"strategy={s.name} with precision=fp16 needs a GPU: DeepSpeed's CPU accelerator runs fp32 and "
            "bf16 only; use precision=bf16 on CPU",
        )


def deep_merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """`base` with `extra` merged in; nested dicts merge key by key, anything else in `extra` wins."""
    out = copy.deepcopy(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def deepspeed_config(
    *, zero: Any, train: TrainConfig, precision: PrecisionConfig, dims: ParallelDims, hidden_size: int | None = None
) -> dict[str, Any]:
    """The DeepSpeed config that trains like every other strategy under the same run config.

    `hidden_size`: the model's width, which sizes ZeRO's buckets as transformers' "auto" does (parallel/buckets.py;
    the estimator reads the same sizes); None keeps DeepSpeed's defaults (5e8 elements for the reduction bucket)."""
    accumulation = dims.microbatches(global_batch_size=train.global_batch_size, micro_batch_size=train.micro_batch_size)
    zero_opt: dict[str, Any] = {"stage": zero.stage}
    if hidden_size is not None:
        buckets = zero_bucket_sizes(hidden_size)
        zero_opt["reduce_bucket_size"] = buckets["reduce_bucket_size"]
        if zero.stage == 3:
            zero_opt["stage3_prefetch_bucket_size"] = buckets["stage3_prefetch_bucket_size"]
    if zero.stage == 3:
        # DeepSpeed keeps parameters under 1e5 elements gathered on every rank by default (not worth
        # a collective each), transformers' "auto" those under 10 x hidden. Here every parameter is partitioned, as
        # the ZeRO paper and FSDP do, so stage 3 shards what it says; raise it through strategy.extra for speed on
        # large models.
        zero_opt["stage3_param_persistence_threshold"] = 0
    if zero.offload_optimizer:
        zero_opt["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    if zero.offload_params:
        zero_opt["offload_param"] = {"device": "cpu", "pin_memory": True}
    config: dict[str, Any] = {
        "train_batch_size": train.global_batch_size,
        "train_micro_batch_size_per_gpu": train.micro_batch_size,
        "gradient_accumulation_steps": accumulation,
        # DeepSpeed clips at 1.0 unless told otherwise; 0 disables, as train.grad_clip does.
        "gradient_clipping": float(train.grad_clip),
        "fp16": {"enabled": precision.loss_scaling},
        "bf16": {"enabled": precision.mixed and not precision.loss_scaling},
        "zero_optimization": zero_opt,
        # The optimizer is our torch optimizer (same math as every strategy), not a DeepSpeed op:
        # ZeRO accepts it only with this flag, and offload only with the second one (DeepSpeedCPUAdam
        # would be faster on the CPU side, but it is another optimizer and another compiled op).
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,
        # Our telemetry reports progress, memory and collectives; DeepSpeed's own printing stays off.
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }
    return deep_merge(config, zero.extra)


# --------------------------------------------------------------------------------------------------
# Start-up: the comm op's build cache, DeepSpeed's comm backend over our process group.
# --------------------------------------------------------------------------------------------------


# --------------------------------------------------------------------------------------------------
# The strategy.
# --------------------------------------------------------------------------------------------------


class ZeroModelState(ModelState):
    """ModelState whose gradient bytes were counted during the step, after each backward.

    DeepSpeed frees its gradient buffers (stage 1/2) inside the optimizer step, so at logging time there
    is nothing left to count; holding references until then would keep them alive and change the memory
    being measured. The bytes are counted with the same function, the largest after any backward.
    """

    def __init__(self, *, params: list[torch.Tensor], optimizer: list[torch.Tensor], grads_bytes: int,
                 expert_bytes: dict[str, int] | None = None) -> None:
        super().__init__(params=params, grads=[], optimizer=optimizer)
        self.grads_bytes = grads_bytes
        self.expert_bytes = expert_bytes or {}  # memory/expert_grads_bytes, memory/expert_optimizer_bytes

    def bytes(self) -> dict[str, int]:
        out = super().bytes()
        out["memory/grads_bytes"] = self.grads_bytes
        out.update(self.expert_bytes)
        return out

    def by_dtype(self) -> dict[str, int]:
        out = super().by_dtype()
        if self.grads_bytes and self.params:  # DeepSpeed's gradients are in the trained parameters' dtype
            out[f"memory/by_dtype/grads/{dtype_name(self.params[0].dtype)}_bytes"] = self.grads_bytes
        return out


class TransientPeaks:
    """Peaks of what ZeRO holds only for a moment, per logging window (`extra_metrics` drains them).

    - gathered parameters (stage 3): DeepSpeed's own count of parameter elements gathered or in flight
      (its parameter coordinator's `__n_available_params`), read at every module's forward and backward;
    - the fp32 gradient partition the optimizer step consumes: its gradients' bytes when the step begins,
      leaving out storage already counted as gradients (stage 3 in fp32 steps on a view of its buffer).
    """

    def __init__(self) -> None:
        self.gathered_bytes = 0
        self.step_grads_bytes = 0

    def drain(self) -> dict[str, float]:
        out: dict[str, float] = {}
        if self.gathered_bytes:
            out["memory/gathered_params_bytes"] = self.gathered_bytes
        if self.step_grads_bytes:
            out["memory/step_grads_bytes"] = self.step_grads_bytes
        self.gathered_bytes = self.step_grads_bytes = 0
        return out


class ZeroStrategy:
    def __init__(self, cfg: Any, ctx: StrategyContext) -> None:
        self.name, self.cfg, self.ctx = cfg.name, cfg, ctx
        self.engine: Any = None
        self._grads_bytes = 0  # peak gradient bytes of the last step, counted at the boundary
        self._grads_seen = 0  # the same, during the step
        self._expert_grads_bytes = self._expert_grads_seen = 0  # the experts' part of both
        # An MoE model's experts' parameters and their elements in this rank's partition of each group, found once
        # (_expert_partitions): DeepSpeed's layout is fixed after its set-up
        self._expert_params: list[nn.Parameter] = []
        self._expert_ids: set[int] = set()
        self._expert_parts: list[int] | None = None
        self.peaks = TransientPeaks()
        self._config: dict[str, Any] | None = None

    def _start(self) -> dict[str, Any]:
        """DeepSpeed's comm over the runtime's process group, once; the DeepSpeed config of this run."""
        rt = self.ctx.runtime
        if self._config is None:
            use_extensions_cache()  # for the ops DeepSpeed may still compile (an optimizer from `strategy.extra`)
            skip_inference_comm_op()
            # DeepSpeed insists on LOCAL_RANK, which a plain `python launch/train.py` run does not set.
            os.environ.setdefault("LOCAL_RANK", str(rt.local_rank))
            init_deepspeed_comm(rt.backend)
            self._config = deepspeed_config(
                zero=self.cfg, train=self.ctx.train, precision=self.ctx.precision,
                dims=self.cfg.parallel_dims(rt.world_size),
                hidden_size=self.ctx.model.hidden_size if self.ctx.model is not None else None,
            )
        return self._config

    def empty_model_context(self) -> Any:
        """DeepSpeed's zero.Init (stage 3): each module's parameters are partitioned as soon as it is built, so no
        rank ever holds more than one module whole; `setup` then fills each rank's partitions from the files."""
        import deepspeed

        unmap_large_frees()
        return deepspeed.zero.Init(config_dict_or_path=self._start())

    def setup(self, model: nn.Module) -> None:
        config = self._start()
        if self.ctx.materialize is not None:  # built under zero.Init: this rank's partitions, filled
            self.ctx.materialize(model)
        optimizer = self.ctx.optimizer.build(model.parameters(), on_device=not self.cfg.offload_optimizer)
        self.engine = self._initialize(model, optimizer, self.ctx.optimizer.scheduler(optimizer), config)
        self._watch_transients()

    def _initialize(self, model: nn.Module, optimizer: Any, scheduler: Any, config: dict[str, Any]) -> Any:
        """DeepSpeed's engine over our model, optimizer and schedule."""
        import deepspeed

        # DeepSpeed would take cuda:LOCAL_RANK; `device_rank` gives it the runtime's GPU (cuda:0 under
        # `srun --gpus-per-task=1`). On the CPU it keeps what it would take (LOCAL_RANK; one CPU device).
        device = self.ctx.runtime.device
        args = SimpleNamespace(device_rank=device.index if device.type == "cuda" else self.ctx.runtime.local_rank)
        stage = config.get("zero_optimization", {}).get("stage")
        with zero3_setup_fixes() if stage == 3 else contextlib.nullcontext([]) as fixes:
            engine, _, _, _ = deepspeed.initialize(
                args=args, model=model, optimizer=optimizer, lr_scheduler=scheduler, config=config,
                dist_init_required=False,
            )
        log.debug("DeepSpeed set-up fixes applied: %s", ", ".join(fixes) or "none")
        return engine

    def _backward_and_step(self, loss: torch.Tensor) -> None:
        self.engine.backward(loss)  # scales by 1/accumulation: the gradient of the mean micro-batch loss
        self._count_grads()
        self.engine.step()  # an optimizer step only at the accumulation boundary

    def _count_grads(self) -> None:
        """After a backward, before its step: the gradient bytes this rank holds (peak over the micro-batches), and
        the experts' part of them."""
        self._grads_seen = max(self._grads_seen, tensor_bytes(self._gradient_tensors()))
        if self._expert_partitions():
            self._expert_grads_seen = max(self._expert_grads_seen, self._expert_gradient_bytes())

    def _expert_partitions(self) -> list[int]:
        """The experts' elements in this rank's partition of each of ZeRO's parameter groups; [] for a dense model.
        Stage 3 partitions each parameter on its own (`ds_tensor`), and a sub-group's flat buffers concatenate its
        parameters' partitions. Stages 1 and 2 cut one flat buffer of the group's parameters (DeepSpeed's offsets into
        it) into equal partitions, which cut across parameters: what of each expert tensor falls in this rank's.
        Computed once: the layout is fixed after DeepSpeed's set-up."""
        if self._expert_parts is None:
            from dist_train.architectures import expert_modules

            self._expert_params = [p for m in expert_modules(self.engine.module) for p in m.parameters()]
            self._expert_ids = {id(p) for p in self._expert_params}
            self._expert_parts = self._partition_elements() if self._expert_params else []
        return self._expert_parts

    def _partition_elements(self) -> list[int]:
        """_expert_partitions' figures, from DeepSpeed's layout."""
        opt = self.engine.optimizer
        if self.cfg.stage == 3:
            return [sum(p.ds_tensor.numel() for p in group if id(p) in self._expert_ids) for group in opt.fp16_groups]
        import torch.distributed as dist

        out = []
        for i, group in enumerate(opt.round_robin_bit16_groups):
            size = int(opt.partition_size[i])
            start = dist.get_rank(group=opt.real_dp_process_group[i]) * size
            out.append(sum(max(0, min(offset + p.numel(), start + size) - max(offset, start))
                           for p, offset in zip(group, opt.round_robin_bit16_offsets[i]) if id(p) in self._expert_ids))
        return out

    def _expert_gradient_bytes(self) -> int:
        """The experts' part of `_gradient_tensors`: their elements of each flat gradient partition held (stage 3's
        buffer; stage 1's and 2's reduced partitions), of the offloaded fp32 ones, and any whole expert gradient held
        (stage 1 accumulates whole gradients until the last micro-batch; stage 2, between micro-batches, the whole
        gradient of every parameter its partition touches)."""
        opt, parts = self.engine.optimizer, self._expert_partitions()
        total = 0
        if self.cfg.stage == 3:
            flat = getattr(opt, "grad_partitions_flat_buffer", None)
            total += sum(parts) * flat.element_size() if flat is not None else 0
        else:
            for i, n in enumerate(parts):
                whole = opt.all_grad_tensors.get(i)  # between micro-batches: the whole gradient of each parameter
                if isinstance(whole, (list, tuple)):  # the partition touches, in params_in_partition's order
                    total += tensor_bytes(t for t, p in zip(whole, opt.params_in_partition[i])
                                          if id(p) in self._expert_ids and isinstance(t, torch.Tensor))
                    continue
                value = opt.averaged_gradients.get(i)  # the reduced partition: the experts' elements of it
                held = [t for t in (value if isinstance(value, (list, tuple)) else [value])
                        if isinstance(t, torch.Tensor)]
                total += n * held[0].element_size() if held else 0
        for n, master in zip(parts, self._master_partitions()):
            grad = getattr(master, "grad", None)
            total += n * grad.element_size() if grad is not None else 0
        return total + tensor_bytes(p.grad for p in self._expert_params if p.grad is not None)

    def _expert_optimizer_bytes(self, *, counted_master: set[int]) -> int:
        """The experts' part of the optimizer category: in each group (stage 3: sub-group), their elements of every
        tensor of the partition's flat size (its fp32 master partition where counted there, the optimizer's moments;
        step counters left out, as for a torch optimizer's experts)."""
        opt = self.engine.optimizer
        total = 0
        for n, master in zip(self._expert_partitions(), self._master_partitions()):
            state = [t for t in opt.optimizer.state.get(master, {}).values()
                     if isinstance(t, torch.Tensor) and t.numel() == master.numel()]
            if id(master) in counted_master:
                state.append(master)
            total += n * sum(t.element_size() for t in state)
        return total

    def _watch_transients(self) -> None:
        opt = self.engine.optimizer

        def before_step(optimizer: Any, args: Any, kwargs: Any) -> None:
            counted = {t.untyped_storage().data_ptr() for t in self._gradient_tensors(with_fp32=False) if t is not None}
            grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
            fresh = tensor_bytes(g for g in grads if g.untyped_storage().data_ptr() not in counted)
            self.peaks.step_grads_bytes = max(self.peaks.step_grads_bytes, fresh)

        opt.optimizer.register_step_pre_hook(before_step)
        if self.cfg.stage != 3:
            return
        coordinator = opt.parameter_offload.get_param_coordinator()
        params = list(self.engine.module.parameters())
        elem = params[0].element_size() if params else 4

        def sample(*_: Any) -> None:
            gathered = getattr(coordinator, "_PartitionedParameterCoordinator__n_available_params", 0)
            self.peaks.gathered_bytes = max(self.peaks.gathered_bytes, int(gathered) * elem)

        for module in self.engine.module.modules():  # after DeepSpeed's own hooks (it fetches in them) ...
            module.register_forward_pre_hook(sample)
            module.register_forward_hook(sample, prepend=True)  # ... and before its release after forward
            module.register_full_backward_pre_hook(sample)

    def train_step(self, batch: Batch) -> StepOutput:
        engine = self.engine
        assert engine is not None, "setup() first"
        micro = batch.to(self.ctx.runtime.device).split(self.ctx.train.micro_batch_size)
        # DeepSpeed's step applies the update after exactly gradient_accumulation_steps backwards.
        assert len(micro) == engine.gradient_accumulation_steps(), (len(micro), engine.gradient_accumulation_steps())
        loss_sum = torch.zeros((), device=self.ctx.runtime.device)
        self._grads_seen = self._expert_grads_seen = 0
        for mb in micro:
            loss = forward_loss(engine, mb.input_ids, mb.labels)
            self._backward_and_step(loss)
            loss_sum += loss.detach().float()
        self._grads_bytes, self._expert_grads_bytes = self._grads_seen, self._expert_grads_seen
        norm = engine.get_global_grad_norm()  # before clipping; a float or a tensor depending on the stage
        grad_norm = None if norm is None else torch.as_tensor(norm, dtype=torch.float32).detach()
        return StepOutput(loss_sum=loss_sum, num_microbatches=len(micro), grad_norm=grad_norm)

    def eval_step(self, batch: Batch) -> StepOutput:
        assert self.engine is not None, "setup() first"
        device = self.ctx.runtime.device
        # DeepSpeed's engine computes in the dtype it cast the model to (bf16 mode), as in training: no autocast.
        out = evaluate(self.engine, batch.to(device), micro_batch_size=self.ctx.train.micro_batch_size,
                       precision=None, device=device)
        if self.cfg.stage == 3:  # a forward no backward follows leaves the last modules' parameters gathered
            self.engine.empty_partition_cache()
        return out

    # ---------------------------------------------------------------- what this rank holds
    def _params(self) -> list[nn.Parameter]:
        return list(self.engine.module.parameters())

    def _master_partitions(self) -> list[torch.Tensor]:
        """DeepSpeed's fp32 master copy of this rank's partition (the tensors the optimizer updates)."""
        opt = self.engine.optimizer
        name = "fp32_partitioned_groups_flat" if self.cfg.stage == 3 else "single_partition_of_fp32_groups"
        return list(getattr(opt, name))

    def _gradient_tensors(self, *, with_fp32: bool = True) -> list[torch.Tensor | None]:
        """Gradient storage this rank holds right after a backward (counted then: see ZeroModelState).

        with_fp32=False leaves out the fp32 partitions' own gradients (offload keeps them; otherwise they exist
        only inside the optimizer step, where TransientPeaks counts them).

        Stage 1 accumulates full gradients in `.grad` until the boundary, then keeps only its reduced
        partition (`averaged_gradients`); stage 2 reduces every micro-batch into its partition
        (`all_grad_tensors` while accumulating, `averaged_gradients` at the boundary); stage 3 keeps one
        persistent flat partition buffer. DeepSpeed's reduction bucket (`reduce_bucket_size` elements,
        hidden^2 here: parallel/buckets.py) is a communication staging buffer and is not counted, as FSDP's are not.
        """
        opt = self.engine.optimizer
        # With optimizer offload the fp32 gradient partition lives on the CPU beside the master copy.
        offloaded = [getattr(t, "grad", None) for t in self._master_partitions()] if with_fp32 else []
        if self.cfg.stage == 3:
            # averaged_gradients are views into this buffer; pass the buffer alone so nothing counts twice
            return [getattr(opt, "grad_partitions_flat_buffer", None), *offloaded, *(p.grad for p in self._params())]
        out: list[torch.Tensor | None] = [p.grad for p in self._params()] + offloaded
        for holder in (getattr(opt, "averaged_gradients", None), getattr(opt, "all_grad_tensors", None)):
            for value in (holder or {}).values():
                out.extend(value if isinstance(value, (list, tuple)) else [value])
        return [t for t in out if isinstance(t, torch.Tensor)]

    def model_state(self) -> ModelState:
        assert self.engine is not None, "setup() first"
        opt = self.engine.optimizer
        if self.cfg.stage == 3:
            # Each parameter's local partition (`ds_tensor`), plus the full tensor of any parameter that
            # is gathered right now (persistent small ones if the threshold was raised through `extra`).
            params = [p.ds_tensor for p in self._params()] + [p.data for p in self._params() if p.data.numel() > 0]
        else:
            params = list(opt.bit16_groups_flat)  # the flat buffer the trained parameters are views of
            # frozen parameters (LoRA's base model) are in no optimizer group: each rank holds them whole
            params += [p.data for p in self._params() if not p.requires_grad]
        # DeepSpeed's fp32 master copy of this rank's partition is optimizer state: it exists only for the
        # optimizer. Under stage 3 in fp32 it is the parameters' own partition (_zero3_setup): counted once, there.
        flats = {id(t) for t in getattr(opt, "fp16_partitioned_groups_flat", [])}  # the same tensor when shared
        master = [t for t in self._master_partitions() if id(t) not in flats]
        experts = None
        if self._expert_partitions():
            experts = {"memory/expert_grads_bytes": self._expert_grads_bytes,
                       "memory/expert_optimizer_bytes": self._expert_optimizer_bytes(counted_master={
                           id(t) for t in master})}
        return ZeroModelState(
            params=params,
            optimizer=optimizer_state_tensors(opt.optimizer) + master,
            grads_bytes=self._grads_bytes,
            expert_bytes=experts,
        )

    def state_dict(self) -> dict[str, Any]:
        """{"model": the full state dict (stage 3 gathers it), "optimizer": this rank's ZeRO partition}.

        The optimizer entry is DeepSpeed's own per-rank layout (fp32 master partition and its Adam
        state): it reloads on the same world size and stage only.
        """
        assert self.engine is not None, "setup() first"
        model = self.engine.module
        if self.cfg.stage == 3:
            import deepspeed

            with deepspeed.zero.GatheredParameters(list(model.parameters()), modifier_rank=None):
                model_sd = detached_clone(model.state_dict())
        else:
            model_sd = detached_clone(model.state_dict())
        # DeepSpeed's state dict holds the live fp32 partitions and moments: copy, or training mutates it.
        return {"model": model_sd, "optimizer": detached_clone(self.engine.optimizer.state_dict())}

    def checkpoint_io(self) -> DeepSpeedIO:
        assert self.engine is not None, "setup() first"
        return DeepSpeedIO(self.engine)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # The optimizer's state carries the fp32 master partition, from which every rank's parameters
        # are rewritten (and all-gathered); the model entry is for consumers outside DeepSpeed.
        # DeepSpeed indexes the list by data-parallel rank; each rank holds (and reads) only its own entry.
        assert self.engine is not None, "setup() first"
        dp_size = self.cfg.data_parallel_size(self.ctx.runtime.world_size)
        self.engine.optimizer.load_state_dict([state["optimizer"]] * dp_size, load_from_fp32_weights=True)
        if self.cfg.stage < 3:
            # Stage 1/2 restore only the fp32 partitions; copy them into the parameters and all-gather
            # (stage 3 does this itself), or the next forward would run on the old weights.
            self.engine.optimizer.update_lp_params()

    @property
    def lr(self) -> float:
        return float(self.engine.get_lr()[0])

    @property
    def devices(self) -> list[torch.device]:
        return [self.ctx.runtime.device]

    def extra_metrics(self) -> dict[str, float]:
        return self.peaks.drain()
