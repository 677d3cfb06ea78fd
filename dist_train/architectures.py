"""What the estimator and the strategies need to know about a transformer block that transformers does not say: its
features, and, for an architecture transformers gives no plans, its plans in transformers' own format.

Every architecture transformers lays out as a decoder stack of RMSNorm, separate q/k/v projections, rotary
positions and a gated MLP (Llama, Mistral, Qwen2/3, ...) is the default description. The others are described here,
by what their blocks are, and nowhere else: the estimator (dist_train/estimate/) and the strategies read features,
never a model's name (tests/unit/test_structure.py checks that they name none).

- GPT-2: transformers gives it no tensor-parallel or pipeline plan; LayerNorm with a bias, learned positions, one
  fused q/k/v projection, a GELU MLP, a bias on every projection, Conv1D weights stored in x out. Its tensor-parallel
  plan is written here as data (FALLBACK_PLANS), and its pipeline stage's forward in the model layer
  (dist_train/model.py), the one piece that is code.
- Gemma: its RMSNorm scales by (1 + weight) in fp32, so the normalized output it keeps is fp32 too.
- Phi-3: fused qkv_proj and gate_up_proj.
- GPT-OSS: attention sinks, and experts stored in x out with biases, behind a biased router.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional


@dataclass(frozen=True)
class BlockFeatures:
    layer_norm: bool = False  # LayerNorm with weight and bias (else RMSNorm, weight only)
    learned_positions: bool = False  # a position embedding table (else rotary: no parameters)
    fused_qkv: bool = False  # one projection computes q, k and v
    gated_mlp: bool = True  # gate and up projections (SwiGLU/GeGLU), else one up-projection and an activation
    fused_gate_up: bool = False  # gate and up as one projection
    biased_projections: bool = False  # every projection and its fused q/k/v carry a bias (GPT-2)
    norm_output_fp32: bool = False  # the norm keeps its normalized output in fp32 whatever the residual's dtype
    attention_sinks: bool = False  # a learned sink logit per attention head (GPT-OSS's `sinks`)
    # An MoE layer's experts: stored in x out (`x @ W`), each with a bias on both projections, and a router with a
    # bias (GPT-OSS); else out x in, no bias (Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE)
    experts_in_by_out: bool = False
    expert_biases: bool = False
    router_bias: bool = False

    @property
    def column_projections(self) -> int:
        """Column-parallel projections per block (each one all-reduce of its input's gradient under tensor
        parallelism): q, k, v (or one fused), gate and up (or one)."""
        attention = 1 if self.fused_qkv else 3
        mlp = 1 if (self.fused_gate_up or not self.gated_mlp) else 2
        return attention + mlp

    @property
    def norm_params_per_unit(self) -> int:
        """Parameters a norm holds per hidden unit: LayerNorm's weight and bias, RMSNorm's weight."""
        return 2 if self.layer_norm else 1


_DESCRIBED = {
    "gpt2": BlockFeatures(layer_norm=True, learned_positions=True, fused_qkv=True, gated_mlp=False,
                          biased_projections=True),
    "gemma": BlockFeatures(norm_output_fp32=True),
    "gemma2": BlockFeatures(norm_output_fp32=True),
    "phi3": BlockFeatures(fused_qkv=True, fused_gate_up=True),
    # GPT-OSS: biases on q, k, v and o (its config.json's attention_bias), sink logits, experts in x out with biases
    # and their gate and up interleaved (transformers' GptOssExperts._apply_gate), a biased router
    "gpt_oss": BlockFeatures(attention_sinks=True, experts_in_by_out=True, expert_biases=True, router_bias=True),
}


def block_features(model_type: str) -> BlockFeatures:
    """The features of `model_type`'s blocks: its description above, else the Llama-like default."""
    return _DESCRIBED.get(model_type, BlockFeatures())


@dataclass(frozen=True)
class Plans:
    """Plans for an architecture transformers gives none, in the form tensor parallelism reads transformers' own:
    `tp`, a block's `base_model_tp_plan` entries (path inside the block: style); `sequence_parallel`, each block child's
    role under sequence parallelism (norm: runs on this rank's tokens; gather_input / gather_kwarg_input: its input,
    split by sequence, gathered whole on entry); `per_rank`, the block attributes that count what one rank computes
    (heads, widths), divided by the tensor-parallel degree."""

    tp: dict[str, str]
    sequence_parallel: dict[str, str]
    per_rank: tuple[str, ...] = ()


# The roles under sequence parallelism of a decoder block laid out as Llama's (transformers' layers pass attention its
# input by keyword).
DECODER_SEQUENCE_PARALLEL = {"input_layernorm": "norm", "post_attention_layernorm": "norm",
                             "self_attn": "gather_kwarg_input", "mlp": "gather_input"}

FALLBACK_PLANS = {
    # colwise_fused_qkv: the fused [q | k | v] Conv1D split by head, each rank computing its heads of all three
    "gpt2": Plans(tp={"attn.c_attn": "colwise_fused_qkv", "attn.c_proj": "rowwise", "mlp.c_fc": "colwise",
                      "mlp.c_proj": "rowwise"},
                  sequence_parallel={"ln_1": "norm", "ln_2": "norm", "attn": "gather_input", "mlp": "gather_input"},
                  per_rank=("attn.split_size", "attn.num_heads", "attn.embed_dim")),
}


def fallback_plans(model_type: str) -> Optional[Plans]:
    """The plans written here for `model_type`, None for an architecture whose plans transformers has."""
    return FALLBACK_PLANS.get(model_type)


def expert_modules(model: Any) -> list[Any]:
    """Every MoE layer's experts module in `model` (an nn.Module), in module order: transformers' stacked experts,
    one module holding 3-D `gate_up_proj` and `down_proj` tensors (a ZeRO-3 partitioned one keeps its shape as
    `ds_shape`). The experts step of parallel/apply.py and the load telemetry (telemetry/moe.py) find them here."""
    def stacked(t: Any) -> bool:
        return t is not None and len(getattr(t, "ds_shape", None) or getattr(t, "shape", ())) == 3

    return [m for m in model.modules()
            if stacked(getattr(m, "gate_up_proj", None)) and getattr(m, "down_proj", None) is not None]
