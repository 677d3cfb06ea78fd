"""`python -m dist_train.estimate [training overrides] [estimator options]`.

Training overrides (`model=llama_1b strategy=zero3 precision=bf16 train.seq_len=2048 ...`) are composed
with Hydra's compose API from conf/, exactly as launch/train.py would. Estimator options are plain
`key=value` pairs, typed by :class:`EstimateArgs`:

    world_size=8 gpu_gib=80 regime=auto activation_checkpointing=true kv_batch=1 kv_context=4096
    fit.models=[7b,70b,llama_1b] fit.params=[175e9] fit.gpus=[8,64,1024] fit.strategies=[ddp,zero3]
    format=json      # the same figures as JSON, in bytes, for tools
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Optional

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from dist_train.estimate.comm import bus_factor, predict_comm, ring_bytes, ring_volume_psi
from dist_train.estimate.fit import DEFAULT_FIT_GPUS, DEFAULT_FIT_STRATEGIES, FitModel, fit_table
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
from dist_train.estimate.setup import Setup, setup_from_config
from dist_train.estimate.shapes import PRESETS, ModelShape


@dataclass
class FitArgs:
    # Presets (7b, 13b, 70b: Llama 2 shapes) or conf/model names; the run's own model is always added.
    models: list[str] = field(default_factory=lambda: ["7b", "70b"])
    # Bare parameter counts (e.g. 175e9): model state only, no shape for activations.
    params: list[float] = field(default_factory=list)
    gpus: list[int] = field(default_factory=lambda: list(DEFAULT_FIT_GPUS))
    strategies: list[str] = field(default_factory=lambda: list(DEFAULT_FIT_STRATEGIES))
    # Activations of one micro-batch of this many tokens; None = each model's max_seq_len.
    seq_len: Optional[int] = None
    micro_batch_size: int = 1


@dataclass
class EstimateArgs:
    world_size: int = 8
    gpu_gib: float = 80.0
    regime: str = "auto"
    activation_checkpointing: bool = False
    kv_batch: Optional[int] = None  # None = train.micro_batch_size
    kv_context: Optional[int] = None  # None = model.max_seq_len
    fit: FitArgs = field(default_factory=FitArgs)
    # text: tables for a person; json: the same figures in bytes, for tools.
    format: str = "text"

    def __post_init__(self) -> None:
        if self.format not in ("text", "json"):
            raise ValueError(f"format={self.format!r} is not supported; allowed: text, json")


_OWN_KEYS = ("world_size", "gpu_gib", "regime", "activation_checkpointing", "kv_batch", "kv_context", "fit", "format")


def split_args(argv: list[str]) -> tuple[list[str], list[str]]:
    """(estimator options, training overrides)."""
    own, training = [], []
    for arg in argv:
        key = arg.split("=", 1)[0].lstrip("+~")
        (own if key.split(".")[0] in _OWN_KEYS else training).append(arg)
    return own, training


def parse_args(own: list[str]) -> EstimateArgs:
    merged = OmegaConf.merge(OmegaConf.structured(EstimateArgs), OmegaConf.from_dotlist(own))
    return OmegaConf.to_object(merged)  # type: ignore[return-value]


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

    from dist_train.entry import one_line, report_config_error

    own, training = split_args(sys.argv[1:] if argv is None else argv)
    try:
        args = parse_args(own)
        cfg, unlisted = compose(training)
        shape = ModelShape.from_config(cfg["model"])
        setup = setup_from_config(
            cfg, world_size=args.world_size, regime=args.regime,
            activation_checkpointing=args.activation_checkpointing,
            **({"strategy": unlisted} if unlisted else {}),
        )
    except (ValueError, OmegaConfBaseException, HydraException) as exc:
        return report_config_error(one_line(exc))
    if args.format == "json":
        print(json.dumps(report_json(shape, setup, args=args), indent=1))
    else:
        print(report(shape, setup, args=args, unlisted=unlisted is not None))
    return 0


def report_json(shape: ModelShape, setup: Setup, *, args: EstimateArgs) -> dict[str, Any]:
    """What `report` prints, as numbers: bytes, per rank; memory categories as in RankMemory."""
    other = predict_memory(shape, replace(setup, activation_checkpointing=not setup.activation_checkpointing))
    kv_batch, kv_ctx = args.kv_batch or setup.micro_batch_size, args.kv_context or shape.max_seq_len
    return {
        "model": {**asdict(shape), "num_params": shape.num_params},
        "setup": {**asdict(setup), "resolved_regime": setup.resolved_regime,
                  "data_parallel_size": setup.data_parallel_size, "microbatches_per_step": setup.microbatches_per_step},
        "bytes_per_param": asdict(setup_state_bytes(with_model(shape, setup))),
        "sharded_over": asdict(shards(setup)),
        "memory_per_rank": [_rank_json(r) for r in predict_memory(shape, setup)],
        "activations_with_the_other_checkpointing": [r.activations for r in other],
        "kv_cache_bytes": kv_cache_bytes(shape, batch=kv_batch, context=kv_ctx, elem=element_bytes(setup.precision)),
        "communication_per_rank": [
            [{**asdict(c), "ring_bytes": c.ring_bytes(setup.comm_group_size)} for c in colls]
            for colls in predict_comm(shape, setup)
        ],
        "fit": [asdict(c) for c in fit_table(
            fit_models(shape, args.fit), base=replace(setup, micro_batch_size=args.fit.micro_batch_size),
            strategies=args.fit.strategies, gpus=args.fit.gpus, gpu_gib=args.gpu_gib, seq_len=args.fit.seq_len)],
        "gpu_gib": args.gpu_gib,
    }


def _rank_json(rank: RankMemory) -> dict[str, float]:
    return {**asdict(rank), "model_state": rank.model_state, "working_set": rank.working_set, "total": rank.total}


def report(shape: ModelShape, setup: Setup, *, args: EstimateArgs, unlisted: bool = False) -> str:
    parts = [header(shape, setup, unlisted=unlisted), memory_section(shape, setup, args=args),
             comm_section(shape, setup), fit_section(shape, setup, args=args)]
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
    rows: list[list[object]] = [
        ["weights", b.weights, sh.weights, *(human_bytes(ranks[r].params) for r in show)],
        ["gradients", b.grads, sh.grads, *(human_bytes(ranks[r].grads) for r in show)],
        ["master weights", b.master, sh.optimizer, *(human_bytes(ranks[r].master) for r in show)],
        ["optimizer state", b.optimizer, sh.optimizer, *(human_bytes(ranks[r].optimizer) for r in show)],
        ["= model state", b.total, "", *(human_bytes(ranks[r].model_state) for r in show)],
        ["activations", "", "", *(human_bytes(ranks[r].activations) for r in show)],
        *_transient_rows(ranks, show),
        ["= total (peak)", "", "", *(human_bytes(ranks[r].total) for r in show)],
        [f"(activations {other} checkpointing)", "", "", *(human_bytes(ckpt[r].activations) for r in show)],
    ]
    kv_batch = args.kv_batch or setup.micro_batch_size
    kv_ctx = args.kv_context or shape.max_seq_len
    kv = kv_cache_bytes(shape, batch=kv_batch, context=kv_ctx, elem=element_bytes(setup.precision))
    return "\n".join([
        "memory per rank (bytes/param before sharding; GiB = 2^30 bytes)",
        text_table(["category", "bytes/param", "sharded over", *cols], rows),
        f"KV cache for inference (2 x batch {kv_batch} x {shape.num_layers} layers x {shape.kv_heads} kv heads "
        f"x {shape.head_dim} head_dim x context {kv_ctx} x {element_bytes(setup.precision)} B): {human_bytes(kv)}",
    ])


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


def fit_models(shape: ModelShape, args: FitArgs) -> list[FitModel]:
    from dist_train.estimate.compose import model_config

    models = [FitModel(shape.name, shape.num_params, shape)]
    for name in args.models:
        other = PRESETS.get(name.lower()) or ModelShape.from_config(model_config(name))
        if other.name != shape.name:
            models.append(FitModel(other.name, other.num_params, other))
    models += [FitModel(f"{human_count(p)} params", p) for p in args.params]
    return models


def fit_section(shape: ModelShape, setup: Setup, *, args: EstimateArgs) -> str:
    f = args.fit
    base = replace(setup, micro_batch_size=f.micro_batch_size)
    cells = fit_table(fit_models(shape, f), base=base, strategies=f.strategies, gpus=f.gpus,
                      gpu_gib=args.gpu_gib, seq_len=f.seq_len)
    rows, index = [], {}
    for c in cells:
        key = (c.model, c.strategy)
        if key not in index:
            index[key] = len(rows)
            rows.append([c.model, c.strategy] + [""] * len(f.gpus))
        cell = "n/a" if c.peak_bytes is None else f"{human_bytes(c.peak_bytes)} {'ok' if c.fits else 'NO'}"
        rows[index[key]][2 + f.gpus.index(c.world_size)] = cell + (" *" if c.note == "model state only" else "")
    seq = f"seq_len {f.seq_len}" if f.seq_len else "each model's max_seq_len"
    return "\n".join([
        f"fits in {args.gpu_gib:g} GiB per GPU? worst rank's GiB: model state + activations of one micro-batch "
        f"({f.micro_batch_size} x {seq}, {'with' if setup.activation_checkpointing else 'no'} activation "
        f"checkpointing); pipeline: one stage per GPU, M = K micro-batches; * = model state only",
        text_table(["model", "strategy", *(f"N={n}" for n in f.gpus)], rows),
    ])
