"""Per-rank memory by category: model state (ZeRO paper) plus activations and the KV cache.

Model state (Rajbhandari et al. 2020, "ZeRO", section 3.1): with Ψ parameters and N data-parallel ranks,
a replica holds weights, gradients, (master weights) and optimizer state; ZeRO-1 shards the optimizer
state (with the master copy) over N, ZeRO-2 the gradients too, ZeRO-3 and FSDP the weights as well. A
pipeline with K stages holds, on each stage, the model state of that stage's parameters only.

Activations (Korthikanti et al. 2022, "Reducing Activation Recomputation", eq. 1): per transformer layer
s·b·h·(34 + 5·a·s/h) bytes for 16-bit activations with dropout. It counts 16 saved values of s·b·h
(2 bytes each), two 1-byte dropout masks of s·b·h, and 2.5 bytes per attention score (softmax output,
dropout mask, dropout output). Generalised here: the element size e is 4 in fp32, masks only when
dropout > 0, the MLP and q/k/v sizes follow the model (GPT-2's unfused tanh GELU keeps 5 ffn-wide
tensors where Korthikanti's fused GELU keeps 2, SwiGLU keeps 4, GQA has smaller k/v), and attention scores only when they are materialised: with SDPA / flash attention (what
`transformers` uses by default) only the output and log-sum-exp are kept, so the a·s² term is dropped.
Full activation checkpointing keeps each layer's input (s·b·h·e) plus one layer's activations while it
is recomputed. The LM head adds its input and the fp32 log-softmax of the logits (s·b·V·4).
"""

from __future__ import annotations

from dataclasses import dataclass

from dist_train.estimate.setup import Setup
from dist_train.estimate.shapes import ModelShape, stage_layers, stage_params

_ELEMENT_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


def element_bytes(precision: str) -> int:
    if precision not in _ELEMENT_BYTES:
        raise ValueError(f"precision={precision!r} unknown; allowed: {', '.join(_ELEMENT_BYTES)}")
    return _ELEMENT_BYTES[precision]


@dataclass(frozen=True)
class StateBytes:
    """Bytes per parameter of each model-state category on a replica (before any sharding)."""

    weights: float
    grads: float
    master: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.weights + self.grads + self.master + self.optimizer


def optimizer_state_count(optimizer: str, *, momentum: float = 0.0) -> int:
    """State tensors per parameter: Adam/AdamW two moments, SGD one momentum buffer (none without)."""
    if optimizer in ("adam", "adamw"):
        return 2
    if optimizer == "sgd":
        return 1 if momentum else 0
    raise ValueError(f"optimizer={optimizer!r} unknown; allowed: adam, adamw, sgd")


def state_bytes(*, precision: str, optimizer: str, momentum: float = 0.0, regime: str) -> StateBytes:
    """Bytes per parameter for `regime` (see setup.REGIMES; `auto` must be resolved first)."""
    p = element_bytes(precision)
    states = optimizer_state_count(optimizer, momentum=momentum)
    if regime == "autocast":
        return StateBytes(weights=4, grads=4, master=0, optimizer=4 * states)
    if regime == "mixed":
        return StateBytes(weights=p, grads=p, master=4 if p < 4 else 0, optimizer=4 * states)
    if regime == "deepspeed":
        return StateBytes(weights=p, grads=p, master=4, optimizer=4 * states)
    if regime == "pure":
        return StateBytes(weights=p, grads=p, master=0, optimizer=p * states)
    raise ValueError(f"regime={regime!r} cannot be used here; resolve `auto` with Setup.resolved_regime")


@dataclass(frozen=True)
class Shards:
    """Over how many ranks each category is split (1 = replicated)."""

    weights: int
    grads: int
    optimizer: int  # optimizer state and master weights together (ZeRO's P_os)


def shards(setup: Setup) -> Shards:
    n = setup.data_parallel_size
    if setup.family == "zero":
        s = setup.zero_stage
        return Shards(weights=n if s >= 3 else 1, grads=n if s >= 2 else 1, optimizer=n)
    if setup.family == "fsdp":
        return Shards(weights=n, grads=n, optimizer=n)
    return Shards(weights=1, grads=1, optimizer=1)


@dataclass(frozen=True)
class RankMemory:
    """Predicted bytes one rank holds, by category."""

    params: float
    grads: float
    master: float
    optimizer: float
    activations: float = 0.0

    @property
    def model_state(self) -> float:
        return self.params + self.grads + self.master + self.optimizer

    @property
    def total(self) -> float:
        return self.model_state + self.activations


