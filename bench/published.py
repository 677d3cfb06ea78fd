"""The time model against published GPU training runs (../shared/GPU-PUBLISHED.md): the calibration table.

    python bench/published.py             # writes the 'published' section of docs/BENCHMARKS.md
    python bench/published.py --no-write  # prints it
    python bench/published.py --fit       # the per-operation constants fitted to MosaicML's rows (FITTED)
    python bench/published.py --loo       # each of those rows under the constants fitted without it
    python bench/published.py --bound     # the smallest worst error any constants of this form reach on them

Each published row goes through the advisor's own search (dist_train.plan.search, what `launch/plan.py` runs),
pinned to the row's strategy, degrees, micro-batch, checkpointing and global batch, with the datasheet profile of the
row's GPU (cluster.gpu=h100 or a100, 8 GPUs a node, bf16). Beside the published tokens per second per GPU it writes
the prediction, the error, and whether the advisor would have offered the configuration at all (its predicted peak
against 90% of the device's memory): a configuration the memory model refuses is still timed here, since the row
shows it ran. FSDP accumulating over several micro-batches is searched both ways, as the advisor searches it
(gradients held unsharded, or reduce-scattered after every micro-batch): the row takes the fastest that fits.

A setting the source does not state is an input, said in the table: Megatron's micro-batch (1 here) and its precision
(bf16). Each row's shape is a `gpt2` config (LayerNorm, GELU 4h MLP, tied embeddings), as MPT's and Megatron's GPT
models are, with their vocabulary; MPT's ALiBi has no position table, which GPT-2's learned positions add (under
0.2% of the parameters here). Megatron's rows map to the nearest dist_train composition, named in the table: data
parallelism alone as ddp (its distributed optimizer's reduce-scatter and gather overlap backward and the next
forward, as DDP's all-reduce does; zero1 here reduces after backward), tensor x data parallelism as ddp_tp (whole
replicas of each TP slice, its gradients all-reduced once a step, as Megatron's are), with its tensor-parallel
all-reduces hidden behind compute on the H100 rows, as Megatron-Core r0.8 overlaps them (OVERLAPPED; the summary
gives their errors with the all-reduces exposed, as dist_train's tp runs them); tensor x pipeline x data
parallelism has no composition here and is not predicted.

Held out: torchtitan's FSDP2 tables (pytorch/torchtitan docs/performance.md: Llama 3 8B and 70B at seq 8,192, Llama 2
13B and 70B at 4,096, on 64 A100 80GB, local batch = micro-batch, words per second per GPU), put through the same
search after the fit and fitted to nothing. Their "selective op" is dist_train's selective (torchtitan also
recomputes every second matrix product, which dist_train keeps), "selective layer" full checkpointing of every
second block (train.checkpoint_every=2). The source states neither its network nor whether it compiled: the a100
profile's (InfiniBand HDR, 23 GB/s a GPU between nodes, assumed) and eager are inputs here.

Targets (issue 41): MosaicML's rows within 10%, Megatron's within 20%. The time model is per operation
(dist_train/estimate/ops.py). The H100's matrix-product, attention and memory constants were measured on an H100
(bench/gpu_calibrate.py); the A100's matrix-product and attention efficiencies, and the attention of MosaicML's H100
rows (MPT's ALiBi kernel, STACKS), were fitted to the MosaicML rows below (`--fit`, five numbers for sixteen rows);
nothing is fitted per row, and Megatron's rows are not fitted.
"""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import md_table, write_section  # noqa: E402


