"""Measure the machine the plan runs on: matrix-product FLOP/s at the model's shapes, memory bandwidth, and the
collectives' latency and bus bandwidth among this node's devices (bench/collectives.py, under torchrun).

On a CPU each training process of a `torchrun --nproc_per_node=P` job gets one thread (torchrun's default
OMP_NUM_THREADS=1 when P > 1), so the products are timed with cores // P threads: what one rank can reach.
The figures replace the profile's; what is not measured here (the link between nodes on one machine) keeps the
profile's figure, and `source` says which is which.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

from dist_train.estimate.shapes import ModelShape
from dist_train.estimate.hardware import GIB, PROFILES, Hardware, Link

ROOT = Path(__file__).resolve().parents[2]
COLLECTIVES = ROOT / "bench" / "collectives.py"
DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
# Message sizes the collectives are timed at: small ones show the latency, the largest the bandwidth.
SIZES = (16 * 2**10, 256 * 2**10, 4 * 2**20)


def _device():  # noqa: ANN202 - a torch.device, imported late (the plan itself needs no torch)
    import torch

    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


@contextlib.contextmanager
def rank_threads(procs_per_node: int) -> Iterator[int]:
    """torch's intra-op threads set to what one of `procs_per_node` CPU ranks has, for the time of the block."""
    import torch

    before = torch.get_num_threads()
    threads = max(1, (os.cpu_count() or 1) // procs_per_node)
    torch.set_num_threads(threads)
    try:
        yield threads
    finally:
        torch.set_num_threads(before)


def _sync(device) -> None:  # noqa: ANN001
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def matmul_shapes(shape: ModelShape) -> list[tuple[int, int]]:
    """(in, out) of one layer's matrix products and the LM head: what a token goes through."""
    h, q, kv, f = shape.hidden_size, shape.q_dim, shape.kv_dim, shape.ffn
    if shape.arch == "gpt2":
        layer = [(h, 3 * h), (h, h), (h, f), (f, h)]
    else:
        layer = [(h, q), (h, kv), (h, kv), (q, h), (h, f), (h, f), (f, h)]
    return [*layer, (h, shape.vocab_size)]


def matmul_flops(shape: ModelShape, *, tokens: int, precision: str, repeats: int = 7) -> float:
    """FLOP/s of the model's products for `tokens` tokens (one micro-batch), median of `repeats` passes."""
    import torch

    device = _device()
    dtype = getattr(torch, DTYPES[precision])
    gen = torch.Generator(device="cpu").manual_seed(0)
    pairs = [(torch.randn(tokens, i, generator=gen).to(device, dtype), torch.randn(i, o, generator=gen).to(device, dtype))
             for i, o in matmul_shapes(shape)]
    flops = sum(2.0 * tokens * i * o for i, o in matmul_shapes(shape))
    times = []
    for k in range(repeats + 2):  # two warm-up passes
        _sync(device)
        start = time.perf_counter()
        for a, b in pairs:
            a @ b
        _sync(device)
        if k >= 2:
            times.append(time.perf_counter() - start)
    return flops / statistics.median(times)


def memory_bandwidth(*, megabytes: int = 256, repeats: int = 7) -> float:
    """Bytes/s of a large copy (read + write), the optimizer step's kind of traffic."""
    import torch

    device = _device()
    src = torch.ones(megabytes * 2**20 // 4, device=device)
    dst = torch.empty_like(src)
    times = []
    for k in range(repeats + 1):
        _sync(device)
        start = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        if k:
            times.append(time.perf_counter() - start)
    return 2 * src.numel() * 4 / statistics.median(times)


def collective_link(procs: int, *, timeout_s: float = 300) -> tuple[Link, list[dict[str, float]]]:
    """Latency and bus bandwidth among `procs` local processes: all_reduce and all_gather at SIZES, timed in one
    launch (each launch starts a process group: NCCL's on 8 GPUs takes seconds), then the least-squares line
    time = latency + ring bytes / busbw through the medians."""
    from dist_train.estimate.comm import bus_factor

    cases = [f"{op}:{size}" for size in SIZES for op in ("all_reduce", "all_gather")]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={procs}",
           str(COLLECTIVES), *cases, "--iterations=20", "--by-case"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, cwd=ROOT)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:]
        raise RuntimeError(f"calibration: bench/collectives.py failed ({' '.join(tail)})")
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    points = []
    for case, r in got.items():
        op = case.split(":")[0]
        points.append({"op": op, "bytes": r["bytes"], "ring_bytes": r["bytes"] * bus_factor(op, procs),
                       "median_s": r["median_s"]})
    return fit_link(points), points