def model_state_bytes(num_params: float, setup: Setup) -> RankMemory:
    """Model state of `num_params` parameters on one rank (all of them, or a pipeline stage's)."""
    b = state_bytes(
        precision=setup.precision, optimizer=setup.optimizer, momentum=setup.momentum, regime=setup.resolved_regime
    )
    sh = shards(setup)
    return RankMemory(
        params=num_params * b.weights / sh.weights,
        grads=num_params * b.grads / sh.grads,
        master=num_params * b.master / sh.optimizer,
        optimizer=num_params * b.optimizer / sh.optimizer,
    )


def predict_memory(shape: ModelShape, setup: Setup) -> list[RankMemory]:
    """One entry per rank: model state plus activations of the micro-batches alive at the peak."""
    if setup.family != "pipeline":
        state = model_state_bytes(shape.num_params, setup)
        act = activation_bytes(shape, setup=setup, num_layers=shape.num_layers, with_head=True, in_flight=1)
        one = RankMemory(state.params, state.grads, state.master, state.optimizer, act)
        return [one] * setup.world_size
    k = setup.num_stages
    split = list(setup.split_points) if setup.split_points else None
    params = stage_params(shape, num_stages=k, split_points=split)
    layers = stage_layers(shape, num_stages=k, split_points=split)
    out = []
    for stage in range(k):
        state = model_state_bytes(params[stage], setup)
        act = activation_bytes(
            shape, setup=setup, num_layers=layers[stage], with_head=stage == k - 1,
            in_flight=pipeline_in_flight(setup, stage=stage),
        )
        out.append(RankMemory(state.params, state.grads, state.master, state.optimizer, act))
    return out


def pipeline_in_flight(setup: Setup, *, stage: int) -> int:
    """Micro-batches whose activations a stage holds at its peak: GPipe all M, 1F1B at most K - stage."""
    m = setup.microbatches_per_step
    if setup.schedule == "1f1b":
        return min(setup.num_stages - stage, m)
    return m


def layer_activation_bytes(shape: ModelShape, *, micro_batch_size: int, seq_len: int, elem: int,
                           attention_scores: bool = False, fused_gelu: bool = False) -> float:
    """Bytes one transformer layer saves for backward for one micro-batch (see the module docstring).

    attention_scores: eager attention keeps the a·s² scores; fused_gelu: a GELU that saves only its input
    (Korthikanti's assumption) instead of transformers' composed tanh GELU."""
    s, b, h = seq_len, micro_batch_size, shape.hidden_size
    q_k_v = h + 2 * shape.kv_dim
    # GPT-2: fc output, GELU output, and 3 more ffn-wide tensors that transformers' tanh GELU ("gelu_new",
    # composed of pow/tanh/mul ops, not fused) saves: tanh output, 0.5·x and 1 + tanh.
    # Llama (SwiGLU): gate output, SiLU output, up output, their product.
    mlp = (2 if fused_gelu else 5) * shape.ffn if shape.arch == "gpt2" else 4 * shape.ffn
    # norm1 in, attention in, q/k/v, attention out, norm2 in, MLP in, MLP intermediates
    values = h + h + q_k_v + h + h + h + mlp
    masks = 2 * h if shape.dropout > 0 else 0  # attention-output and MLP-output dropout (1 byte each)
    per_token = values * elem + masks
    scores = 0.0
    if attention_scores:  # eager attention: softmax output (+ dropout mask and output)
        scores = shape.num_heads * s * s * b * ((2 * elem + 1) if shape.dropout > 0 else elem)
    return s * b * per_token + scores


def activation_bytes(shape: ModelShape, *, setup: Setup, num_layers: int, with_head: bool, in_flight: int) -> float:
    """Activations a rank holds at its peak: `in_flight` micro-batches through `num_layers` layers."""
    elem = element_bytes(setup.precision)
    s, b = setup.seq_len, setup.micro_batch_size
    layer = layer_activation_bytes(shape, micro_batch_size=b, seq_len=s, elem=elem)
    head = s * b * (2 * shape.hidden_size * elem + shape.vocab_size * 4) if with_head else 0.0
    if setup.activation_checkpointing:
        # each micro-batch keeps its layer inputs; one layer at a time is recomputed in full
        return in_flight * (num_layers * s * b * shape.hidden_size * elem + head) + layer
    return in_flight * (num_layers * layer + head)


def kv_cache_bytes(shape: ModelShape, *, batch: int, context: int, elem: int) -> float:
    """2 (K and V) x batch x layers x kv_heads x head_dim x context x bytes; kv_heads = heads without GQA."""
    return 2 * batch * shape.num_layers * shape.kv_heads * shape.head_dim * context * elem
