"""Small model directories made with save_pretrained (nothing downloaded), and transformers' own first loss on them:
what tests/unit/test_own_model.py, tests/launched/test_own_model.py, tests/unit/test_weights.py and
bench/arch_matrix.py build on."""

from __future__ import annotations

from pathlib import Path

import torch

from dist_train.config import DataConfig

SEQ = 32
ARCHS = {
    "llama": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2),
    "mistral": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2),
    "qwen2": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2),
    "qwen3": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16),
    "gemma": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16),
    "gpt2": dict(n_embd=64, n_layer=2, n_head=4),
}
# Architectures tested under one strategy only (not in every pair of the matrix above)
PHI3 = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            pad_token_id=0)
# StableLM: no pipeline and no tensor-parallel plan in transformers; a plain decoder stack, cut into stages by its
# structure (dist_train.model._stack_layout)
ONE_STRATEGY = {"phi3": PHI3, "stablelm": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                               num_attention_heads=4, num_key_value_heads=4),
                # Qwen3-MoE, every layer 4 experts of width 32, top-2: saved one expert at a time, stacked when built
                "qwen3_moe": dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_experts=4,
                                  num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2, head_dim=16, decoder_sparse_step=1, mlp_only_layers=[])}


def make_model_dir(root: Path, arch: str = "llama", *, weights: str = "safetensors", shard: bool = False,
                   tie: bool = False) -> Path:
    """A small pretrained-looking directory: config.json and weights from save_pretrained."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(arch, vocab_size=256, max_position_embeddings=128, tie_word_embeddings=tie,
                               **{**ARCHS, **ONE_STRATEGY}[arch])
    torch.manual_seed(7)
    model = AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():  # weights unlike any fresh init: a loader that ignored the files would show
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    out = root / f"{arch}-{weights}{'-sharded' if shard else ''}"
    model.save_pretrained(out, max_shard_size="60KB" if shard else "5GB")
    if weights == "bin":  # the older format, as torch.save writes it (transformers now saves safetensors only)
        for f in out.glob("model*.safetensors*"):
            f.unlink()
        torch.save(model.state_dict(), out / "pytorch_model.bin")
    return out


def batch_of_step_one(path: Path, *, global_batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    from dist_train.data import GlobalBatches, build_dataset

    ds = build_dataset(DataConfig(), vocab_size=256, seq_len=SEQ, seed=1234)
    b = GlobalBatches(ds, global_batch_size=global_batch, dp_rank=0, dp_size=1).local_batch(0)
    return b.input_ids, b.labels


def reference_loss(path: Path, *, global_batch: int) -> float:
    """transformers' own loading of the directory, on the batch dist_train trains first."""
    from transformers import AutoModelForCausalLM

    from dist_train.model import forward_loss

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, local_files_only=True)
    ids, labels = batch_of_step_one(path, global_batch=global_batch)
    with torch.no_grad():
        return float(forward_loss(model, ids, labels))
