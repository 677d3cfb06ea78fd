"""Model shapes and their parameter counts, computed from the config (no model is built).

The counts reproduce what `transformers` builds for `dist_train.model` (GPT-2 with biases and learned
positions; Llama without biases, SwiGLU MLP, grouped-query attention), so a prediction for `model=tiny`
uses the same Ψ as the run, and a 70B shape costs no memory to describe. A model directory's Llama-like
architectures (mistral, qwen2, qwen3, gemma: RMSNorm, a gated 3-matrix MLP) are counted as Llama with what
their config.json sets: a head_dim of their own, biases (Qwen2's on q, k and v), per-head q/k norms (Qwen3).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from dist_train.architectures import BlockFeatures, block_features
from dist_train.config import ModelConfig


class ExpertDims(tuple):
    """The shape of an experts module's tensor that is not a 3-D stack (GPT-OSS's per-expert biases, E x n): one row
    per expert, split by expert parallelism with the stacks, which `ModelShape.is_experts` tells by this type (an
    E x h bias has the router's shape)."""


@dataclass(frozen=True)
class ModelShape:
    name: str
    arch: str  # transformers' model_type (the presets', a model directory's); its blocks' features: `features`
    num_layers: int
    hidden_size: int
    num_heads: int
    vocab_size: int
    max_seq_len: int
    num_kv_heads: Optional[int] = None  # None: num_heads (no grouped-query attention)
    ffn_hidden_size: Optional[int] = None  # None: 4 * hidden_size
    tie_embeddings: bool = False
    dropout: float = 0.0
    # Not GPT-2 (see ModelConfig): model.head_dim (None: hidden_size // num_heads), the projections' biases, and
    # an RMSNorm of head_dim on each query and key head
    head_size: Optional[int] = None
    qkv_bias: bool = False
    out_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    # Mixture-of-Experts (ModelConfig's fields): experts per layer (0 = dense), top-k, each expert's width (None: ffn)
    num_experts: int = 0
    experts_per_token: int = 0
    moe_ffn_hidden_size: Optional[int] = None
    experts_implementation: str = "eager"  # model.experts_implementation: how the experts' products run
    shared_expert_ffn_hidden_size: Optional[int] = None  # Qwen2-MoE's shared expert: a gated MLP every token takes

    def __post_init__(self) -> None:
        if self.num_experts and self.features.biased_projections:
            raise ValueError(f"model.arch={self.arch}: experts are counted for Llama-like blocks only")

    @classmethod
    def from_config(cls, model: Any) -> "ModelShape":
        """From a ModelConfig, a DictConfig or a plain dict of the `model` group."""
        get = _getter(model)
        why = cls.unsupported(model)
        if why:
            raise ValueError(why)
        return cls(
            name=str(get("name", "model")), arch=str(get("arch", ModelConfig.arch)),
            num_layers=int(get("num_layers")), hidden_size=int(get("hidden_size")), num_heads=int(get("num_heads")),
            vocab_size=int(get("vocab_size")), max_seq_len=int(get("max_seq_len", 2048)),
            num_kv_heads=get("num_kv_heads"), ffn_hidden_size=get("ffn_hidden_size"),
            tie_embeddings=bool(get("tie_embeddings", False)), dropout=float(get("dropout", 0.0) or 0.0),
            head_size=get("head_dim"), qkv_bias=bool(get("qkv_bias", False)), out_bias=bool(get("out_bias", False)),
            mlp_bias=bool(get("mlp_bias", False)), qk_norm=bool(get("qk_norm", False)),
            num_experts=int(get("num_experts", 0) or 0), experts_per_token=int(get("experts_per_token", 0) or 0),
            moe_ffn_hidden_size=get("moe_ffn_hidden_size"),
            experts_implementation=str(get("experts_implementation", "eager") or "eager"),
            shared_expert_ffn_hidden_size=get("shared_expert_ffn_hidden_size") or None,
        )

    @staticmethod
    def unsupported(model: Any) -> Optional[str]:
        """Why the estimator cannot count `model` (a ModelConfig or its dict), or None: MoE models whose layers are
        not all MoE are not modelled yet."""
        get = _getter(model)
        if not get("num_experts", 0):
            return None
        if get("moe_layers") is not None:
            return (f"model {get('name', '')}: MoE layers {list(get('moe_layers'))} of {get('num_layers')} (dense MLP "
                    "layers between them) are not modelled yet; the estimator counts models whose every layer is MoE")
        return None

    @property
    def features(self) -> BlockFeatures:
        """What the blocks are made of (dist_train/architectures.py): the counts below read these, not the name."""
        return block_features(self.arch)

    # ------------------------------------------------------------------ derived sizes
    @property
    def head_dim(self) -> int:
        return self.head_size or self.hidden_size // self.num_heads

    @property
    def q_dim(self) -> int:
        """Width of the queries and of attention's output (hidden_size unless head_dim is set apart)."""
        return self.num_heads * self.head_dim

    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads or self.num_heads

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def ffn(self) -> int:
        return self.ffn_hidden_size or 4 * self.hidden_size

    @property
    def moe_ffn(self) -> int:
        """One expert's MLP width."""
        return self.moe_ffn_hidden_size or self.ffn

    @property
    def routed_ffn(self) -> int:
        """The MLP width one token passes through: its top-k experts' together in an MoE layer, else the MLP's."""
        return self.experts_per_token * self.moe_ffn if self.num_experts else self.ffn

    @property
    def params_per_expert(self) -> int:
        """One expert's gate, up and down projections, and their biases where it has them (GPT-OSS: 2I + h)."""
        biases = (2 * self.moe_ffn + self.hidden_size) if self.features.expert_biases else 0
        return 3 * self.hidden_size * self.moe_ffn + biases

    @property
    def expert_params(self) -> int:
        """Parameters of one layer's experts, all of them (transformers' stacked gate_up_proj and down_proj, and any
        biases)."""
        return self.num_experts * self.params_per_expert

    @property
    def expert_matmul_weights(self) -> int:
        """One layer's experts' matrices (E x 3 h I), their biases left out."""
        return self.num_experts * 3 * self.hidden_size * self.moe_ffn

    @property
    def router_weight(self) -> int:
        """One MoE layer's router's matrix (E x h); 0 for a dense model."""
        return self.num_experts * self.hidden_size

    @property
    def router_params(self) -> int:
        """One MoE layer's router: its matrix, and its bias where it has one (GPT-OSS); 0 for a dense model."""
        return self.router_weight + (self.num_experts if self.features.router_bias else 0)

    @property
    def shared_expert_params(self) -> int:
        """One MoE layer's shared expert (Qwen2-MoE's: gate, up and down projections S x h, and its 1 x h gate);
        0 without one. Dense: every token takes it, and nothing splits it by expert."""
        s = self.shared_expert_ffn_hidden_size or 0
        return 3 * self.hidden_size * s + self.hidden_size if s else 0

    @property
    def dense_params(self) -> int:
        """Everything but the experts: attention, norms, routers, embeddings, head."""
        return self.num_params - self.num_layers * self.expert_params

    @property
    def active_params(self) -> int:
        """Parameters one token passes through: the dense ones and its top-k experts' (the N of 6·N·tokens)."""
        if not self.num_experts:
            return self.num_params
        return self.dense_params + self.num_layers * self.experts_per_token * self.params_per_expert

    # ------------------------------------------------------------------ parameter counts
    def layer_modules(self) -> list[list[tuple[int, ...]]]:
        """One transformer layer's modules, each as its parameter tensors' shapes, in forward order
        (transformers' GPT-2 Conv1D stores in x out, nn.Linear out x in)."""
        h, f, q, kv = self.hidden_size, self.ffn, self.q_dim, self.kv_dim
        if self.features.biased_projections:  # GPT-2: LayerNorms (weight + bias), c_attn, c_proj, c_fc, c_proj
            ln = [(h,), (h,)]
            return [ln, [(h, 3 * h), (3 * h,)], [(h, h), (h,)], ln, [(h, f), (f,)], [(f, h), (h,)]]

        def linear(out: int, inp: int, bias: bool) -> list[tuple[int, ...]]:
            return [(out, inp), (out,)] if bias else [(out, inp)]

        qk_norm = [[(self.head_dim,)]] if self.qk_norm else []  # after q_proj and after k_proj
        sinks = [[(self.num_heads,)]] if self.features.attention_sinks else []  # attention's own parameter
        return [
            [(h,)],  # RMSNorm (weight only)
            *sinks,
            linear(q, h, self.qkv_bias), *qk_norm, linear(kv, h, self.qkv_bias), *qk_norm, linear(kv, h, self.qkv_bias),
            linear(h, q, self.out_bias),
            [(h,)],
            *(self._moe_modules() if self.num_experts else  # gate, up, down
              [linear(f, h, self.mlp_bias), linear(f, h, self.mlp_bias), linear(h, f, self.mlp_bias)]),
        ]

    def _moe_modules(self) -> list[list[tuple[int, ...]]]:
        """An MoE layer's router (E x h, and GPT-OSS's bias) and its stacked experts (gate_up_proj E x 2I x h,
        down_proj E x h x I: transformers' layout; GPT-OSS's in x out, E x h x 2I and E x I x h, each with its
        biases), one module."""
        h, e, i = self.hidden_size, self.num_experts, self.moe_ffn
        router = [(e, h), (e,)] if self.features.router_bias else [(e, h)]
        if self.features.experts_in_by_out:
            stacks = [(e, h, 2 * i), (e, i, h)]
        else:
            stacks = [(e, 2 * i, h), (e, h, i)]
        if self.features.expert_biases:
            stacks = [stacks[0], ExpertDims((e, 2 * i)), stacks[1], ExpertDims((e, h))]
        shared = self.shared_expert_ffn_hidden_size
        if shared:  # Qwen2-MoE runs its shared expert first, gates its output after the experts' (sigmoid, 1 x h)
            return [[(shared, h)], [(shared, h)], [(h, shared)], router, stacks, [(1, h)]]
        return [router, stacks]

    def layer_params(self) -> int:
        return sum(math.prod(dims) for module in self.layer_modules() for dims in module)

    def embedding_params(self) -> int:
        """Input side: token embedding (+ learned positions for GPT-2)."""
        positions = self.max_seq_len * self.hidden_size if self.features.learned_positions else 0
        return self.vocab_size * self.hidden_size + positions

    def head_params(self) -> int:
        """Output side: final norm and (untied) LM head."""
        norm = self.features.norm_params_per_unit * self.hidden_size
        head = 0 if self.tie_embeddings else self.vocab_size * self.hidden_size
        return norm + head

    def last_stage_params(self) -> int:
        """What a pipeline's last stage holds beyond its blocks: a tied head is a second copy there."""
        return self.head_params() + (self.vocab_size * self.hidden_size if self.tie_embeddings else 0)

    @property
    def num_params(self) -> int:
        return self.embedding_params() + self.num_layers * self.layer_params() + self.head_params()

    # ------------------------------------------------------------------ what autocast and ZeRO-3 see
    def layer_matmul_weights(self) -> int:
        """Weights of one layer's matrix products: what autocast copies to 16 bits and keeps for backward (the
        experts' biases are not one)."""
        return sum(math.prod(dims) for module in self.layer_modules() for dims in module
                   if len(dims) >= 2 and not isinstance(dims, ExpertDims))

    def layer_tp_sharded(self) -> int:
        """Elements of one layer that tensor parallelism splits across ranks: the matmul weights and the
        column-parallel biases (GPT-2's c_attn and c_fc; q, k, v, gate and up where they have them); norms
        (per-head q/k norms included) and row-parallel biases stay whole, and an MoE layer's router and experts
        (expert parallelism splits those: memory.tp_rank_params)."""
        if self.features.biased_projections:  # the fused q/k/v's and the MLP's first biases are split too
            return self.layer_matmul_weights() + 3 * self.hidden_size + self.ffn
        if self.num_experts:  # an MoE layer's router stays whole, its experts are split by expert (strategy.ep), and a
            # shared expert stays whole (transformers' Qwen2-MoE plan has no entry for it)
            biases = (self.q_dim + 2 * self.kv_dim) * self.qkv_bias
            return (self.layer_matmul_weights() - self.router_weight - self.expert_matmul_weights
                    - self.shared_expert_params + biases)
        biases = (self.q_dim + 2 * self.kv_dim) * self.qkv_bias + 2 * self.ffn * self.mlp_bias
        return self.layer_matmul_weights() + biases

    def layer_params_tp(self, tp: int) -> float:
        """Parameters of one layer that one rank of a `tp`-way tensor-parallel group holds."""
        return self.layer_params() - self.layer_tp_sharded() * (1 - 1 / tp)

    def head_matmul_weights(self) -> int:
        """The LM head's weight (a matrix product whether or not it is tied to the embedding)."""
        return self.vocab_size * self.hidden_size

    def module_shapes(self) -> list[list[tuple[int, ...]]]:
        """Every module's parameter tensors' shapes, in forward order: embeddings, the layers, final norm, head."""
        h, v = self.hidden_size, self.vocab_size
        first = [[(v, h)], [(self.max_seq_len, h)]] if self.features.learned_positions else [[(v, h)]]
        last = [[(h,)] * self.features.norm_params_per_unit]
        head = [] if self.tie_embeddings else [[(v, h)]]
        return [*first, *self.layer_modules() * self.num_layers, *last, *head]

    def param_shapes(self) -> list[tuple[int, ...]]:
        """Every parameter tensor's shape, in forward order."""
        return [dims for module in self.module_shapes() for dims in module]

    @staticmethod
    def is_experts(dims: tuple[int, ...]) -> bool:
        """Whether a parameter of this shape is an MoE layer's experts' (gate_up_proj E x 2I x h, down_proj E x h x I,
        the only 3-D parameters here; GPT-OSS's biases, `ExpertDims`): what expert parallelism splits by expert."""
        return len(dims) == 3 or isinstance(dims, ExpertDims)

    def module_params(self) -> list[tuple[int, ...]]:
        """Each module's own parameter tensors (their sizes), in forward order: the unit ZeRO-3 gathers."""
        return [tuple(math.prod(dims) for dims in module) for module in self.module_shapes()]


def _getter(model: Any) -> Any:
    """`get(key, default)` over a ModelConfig, a DictConfig or a plain dict of the `model` group."""
    return model.get if isinstance(model, Mapping) else lambda k, d=None: getattr(model, k, d)


def _conf_model(key: str) -> ModelShape:
    """A model option's shape, as training reads it: conf/model/<key>.yaml."""
    import yaml

    path = Path(__file__).resolve().parents[2] / "conf" / "model" / f"{key}.yaml"
    return ModelShape.from_config(yaml.safe_load(path.read_text()))


# Public shapes far beyond this machine, for "does it fit" questions (Touvron et al. 2023, Llama 2 table): the model
# options model=7b, 13b and 70b themselves, so training, the advisor's commands and the estimator share one shape.
PRESETS: dict[str, ModelShape] = {key: _conf_model(key) for key in ("7b", "13b", "70b")}


def find_preset(name: str) -> Optional[ModelShape]:
    """A preset by its key (`7b`) or by the name its tables print (`llama2-7b`), in any case; None if neither."""
    key = name.strip().lower()
    return PRESETS.get(key) or next((s for s in PRESETS.values() if s.name == key), None)


def preset_names() -> str:
    """`7b, 13b, 70b (llama2-7b, llama2-13b, llama2-70b)`: how a message lists the presets."""
    return f"{', '.join(PRESETS)} ({', '.join(s.name for s in PRESETS.values())})"


def stage_bounds(shape: ModelShape, *, num_stages: int, split_points: Optional[list[int]] = None) -> list[int]:
    """First block of stages 1..K-1: `split_points` if given, else the pipeline strategy's own balanced
    split (dist_train.strategies.pipeline_stages.split_layers), so the prediction splits as the run does."""
    if split_points:
        return list(split_points)
    if num_stages > shape.num_layers:
        raise ValueError(f"{num_stages} pipeline stages need as many blocks; {shape.name} has {shape.num_layers}")
    return list(_balanced_bounds(shape, num_stages))


@functools.lru_cache(maxsize=1024)
def _balanced_bounds(shape: ModelShape, num_stages: int) -> tuple[int, ...]:
    """The balanced split, once per shape and stage count: an exact search, O(K L^2), that the advisor asks for
    thousands of times (70B: 80 layers)."""
    try:
        from dist_train.strategies.pipeline_stages import split_layers
    except ImportError:  # no pipeline strategy installed: cut evenly by block count
        return tuple(round(k * shape.num_layers / num_stages) for k in range(1, num_stages))
    return tuple(split_layers(
        [shape.layer_params()] * shape.num_layers, num_stages=num_stages,
        first_extra=shape.embedding_params(), last_extra=shape.last_stage_params(),
    ))


def stage_params(shape: ModelShape, *, num_stages: int, split_points: Optional[list[int]] = None) -> list[int]:
    """Parameters held by each pipeline stage: embeddings on the first, final norm and head on the last."""
    out = []
    for k, layers in enumerate(stage_layers(shape, num_stages=num_stages, split_points=split_points)):
        n = layers * shape.layer_params()
        n += shape.embedding_params() if k == 0 else 0
        n += shape.last_stage_params() if k == num_stages - 1 else 0
        out.append(n)
    return out


def stage_layers(shape: ModelShape, *, num_stages: int, split_points: Optional[list[int]] = None) -> list[int]:
    bounds = [0, *stage_bounds(shape, num_stages=num_stages, split_points=split_points), shape.num_layers]
    return [bounds[k + 1] - bounds[k] for k in range(num_stages)]
