"""What a device and its interconnect can do, for the time model: datasheet profiles, or one measured here.

A profile is a handful of numbers. Peaks come from datasheets (the same table MFU uses, telemetry/flops.py);
the interconnect's bus bandwidths are nccl-tests figures for the named fabric; the per-operation constants
(estimate/ops.py: how much of the peak matrix products and attention reach, by shape, and of the memory bandwidth
memory-bound kernels reach) were measured on an H100 and an H200 or fitted to published runs (OPS, each with its
source);
`efficiency`, `overlap` and `overhead_s` are what a real step loses beyond them. `bench/gpu_calibrate.py` measures
a GPU's (an H200 and an H100 so far, docs/BENCHMARKS.md) and stores the profile where `resolve` finds it;
`plan.calibrate=true` measures the machine it runs on (calibrate.py) and `plan.verify=K` refits them from real
steps (verify.py).
`cluster.gpu=cpu` is the profile this machine's tests verify: it has no datasheet, so it is always measured.
"""

from __future__ import annotations

import json
import re
import socket
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Optional

from dist_train.telemetry.flops import PEAK_FLOPS

GIB = 2**30


@dataclass(frozen=True)
class Link:
    """One level of the interconnect, as a collective sees it: nccl-tests bus bandwidth (bytes/s) of a large
    message, the fixed cost of one call between two ranks (seconds), and what each further step of a ring or tree
    over this link adds to a call (seconds; estimate/step_time.py collective_latency_s counts the steps)."""

    busbw: float
    latency_s: float
    step_latency_s: float = 0.0


