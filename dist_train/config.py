"""Typed run configuration: Hydra ConfigStore schemas plus the checks that run before any process starts.

Values live in YAML groups under ``conf/``; the dataclasses here give them types (Hydra rejects a
string where an int belongs) and :func:`validate` rejects combinations no single field can judge
(a batch that does not divide, ``dp`` under several processes). Every check raises
:class:`ConfigError` with one line naming the key and what is allowed.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass, field
from typing import Any, Optional

from omegaconf import MISSING


class ConfigError(ValueError):
    """A config value that cannot run; the message is one line naming the key and what is allowed."""


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def _importable(module: str) -> bool:
    """Whether `import module` can work, without importing it (deepspeed's import costs seconds)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # ValueError: sys.modules[module] is None (import blocked)
        return False


def _choice(key: str, value: str, allowed: tuple[str, ...]) -> None:
    _require(value in allowed, f"{key}={value!r} is not supported; allowed: {', '.join(allowed)}")


# --------------------------------------------------------------------------------------------------
# Strategies. One schema per strategy family; the YAML files in conf/strategy/ pick one and set `name`.
# `data_parallel_size` tells the loop how many ranks split each global batch.
# --------------------------------------------------------------------------------------------------


@dataclass
class StrategyConfig:
    name: str = MISSING

    @property
    def needs_process_group(self) -> bool:
        return True

    @property
    def checkpoint_format(self) -> str:
        """The checkpoint format this strategy writes and reads (torch.distributed.checkpoint by default)."""
        return "dcp"

    def data_parallel_size(self, world_size: int) -> int:
        return world_size

    def check(self, world_size: int) -> None:
        """Strategy-specific checks; world_size is the number of processes that will run."""

    def microbatches_per_step(self, train: "TrainConfig", world_size: int) -> int:
        """Micro-batches each rank runs per optimizer step (gradient accumulation)."""
        return train.global_batch_size // (train.micro_batch_size * self.data_parallel_size(world_size))

    def check_run(self, run: "RunConfig", world_size: int) -> None:
        """Checks that also need the model/train values; by default, that the global batch splits evenly."""
        t, dp = run.train, self.data_parallel_size(world_size)
        per_step = t.micro_batch_size * dp
        _require(
            t.global_batch_size % per_step == 0,
            f"train.global_batch_size={t.global_batch_size} must be divisible by train.micro_batch_size "
            f"({t.micro_batch_size}) x data-parallel size ({dp}) = {per_step}",
        )


@dataclass
class SingleConfig(StrategyConfig):
    name: str = "single"

    @property
    def needs_process_group(self) -> bool:
        return False

    def data_parallel_size(self, world_size: int) -> int:
        return 1

    def check(self, world_size: int) -> None:
        _require(
            world_size == 1,
            f"strategy=single runs one process but WORLD_SIZE={world_size}; "
            "run it with plain `python launch/train.py` or pick strategy=ddp|fsdp|...",
        )


@dataclass
class DPConfig(StrategyConfig):
    """``nn.DataParallel``: one process drives every local GPU."""

    name: str = "dp"
    # None = all visible GPUs.
    device_ids: Optional[list[int]] = None

    @property
    def needs_process_group(self) -> bool:
        return False

    def data_parallel_size(self, world_size: int) -> int:
        return 1  # one process; DataParallel scatters each micro-batch over GPUs itself

    def check(self, world_size: int) -> None:
        _require(
            world_size == 1,
            f"strategy=dp is single-process nn.DataParallel but WORLD_SIZE={world_size}; "
            "launch it with `python launch/train.py strategy=dp` (no torchrun) or use strategy=ddp",
        )


@dataclass
class DDPConfig(StrategyConfig):
    name: str = "ddp"
    bucket_cap_mb: float = 25.0
    # Gradients live inside DDP's all-reduce buckets instead of beside them: one copy, not two.
    gradient_as_bucket_view: bool = True

    def check(self, world_size: int) -> None:
        _require(self.bucket_cap_mb > 0, f"strategy.bucket_cap_mb={self.bucket_cap_mb} must be > 0")


@dataclass
class FSDPConfig(StrategyConfig):
    """FSDP2 (`fully_shard`) per transformer block, then the root."""

    name: str = "fsdp"
    # True: free gathered parameters after forward and gather again in backward (ZeRO-3-like).
    # False: keep them from forward to backward (ZeRO-2-like: more memory, one all-gather fewer).
    reshard_after_forward: bool = True


@dataclass
class ZeroConfig(StrategyConfig):
    """DeepSpeed ZeRO; zero1/zero2/zero3 differ only in `stage` (and the offload variants)."""

    name: str = "zero2"
    stage: int = 2
    offload_optimizer: bool = False
    offload_params: bool = False
    # Extra DeepSpeed config keys merged over the ones derived from the run's own config.
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def checkpoint_format(self) -> str:
        return "deepspeed"

    def check(self, world_size: int) -> None:
        _require(self.stage in (1, 2, 3), f"strategy.stage={self.stage} is not a ZeRO stage; allowed: 1, 2, 3")
        _require(
            not self.offload_params or self.stage == 3,
            f"strategy.offload_params=true needs strategy.stage=3 (got {self.stage})",
        )
        _require(
            _importable("deepspeed"),
            f"strategy={self.name} needs DeepSpeed, which is not importable in this environment; "
            "`pip install deepspeed` or pick strategy=ddp|fsdp",
        )
        if self.offload_optimizer or self.offload_params:
            import torch

            what = "optimizer and parameters" if self.offload_params else "optimizer"
            _require(
                torch.cuda.is_available(),
                f"strategy={self.name} offloads the {what} from GPU to CPU memory, but no CUDA GPU is visible; "
                f"on CPU use strategy=zero{self.stage} (no offload)",
            )

    def check_run(self, run: "RunConfig", world_size: int) -> None:
        super().check_run(run, world_size)
        if run.precision.name == "fp16":
            import torch

            _require(
                torch.cuda.is_available(),
                f"strategy={self.name} with precision=fp16 needs a GPU: DeepSpeed's CPU accelerator runs fp32 and "
                "bf16 only; use precision=bf16 on CPU",
            )


@dataclass
class PipelineConfig(StrategyConfig):
    """torch.distributed.pipelining: one stage per rank, `schedule` picks GPipe or 1F1B."""

    name: str = "gpipe"
    schedule: str = "gpipe"
    # Micro-batches per step; None = train.global_batch_size // train.micro_batch_size.
    num_microbatches: Optional[int] = None
    # Index of the first transformer block of stages 1..K-1; None = balance by parameter count.
    split_points: Optional[list[int]] = None

    def data_parallel_size(self, world_size: int) -> int:
        return 1  # every rank is a stage of one pipeline

    def check(self, world_size: int) -> None:
        _choice("strategy.schedule", self.schedule, ("gpipe", "1f1b"))
        _require(
            self.name not in ("gpipe", "1f1b") or self.name == self.schedule,
            f"strategy.schedule={self.schedule!r} contradicts strategy={self.name}; "
            f"pick the schedule by name: strategy={self.schedule}",
        )
        _require(
            world_size >= 2,
            f"strategy={self.name} needs at least 2 processes (one pipeline stage each), got WORLD_SIZE={world_size}",
        )
        if self.num_microbatches is not None:
            _require(self.num_microbatches >= 1, f"strategy.num_microbatches={self.num_microbatches} must be >= 1")

    # ---------------------------------------------------------------- pipeline: checks needing run values
    def microbatches(self, train: "TrainConfig") -> int:
        """Micro-batches per step: strategy.num_microbatches, else global_batch_size // micro_batch_size."""
        if self.num_microbatches is not None:
            return self.num_microbatches
        return train.global_batch_size // train.micro_batch_size

    def microbatches_per_step(self, train: "TrainConfig", world_size: int) -> int:
        return self.microbatches(train)

    def check_run(self, run: "RunConfig", world_size: int) -> None:
        stages, layers, batch = world_size, run.model.num_layers, run.train.global_batch_size
        _require(
            layers >= stages,
            f"model.num_layers={layers} is fewer than the {stages} pipeline stages (one per process, "
            f"WORLD_SIZE={stages}); strategy={self.name} needs model.num_layers >= WORLD_SIZE",
        )
        if self.num_microbatches is None:
            _require(
                batch % run.train.micro_batch_size == 0,
                f"train.global_batch_size={batch} must be divisible by train.micro_batch_size="
                f"{run.train.micro_batch_size} (or set strategy.num_microbatches)",
            )
        micro = self.microbatches(run.train)
        _require(
            batch % micro == 0,
            f"strategy.num_microbatches={micro} must divide train.global_batch_size={batch} "
            "(every micro-batch the same size)",
        )
        if self.schedule == "1f1b":
            _require(
                micro >= stages,
                f"strategy.num_microbatches={micro} must be >= the {stages} pipeline stages for strategy=1f1b",
            )
        if self.split_points is not None:
            points = list(self.split_points)
            edges = [0, *points, layers]  # every stage needs at least one block
            ok = len(points) == stages - 1 and all(a < b for a, b in zip(edges, edges[1:]))
            _require(
                ok,
                f"strategy.split_points={points} must be a list of {stages - 1} strictly increasing block "
                f"index(es) in [1, {layers - 1}] "
                f"(the first block of stages 1..{stages - 1}; WORLD_SIZE={stages}, model.num_layers={layers})",
            )
        _require(
            run.precision.name != "fp16",
            f"precision=fp16 is not supported with strategy={self.name} (each stage would skip steps on its own "
            "overflows); use precision=bf16 or precision=fp32",
        )


# --------------------------------------------------------------------------------------------------
# The other groups.
# --------------------------------------------------------------------------------------------------

MODEL_ARCHS = ("gpt2", "llama")


@dataclass
class ModelConfig:
    name: str = "tiny"
    arch: str = "gpt2"
    num_layers: int = 4
    hidden_size: int = 64
    num_heads: int = 4
    # Llama only: grouped-query attention; None = num_heads.
    num_kv_heads: Optional[int] = None
    # None = 4 * hidden_size.
    ffn_hidden_size: Optional[int] = None
    vocab_size: int = 256
    max_seq_len: int = 128
    tie_embeddings: bool = False
    dropout: float = 0.0


@dataclass
class TrainConfig:
    seq_len: int = 64
    global_batch_size: int = 8
    micro_batch_size: int = 2
    steps: int = 20
    lr: float = 1e-3
    seed: int = 1234
    # Close a logging window (gather every rank's figures, write metrics.jsonl, W&B) every N steps and after the last.
    log_every: int = 10
    # Clip the global gradient norm to this value; 0 disables clipping (the norm is still logged).
    grad_clip: float = 1.0
    lr_schedule: str = "constant"
    lr_warmup_steps: int = 0
    min_lr_ratio: float = 0.1
    # Recompute each transformer block in backward instead of keeping its activations.
    activation_checkpointing: bool = False


@dataclass
class DataConfig:
    name: str = "synthetic"
    path: Optional[str] = None
    # synthetic: probability that a token of a learnable sequence is replaced by a random one.
    noise: float = 0.1


@dataclass
class OptimizerConfig:
    name: str = "adamw"
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    weight_decay: float = 0.0
    momentum: float = 0.0


@dataclass
class PrecisionConfig:
    name: str = "fp32"


@dataclass
class LoggerConfig:
    name: str = "wandb"
    project: str = "dist_train"
    entity: Optional[str] = None
    # Runs of one experiment share a group; None = derived from the config minus strategy and logger.
    group: Optional[str] = None
    # online | offline | auto (offline unless an API key is configured).
    mode: str = "auto"
    # How long `wandb.init` may try to reach the server before the run logs offline instead.
    init_timeout_s: float = 30.0


@dataclass
class TelemetryConfig:
    # Steps left out of summary.json's mean step time (lazy init, DDP bucket rebuild, ...).
    warmup_steps: int = 1
    # Peak FLOP/s of one device for MFU; None = looked up from the GPU name (unknown on CPU: no mfu).
    peak_flops: Optional[float] = None
    # Count and time collectives.
    comm: bool = True
    # Track the bytes autograd saves for backward (memory/activations_bytes).
    activations: bool = True


@dataclass
class CheckpointConfig:
    # Save every N optimizer steps, and after the last step; 0 = never save.
    every_steps: int = 0
    # Where checkpoints go; None = <run dir>/checkpoints.
    dir: Optional[str] = None
    # Complete checkpoints kept on disk, the oldest removed first; 0 = keep all.
    keep_last: int = 2
    # auto: the newest complete checkpoint in `dir`, if any (what a restarted job wants); none: start fresh;
    # or a path: one checkpoint (step-NNNNNNNN) or a directory of them (its newest complete one).
    resume: str = "auto"
    # Write in a background thread (torch.distributed.checkpoint.async_save) where the strategy allows it;
    # the step only waits for the copy of the state to host memory.
    async_save: bool = True


@dataclass
class RuntimeConfig:
    # Seconds a collective waits for its peers before the process group gives up: how long a hung or lost
    # rank can hold the job.
    timeout_s: float = 600.0


@dataclass
class RunConfig:
    strategy: Any = MISSING
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    telemetry: TelemetryConfig = field(default_factory=TelemetryConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)


# Schemas live in their own group (`schema/strategy/<name>`), so `strategy=` lists only real strategies;
# each conf/strategy/*.yaml pulls its schema in with `- /schema/strategy/<name>@_here_`.
STRATEGY_SCHEMAS: dict[str, type[StrategyConfig]] = {
    "single": SingleConfig,
    "dp": DPConfig,
    "ddp": DDPConfig,
    "fsdp": FSDPConfig,
    "zero": ZeroConfig,
    "pipeline": PipelineConfig,
}


def register_configs() -> None:
    """Put the schemas in Hydra's ConfigStore; YAML files extend them through their defaults list."""
    from hydra.core.config_store import ConfigStore

    cs = ConfigStore.instance()
    cs.store(name="base_config", node=RunConfig)
    for name, schema in STRATEGY_SCHEMAS.items():
        cs.store(group="schema/strategy", name=name, node=schema)


# --------------------------------------------------------------------------------------------------
# Validation.
# --------------------------------------------------------------------------------------------------


def world_size_from_env() -> int:
    """The number of processes this launch will run (torchrun and the deepspeed launcher set WORLD_SIZE)."""
    raw = os.environ.get("WORLD_SIZE", "1")
    try:
        return int(raw)
    except ValueError as exc:
        raise ConfigError(f"environment WORLD_SIZE={raw!r} is not an integer") from exc


def accumulation_steps(run: RunConfig, world_size: int) -> int:
    """Micro-batches each rank runs per optimizer step."""
    return run.strategy.microbatches_per_step(run.train, world_size)


def validate(run: RunConfig, world_size: int) -> None:
    """Raise ConfigError (one line) for the first value that cannot run. No process group is needed."""
    validate_fields(run)
    _require(world_size >= 1, f"WORLD_SIZE={world_size} must be >= 1")
    from dist_train.strategies import available

    _choice("strategy.name", run.strategy.name, tuple(available()))
    run.strategy.check(world_size)
    run.strategy.check_run(run, world_size)


def validate_fields(run: RunConfig) -> None:
    """The checks that do not depend on the number of processes (the estimator and compare run these too)."""
    _require(isinstance(run.strategy, StrategyConfig), "strategy is not set; pick one with strategy=<name>")
    t, m = run.train, run.model
    for key in ("steps", "seq_len", "global_batch_size", "micro_batch_size", "log_every"):
        value = getattr(t, key)
        _require(value >= 1, f"train.{key}={value} must be >= 1")
    _require(t.lr > 0, f"train.lr={t.lr} must be > 0")
    _require(t.grad_clip >= 0, f"train.grad_clip={t.grad_clip} must be >= 0 (0 disables clipping)")
    _choice("train.lr_schedule", t.lr_schedule, ("constant", "cosine"))
    _require(t.lr_warmup_steps >= 0, f"train.lr_warmup_steps={t.lr_warmup_steps} must be >= 0")
    _require(0 <= t.min_lr_ratio <= 1, f"train.min_lr_ratio={t.min_lr_ratio} must be in [0, 1]")

    _choice("model.arch", m.arch, MODEL_ARCHS)
    for key in ("num_layers", "hidden_size", "num_heads", "vocab_size", "max_seq_len"):
        value = getattr(m, key)
        _require(value >= 1, f"model.{key}={value} must be >= 1")
    _require(
        m.hidden_size % m.num_heads == 0,
        f"model.hidden_size={m.hidden_size} must be divisible by model.num_heads={m.num_heads}",
    )
    if m.num_kv_heads is not None:
        _require(
            m.num_kv_heads >= 1 and m.num_heads % m.num_kv_heads == 0,
            f"model.num_kv_heads={m.num_kv_heads} must divide model.num_heads={m.num_heads}",
        )
    _require(0 <= m.dropout < 1, f"model.dropout={m.dropout} must be in [0, 1)")
    _require(
        t.seq_len <= m.max_seq_len,
        f"train.seq_len={t.seq_len} exceeds model.max_seq_len={m.max_seq_len}; lower one or raise the other",
    )

    _validate_data(run)
    _choice("optimizer.name", run.optimizer.name, ("adamw", "adam", "sgd"))
    _require(len(run.optimizer.betas) == 2, f"optimizer.betas={run.optimizer.betas} needs two values")
    _choice("precision.name", run.precision.name, ("fp32", "bf16", "fp16"))
    _choice("logger.name", run.logger.name, ("wandb", "none"))
    _choice("logger.mode", run.logger.mode, ("auto", "online", "offline"))
    _require(run.logger.init_timeout_s > 0, f"logger.init_timeout_s={run.logger.init_timeout_s} must be > 0")
    _require(run.telemetry.warmup_steps >= 0, f"telemetry.warmup_steps={run.telemetry.warmup_steps} must be >= 0")
    _require(run.runtime.timeout_s > 0, f"runtime.timeout_s={run.runtime.timeout_s} must be > 0")
    _validate_checkpoint(run.checkpoint)


def _validate_checkpoint(c: CheckpointConfig) -> None:
    from dist_train.checkpoint.layout import resolve_resume

    _require(c.every_steps >= 0, f"checkpoint.every_steps={c.every_steps} must be >= 0 (0 = never save)")
    _require(c.keep_last >= 0, f"checkpoint.keep_last={c.keep_last} must be >= 0 (0 = keep all)")
    _require(bool(c.resume), "checkpoint.resume is empty; allowed: auto, none, or a checkpoint path")
    if c.resume not in ("auto", "none"):
        try:
            resolve_resume(c.resume, default_root=None)
        except ValueError as exc:
            raise ConfigError(str(exc)) from exc


def _validate_data(run: RunConfig) -> None:
    d = run.data
    _choice("data.name", d.name, ("synthetic", "textfile"))
    if d.name == "synthetic":
        _require(0 <= d.noise <= 1, f"data.noise={d.noise} must be in [0, 1]")
        return
    _require(bool(d.path), "data=textfile needs data.path=/path/to/file.txt (a local text file)")
    _require(os.path.isfile(d.path), f"data.path={d.path!r} is not a readable file")
    size = os.path.getsize(d.path)
    need = run.train.seq_len + 1
    _require(size >= need, f"data.path={d.path!r} has {size} bytes; train.seq_len={run.train.seq_len} needs >= {need}")
    _require(
        run.model.vocab_size >= 256,
        f"data=textfile uses a byte-level tokenizer (256 tokens) but model.vocab_size={run.model.vocab_size}; "
        "set model.vocab_size>=256",
    )
