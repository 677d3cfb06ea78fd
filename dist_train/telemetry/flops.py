"""Model FLOPs per token and device peak FLOP/s, for model FLOPs utilisation (MFU)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the table below is read by the estimator and the advisor, which import no torch
    from torch import nn

# Dense (no sparsity) peak FLOP/s per device, keyed by the name torch.cuda.get_device_name() reports (matched as
# whole words, see _entry). Some datasheets print tensor-core figures with sparsity only (marked * below): the dense
# one is half, rounded down to a whole TFLOP/s (1,979* -> 989); dense figures printed as such are kept (362.05 as
# 362). "tf32" is what fp32 matmuls get when TF32 is allowed, "fp32" (non-tensor) otherwise.
# NVIDIA H100 datasheet, SXM and NVL columns (the H200 datasheet's SXM and NVL columns are the same figures):
# BF16/FP16 1,979* / 1,671*, TF32 989* / 835*, FP32 67 / 60 TFLOP/s.
_HOPPER_SXM = {"bf16": 989e12, "fp16": 989e12, "tf32": 494e12, "fp32": 67e12}
_HOPPER_NVL = {"bf16": 835e12, "fp16": 835e12, "tf32": 417e12, "fp32": 60e12}
# NVIDIA A100 datasheet, the same for SXM and PCIe, 40 and 80 GB: BF16/FP16 312, TF32 156, FP32 19.5 TFLOP/s.
_A100 = {"bf16": 312e12, "fp16": 312e12, "tf32": 156e12, "fp32": 19.5e12}
PEAK_FLOPS: dict[str, dict[str, float]] = {
    "NVIDIA H100 80GB HBM3": _HOPPER_SXM,  # the SXM5 board
    # H100 datasheet, PCIe column: BF16/FP16 1,513*, TF32 756*, FP32 51
    "NVIDIA H100 PCIe": {"bf16": 756e12, "fp16": 756e12, "tf32": 378e12, "fp32": 51e12},
    "NVIDIA H100 NVL": _HOPPER_NVL,
    "NVIDIA H200": _HOPPER_SXM,  # the SXM board
    "NVIDIA H200 NVL": _HOPPER_NVL,
    "NVIDIA A100-SXM4-80GB": _A100,
    "NVIDIA A100-SXM4-40GB": _A100,
    "NVIDIA A100-PCIE-40GB": _A100,
    "NVIDIA A100 80GB PCIe": _A100,
    "NVIDIA L40S": {"bf16": 362e12, "fp16": 362e12, "tf32": 183e12, "fp32": 91.6e12},  # L40S datasheet: 362.05, 183, 91.6
    "NVIDIA L40": {"bf16": 181e12, "fp16": 181e12, "tf32": 90.5e12, "fp32": 90.5e12},  # L40 datasheet: 181.05, 90.5, 90.5
    "NVIDIA L4": {"bf16": 121e12, "fp16": 121e12, "tf32": 60e12, "fp32": 30.3e12},  # L4 datasheet: 242*, 120*, 30.3
    "NVIDIA A10": {"bf16": 125e12, "fp16": 125e12, "tf32": 62.5e12, "fp32": 31.2e12},  # A10 datasheet: 125, 62.5, 31.2
    # NVIDIA Ada GPU Architecture whitepaper, RTX 4090: BF16 and FP16 with FP32 accumulate (what torch's matmuls
    # use) 165.2, TF32 82.6, FP32 82.6
    "NVIDIA GeForce RTX 4090": {"bf16": 165.2e12, "fp16": 165.2e12, "tf32": 82.6e12, "fp32": 82.6e12},
}


def embedding_params(model: nn.Module) -> int:
    """Parameters of lookup tables (token and position embeddings): they cost no matmul FLOPs."""
    from torch import nn

    from dist_train.contracts import whole_numel

    return sum(whole_numel(m.weight) for m in model.modules() if isinstance(m, nn.Embedding))


def flops_per_token(*, num_params: int, num_embedding_params: int, num_layers: int, hidden_size: int, seq_len: int) -> float:
    """Training FLOPs per token (forward + backward): 6 N for the matmuls plus 12 L H T for attention scores.

    N excludes embedding lookups (PaLM, appendix B; nanoGPT's estimate_mfu).
    """
    return 6.0 * (num_params - num_embedding_params) + 12.0 * num_layers * hidden_size * seq_len


def peak_flops(device_name: str, precision: str, *, allow_tf32: bool = False) -> float | None:
    """Datasheet peak of `device_name` for `precision`, or None (no MFU rather than a wrong one) for a name the
    table lacks: a CPU, a MIG slice, an unlisted GPU (telemetry.peak_flops then gives the figure)."""
    table = _entry(device_name)
    if table is None:
        return None
    if precision == "fp32":
        return table["tf32" if allow_tf32 else "fp32"]
    return table[precision]


def _entry(device_name: str) -> dict[str, float] | None:
    """The table's entry whose name appears in `device_name` as whole words, the longest name first:
    "NVIDIA L40" is not "NVIDIA L4", "NVIDIA H200 NVL" is not "NVIDIA H200"."""
    words = device_name.casefold().split()
    if "mig" in words:  # a MIG slice ("... MIG 1g.10gb") has a fraction of the whole GPU's peak
        return None
    for key in sorted(PEAK_FLOPS, key=len, reverse=True):
        key_words = key.casefold().split()
        n = len(key_words)
        if any(words[i:i + n] == key_words for i in range(len(words) - n + 1)):
            return PEAK_FLOPS[key]
    return None
