"""`python -m dist_train.estimate [training overrides] [estimator options]` (`--help` says the same).

Training overrides (`model=llama_1b strategy=zero3 precision=bf16 train.seq_len=2048 ...`) are composed
with Hydra's compose API from conf/, exactly as launch/train.py would. `model=` also takes the estimator's
presets (`7b`, `13b`, `70b`, or the names its tables print, `llama2-7b`, ...): they become `model.*` overrides
of the default model group before composing, so the training config is still checked as training would check
it, later `model.<key>=` overrides still apply, and training itself accepts only conf/model/*.yaml.
Estimator options are plain `key=value` pairs, typed by :class:`EstimateArgs`:

    world_size=8 gpu_gib=80 regime=auto activation_checkpointing=true kv_batch=1 kv_context=4096
    fit.models=[7b,70b,llama_1b] fit.params=[175e9] fit.gpus=[8,64,1024] fit.strategies=[ddp,zero3]
    format=json      # the same figures as JSON, in bytes, for tools

One printout describes one model at one sequence length: the breakdown and the fit table both use the training
config's `train.seq_len` (and, unless fit.micro_batch_size says otherwise, its `train.micro_batch_size`).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from dataclasses import MISSING, asdict, dataclass, field, fields, replace
from typing import Any, Optional

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from dist_train.estimate.comm import bus_factor, predict_comm, ring_bytes, ring_volume_psi
from dist_train.estimate.compose import check_as_training
from dist_train.estimate.dryrun import dryrun_rows, dryrun_section, supported
from dist_train.estimate.fit import DEFAULT_FIT_GPUS, DEFAULT_FIT_STRATEGIES, FitCell, FitModel, fit_table
from dist_train.estimate.memory import (
    RankMemory,
    element_bytes,
    kv_cache_bytes,
    predict_memory,
    setup_state_bytes,
    shards,
    with_model,
)
from dist_train.estimate.render import human_bytes, human_count, text_table
from dist_train.estimate.setup import KNOWN_STRATEGIES, REGIMES, Setup, family_of, setup_from_config
from dist_train.estimate.shapes import PRESETS, ModelShape, find_preset, preset_names


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
    activation_checkpointing: Optional[bool] = None  # None = train.activation_checkpointing
    kv_batch: Optional[int] = None  # None = train.micro_batch_size
    kv_context: Optional[int] = None  # None = model.max_seq_len
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


# What --help says of each estimator option; its default is read from the dataclasses above.
OPTION_HELP = {
    "world_size": "ranks (processes) the run is predicted on",
    "gpu_gib": "memory per GPU in GiB (2^30 bytes) that the fit table checks against",
    "regime": f"which bytes per parameter: {' | '.join(REGIMES)} (auto: what this code does for the strategy; "
              "mixed: the ZeRO paper's 2+2+12; pure: all state in 16 bits)",
    "activation_checkpointing": "predict with activation checkpointing or without (null: as "
                                "train.activation_checkpointing says; the breakdown shows the other case too)",
    "kv_batch": "batch of the inference KV-cache line (null: train.micro_batch_size)",
    "kv_context": "context of the inference KV-cache line (null: the model's max_seq_len)",
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


def _checkpointing(option: Optional[bool], train: dict[str, Any]) -> dict[str, bool]:
    """The estimator's activation_checkpointing option where it is given; it may add checkpointing to a run that
    has none, but not silently drop the run's own train.activation_checkpointing=true."""
    if option is None:
        return {}
    if not option and train.get("activation_checkpointing"):
        raise ValueError("activation_checkpointing=false contradicts train.activation_checkpointing=true; "
                         "give one of them")
    return {"activation_checkpointing": option}


_OWN_KEYS = ("world_size", "gpu_gib", "regime", "activation_checkpointing", "kv_batch", "kv_context", "fit", "format",
             "dryrun")


def split_args(argv: list[str]) -> tuple[list[str], list[str]]:
    """(estimator options, training overrides)."""
    own, training = [], []
    for arg in argv:
        key = arg.split("=", 1)[0].lstrip("+~")
        (own if key.split(".")[0] in _OWN_KEYS else training).append(arg)
    return own, training


