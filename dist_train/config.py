"""Typed run configuration: Hydra ConfigStore schemas plus the checks that run before any process starts.

Values live in YAML groups under ``conf/``; the dataclasses here give them types (Hydra rejects a
string where an int belongs) and :func:`validate` rejects combinations no single field can judge
(a batch that does not divide, ``dp`` under several processes). Every check raises
:class:`ConfigError` with one line naming the key and what is allowed.
"""

from __future__ import annotations

import dataclasses

import importlib.util
import os
from dataclasses import dataclass, field
from typing import Any, ClassVar, Optional

from omegaconf import MISSING

from dist_train.errors import ConfigError, require
from dist_train.parallel_dims import ParallelDims


def importable(module: str) -> bool:
    """Whether `import module` can work, without importing it (deepspeed's import costs seconds)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # ValueError: sys.modules[module] is None (import blocked)
        return False


def choice(key: str, value: str, allowed: tuple[str, ...]) -> None:
    require(value in allowed, f"{key}={value!r} is not supported; allowed: {', '.join(allowed)}")


# train.activation_checkpointing's modes (TrainConfig), and the booleans it took before them.
CHECKPOINTING = ("none", "full", "selective")
_CHECKPOINTING_ALIASES = {"true": "full", "false": "none"}


def _validate_experts(m: "ModelConfig") -> None:
    """An MoE model's sizes: top-k within the experts, and the 16-byte strides torch's grouped matrix product needs."""
    if not m.num_experts:
        return
    choice("model.experts_implementation", m.experts_implementation, EXPERTS_IMPLEMENTATIONS)
    require(1 <= m.experts_per_token <= m.num_experts,
            f"model.experts_per_token={m.experts_per_token} must be between 1 and model.num_experts={m.num_experts}")
    width = m.moe_ffn_hidden_size or m.ffn_hidden_size or 4 * m.hidden_size
    if m.experts_implementation == "grouped_mm":
        require(m.hidden_size % 8 == 0 and width % 8 == 0,
                f"model.experts_implementation=grouped_mm needs model.hidden_size ({m.hidden_size}) and the experts' "
                f"width ({width}) to be multiples of 8 (torch's grouped matrix product takes 16-byte strides); "
                "use model.experts_implementation=eager, or sizes that are")


def checkpointing_mode(value: Any, key: str = "train.activation_checkpointing") -> str:
    """train.activation_checkpointing as one of CHECKPOINTING: true and false (a bool, a YAML string of one, or the
    "True" OmegaConf makes of a bool given to the string field) are full and none. Torch-free: the estimator reads
    a run's config.yaml, old ones with a bool, through it."""
    text = str(value).strip().lower()
    mode = _CHECKPOINTING_ALIASES.get(text, text)
    require(mode in CHECKPOINTING, f"{key}={value!r} is not supported; allowed: "
                                   f"{', '.join(CHECKPOINTING)} (true = full, false = none)")
    return mode


# --------------------------------------------------------------------------------------------------
# Strategies. The base of every strategy schema; each family's schema lives in its own module under
# dist_train/strategies/ (see strategies/registry.py), the YAML files in conf/strategy/ pick one and set `name`.
# `parallel_dims` states the strategy's degrees; every batch and mesh question is answered from them.
# --------------------------------------------------------------------------------------------------


