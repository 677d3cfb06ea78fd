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
