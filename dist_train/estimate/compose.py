"""Compose the training config with Hydra's compose API from the same conf/ directory training uses."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

CONF_DIR = Path(__file__).resolve().parents[2] / "conf"


def compose_training_config(overrides: list[str], *, validated: bool = True) -> dict[str, Any]:
    """The resolved run config (no `hydra` node) that `launch/train.py <overrides>` would see.

    `validated`: run the checks that do not depend on the number of processes (ConfigError otherwise),
    so a prediction or a comparison never starts from a config training would refuse.
    """
    from dataclasses import asdict

    from dist_train.config import validate_fields
    from dist_train.data_checks import validate_data

    cfg, run = _compose(overrides)
    if validated:
        validate_fields(run)
        validate_data(run)
    out = OmegaConf.to_container(cfg, resolve=True)
    out["model"] = asdict(run.model)
    return out  # type: ignore[return-value]


def compose_run(overrides: list[str]) -> Any:
    """The RunConfig that `launch/train.py <overrides>` would build (not validated: checks.validate does that
    for a number of processes)."""
    return _compose(overrides)[1]


def check_as_training(overrides: list[str], *, world_size: int, here: bool = False) -> Any:
    """The RunConfig `launch/train.py <overrides>` would train on `world_size` processes, checked by the checks
    training runs (checks.validate: the fields, the strategy registry's check_strategy, the optimizer, peft), or
    the ConfigError whose line `launch/train.py --check-config` prints.

    A prediction (the estimator, the advisor) is for a machine with GPUs, not necessarily this one: the checks that
    ask this machine whether it has a GPU (DeepSpeed's offloading and fp16, Accelerate's FSDP) are answered as on a
    GPU machine. `here`: a run on this machine (the dry run, plan.verify) asks this machine."""
    from dist_train.checks import validate

    run = compose_run(overrides)
    with contextlib.nullcontext() if here else _as_on_a_gpu_machine():
        validate(run, world_size)
    return run


@contextlib.contextmanager
def _as_on_a_gpu_machine() -> Iterator[None]:
    """torch.cuda reports GPUs for a while (checks only run meanwhile; nothing touches a device): as many as a
    set-up may name (strategy=dp's device_ids)."""
    import torch

    saved = torch.cuda.is_available, torch.cuda.device_count
    torch.cuda.is_available, torch.cuda.device_count = (lambda: True), (lambda: 1 << 16)
    try:
        yield
    finally:
        torch.cuda.is_available, torch.cuda.device_count = saved


def _compose(overrides: list[str]) -> tuple[Any, Any]:
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from dist_train.paths import expand_overrides, normalize_paths
    from dist_train.pretrained import resolve_model
    from dist_train.rundir import register_resolvers
    from dist_train.strategies.registry import register_configs

    register_configs()
    register_resolvers()
    GlobalHydra.instance().clear()  # a caller (tests, compare) may have initialised Hydra already
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            cfg = compose(config_name="config", overrides=expand_overrides(list(overrides)))
    finally:
        GlobalHydra.instance().clear()
    run = OmegaConf.to_object(cfg)
    normalize_paths(run)
    resolve_model(run.model)  # type: ignore[union-attr]  # model=hf: the sizes come from the directory's config.json
    return cfg, run


def model_config(name: str) -> dict[str, Any]:
    """conf/model/<name>.yaml merged over the ModelConfig defaults."""
    from dist_train.config import ModelConfig

    path = CONF_DIR / "model" / f"{name}.yaml"
    if not path.is_file():
        raise ValueError(f"model {name!r}: no {path}")
    merged = OmegaConf.merge(OmegaConf.structured(ModelConfig), OmegaConf.load(path))
    return OmegaConf.to_container(merged, resolve=True)  # type: ignore[return-value]


def model_groups() -> list[str]:
    """The `model=` options training accepts: conf/model/*.yaml."""
    return sorted(p.stem for p in (CONF_DIR / "model").glob("*.yaml"))


def shaped_model_groups() -> list[str]:
    """The conf/model options that fix a shape by themselves (`hf` needs a directory, `model.path=DIR`)."""
    return [n for n in model_groups() if "num_layers" in (OmegaConf.load(CONF_DIR / "model" / f"{n}.yaml") or {})]


def shape_overrides(shape: Any) -> list[str]:
    """Training overrides that make the `model` group describe `shape` (an estimator preset, dist_train.estimate.
    shapes.PRESETS): every field a ModelShape reads, so nothing of the default group's shape is left over."""
    fields = {
        "name": shape.name, "arch": shape.arch, "num_layers": shape.num_layers, "hidden_size": shape.hidden_size,
        "num_heads": shape.num_heads, "num_kv_heads": shape.num_kv_heads, "ffn_hidden_size": shape.ffn_hidden_size,
        "head_dim": shape.head_size, "qkv_bias": shape.qkv_bias, "out_bias": shape.out_bias,
        "mlp_bias": shape.mlp_bias, "qk_norm": shape.qk_norm, "vocab_size": shape.vocab_size,
        "max_seq_len": shape.max_seq_len, "tie_embeddings": shape.tie_embeddings, "dropout": shape.dropout,
        "num_experts": shape.num_experts, "experts_per_token": shape.experts_per_token,
        "moe_ffn_hidden_size": shape.moe_ffn_hidden_size, "path": None,
    }

    def value(v: Any) -> str:
        if v is None:
            return "null"
        if isinstance(v, bool):
            return str(v).lower()
        return repr(v) if isinstance(v, str) else str(v)

    return [f"model.{k}={value(v)}" for k, v in fields.items()]
