"""What a prediction needs to know about a run: strategy family, world size, precision, optimizer, batch.

Built from the same config training composes (or from a run's own config.yaml), so a prediction and
the run it is compared with cannot disagree on the inputs. Strategies are recognised by the fields
their schema has (`stage`: DeepSpeed ZeRO, `schedule`: pipeline, ...) and, for names whose YAML does
not exist yet, by name.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Optional

from dist_train.config import PrecisionConfig, checkpointing_mode, require
from dist_train.parallel.catalog import Parallelism, composition
from dist_train.parallel_dims import ParallelDims, layout_dims, nodes_of_launch

FAMILIES = ("single", "dp", "ddp", "fsdp", "zero", "pipeline", "tp", "accelerate", "fsdp_tp")

# name -> (family, ZeRO stage, pipeline schedule) for the strategies this project has or plans.
KNOWN_STRATEGIES: dict[str, tuple[str, int, str]] = {
    "single": ("single", 0, ""),
    "dp": ("dp", 0, ""),
    "ddp": ("ddp", 0, ""),
    "fsdp": ("fsdp", 0, ""),
    "hsdp": ("fsdp", 0, ""),
    "zero1": ("zero", 1, ""),
    "zero2": ("zero", 2, ""),
    "zero3": ("zero", 3, ""),
    "gpipe": ("pipeline", 0, "gpipe"),
    "1f1b": ("pipeline", 0, "1f1b"),
    "pp_dp": ("pipeline", 0, "gpipe"),
    "tp": ("tp", 0, ""),
    "accelerate": ("accelerate", 0, ""),
    "fsdp_tp": ("fsdp_tp", 0, ""),
    "ddp_tp": ("fsdp_tp", 0, ""),
    "fsdp_ep": ("fsdp", 0, ""),
    "ep": ("fsdp_tp", 0, ""),
}
# Strategies the estimator refuses (one line, where a prediction would be wrong), and why.
NOT_MODELLED: dict[str, str] = {}
# Registered strategies (by name) that the estimator models as another family with fields set: fsdp_ep is FSDP with
# the experts split over `ep` ranks (Setup.ep); ep is ddp_tp's FSDP2 replicas at tp 1, the experts split the same way.
MODELLED_AS = {"fsdp_ep": "fsdp", "ep": "fsdp_tp"}
# What a name implies beside its family (the strategy registry's names, which import torch; a test checks they agree);
# a field the run's strategy config does not have comes from here too (ep's tp of 1)
IMPLIED: dict[str, dict[str, Any]] = {"ddp_tp": {"dp_mode": "replicate"}, "fsdp_ep": {"ep": 2},
                                      "ep": {"dp_mode": "replicate", "tp": 1, "ep": 2}}

# How model state is stored (bytes per parameter; see memory.state_bytes):
#   autocast  - fp32 weights, gradients and optimizer state; 16-bit only inside forward/backward. What
#               torch autocast (single/dp/ddp/pipeline) and FSDP2's MixedPrecisionPolicy(param_dtype=bf16,
#               reduce_dtype=fp32) do here: the fp32 parameters (or shards) are the master copy.
#   mixed     - the ZeRO paper's mixed precision: 16-bit weights and gradients, fp32 master weights and
#               fp32 optimizer state (K = 12 for Adam); in fp32 training there is no separate master.
#   deepspeed - `mixed`, except that DeepSpeed ZeRO 1/2 keep an fp32 master partition even when training in
#               fp32 (`single_partition_of_fp32_groups` is a `.float().clone()` of the weights whatever their
#               dtype). Stage 3 under strategy=zero3 uses an fp32 partition as its own master
#               (strategies/_zero3_setup.py; Setup.zero3_shares_master); Accelerate's engine keeps the copy.
#   pure      - every state tensor in the training dtype, no master (e.g. fp16 Adam moments: 4 B/param).
#   auto      - what this project's code does: `deepspeed` for ZeRO, `autocast` for everything else.
REGIMES = ("auto", "autocast", "mixed", "deepspeed", "pure")


@dataclass(frozen=True)
class Setup:
    strategy: str
    family: str
    world_size: int = 1
    zero_stage: int = 0
    schedule: str = ""
    precision: str = "fp32"
    optimizer: str = "adamw"
    momentum: float = 0.0
    micro_batch_size: int = 1
    seq_len: int = 2048
    # None: micro_batch_size x world_size (what train.global_batch_size=null trains).
    global_batch_size: Optional[int] = None
    # Pipeline only; None = global_batch_size // micro_batch_size.
    num_microbatches: Optional[int] = None
    split_points: Optional[tuple[int, ...]] = None
    reshard_after_forward: bool = True
    # fsdp: reduce-scatter after every micro-batch instead of once a step (strategy.reduce_every_microbatch)
    reduce_every_microbatch: bool = False
    activation_checkpointing: str = "none"  # none | full | selective (config.CHECKPOINTING)
    checkpoint_every: int = 1  # train.checkpoint_every: only every k-th block checkpointed
    regime: str = "auto"
    # ZeRO-3's gathering, as DeepSpeed is configured (zero_optimization.stage3_*; in elements). The persistence
    # threshold is this project's default (0: every parameter partitioned), the prefetch follows the model (None:
    # 0.9 x hidden^2, parallel/buckets.py, filled in by memory.with_model), the rest are DeepSpeed's defaults.
    zero3_persistence_threshold: int = 0
    zero3_max_live_parameters: int = 10**9
    zero3_max_reuse_distance: int = 10**9
    zero3_prefetch_bucket_size: Optional[int] = None
    # ZeRO-3 splits each rank's partition into sub-groups of this many elements: the optimizer steps, and the
    # gradient norm is reduced, one sub-group at a time (zero_optimization.sub_group_size; DeepSpeed's default)
    zero3_sub_group_size: int = 10**9
    # ZeRO's reduction bucket (zero_optimization.reduce_bucket_size, in elements), allocated whole in the training
    # dtype (ZeRO 1 and 2 at the first reduction, 3 at set-up). None: the model's hidden^2, as the training code
    # configures DeepSpeed (parallel/buckets.py), filled in by memory.with_model
    zero_reduce_bucket_size: Optional[int] = None
    # ddp: the gradient bucket's size (strategy.bucket_cap_mb, MiB): how many all-reduces carry the gradients
    bucket_cap_mb: float = 25.0
    # strategy=accelerate: what Accelerate wraps the model in (ddp | fsdp)
    plugin: str = "ddp"
    # strategy=fsdp_tp, ddp_tp: ranks per tensor-parallel group
    tp: int = 2
    # strategy=tp: Megatron's sequence parallelism
    sequence_parallel: bool = False
    # Optimizer state bytes per parameter where they depend on the tensors' shapes (Adafactor, 8-bit Adam):
    # set from the model by memory.with_model; None for the others, whose state is so many bytes per element.
    optimizer_bytes_per_param: Optional[float] = None
    # pipelines: stages (None = one per rank); world / pp replicas, each stage replicated or FSDP-sharded
    pp: Optional[int] = None
    # how each data-parallel group holds a pipeline stage's or a TP slice's state: replicate | fsdp; "" = the
    # strategy's default (pipelines and ddp_tp: replicate; fsdp_tp: fsdp)
    dp_mode: str = ""
    # fsdp/hsdp: replicas of the sharded state (strategy.replicate; HSDP's dp_replicate degree), 1 = plain FSDP
    replicate: int = 1
    # fsdp_ep, ep: ranks that split each MoE layer's experts (strategy.ep); 1 = no expert parallelism
    ep: int = 1
    # Under expert parallelism, the busiest rank's received rows over the rows it sends (telemetry's
    # moe/ep_overload; 1 = balanced routing): its experts' activations and compute scale with it
    ep_overload: float = 1.0

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ValueError(f"strategy family {self.family!r} unknown; allowed: {', '.join(FAMILIES)}")
        if self.regime not in REGIMES:
            raise ValueError(f"regime={self.regime!r} unknown; allowed: {', '.join(REGIMES)}")
        if self.world_size < 1:
            raise ValueError(f"world_size={self.world_size} must be >= 1")
        if self.checkpoint_every < 1:
            raise ValueError(f"train.checkpoint_every={self.checkpoint_every} must be >= 1")
        if not self.ep_overload >= 1:  # NaN too
            raise ValueError(f"ep_overload={self.ep_overload} must be >= 1 (1 = balanced routing)")
        # True and False (the bool it was) stay full and none
        object.__setattr__(self, "activation_checkpointing", checkpointing_mode(self.activation_checkpointing))
        # each degree divides the world, in the words training uses (strategies' check()), before the product is
        # judged (which would name degrees the user never set)
        degree = {"fsdp_tp": ("strategy.tp", self.tp), "fsdp": ("strategy.replicate", self.replicate),
                  "pipeline": ("strategy.pp", self.num_stages)}.get(self.family)
        if degree is not None:
            key, value = degree
            require(value >= 1 and self.world_size % value == 0,
                    f"{key}={value} must divide the number of processes ({self.world_size})")
        self.dims  # noqa: B018 - the degrees must multiply to the world (ConfigError, one line)

    @property
    def kind(self) -> str:
        """The family whose memory and traffic this run has: Accelerate's DDP is DDP's, its FSDP2 is FSDP's."""
        if self.family == "accelerate":
            return "fsdp" if self.plugin == "fsdp" else "ddp"
        return self.family

    @property
    def dims(self) -> ParallelDims:
        """The run's parallel degrees, as its strategy states them (StrategyConfig.parallel_dims; a test checks
        that the two agree for every strategy and world size)."""
        if self.family in ("single", "dp"):
            layout = "one"
        elif self.family == "fsdp_tp":
            layout = "fsdp_tp" if self.shards_tp else "ddp_tp"
        elif self.family in ("tp", "pipeline", "fsdp"):
            layout = self.family
        else:  # ZeRO; Accelerate's DDP, FSDP or DeepSpeed
            layout = "replicate" if self.kind == "ddp" else "shard"
        return layout_dims(layout, self.world_size, replicas=self.replicate, tp=self.tp,
                           stages=self.num_stages if self.family == "pipeline" else 1,
                           stage_dp="dp_shard" if self.dp_mode == "fsdp" else "dp_replicate", ep=self.ep)

    @property
    def shard_with(self) -> Optional[str]:
        """What partitions the model state over dp_shard (parallel/catalog.py's fsdp or zero<stage>), None if
        nothing does."""
        if self.family == "zero":
            return f"zero{self.zero_stage}"
        fsdp = self.kind == "fsdp" or self.shards_tp or (self.family == "pipeline" and self.dp_mode == "fsdp")
        return "fsdp" if fsdp else None

    @property
    def shards_tp(self) -> bool:
        """fsdp_tp: FSDP2 shards each TP slice over the data-parallel groups; not ddp_tp, whose replicas hold it
        whole (FSDP2's replicate)."""
        return self.family == "fsdp_tp" and self.dp_mode != "replicate"

    @property
    def parallelisms(self) -> tuple[Parallelism, ...]:
        """The run's parallelisms, as parallel/catalog.py declares them, in the order they are applied."""
        return composition(self.dims, shard_with=self.shard_with, sequence_parallel=self.sequence_parallel)

    @property
    def data_parallel_size(self) -> int:
        return self.dims.data_parallel

    @property
    def tensor_parallel_size(self) -> int:
        return {"tp": self.world_size, "fsdp_tp": self.tp}.get(self.family, 1)

    @property
    def comm_group_size(self) -> int:
        """Ranks in the group a rank's collectives run over (a pipeline's send/recv: a pair; its replicas'
        collectives name their own group size)."""
        if self.family == "pipeline":
            return 2
        return self.tensor_parallel_size if self.family == "tp" else self.data_parallel_size  # fsdp_tp: by collective

    @property
    def num_stages(self) -> int:
        if self.family != "pipeline":
            return 1
        return self.pp if self.pp is not None else self.world_size

    @property
    def microbatches_per_step(self) -> int:
        """Micro-batches each rank runs per optimizer step (gradient accumulation or pipeline micro-batches)."""
        if self.family == "pipeline" and self.num_microbatches:
            return self.num_microbatches
        # train.global_batch_size=null trains micro_batch_size x world_size samples a step (config.default_global_batch)
        global_batch = self.global_batch_size or self.micro_batch_size * self.world_size
        return max(1, global_batch // (self.micro_batch_size * self.data_parallel_size))

    def checkpointed_layers(self, num_layers: int, first: int = 0) -> int:
        """Of the `num_layers` blocks from block `first` (0-based; a pipeline stage's first), how many
        train.activation_checkpointing checkpoints: every checkpoint_every-th of the model, counted from 1."""
        if self.activation_checkpointing == "none":
            return 0
        return (first + num_layers) // self.checkpoint_every - first // self.checkpoint_every

    def trailing_plain_layers(self, num_layers: int, first: int = 0) -> int:
        """The blocks after the last checkpointed one among those: freed before backward recomputes any."""
        return (first + num_layers) % self.checkpoint_every

    @property
    def autocast_16bit(self) -> bool:
        """Whether a 16-bit run computes under torch autocast over fp32 weights (single, dp, ddp, pipelines, tp):
        norms then run in fp32 and matrix products keep 16-bit copies of their weights. FSDP's mixed precision
        and DeepSpeed compute in 16 bits throughout instead."""
        return PrecisionConfig(self.precision).mixed and self.kind in ("single", "dp", "ddp", "pipeline", "tp")

    @property
    def zero3_shares_master(self) -> bool:
        """Whether DeepSpeed's fp32 master partition is the parameters' own partition where both are fp32: under
        strategy=zero3's engine (strategies/_zero3_setup.py), not under Accelerate's."""
        return self.family == "zero" and self.zero_stage == 3 and self.strategy != "accelerate"

    @property
    def resolved_regime(self) -> str:
        if self.regime != "auto":
            return self.regime
        return "deepspeed" if self.family == "zero" else "autocast"

    @property
    def regime_description(self) -> str:
        """What the regime means for this run's dtypes, in words (the report's column): `autocast` is the name of
        the fp32-state regime, which an fp32 run has too, without any autocast."""
        p = self.precision
        regime = self.resolved_regime
        if regime == "autocast":
            if p == "fp32":
                return "fp32 weights, grads and state"
            compute = "autocast" if self.autocast_16bit else "mixed-precision policy"
            return f"fp32 weights, grads and state; {p} compute ({compute})"
        if regime == "deepspeed":
            if p == "fp32" and self.zero3_shares_master:
                return "fp32 weights, grads and state; the weights are the master (DeepSpeed)"
            return f"{p} weights and grads; fp32 master and state (DeepSpeed)"
        if regime == "mixed":
            return f"{p} weights and grads; fp32 master and state"
        return f"{p} weights, grads and state"


def family_of(name: str, strategy: Optional[Mapping[str, Any]] = None) -> tuple[str, int, str]:
    """(family, ZeRO stage, schedule) from the strategy's config fields, else from its name."""
    s = dict(strategy or {})
    if "stage" in s:
        return "zero", int(s["stage"]), ""
    if "schedule" in s:
        return "pipeline", 0, str(s["schedule"])
    if "tp" in s or (s.get("dp_mode") == "replicate" and "ep" in s):  # ep: ddp_tp's replicas at tp 1
        return "fsdp_tp", 0, ""
    if "reshard_after_forward" in s:
        return "fsdp", 0, ""
    if "bucket_cap_mb" in s:
        return "ddp", 0, ""
    if "plugin" in s:
        stage = _accelerate_deepspeed_stage(s)
        return ("zero", stage, "") if stage else ("accelerate", 0, "")
    if name in KNOWN_STRATEGIES:
        return KNOWN_STRATEGIES[name]
    raise ValueError(f"strategy {name!r}: cannot tell its family; known: {', '.join(KNOWN_STRATEGIES)}")


def _accelerate_deepspeed_stage(strategy: Mapping[str, Any]) -> int:
    """strategy=accelerate driving DeepSpeed (by strategy.plugin, or by its accelerate config file): its ZeRO
    stage, whose memory and traffic are zero<N>'s; 0 for DDP or FSDP."""
    plugin, path = strategy.get("plugin"), strategy.get("config_file")
    settings: Mapping[str, Any] = {}
    if path and Path(str(path)).is_file():
        import yaml

        settings = yaml.safe_load(Path(str(path)).read_text()) or {}
    if plugin is None and str(settings.get("distributed_type", "")).upper() == "DEEPSPEED":
        plugin = "deepspeed"
    if plugin != "deepspeed":
        return 0
    return int((settings.get("deepspeed_config") or {}).get("zero_stage") or strategy.get("zero_stage") or 2)


_ZERO3_KEYS = {
    "stage3_param_persistence_threshold": "zero3_persistence_threshold",
    "stage3_max_live_parameters": "zero3_max_live_parameters",
    "stage3_max_reuse_distance": "zero3_max_reuse_distance",
    "stage3_prefetch_bucket_size": "zero3_prefetch_bucket_size",
    "sub_group_size": "zero3_sub_group_size",
    "reduce_bucket_size": "zero_reduce_bucket_size",
}


def _zero3_fields(strategy: Mapping[str, Any]) -> dict[str, int]:
    """ZeRO knobs the estimator follows (ZeRO-3's gathering, the reduction bucket) that a run overrides through
    strategy.extra.zero_optimization."""
    zero = (strategy.get("extra") or {}).get("zero_optimization") or {}
    return {field: int(float(zero[key])) for key, field in _ZERO3_KEYS.items() if key in zero}


def _replicas(strategy: Mapping[str, Any], world_size: int) -> int:
    """strategy.replicate (fsdp: 1, hsdp's default None: one replica per node, as training counts the nodes)."""
    if "replicate" not in strategy:
        return 1
    return int(strategy["replicate"]) if strategy["replicate"] is not None else nodes_of_launch(world_size)


# The fields a strategy's own config sets (strategy.<field>): another strategy, named only, takes Setup's defaults
# for them and what its name implies, not the run's own strategy's values.
STRATEGY_FIELDS = ("tp", "dp_mode", "ep", "replicate", "pp", "sequence_parallel", "plugin")


def named_only(name: str) -> dict[str, Any]:
    """The strategy fields of strategy `name` named without its config: Setup's defaults and IMPLIED[name] (ddp_tp's
    replicas, fsdp_ep's and ep's ep of 2, ep's tp of 1)."""
    defaults = {f.name: f.default for f in fields(Setup) if f.name in STRATEGY_FIELDS}
    return {**defaults, **IMPLIED.get(name, {})}


def setup_from_config(cfg: Mapping[str, Any], *, world_size: int, **overrides: Any) -> Setup:
    """A Setup from a resolved run config (a dict with strategy/train/precision/optimizer groups)."""
    strategy = dict(cfg.get("strategy") or {})
    peft = str((cfg.get("peft") or {}).get("name", "none"))
    if peft != "none":
        raise ValueError(f"peft={peft}: the estimator does not model LoRA adapters yet (it would predict full training)")
    name = str(overrides.pop("strategy", None) or strategy.get("name"))
    if name != strategy.get("name"):
        strategy = {}  # a different strategy than the config's: judge by name only
    if name in NOT_MODELLED:
        raise ValueError(f"strategy={name}: {NOT_MODELLED[name]}")
    family, stage, schedule = family_of(name, strategy)
    train, optimizer = cfg.get("train", {}), cfg.get("optimizer", {})
    split = strategy.get("split_points")
    fields: dict[str, Any] = dict(
        strategy=name, family=family, world_size=world_size, zero_stage=stage, schedule=schedule,
        precision=str(cfg.get("precision", {}).get("name", "fp32")),
        optimizer=str(optimizer.get("name", "adamw")), momentum=float(optimizer.get("momentum", 0.0) or 0.0),
        micro_batch_size=int(train.get("micro_batch_size", 1)), seq_len=int(train.get("seq_len", 2048)),
        global_batch_size=train.get("global_batch_size"),
        activation_checkpointing=checkpointing_mode(train.get("activation_checkpointing", "none")),
        checkpoint_every=int(train.get("checkpoint_every", 1)),
        num_microbatches=strategy.get("num_microbatches"),
        split_points=tuple(split) if split else None,
        reshard_after_forward=bool(strategy.get("reshard_after_forward", True)),
        reduce_every_microbatch=bool(strategy.get("reduce_every_microbatch", False)),
        plugin=str(strategy.get("plugin") or "ddp"),
        tp=int(strategy.get("tp") or 2),
        sequence_parallel=bool(strategy.get("sequence_parallel", False)),
        pp=int(strategy["pp"]) if strategy.get("pp") is not None else None,
        dp_mode=str(strategy.get("dp_mode") or ""),
        replicate=_replicas(strategy, world_size),
        ep=min(int(strategy.get("ep") or 1), world_size),
        bucket_cap_mb=float(strategy.get("bucket_cap_mb") or 25.0),
        **_zero3_fields(strategy),
    )
    fields.update({k: v for k, v in IMPLIED.get(name, {}).items() if k not in strategy})
    fields.update(overrides)
    return Setup(**fields)