@dataclass(frozen=True)
class Hardware:
    name: str
    memory_bytes: float  # one device's memory, as torch reports its total
    flops: dict[str, float]  # peak dense FLOP/s by compute dtype: fp32 (no TF32), tf32, bf16, fp16
    memory_bw: float  # bytes/s: the optimizer step reads and writes the model state at this speed
    intra: Link  # between the devices of a node
    inter: Link  # between nodes
    gpus_per_node: int = 8
    # What the per-operation model (estimate/ops.py) does not see, as one factor on its compute: launches and the
    # framework's own work between kernels (1: none). plan.verify and bench/gpu_calibrate.py refit it.
    efficiency: float = 1.0
    # The per-operation model's device constants (estimate/ops.py); the defaults are a device with no shape effects
    # (a CPU, whose products calibrate.py times at the model's own shapes):
    sm_count: int = 0  # streaming multiprocessors: the waves of a product's output tiles (0: none)
    gemm_efficiency: float = 1.0  # the fraction of the peak a large matrix product reaches
    gemm_k_half: float = 0.0  # the inner dimension at which a product runs at half that
    attention_efficiency: float = 1.0  # flash/SDPA forward + backward, of the peak, at long sequences
    attention_seq_half: float = 0.0  # the sequence length at which attention runs at half that
    memory_efficiency: float = 1.0  # the fraction of memory_bw that memory-bound kernels reach
    # Eager PyTorch's own cost of one block's forward and backward (dispatching its ops, autograd), whatever the
    # strategy, per block and micro-batch. It adds to a CPU's compute (the same cores run both); a GPU runs it ahead
    # of its kernels, so the GPU profiles leave it 0. plan.calibrate measures it on a CPU.
    layer_overhead_s: float = 0.0
    # Selective checkpointing's host time per block and micro-batch, forward + backward: torch's selective
    # checkpointing runs every op of the block through a Python dispatch mode, forward and again in the
    # recomputation. A GPU runs a block no faster than its host issues it, so this is a floor on the block's time
    # (estimate/ops.py layer_compute). 0: not modelled (the CPU profile, whose host is the device).
    selective_host_s: float = 0.0
    # The fraction of the compute that data-parallel collectives can hide behind (1: a GPU's copy engines and
    # NCCL's own SMs run beside the kernels; 0: a CPU, where gloo and the matmuls share the cores).
    overlap: float = 1.0
    # The framework's own cost per block and micro-batch of the strategies that hook every block (FSDP's and
    # ZeRO-3's gathers, DTensor's dispatch under tensor parallelism, a pipeline's schedule), beside the bytes
    # they move, keyed as overhead_key() names them. Absent: 0.
    overhead_s: dict[str, float] = field(default_factory=dict)
    # An MoE layer's experts beyond their products (estimate/ops.py experts_compute), by model.experts_implementation:
    # {"gemm_factor": on the grouped kernel's product efficiency, "routing_passes": passes over the routed rows'
    # bytes (permuting, weighting and scattering them back, forward and backward), "fixed_s": per layer and
    # micro-batch}. Absent: 1, 0, 0. fixed_s is per layer, not per local expert, so expert parallelism leaves it as
    # it is: a per-expert term beside it, fitted to the same 18 blocks (64 and 128 experts among them), came out 0.
    experts: dict[str, dict[str, float]] = field(default_factory=dict)
    # What each figure rests on: "datasheet", "assumed", or how it was measured.
    source: dict[str, str] = field(default_factory=dict)

    def peak(self, precision: str, *, allow_tf32: bool = False) -> float:
        if precision == "fp32":
            return self.flops["tf32" if allow_tf32 and "tf32" in self.flops else "fp32"]
        return self.flops[precision]

    def link(self, *, spans_nodes: bool) -> Link:
        return self.inter if spans_nodes else self.intra

    def fitted_to(self) -> list[str]:
        """The published runs this profile's constants were fitted to (their `source`s that say "fitted"), in
        words: what a prediction with it rests on beyond datasheets and measurements."""
        return sorted({v.split("(", 1)[-1].rstrip(")") for v in self.source.values() if v.startswith("fitted")})

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "Hardware":
        known = {f.name for f in fields(cls)}
        data = {k: v for k, v in data.items() if k in known}
        for key in ("experts", "selective_host_s"):  # stored before these constants existed: the built-in ones
            if key not in data and data.get("name") in OPS and key in OPS[data["name"]][0]:
                data[key] = OPS[data["name"]][0][key]
                data["source"] = {**data.get("source", {}), key: OPS[data["name"]][1].get(key, "")}
        overheads = dict(data.get("overhead_s") or {})
        if "pipeline" in overheads:  # stored before the pipelines' overheads were keyed by schedule: both had it
            shared = overheads.pop("pipeline")
            data["overhead_s"] = {"gpipe": shared, "1f1b": shared, **overheads}
        links = {}
        for level in ("intra", "inter"):  # stored before a ring step's latency was modelled: the built-in profile's
            link = dict(data[level])
            if "step_latency_s" not in link and data.get("name") in PROFILES:
                link["step_latency_s"] = getattr(PROFILES[data["name"]], level).step_latency_s
            links[level] = Link(**link)
        return cls(**{**data, **links})


_ASSUMED = {
    "efficiency": "1: the per-operation model (estimate/ops.py) carries the device's efficiencies",
    "overlap": "assumed: a GPU overlaps NCCL with compute",
    "overhead_s": "assumed: 2 ms of DeepSpeed ZeRO-3 hooks per block and micro-batch (0.1 ms a module fetch), "
                  "the other strategies' hidden behind the GPU's work; never measured here on a GPU",
}
GPU_OVERHEAD_S = {"zero3": 2e-3}