@dataclass(frozen=True)
class Row:
    source: str  # mosaicml | megatron | torchtitan (held out: no target, nothing fitted to it)
    gpu: str  # the profile: h100 | a100
    name: str
    hidden: int
    layers: int
    heads: int
    vocab: int
    seq: int
    gpus: int
    micro: int
    global_batch: int
    checkpointing: str  # train.activation_checkpointing: none | full | selective
    published: float  # tokens/s per GPU
    tp: int = 1
    pp: int = 1
    derived: bool = False  # tokens/s derived from published TFLOP/s (GPU-PUBLISHED.md says how)
    checkpoint_every: int = 1  # train.checkpoint_every (torchtitan's "selective layer": full, every 2nd block)
    arch: str = "gpt2"  # gpt2: MPT's and Megatron's GPT shapes; llama: Llama 2 and 3 (GQA, SwiGLU, untied)
    kv_heads: int = 0  # llama: key/value heads
    ffn: int = 0  # llama: the MLP's width


MPT = {"1b": (2048, 24, 16), "3b": (2560, 32, 20), "7b": (4096, 32, 32), "13b": (5120, 40, 40),
       "30b": (7168, 48, 56), "70b": (8192, 80, 64)}


def _mpt(gpu: str, model: str, seq: int, gpus: int, micro: int, accum: int, ckpt: bool, tokens: float) -> Row:
    hidden, layers, heads = MPT[model]
    return Row("mosaicml", gpu, f"MPT-{model}", hidden, layers, heads, 50368, seq, gpus, micro,
               micro * accum * gpus, "full" if ckpt else "none", tokens)


# Llama shapes (the published configs): hidden, layers, heads, kv heads, MLP, vocabulary, the sequence trained
LLAMA = {"Llama 3 8B": (4096, 32, 32, 8, 14336, 128256, 8192), "Llama 3 70B": (8192, 80, 64, 8, 28672, 128256, 8192),
         "Llama 2 13B": (5120, 40, 40, 40, 13824, 32000, 4096), "Llama 2 70B": (8192, 80, 64, 8, 28672, 32000, 4096)}


def _titan(model: str, local_batch: int, ac: str, wps: float) -> Row:
    """torchtitan's docs/performance.md (pytorch/torchtitan at 0413364): FSDP2 on 64 A100 80GB, local batch =
    micro-batch (no accumulation), bf16; "selective op" is dist_train's selective (torchtitan recomputes every
    second matrix product besides; dist_train keeps them all), "selective layer" full checkpointing of every
    second block."""
    hidden, layers, heads, kv, ffn, vocab, seq = LLAMA[model]
    ckpt, every = {"no": ("none", 1), "full": ("full", 1), "selective op": ("selective", 1),
                   "selective layer": ("full", 2)}[ac]
    return Row("torchtitan", "a100", model, hidden, layers, heads, vocab, seq, 64, local_batch, local_batch * 64,
               ckpt, wps, checkpoint_every=every, arch="llama", kv_heads=kv, ffn=ffn)


