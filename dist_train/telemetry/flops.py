"""Model FLOPs per token and device peak FLOP/s, for model FLOPs utilisation (MFU)."""

from __future__ import annotations

from torch import nn

# Dense peak FLOP/s per device from vendor datasheets (no sparsity). Matched by substring of the
# CUDA device name; "tf32" is what fp32 matmuls get when TF32 is allowed, "fp32" otherwise.
PEAK_FLOPS: dict[str, dict[str, float]] = {
    "H200": {"bf16": 989e12, "fp16": 989e12, "tf32": 494e12, "fp32": 67e12},
    "H100": {"bf16": 989e12, "fp16": 989e12, "tf32": 494e12, "fp32": 67e12},
    "A100": {"bf16": 312e12, "fp16": 312e12, "tf32": 156e12, "fp32": 19.5e12},
    "L40S": {"bf16": 362e12, "fp16": 362e12, "tf32": 183e12, "fp32": 91.6e12},
    "L4": {"bf16": 121e12, "fp16": 121e12, "tf32": 60e12, "fp32": 30.3e12},
    "A10G": {"bf16": 70e12, "fp16": 70e12, "tf32": 35e12, "fp32": 31.2e12},
}


def embedding_params(model: nn.Module) -> int:
    """Parameters of lookup tables (token and position embeddings): they cost no matmul FLOPs."""
    return sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Embedding))


def flops_per_token(*, num_params: int, num_embedding_params: int, num_layers: int, hidden_size: int, seq_len: int) -> float:
    """Training FLOPs per token (forward + backward): 6 N for the matmuls plus 12 L H T for attention scores.

    N excludes embedding lookups (PaLM, appendix B; nanoGPT's estimate_mfu).
    """
    return 6.0 * (num_params - num_embedding_params) + 12.0 * num_layers * hidden_size * seq_len


def peak_flops(device_name: str, precision: str, *, allow_tf32: bool = False) -> float | None:
    """Datasheet peak of `device_name` for `precision`, or None if unknown (e.g. on CPU)."""
    for key, table in PEAK_FLOPS.items():
        if key in device_name:
            if precision == "fp32":
                return table["tf32" if allow_tf32 else "fp32"]
            return table[precision]
    return None
