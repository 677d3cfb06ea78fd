"""Hugging Face Accelerate: the model prepared by `accelerate.Accelerator`, as a user's own Accelerate setup would.

Accelerate decides the wrapping (DDP, FSDP2 with its auto-wrap policy, or DeepSpeed's engine), places the
model on its device, applies its mixed-precision autocast and silences gradient sync during accumulation
(`accelerator.no_sync`, `accelerator.accumulate`). Which of these it does comes from, in order:
`strategy.plugin` (ddp | fsdp | deepspeed), the accelerate config file in `strategy.config_file` (read with
accelerate's own launcher code, exactly as `accelerate launch --config_file` would), the environment
`accelerate launch` set, else plain DDP.

DDP and FSDP: the optimizer, its clipping and the LR schedule are the ones every strategy uses (built before
`prepare`, which re-points them at the prepared parameters), so the training is the same as
`strategy=single`'s and the rows of a comparison differ only by what Accelerate does.

DeepSpeed: Accelerate builds the engine (`DeepSpeedPlugin` over the same DeepSpeed config strategy=zero<N>
derives from the run, ZeRO stage from `strategy.zero_stage` or the config file's `deepspeed_config`), and
each micro-batch goes through `accelerator.accumulate` and `accelerator.backward`, which step the engine at
the accumulation boundary. Telemetry, checkpoints and the estimator treat it as zero<N>.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ContextManager, Optional

import torch
from torch import nn

from dist_train.config import RunConfig, StrategyConfig, choice, importable, require
from dist_train.parallel_dims import ParallelDims, layout_dims
from dist_train.contracts import StrategyFamily
from dist_train.model import transformer_blocks
from dist_train.strategies.base import LocalOptimizer, StrategyContext
from dist_train.strategies.torch_strategy import TorchStrategy
from dist_train.strategies._deepspeed import DeepSpeedSettings, ZeroStrategy, check_run_settings, check_settings

log = logging.getLogger("dist_train")

PLUGINS = ("ddp", "fsdp", "deepspeed")
# accelerate's mixed_precision names for this project's precisions
MIXED_PRECISION = {"fp32": "no", "bf16": "bf16", "fp16": "fp16"}


def same_device(a: torch.device, b: torch.device) -> bool:
    """One device, whatever its spelling (Accelerate says cpu:0 where the runtime says cpu)."""
    return a.type == b.type and (a.type != "cuda" or a.index == b.index)


@dataclass
class AccelerateConfig(StrategyConfig):
    """The model prepared by accelerate.Accelerator (DDP or FSDP2), the loop and optimizer shared."""

    name: str = "accelerate"
    # ddp | fsdp | deepspeed; None: from config_file, else from `accelerate launch`'s environment, else ddp.
    plugin: Optional[str] = None
    # An accelerate config YAML (what `accelerate config` writes); applied as `accelerate launch` would.
    config_file: Optional[str] = None
    # DeepSpeed's ZeRO stage when the plugin is deepspeed and neither the config file nor accelerate launch says
    zero_stage: int = 2

    @property
    def checkpoint_format(self) -> str:
        return "deepspeed" if self.requested_plugin() == "deepspeed" else "dcp"

    @property
    def optimizer_sees_whole_tensors(self) -> bool:
        return self.requested_plugin() == "ddp"

    def parallel_dims(self, world_size: int) -> ParallelDims:
        """DDP's replicas, or FSDP's and DeepSpeed's shards over every rank."""
        return layout_dims("replicate" if self.requested_plugin() == "ddp" else "shard", world_size)

    def check(self, world_size: int) -> None:
        require(importable("accelerate"), "strategy=accelerate needs the accelerate package (pip install accelerate)")
        if self.plugin is not None:
            choice("strategy.plugin", self.plugin, PLUGINS)
        if self.config_file is not None:
            require(Path(self.config_file).is_file(), f"strategy.config_file={self.config_file}: no such file")
        if self.requested_plugin() == "deepspeed":
            require(importable("deepspeed"), "strategy=accelerate with DeepSpeed needs the deepspeed package")
            stage = self.deepspeed_stage()
            require(stage in (1, 2, 3), f"strategy=accelerate with DeepSpeed: ZeRO stage {stage} is not 1, 2 or 3")
            check_settings(self.as_zero(), world_size)
        import torch

        from dist_train.runtime import gpu_per_task

        require(
            not (torch.cuda.is_available() and gpu_per_task()),
            "strategy=accelerate under srun --gpus-per-task=1: Accelerate takes cuda:LOCAL_RANK, which a task that "
            "sees one GPU does not have; launch torchrun once per node instead (launch/slurm.sbatch does)",
        )
        require(
            self.requested_plugin() != "fsdp" or torch.cuda.is_available(),
            "strategy=accelerate with FSDP (from strategy.plugin, strategy.config_file or accelerate launch): "
            "Accelerate runs FSDP on GPUs only (on CPU it would silently use DDP); on CPU use strategy=fsdp",
        )

    def requested_plugin(self) -> str:
        """ddp, fsdp or deepspeed: strategy.plugin, else the config file's distributed_type, else accelerate
        launch's environment, else ddp."""
        if self.plugin is not None:
            return self.plugin
        if self.config_file is not None:
            kind = str(_file_settings(self.config_file).get("distributed_type", "")).upper()
            return {"FSDP": "fsdp", "DEEPSPEED": "deepspeed"}.get(kind, "ddp")
        if os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true":
            return "deepspeed"
        return "fsdp" if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true" else "ddp"

    def deepspeed_stage(self) -> int:
        """The ZeRO stage: the config file's deepspeed_config.zero_stage, else accelerate launch's, else
        strategy.zero_stage."""
        if self.config_file is not None:
            stage = (_file_settings(self.config_file).get("deepspeed_config") or {}).get("zero_stage")
            if stage is not None:
                return int(stage)
        return int(os.environ.get("ACCELERATE_DEEPSPEED_ZERO_STAGE", self.zero_stage))

    def as_zero(self) -> DeepSpeedSettings:
        """The DeepSpeed settings as strategy=zero<N> has them (the same derived DeepSpeed config)."""
        return DeepSpeedSettings(name=self.name, stage=self.deepspeed_stage())

    def check_run(self, run: RunConfig, world_size: int) -> None:
        super().check_run(run, world_size)
        if self.requested_plugin() == "deepspeed":
            check_run_settings(self.as_zero(), run)
        if self.config_file is None:
            return
        wanted = str(_file_settings(self.config_file).get("mixed_precision", "no"))
        require(
            wanted in ("no", MIXED_PRECISION[run.precision.name]),
            f"strategy.config_file={self.config_file} says mixed_precision={wanted} but precision="
            f"{run.precision.name}; set precision= to match (the run's precision decides, for every strategy)",
        )


