"""The estimator's own options (`world_size=8 fit.gpus=[8,64] format=json ...`), apart from the training overrides:
their types and checks, what --help says of each, and how a command line is split between the two."""

from __future__ import annotations

import textwrap
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, Optional

from omegaconf import OmegaConf

from dist_train.config import checkpointing_mode
from dist_train.estimate.fit import DEFAULT_FIT_GPUS, DEFAULT_FIT_STRATEGIES
from dist_train.estimate.setup import KNOWN_STRATEGIES, REGIMES, family_of
from dist_train.estimate.shapes import preset_names



@dataclass
class FitArgs:
    # Presets (7b, 13b, 70b: Llama 2 shapes, or llama2-7b, ...) or conf/model names; the run's own model is always
    # added. Activations are those of one micro-batch of train.seq_len tokens, as in the breakdown above the table.
    models: list[str] = field(default_factory=lambda: ["7b", "70b"])
    # Bare parameter counts (e.g. 175e9): model state only, no shape for activations.
    params: list[float] = field(default_factory=list)
    gpus: list[int] = field(default_factory=lambda: list(DEFAULT_FIT_GPUS))
    strategies: list[str] = field(default_factory=lambda: list(DEFAULT_FIT_STRATEGIES))
    micro_batch_size: Optional[int] = None  # None = train.micro_batch_size

    def __post_init__(self) -> None:
        for n in self.gpus:
            if n < 1:
                raise ValueError(f"fit.gpus: {n} GPUs; each count must be >= 1")
        if self.micro_batch_size is not None and self.micro_batch_size < 1:
            raise ValueError(f"fit.micro_batch_size={self.micro_batch_size} must be >= 1")
        for name in self.strategies:
            try:
                family_of(name)
            except ValueError as exc:
                raise ValueError(f"fit.strategies: {exc}") from None


@dataclass
class DryRunArgs:
    # Ranks of a world_size-rank job to run for real under a fake process group (empty: no dry run).
    ranks: list[int] = field(default_factory=list)
    timeout_s: float = 900.0  # per rank

    def __post_init__(self) -> None:
        if self.timeout_s <= 0:
            raise ValueError(f"dryrun.timeout_s={self.timeout_s} must be > 0")


@dataclass
class EstimateArgs:
    world_size: int = 8
    gpu_gib: float = 80.0
    regime: str = "auto"
    activation_checkpointing: Optional[str] = None  # none | full | selective; None = train.activation_checkpointing
    kv_batch: Optional[int] = None  # None = train.micro_batch_size
    kv_context: Optional[int] = None  # None = model.max_seq_len
    ep_overload: float = 1.0  # expert parallelism: the busiest rank's received rows over its share (1 = balanced)
    fit: FitArgs = field(default_factory=FitArgs)
    dryrun: DryRunArgs = field(default_factory=DryRunArgs)
    # text: tables for a person; json: the same figures in bytes, for tools.
    format: str = "text"

    def __post_init__(self) -> None:
        for rank in self.dryrun.ranks:
            if not 0 <= rank < self.world_size:
                raise ValueError(f"dryrun.ranks: rank {rank} is not one of world_size={self.world_size}'s "
                                 f"(0 to {self.world_size - 1})")
        if self.format not in ("text", "json"):
            raise ValueError(f"format={self.format!r} is not supported; allowed: text, json")
        if self.gpu_gib <= 0:
            raise ValueError(f"gpu_gib={self.gpu_gib} must be > 0")
        if not self.ep_overload >= 1:  # NaN too
            raise ValueError(f"ep_overload={self.ep_overload} must be >= 1 (the busiest rank's received rows over "
                             "its balanced share; 1 = balanced routing)")
        if self.ep_overload != 1 and self.dryrun.ranks:
            raise ValueError(f"ep_overload={self.ep_overload}: the dry run routes tokens balanced; predict with "
                             "ep_overload=1 beside it, or drop dryrun.ranks")


# What --help says of each estimator option; its default is read from the dataclasses above.
OPTION_HELP = {
    "world_size": "ranks (processes) the run is predicted on",
    "gpu_gib": "memory per GPU in GiB (2^30 bytes) that the fit table checks against",
    "regime": f"which bytes per parameter: {' | '.join(REGIMES)} (auto: what this code does for the strategy; "
              "mixed: the ZeRO paper's 2+2+12; pure: all state in 16 bits)",
    "activation_checkpointing": "predict with activation checkpointing none | full | selective (true = full, "
                                "false = none; null: as train.activation_checkpointing says; the breakdown shows "
                                "none or full beside it)",
    "kv_batch": "batch of the inference KV-cache line (null: train.micro_batch_size)",
    "kv_context": "context of the inference KV-cache line (null: the model's max_seq_len)",
    "ep_overload": "expert parallelism (fsdp_ep, ep): the busiest rank's received rows over its balanced share, as "
                   "moe/ep_overload measures it (at most strategy.ep); its experts' activations and compute scale "
                   "with it",
    "format": "text: tables for a person; json: the same figures in bytes, for tools",
    "fit.models": f"other models for the fit table: presets {preset_names()} or conf/model names "
                  "(the run's own model is always in it)",
    "fit.params": "bare parameter counts for the fit table (e.g. [175e9]): model state only",
    "fit.gpus": "GPU counts N, the fit table's columns",
    "fit.strategies": "the fit table's strategies (known: " + ", ".join(KNOWN_STRATEGIES) + ")",
    "fit.micro_batch_size": "micro-batch of the fit table's activations (null: train.micro_batch_size)",
    "dryrun.ranks": "ranks of the world_size-rank job to run for real here, one process each, under a fake process "
                    "group and FakeTensorMode: set-up and one step, figures beside the prediction",
    "dryrun.timeout_s": "seconds one rank's dry run may take",
}

