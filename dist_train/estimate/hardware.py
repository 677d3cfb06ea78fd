"""What a device and its interconnect can do, for the time model: datasheet profiles, or one measured here.

A profile is a handful of numbers. Peaks come from datasheets (the same table MFU uses, telemetry/flops.py);
the interconnect's bus bandwidths are typical nccl-tests figures for the named fabric; `efficiency`,
`overlap` and `overhead_s` are what a real step loses against those peaks. In the datasheet profiles below they
are assumptions; `bench/gpu_calibrate.py` measures a GPU's memory bandwidth and efficiency (one whole step; one
H200 so far, docs/BENCHMARKS.md) and stores the profile where `resolve` finds it; `plan.calibrate=true` measures
the machine it runs on (calibrate.py) and `plan.verify=K` refits them from real steps (verify.py).
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
    message, and the fixed cost of one call (seconds)."""

    busbw: float
    latency_s: float

    def seconds(self, ring_bytes: float, calls: int) -> float:
        return calls * self.latency_s + ring_bytes / self.busbw


@dataclass(frozen=True)
class Hardware:
    name: str
    memory_bytes: float  # one device's memory, as torch reports its total
    flops: dict[str, float]  # peak dense FLOP/s by compute dtype: fp32 (no TF32), tf32, bf16, fp16
    memory_bw: float  # bytes/s: the optimizer step reads and writes the model state at this speed
    intra: Link  # between the devices of a node
    inter: Link  # between nodes
    gpus_per_node: int = 8
    # The fraction of the peak a training step's matrix products reach (the rest: small kernels, launches,
    # the framework's own work between them).
    efficiency: float = 0.5
    # The fraction of the compute that data-parallel collectives can hide behind (1: a GPU's copy engines and
    # NCCL's own SMs run beside the kernels; 0: a CPU, where gloo and the matmuls share the cores).
    overlap: float = 1.0
    # The framework's own cost per block and micro-batch of the strategies that hook every block (FSDP's and
    # ZeRO-3's gathers, DTensor's dispatch under tensor parallelism, a pipeline's schedule), beside the bytes
    # they move, keyed as overhead_key() names them. Absent: 0.
    overhead_s: dict[str, float] = field(default_factory=dict)
    # What each figure rests on: "datasheet", "assumed", or how it was measured.
    source: dict[str, str] = field(default_factory=dict)

    def peak(self, precision: str, *, allow_tf32: bool = False) -> float:
        if precision == "fp32":
            return self.flops["tf32" if allow_tf32 and "tf32" in self.flops else "fp32"]
        return self.flops[precision]

    def link(self, *, spans_nodes: bool) -> Link:
        return self.inter if spans_nodes else self.intra

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "Hardware":
        known = {f.name for f in fields(cls)}
        data = {k: v for k, v in data.items() if k in known}
        return cls(**{**data, "intra": Link(**data["intra"]), "inter": Link(**data["inter"])})


_ASSUMED = {
    "efficiency": "assumed: typical MFU of a well-tuned transformer step, never measured here on a GPU",
    "overlap": "assumed: a GPU overlaps NCCL with compute",
    "overhead_s": "assumed: 2 ms of DeepSpeed ZeRO-3 hooks per block and micro-batch (0.1 ms a module fetch), "
                  "the other strategies' hidden behind the GPU's work; never measured here on a GPU",
}
GPU_OVERHEAD_S = {"zero3": 2e-3}


def _gpu(name: str, *, board: str, memory_gib: float, memory_bw: float, intra: Link, inter: Link,
         fabric: str) -> Hardware:
    return Hardware(
        name=name, memory_bytes=memory_gib * GIB, flops=dict(PEAK_FLOPS[board]), memory_bw=memory_bw,
        intra=intra, inter=inter, overhead_s=dict(GPU_OVERHEAD_S),
        source={"flops": f"datasheet ({board}, dense)", "memory_bytes": "datasheet capacity, as torch reports it",
                "memory_bw": "datasheet", "intra": f"assumed: nccl-tests bus bandwidth typical of {fabric}",
                "inter": "assumed: nccl-tests bus bandwidth typical of the named network", **_ASSUMED},
    )


# Interconnect defaults: NVLink 4 (H100/H200: 450 GB/s a direction, nccl-tests all-reduce reaches about 360),
# NVLink 3 (A100: 300, about 230), PCIe Gen4 (L40S: 32 GB/s a direction, about 22); between nodes one
# InfiniBand NDR (400 Gb/s) or HDR (200 Gb/s) port per GPU, or 100 Gb/s Ethernet per node for L40S.
_NVLINK4, _NVLINK3, _PCIE4 = Link(360e9, 15e-6), Link(230e9, 15e-6), Link(22e9, 20e-6)
_NDR, _HDR, _ETH100 = Link(40e9, 25e-6), Link(20e9, 25e-6), Link(1.2e9, 40e-6)

PROFILES: dict[str, Hardware] = {
    "h100": _gpu("h100", board="NVIDIA H100 80GB HBM3", memory_gib=79.1, memory_bw=3.35e12, intra=_NVLINK4,
                 inter=_NDR, fabric="NVLink 4 (SXM)"),
    "h200": _gpu("h200", board="NVIDIA H200", memory_gib=139.8, memory_bw=4.8e12, intra=_NVLINK4, inter=_NDR,
                 fabric="NVLink 4 (SXM)"),
    "a100": _gpu("a100", board="NVIDIA A100-SXM4-80GB", memory_gib=79.2, memory_bw=2.039e12, intra=_NVLINK3,
                 inter=_HDR, fabric="NVLink 3 (SXM)"),
    "l40s": _gpu("l40s", board="NVIDIA L40S", memory_gib=44.4, memory_bw=0.864e12, intra=_PCIE4, inter=_ETH100,
                 fabric="PCIe Gen4"),
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
        gbps, lat = getattr(args, f"{level}_gbps"), getattr(args, f"{level}_latency_us")
        if gbps is not None or lat is not None:
            changes[level] = Link(gbps * 1e9 if gbps is not None else link.busbw,
                                  lat * 1e-6 if lat is not None else link.latency_s)
    if not changes:
        return hw
    source = dict(hw.source)
    for key in changes:
        source[key] = "given on the command line (cluster.*)"
    return replace(hw, **changes, source=source)