# The per-operation constants (estimate/ops.py) and where each comes from.
# - H100 and H200 (SXM, 132 SMs, one die), each measured on its own device by bench/gpu_calibrate.py: the matrix
#   products (least squares of log error over 132 products, median error about 5%), SDPA (flash, causal, seq
#   4096-8192) and a 2 GiB device copy (H100 3.01 of the datasheet's 3.35 TB/s, H200 4.25 of 4.8);
#   bench/data/gpu_calibrate-h100-2026-11-27.json and gpu_calibrate-h200-2026-11-26.json.
# - The A100 not measured here: its products and attention fitted to the calibration set's MosaicML rows
#   (`python bench/published.py --fit`, least squares of log error over the rows of that GPU, the other constants
#   held). MosaicML's H100 rows imply an attention at about 0.2 of the peak against torch's SDPA's 0.71 measured: MPT's
#   ALiBi attention is another kernel, so bench/published.py fits it to those rows as their stack's, not the H100's.
_H100_MEASURED = "measured: bench/gpu_calibrate.py on an H100 80GB HBM3, 2026-11-27"
# The experts' constants: fitted (ops.fit_experts) to 18 MoE blocks measured on an H100 (bench/gpu_calibrate.py --only
# moe: Qwen3-30B-A3B's, OLMoE's and Mixtral's sizes, 4k-16k tokens, eager and grouped_mm;
# bench/data/gpu_moe-h100-2026-11-27.json); the same 18 measured on an H200 (gpu_calibrate-h200-2026-11-27.json)
# are the held-out check (tests/unit/test_time_ops.py).
_MOE_FITTED = ("measured: 18 MoE blocks on an H100 (bench/data/gpu_moe-h100-2026-11-27.json), the constants by "
               "estimate/ops.py fit_experts")
EXPERTS_HOPPER = {"eager": {"gemm_factor": 1.0, "routing_passes": 64.0, "fixed_s": 0.005},
                  "grouped_mm": {"gemm_factor": 0.9, "routing_passes": 36.0, "fixed_s": 0.00125}}
_HOPPER_MEASURED = "measured: bench/gpu_calibrate.py on an H200, 2026-11-26"
# Selective checkpointing's host time per block (Hardware.selective_host_s): an H200's llama-8b layer at 4,096 tokens
# took 15.6 ms under selective against 11.9 ms of kernels and 14.5 ms under full checkpointing, twice (host-bound);
# bench/gpu_calibrate.py selective_host_s finds it in the kept file. The other GPUs' hosts are assumed alike.
SELECTIVE_HOST_S = 0.0156
_SELECTIVE_MEASURED = ("measured: an H200's host-bound selective layer (bench/data/gpu_calibrate-h200-2026-11-27.json, "
                       "gpu_calibrate.selective_host_s)")
_SELECTIVE_ASSUMED = "assumed: the H200 host's, " + _SELECTIVE_MEASURED.removeprefix("measured: ")
_FITTED = "fitted: python bench/published.py --fit (MosaicML's {gpu} rows of ../shared/GPU-PUBLISHED.md)"
_HOPPER = dict(sm_count=132, gemm_efficiency=0.725, gemm_k_half=350.0, memory_efficiency=0.885)
_OPS_SOURCE_HOPPER = {"sm_count": "datasheet", "gemm_efficiency": _HOPPER_MEASURED, "gemm_k_half": _HOPPER_MEASURED,
                      "memory_efficiency": _HOPPER_MEASURED}
