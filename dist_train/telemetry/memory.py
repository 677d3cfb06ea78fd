"""Memory a rank holds, by category, and the allocator / process peaks of a logging window.

Model-state bytes are counted from the tensors a rank holds locally (a DTensor's local shard, a ZeRO
partition), because on the CPU there is no allocator to ask and RSS does not shrink when a rank frees
a replica. On CUDA the caching allocator's peaks are read and reset per window as well. The peak of all
live tensors (what decides out-of-memory) is the allocator's on CUDA and torch's MemTracker's on the CPU.
"""

from __future__ import annotations

import contextlib
import os
import threading
import weakref
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

import torch

if TYPE_CHECKING:
    from dist_train.contracts import ModelState


def optimizer_state_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]


# MemTracker's categories (its _MemRefType values) under the names of our metrics.
LIVE_CATEGORIES = {"Parameter": "params", "Buffer": "buffers", "Gradient": "grads", "Optstate": "optimizer",
                   "Activation": "activations", "Temp": "temporaries", "Other": "other"}


class LiveMeter:
    """The peak of all live tensors through one step on the CPU, and what they were at that moment.

    torch's MemTracker (a dispatch mode that follows every storage an op makes until it is freed, and storage
    resizes such as FSDP2's) is seeded with what the rank holds when the step begins: the strategy's own tensors
    by category (parameters, gradients, optimizer state, a ZeRO partition or flat buffer). It therefore sees, beside
    the categories dist_train reports, what a strategy gathers, buffers and keeps in flight: unsharded gradients
    held across micro-batches, gathered parameters, collective buffers (its "Temp" and "Activation").
    """

    def __init__(self) -> None:
        self.peak_bytes = 0
        self.peak_by_category: dict[str, int] = {}

    @contextlib.contextmanager
    def measuring(self, state: ModelState) -> Iterator[None]:
        from torch.distributed._tools.mem_tracker import _MemRefType

        tracker = _step_tracker()
        # track_external would file every tensor as "Other"; its own helper files them by what they are.
        for reftype, tensors in ((_MemRefType.PARAM, state.params), (_MemRefType.GRAD, state.grads),
                                 (_MemRefType.OPT, state.optimizer)):
            for t in tensors:
                if isinstance(t, torch.Tensor):
                    tracker._update_and_maybe_create_winfos(t, reftype)
        # Hold no reference through the step: the last step's gradients must be free to go at zero_grad.
        state = tensors = t = None  # type: ignore[assignment]
        with tracker:
            yield
        peak = tracker.get_tracker_snapshot("peak").get(torch.device("cpu"), {})
        self.peak_bytes = int(peak.get("Total", 0))
        self.peak_by_category = {name: int(peak[key]) for key, name in LIVE_CATEGORIES.items() if peak.get(key)}