ROWS = [
    # MosaicML llm-foundry, FSDP FULL_SHARD, bf16 (GPU-PUBLISHED.md section 1): micro, accumulation, AC
    _mpt("h100", "70b", 2048, 64, 8, 4, True, 1039), _mpt("h100", "30b", 2048, 8, 3, 21, True, 2002),
    _mpt("h100", "30b", 8192, 8, 1, 21, True, 1384), _mpt("h100", "13b", 2048, 8, 2, 1, False, 4792),
    _mpt("h100", "13b", 4096, 8, 10, 3, True, 4717), _mpt("h100", "7b", 2048, 8, 6, 1, False, 10643),
    _mpt("h100", "7b", 8192, 8, 8, 2, True, 6935), _mpt("h100", "7b", 32768, 8, 2, 2, True, 3318),
    _mpt("h100", "3b", 2048, 64, 6, 3, False, 22525), _mpt("h100", "1b", 2048, 8, 14, 1, False, 45455),
    _mpt("a100", "70b", 2048, 64, 8, 4, True, 410), _mpt("a100", "30b", 2048, 8, 3, 21, True, 916),
    _mpt("a100", "13b", 2048, 8, 2, 3, False, 2262), _mpt("a100", "7b", 2048, 8, 6, 2, False, 4641),
    _mpt("a100", "7b", 8192, 8, 8, 2, True, 3206), _mpt("a100", "1b", 2048, 8, 14, 4, False, 20513),
    # Megatron-LM on H100 (section 2): vocabulary 131,072, seq 4096, micro-batch and recompute unstated
    Row("megatron", "h100", "GPT 1.7B", 2048, 24, 16, 131072, 4096, 48, 1, 192, "none", 36260, derived=True),
    Row("megatron", "h100", "GPT 7.1B", 4096, 30, 32, 131072, 4096, 96, 1, 192, "none", 10240, tp=2, derived=True),
    Row("megatron", "h100", "GPT 16B", 6144, 32, 48, 131072, 4096, 192, 1, 192, "none", 4820, tp=4, derived=True),
    Row("megatron", "h100", "GPT 32B", 7168, 48, 56, 131072, 4096, 384, 1, 192, "none", 2297, tp=8, derived=True),
    Row("megatron", "h100", "GPT 70B", 8192, 84, 64, 131072, 4096, 768, 1, 384, "none", 941, tp=8, pp=2,
        derived=True),
    # Megatron-LM on A100 80GB, Narayanan et al. 2021 (section 3): vocabulary 51,200, seq 2048, recompute
    Row("megatron", "a100", "GPT 1.7B", 2304, 24, 24, 51200, 2048, 32, 1, 512, "full", 9288, derived=True),
    Row("megatron", "a100", "GPT 7.5B", 4096, 36, 32, 51200, 2048, 128, 1, 512, "full", 2216, tp=4, derived=True),
    Row("megatron", "a100", "GPT 39.1B", 8192, 48, 64, 51200, 2048, 512, 1, 1536, "full", 425, tp=8, pp=2,
        derived=True),
    Row("megatron", "a100", "GPT 145.6B", 12288, 80, 96, 51200, 2048, 1536, 1, 2304, "full", 124, tp=8, pp=8,
        derived=True),
    # Held out (not in GPU-PUBLISHED.md; nothing fitted to it): torchtitan's FSDP2 tables, 64 A100 80GB
    _titan("Llama 3 8B", 1, "selective layer", 2904), _titan("Llama 3 8B", 1, "selective op", 2973),
    _titan("Llama 3 70B", 1, "full", 331), _titan("Llama 2 13B", 2, "no", 2162),
    _titan("Llama 2 13B", 2, "selective layer", 1914), _titan("Llama 2 13B", 2, "selective op", 1904),
    _titan("Llama 2 70B", 1, "selective op", 355), _titan("Llama 2 70B", 2, "full", 353),
]


def composition(row: Row) -> tuple[Optional[str], tuple[str, ...], str]:
    """(strategy, its degree overrides, how it is named in the table); strategy None: no composition here."""
    if row.pp > 1:
        return None, (), f"none (TP {row.tp} x PP {row.pp} x DP)"
    if row.source in ("mosaicml", "torchtitan"):
        return "fsdp", (), "fsdp"
    if row.tp == 1:  # the distributed optimizer's reduce-scatter and gather overlap backward and forward
        return "ddp", (), "ddp (overlapped data parallelism)"
    return "ddp_tp", (f"strategy.tp={row.tp}",), f"ddp_tp tp={row.tp}"


def _pinned(row: Row, hw):  # noqa: ANN001, ANN202 - (shape, the advisor's candidates for the row)
    from dist_train.estimate.cli import compose
    from dist_train.estimate.shapes import ModelShape
    from dist_train.plan.search import search

    strategy, _, _ = composition(row)
    model = (["model=gpt2_small", "model.tie_embeddings=true"] if row.arch == "gpt2" else
             ["model=7b", f"model.num_kv_heads={row.kv_heads}", f"model.ffn_hidden_size={row.ffn}"])
    cfg, _ = compose([*model, f"model.hidden_size={row.hidden}", f"model.num_layers={row.layers}",
                      f"model.num_heads={row.heads}", f"model.vocab_size={row.vocab}", f"model.max_seq_len={row.seq}",
                      "precision=bf16", f"train.seq_len={row.seq}", f"train.checkpoint_every={row.checkpoint_every}",
                      f"train.micro_batch_size={row.micro}", f"train.global_batch_size={row.global_batch}",
                      "logger=none"])
    shape = ModelShape.from_config(cfg["model"])
    found = search(shape, cfg, hw, nodes=row.gpus // 8, strategies=(strategy,), micro_batch_sizes=[row.micro],
                   checkpointing=(row.checkpointing,), memory_fraction=float("inf"))
    sp = SEQUENCE_PARALLEL.get((row.source, row.gpu), False)
    return shape, [c for c in found.ranked if (strategy != "ddp_tp" or c.setup.tp == row.tp)
                   and c.setup.sequence_parallel == (sp and row.tp > 1)], found


