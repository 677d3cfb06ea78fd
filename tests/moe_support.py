"""MoE model directories the tests make (nothing is downloaded), for tests/unit/test_moe.py and
tests/launched/test_moe.py."""

from __future__ import annotations

from pathlib import Path

import torch


def gpt_oss_dir(tmp_path: Path) -> Path:
    """A tiny GPT-OSS (transformers' GptOssConfig): q/k/v/o biases, attention sinks, a biased router, experts
    stored in x out with per-expert biases, 2I == h so that a bias has the router's shape. Saved with its weights."""
    from transformers import AutoModelForCausalLM, GptOssConfig

    config = GptOssConfig(vocab_size=256, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=8,
                          num_experts_per_tok=2, max_position_embeddings=256, sliding_window=32,
                          layer_types=["sliding_attention", "full_attention"],
                          rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    return tmp_path


def qwen2_moe_config(**extra: object) -> object:
    """A tiny Qwen2-MoE (transformers' Qwen2MoeConfig): q/k/v biases, 8 experts of width 32, top-2 (weights not
    renormalised, its default), and a shared expert of width 64 every token takes, gated by a sigmoid."""
    from transformers import Qwen2MoeConfig

    return Qwen2MoeConfig(**{**dict(vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                                    shared_expert_intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                    num_key_value_heads=2, num_experts=8, num_experts_per_tok=2,
                                    max_position_embeddings=256), **extra})


def qwen2_moe_dir(tmp_path: Path) -> Path:
    """qwen2_moe_config's model, saved with its weights (each expert apart, as save_pretrained writes them)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(qwen2_moe_config()).save_pretrained(tmp_path)
    return tmp_path