def parse_args(own: list[str]) -> EstimateArgs:
    for arg in own:
        if arg.split("=", 1)[0].lstrip("+~") == "fit.seq_len":
            raise ValueError(f"{arg}: fit.seq_len is no longer an option; the breakdown and the fit table share one "
                             "sequence length, train.seq_len=N")
    merged = OmegaConf.merge(OmegaConf.structured(EstimateArgs), OmegaConf.from_dotlist(own))
    return OmegaConf.to_object(merged)  # type: ignore[return-value]


def resolve_model_choice(training: list[str]) -> list[str]:
    """`model=7b` (a preset, by its key or by the name the tables print) as `model.*` overrides placed before the
    user's own `model.<key>=` (which win, as they would over a config group's values); a conf/model name is left
    to Hydra; anything else is a ValueError naming both lists."""
    from dist_train.estimate.compose import model_groups, shape_overrides

    choices = [a for a in training if a.split("=", 1)[0] == "model"]
    if not choices:
        return training
    name = choices[-1].split("=", 1)[1]
    groups = model_groups()
    if name in groups:
        return training
    preset = find_preset(name)
    if preset is None:
        printed = ", ".join(s.name for s in PRESETS.values())
        raise ValueError(f"model={name} is not an option (no conf/model/{name}.yaml); available: {', '.join(groups)} "
                         f"(or the presets by the names the tables print: {printed})")
    return shape_overrides(preset) + [a for a in training if a not in choices]


def compose(training: list[str]) -> tuple[dict[str, Any], Optional[str]]:
    """The training config, and the strategy name when its YAML does not exist (yet)."""
    from dist_train.estimate.compose import compose_training_config

    from hydra.errors import MissingConfigException

    try:
        return compose_training_config(training), None
    except Exception as exc:  # noqa: BLE001 - only a strategy with no YAML is retried; the rest re-raise
        names = [a.split("=", 1)[1] for a in training if a.startswith("strategy=")]
        missing = isinstance(exc, MissingConfigException) or isinstance(exc.__cause__, MissingConfigException)
        if not names or not missing or f"strategy/{names[-1]}" not in str(exc):
            raise
        rest = [a for a in training if not a.startswith(("strategy=", "strategy."))]
        return compose_training_config(rest), names[-1]