# What a source's own software does unlike dist_train's, fitted to that source's rows (--fit) and applied to them
# alone: MPT's ALiBi attention (llm-foundry's Triton flash attention with a bias) against torch's SDPA, which the
# H100 profile measured (0.71 of the peak). The A100 profile's own constants are fitted to the same rows (hardware.OPS).
STACKS = {("mosaicml", "h100"): {"attention_efficiency": 0.2, "attention_seq_half": 0.0}}
# Communication a source's stack hides and dist_train's code does not: Megatron-Core r0.8.0 overlaps its tensor-parallel
# communication with the layer's matrix products (--tp-comm-overlap; GPU-PUBLISHED.md section 2: "DP/TP/PP
# communication overlapped"), which dist_train's tp runs on the critical path. Narayanan et al. 2021 (the A100 rows)
# did not. Not fitted: the rows are timed both ways, and the table says which.
OVERLAPPED = {("megatron", "h100"): ("tp",)}
# Megatron's --tp-comm-overlap requires --sequence-parallel (megatron/training/arguments.py: "Tensor parallel
# communication/GEMM overlap can happen only when sequence parallelism is enabled"), so the H100 rows, their TP
# communication overlapped, ran sequence-parallel; the A100 rows (Narayanan et al. 2021) predate it (Korthikanti et
# al. 2022). Pinned, as the degrees are: the advisor searches both ways.
SEQUENCE_PARALLEL = {("megatron", "h100"): True}


def _profile(row: Row, *, stack: bool = True):  # noqa: ANN202
    from dataclasses import replace

    from dist_train.estimate.hardware import PROFILES

    return replace(PROFILES[row.gpu], gpus_per_node=8, **(STACKS.get((row.source, row.gpu), {}) if stack else {}))


def offered(timed: list, usable: float) -> tuple:  # noqa: ANN001 - [(candidate, step_s)] -> (candidate, step_s)
    """What the advisor offers among a row's candidates (FSDP accumulating either way): the fastest that fits in
    `usable` bytes, else the fastest."""
    return min(timed, key=lambda ct: (ct[0].peak_bytes > usable, ct[1]))


def predict(row: Row) -> dict[str, object]:
    """The advisor's search pinned to the row; its one candidate's prediction."""
    from dist_train.estimate.hardware import GIB

    strategy, _, named = composition(row)
    out: dict[str, object] = {"composition": named}
    if strategy is None:
        return out
    hw = _profile(row)
    shape, picked, found = _pinned(row, hw)
    if not picked:
        out["why"] = "; ".join(r.reason for r in found.rejected)[:120]
        return out
    usable = hw.memory_bytes * 0.9
    c, _ = offered([(c, c.time.step_s) for c in picked], usable)
    if c.setup.reduce_every_microbatch:
        out["composition"] = f"{named}, reduce every micro-batch"
    if c.setup.sequence_parallel:
        out["composition"] = f"{out['composition']}, sequence-parallel"
    tokens = c.time.tokens_per_s / c.setup.world_size
    hidden = OVERLAPPED.get((row.source, row.gpu), ()) if row.tp > 1 else ()
    if hidden:
        from dist_train.estimate.step_time import predict_step

        out["composition"] = f"{out['composition']}, TP communication overlapped as Megatron's"
        out["tokens_exposed"] = tokens  # dist_train's own tp: its collectives on the critical path
        tokens = predict_step(shape, c.setup, hw, overlapped_activations=hidden).tokens_per_s / c.setup.world_size
    out.update(tokens=tokens, peak_gib=c.peak_bytes / GIB, comm_bound=c.time.comm_s > c.time.compute_s,
               offered=c.peak_bytes <= usable, usable_gib=usable / GIB, num_params=shape.num_params)
    return out


