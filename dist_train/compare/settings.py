"""The comparison's own options (`compare.*`), split from the training overrides every run shares."""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from omegaconf import OmegaConf

DEFAULT_STRATEGIES = ["single", "ddp", "fsdp", "zero1", "zero2", "zero3", "gpipe"]


@dataclass
class CompareConfig:
    # Strategy names (conf/strategy/<name>.yaml). `name+key=value+...` adds overrides for that row only,
    # e.g. fsdp+strategy.reshard_after_forward=false.
    strategies: list[str] = field(default_factory=lambda: list(DEFAULT_STRATEGIES))
    # Knobs to sweep besides the strategy, {key: [values]}: every strategy runs once per combination, e.g.
    # compare.sweep='{precision:[fp32,bf16],train.activation_checkpointing:[none,full]}' (see sweep.py).
    sweep: dict[str, Any] = field(default_factory=dict)
    # Processes per multi-process strategy (single and dp always run one process); with launcher=slurm, per node.
    nproc: int = 2
    # local: launch here (torchrun --standalone); slurm: each strategy a job step of the Slurm job this runs in.
    launcher: str = "local"
    # compare.from=[PATH, ...]: report on runs that already happened (run directories, or directories of them,
    # e.g. a multirun sweep run as Slurm jobs) instead of training; compare.strategies is then not used.
    from_: list[str] = field(default_factory=list)
    # None: outputs/compare-<YYYYmmdd-HHMMSS>.
    out_dir: Optional[str] = None
    # W&B group of the runs and of the comparison's own W&B run; None: the output directory's name.
    group: Optional[str] = None
    # Per strategy, wall-clock seconds before the run is stopped and reported as timed out.
    timeout_s: float = 900.0
    # A strategy agrees with single when every step's loss is within this relative difference.
    loss_rtol: float = 1e-4
    # Predicted-vs-measured model-state memory passes within this relative error.
    memory_rtol: float = 0.10
    # Log the comparison as its own W&B run (a Table + charts); None: when training logs to W&B.
    wandb: Optional[bool] = None
    # "Would it fit" section of the report: per-GPU memory, GPU counts and model sizes to ask about.
    gpu_gib: float = 80.0
    fit_gpus: list[int] = field(default_factory=lambda: [8, 64, 1024])
    fit_models: list[str] = field(default_factory=lambda: ["7b", "70b"])
    # Dry-run rows (dryruns.py): every strategy also as the first and last rank of jobs of these sizes, under a
    # fake process group (the real code, nothing trained), beside the estimator; [] = none.
    dryrun_world_sizes: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.nproc < 1:
            raise ValueError(f"compare.nproc={self.nproc} must be >= 1")
        if not self.strategies:
            raise ValueError("compare.strategies is empty; e.g. compare.strategies=[single,ddp,fsdp]")
        self.sweep = flatten_sweep(self.sweep)
        bad = [n for n in self.dryrun_world_sizes if int(n) < 1]
        if bad:
            raise ValueError(f"compare.dryrun_world_sizes={list(self.dryrun_world_sizes)}: {bad[0]} is not a world "
                             "size; each must be >= 1")
        if self.dryrun_world_sizes and self.from_:
            raise ValueError("compare.dryrun_world_sizes runs the rows' training overrides at other sizes; "
                             "compare.from has none: run the dry runs with the comparison that trains them")
        if self.launcher not in ("local", "slurm"):
            raise ValueError(f"compare.launcher={self.launcher!r} is not supported; allowed: local, slurm")


# Settings that say how a run is run and watched, not what it trains (session.config_hash leaves out the same).
NOT_KNOBS = ("strategy", "logger", "telemetry", "checkpoint", "runtime")