@dataclass
class StrategyConfig:
    name: str = MISSING
    # Traits of a family: class attributes, not config fields.
    # Tensor parallelism splits the projections themselves into DTensor shards (tp, fsdp_tp): LoRA's layers
    # cannot sit on them, and no optimizer sees a whole tensor.
    splits_projections: ClassVar[bool] = False
    # train.compile: blocks compiled before this strategy wraps them train as eager ones (tested).
    compiles_blocks: ClassVar[bool] = False
    # Activation checkpointing and train.compile are applied by the strategy itself, in dist_train.parallel.apply's
    # fixed order (tensor parallelism, checkpointing, compile, FSDP2), not as model transforms before it wraps.
    transforms_in_parallelize: ClassVar[bool] = False
    # peft=qlora: the packed 4-bit weights and their scales stay whole on every rank (nothing shards or splits
    # a parameter), and it is tested.
    keeps_packed_weights: ClassVar[bool] = False
    # The model is built without weights (the strategy's `empty_model_context()`: the meta device, or zero.Init),
    # sharded or split by this strategy, then each rank fills only what it holds, from a model directory's files
    # or the seeded random init (weights.materialize): set-up never holds the whole model.
    loads_own_shard: ClassVar[bool] = False

    @property
    def needs_process_group(self) -> bool:
        return True

    @property
    def checkpoint_format(self) -> str:
        """The checkpoint format this strategy writes and reads (torch.distributed.checkpoint by default)."""
        return "dcp"

    @property
    def optimizer_sees_whole_tensors(self) -> bool:
        """Whether the optimizer updates whole parameter tensors (False: shards or DTensors, as FSDP, ZeRO and
        tensor parallelism hand it); optimizers in WHOLE_TENSOR_OPTIMIZERS need True."""
        return not self.splits_projections

    @property
    def supports_lora(self) -> bool:
        """Whether LoRA adapters can sit on the layers this strategy wraps (not on tensor-parallel shards)."""
        return not self.splits_projections

    @property
    def updates_in_backward(self) -> bool:
        """Whether an optimizer may update each parameter inside backward (LOMO): one process, one replica,
        no gradient to reduce first."""
        return False

    def parallel_dims(self, world_size: int) -> ParallelDims:
        """This strategy's degrees on `world_size` processes (dist_train/parallel_dims.py): by default every rank a
        whole replica (DDP). Families that shard, split or pipeline override it; nothing else computes degrees."""
        return ParallelDims(world_size, dp_replicate=world_size)

    # The questions every caller asks, answered by the degrees.
    def data_parallel_size(self, world_size: int) -> int:
        return self.parallel_dims(world_size).data_parallel

    def data_parallel_rank(self, rank: int, world_size: int) -> int:
        """Which slice of the global batch `rank` trains on (ranks of one model replica share a slice)."""
        return self.parallel_dims(world_size).data_parallel_rank(rank)

    def check(self, world_size: int) -> None:
        """Strategy-specific checks; world_size is the number of processes that will run."""

    def microbatches_per_step(self, train: "TrainConfig", world_size: int) -> int:
        """Micro-batches each rank runs per optimizer step (gradient accumulation)."""
        return self.parallel_dims(world_size).microbatches(global_batch_size=train.global_batch_size,
                                                           micro_batch_size=train.micro_batch_size)

    def check_run(self, run: "RunConfig", world_size: int) -> None:
        """Checks that also need the model/train values; by default, that the global batch splits evenly."""
        self.parallel_dims(world_size).check_batch(global_batch_size=run.train.global_batch_size,
                                                   micro_batch_size=run.train.micro_batch_size)


# --------------------------------------------------------------------------------------------------
# The other groups.
# --------------------------------------------------------------------------------------------------

MODEL_ARCHS = ("gpt2", "llama", "qwen3_moe")
# transformers' implementations of a layer of stacked experts (its ExpertsInterface): pinned by
# model.experts_implementation so that every strategy runs the same arithmetic (transformers' own default, grouped_mm where it can dispatch, is not
# eager's, and it needs 16-byte strides)
EXPERTS_IMPLEMENTATIONS = ("eager", "grouped_mm", "batched_mm")


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
    # Not GPT-2 (whose projections all have biases), set from a directory's config.json: the width of one attention
    # head where the architecture sets its own (Qwen3, Gemma; None = hidden_size / num_heads), biases on the q, k and
    # v projections (Qwen2's, or attention_bias), on attention's output projection (attention_bias) and on the MLP's
    # (mlp_bias), and an RMSNorm of head_dim on each query and key head (Qwen3's q_norm, k_norm).
    head_dim: Optional[int] = None
    qkv_bias: bool = False
    out_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    vocab_size: int = 256
    max_seq_len: int = 128
    tie_embeddings: bool = False
    dropout: float = 0.0
    # Mixture-of-Experts (Qwen3-MoE, Mixtral, OLMoE: transformers' stacked experts; 0 = a dense model): experts per
    # MoE layer, experts each token is routed to, each expert's MLP width (None: ffn_hidden_size), which layers are
    # MoE (None: every one; a directory's decoder_sparse_step / mlp_only_layers), a shared expert's width (Qwen2-MoE),
    # and the experts' implementation, the same under every strategy
    num_experts: int = 0
    experts_per_token: int = 0
    moe_ffn_hidden_size: Optional[int] = None
    moe_layers: Optional[list[int]] = None
    shared_expert_ffn_hidden_size: Optional[int] = None
    experts_implementation: str = "eager"
    # model=hf: a local transformers model directory (config.json, and weights if any); its config.json fills
    # the fields above (dist_train/pretrained.py). None: a preset built from the fields above.
    path: Optional[str] = None
    # pretrained | random; None: pretrained when the directory holds weights, else random.
    init: Optional[str] = None
    # Run modelling code shipped with the directory (config.json's auto_map): only for code you trust.
    trust_remote_code: bool = False


