"""The compute of one micro-batch on one rank, operation by operation: matrix products, attention, memory-bound work
and the loss, forward, backward and recompute. step_time.py adds communication, the bubble and the optimizer.

- **Matrix products** (each projection forward, its input's gradient and its weight's gradient): 2 m k n FLOPs at
  the profile's peak x `gemm_efficiency`, times two shape factors: the last wave's idle SMs (output tiles of
  TILE_M x TILE_N over `sm_count` SMs) and a short inner dimension (k / (k + `gemm_k_half`)); never faster than
  reading and writing its operands at the memory bandwidth. On the H100/H200 this form, with 3 constants, gives
  the 132 products bench/gpu_calibrate.py measured within 5% (median), and tensor-parallel slices as thin as 128
  columns within 60%.
- **Attention** (flash/SDPA, causal: the unmasked half of the scores): forward 4 b s^2 q_dim / 2 FLOPs, backward 2.5
  times that (five products against two), at the peak x `attention_efficiency` x s / (s + `attention_seq_half`):
  short sequences keep the tiles less busy.
- **Memory-bound work**, read and written at `memory_efficiency` x the memory bandwidth: the norms, the activation,
  rotary positions, the residual adds and attention's layout copy, as the eager modules of transformers run them
  (ELEMENTWISE below, bytes per element of each kernel), backward BACKWARD_TRAFFIC times the forward's bytes.
- **Experts** (an MoE layer's, `experts_compute`): each local expert's products over its share of the routed rows
  (top-k x tokens x ep / experts, as even routing gives them), priced as the products above: one product per expert
  under model.experts_implementation=eager, where a few hundred rows leave most SMs idle; one grouped kernel over
  all of them under grouped_mm, its tiles sharing the waves, at the profile's `gemm_factor`. Beside the products,
  the routing (permuting the rows, weighting them, scattering them back) as passes over the routed rows' bytes at
  the memory bandwidth, and a fixed cost per layer (the profile's `experts`, fitted to MoE blocks measured on an
  H100 and checked on an H200's).
- **The loss**: LOSS_BYTES_PER_LOGIT per logit (cross-entropy over the vocabulary in fp32, forward and backward,
  measured on an H200) at the memory bandwidth.

A recomputed forward (activation checkpointing) adds the forward of all of it under `full`, and of the memory-bound
work only under `selective` (matrix products' and attention's outputs are kept).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Optional

from dist_train.estimate.hardware import Hardware
from dist_train.estimate.shapes import ModelShape

# A product's output is computed in tiles of TILE_M x TILE_N, one tile per SM at a time (cuBLAS's common bf16 tile on
# Hopper and Ampere); the fit to the measured products preferred this one of 128x128, 128x256 and 256x128.
TILE_M, TILE_N = 128, 256
# Attention's backward runs five products of the forward's size against its two.
ATTENTION_BACKWARD = 2.5
# A backward kernel reads the saved input and the output's gradient and writes the input's gradient, and autograd
# adds gradients where a tensor is used twice: about twice the forward's bytes.
BACKWARD_TRAFFIC = 2.0
# Cross-entropy over the vocabulary, forward and backward (logits upcast to fp32, log-softmax, its gradient, cast
# back): 7.6 ms for 4,096 x 128,256 logits on an H200 at 4.25 TB/s (bench/data/gpu_calibrate-h200-2026-11-26.json),
# 61 bytes of memory traffic per logit.
LOSS_BYTES_PER_LOGIT = 61.0


def recompute_mode(value: object) -> str:
    """train.activation_checkpointing as the time model reads it: none | full | selective (true/false: full/none)."""
    if value is True or value == "full":
        return "full"
    return "selective" if value == "selective" else "none"


def wave_utilisation(m: int, n: int, sms: int, groups: int = 1) -> float:
    """The busy fraction of the SMs over the waves of output tiles of `groups` products in one kernel (1 with no SM
    count: a CPU)."""
    if sms <= 0:
        return 1.0
    tiles = groups * math.ceil(m / TILE_M) * math.ceil(n / TILE_N)
    return tiles / (math.ceil(tiles / sms) * sms)


def gemm_seconds(m: int, k: int, n: int, hw: Hardware, peak: float, element_bytes: int, *, groups: int = 1,
                 factor: float = 1.0) -> float:
    """One product of an m x k and a k x n matrix; or `groups` of them in one grouped kernel, whose output tiles
    share the waves, at `factor` times a product's efficiency."""
    eff = hw.gemm_efficiency * factor * wave_utilisation(m, n, hw.sm_count, groups) * k / (k + hw.gemm_k_half)
    compute = 2.0 * groups * m * k * n / (peak * eff)
    traffic = element_bytes * groups * (m * k + k * n + m * n) / hw.memory_bw
    return max(compute, traffic)