def _file_settings(path: str) -> dict[str, Any]:
    import yaml

    data = yaml.safe_load(Path(path).read_text()) or {}
    require(isinstance(data, dict), f"strategy.config_file={path}: not an accelerate config (a YAML mapping)")
    return data


def launcher_environment(config_file: str) -> dict[str, str]:
    """What `accelerate launch --config_file F` puts in the environment for the plugins (ACCELERATE_USE_FSDP,
    FSDP_*, ...), computed by accelerate's own launcher code."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_multi_gpu_env

    args = launch_command_parser().parse_args(["--config_file", config_file, "train.py"])
    validated = _validate_launch_command(args)
    args = validated[0] if isinstance(validated, tuple) else args
    env = prepare_multi_gpu_env(args)
    return {k: v for k, v in env.items() if k.startswith(("ACCELERATE_USE_", "FSDP_"))}


class AccelerateWrapper:
    def __init__(self, cfg: AccelerateConfig, ctx: StrategyContext) -> None:
        self.cfg, self.ctx = cfg, ctx
        self.accelerator: Any = None

    def _accelerator(self, model: nn.Module) -> Any:
        from accelerate import Accelerator
        from accelerate.utils import FullyShardedDataParallelPlugin

        if self.cfg.config_file is not None:
            os.environ.update(launcher_environment(self.cfg.config_file))
        if self.cfg.plugin == "ddp":
            os.environ["ACCELERATE_USE_FSDP"] = "false"
        fsdp = None
        if self.cfg.plugin == "fsdp":  # else the config file's or accelerate launch's FSDP settings, if any
            block = type(transformer_blocks(model)[0]).__name__  # GPT2Block, LlamaDecoderLayer
            fsdp = FullyShardedDataParallelPlugin(
                fsdp_version=2, reshard_after_forward=True, auto_wrap_policy="transformer_based_wrap",
                transformer_cls_names_to_wrap=[block], state_dict_type="SHARDED_STATE_DICT",
            )
        return Accelerator(
            cpu=self.ctx.runtime.device.type == "cpu",
            mixed_precision=MIXED_PRECISION[self.ctx.precision.name],
            fsdp_plugin=fsdp,
        )

    def prepare(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> nn.Module:
        self.accelerator = self._accelerator(model)
        if not same_device(self.accelerator.device, self.ctx.runtime.device):  # both take cuda:LOCAL_RANK: checked
            raise RuntimeError(f"Accelerate chose {self.accelerator.device}, dist_train's runtime "
                               f"{self.ctx.runtime.device}: one rank would train on two devices")
        wrapped, _ = self.accelerator.prepare(model, optimizer)
        if isinstance(wrapped, torch.nn.parallel.DistributedDataParallel) and self.ctx.ddp_comm_hook is not None:
            wrapped.register_comm_hook(state=None, hook=self.ctx.ddp_comm_hook)  # telemetry sees the buckets
        return wrapped

    def wrap(self, model: nn.Module) -> nn.Module:
        raise NotImplementedError("Accelerate prepares the model with its optimizer: AccelerateStrategy.setup")

    def no_sync(self, wrapped: nn.Module) -> ContextManager[Any]:
        return self.accelerator.no_sync(wrapped)

    def devices(self) -> list[torch.device]:
        return [self.accelerator.device if self.accelerator is not None else self.ctx.runtime.device]

    @property
    def kind(self) -> str:
        """What Accelerate made of the model: ddp, fsdp (FSDP2) or none (one process)."""
        if self.accelerator is None:
            return "none"
        if self.accelerator.is_fsdp2:
            return "fsdp"
        return "ddp" if self.accelerator.num_processes > 1 else "none"


class AccelerateStrategy(TorchStrategy):
    wrapper: AccelerateWrapper

    def setup(self, model: nn.Module) -> None:
        self.model = model
        # The shared optimizer and schedule, built over the model as is; prepare() re-points the optimizer at
        # the prepared (e.g. FSDP2-sharded) parameters, which are then what the norm and clipping see.
        self.opt = LocalOptimizer(self.ctx, list(model.parameters()))
        self.wrapped = self.wrapper.prepare(model, self.opt.optimizer)
        self.opt.params = list(self.wrapped.parameters())
        if self.wrapper.kind != "none" and self.wrapper.kind != self.wrapper.cfg.requested_plugin():
            raise RuntimeError(f"asked Accelerate for {self.wrapper.cfg.requested_plugin()}, it prepared {self.wrapper.kind}")
        log.info("accelerate prepared the model as %s on %s", self.wrapper.kind, self.wrapper.devices()[0])


class AccelerateZeroStrategy(ZeroStrategy):
    """DeepSpeed's engine as Accelerate builds and steps it; what ZeRO holds is measured as for zero<N>."""

    def __init__(self, cfg: AccelerateConfig, ctx: StrategyContext) -> None:
        super().__init__(cfg.as_zero(), ctx)
        self.accelerator: Any = None

    def _initialize(self, model: nn.Module, optimizer: Any, scheduler: Any, config: dict[str, Any]) -> Any:
        from accelerate import Accelerator
        from accelerate.utils import DeepSpeedPlugin

        self.accelerator = Accelerator(
            deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=config),
            mixed_precision=MIXED_PRECISION[self.ctx.precision.name],
            gradient_accumulation_steps=config["gradient_accumulation_steps"],
        )
        engine, _, _ = self.accelerator.prepare(model, optimizer, scheduler)
        backward = engine.backward

        def counted_backward(*args: Any, **kwargs: Any) -> Any:  # accelerator.backward calls it, then step
            out = backward(*args, **kwargs)
            self._count_grads()
            return out

        engine.backward = counted_backward
        log.info("accelerate prepared the model as deepspeed (ZeRO stage %d) on %s", self.cfg.stage,
                 self.accelerator.device)
        return engine

    def _backward_and_step(self, loss: torch.Tensor) -> None:
        # Accelerate's accumulation: it counts micro-batches and steps the engine at the boundary.
        with self.accelerator.accumulate(self.engine):
            self.accelerator.backward(loss)


def build(cfg: AccelerateConfig, ctx: StrategyContext) -> Any:
    if cfg.requested_plugin() == "deepspeed":
        return AccelerateZeroStrategy(cfg, ctx)
    return AccelerateStrategy(cfg.name, ctx, AccelerateWrapper(cfg, ctx))


FAMILY = StrategyFamily(family="accelerate", schema=AccelerateConfig, names={"accelerate": {}}, build=build)