def main(argv: list[str] | None = None) -> int:
    """Bad input of any kind (our checks, Hydra's composition, OmegaConf's types) is one `config error:` line."""
    from hydra.errors import HydraException

    from dist_train.config import ConfigError
    from dist_train.entry import one_line, print_help, report_config_error
    from dist_train.paths import expand_overrides

    argv = expand_overrides(sys.argv[1:] if argv is None else list(argv))  # model.path=~/m, as the shell left it
    if "--help" in argv or "-h" in argv:  # before Hydra's override parser, which cannot read it
        print_help(help_text())
        return 0
    own, training = split_args(argv)
    try:
        args = parse_args(own)
        cfg, unlisted = compose(resolve_model_choice(training))
        shape = ModelShape.from_config(cfg["model"])
        checkpointing = _checkpointing(args.activation_checkpointing, cfg["train"])
        # LoRA: the estimator does not model its adapters (setup_from_config says so); the dry run measures them
        adapters = str((cfg.get("peft") or {}).get("name", "none")) != "none" and bool(args.dryrun.ranks)
        setup = setup_from_config(
            {**cfg, "peft": {"name": "none"}} if adapters else cfg, world_size=args.world_size, regime=args.regime,
            **checkpointing, **({"strategy": unlisted} if unlisted else {}),
        )
        dryrun_overrides = resolve_model_choice(training)
        if args.dryrun.ranks:
            why_not = supported(setup.family, setup.strategy)
            if why_not:
                raise ValueError(why_not)
        refused: dict[str, str] = {}
        if unlisted is None:  # a strategy with no YAML yet: nothing of training's to check it against
            # training's checks, training's line; the dry run runs here, so it is checked for this machine
            run = check_as_training(dryrun_overrides, world_size=args.world_size, here=bool(args.dryrun.ranks))
            refused = model_refusals(run)
        models = fit_models(shape, args.fit, refused=refused)
    except ConfigError as exc:  # our own checks' line, as launch/train.py prints it
        return report_config_error(str(exc))
    except (ValueError, OmegaConfBaseException, HydraException) as exc:
        return report_config_error(one_line(exc))
    dry: list[dict[str, Any]] = []
    if args.dryrun.ranks:
        try:
            dry = dryrun_rows(dryrun_overrides, shape, setup, ranks=list(args.dryrun.ranks),
                              timeout_s=args.dryrun.timeout_s, predict=not adapters)
        except (RuntimeError, subprocess.TimeoutExpired) as exc:
            print(f"dry run failed: {one_line(exc)}", file=sys.stderr)
            return 1
    if adapters:  # no prediction to print beside it: the dry run's own figures, and why
        note = (f"peft={cfg['peft']['name']}: the estimator does not model LoRA adapters yet; the dry run's figures "
                "are measured with them, nothing is predicted")
        if args.format == "json":
            print(json.dumps({"note": note, "dryrun": {"world_size": args.world_size, "ranks": dry}}, indent=1))
        else:
            print(note + "\n\n" + dryrun_section(dry, world_size=args.world_size))
        return 0
    if args.format == "json":
        out = report_json(shape, setup, args=args, models=models)
        if dry:
            out["dryrun"] = {"world_size": args.world_size, "ranks": dry}
        print(json.dumps(out, indent=1))
    else:
        print(report(shape, setup, args=args, unlisted=unlisted is not None, models=models))
        if dry:
            print("\n" + dryrun_section(dry, world_size=args.world_size))
    return 0


def report_json(shape: ModelShape, setup: Setup, *, args: EstimateArgs,
                models: Optional[list[FitModel]] = None) -> dict[str, Any]:
    """What `report` prints, as numbers: bytes, per rank; memory categories as in RankMemory. The fit cells'
    activations are those of `fit_base(setup, args)` (the breakdown's train.seq_len)."""
    other = predict_memory(shape, replace(setup, activation_checkpointing=not setup.activation_checkpointing))
    kv_batch, kv_ctx = args.kv_batch or setup.micro_batch_size, args.kv_context or shape.max_seq_len
    return {
        "model": {**asdict(shape), "num_params": shape.num_params},
        "setup": {**asdict(setup), "resolved_regime": setup.resolved_regime,
                  "data_parallel_size": setup.data_parallel_size, "microbatches_per_step": setup.microbatches_per_step,
                  "tensor_parallel_size": setup.tensor_parallel_size},
        "bytes_per_param": asdict(setup_state_bytes(with_model(shape, setup))),
        # data-parallel sharding; tensor parallelism splits each rank's share further (setup.tensor_parallel_size)
        "sharded_over": asdict(shards(setup)),
        "memory_per_rank": [_rank_json(r) for r in predict_memory(shape, setup)],
        "activations_with_the_other_checkpointing": [r.activations for r in other],
        "kv_cache_bytes": kv_cache_bytes(shape, batch=kv_batch, context=kv_ctx, elem=element_bytes(setup.precision)),
        "communication_per_rank": [
            [{**asdict(c), "ring_bytes": c.ring_bytes(setup.comm_group_size)} for c in colls]
            for colls in predict_comm(shape, setup)
        ],
        "fit": [asdict(c) for c in fit_cells(shape, setup, args=args, models=models)],
        "fit_micro_batch": {"micro_batch_size": fit_base(setup, args).micro_batch_size, "seq_len": setup.seq_len},
        "gpu_gib": args.gpu_gib,
    }


def _rank_json(rank: RankMemory) -> dict[str, float]:
    return {**asdict(rank), "model_state": rank.model_state, "working_set": rank.working_set, "total": rank.total}