def projections(shape: ModelShape, tp: int) -> list[tuple[int, int]]:
    """(in, out) of one layer's projections on one rank of a `tp`-way tensor-parallel group, forward order:
    column-parallel outputs and row-parallel inputs divided by tp."""
    h, q, kv, f = shape.hidden_size, shape.q_dim, shape.kv_dim, shape.ffn
    feats = shape.features
    attention = [(h, (q + 2 * kv) // tp)] if feats.fused_qkv else [(h, q // tp), (h, kv // tp), (h, kv // tp)]
    if shape.num_experts:  # the router; the experts are experts_compute's; a shared expert, whole on every rank
        s = shape.shared_expert_ffn_hidden_size
        shared = [(h, s), (h, s), (s, h), (h, 1)] if s else []
        return [*attention, (q // tp, h), (h, shape.num_experts), *shared]
    if not feats.gated_mlp:
        mlp = [(h, f // tp)]
    else:
        mlp = [(h, 2 * f // tp)] if feats.fused_gate_up else [(h, f // tp), (h, f // tp)]
    return [*attention, (q // tp, h), *mlp, (f // tp, h)]


def experts_compute(shape: ModelShape, *, tokens: int, ep: int, recompute: str, hw: Hardware, peak: float,
                    element_bytes: int, constants: Optional[dict[str, float]] = None,
                    overload: float = 1.0) -> tuple[float, float]:
    """(products, routing) seconds of one MoE layer's experts on one rank for `tokens` of its tokens, forward +
    backward + recompute: the E / ep local experts, each with tokens x k x ep / E rows. Full checkpointing
    recomputes the forward; selective too under grouped_mm (its grouped products are not among what selective
    keeps, dist_train.model._SAVED_OPS), only the routing under eager (its products are kept). `overload`: the rank's
    received rows over the balanced share (the busiest EP rank's, Setup.ep_overload), which its experts compute."""
    h, i, k = shape.hidden_size, shape.moe_ffn, shape.experts_per_token
    local = shape.num_experts // ep
    rows = max(1, round(tokens * k * ep * overload / shape.num_experts))
    impl = shape.experts_implementation
    c = hw.experts.get(impl, {}) if constants is None else constants
    # grouped_mm: one kernel over the local experts; eager: one product per expert
    grouped = dict(groups=local, factor=c.get("gemm_factor", 1.0)) if impl == "grouped_mm" else {}
    per_kernel = 1 if grouped else local
    fwd = bwd = 0.0
    for a, b in ((h, 2 * i), (i, h)):  # gate and up as one product, then down
        fwd += per_kernel * gemm_seconds(rows, a, b, hw, peak, element_bytes, **grouped)
        bwd += per_kernel * (gemm_seconds(rows, b, a, hw, peak, element_bytes, **grouped)
                             + gemm_seconds(a, rows, b, hw, peak, element_bytes, **grouped))
    again = recompute == "full" or (recompute == "selective" and impl == "grouped_mm")
    routing = (c.get("routing_passes", 0.0) * tokens * overload * k * h * element_bytes / hw.memory_bw
               + c.get("fixed_s", 0.0))  # forward and backward: the forward a third, as BACKWARD_TRAFFIC has it
    return fwd * (2 if again else 1) + bwd, routing * (1 + (1 / 3 if recompute != "none" else 0))


def projection_pass_seconds(tokens: int, pairs: list[tuple[int, int]], hw: Hardware, peak: float,
                            element_bytes: int) -> tuple[float, float]:
    """(forward, backward) seconds of `pairs` over `tokens` rows: backward is the input's gradient (tokens x out x
    in) and the weight's (in x tokens x out)."""
    fwd = sum(gemm_seconds(tokens, i, o, hw, peak, element_bytes) for i, o in pairs)
    bwd = sum(gemm_seconds(tokens, o, i, hw, peak, element_bytes) + gemm_seconds(i, tokens, o, hw, peak, element_bytes)
              for i, o in pairs)
    return fwd, bwd


def attention_forward_seconds(shape: ModelShape, *, batch: int, seq_len: int, tp: int, hw: Hardware,
                              peak: float) -> float:
    flops = 4.0 * batch * seq_len * seq_len * (shape.q_dim // tp) / 2  # causal: the unmasked half
    eff = hw.attention_efficiency * seq_len / (seq_len + hw.attention_seq_half)
    return flops / (peak * eff)


def elementwise_bytes_per_token(shape: ModelShape, *, tp: int, sequence_parallel: bool, element_bytes: int) -> float:
    """Forward bytes one token's memory-bound kernels read and write in one layer, on one rank (ELEMENTWISE)."""
    e, h, f = element_bytes, shape.hidden_size, shape.routed_ffn
    q, kv = shape.q_dim // tp, shape.kv_dim // tp
    feats = shape.features
    token_parallel = tp if sequence_parallel else 1  # norms and residuals run on this rank's tokens only
    norm = 2 * e if feats.layer_norm else ELEMENTWISE["rms_norm_fp32"] + ELEMENTWISE["rms_norm"] * e
    per_h = (2 * norm + 2 * 3 * e) / token_parallel  # two norms, two residual adds (read 2, write 1)
    if feats.gated_mlp:
        act = ELEMENTWISE["swiglu"] * e * f // tp
    else:
        act = ELEMENTWISE["gelu_tanh"] * e * f // tp
    rotary = 0 if feats.learned_positions else ELEMENTWISE["rotary"] * e * (q + kv)
    layout = 2 * e * q  # attention's output back from (batch, heads, seq, dim): one copy
    shared = 0
    if shape.num_experts and shape.shared_expert_ffn_hidden_size:  # its SwiGLU, then its gated output (read h and
        # the gate, write h) added to the experts' (read 2 h, write h); the gate's sigmoid, one element, left out
        shared = ELEMENTWISE["swiglu"] * e * shape.shared_expert_ffn_hidden_size + 5 * e * h
    return per_h * h + act + rotary + layout + shared


# Bytes per element of the kernels eager transformers runs (each kernel reads its inputs and writes its output once):
# - rms_norm (Llama's): x.to(fp32), pow(2), mean, x * rsqrt, .to(dtype), weight * x: 28 fp32 bytes plus 4 of the
#   activation's dtype per element;
# - gelu_tanh (GPT-2's gelu_new, written out in Python): pow, three multiplies by constants or x, two adds, tanh,
#   one more multiply: 8 kernels, 18 elements;
# - swiglu: silu(gate) (2) and its product with up (3): 5 elements;
# - rotary: q * cos, rotate_half's negate and concatenate, * sin, the add: 10 elements of q and of k.
ELEMENTWISE = {"rms_norm_fp32": 28, "rms_norm": 4, "gelu_tanh": 18, "swiglu": 5, "rotary": 10}


@dataclass(frozen=True)
class MicroBatchCompute:
    """Seconds of one micro-batch on one rank, by kind of operation (forward + backward + recompute)."""

    gemm_s: float
    attention_s: float
    elementwise_s: float
    loss_s: float
    host_s: float = 0.0  # what the device waits for its host beyond its kernels (Hardware.selective_host_s)

    @property
    def total_s(self) -> float:
        return self.gemm_s + self.attention_s + self.elementwise_s + self.loss_s + self.host_s

    def __add__(self, other: "MicroBatchCompute") -> "MicroBatchCompute":
        return MicroBatchCompute(self.gemm_s + other.gemm_s, self.attention_s + other.attention_s,
                                 self.elementwise_s + other.elementwise_s, self.loss_s + other.loss_s,
                                 self.host_s + other.host_s)

    def scaled(self, k: float) -> "MicroBatchCompute":
        return MicroBatchCompute(self.gemm_s * k, self.attention_s * k, self.elementwise_s * k, self.loss_s * k,
                                 self.host_s * k)


def layer_compute(shape: ModelShape, *, batch: int, seq_len: int, tp: int, sequence_parallel: bool, recompute: str,
                  hw: Hardware, peak: float, element_bytes: int, ep: int = 1,
                  experts_fp32: bool = False, ep_overload: float = 1.0) -> MicroBatchCompute:
    """One layer, one micro-batch of `batch` sequences, on one rank (its experts split over `ep` ranks).
    `experts_fp32`: the experts' products run in fp32 (grouped_mm over fp32 weights under autocast, which does not
    cast them: transformers casts the input to the weights' dtype instead)."""
    tokens = batch * seq_len
    fwd, bwd = projection_pass_seconds(tokens, projections(shape, tp), hw, peak, element_bytes)
    experts_s = routing_s = 0.0
    if shape.num_experts:
        # under tensor parallelism (with strategy.ep) each rank of the tp group dispatches its share of the tokens:
        # the largest, ceil(tokens / tp), is the step's
        experts_s, routing_s = experts_compute(shape, tokens=-(-tokens // tp), ep=ep, recompute=recompute, hw=hw,
                                               peak=hw.peak("fp32") if experts_fp32 else peak,
                                               element_bytes=4 if experts_fp32 else element_bytes,
                                               overload=ep_overload if ep > 1 else 1.0)
    att = attention_forward_seconds(shape, batch=batch, seq_len=seq_len, tp=tp, hw=hw, peak=peak)
    ew = tokens * elementwise_bytes_per_token(shape, tp=tp, sequence_parallel=sequence_parallel,
                                              element_bytes=element_bytes) / (hw.memory_bw * hw.memory_efficiency)
    full = recompute == "full"
    out = MicroBatchCompute(
        gemm_s=fwd * (2 if full else 1) + bwd + experts_s,
        attention_s=att * (1 + ATTENTION_BACKWARD + (1 if full else 0)),
        elementwise_s=ew * (1 + BACKWARD_TRAFFIC + (1 if recompute != "none" else 0)) + routing_s,
        loss_s=0.0,
    )
    # the host issues it slower than its kernels run: the wait, in the units the step divides by `efficiency`
    floor = hw.selective_host_s * hw.efficiency
    if recompute == "selective" and floor > out.total_s:
        out = replace(out, host_s=floor - out.total_s)
    return out


def head_compute(shape: ModelShape, *, batch: int, seq_len: int, tp: int, hw: Hardware, peak: float,
                 element_bytes: int) -> MicroBatchCompute:
    """The LM head's product and the loss over the vocabulary (split by vocabulary row under tensor parallelism),
    one micro-batch; never checkpointed."""
    tokens, vocab = batch * seq_len, shape.vocab_size // tp
    fwd, bwd = projection_pass_seconds(tokens, [(shape.hidden_size, vocab)], hw, peak, element_bytes)
    loss = tokens * vocab * LOSS_BYTES_PER_LOGIT / hw.memory_bw
    return MicroBatchCompute(gemm_s=fwd + bwd, attention_s=0.0, elementwise_s=0.0, loss_s=loss)


# ------------------------------------------------------------------ fitting the constants to measured operations
def _least_log_squares(grid_a: list[float], grid_b: list[float], points: list[tuple[float, float]],
                       model: Callable[[float, float, int], float]) -> tuple[float, float]:
    """The (a, b) of the grids whose model(a, b, i) is nearest points[i]'s measured value, in log error."""
    best: Optional[tuple[float, float, float]] = None
    for a in grid_a:
        for b in grid_b:
            loss = sum(math.log(model(a, b, i) / measured) ** 2 for i, (_, measured) in enumerate(points))
            if best is None or loss < best[0]:
                best = (loss, a, b)
    assert best is not None
    return best[1], best[2]


def fit_gemm(rows: list[dict], *, sms: int, peak: float) -> tuple[float, float]:
    """(gemm_efficiency, gemm_k_half) from measured products: bench/gpu_calibrate.py's `matmuls` rows (m, k, n of
    the forward; kind fwd, dgrad or wgrad; flops_per_s)."""
    shapes = []
    for r in rows:
        m, k, n = r["m"], r["k"], r["n"]
        shapes.append({"fwd": (m, k, n), "dgrad": (m, n, k), "wgrad": (k, m, n)}[r["kind"]])
    points = [(0.0, r["flops_per_s"] / peak) for r in rows]

    def model(eff: float, k_half: float, i: int) -> float:
        m, k, n = shapes[i]
        return eff * wave_utilisation(m, n, sms) * k / (k + k_half)

    return _least_log_squares([x / 1000 for x in range(500, 951, 5)], [float(x) for x in range(0, 1201, 25)],
                              points, model)


# The grids fit_experts searches: the grouped kernel's factor, passes over the routed rows, fixed seconds per layer.
_EXPERT_GRID = ([x / 100 for x in range(40, 101, 5)], [float(x) for x in range(0, 97, 4)],
                [x * 2.5e-4 for x in range(0, 41)])


def moe_block_seconds(shape: ModelShape, *, tokens: int, hw: Hardware, constants: dict[str, float]) -> float:
    """The model's seconds for one MoE block of `shape` (its router and experts, one rank) over `tokens`, forward +
    backward in bf16, as bench/gpu_calibrate.py measures it: the router's product and experts_compute."""
    peak = hw.flops["bf16"]
    fwd, bwd = projection_pass_seconds(tokens, [(shape.hidden_size, shape.num_experts)], hw, peak, 2)
    experts_s, routing_s = experts_compute(shape, tokens=tokens, ep=1, recompute="none", hw=hw, peak=peak,
                                           element_bytes=2, constants=constants)
    return fwd + bwd + experts_s + routing_s


def fit_experts(blocks: list[tuple[ModelShape, int, float]], hw: Hardware) -> dict[str, dict[str, float]]:
    """Hardware.experts from measured MoE blocks ((shape, tokens, measured seconds), each shape's
    experts_implementation): per implementation, the grid point of least squared log error of moe_block_seconds
    (grouped_mm's gemm_factor; eager has none)."""
    out = {}
    for impl in sorted({shape.experts_implementation for shape, _, _ in blocks}):
        mine = [b for b in blocks if b[0].experts_implementation == impl]
        factors = _EXPERT_GRID[0] if impl == "grouped_mm" else [1.0]
        best: Optional[tuple[float, dict[str, float]]] = None
        for factor in factors:
            for passes in _EXPERT_GRID[1]:
                for fixed in _EXPERT_GRID[2]:
                    c = {"gemm_factor": factor, "routing_passes": passes, "fixed_s": fixed}
                    loss = sum(math.log(moe_block_seconds(shape, tokens=tokens, hw=hw, constants=c) / s) ** 2
                               for shape, tokens, s in mine)
                    if best is None or loss < best[0]:
                        best = (loss, c)
        assert best is not None
        out[impl] = best[1]
    return out


def fit_attention(rows: list[dict], *, peak: float) -> tuple[float, float]:
    """(attention_efficiency, attention_seq_half) from measured SDPA: bench/gpu_calibrate.py's `attention` rows (seq,
    fwd_bwd_flops_per_s counted as this model counts them: 3.5 x the causal forward)."""
    points = [(float(r["seq"]), r["fwd_bwd_flops_per_s"] / peak) for r in rows]

    def model(eff: float, seq_half: float, i: int) -> float:
        seq = points[i][0]
        return eff * seq / (seq + seq_half)

    return _least_log_squares([x / 1000 for x in range(300, 951, 2)], [float(x) for x in range(0, 8001, 25)],
                              points, model)