OPS: dict[str, tuple[dict[str, Any], dict[str, str]]] = {
    "h100": (dict(sm_count=132, gemm_efficiency=0.71, gemm_k_half=400.0, memory_efficiency=0.897,
                  attention_efficiency=0.71, attention_seq_half=2925.0, experts=EXPERTS_HOPPER,
                  selective_host_s=SELECTIVE_HOST_S),
             {"sm_count": "datasheet", "experts": _MOE_FITTED, "selective_host_s": _SELECTIVE_ASSUMED,
              **{k: _H100_MEASURED for k in (
                 "gemm_efficiency", "gemm_k_half", "memory_efficiency", "attention_efficiency",
                 "attention_seq_half")}}),
    "h200": ({**_HOPPER, "attention_efficiency": 0.706, "attention_seq_half": 2700.0, "experts": EXPERTS_HOPPER,
              "selective_host_s": SELECTIVE_HOST_S},
             {**_OPS_SOURCE_HOPPER, "attention_efficiency": _HOPPER_MEASURED, "attention_seq_half": _HOPPER_MEASURED,
              "selective_host_s": _SELECTIVE_MEASURED,
              "experts": _MOE_FITTED + "; checked on an H200's same 18 blocks"}),
    "a100": (dict(sm_count=108, gemm_efficiency=0.8, gemm_k_half=350.0, memory_efficiency=0.885,
                  attention_efficiency=0.8, attention_seq_half=0.0, experts=EXPERTS_HOPPER,
                  selective_host_s=SELECTIVE_HOST_S),
             {"sm_count": "datasheet", "gemm_efficiency": _FITTED.format(gpu="A100"),
              "selective_host_s": _SELECTIVE_ASSUMED,
              "experts": "assumed: the H100's, " + _MOE_FITTED.removeprefix("measured: "),
              "attention_efficiency": _FITTED.format(gpu="A100"), "attention_seq_half": _FITTED.format(gpu="A100"),
              "gemm_k_half": "assumed: the H200's", "memory_efficiency": "assumed: the H200's"}),
    "l40s": (dict(sm_count=142, gemm_efficiency=0.725, gemm_k_half=350.0, memory_efficiency=0.885,
                  attention_efficiency=0.706, attention_seq_half=2700.0, experts=EXPERTS_HOPPER,
                  selective_host_s=SELECTIVE_HOST_S),
             {"sm_count": "datasheet", "experts": "assumed: the H100's, " + _MOE_FITTED.removeprefix("measured: "),
              "selective_host_s": _SELECTIVE_ASSUMED,
              **{k: "assumed: the H200's" for k in (
                 "gemm_efficiency", "gemm_k_half", "memory_efficiency", "attention_efficiency",
                 "attention_seq_half")}}),
}


def _gpu(name: str, *, board: str, memory_gib: float, memory_bw: float, intra: Link, inter: Link,
         fabric: str, network: str) -> Hardware:
    constants, sources = OPS[name]
    return Hardware(
        name=name, memory_bytes=memory_gib * GIB, flops=dict(PEAK_FLOPS[board]), memory_bw=memory_bw,
        intra=intra, inter=inter, overhead_s=dict(GPU_OVERHEAD_S), **constants,
        source={"flops": f"datasheet ({board}, dense)", "memory_bytes": "datasheet capacity, as torch reports it",
                "memory_bw": "datasheet", "intra": f"nccl-tests bus bandwidth of {fabric}; {_LATENCY}",
                "inter": f"nccl-tests bus bandwidth of {network}; {_LATENCY}", **_ASSUMED, **sources},
    )


# Interconnect: nccl-tests bus bandwidth of a large message (../shared/GPU-PUBLISHED.md section 4). NVLink 4
# (H100/H200, NVSwitch): about 370 GB/s for ring all-reduce and the other collectives (NVIDIA/nccl-tests#212, #290);
# NVLink 3 (A100): 200-233 GB/s (users' reports, nccl-tests#149, #175); PCIe Gen4 (L40S: 32 GB/s a direction, about
# 22, assumed). Between nodes, one InfiniBand NDR 400 Gb/s NIC per GPU: 46-48 GB/s (nccl-tests#290); HDR 200 Gb/s
# (MosaicML's A100s: 1,600 Gb/s a node): half that, 23 (assumed); 100 Gb/s Ethernet a node for L40S (assumed).
# A call's latency grows with its group: each step of NCCL's ring (n - 1 for an all-gather or a reduce-scatter over n
# ranks, twice that for an all-reduce, which takes a tree's 2 x (log2 nodes + ranks a node - 1) steps where fewer)
# adds its hop's latency, NCCL's own tuning model (src/graph/tuning.cc, hwLat, Simple protocol, the one large
# messages use): 3.4 us a step over NVLink, 5.7 over PCIe, 14 over the network. The per-call latencies (15-40 us,
# the cost of a call between two ranks, launch included) are assumed.
_LATENCY = "a two-rank call's latency assumed, each further ring step's NCCL's (src/graph/tuning.cc)"
_NVLINK4, _NVLINK3 = Link(370e9, 15e-6, 3.4e-6), Link(230e9, 15e-6, 3.4e-6)
_PCIE4 = Link(22e9, 20e-6, 5.7e-6)
_NDR, _HDR, _ETH100 = Link(46e9, 25e-6, 14e-6), Link(23e9, 25e-6, 14e-6), Link(1.2e9, 40e-6, 14e-6)