def fit_link(points: list[dict[str, float]]) -> Link:
    xs, ys = [p["ring_bytes"] for p in points], [p["median_s"] for p in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
    if slope <= 0:  # noise swamped the size: bandwidth of the largest message, latency of the smallest
        big = max(points, key=lambda p: p["ring_bytes"])
        small = min(points, key=lambda p: p["ring_bytes"])
        return Link(big["ring_bytes"] / big["median_s"], small["median_s"])
    return Link(1.0 / slope, max(0.0, my - slope * mx))


def host_memory_bytes() -> float:
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def calibrate(name: str, shape: ModelShape, *, tokens: int, precision: str, procs: int,
              measure_links: bool = True) -> Hardware:
    """The profile `name` (the datasheet one, or a bare CPU one) with what was measured here in its place (on a CPU,
    plan/probe.py then measures what separates the strategies)."""
    import torch

    when = datetime.date.today().isoformat()
    on_gpu = torch.cuda.is_available()
    base = PROFILES.get(name) or _bare_cpu(procs)
    with rank_threads(procs) if not on_gpu else contextlib.nullcontext(0) as threads:
        flops = matmul_flops(shape, tokens=tokens, precision=precision)
        bw = memory_bandwidth()
    how = f"measured {when}, {shape.name}'s products at {tokens} tokens" + (f", {threads} thread(s)" if threads else "")
    flops_table = dict(base.flops)
    if not on_gpu:  # a CPU has no datasheet: every dtype not measured is taken as fp32's speed
        flops_table = {k: flops for k in ("fp32", "tf32", "bf16", "fp16")}
    flops_table[precision] = flops
    source = {**base.source, "flops": f"{precision}: {how}", "memory_bw": f"measured {when}: a 256 MiB copy"}
    changes: dict = {"flops": flops_table, "memory_bw": bw, "source": source}
    if measure_links and procs > 1:
        link, _ = collective_link(procs)
        changes["intra"] = link
        source["intra"] = f"measured {when}: bench/collectives.py, {procs} processes, fitted latency + size/busbw"
        if not on_gpu:
            changes["inter"] = link
            source["inter"] = "not measured (one machine): taken as the link within it"
    if not on_gpu:
        changes["memory_bytes"] = host_memory_bytes() / procs
        source["memory_bytes"] = f"this host's memory / {procs} processes"
    return replace(base, **changes)


def _bare_cpu(procs: int) -> Hardware:
    """The cpu profile before anything is measured: its factors as this machine's runs were found to behave
    (gloo and the products share the cores: no overlap), to be refit by plan.verify."""
    return Hardware(
        name="cpu", memory_bytes=host_memory_bytes() / procs, flops={"fp32": 1.0}, memory_bw=1.0,
        intra=Link(1.0, 0.0), inter=Link(1.0, 0.0), gpus_per_node=procs, efficiency=1.0, overlap=0.0,
        source={"efficiency": "1 until plan.verify refits it", "overlap": "0: gloo and compute share the cores",
                "overhead_s": "0 until plan.verify refits each strategy's from its runs"},
    )


def describe(hw: Hardware) -> str:
    peak = ", ".join(f"{k} {v / 1e12:.3g} TFLOP/s" for k, v in hw.flops.items())

    def link(level: str) -> str:
        ln = getattr(hw, level)
        steps = f" (+ {ln.step_latency_s * 1e6:.2g} us a further step)" if ln.step_latency_s else ""
        return f"{level} {ln.busbw / 1e9:.3g} GB/s + {ln.latency_s * 1e6:.0f} us{steps}, "
    return (f"{hw.name}: {hw.memory_bytes / GIB:.1f} GiB, {peak}, memory {hw.memory_bw / 1e9:.3g} GB/s, "
            + link("intra") + link("inter")
            + (f"products {hw.gemm_efficiency:.3g} of the peak (half at k={hw.gemm_k_half:.0f}, {hw.sm_count} SMs), "
               f"attention {hw.attention_efficiency:.3g} (half at seq {hw.attention_seq_half:.0f}), memory-bound "
               f"{hw.memory_efficiency:.3g} of the bandwidth, " if hw.sm_count else "")
            + f"efficiency {hw.efficiency:.3g}, overlap {hw.overlap:.3g}"
            + (f", {hw.layer_overhead_s * 1e3:.3g} ms/block eager" if hw.layer_overhead_s else "")
            + "".join(f", {k} {v * 1e3:.3g} ms/block" for k, v in sorted(hw.overhead_s.items()) if v))