@dataclass
class TrainConfig:
    seq_len: int = 64
    # Samples per optimizer step, over all ranks. None (the default): micro_batch_size x the number of processes,
    # so the same command runs at any world size, pipeline or TP degree, and every strategy launched with N
    # processes trains the same samples (a strategy with fewer data-parallel replicas than processes, such as
    # tp or a pipeline, accumulates or pipelines the rest). Given explicitly, it must divide evenly.
    global_batch_size: Optional[int] = None
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
    # none: keep every block's activations for backward; full: keep each block's input and recompute the block in
    # backward; selective: keep what its matrix products and attention produce and recompute the rest (norms,
    # activations, residuals, casts), torchtitan's per-op policy. true and false are full and none.
    activation_checkpointing: str = "none"
    # Checkpoint every k-th block only (blocks k, 2k, ... counted from 1, as torchtitan's layer-frequency option), the
    # others keep all their activations; 1 = every block. Applies to full and selective.
    checkpoint_every: int = 1
    # torch.compile each transformer block (after checkpointing, before the strategy wraps it, as torchtitan).
    compile: bool = False
    # NEFTune (Jain et al. 2023): uniform noise of scale alpha / sqrt(seq_len * hidden) on the token embeddings
    # in training, none in evaluation; 0 = off (the paper uses 5-15).
    neftune_alpha: float = 0.0


@dataclass
class DataConfig:
    name: str = "synthetic"
    path: Optional[str] = None
    # data=tokens: uint16 | uint32; None = the dtype in the file's JSON beside it, else uint16 (nanoGPT's)
    dtype: Optional[str] = None
    # synthetic: probability that a token of a learnable sequence is replaced by a random one.
    noise: float = 0.1
    # Build the next step's batch in a background thread (pinned host memory on CUDA); the same samples.
    prefetch: bool = True


@dataclass
class EvalConfig:
    """Evaluation on held-out data: the loss (and perplexity) of `batches` global batches, forward only, every
    `every_steps` optimizer steps and after the last; the same batches every time and under every strategy."""

    every_steps: int = 0  # 0 = never
    batches: int = 2  # global batches of train.global_batch_size samples
    # A text or token file of the same kind as data.path to evaluate on. None: a held-out split of the training
    # data: a file's last `holdout` fraction (training then reads only the rest), or synthetic data's own stream.
    path: Optional[str] = None
    holdout: float = 0.05


@dataclass
class PeftConfig:
    """Parameter-efficient fine-tuning: `lora` freezes the model and trains low-rank adapters (peft)."""

    name: str = "none"  # none | lora | qlora (LoRA over a 4-bit base model, bitsandbytes, CUDA only)
    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    # module names to adapt; None: every attention and MLP projection of the architecture
    target_modules: Optional[list[str]] = None
    # qlora: how the frozen projections are stored, bitsandbytes' 4-bit NormalFloat or float (nf4 | fp4)
    quant_type: str = "nf4"


@dataclass
class OptimizerConfig:
    name: str = "adamw"
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    weight_decay: float = 0.0
    momentum: float = 0.0