def _step_tracker() -> Any:
    """torch's MemTracker for the whole step's peak only, without its per-module statistics.

    Those refuse a second forward of the root module inside one tracked region (gradient accumulation, a
    pipeline's micro-batches), and a snapshot per module call is not needed here. What its module hooks do that
    the peak needs is kept: each module's parameters, buffers and gradients are filed by category, and a module
    run again in backward (activation checkpointing's recomputation) files what it makes as activations."""
    import weakref
    from functools import partial

    from torch._guards import active_fake_mode
    from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType, _ModState
    from torch.distributed.tensor import DTensor
    from torch.utils._pytree import tree_map_only
    from torch.utils.weak import WeakIdKeyDictionary

    _WAIT = torch.ops._c10d_functional.wait_tensor.default

    class StepTracker(MemTracker):
        def __init__(self) -> None:
            super().__init__()
            self._seen = WeakIdKeyDictionary()

        def _pre_fw_hook(self, module: torch.nn.Module, inputs: Any) -> None:
            if module not in self._seen:
                self._seen[module] = True
                # MemTracker hooks every parameter; a frozen one (LoRA's base) cannot take a hook.
                self._track_module_params_and_buffers(module, install_grad_hooks=False)
                for param in module.parameters():
                    if param.requires_grad and self._param_to_grad_hook_handles.get(param) is None:
                        self._param_to_grad_hook_handles[param] = (
                            param.register_hook(self._file_grad),
                            param.register_post_accumulate_grad_hook(lambda p: self._file_grad(p.grad)),
                        )
            elif self._mod_tracker.is_bw and self._ac_mod is None:
                self._ac_mod, self._in_ac = weakref.ref(module), True

        def _file_grad(self, grad: torch.Tensor | None) -> None:
            if grad is not None:
                self._update_and_maybe_create_winfos(grad, _MemRefType.GRAD)

        def _post_fw_hook(self, module: torch.nn.Module, inputs: Any, outputs: Any) -> None:
            if self._mod_tracker.is_bw and self._ac_mod is not None and self._ac_mod() is module:
                self._ac_mod, self._in_ac = None, False

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            # MemTracker's own, less its per-op cost where an op makes no tensor: prim.device (the autograd
            # engine and DTensor ask every fake tensor's device through the dispatcher: half the ops of a
            # tensor-parallel step), sizes, scalars. Such an op allocates nothing, and a storage resize before it
            # is counted at the next op that makes a tensor, as MemTracker counts it. A 70B fsdp_tp dry run
            # spent a quarter of its time in this mode's bookkeeping.
            if DTensor in types:  # let DTensor desugar into local ops first, which this mode then sees
                return NotImplemented
            if func is _WAIT and active_fake_mode():
                return super().__torch_dispatch__(func, types, args, kwargs)
            res = func(*args, **kwargs or {})
            if isinstance(res, torch.Tensor) or (isinstance(res, (tuple, list)) and res):
                # not DTensor's propagation under its own mode (torch 2.11's MemTracker keeps no entry mode: the
                # CUDA images of lent GPUs carry 2.11, and a real run has no fake mode)
                if active_fake_mode() is getattr(self, "_fake_mode_on_entry", None):
                    if self._in_opt:
                        reftype = _MemRefType.OPT
                    elif self._mod_tracker.is_bw and not self._in_ac:
                        reftype = _MemRefType.TEMP
                    else:
                        reftype = _MemRefType.ACT
                    if isinstance(res, torch.Tensor):
                        self._track(reftype, res)
                    else:
                        tree_map_only(torch.Tensor, partial(self._track, reftype), res)
                    self._update_peak_stats(_ModState.PEAK_BW if self._mod_tracker.is_bw else _ModState.PEAK_FW)
            return res

        def _pre_bw_hook(self, module: torch.nn.Module, args: Any) -> None:
            pass

        def _post_bw_hook(self, module: torch.nn.Module, args: Any) -> None:
            pass

    return StepTracker()


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


_STATM = "/proc/self/statm"
_PAGE_BYTES = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def anon_bytes() -> int | None:
    """This process's anonymous resident memory now (Linux RssAnon: resident pages less file-backed and shared
    ones, from /proc/self/statm, as psutil's `rss - shared`); None where /proc is not there."""
    try:
        with open(_STATM, "rb") as f:
            fields = f.read().split()
    except OSError:
        return None
    return (int(fields[1]) - int(fields[2])) * _PAGE_BYTES


class AnonPeak:
    """The peak of this process's anonymous resident memory from `start()` to `stop()`, sampled by a daemon thread.

    Linux keeps a high-water mark of the whole resident set (VmHWM) but none of its anonymous part, and VmHWM counts
    the pages of memory-mapped weight files a rank has read: shared page cache the kernel can drop, not what the
    process allocated. So a thread reads RssAnon every `interval_s` (and once at start and at stop): a rise and fall
    shorter than the interval can be missed. It costs one read of /proc per interval, and is meant for set-up only:
    the telemetry stops it before the first step. A sampler dropped without `stop()` ends its thread too."""

    def __init__(self, *, interval_s: float = 0.02) -> None:
        self.interval_s = interval_s
        self._peak: list[int] = []  # shared with the thread, which holds no reference to this object
        self._done = threading.Event()
        self._thread: threading.Thread | None = None
        weakref.finalize(self, self._done.set)

    def start(self) -> AnonPeak:
        first = anon_bytes()
        if first is None:  # no /proc: nothing to sample
            return self
        self._peak.append(first)
        self._thread = threading.Thread(target=_sample, args=(self._peak, self._done, self.interval_s),
                                        name="dist_train-anon-peak", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> int | None:
        """End the sampling (idempotent); the peak in bytes, None where nothing was sampled."""
        self._done.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
            now = anon_bytes()
            self._peak[0] = max(self._peak[0], now or 0)
        return self._peak[0] if self._peak else None

    @property
    def peak_bytes(self) -> int | None:
        """The peak so far (while sampling: up to the last reading)."""
        return self._peak[0] if self._peak else None


def _sample(peak: list[int], done: threading.Event, interval_s: float) -> None:
    while not done.wait(interval_s):
        now = anon_bytes()
        if now is not None and now > peak[0]:
            peak[0] = now


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