PROFILES: dict[str, Hardware] = {
    "h100": _gpu("h100", board="NVIDIA H100 80GB HBM3", memory_gib=79.1, memory_bw=3.35e12, intra=_NVLINK4,
                 inter=_NDR, fabric="NVLink 4 (SXM), NCCL's maintainers", network="InfiniBand NDR, NCCL's maintainers"),
    "h200": _gpu("h200", board="NVIDIA H200", memory_gib=139.8, memory_bw=4.8e12, intra=_NVLINK4, inter=_NDR,
                 fabric="NVLink 4 (SXM), NCCL's maintainers", network="InfiniBand NDR, NCCL's maintainers"),
    "a100": _gpu("a100", board="NVIDIA A100-SXM4-80GB", memory_gib=79.2, memory_bw=2.039e12, intra=_NVLINK3,
                 inter=_HDR, fabric="NVLink 3 (SXM), users' reports", network="InfiniBand HDR (assumed: half NDR's)"),
    "l40s": _gpu("l40s", board="NVIDIA L40S", memory_gib=44.4, memory_bw=0.864e12, intra=_PCIE4, inter=_ETH100,
                 fabric="PCIe Gen4 (assumed)", network="100 Gb/s Ethernet a node (assumed)"),
}
MEASURED_ONLY = ("cpu",)  # no datasheet: calibrate.py measures it
KNOWN_GPUS = (*PROFILES, *MEASURED_ONLY)

# torch.cuda.get_device_name() -> the profile of that board, for the comparison report's predicted step time.
_DEVICE_NAMES = {"H100": "h100", "H200": "h200", "A100": "a100", "L40S": "l40s"}


def profile_for_device(device_name: str) -> Optional[str]:
    """The profile name of a run's device ("NVIDIA H100 80GB HBM3" -> h100, "cpu" -> cpu), None if none fits."""
    if device_name.lower() == "cpu":
        return "cpu"
    words = re.split(r"[\s-]+", device_name.upper())  # "NVIDIA A100-SXM4-80GB": A100
    return next((p for key, p in _DEVICE_NAMES.items() if key in words), None)


def default_profile_dir() -> Path:
    return Path.home() / ".cache" / "dist_train" / "profiles"


def profile_path(name: str, profile_dir: Path) -> Path:
    """Where a measured profile of this machine is stored: one file per kind and host."""
    return Path(profile_dir) / f"{name}-{socket.gethostname()}.json"


def stored_profile(name: str, profile_dir: Path) -> Optional[Hardware]:
    path = profile_path(name, profile_dir)
    if not path.is_file():
        return None
    try:
        return Hardware.from_json(json.loads(path.read_text()))
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{path}: not a hardware profile ({exc}); delete it, or plan.calibrate=true rewrites "
                         "it") from None


def save_profile(hw: Hardware, profile_dir: Path) -> Path:
    path = profile_path(hw.name, profile_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(hw.to_json(), indent=1))
    tmp.replace(path)  # a reader never sees half a profile
    return path


