"""What the estimator needs to know about a transformer block that transformers' configs do not say, as features.

Every architecture transformers lays out as a decoder stack of RMSNorm, separate q/k/v projections, rotary
positions and a gated MLP (Llama, Mistral, Qwen2/3, ...) is the default description. The others are described here,
by what their blocks are, and nowhere else: the estimator (dist_train/estimate/) and the strategies read features,
never a model's name (tests/test_structure.py checks that they name none).

- GPT-2: transformers gives it no tensor-parallel or pipeline plan; LayerNorm with a bias, learned positions, one
  fused q/k/v projection, a GELU MLP, a bias on every projection, Conv1D weights stored in x out.
- Gemma: its RMSNorm scales by (1 + weight) in fp32, so the normalized output it keeps is fp32 too.
- Phi-3: fused qkv_proj and gate_up_proj.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BlockFeatures:
    layer_norm: bool = False  # LayerNorm with weight and bias (else RMSNorm, weight only)
    learned_positions: bool = False  # a position embedding table (else rotary: no parameters)
    fused_qkv: bool = False  # one projection computes q, k and v
    gated_mlp: bool = True  # gate and up projections (SwiGLU/GeGLU), else one up-projection and an activation
    fused_gate_up: bool = False  # gate and up as one projection
    biased_projections: bool = False  # every projection and its fused q/k/v carry a bias (GPT-2)
    norm_output_fp32: bool = False  # the norm keeps its normalized output in fp32 whatever the residual's dtype

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
}


def block_features(model_type: str) -> BlockFeatures:
    """The features of `model_type`'s blocks: its description above, else the Llama-like default."""
    return _DESCRIBED.get(model_type, BlockFeatures())
