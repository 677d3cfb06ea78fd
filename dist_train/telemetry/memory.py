"""Memory a rank holds, by category, and the allocator / process peaks of a logging window.

Model-state bytes are counted from the tensors a rank holds locally (a DTensor's local shard, a ZeRO
partition), because on the CPU there is no allocator to ask and RSS does not shrink when a rank frees
a replica. On CUDA the caching allocator's peaks are read and reset per window as well.
"""

from __future__ import annotations

from pathlib import Path

import torch


def optimizer_state_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]





class HostPeak:
    """Peak resident set size of this process; reset per window where Linux allows it."""

    _STATUS = Path("/proc/self/status")
    _CLEAR = Path("/proc/self/clear_refs")

    def __init__(self) -> None:
        self.resettable = self._STATUS.exists()

    def reset(self) -> None:
        if not self.resettable:
            return
        try:
            self._CLEAR.write_text("5")  # "5" resets the VmHWM high-water mark to the current RSS
        except OSError:
            self.resettable = False

    def current_bytes(self) -> int:
        """Resident set size now (VmRSS); 0 where /proc is not there."""
        if self._STATUS.exists():
            for line in self._STATUS.read_text().splitlines():
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        return 0

    def peak_bytes(self) -> int:
        if self._STATUS.exists():
            for line in self._STATUS.read_text().splitlines():
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # lifetime peak, never reset


def cuda_peaks(devices: list[torch.device]) -> dict[str, int]:
    """Allocator peaks since the last reset: of the rank's device, and of every device when there are several."""
    cuda = [d for d in devices if d.type == "cuda"]
    if not cuda:
        return {}
    out: dict[str, int] = {}
    per_device = [(torch.cuda.max_memory_allocated(d), torch.cuda.max_memory_reserved(d)) for d in cuda]
    out["memory/peak_allocated_bytes"] = max(a for a, _ in per_device)
    out["memory/peak_reserved_bytes"] = max(r for _, r in per_device)
    out["device/total_memory_bytes"] = min(torch.cuda.get_device_properties(d).total_memory for d in cuda)
    if len(cuda) > 1:  # nn.DataParallel: the master-GPU imbalance is the point
        for d, (alloc, reserved) in zip(cuda, per_device):
            out[f"memory/gpu{d.index}/peak_allocated_bytes"] = alloc
            out[f"memory/gpu{d.index}/peak_reserved_bytes"] = reserved
    return out


def reset_cuda_peaks(devices: list[torch.device]) -> None:
    for d in devices:
        if d.type == "cuda":
            torch.cuda.reset_peak_memory_stats(d)