def report(shape: ModelShape, setup: Setup, *, args: EstimateArgs, unlisted: bool = False,
           models: Optional[list[FitModel]] = None) -> str:
    parts = [header(shape, setup, unlisted=unlisted), memory_section(shape, setup, args=args),
             comm_section(shape, setup), fit_section(shape, setup, args=args, models=models)]
    return "\n\n".join(parts)


def header(shape: ModelShape, setup: Setup, *, unlisted: bool) -> str:
    lines = [
        f"model {shape.name}: {human_count(shape.num_params)} parameters (Ψ = {shape.num_params:,}), "
        f"{shape.num_layers} layers, hidden {shape.hidden_size}, {shape.num_heads} heads "
        f"({shape.kv_heads} kv), vocab {shape.vocab_size}",
        f"strategy {setup.strategy} ({setup.family}{f' stage {setup.zero_stage}' if setup.family == 'zero' else ''}) "
        f"on {setup.world_size} ranks | precision {setup.precision} | optimizer {setup.optimizer} | "
        f"regime {setup.resolved_regime} | micro-batch {setup.micro_batch_size} x {setup.seq_len} tokens, "
        f"{setup.microbatches_per_step} per step",
    ]
    if unlisted:
        lines.append(f"(no conf/strategy/{setup.strategy}.yaml: predicted from the strategy's name and defaults)")
    return "\n".join(lines)


def memory_section(shape: ModelShape, setup: Setup, *, args: EstimateArgs) -> str:
    ranks = predict_memory(shape, setup)
    ckpt = predict_memory(shape, replace(setup, activation_checkpointing=not setup.activation_checkpointing))
    b = setup_state_bytes(with_model(shape, setup))
    sh = shards(setup)
    show = list(range(len(ranks))) if len(set(ranks)) > 1 and len(ranks) <= 8 else [0]
    cols = [f"rank {r}" for r in show] if len(show) > 1 else ["per rank"]
    other = "with" if not setup.activation_checkpointing else "without"
    t = setup.tensor_parallel_size
    rows: list[list[object]] = [
        ["weights", b.weights, split_over(sh.weights, t), *(human_bytes(ranks[r].params) for r in show)],
        ["gradients", b.grads, split_over(sh.grads, t), *(human_bytes(ranks[r].grads) for r in show)],
        ["master weights", b.master, split_over(sh.optimizer, t), *(human_bytes(ranks[r].master) for r in show)],
        ["optimizer state", b.optimizer, split_over(sh.optimizer, t), *(human_bytes(ranks[r].optimizer) for r in show)],
        ["= model state", b.total, "", *(human_bytes(ranks[r].model_state) for r in show)],
        ["activations", "", "", *(human_bytes(ranks[r].activations) for r in show)],
        *_transient_rows(ranks, show),
        ["= total (peak)", "", "", *(human_bytes(ranks[r].total) for r in show)],
        *([["peak of live tensors", "", "", *(human_bytes(ranks[r].peak_live) for r in show)]]
          if all(ranks[r].peak_live is not None for r in show) else []),
        [f"(activations {other} checkpointing)", "", "", *(human_bytes(ckpt[r].activations) for r in show)],
    ]
    kv_batch = args.kv_batch or setup.micro_batch_size
    kv_ctx = args.kv_context or shape.max_seq_len
    kv = kv_cache_bytes(shape, batch=kv_batch, context=kv_ctx, elem=element_bytes(setup.precision))
    return "\n".join([
        "memory per rank (bytes/param before sharding; GiB = 2^30 bytes)",
        text_table(["category", "bytes/param", "sharded over", *cols], rows),
        *([f"(tp {t}: each layer's matmul weights and column-parallel biases, the embedding and an untied head are "
           f"split {t} ways; norms, positions and row-parallel biases are whole on every rank)"] if t > 1 else []),
        f"KV cache for inference (2 x batch {kv_batch} x {shape.num_layers} layers x {shape.kv_heads} kv heads "
        f"x {shape.head_dim} head_dim x context {kv_ctx} x {element_bytes(setup.precision)} B): {human_bytes(kv)}",
    ])