# What --fit searches, per GPU, holding the profile's other constants: the A100's that hardware.OPS says were fitted
# here, and the H100 rows' STACKS. Attention stops at 0.8 of the peak, above the best any FlashAttention-2 pass
# reached on an A100 (forward, 73%: Dao 2023): a fit that ends there wants more than the kernel can give. The grid is
# not widened past it; the fit's report says which constants stopped at an end (on_edge).
FITTED = {
    "h100": {"attention_efficiency": (0.15, 0.2, 0.25, 0.3, 0.35, 0.4, 0.5, 0.6, 0.7),
             "attention_seq_half": (0.0, 1000.0, 2000.0, 3000.0, 4000.0, 6000.0, 8000.0)},
    "a100": {"gemm_efficiency": (0.7, 0.75, 0.8, 0.85, 0.9, 0.95),
             "attention_efficiency": (0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8),
             "attention_seq_half": (0.0, 2000.0, 4000.0)},
}


def fitted_rows(rows: list[Row], gpu: str) -> list[Row]:
    """The rows --fit, --loo and --bound read for `gpu`: MosaicML's on that GPU."""
    return [r for r in rows if r.source == "mosaicml" and r.gpu == gpu]


def _grid_errors(gpu: str, mine: tuple[Row, ...]) -> tuple[list[dict[str, float]], list[tuple[float, ...]]]:
    """Every point of FITTED[gpu]'s grid, and at each the tokens/s error of each of `mine` (that GPU's MosaicML
    rows). Each row's candidates (FSDP accumulating either way) are searched once and re-timed at each point; the
    row takes the fastest that fits, as predict() does. Computed once per grid and rows (fit, --loo and the table's
    summary all read it)."""
    return _errors_on(gpu, mine, tuple((k, tuple(v)) for k, v in FITTED[gpu].items()))


@functools.lru_cache(maxsize=None)
def _errors_on(gpu: str, mine: tuple[Row, ...], grid_items: tuple) -> tuple[list[dict[str, float]],
                                                                           list[tuple[float, ...]]]:
    """_grid_errors, cached by the grid as well as the rows (FITTED may be changed between calls)."""
    import itertools
    from dataclasses import replace

    from dist_train.estimate.step_time import predict_step

    grid = dict(grid_items)
    base = _profile(mine[0], stack=False)
    pinned = [(r, *_pinned(r, base)[:2]) for r in mine]
    points, errors = [], []
    for values in itertools.product(*grid.values()):
        hw = replace(base, **dict(zip(grid, values)))
        usable, row_errors = hw.memory_bytes * 0.9, []
        for r, shape, cands in pinned:
            c, step = offered([(c, predict_step(shape, c.setup, hw).step_s) for c in cands], usable)
            row_errors.append(c.setup.micro_batch_size * c.setup.seq_len * c.setup.microbatches_per_step / step
                              / r.published - 1)
        points.append(dict(zip(grid, values)))
        errors.append(tuple(row_errors))
    return points, errors


def _best(errors: Sequence[Sequence[float]], *, leave_out: Optional[int] = None) -> int:
    """The grid point with the least sum of squared log errors of tokens/s over the rows (but `leave_out`)."""
    import math

    def loss(row_errors: Sequence[float]) -> float:
        return sum(math.log1p(e) ** 2 for i, e in enumerate(row_errors) if i != leave_out)

    return min(range(len(errors)), key=lambda k: loss(errors[k]))