# optimizer.name: torch's AdamW, Adam, SGD and Adafactor; Lion (lion-pytorch); 8-bit AdamW (bitsandbytes);
# LOMO (SGD fused into backward, dist_train.optim.LOMO).
OPTIMIZERS = ("adamw", "adam", "sgd", "adafactor", "lion", "adam8bit", "lomo")
# Optimizers whose update of a tensor depends on more than its elements one by one (Adafactor factors a
# matrix's second moment by rows and columns, 8-bit Adam quantizes blocks of 256): on a strategy that hands
# the optimizer shards instead of whole tensors they would train differently from one process.
WHOLE_TENSOR_OPTIMIZERS = ("adafactor", "adam8bit")


# precision.name -> (torch dtype name, bytes per element): the project's one dtype table.
PRECISIONS: dict[str, tuple[str, int]] = {"fp32": ("float32", 4), "bf16": ("bfloat16", 2), "fp16": ("float16", 2)}


@dataclass
class PrecisionConfig:
    name: str = "fp32"

    @property
    def mixed(self) -> bool:
        """16-bit compute (bf16/fp16) over fp32 master weights; fp32 runs as is."""
        return self.name != "fp32"

    @property
    def loss_scaling(self) -> bool:
        """fp16 needs a loss scaler (bf16 has fp32's range)."""
        return self.name == "fp16"

    @property
    def dtype(self) -> Any:
        """The compute dtype (torch.float32 / bfloat16 / float16)."""
        import torch

        return getattr(torch, PRECISIONS[self.name][0])

    @property
    def element_bytes(self) -> int:
        return PRECISIONS[self.name][1]


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
    # Every third-party warning, each time it is raised (default: a repeated one is shown once, then counted, and
    # the run's end names it with its count; dist_train/quiet.py).
    verbose: bool = False


@dataclass
class TelemetryConfig:
    # Steps left out of summary.json's steady figures, mean step time and per-rank means (lazy init, DDP
    # bucket rebuild, ZeRO-3's trace, ...); they are logged as a window of their own.
    warmup_steps: int = 1
    # Peak FLOP/s of one device for MFU; None = looked up from the GPU name (unknown on CPU: no mfu).
    peak_flops: Optional[float] = None
    # Count and time collectives.
    comm: bool = True
    # Track the bytes autograd saves for backward (memory/activations_bytes).
    activations: bool = True
    # The peak of all live tensors, what decides out-of-memory (memory/peak_live_bytes). On the CPU torch's
    # MemTracker follows one step, with what the peak was made of (memory/peak_live/<category>_bytes); that step
    # runs several times slower and is added to the warm-up steps. On CUDA it is the allocator's peak, at no cost.
    peak_live: bool = True
    # An MoE model's load: tokens per expert, MaxVio, dead experts per layer, EP overload (telemetry/moe.py); one
    # bincount per MoE layer and micro-batch on the device. Not under strategy=dp, nor under train.compile without
    # expert parallelism (its hook would break the compiled blocks' graphs where the experts run).
    moe_load: bool = True


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
    # On Ctrl-C or SIGTERM (Slurm's time limit, pre-emption), save the step every rank stopped after, even with
    # every_steps=0, so that the run can resume; false: stop without saving.
    save_on_signal: bool = True


@dataclass
class RuntimeConfig:
    # Seconds a collective waits for its peers before the process group gives up: how long a hung or lost
    # rank can hold the job.
    timeout_s: float = 600.0
    # auto: one CUDA GPU per local process where GPUs are visible (NCCL), else the CPU (gloo); cpu: the CPU even
    # on a GPU machine; cuda: refuse to start without a GPU.
    device: str = "auto"
    # After Ctrl-C or SIGTERM, how long a rank may take to reach the step every rank stops after and save it before
    # it exits anyway (a rank stuck outside a step would ignore torchrun's SIGTERM); torchrun and Slurm (KillWait)
    # give 30 s before SIGKILL.
    stop_grace_s: float = 20.0