def override_value(value: Any) -> str:
    """A value as a Hydra override writes it (booleans lower case, None as null)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return "null" if value is None else str(value)


def as_overrides(values: dict[str, Any]) -> str:
    """{key: value} as the overrides that set them, space-separated (`precision=bf16 train.steps=5`)."""
    return " ".join(f"{k}={override_value(v)}" for k, v in values.items())


def flatten(mapping: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested mappings as dotted keys: {"train": {"seq_len": 64}} -> {"train.seq_len": 64}."""
    out: dict[str, Any] = {}
    for key, value in mapping.items():
        if isinstance(value, dict):
            out.update(flatten(value, prefix=f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def flatten_sweep(sweep: dict[str, Any]) -> dict[str, list[Any]]:
    """{dotted key: values}: accepts `{train.activation_checkpointing: [...]}` and the nested form that
    `compare.sweep.train.activation_checkpointing=[...]` gives. A bad entry is a ValueError naming it."""
    out: dict[str, list[Any]] = {}
    for name, values in flatten(sweep).items():
        if not isinstance(values, (list, tuple)) or not values:
            raise ValueError(f"compare.sweep: {name!r} needs a non-empty list of values, e.g. "
                             "compare.sweep='{precision:[fp32,bf16]}'")
        if name.split(".")[0] in NOT_KNOBS:
            raise ValueError(f"compare.sweep: {name!r} is not a training knob (the strategies come from "
                             f"compare.strategies; {', '.join(NOT_KNOBS[1:])} do not change what is trained)")
        bad = [v for v in values if "+" in override_value(v) or isinstance(v, (dict, list))]
        if bad:
            raise ValueError(f"compare.sweep: {name!r} has values {bad} that cannot be one override (no '+', "
                             "lists or mappings)")
        out[name] = list(values)
    return out


@dataclass(frozen=True)
class StrategySpec:
    """One row of the comparison: a strategy name plus that row's own overrides."""

    label: str
    name: str
    overrides: tuple[str, ...] = ()

    @classmethod
    def parse(cls, text: str) -> "StrategySpec":
        name, *extra = str(text).split("+")
        return cls(label=str(text), name=name, overrides=tuple(extra))

    @property
    def dirname(self) -> str:
        # no '=' or '+': the directory is passed back to Hydra as hydra.run.dir=<dir>
        return re.sub(r"[^A-Za-z0-9_.-]+", "_", self.label)


def split_argv(argv: list[str]) -> tuple[list[str], list[str]]:
    """(compare.* options, training overrides). `hydra.run.dir=PATH` is taken as compare.out_dir."""
    own, training = [], []
    for arg in argv:
        if arg.startswith("compare.from="):  # `from` is a Python keyword: the field is from_
            own.append("from_=" + arg.split("=", 1)[1])
        elif arg.startswith("compare."):
            own.append(arg[len("compare."):])
        elif arg.startswith("hydra.run.dir="):
            own.append("out_dir=" + arg.split("=", 1)[1])
        else:
            training.append(arg)
    if training and any(o.startswith("from_=") for o in own):
        raise ValueError(f"compare.from reports on finished runs; training overrides {training} would not apply")
    for arg in training:
        if arg.split("=", 1)[0].lstrip("+~") == "strategy":
            raise ValueError(f"{arg!r}: the strategies come from compare.strategies=[...], not strategy=")
    return own, training


def parse(own: list[str]) -> CompareConfig:
    """The compare.* options (given without their prefix); errors name the key as the user wrote it."""
    schema = OmegaConf.create({"compare": OmegaConf.structured(CompareConfig)})
    merged = OmegaConf.merge(schema, OmegaConf.from_dotlist([f"compare.{o}" for o in own]))
    return OmegaConf.to_object(merged.compare)  # type: ignore[return-value]


def resolve_out_dir(cfg: CompareConfig) -> Path:
    if cfg.out_dir:
        return Path(cfg.out_dir).expanduser().resolve()
    return Path("outputs", f"compare-{time.strftime('%Y%m%d-%H%M%S')}").resolve()


def pinned_global_batch(base_train: dict[str, Any], spec: StrategySpec, *, world_size: int) -> list[str]:
    """The override that gives every row one global batch, where the training config leaves it null.

    A null train.global_batch_size means micro_batch_size x the run's processes; single and dp run one process
    and the others `world_size`, so left null they would train different batches. The comparison fixes it at
    micro_batch_size x world_size (the row's own micro-batch, where a sweep sets one) for every row."""
    if base_train.get("global_batch_size") is not None:
        return []
    micro = base_train["micro_batch_size"]
    for override in spec.overrides:
        key, _, value = override.partition("=")
        if key.lstrip("+") == "train.global_batch_size":
            return []
        if key.lstrip("+") == "train.micro_batch_size":
            micro = value
    try:
        return [f"train.global_batch_size={int(micro) * world_size}"]
    except ValueError:  # not a number: the row fails with train.py's own line
        return []