def on_edge(gpu: str, point: dict[str, float]) -> list[str]:
    """The constants of a fitted point at the end of their grid where the grid could go further (a fit that stops
    there wants a value the grid does not hold): not a half-point of 0, which is the end of its range."""
    return [k for k, v in point.items() if len(FITTED[gpu][k]) > 1 and v in (min(FITTED[gpu][k]), max(FITTED[gpu][k]))
            and not (k.endswith("_seq_half") and v == 0)]


def fit(rows: list[Row], *, quiet: bool = False) -> dict[str, dict[str, float]]:
    """For each GPU in FITTED: the grid point with the least sum of squared log errors of tokens/s over its MosaicML
    rows (_grid_errors, _best); printed unless `quiet`."""
    out = {}
    for gpu in FITTED:
        mine = fitted_rows(rows, gpu)
        points, errors = _grid_errors(gpu, tuple(mine))
        k = _best(errors)
        out[gpu] = points[k]
        edge = on_edge(gpu, points[k])
        if not quiet:
            each = ", ".join(f"{r.name} {r.seq}: {e:+.1%}" for r, e in zip(mine, errors[k]))
            ends = f"; at the end of its grid: {', '.join(edge)}" if edge else ""
            print(f"{gpu}: {points[k]}; errors {each}{ends}")
    return out


def fit_text(rows: list[Row]) -> str:
    """Whether the constants in use (hardware.OPS for the A100, STACKS for MosaicML's H100 rows) are what --fit gives
    on these rows, and which of them the fit left at the end of its grid."""
    parts = []
    for gpu, point in fit(rows, quiet=True).items():
        hw = _profile(fitted_rows(rows, gpu)[0])
        used = {k: getattr(hw, k) for k in point}
        same = "the constants in use" if used == point else f"not the constants in use ({used})"
        edge = on_edge(gpu, point)
        parts.append(f"{gpu.upper()} {', '.join(f'{k} {v:g}' for k, v in point.items())}, {same}"
                     + (f"; at the end of its grid: {', '.join(f'{k} {point[k]:g}' for k in edge)}" if edge else ""))
    return "--fit on these rows: " + "; ".join(parts) + "."


def leave_one_out(rows: list[Row]) -> list[tuple[Row, float, bool, list[str]]]:
    """How the fit predicts a row it has not seen: for each MosaicML row of a GPU in FITTED, its tokens/s error under
    the constants fitted to that GPU's other rows, whether those differ from the constants fitted to all of them, and
    which of them stopped at the end of their grid (on_edge). (row, error, constants moved, ends) per row."""
    out = []
    for gpu in FITTED:
        mine = fitted_rows(rows, gpu)
        points, errors = _grid_errors(gpu, tuple(mine))
        everything = _best(errors)
        for i, r in enumerate(mine):
            k = _best(errors, leave_out=i)
            out.append((r, errors[k][i], k != everything, on_edge(gpu, points[k])))
    return out