def split_over(shards: int, tensor_parallel: int) -> str:
    """The "sharded over" cell: the ranks a category is divided over, by data-parallel sharding (FSDP, ZeRO) and
    by tensor parallelism (`2 (tp)`, `4 x 2 (dp x tp)`); tensor parallelism leaves some parameters whole."""
    if tensor_parallel == 1:
        return str(shards)
    return f"{tensor_parallel} (tp)" if shards == 1 else f"{shards} x {tensor_parallel} (dp x tp)"


_TRANSIENT = (
    ("weight_copies", "autocast weight copies (16-bit)"),
    ("gathered_params", "ZeRO-3 gathered parameters"),
    ("gathered_grads", "ZeRO-3 full-size gradients"),
    ("step_grads", "ZeRO fp32 step gradients"),
)


def _transient_rows(ranks: list[RankMemory], show: list[int]) -> list[list[object]]:
    """Buffers held for a moment (see dist_train/estimate/memory.py), the rows that apply to this run."""
    rows: list[list[object]] = []
    for attr, label in _TRANSIENT:
        if any(getattr(ranks[r], attr) for r in show):
            rows.append([label, "", "", *(human_bytes(getattr(ranks[r], attr)) for r in show)])
    return rows


def comm_section(shape: ModelShape, setup: Setup) -> str:
    per_rank = predict_comm(shape, setup)
    worst = max(range(len(per_rank)), key=lambda r: ring_bytes(per_rank[r], group_size=setup.comm_group_size))
    colls = per_rank[worst]
    if not colls:
        return "communication per step: none (one process)"
    n = setup.comm_group_size
    psi = shape.num_params
    rows = [[c.op, human_bytes(c.bytes), f"{c.elem} B", f"{bus_factor(c.op, c.group_size or n):.3f}", human_bytes(c.ring_bytes(n)),
             f"{c.ring_elements(n) / psi:.3f} Ψ", c.what] for c in colls]
    total_ring = ring_bytes(colls, group_size=n)
    return "\n".join([
        f"communication per optimizer step, rank {worst} (buffer = nccl-tests size, ring = what the rank sends)",
        text_table(["collective", "buffer", "element", "bus factor", "ring traffic", "ring volume", "what"], rows),
        f"total ring traffic {human_bytes(total_ring)} = {ring_volume_psi(colls, group_size=n, num_params=psi):.3f} Ψ "
        "elements (ZeRO paper: DDP / ZeRO-1 / ZeRO-2 2Ψ, ZeRO-3 / FSDP 3Ψ per micro-batch, each x (N-1)/N)",
    ])


def fit_shape(name: str) -> ModelShape:
    """A fit.models name: a preset (`7b`, `llama2-7b`) or a conf/model group with a shape of its own; a ValueError
    naming the allowed names otherwise."""
    from dist_train.estimate.compose import model_config, shaped_model_groups

    preset = find_preset(name)
    if preset is not None:
        return preset
    groups = shaped_model_groups()
    if name in groups:
        return ModelShape.from_config(model_config(name))
    why = "needs a model directory (model=hf model.path=DIR puts it in the table as the run's own model)" \
        if name == "hf" else "is not a model"
    raise ValueError(f"fit.models: {name!r} {why}; allowed: {', '.join(PRESETS)}, "
                     f"{', '.join(s.name for s in PRESETS.values())}, {', '.join(groups)}")


def model_refusals(run: Any) -> dict[str, str]:
    """Strategy families training refuses for the run's own model whatever the world size (a model directory
    whose architecture has no pipeline or no tensor-parallel plan in transformers), with training's reason: the
    same checks the strategies run (pipeline.check_splittable, base.check_tensor_parallel)."""
    from dist_train.config import ConfigError
    from dist_train.strategies.base import check_tensor_parallel
    from dist_train.strategies.pipeline import check_splittable

    if run.model.path is None:  # the presets and conf/model shapes: GPT-2 and Llama, which both split
        return {}
    out: dict[str, str] = {}
    for families, check in ((("pipeline",), lambda: check_splittable(run, what="pipelines")),
                            (("tp", "fsdp_tp"), lambda: check_tensor_parallel(run, 1, what="tensor parallelism"))):
        try:
            check()
        except ConfigError as exc:
            out.update(dict.fromkeys(families, str(exc)))
    return out