EXAMPLES = (
    ("a Llama 2 7B preset under FSDP on 64 GPUs, 4096-token sequences",
     "python -m dist_train.estimate strategy=fsdp model=7b world_size=64 train.seq_len=4096"),
    ("ZeRO-3 on 64 GPUs in bf16, as JSON (bytes, per rank) for tools",
     "python -m dist_train.estimate model=llama_1b strategy=zero3 world_size=64 precision=bf16 format=json"),
    ("the real fsdp code as the last rank of a 64-rank job, beside the prediction (one process here, no GPU)",
     "python -m dist_train.estimate strategy=fsdp model=llama_1b world_size=64 train.seq_len=256 dryrun.ranks=[63]"),
    ("your own model directory (its config.json gives the shape), ZeRO-2 on 8 GPUs of 40 GiB",
     "python -m dist_train.estimate model=hf model.path=DIR strategy=zero2 world_size=8 gpu_gib=40 "
     "fit.models=[7b,13b]"),
)


def _default(f: Any) -> Any:
    return f.default_factory() if f.default is MISSING else f.default


def _render(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_render(v) for v in value) + "]"
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    return str(value)


def option_defaults(cls: type = EstimateArgs, prefix: str = "") -> dict[str, str]:
    """Each estimator option (`fit.gpus`, ...) and its default as it would be written on the command line."""
    out: dict[str, str] = {}
    for f in fields(cls):
        default = _default(f)
        if f.name == "fit":
            out.update(option_defaults(FitArgs, "fit."))
        elif f.name == "dryrun":
            out.update(option_defaults(DryRunArgs, "dryrun."))
        else:
            out[prefix + f.name] = _render(default)
    return out


def help_text() -> str:
    """What `--help` prints: what it does, every estimator option with its default (read from EstimateArgs,
    FitArgs and DryRunArgs), that training overrides apply, and examples."""
    from dist_train.estimate.compose import model_groups

    options = [line for k, v in option_defaults().items()
               for line in (f"  {k}={v}", *textwrap.wrap(OPTION_HELP.get(k, ""), 104, initial_indent=" " * 6,
                                                         subsequent_indent=" " * 6, break_on_hyphens=False))]
    examples = [line for what, cmd in EXAMPLES for line in (f"  # {what}", f"  {cmd}")]
    about = (
        "Predicts, without running anything, each rank's memory (weights, gradients, master weights, optimizer "
        "state, activations, transient buffers; the KV cache for inference), the collectives of one optimizer "
        "step, and which strategies fit in gpu_gib on N GPUs: for one model at one sequence length, "
        "train.seq_len (the breakdown and the fit table use the same). With dryrun.ranks it also runs the real "
        "strategy code as those ranks of world_size, here, under a fake process group, and puts what they hold "
        "and send beside the prediction.",
        "Training overrides: any override launch/train.py takes applies (strategy=, precision=, optimizer=, "
        "model=, train.seq_len=, train.micro_batch_size=, strategy.<key>=, ...), and the config is checked as "
        f"training checks it. model= takes conf/model ({', '.join(model_groups())}) and the estimator's Llama 2 "
        f"presets {preset_names()}; model=hf model.path=DIR reads a local model directory's config.json.",
    )
    return "\n".join([
        "usage: python -m dist_train.estimate [training overrides] [estimator options]",
        "",
        *(line for para in about for line in (*textwrap.wrap(para, 110, break_on_hyphens=False), "")),
        "Estimator options (key=value; default shown):",
        *options,
        "",
        "Examples:",
        *examples,
        "",
        "Bad input is one `config error:` line on stderr, exit code 2.",
    ])


def checkpointing_option(option: Optional[str], train: dict[str, Any]) -> dict[str, str]:
    """The estimator's activation_checkpointing option where it is given; it may add checkpointing to a run that
    has none, but not silently change the run's own train.activation_checkpointing (full or selective)."""
    if option is None:
        return {}
    mode = checkpointing_mode(option, "activation_checkpointing")
    own = checkpointing_mode(train.get("activation_checkpointing", "none"))
    if own not in ("none", mode):
        raise ValueError(f"activation_checkpointing={mode} contradicts train.activation_checkpointing={own}; "
                         "give one of them")
    return {"activation_checkpointing": mode}


_OWN_KEYS = ("world_size", "gpu_gib", "regime", "activation_checkpointing", "kv_batch", "kv_context", "ep_overload",
             "fit", "format", "dryrun")


def split_options(argv: list[str], own_keys: tuple[str, ...]) -> tuple[list[str], list[str]]:
    """(a tool's own `key=value` options, whose first key part is in `own_keys`; the training overrides): how the
    estimator and the advisor (dist_train/plan/cli.py) split their command lines."""
    own, training = [], []
    for arg in argv:
        key = arg.split("=", 1)[0].lstrip("+~")
        (own if key.split(".")[0] in own_keys else training).append(arg)
    return own, training


def parse_options(schema: type, own: list[str]) -> Any:
    """`own` (`key=value` dotlist) typed and checked by the dataclass `schema`, over its defaults."""
    merged = OmegaConf.merge(OmegaConf.structured(schema), OmegaConf.from_dotlist(own))
    return OmegaConf.to_object(merged)


def split_args(argv: list[str]) -> tuple[list[str], list[str]]:
    """(estimator options, training overrides)."""
    return split_options(argv, _OWN_KEYS)


def parse_args(own: list[str]) -> EstimateArgs:
    for arg in own:
        if arg.split("=", 1)[0].lstrip("+~") == "fit.seq_len":
            raise ValueError(f"{arg}: fit.seq_len is no longer an option; the breakdown and the fit table share one "
                             "sequence length, train.seq_len=N")
    return parse_options(EstimateArgs, own)
