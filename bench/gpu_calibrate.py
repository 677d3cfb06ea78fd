"""What one GPU can do for a training step, measured in a few minutes: a calibration for the time model.

    python bench/gpu_calibrate.py                       # on a CUDA machine: measure, store the profile, write docs
    python bench/gpu_calibrate.py --out calib.json      # also keep every measurement
    python bench/gpu_calibrate.py --from calib.json     # anywhere: print a kept file's tables (docs untouched)

It measures, in bf16 on the visible GPU (each figure the median of timed repetitions, CUDA events):
- the device's memory bandwidth (a device-to-device copy, bytes read and written);
- the matrix products of Llama 8B's and 70B's layers and LM head at 4,096 and 8,192 tokens: forward, the
  input's gradient and the weight's gradient, and the tensor-parallel slices (degree 8) of each;
- SDPA (flash, causal) forward and forward + backward at those shapes;
- one transformers `LlamaDecoderLayer` forward + backward at 8B and 70B sizes, seq 4,096 and 8,192, batch 1,
  with and without activation checkpointing;
- fused AdamW over 256M fp32 parameters; the loss over a 128,256-token vocabulary;
- a whole eager training step of model=llama_1b (2 micro-batches of 4 x 2048 tokens);
- one Qwen3-MoE block (router and experts) at Qwen3-30B-A3B's, OLMoE's and Mixtral's sizes, eager and grouped_mm
  experts, in bf16, and again with fp32 weights under bf16 autocast, as dist_train trains (`moe_autocast`).

From them it writes a hardware profile (dist_train/estimate/hardware.py) where `cluster.gpu=<kind>` finds it on
this host (plan.profile_dir, default ~/.cache/dist_train/profiles): the datasheet's peaks, the measured memory
bandwidth, and as `efficiency` the fraction of the peak at which the time model's compute term gives the whole
step's measured time (its FLOPs counted as the time model counts them). Each figure's `source` says it was
measured, where and when. The 'gpu-calibrate' section of docs/BENCHMARKS.md gets every figure. Without a CUDA
device it measures nothing and exits 0.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import ROOT, md_table, write_section  # noqa: E402

sys.path.insert(0, str(ROOT))

# Llama 3 shapes: hidden, heads, kv heads, MLP, vocabulary (the published configs).
MODELS = {
    "llama-8b": dict(hidden=4096, heads=32, kv_heads=8, ffn=14336, vocab=128256),
    "llama-70b": dict(hidden=8192, heads=64, kv_heads=8, ffn=28672, vocab=128256),
}
SEQS = (4096, 8192)
# the layer's activation checkpointing, as train.activation_checkpointing names it (selective: dist_train's policy)
CHECKPOINTING = ("none", "full", "selective")
TP = 8
HEAD_DIM = 128


def timed(fn: Callable[[], Any], *, reps: int, warmup: int = 2) -> float:
    """Median seconds of one call of fn, each timed by CUDA events on the current stream."""
    import torch

    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def memory_bandwidth() -> dict[str, float]:
    import torch

    n = 2**30  # 2 GiB of bf16 each way
    src, dst = torch.empty(n, dtype=torch.bfloat16, device="cuda"), torch.empty(n, dtype=torch.bfloat16, device="cuda")
    s = timed(lambda: dst.copy_(src), reps=10)
    return {"bytes": 4 * n, "s": s, "bytes_per_s": 4 * n / s}


def matmuls() -> list[dict[str, Any]]:
    """Each GEMM of a layer and the head as (M tokens, K in, N out); forward Y = X W, dgrad dX = dY W^T,
    wgrad dW = X^T dY, in the layouts autograd hands to cuBLAS (nn.Linear's weight is (N, K))."""
    import torch

    rows = []
    for model, s in MODELS.items():
        h, q, kv, ffn, vocab = s["hidden"], s["heads"] * HEAD_DIM, s["kv_heads"] * HEAD_DIM, s["ffn"], s["vocab"]
        gemms = {"q": (h, q), "kv": (h, kv), "o": (q, h), "gate_up": (h, ffn), "down": (ffn, h), "head": (h, vocab)}
        for m in SEQS:
            for name, (k, n) in gemms.items():
                for tp in (1, TP):
                    if tp > 1 and name == "head":
                        continue
                    # column-parallel layers split N, row-parallel ones (o, down) split K
                    kk, nn = (k // tp, n) if name in ("o", "down") else (k, n // tp) if tp > 1 else (k, n)
                    x = torch.randn(m, kk, dtype=torch.bfloat16, device="cuda")
                    w = torch.randn(nn, kk, dtype=torch.bfloat16, device="cuda")
                    dy = torch.randn(m, nn, dtype=torch.bfloat16, device="cuda")
                    flops = 2.0 * m * kk * nn
                    for kind, fn in (
                        ("fwd", lambda: x @ w.t()),
                        ("dgrad", lambda: dy @ w),
                        ("wgrad", lambda: dy.t() @ x),
                    ):
                        sec = timed(fn, reps=8)
                        rows.append(
                            {
                                "model": model,
                                "gemm": name,
                                "tp": tp,
                                "kind": kind,
                                "m": m,
                                "k": kk,
                                "n": nn,
                                "s": sec,
                                "flops_per_s": flops / sec,
                            }
                        )
    return rows


def attention() -> list[dict[str, Any]]:
    import torch
    import torch.nn.functional as F

    rows = []
    for model, s in MODELS.items():
        for t in SEQS:
            q = torch.randn(1, s["heads"], t, HEAD_DIM, dtype=torch.bfloat16, device="cuda", requires_grad=True)
            k = torch.randn(1, s["kv_heads"], t, HEAD_DIM, dtype=torch.bfloat16, device="cuda", requires_grad=True)
            v = torch.randn_like(k, requires_grad=True)

            def fwd():
                F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

            def fwd_bwd():
                F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).sum().backward()

            causal_fwd_flops = 4.0 * t * t * HEAD_DIM * s["heads"] / 2  # QK^T and PV, half of them masked
            f, fb = timed(fwd, reps=8), timed(fwd_bwd, reps=8)
            rows.append(
                {
                    "model": model,
                    "seq": t,
                    "fwd_s": f,
                    "fwd_bwd_s": fb,
                    "fwd_flops_per_s": causal_fwd_flops / f,
                    "fwd_bwd_flops_per_s": 3.5 * causal_fwd_flops / fb,
                }
            )
    return rows


def layer_shape(model: str) -> Any:
    """One layer of MODELS[model] as the estimator's ModelShape."""
    from dist_train.estimate.shapes import ModelShape

    s = MODELS[model]
    return ModelShape(name=model, arch="llama", num_layers=1, hidden_size=s["hidden"], num_heads=s["heads"],
                      num_kv_heads=s["kv_heads"], ffn_hidden_size=s["ffn"], vocab_size=s["vocab"],
                      max_seq_len=max(SEQS))


def layer_flops(model: str, seq: int, *, recompute: bool) -> float:
    """Forward + backward FLOPs of one layer and sequence, counted by dist_train's time model itself
    (estimate/step_time.py): 2 per weight and token forward, twice that backward, attention 4 q_dim T a token
    (not halved for the mask), one more forward where checkpointing recomputes it."""
    from dist_train.estimate.step_time import _matmul_flops_per_token

    return seq * _matmul_flops_per_token(layer_shape(model), layers=1, head=False, seq_len=seq, recompute=recompute)


def layers(*, models: tuple[str, ...] = tuple(MODELS), seqs: tuple[int, ...] = SEQS,
           modes: tuple[str, ...] = CHECKPOINTING) -> list[dict[str, Any]]:
    import torch
    from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    from dist_train.model import saved_ops, selective_policy

    selective = functools.partial(create_selective_checkpoint_contexts, selective_policy(saved_ops()))

    rows = []
    for model in models:
        s = MODELS[model]
        config = LlamaConfig(
            hidden_size=s["hidden"],
            num_attention_heads=s["heads"],
            num_key_value_heads=s["kv_heads"],
            intermediate_size=s["ffn"],
            vocab_size=s["vocab"],
            num_hidden_layers=1,
            max_position_embeddings=max(SEQS),
            attn_implementation="sdpa",
        )
        with torch.device("cuda"):
            layer = LlamaDecoderLayer(config, layer_idx=0).to(torch.bfloat16)
            rotary = LlamaRotaryEmbedding(config)
        for seq in seqs:
            x = torch.randn(1, seq, s["hidden"], dtype=torch.bfloat16, device="cuda", requires_grad=True)
            pos = torch.arange(seq, device="cuda")[None]
            cos_sin = rotary(x, pos)
            for mode in modes:

                def forward():
                    if mode == "none":
                        return layer(x, position_embeddings=cos_sin, position_ids=pos)
                    kwargs = {"context_fn": selective} if mode == "selective" else {}
                    return checkpoint(layer, x, position_embeddings=cos_sin, position_ids=pos, use_reentrant=False,
                                      **kwargs)

                def step():
                    y = forward()
                    y = y[0] if isinstance(y, tuple) else y
                    y.backward(torch.ones_like(y))

                torch.cuda.reset_peak_memory_stats()
                sec = timed(step, reps=5)
                peak_bytes = torch.cuda.max_memory_allocated()
                before = torch.cuda.memory_allocated()
                y = forward()  # what the forward leaves for backward, the output included
                saved = torch.cuda.memory_allocated() - before
                del y
                flops = layer_flops(model, seq, recompute=mode == "full")
                rows.append(
                    {
                        "model": model,
                        "seq": seq,
                        "checkpointing": mode,
                        "s": sec,
                        "model_flops_per_s": flops / sec,
                        "peak_allocated_bytes": peak_bytes,
                        "saved_bytes": saved,
                    }
                )
                layer.zero_grad(set_to_none=True)
        torch.cuda.empty_cache()
    return rows


# Selective checkpointing's host time: Llama 8B's layer over so few tokens that its kernels take a fraction of the
# time torch's selective checkpointing needs to issue them (its Python dispatch mode sees every op, forward and again
# in the recomputation); none beside it, whose eager dispatch has no such mode.
SELECTIVE_HOST_SEQ = 128


def selective_host() -> list[dict[str, Any]]:
    return layers(models=("llama-8b",), seqs=(SELECTIVE_HOST_SEQ,), modes=("none", "selective"))


def selective_host_s(calib: dict[str, Any], hw) -> float:  # noqa: ANN001
    """Hardware.selective_host_s from a calibration: its `selective_host` row (a layer too small for its kernels to
    hide the host), or, in a file without one, the longest selective layer of `layers` that took over 1.1 times
    what the per-operation model says its kernels take under `hw` (a host-bound one); 0 where none was."""
    from dataclasses import replace

    host = [r["s"] for r in calib.get("selective_host", []) if r["checkpointing"] == "selective"]
    if host:
        return float(host[0])
    rows = calib.get("layers", [])
    bound = [r["s"] for r, p in zip(rows, predicted_layers(calib, replace(hw, selective_host_s=0.0)))
             if checkpointing_of(r) == "selective" and r["s"] > 1.1 * p]
    return float(max(bound, default=0.0))


# MoE blocks (their config.json's sizes): hidden, experts, top-k, one expert's MLP width. Qwen3-30B-A3B's first: the
# one the docs' table names.
MOE_MODELS = (dict(model="qwen3-30b-a3b", hidden=2048, experts=128, top_k=8, ffn=768),
              dict(model="olmoe-1b-7b", hidden=2048, experts=64, top_k=8, ffn=1024),
              dict(model="mixtral-8x7b", hidden=4096, experts=8, top_k=2, ffn=14336))
MOE = MOE_MODELS[0]
MOE_TOKENS = (4096, 8192, 16384)


def moe_measured(calib: dict[str, Any]) -> list[tuple[Any, int, float]]:
    """A calibration's MoE blocks as estimate/ops.py fit_experts takes them: (the block's shape, with the experts
    implementation it ran, tokens, measured seconds)."""
    from dist_train.estimate.shapes import ModelShape

    sizes = {m["model"]: m for m in MOE_MODELS}
    out = []
    for r in calib.get("moe", []):
        s = sizes[r["model"]]
        shape = ModelShape(name=r["model"], arch="llama", num_layers=1, hidden_size=s["hidden"], num_heads=1,
                           vocab_size=1, max_seq_len=1, num_experts=s["experts"], experts_per_token=s["top_k"],
                           moe_ffn_hidden_size=s["ffn"], experts_implementation=r["implementation"])
        out.append((shape, r["tokens"], r["s"]))
    return out


def moe_blocks(*, autocast: bool = False, tokens_list: tuple[int, ...] = MOE_TOKENS) -> list[dict[str, Any]]:
    """One transformers `Qwen3MoeSparseMoeBlock` (router, top-k, experts) forward + backward at each MOE_MODELS
    shape (Qwen3-MoE's block with that model's sizes: the experts' products are the same), bf16, under each experts
    implementation dist_train pins (model.experts_implementation). batched_mm is
    left out: it gathers one expert's weights per routed row (T x k x 3 x H x F elements, 0.6 TB at 4,096 tokens).
    FLOPs are the active ones: the router and the top-k experts' three products, forward + backward.
    `autocast`: the block's weights in fp32 under bf16 autocast, as dist_train's precision=bf16 trains them."""
    import contextlib

    import torch
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    rows = []
    for moe, impl in ((m, i) for m in MOE_MODELS for i in ("eager", "grouped_mm")):
        h, e, k, f = moe["hidden"], moe["experts"], moe["top_k"], moe["ffn"]
        config = Qwen3MoeConfig(hidden_size=h, num_experts=e, num_experts_per_tok=k, moe_intermediate_size=f,
                                norm_topk_prob=True, num_hidden_layers=1)
        config._experts_implementation = impl
        with torch.device("cuda"):
            block = Qwen3MoeSparseMoeBlock(config)
        if not autocast:
            block = block.to(torch.bfloat16)
        for tokens in tokens_list:
            x = torch.randn(1, tokens, h, dtype=torch.float32 if autocast else torch.bfloat16, device="cuda",
                            requires_grad=True)

            def step():
                cast = torch.autocast("cuda", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
                with cast:
                    y = block(x)
                y = y[0] if isinstance(y, tuple) else y
                y.backward(torch.ones_like(y))

            torch.cuda.reset_peak_memory_stats()
            sec = timed(step, reps=5)
            flops = 3 * 2 * tokens * (h * e + k * 3 * h * f)
            rows.append({"model": moe["model"], "implementation": impl, "tokens": tokens, "s": sec,
                         "precision": "autocast" if autocast else "bf16",
                         "active_flops_per_s": flops / sec,
                         "peak_allocated_bytes": torch.cuda.max_memory_allocated()})
            block.zero_grad(set_to_none=True)
        torch.cuda.empty_cache()
    return rows


def optimizer_step() -> dict[str, float]:
    import torch

    n = 256 * 2**20
    p = torch.nn.Parameter(torch.zeros(n, device="cuda"))
    p.grad = torch.randn(n, device="cuda")
    opt = torch.optim.AdamW([p], lr=1e-4, fused=True)
    sec = timed(opt.step, reps=10)
    # fp32 parameter, gradient and two moments: read 4 tensors, write 3 (28 bytes a parameter); the time model
    # charges 2 x the 16 bytes of state at the memory bandwidth
    return {"params": n, "s": sec, "bytes_per_s_28B": 28 * n / sec, "model_bytes_per_s_32B": 32 * n / sec}


def loss_over_vocab() -> list[dict[str, float]]:
    import torch
    import torch.nn.functional as F

    rows = []
    vocab = MODELS["llama-8b"]["vocab"]
    for tokens in SEQS:
        logits = torch.randn(tokens, vocab, dtype=torch.bfloat16, device="cuda", requires_grad=True)
        labels = torch.randint(vocab, (tokens,), device="cuda")
        sec = timed(lambda: F.cross_entropy(logits.float(), labels).backward(), reps=8)
        rows.append(
            {
                "tokens": tokens,
                "vocab": vocab,
                "s": sec,
                "logit_bytes": 2 * tokens * vocab,
                "logit_bytes_per_s": 2 * tokens * vocab / sec,
            }
        )
    return rows


STEP_MODEL, STEP_SEQ, STEP_MICRO, STEP_ACCUM = "llama_1b", 2048, 4, 2


def whole_step() -> dict[str, Any]:
    """A whole training step of model=llama_1b on this GPU, in a plain loop: fp32 weights under bf16 autocast,
    2 micro-batches of 4 x 2048 tokens, fused AdamW, eager (what dist_train's strategies run without
    train.compile). The profile's `efficiency` is the one that makes the time model's compute term reproduce
    this step: model FLOPs (counted as estimate/step_time.py counts them) / (peak x (step - its optimizer term))."""
    import torch

    from dist_train.estimate.compose import compose_run
    from dist_train.estimate.shapes import ModelShape
    from dist_train.estimate.step_time import _matmul_flops_per_token
    from dist_train.model import _constructor, forward_loss

    cfg = compose_run([f"model={STEP_MODEL}"]).model  # the model training builds, from conf/model
    shape = ModelShape.from_config(cfg)
    with torch.device("cuda"):
        model = _constructor(cfg)()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    ids = torch.randint(shape.vocab_size, (STEP_ACCUM, STEP_MICRO, STEP_SEQ), device="cuda")

    def step():
        for micro in ids:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = forward_loss(model, micro, micro)  # training's loss: the fp32 cross-entropy
            (loss / STEP_ACCUM).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    torch.cuda.reset_peak_memory_stats()
    sec = timed(step, reps=5, warmup=3)
    tokens = STEP_ACCUM * STEP_MICRO * STEP_SEQ
    flops = tokens * _matmul_flops_per_token(
        shape, layers=shape.num_layers, head=True, seq_len=STEP_SEQ, recompute=False
    )
    state = 16 * sum(p.numel() for p in model.parameters())  # fp32 weights, gradients, two moments
    return {
        "model": STEP_MODEL,
        "seq": STEP_SEQ,
        "micro_batch": STEP_MICRO,
        "accumulation": STEP_ACCUM,
        "s": sec,
        "tokens_per_s": tokens / sec,
        "model_flops": flops,
        "state_bytes": state,
        "peak_allocated_bytes": torch.cuda.max_memory_allocated(),
    }


def measure(budget_s: float, *, only: set[str] | None = None) -> dict[str, Any]:
    import torch

    props = torch.cuda.get_device_properties(0)
    out: dict[str, Any] = {
        "device": torch.cuda.get_device_name(0),
        "sms": props.multi_processor_count,
        "memory_bytes": props.total_memory,
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
        "skipped": [],
    }
    try:
        import transformers

        out["transformers"] = transformers.__version__
    except ImportError:
        out["transformers"] = None
    start = time.monotonic()
    for name, fn in (
        ("memory_bandwidth", memory_bandwidth),
        ("layers", layers),
        ("matmuls", matmuls),
        ("attention", attention),
        ("optimizer", optimizer_step),
        ("loss", loss_over_vocab),
        ("step", whole_step),
        ("moe", moe_blocks),
        ("moe_autocast", functools.partial(moe_blocks, autocast=True, tokens_list=MOE_TOKENS[:2])),
        ("selective_host", selective_host),
    ):
        if only is not None and name not in only:
            continue
        if time.monotonic() - start > budget_s:
            out["skipped"].append(f"{name}: over the {budget_s:.0f} s budget")
            continue
        t0 = time.monotonic()
        try:
            out[name] = fn()
        except Exception as exc:  # one failed measurement leaves the others
            out["skipped"].append(f"{name}: {type(exc).__name__}: {exc}"[:300])
        print(f"gpu_calibrate: {name} {time.monotonic() - t0:.1f} s", flush=True)
        torch.cuda.empty_cache()
    return out


def profile_from(calib: dict[str, Any]):
    """The hardware profile these measurements make: the datasheet one with the per-operation constants fitted to
    the measured products and attention (estimate/ops.py fit_gemm, fit_attention), the measured memory bandwidth,
    and as `efficiency` what the whole step loses beyond the per-operation model; each figure's source names this
    calibration."""
    from dataclasses import replace

    from dist_train.estimate.hardware import PROFILES, profile_for_device
    from dist_train.estimate.ops import fit_attention, fit_experts, fit_gemm

    kind = profile_for_device(calib["device"])
    if kind not in PROFILES or not any(calib.get(k) for k in ("memory_bandwidth", "matmuls", "attention", "step",
                                                                 "selective_host")):
        return None  # nothing measured that a profile takes (--only moe)
    base = PROFILES[kind]
    peak = base.flops["bf16"]
    where = f"measured by bench/gpu_calibrate.py on {calib['device']}, torch {calib['torch']}, {calib['date']}"
    source = dict(base.source)
    changes: dict[str, Any] = {"sm_count": calib["sms"]}
    source["sm_count"] = where
    if "memory_bandwidth" in calib:
        changes.update(memory_bw=calib["memory_bandwidth"]["bytes_per_s"], memory_efficiency=1.0)
        source["memory_bw"] = f"{where} (device-to-device copy)"
        source["memory_efficiency"] = "1: memory_bw is measured"
    if calib.get("matmuls"):
        eff, k_half = fit_gemm(calib["matmuls"], sms=calib["sms"], peak=peak)
        changes.update(gemm_efficiency=eff, gemm_k_half=k_half)
        source["gemm_efficiency"] = source["gemm_k_half"] = f"{where}: fitted to {len(calib['matmuls'])} products"
    if calib.get("attention"):
        eff, seq_half = fit_attention(calib["attention"], peak=peak)
        changes.update(attention_efficiency=eff, attention_seq_half=seq_half)
        source["attention_efficiency"] = source["attention_seq_half"] = f"{where}: fitted to SDPA at each shape"
    host = selective_host_s(calib, replace(base, **changes))
    if host:
        changes["selective_host_s"] = host
        source["selective_host_s"] = (f"{where}: llama-8b's layer under selective at {SELECTIVE_HOST_SEQ} tokens"
                                      if calib.get("selective_host") else f"{where}: its host-bound selective layer")
    if calib.get("moe"):
        changes["experts"] = fit_experts(moe_measured(calib), replace(base, **changes))
        source["experts"] = f"{where}: fitted to {len(calib['moe'])} MoE blocks (estimate/ops.py fit_experts)"
    if calib.get("step"):
        changes["efficiency"] = round(step_efficiency(calib, replace(base, **changes)), 4)
        source["efficiency"] = (
            f"{where}: a whole eager training step of {STEP_MODEL} (bf16 autocast, "
            f"{STEP_ACCUM} x {STEP_MICRO} x {STEP_SEQ} tokens, fused AdamW): the per-operation model's compute / "
            "(step - the optimizer term)"
        )
    return replace(base, **changes, source=source)


def checkpointing_of(row: dict[str, Any]) -> str:
    """A layer row's checkpointing as train.activation_checkpointing names it (the files of 2026-11-26 and of the H100
    kept a bool: full or none)."""
    value = row["checkpointing"]
    return value if isinstance(value, str) else ("full" if value else "none")


def predicted_layers(calib: dict[str, Any], hw) -> list[float]:  # noqa: ANN001
    """The per-operation model's seconds for each measured decoder layer (batch 1, bf16) under `hw`."""
    from dist_train.estimate.ops import layer_compute

    return [layer_compute(layer_shape(r["model"]), batch=1, seq_len=r["seq"], tp=1, sequence_parallel=False,
                          recompute=checkpointing_of(r), hw=hw, peak=hw.flops["bf16"],
                          element_bytes=2).total_s for r in calib["layers"]]


def step_efficiency(calib: dict[str, Any], hw) -> float:  # noqa: ANN001
    """The factor on the per-operation model's compute at which it, plus the optimizer term, gives the measured
    step: what the step spends beyond its kernels (launches, the framework, the embedding)."""
    from dataclasses import replace

    from dist_train.estimate.compose import compose_run
    from dist_train.estimate.setup import Setup
    from dist_train.estimate.shapes import ModelShape
    from dist_train.estimate.step_time import predict_step

    step = calib["step"]
    shape = ModelShape.from_config(compose_run([f"model={step['model']}"]).model)
    setup = Setup(strategy="single", family="single", precision="bf16", micro_batch_size=step["micro_batch"],
                  seq_len=step["seq"], global_batch_size=step["micro_batch"] * step["accumulation"])
    t = predict_step(shape, setup, replace(hw, efficiency=1.0), model_state_bytes=step["state_bytes"])
    return t.compute_s / (step["s"] - t.optimizer_s)


def render(calib: dict[str, Any]) -> str:
    from dist_train.estimate.hardware import PROFILES, profile_for_device

    kind = profile_for_device(calib["device"])
    peak = PROFILES[kind].flops["bf16"] if kind in PROFILES else None
    tf = 1e12

    def pct(flops_per_s: float) -> str:
        return f"{flops_per_s / peak:.0%}" if peak else ""

    parts = [
        f"{calib['device']}, {calib['sms']} SMs, torch {calib['torch']}, transformers {calib['transformers']}, "
        f"{calib['date']}. Percentages are of the datasheet's dense bf16 peak "
        f"({peak / tf:.0f} TFLOP/s)."
        if peak
        else f"{calib['device']}: no datasheet peak known."
    ]
    if "memory_bandwidth" in calib:
        bw = calib["memory_bandwidth"]
        parts.append(
            f"Memory bandwidth (device-to-device copy of 2 GiB, read + written): {bw['bytes_per_s'] / 1e12:.2f} TB/s."
        )
    if calib.get("layers"):
        parts.append(
            "One decoder layer, forward + backward, batch 1, bf16 (model FLOPs as the time model counts them):\n\n"
            + md_table(
                ["model", "seq", "checkpointing", "ms", "TFLOP/s", "of peak", "peak allocated (GiB)",
                 "kept for backward (GiB)"],
                [
                    [
                        r["model"],
                        r["seq"],
                        checkpointing_of(r),
                        f"{r['s'] * 1e3:.2f}",
                        f"{r['model_flops_per_s'] / tf:.0f}",
                        pct(r["model_flops_per_s"]),
                        f"{r['peak_allocated_bytes'] / 2**30:.2f}",
                        f"{r['saved_bytes'] / 2**30:.3f}" if "saved_bytes" in r else "-",
                    ]
                    for r in calib["layers"]
                ],
            )
        )
    if calib.get("selective_host"):
        by_mode = {r["checkpointing"]: r["s"] for r in calib["selective_host"]}
        parts.append(
            f"Selective checkpointing's host time (llama-8b's layer at {SELECTIVE_HOST_SEQ} tokens, forward + "
            f"backward, its kernels a fraction of it): {by_mode.get('selective', 0) * 1e3:.2f} ms under selective, "
            f"{by_mode.get('none', 0) * 1e3:.2f} ms without checkpointing; the profile's selective_host_s."
        )
    if calib.get("attention"):
        parts.append(
            "SDPA (causal, GQA, head dim 128, batch 1); FLOPs counted for the unmasked half:\n\n"
            + md_table(
                ["model", "seq", "fwd ms", "fwd TFLOP/s", "fwd+bwd ms", "fwd+bwd TFLOP/s"],
                [
                    [
                        r["model"],
                        r["seq"],
                        f"{r['fwd_s'] * 1e3:.2f}",
                        f"{r['fwd_flops_per_s'] / tf:.0f}",
                        f"{r['fwd_bwd_s'] * 1e3:.2f}",
                        f"{r['fwd_bwd_flops_per_s'] / tf:.0f}",
                    ]
                    for r in calib["attention"]
                ],
            )
        )
    if calib.get("matmuls"):
        parts.append(
            "Matrix products (M tokens x K in -> N out; TFLOP/s of forward / input gradient / weight gradient):\n\n"
            + md_table(["model", "gemm", "tp", "M", "K", "N", "fwd", "dgrad", "wgrad"], _matmul_rows(calib))
        )
    if calib.get("step"):
        st = calib["step"]
        parts.append(
            f"A whole eager training step of {st['model']} ({st['accumulation']} x {st['micro_batch']} x {st['seq']} "
            f"tokens, bf16 autocast, fused AdamW, a plain loop): {st['s'] * 1e3:.1f} ms, "
            f"{st['tokens_per_s']:,.0f} tokens/s, model FLOPs at {pct(st['model_flops'] / st['s'])} of the peak, "
            f"peak allocated {st['peak_allocated_bytes'] / 2**30:.2f} GiB."
        )
    if calib.get("moe_autocast"):
        parts.append(
            "The same MoE blocks with fp32 weights under bf16 autocast (dist_train's precision=bf16); not fitted:\n\n"
            + md_table(["model", "experts implementation", "tokens", "ms", "TFLOP/s", "of peak",
                        "peak allocated (GiB)"],
                       [[r["model"], r["implementation"], r["tokens"], f"{r['s'] * 1e3:.2f}",
                         f"{r['active_flops_per_s'] / tf:.0f}", pct(r["active_flops_per_s"]),
                         f"{r['peak_allocated_bytes'] / 2**30:.2f}"] for r in calib["moe_autocast"]])
        )
    if calib.get("moe"):
        parts.append(
            "One MoE block (router, top-k experts) at each model's sizes ("
            + "; ".join(f"{m['model']}: top-{m['top_k']} of {m['experts']} experts of width {m['ffn']}, hidden "
                        f"{m['hidden']}" for m in MOE_MODELS if any(r["model"] == m["model"] for r in calib["moe"]))
            + "), forward + backward, bf16; TFLOP/s of the active FLOPs:\n\n"
            + md_table(["model", "experts implementation", "tokens", "ms", "TFLOP/s", "of peak",
                        "peak allocated (GiB)"],
                       [[r["model"], r["implementation"], r["tokens"], f"{r['s'] * 1e3:.2f}",
                         f"{r['active_flops_per_s'] / tf:.0f}", pct(r["active_flops_per_s"]),
                         f"{r['peak_allocated_bytes'] / 2**30:.2f}"] for r in calib["moe"]])
        )
    if calib.get("optimizer"):
        o = calib["optimizer"]
        parts.append(
            f"Fused AdamW over {o['params'] / 2**20:.0f}M fp32 parameters: {o['s'] * 1e3:.2f} ms, "
            f"{o['bytes_per_s_28B'] / 1e12:.2f} TB/s of the 28 bytes a parameter it reads and writes "
            f"(the time model charges 32 bytes at the memory bandwidth: {o['model_bytes_per_s_32B'] / 1e12:.2f} TB/s)."
        )
    if calib.get("loss"):
        parts.append(
            "Cross-entropy forward + backward over the vocabulary (bf16 logits upcast to fp32): "
            + "; ".join(
                f"{r['tokens']} tokens x {r['vocab']}: {r['s'] * 1e3:.2f} ms "
                f"({r['logit_bytes_per_s'] / 1e12:.2f} TB/s of bf16 logits)"
                for r in calib["loss"]
            )
            + "."
        )
    prof = profile_from(calib)
    if prof is not None:
        parts.append(
            f"Profile written for `cluster.gpu={prof.name}` on that host: memory_bw {prof.memory_bw / 1e12:.2f} TB/s; "
            f"matrix products at {prof.gemm_efficiency:.3f} of the peak, halved at an inner dimension of "
            f"{prof.gemm_k_half:.0f}, over {prof.sm_count} SMs; attention at {prof.attention_efficiency:.3f}, halved "
            f"at a sequence of {prof.attention_seq_half:.0f}; efficiency {prof.efficiency:.3f}, what the whole step "
            "spends beyond the per-operation model (estimate/ops.py)."
        )
        if calib.get("layers"):
            parts.append("The per-operation model with this profile against the measured decoder layers (nothing "
                         "in it was fitted to them):\n\n" + md_table(
                             ["model", "seq", "checkpointing", "measured ms", "predicted ms", "error"],
                             [[r["model"], r["seq"], checkpointing_of(r), f"{r['s'] * 1e3:.2f}",
                               f"{p * 1e3:.2f}", f"{p / r['s'] - 1:+.1%}"]
                              for r, p in zip(calib["layers"], predicted_layers(calib, prof))]))
    if calib.get("skipped"):
        parts.append("Not measured: " + "; ".join(calib["skipped"]) + ".")
    return "\n\n".join(parts)


def _matmul_rows(calib: dict[str, Any]) -> list[list[Any]]:
    by_shape: dict[tuple, dict[str, float]] = {}
    for r in calib["matmuls"]:
        by_shape.setdefault((r["model"], r["gemm"], r["tp"], r["m"], r["k"], r["n"]), {})[r["kind"]] = r["flops_per_s"]
    return [
        [*key, *(f"{kinds.get(k, 0) / 1e12:.0f}" for k in ("fwd", "dgrad", "wgrad"))] for key, kinds in by_shape.items()
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="also keep every measurement in this JSON file")
    parser.add_argument("--from", dest="from_file", type=Path,
                        help="print a kept file's tables; the docs section is written only where it was measured")
    parser.add_argument("--budget-s", type=float, default=300.0, help="skip the measurements that would start later")
    parser.add_argument("--profile-dir", type=Path, help="where cluster.gpu= finds it (default: plan.profile_dir's)")
    parser.add_argument("--no-docs", action="store_true")
    parser.add_argument("--only", help="measure only these, comma-separated (memory_bandwidth, layers, matmuls, "
                                       "attention, optimizer, loss, step, moe, moe_autocast, selective_host)")
    args = parser.parse_args()
    if args.from_file:
        calib = json.loads(args.from_file.read_text())
    else:
        import torch

        if not torch.cuda.is_available():
            print("gpu_calibrate: no CUDA device is visible; nothing was measured", file=sys.stderr)
            return 0
        calib = measure(args.budget_s, only=set(args.only.split(",")) if args.only else None)
        if args.out:
            args.out.write_text(json.dumps(calib, indent=1))
        prof = profile_from(calib)
        if prof is not None:
            from dist_train.estimate.hardware import default_profile_dir, save_profile

            print(f"gpu_calibrate: profile {save_profile(prof, args.profile_dir or default_profile_dir())}")
    text = render(calib)
    print(text)
    if not args.no_docs and not args.from_file:  # the section names the machine it is written on
        write_section(
            "gpu-calibrate",
            "One GPU's calibration for the time model",
            text,
            command="python bench/gpu_calibrate.py --out calib.json",
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
