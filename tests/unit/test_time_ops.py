"""The per-operation time model (dist_train/estimate/ops.py), term by term, against cases computed by hand."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from dist_train.estimate.hardware import PROFILES, Hardware, Link
from dist_train.estimate.ops import (
    ATTENTION_BACKWARD,
    BACKWARD_TRAFFIC,
    LOSS_BYTES_PER_LOGIT,
    attention_forward_seconds,
    elementwise_bytes_per_token,
    gemm_seconds,
    head_compute,
    layer_compute,
    projections,
    recompute_mode,
    wave_utilisation,
)
from dist_train.estimate.setup import Setup
from dist_train.estimate.shapes import ModelShape
from dist_train.estimate.step_time import predict_step

PEAK = 1e15
HW = Hardware(name="test", memory_bytes=80 * 2**30, flops={"bf16": PEAK, "fp32": PEAK / 10}, memory_bw=2e12,
              intra=Link(1e11, 1e-5), inter=Link(1e10, 1e-5), sm_count=132, gemm_efficiency=0.8, gemm_k_half=256,
              attention_efficiency=0.6, attention_seq_half=1024, memory_efficiency=0.5)
GPT2 = ModelShape(name="g", arch="gpt2", num_layers=4, hidden_size=1024, num_heads=8, vocab_size=32000,
                  max_seq_len=2048)
LLAMA = ModelShape(name="l", arch="llama", num_layers=4, hidden_size=1024, num_heads=8, num_kv_heads=2,
                   vocab_size=32000, max_seq_len=2048, ffn_hidden_size=2816)


def test_a_large_product_runs_at_the_efficiency_times_its_waves_and_its_inner_dimension():
    # 4096 x 4096 outputs: 32 x 16 = 512 tiles of 128 x 256 on 132 SMs: 4 waves, the last with 116 busy
    assert wave_utilisation(4096, 4096, 132) == pytest.approx(512 / 528)
    t = gemm_seconds(4096, 1024, 4096, HW, PEAK, 2)
    assert t == pytest.approx(2 * 4096 * 1024 * 4096 / (PEAK * 0.8 * (512 / 528) * 1024 / (1024 + 256)))
    # one tile's worth of output keeps one SM of 132 busy
    assert wave_utilisation(128, 256, 132) == pytest.approx(1 / 132)
    assert wave_utilisation(128, 256, 0) == 1.0  # no SMs named (a CPU): no waves


def test_a_skinny_product_is_bound_by_its_bytes():
    # 8 x 8192 by 8192 x 8: 1 MFLOP, but 2 B x (65,536 + 65,536 + 64) elements at 2 TB/s
    t = gemm_seconds(8, 8192, 8, replace(HW, sm_count=0, gemm_k_half=0), PEAK, 2)
    assert t == pytest.approx(2 * (8 * 8192 + 8192 * 8 + 8 * 8) / 2e12)


def test_projections_split_by_tensor_parallel_degree():
    assert projections(GPT2, 1) == [(1024, 3072), (1024, 1024), (1024, 4096), (4096, 1024)]
    assert projections(GPT2, 4) == [(1024, 768), (256, 1024), (1024, 1024), (1024, 1024)]
    assert projections(LLAMA, 2) == [(1024, 512), (1024, 128), (1024, 128), (512, 1024), (1024, 1408), (1024, 1408),
                                     (1408, 1024)]


def test_attention_counts_the_unmasked_half_at_its_sequence_efficiency():
    t = attention_forward_seconds(GPT2, batch=2, seq_len=2048, tp=2, hw=HW, peak=PEAK)
    flops = 4 * 2 * 2048 * 2048 * 512 / 2
    assert t == pytest.approx(flops / (PEAK * 0.6 * 2048 / (2048 + 1024)))


def test_memory_bound_bytes_counted_by_hand():
    # GPT-2, bf16: two LayerNorms (read + write, 2 x 2 B) and two residual adds (3 x 2 B) per hidden unit; tanh GELU
    # written out, 18 elements of the 4h MLP; attention's output copied back once (2 x 2 B of q)
    h = 1024
    assert elementwise_bytes_per_token(GPT2, tp=1, sequence_parallel=False, element_bytes=2) == \
        (2 * 4 + 2 * 6) * h + 18 * 2 * 4 * h + 4 * h
    # Llama: RMSNorm in fp32 (28 B + 4 elements), SwiGLU 5 elements of ffn, rotary 10 of q and k
    q, kv, f = 1024, 256, 2816
    assert elementwise_bytes_per_token(LLAMA, tp=1, sequence_parallel=False, element_bytes=2) == \
        (2 * (28 + 8) + 12) * h + 5 * 2 * f + 10 * 2 * (q + kv) + 4 * q
    # sequence parallelism splits the norms' and residuals' tokens; tensor parallelism the rest
    split = elementwise_bytes_per_token(LLAMA, tp=2, sequence_parallel=True, element_bytes=2)
    assert split == (2 * (28 + 8) + 12) * h / 2 + 5 * 2 * f // 2 + 10 * 2 * (q + kv) // 2 + 4 * q // 2


def test_checkpointing_recomputes_everything_under_full_and_only_memory_bound_work_under_selective():
    kw = dict(batch=1, seq_len=2048, tp=1, sequence_parallel=False, hw=HW, peak=PEAK, element_bytes=2)
    none, full, sel = (layer_compute(LLAMA, recompute=r, **kw) for r in ("none", "full", "selective"))
    fwd = sum(gemm_seconds(2048, i, o, HW, PEAK, 2) for i, o in projections(LLAMA, 1))
    att = attention_forward_seconds(LLAMA, batch=1, seq_len=2048, tp=1, hw=HW, peak=PEAK)
    ew = 2048 * elementwise_bytes_per_token(LLAMA, tp=1, sequence_parallel=False, element_bytes=2) / (2e12 * 0.5)
    assert none.attention_s == pytest.approx(att * (1 + ATTENTION_BACKWARD))
    assert none.elementwise_s == pytest.approx(ew * (1 + BACKWARD_TRAFFIC))
    assert full.gemm_s == pytest.approx(none.gemm_s + fwd)
    assert full.attention_s == pytest.approx(none.attention_s + att)
    assert full.elementwise_s == pytest.approx(sel.elementwise_s) == pytest.approx(none.elementwise_s + ew)
    assert (sel.gemm_s, sel.attention_s) == (none.gemm_s, none.attention_s)
    assert none.total_s < sel.total_s < full.total_s
    assert [recompute_mode(v) for v in (True, False, "full", "none", "selective")] == \
        ["full", "none", "full", "none", "selective"]


def test_the_loss_reads_every_logit_at_the_memory_bandwidth():
    head = head_compute(GPT2, batch=2, seq_len=1024, tp=1, hw=HW, peak=PEAK, element_bytes=2)
    assert head.loss_s == pytest.approx(2048 * 32000 * LOSS_BYTES_PER_LOGIT / 2e12)
    split = head_compute(GPT2, batch=2, seq_len=1024, tp=4, hw=HW, peak=PEAK, element_bytes=2)
    assert split.loss_s == pytest.approx(head.loss_s / 4)  # vocabulary-parallel head


def test_a_steps_compute_is_its_micro_batches_of_layers_and_head_over_the_efficiency():
    setup = Setup(strategy="single", family="single", precision="bf16", micro_batch_size=2, seq_len=1024,
                  global_batch_size=6)
    kw = dict(batch=2, seq_len=1024, tp=1, hw=HW, peak=PEAK, element_bytes=2)
    one = layer_compute(GPT2, sequence_parallel=False, recompute="none", **kw).total_s * 4 + \
        head_compute(GPT2, **kw).total_s
    t = predict_step(GPT2, setup, replace(HW, efficiency=0.5))
    assert t.compute_s == pytest.approx(3 * one / 0.5)
    assert t.ops.total_s == pytest.approx(t.compute_s)
    assert math.isclose(t.ops.gemm_s + t.ops.attention_s + t.ops.elementwise_s + t.ops.loss_s, t.compute_s)
    # eager PyTorch's own cost: per block and micro-batch, 4 blocks x 3 micro-batches
    dispatched = predict_step(GPT2, setup, replace(HW, efficiency=0.5, layer_overhead_s=1e-3))
    assert dispatched.compute_s == pytest.approx(t.compute_s + 12e-3)


def test_every_datasheet_profile_names_the_source_of_each_per_operation_constant():
    for prof in PROFILES.values():
        for key in ("sm_count", "gemm_efficiency", "gemm_k_half", "attention_efficiency", "attention_seq_half",
                    "memory_efficiency"):
            assert prof.source.get(key), (prof.name, key)


# ------------------------------------------------------------------ an MoE layer's experts
MOE = ModelShape(name="m", arch="llama", num_layers=2, hidden_size=256, num_heads=4, num_kv_heads=2, vocab_size=1000,
                 max_seq_len=128, num_experts=8, experts_per_token=2, moe_ffn_hidden_size=128)


@pytest.mark.parametrize("impl", ["eager", "grouped_mm"])
def test_the_experts_are_their_own_products_over_their_rows_then_the_routing(impl):
    """By hand, on a device without shape effects: 64 tokens, top-2 of 8 experts split over 2 ranks: 4 local
    experts of 64 x 2 x 2 / 8 = 32 rows each, each a gate-and-up product (256 -> 256) and a down product
    (128 -> 256), 3 passes of 2 m k n FLOPs each (forward, the input's and the weight's gradients). The routing:
    passes over the 64 x 2 routed rows of 256 bf16 elements at the memory bandwidth, plus the fixed cost; a
    recomputation adds a third of it."""
    from dist_train.estimate.ops import experts_compute

    hw = replace(HW, sm_count=0, gemm_efficiency=1.0, gemm_k_half=0, memory_bw=1e30)  # products at the peak
    shape = replace(MOE, experts_implementation=impl)
    c = {"gemm_factor": 1.0, "routing_passes": 10.0, "fixed_s": 1e-3}
    forward = 4 * (2 * 32 * 256 * 256 + 2 * 32 * 128 * 256) / PEAK
    routing_bw = 1e12
    products, routing = experts_compute(shape, tokens=64, ep=2, recompute="none", hw=replace(hw), peak=PEAK,
                                        element_bytes=2, constants=c)
    assert products == pytest.approx(3 * forward)
    assert routing == pytest.approx(1e-3)  # the routing's bytes at an unbounded bandwidth: the fixed cost alone
    _, routing = experts_compute(shape, tokens=64, ep=2, recompute="none", hw=replace(hw, memory_bw=routing_bw),
                                 peak=PEAK, element_bytes=2, constants=c)
    assert routing == pytest.approx(10 * 64 * 2 * 256 * 2 / routing_bw + 1e-3)
    full = experts_compute(shape, tokens=64, ep=2, recompute="full", hw=hw, peak=PEAK, element_bytes=2, constants=c)
    assert full == pytest.approx((4 * forward, 1e-3 * 4 / 3))
    # selective keeps eager's products (aten.mm) but not grouped_mm's: those run forward again
    selective, _ = experts_compute(shape, tokens=64, ep=2, recompute="selective", hw=hw, peak=PEAK, element_bytes=2,
                                   constants=c)
    assert selective == pytest.approx((4 if impl == "grouped_mm" else 3) * forward)
    # one rank holding all 8 experts: 16 rows each, the same FLOPs
    alone, _ = experts_compute(shape, tokens=64, ep=1, recompute="none", hw=hw, peak=PEAK, element_bytes=2,
                               constants=c)
    assert alone == pytest.approx(3 * forward)


def test_few_rows_per_expert_leave_the_sms_idle_under_eager_and_share_the_waves_under_grouped_mm():
    """Qwen3-30B-A3B's layer (128 experts of width 768, top-8, hidden 2048), 4,096 tokens: 256 rows an expert.
    Eager runs 128 small products, each 2 x 6 tiles on 132 SMs; grouped_mm runs them as one kernel of 1,536
    tiles; both are slower than the same FLOPs as one dense product, which the model priced them as before."""
    from dist_train.estimate.ops import experts_compute

    h100 = PROFILES["h100"]
    qwen = replace(MOE, hidden_size=2048, num_experts=128, experts_per_token=8, moe_ffn_hidden_size=768)
    none = {"routing_passes": 0.0, "fixed_s": 0.0}
    eager, _ = experts_compute(qwen, tokens=4096, ep=1, recompute="none", hw=h100, peak=h100.flops["bf16"],
                               element_bytes=2, constants=none)
    grouped, _ = experts_compute(replace(qwen, experts_implementation="grouped_mm"), tokens=4096, ep=1,
                                 recompute="none", hw=h100, peak=h100.flops["bf16"], element_bytes=2,
                                 constants={**none, "gemm_factor": 1.0})
    dense = sum(gemm_seconds(m, k, n, h100, h100.flops["bf16"], 2) for m, k, n in (
        (4096, 2048, 1536), (4096, 1536, 2048), (2048, 4096, 1536), (4096, 768, 2048), (4096, 2048, 768),
        (768, 4096, 2048))) * 8
    assert dense < grouped < eager


def test_the_hopper_experts_constants_are_the_fit_to_an_h100s_blocks_and_hold_on_an_h200s():
    """PROFILES' experts constants are what fit_experts finds in bench/data/gpu_moe-h100-2026-11-27.json (18 MoE
    blocks: Qwen3-30B-A3B's, OLMoE's, Mixtral's sizes, 4k-16k tokens, eager and grouped_mm), which they then
    predict within 10%. The same 18 blocks measured on an H200 (gpu_calibrate-h200-2026-11-27.json), not fitted,
    within 16% with the H200's profile (the worst: Mixtral's grouped_mm at 16k tokens, +15.0%). Pricing the experts
    as k dense products over all the tokens, as the model did before, was 2.5-9 times short on the fine-grained
    ones (docs/BENCHMARKS.md)."""
    import json
    import sys

    from dist_train.estimate.hardware import EXPERTS_HOPPER
    from dist_train.estimate.ops import fit_experts, moe_block_seconds
    from tests.helpers import ROOT

    sys.path.insert(0, str(ROOT / "bench"))
    from gpu_calibrate import moe_measured

    h100 = moe_measured(json.loads((ROOT / "bench/data/gpu_moe-h100-2026-11-27.json").read_text()))
    h200 = moe_measured(json.loads((ROOT / "bench/data/gpu_calibrate-h200-2026-11-27.json").read_text()))
    assert len(h100) == len(h200) == 18
    assert fit_experts(h100, PROFILES["h100"]) == EXPERTS_HOPPER
    for gpu, rows, within in (("h100", h100, 0.10), ("h200", h200, 0.16)):
        hw = PROFILES[gpu]
        assert hw.experts == EXPERTS_HOPPER
        for shape, tokens, measured in rows:
            predicted = moe_block_seconds(shape, tokens=tokens, hw=hw,
                                          constants=hw.experts[shape.experts_implementation])
            assert predicted == pytest.approx(measured, rel=within), (gpu, shape.name, shape.experts_implementation,
                                                                      tokens)


def test_grouped_mm_experts_multiply_in_fp32_only_under_fp16_autocast():
    """transformers' grouped_mm casts its input to the weights' dtype and torch does not autocast it: over the fp32
    weights of torch autocast (single, ddp, the pipelines) the experts multiplied in fp32. On an H200 a whole step
    of a 2-layer, 64-expert top-8 model (hidden 2,048, 4,096 tokens a micro-batch, 2 micro-batches,
    strategy=single, bf16) took 176 ms with grouped_mm; pricing the experts in fp32 the model says 194 ms, in bf16
    43 ms (docs/BENCHMARKS.md). A bf16 run now registers grouped_mm with autocast (model.autocast_grouped_mm), so
    it is priced in bf16 under every strategy; an fp16 run's stays in fp32 under autocast, in fp16 under FSDP2's
    policy. The eager experts (F.linear, which autocast casts) are the same everywhere."""
    shape = replace(MOE, hidden_size=2048, num_heads=16, num_kv_heads=4, head_size=128, num_experts=64,
                    experts_per_token=8, moe_ffn_hidden_size=1024, num_layers=2, vocab_size=32000, max_seq_len=4096)
    h200 = PROFILES["h200"]

    def step(impl: str, strategy: str, precision: str) -> float:
        setup = Setup(strategy=strategy, family=strategy, precision=precision, micro_batch_size=1, seq_len=4096,
                      global_batch_size=2, world_size=1)
        return predict_step(replace(shape, experts_implementation=impl), setup, h200).ops.gemm_s

    assert step("grouped_mm", "single", "bf16") == pytest.approx(step("grouped_mm", "fsdp", "bf16"))
    assert step("grouped_mm", "single", "fp16") > 5 * step("grouped_mm", "fsdp", "fp16")
    assert step("eager", "single", "fp16") == pytest.approx(step("eager", "fsdp", "fp16"))
    # the whole step the docs quote (the advisor's profile: one H200 a node): 42.7 ms in bf16, 194 ms with the
    # experts in fp32 (an fp16 run's, which is what the bf16 run was before it registered grouped_mm)
    one_gpu = replace(h200, gpus_per_node=1)

    def whole(precision: str) -> float:
        setup = Setup(strategy="single", family="single", precision=precision, micro_batch_size=1, seq_len=4096,
                      global_batch_size=2, world_size=1)
        return predict_step(replace(shape, experts_implementation="grouped_mm"), setup, one_gpu).step_s

    assert whole("bf16") == pytest.approx(0.0427, abs=5e-4) and whole("fp16") == pytest.approx(0.194, abs=1e-3)


def test_a_profile_stored_before_the_experts_constants_loads_with_the_built_in_ones():
    """A calibrated profile written before Hardware.experts existed has no such key: it takes its kind's built-in
    constants (and their source), not none (which would price an MoE layer's routing at nothing)."""
    import json

    data = PROFILES["h100"].to_json()
    del data["experts"], data["source"]["experts"]
    stored = Hardware.from_json(json.loads(json.dumps(data)))
    assert stored.experts == PROFILES["h100"].experts and stored.source["experts"] == PROFILES["h100"].source["experts"]


def test_a_profile_stored_before_ring_steps_had_a_latency_loads_with_the_built_in_ones():
    """A calibrated GPU profile written before Link.step_latency_s existed takes its kind's NCCL step latencies (an
    all-gather over 1,024 ranks is not priced as one over 2); a measured CPU profile, which has no built-in one,
    keeps 0 (two ranks: one step, which its measured call latency already is)."""
    import json

    data = PROFILES["h100"].to_json()
    for level in ("intra", "inter"):
        del data[level]["step_latency_s"]
    stored = Hardware.from_json(json.loads(json.dumps(data)))
    assert stored.intra == PROFILES["h100"].intra and stored.inter.step_latency_s == 14e-6
    cpu = {**data, "name": "cpu"}
    assert Hardware.from_json(json.loads(json.dumps(cpu))).intra.step_latency_s == 0.0
