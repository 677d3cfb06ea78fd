"""peft=lora and peft=qlora in this process: bad settings in one line, and the projections adapted by default.
Real runs (the same losses as one process, what shrinks to the adapters'): tests/launched/test_peft.py."""

from __future__ import annotations

import pytest

from dist_train.checks import validate
from dist_train.config import ConfigError
from tests.helpers import run_config


@pytest.mark.parametrize(
    ("overrides", "world", "needle"),
    [
        (["peft=lora", "strategy=tp"], 2, "peft=lora puts adapters on whole projections; strategy=tp splits them"),
        (["peft=lora", "peft.rank=0"], 1, "peft.rank=0 must be >= 1"),
        (["peft=qlora", "strategy=fsdp"], 2, "peft=qlora: strategy=fsdp would shard or split the packed 4-bit"),
        (["peft=qlora", "peft.quant_type=int4"], 1, "peft.quant_type"),
    ],
)
def test_bad_lora_settings_are_one_line(overrides, world, needle):
    _, run = run_config(*overrides)
    with pytest.raises(ConfigError) as err:
        validate(run, world)
    assert needle in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize(("arch", "config", "targets"), [
    ("gpt2", dict(n_embd=32, n_layer=2, n_head=2), ["c_attn", "c_proj", "c_fc"]),
    ("llama", dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2),
     ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
    # Phi-3's fused projections: before, the Llama names left only o_proj and down_proj adapted, without a word
    ("phi3", dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, pad_token_id=0),
     ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]),
])
def test_default_lora_targets_are_every_projection_of_the_models_own_blocks(arch, config, targets):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from dist_train.model import default_lora_targets

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(arch, vocab_size=64, **config))
    assert sorted(default_lora_targets(model)) == sorted(targets)
