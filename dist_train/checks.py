"""The whole pre-flight check of a run, before any process group starts: one ConfigError line, or nothing.

config.validate_fields judges the values on their own; here they meet what lies outside the config: the
checkpoint that checkpoint.resume names, the number of processes, the strategy's own checks (asked of
the registry), and whether the optimizer can work under that strategy.
"""

from __future__ import annotations

from dist_train.checkpoint.layout import resolve_resume
from dist_train.config import (WHOLE_TENSOR_OPTIMIZERS, ConfigError, RunConfig, importable, require,
                               resolve_global_batch, validate_fields)
from dist_train.data_checks import validate_data
from dist_train.strategies.registry import check_strategy, names_with


def validate(run: RunConfig, world_size: int) -> None:
    """Raise ConfigError (one line) for the first value that cannot run with `world_size` processes.

    A null train.global_batch_size is filled in here (config.resolve_global_batch), before the checks that
    divide it, and `model.path=DIR` fills the model group from the directory's config.json (pretrained.resolve_model)."""
    from dist_train.paths import normalize_paths
    from dist_train.pretrained import resolve_model

    normalize_paths(run)  # `~`, `$HOME` and relative paths, recorded as absolute ones
    resolve_model(run.model)
    validate_fields(run)
    validate_data(run)
    _check_resume(run.checkpoint.resume)
    require(world_size >= 1, f"WORLD_SIZE={world_size} must be >= 1")
    resolve_global_batch(run, world_size)
    check_strategy(run, world_size)
    check_optimizer(run, world_size)
    require(
        run.peft.name == "none" or run.strategy.supports_lora,
        f"peft={run.peft.name} puts adapters on whole projections; strategy={run.strategy.name} splits them by tensor "
        "parallelism: use ddp, fsdp, zero1-3, a pipeline or single",
    )
    # QLoRA's packed 4-bit weights stay whole under data parallelism; a strategy that shards or splits
    # parameters (FSDP, ZeRO, pipelines, tensor parallelism) would cut the packed bytes and their scales apart.
    require(
        run.peft.name != "qlora" or run.strategy.keeps_packed_weights,
        f"peft=qlora: strategy={run.strategy.name} would shard or split the packed 4-bit weights; use "
        f"{' or '.join(names_with('keeps_packed_weights'))} (or peft=lora with any strategy but tp)",
    )
    require(
        not run.train.compile or run.strategy.compiles_blocks,
        f"train.compile=true runs with strategy={' | '.join(names_with('compiles_blocks'))} (tested: the same "
        f"losses as without it); strategy={run.strategy.name} is not wired for compiled blocks yet",
    )


# optimizer.name -> the package it comes from, where that is not torch
_PACKAGES = {"lion": ("lion_pytorch", "lion-pytorch"), "adam8bit": ("bitsandbytes", "bitsandbytes")}


def check_optimizer(run: RunConfig, world_size: int) -> None:
    """The optimizer against the strategy: what it needs installed, whole tensors, or (LOMO) one process."""
    name, strategy, t = run.optimizer.name, run.strategy, run.train
    if name in _PACKAGES:
        module, package = _PACKAGES[name]
        require(importable(module), f"optimizer={name} needs the {package} package (pip install {package})")
    if name in WHOLE_TENSOR_OPTIMIZERS:
        why = "factors each matrix's second moment by rows and columns" if name == "adafactor" else \
            "quantizes its state in blocks of 256 elements"
        require(
            strategy.optimizer_sees_whole_tensors,
            f"optimizer={name} {why}; strategy={strategy.name} hands the optimizer shards, so it would not train as "
            "one process does; use it with single, dp, ddp, gpipe, 1f1b or accelerate (ddp), or pick "
            "optimizer=adamw|lion|sgd",
        )
    if name == "lomo":
        require(
            strategy.updates_in_backward,
            f"optimizer=lomo updates each parameter inside backward, before a gradient could be reduced across "
            f"ranks or devices; it runs with strategy=single only (got strategy={strategy.name})",
        )
        accumulation = strategy.microbatches_per_step(t, world_size)
        require(
            accumulation == 1,
            f"optimizer=lomo applies each backward's update at once, so it cannot accumulate {accumulation} "
            f"micro-batches: set train.global_batch_size equal to train.micro_batch_size (now {t.global_batch_size} "
            f"and {t.micro_batch_size})",
        )
        require(
            t.grad_clip == 0,
            f"optimizer=lomo updates each parameter before the global gradient norm is known, so it cannot clip: "
            f"set train.grad_clip=0 (now {t.grad_clip})",
        )
        require(
            not run.precision.loss_scaling,
            "optimizer=lomo with precision=fp16: the loss scaler must see every gradient before any update; "
            "use precision=bf16 or fp32",
        )


def _check_resume(resume: str) -> None:
    if resume in ("auto", "none"):
        return
    try:
        resolve_resume(resume, default_root=None)
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