@dataclass
class RunConfig:
    strategy: Any = MISSING
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    peft: PeftConfig = field(default_factory=PeftConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    telemetry: TelemetryConfig = field(default_factory=TelemetryConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)


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


def default_global_batch(train: TrainConfig, world_size: int) -> int:
    """What train.global_batch_size=null means: one micro-batch per process and step."""
    return train.micro_batch_size * world_size


def resolve_global_batch(run: RunConfig, world_size: int) -> None:
    """Fill train.global_batch_size when it is null (see TrainConfig)."""
    if run.train.global_batch_size is None:
        run.train.global_batch_size = default_global_batch(run.train, world_size)


def describe_batch(run: RunConfig, world_size: int) -> str:
    """The batch this run trains and how it is split, as its first log line and `--check-config` say it:
    `global_batch=16 = micro_batch 2 x accumulation 1 x data_parallel 8` (ddp on 8), then what splits each
    replica's model over the remaining processes: `global_batch=4 = micro_batch 2 x accumulation 2 x
    data_parallel 1 | tensor_parallel 2` (tp on 2). A pipeline's micro-batches are its schedule's, not
    accumulation: `micro_batch 2 x pipeline_microbatches 4 x data_parallel 1 | pipeline_stages 2` (gpipe on 2),
    with the micro-batch the schedule really feeds (strategy.num_microbatches may set it). HSDP's data
    parallelism says its two factors: `data_parallel 4 (replicas 2 x shards 2)`."""
    t, s = run.train, run.strategy
    dims = s.parallel_dims(world_size)
    dp, micro = dims.data_parallel, accumulation_steps(run, world_size)
    pipelined = dims.pp > 1 or hasattr(s, "num_stages")  # the pipeline family (config.py cannot import strategies/)
    size = dims.samples_per_replica(t.global_batch_size) // micro if pipelined and micro else t.micro_batch_size
    how = "pipeline_microbatches" if pipelined else "accumulation"
    hybrid = f" (replicas {dims.dp_replicate} x shards {dims.dp_shard})" if min(dims.dp_replicate, dims.dp_shard) > 1 else ""
    split = _model_split(s, dims)
    return (f"global_batch={t.global_batch_size} = micro_batch {size} x {how} {micro} x data_parallel {dp}{hybrid}"
            + (f" | {split}" if split else ""))


def _model_split(strategy: "StrategyConfig", dims: ParallelDims) -> str:
    """What splits one replica's model, by the strategy's degrees: its pipeline stages, its tensor-parallel degree,
    nn.DataParallel's split of each micro-batch; "" for none."""
    parts = [f"pipeline_stages {dims.pp}"] if dims.pp > 1 or hasattr(strategy, "num_stages") else []
    if dims.tp > 1 or "tp" in dims.mesh_dim_names:
        parts.append(f"tensor_parallel {dims.tp}")
    if hasattr(strategy, "device_ids"):  # nn.DataParallel: one process, its GPUs share each micro-batch
        n = None if strategy.device_ids is None else len(strategy.device_ids)
        parts.append("nn.DataParallel over every visible GPU" if n is None else f"nn.DataParallel over {n} GPU(s)")
    return " x ".join(parts)


def accumulation_steps(run: RunConfig, world_size: int) -> int:
    """Micro-batches each rank runs per optimizer step."""
    return run.strategy.microbatches_per_step(run.train, world_size)


def validate_fields(run: RunConfig) -> None:
    """The checks that do not depend on the number of processes (the estimator and compare run these too)."""
    require(isinstance(run.strategy, StrategyConfig), "strategy is not set; pick one with strategy=<name>")
    t, m = run.train, run.model
    for key in ("steps", "seq_len", "global_batch_size", "micro_batch_size", "log_every", "checkpoint_every"):
        value = getattr(t, key)
        require(value is None and key == "global_batch_size" or value >= 1, f"train.{key}={value} must be >= 1")
    require(t.lr > 0, f"train.lr={t.lr} must be > 0")
    require(t.grad_clip >= 0, f"train.grad_clip={t.grad_clip} must be >= 0 (0 disables clipping)")
    require(t.neftune_alpha >= 0, f"train.neftune_alpha={t.neftune_alpha} must be >= 0 (0 = off)")
    choice("train.lr_schedule", t.lr_schedule, ("constant", "cosine"))
    t.activation_checkpointing = checkpointing_mode(t.activation_checkpointing)  # normalised: true -> full
    require(t.lr_warmup_steps >= 0, f"train.lr_warmup_steps={t.lr_warmup_steps} must be >= 0")
    require(0 <= t.min_lr_ratio <= 1, f"train.min_lr_ratio={t.min_lr_ratio} must be in [0, 1]")

    if m.path is None:  # a directory's config.json names any architecture transformers builds
        choice("model.arch", m.arch, MODEL_ARCHS)
    for key in ("num_layers", "hidden_size", "num_heads", "vocab_size", "max_seq_len"):
        value = getattr(m, key)
        require(value >= 1, f"model.{key}={value} must be >= 1")
    require(  # a directory's architecture may set its own head width (Qwen3, Gemma): then any hidden size
        m.head_dim is not None or m.hidden_size % m.num_heads == 0,
        f"model.hidden_size={m.hidden_size} must be divisible by model.num_heads={m.num_heads}",
    )
    if m.num_kv_heads is not None:
        require(
            m.num_kv_heads >= 1 and m.num_heads % m.num_kv_heads == 0,
            f"model.num_kv_heads={m.num_kv_heads} must divide model.num_heads={m.num_heads}",
        )
    require(0 <= m.dropout < 1, f"model.dropout={m.dropout} must be in [0, 1)")
    _validate_experts(m)
    require(
        t.seq_len <= m.max_seq_len,
        f"train.seq_len={t.seq_len} exceeds model.max_seq_len={m.max_seq_len}; lower one or raise the other",
    )

    choice("optimizer.name", run.optimizer.name, OPTIMIZERS)
    _validate_peft(run.peft)
    require(len(run.optimizer.betas) == 2, f"optimizer.betas={run.optimizer.betas} needs two values")
    choice("precision.name", run.precision.name, tuple(PRECISIONS))
    choice("logger.name", run.logger.name, ("wandb", "none"))
    choice("logger.mode", run.logger.mode, ("auto", "online", "offline"))
    require(run.logger.init_timeout_s > 0, f"logger.init_timeout_s={run.logger.init_timeout_s} must be > 0")
    require(run.telemetry.warmup_steps >= 0, f"telemetry.warmup_steps={run.telemetry.warmup_steps} must be >= 0")
    require(run.runtime.timeout_s > 0, f"runtime.timeout_s={run.runtime.timeout_s} must be > 0")
    require(run.runtime.stop_grace_s > 0, f"runtime.stop_grace_s={run.runtime.stop_grace_s} must be > 0")
    choice("runtime.device", run.runtime.device, ("auto", "cuda", "cpu"))
    _validate_checkpoint(run.checkpoint)


def _validate_peft(p: PeftConfig) -> None:
    choice("peft.name", p.name, ("none", "lora", "qlora"))
    if p.name == "none":
        for f in dataclasses.fields(p):  # a key only the adapters read is not ignored silently
            value = getattr(p, f.name)
            require(f.name == "name" or value == getattr(PeftConfig(), f.name),
                    f"peft.{f.name}={value} is set but peft=none trains the whole model; pick peft=lora or peft=qlora")
        return
    if p.name == "lora":
        require(p.quant_type == PeftConfig.quant_type, f"peft.quant_type={p.quant_type} is read only by peft=qlora "
                                                       "(LoRA over a 4-bit base); pick peft=qlora")
    require(importable("peft"), f"peft={p.name} needs the peft package (pip install peft)")
    if p.name == "qlora":
        choice("peft.quant_type", p.quant_type, ("nf4", "fp4"))
        require(importable("bitsandbytes"), "peft=qlora needs the bitsandbytes package (pip install bitsandbytes)")
    require(p.rank >= 1, f"peft.rank={p.rank} must be >= 1")
    require(p.alpha > 0, f"peft.alpha={p.alpha} must be > 0")
    require(0 <= p.dropout < 1, f"peft.dropout={p.dropout} must be in [0, 1)")


def _validate_checkpoint(c: CheckpointConfig) -> None:
    """The values alone; whether checkpoint.resume names a checkpoint is checked by dist_train.checks."""
    require(c.every_steps >= 0, f"checkpoint.every_steps={c.every_steps} must be >= 0 (0 = never save)")
    require(c.keep_last >= 0, f"checkpoint.keep_last={c.keep_last} must be >= 0 (0 = keep all)")
    require(bool(c.resume), "checkpoint.resume is empty; allowed: auto, none, or a checkpoint path")