def fit_models(shape: ModelShape, args: FitArgs, *, refused: Optional[dict[str, str]] = None) -> list[FitModel]:
    """The fit table's models: the run's own first (with the strategy families training refuses for it), then
    fit.models and fit.params."""
    models = [FitModel(shape.name, shape.num_params, shape, refused=refused or {})]
    for name in args.models:
        other = fit_shape(name)
        if any(other == m.shape for m in models):
            continue  # the run's own model, or a name given twice
        label = other.name
        if any(label == m.name for m in models):  # e.g. model=70b model.num_layers=2 beside the 70b preset
            label = f"{other.name} ({human_count(other.num_params)})"
        models.append(FitModel(label, other.num_params, other))
    models += [FitModel(f"{human_count(p)} params", p) for p in args.params]
    return models


def fit_base(setup: Setup, args: EstimateArgs) -> Setup:
    """The run's setup at the fit table's micro-batch; the sequence length stays the run's train.seq_len."""
    return replace(setup, micro_batch_size=args.fit.micro_batch_size or setup.micro_batch_size)


def fit_cells(shape: ModelShape, setup: Setup, *, args: EstimateArgs,
              models: Optional[list[FitModel]] = None) -> list[FitCell]:
    f = args.fit
    return fit_table(fit_models(shape, f) if models is None else models, base=fit_base(setup, args),
                     strategies=f.strategies, gpus=f.gpus, gpu_gib=args.gpu_gib, seq_len=setup.seq_len)


def fit_section(shape: ModelShape, setup: Setup, *, args: EstimateArgs,
                models: Optional[list[FitModel]] = None) -> str:
    f = args.fit
    models = fit_models(shape, f) if models is None else models
    cells = fit_cells(shape, setup, args=args, models=models)
    base = fit_base(setup, args)
    rows, index = [], {}
    for c in cells:
        key = (c.model, c.strategy)
        if key not in index:
            index[key] = len(rows)
            rows.append([c.model, c.strategy] + [""] * len(f.gpus))
        cell = "n/a" if c.peak_bytes is None else f"{human_bytes(c.peak_bytes)} {'ok' if c.fits else 'NO'}"
        rows[index[key]][2 + f.gpus.index(c.world_size)] = cell + (" *" if c.note == "model state only" else "")
    mb = "train.micro_batch_size" if f.micro_batch_size is None else "fit.micro_batch_size"
    short = [f"{m.name} (max_seq_len {m.shape.max_seq_len})" for m in models
             if m.shape is not None and m.shape.max_seq_len < setup.seq_len]
    refusals = dict.fromkeys(f"n/a: {c.model} {c.strategy}: launch/train.py refuses it: {c.note}" for c in cells
                             if c.peak_bytes is None and c.note in models[0].refused.values())
    return "\n".join([
        f"fits in {args.gpu_gib:g} GiB per GPU? worst rank's GiB: model state + activations of one micro-batch of "
        f"{base.micro_batch_size} x {setup.seq_len} tokens ({mb} x train.seq_len, every model), plus what the peak "
        "of live tensors adds where it is predicted (gathered parameters, DeepSpeed's reduction bucket), "
        f"{'with' if setup.activation_checkpointing else 'no'} activation checkpointing; "
        "pipeline: one stage per GPU, M = K micro-batches; * = model state only",
        text_table(["model", "strategy", *(f"N={n}" for n in f.gpus)], rows),
        *([f"predicted at {setup.seq_len} tokens beyond the max_seq_len of: {', '.join(short)}"] if short else []),
        *refusals,
    ])