def resolve(name: str, profile_dir: Path) -> tuple[Optional[Hardware], str]:
    """The stored measured profile of this machine, else the datasheet one, and which it is; None for a kind
    with no datasheet (cpu) that has not been measured yet."""
    if name not in KNOWN_GPUS:
        raise ValueError(f"cluster.gpu={name!r} is not a known kind; allowed: {', '.join(KNOWN_GPUS)}")
    stored = stored_profile(name, profile_dir)
    if stored is not None:
        return stored, f"stored: {profile_path(name, profile_dir)}"
    return PROFILES.get(name), "datasheet"


@dataclass
class ClusterArgs:
    """`cluster.*`: the machines a plan is for. null keeps the profile's figure."""

    gpu: str = "h100"  # the device kind: datasheet figures, or cpu (measured here)
    nodes: int = 1
    gpus_per_node: Optional[int] = None  # devices (processes) per node; null: the profile's (8 GPUs; cpu: 2)
    memory_gib: Optional[float] = None  # one device's memory in GiB; null: the profile's
    intra_gbps: Optional[float] = None  # bus bandwidth within a node, GB/s; null: the profile's
    inter_gbps: Optional[float] = None  # bus bandwidth between nodes, GB/s; null: the profile's
    intra_latency_us: Optional[float] = None  # one collective call within a node, microseconds
    inter_latency_us: Optional[float] = None  # one collective call between nodes, microseconds
    intra_step_latency_us: Optional[float] = None  # each further ring/tree step within a node, microseconds
    inter_step_latency_us: Optional[float] = None  # each further ring/tree step between nodes, microseconds
    efficiency: Optional[float] = None  # fraction of the peak FLOP/s a step's products reach; null: the profile's

    def __post_init__(self) -> None:
        if self.gpu not in KNOWN_GPUS:
            raise ValueError(f"cluster.gpu={self.gpu!r} is not a known kind; allowed: {', '.join(KNOWN_GPUS)}")
        if self.nodes < 1:
            raise ValueError(f"cluster.nodes={self.nodes} must be >= 1")
        if self.gpus_per_node is not None and self.gpus_per_node < 1:
            raise ValueError(f"cluster.gpus_per_node={self.gpus_per_node} must be >= 1")
        for key in ("memory_gib", "intra_gbps", "inter_gbps", "efficiency"):
            value = getattr(self, key)
            if value is not None and value <= 0:
                raise ValueError(f"cluster.{key}={value} must be > 0")
        for key in ("intra_latency_us", "inter_latency_us", "intra_step_latency_us", "inter_step_latency_us"):
            value = getattr(self, key)
            if value is not None and value < 0:
                raise ValueError(f"cluster.{key}={value} must be >= 0")
        if self.efficiency is not None and self.efficiency > 1:
            raise ValueError(f"cluster.efficiency={self.efficiency} is a fraction of the peak: (0, 1]")


def apply_overrides(hw: Hardware, args: ClusterArgs) -> Hardware:
    """The profile with the user's cluster.* figures in place of its own; each named in `source`."""
    changes: dict[str, Any] = {}
    if args.gpus_per_node is not None:
        changes["gpus_per_node"] = args.gpus_per_node
    if args.memory_gib is not None:
        changes["memory_bytes"] = args.memory_gib * GIB
    if args.efficiency is not None:
        changes["efficiency"] = args.efficiency
    for level in ("intra", "inter"):
        link = getattr(hw, level)
        gbps, lat, step = (getattr(args, f"{level}_{key}") for key in ("gbps", "latency_us", "step_latency_us"))
        if gbps is not None or lat is not None or step is not None:
            changes[level] = replace(link, busbw=gbps * 1e9 if gbps is not None else link.busbw,
                                     latency_s=lat * 1e-6 if lat is not None else link.latency_s,
                                     step_latency_s=step * 1e-6 if step is not None else link.step_latency_s)
    if not changes:
        return hw
    source = dict(hw.source)
    for key in changes:
        source[key] = "given on the command line (cluster.*)"
    return replace(hw, **changes, source=source)