def loo_text(loo: list[tuple[Row, float, bool, list[str]]]) -> str:
    """The leave-one-out errors in a sentence: how many within 10%, the median and each row's (marked where the
    constants fitted without it stopped at the end of their grid)."""
    errors = sorted(abs(e) for _, e, _, _ in loo)
    median = (errors[(len(errors) - 1) // 2] + errors[len(errors) // 2]) / 2
    return (f"Each fitted row predicted by the constants fitted without it (--loo, leave one out): "
            f"{sum(e <= 0.10 for e in errors)} of {len(loo)} within 10%, median |error| {median:.1%}; leaving a row "
            f"out changed the fitted constants {sum(m for _, _, m, _ in loo)} times; "
            + ", ".join(f"{r.gpu.upper()} {r.name} {r.seq:,} {e:+.0%}"
                        + (f" (fitted without it: {', '.join(ends)} at the end of the grid)" if ends else "")
                        for r, e, _, ends in loo) + ".")


TERMS = ("matrix products", "attention", "memory-bound work", "the rest")


def bound(rows: list[Row]) -> dict[str, tuple[list[float], float, list[tuple[Row, float]]]]:
    """What no rescaling of this model's terms can beat. For each GPU's MosaicML rows, each row's predicted step is
    split into four terms (TERMS: matrix products, attention, memory-bound work with the loss, and the rest:
    optimizer, exposed communication, framework, bubble, any host wait), and four free multipliers, of any sign, are
    chosen to make the worst relative error of the step time as small as it can be (Chebyshev's fit, by Lawson's
    reweighted least squares). Returns, per GPU: the multipliers, that smallest worst error, and each row's tokens/s
    error under them. A worst error above 10% puts the target out of reach of any rescaling of the four terms
    (a profile's shape-dependent constants, such as the products' wave quantisation, are not covered)."""
    import numpy as np

    out = {}
    for gpu in FITTED:
        mine, terms, published = fitted_rows(rows, gpu), [], []
        for r in mine:
            hw = _profile(r)
            _, cands, _ = _pinned(r, hw)
            c, _ = offered([(c, c.time.step_s) for c in cands], hw.memory_bytes * 0.9)
            t, tokens = c.time, c.time.tokens_per_step / c.setup.world_size
            kernels = [t.ops.gemm_s, t.ops.attention_s, t.ops.elementwise_s + t.ops.loss_s]
            terms.append([*kernels, t.step_s - sum(kernels)])  # the rest: it all adds up to the step
            published.append(tokens / r.published)  # the published step, seconds
        a = np.array(terms) / np.array(published)[:, None]  # a @ w: predicted over published step
        w, worst = minimax(a)
        out[gpu] = (w, worst, [(r, float(1 / (a[i] @ w) - 1)) for i, r in enumerate(mine)])
    return out


def minimax(a) -> tuple[list[float], float]:  # noqa: ANN001 - a numpy matrix, rows x terms
    """The multipliers w that make max_i |a_i . w - 1| smallest, and that maximum: Lawson's reweighted least squares
    (each row's weight grows with its residual), which converges on the Chebyshev fit of a linear model."""
    import numpy as np

    weights = np.full(len(a), 1 / len(a))
    for _ in range(5000):
        root = np.sqrt(weights)
        w, *_ = np.linalg.lstsq(a * root[:, None], root, rcond=None)
        weights = weights * np.abs(a @ w - 1)
        if weights.sum() == 0:  # an exact fit
            break
        weights = weights / weights.sum()
    return [float(x) for x in w], float(np.abs(a @ w - 1).max())


def bound_text(bounds: dict[str, tuple[list[float], float, list[tuple[Row, float]]]]) -> str:
    parts = []
    for gpu, (w, worst, errs) in bounds.items():
        lo, hi = min(e for _, e in errs), max(e for _, e in errs)
        parts.append(f"{gpu.upper()} {worst:.1%} ({', '.join(f'{t} x{x:.2f}' for t, x in zip(TERMS, w))}; "
                     f"tokens/s {lo:+.0%} to {hi:+.0%})"
                     + (": above 10%, so no rescaling of these terms meets the target on these rows"
                        if worst > 0.10 else ""))
    return ("The smallest worst step-time error any rescaling of this model's terms reaches on MosaicML's rows "
            "(--bound: its four terms scaled by free multipliers of any sign, minimax per GPU): "
            + "; ".join(parts) + ".")


def table(rows: list[Row]) -> tuple[str, dict[str, tuple[int, int]], list[tuple[float, bool]], list[str]]:
    """The markdown table; per target source (rows within, rows predicted); each held-out row's (error,
    communication-bound in the model); Megatron's rows with their TP all-reduces exposed."""
    body, within, held_out, exposed = [], {"mosaicml": [0, 0], "megatron": [0, 0]}, [], []
    for row in rows:
        p = predict(row)
        tokens = p.get("tokens")
        err = (tokens / row.published - 1) if isinstance(tokens, float) else None
        if isinstance(p.get("tokens_exposed"), float):
            exposed.append(f"{row.name} {p['tokens_exposed'] / row.published - 1:+.0%}")
        target = 0.10 if row.source == "mosaicml" else 0.20
        if err is not None and row.source in within:
            within[row.source][1] += 1
            within[row.source][0] += abs(err) <= target
        elif err is not None:
            held_out.append((err, p["comm_bound"]))
        offered = "-" if err is None else (
            "yes" if p["offered"] else f"no: {p['peak_gib']:.2f} GiB > {p['usable_gib']:.2f}")
        body.append([
            row.source, row.gpu.upper(), row.name, f"{row.seq:,}", row.gpus, f"{row.micro} x {row.global_batch:,}",
            row.checkpointing + (f", every {row.checkpoint_every}" if row.checkpoint_every > 1 else ""),
            p["composition"],
            f"{row.published:,.0f}" + (" [derived]" if row.derived else ""),
            f"{tokens:,.0f}" if err is not None else "-", f"{err:+.0%}" if err is not None else "-", offered,
        ])
    headers = ["source", "GPU", "model", "seq", "GPUs", "micro x global", "checkpointing", "dist_train composition",
               "published tokens/s/GPU", "predicted", "error", "advisor offers it"]
    return md_table(headers, body), {k: (v[0], v[1]) for k, v in within.items()}, held_out, exposed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-write", action="store_true", help="print the table, leave docs/BENCHMARKS.md alone")
    parser.add_argument("--fit", action="store_true", help="print the constants fitted to MosaicML's rows, and stop")
    parser.add_argument("--loo", action="store_true",
                        help="print each MosaicML row's error under constants fitted to the other rows, and stop")
    parser.add_argument("--bound", action="store_true",
                        help="print each MosaicML row's error under the best free rescaling of the model's terms")
    args = parser.parse_args()
    if args.fit:
        fit(ROWS)
        return
    if args.bound:
        print(bound_text(bound(ROWS)))
        return
    if args.loo:
        print(loo_text(leave_one_out(ROWS)))
        return
    text, within, held_out, exposed = table(ROWS)
    m, g = within["mosaicml"], within["megatron"]
    held = ""
    if held_out:
        errors, bound_by_comm = [e for e, _ in held_out], sum(b for _, b in held_out)
        held = (f"Held out (torchtitan, no target, nothing fitted to it): {len(held_out)} rows, errors "
                f"{min(errors):+.0%} to {max(errors):+.0%}, median |error| "
                f"{sorted(abs(e) for e in errors)[len(errors) // 2]:.0%}; {bound_by_comm} of {len(held_out)} "
                "communication-bound in the model (their gathers and reductions over the a100 profile's assumed "
                "links take longer than their compute)"
                + (", so these rows test that assumption more than the compute. " if 2 * bound_by_comm > len(held_out)
                   else ". "))
    tp = (f"Megatron's H100 rows with their tensor-parallel collectives on the critical path, as dist_train's tp "
          f"runs them (not overlapped): {', '.join(exposed)}. " if exposed else "")
    summary = (f"Within target: MosaicML {m[0]} of {m[1]} rows within 10%; Megatron {g[0]} of {g[1]} predicted rows "
               f"within 20%. {tp}{held}The profiles are the datasheet ones, with the per-operation constants of "
               f"dist_train/estimate/hardware.py's OPS: the H100's measured on an H100 (its products, SDPA and "
               f"memory), "
               f"the A100's products and attention fitted to these MosaicML rows (--fit); MosaicML's H100 rows take "
               f"their own attention, fitted to them (STACKS: MPT's ALiBi kernel, not torch's SDPA).")
    summary += " " + fit_text(ROWS) + " " + loo_text(leave_one_out(ROWS)) + " " + bound_text(bound(ROWS))
    print(text)
    print(summary)
    if not args.no_write:
        write_section("published", "The time model against published GPU runs", text + "\n\n" + summary,
                      command="python bench/published.py", note=__doc__.split("\n\n", 2)[2])


if __name__ == "__main__":
    main()
