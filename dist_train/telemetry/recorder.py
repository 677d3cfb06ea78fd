"""Per-rank telemetry of each logging window, gathered to rank 0 on logging steps only.

In the step: device tensors are kept (loss, grad norm) and a wall-clock stamp is taken; nothing is
synchronised or moved to the host. When a window closes every rank builds one record (memory by
category, allocator and RSS peaks, collectives, step time), the records are all-gathered with the
training's collectives paused, the global figures are added (loss over the global batch, throughput, MFU)
and rank 0 hands the records to the sinks.

Every rank sees every record, so every rank reaches the same verdict on the window's losses without a
collective of its own: a NaN/Inf loss (or, outside fp16, gradient norm) stops the run on all ranks at once,
naming the step; under fp16 loss scaling a non-finite gradient norm is a skipped step, counted instead.
"""

from __future__ import annotations

import contextlib
import logging
import math
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from dist_train.contracts import Runtime, StepOutput, Strategy
from dist_train.telemetry.activations import ActivationMeter
from dist_train.telemetry.bandwidth import busbw_gbps
from dist_train.telemetry.comm import CommTracker
from dist_train.telemetry.comm_analysis import comm_keys, peer_wait, total_comm_s
from dist_train.telemetry.memory import AnonPeak, HostPeak, LiveMeter, cuda_peaks, reset_cuda_peaks
from dist_train.telemetry.sinks import Sink

log = logging.getLogger("dist_train")

GLOBAL_KEYS = (
    "loss", "lr", "grad_norm", "throughput/tokens_per_s", "throughput/samples_per_s", "mfu", "train/skipped_steps",
    "eval/loss", "eval/perplexity", "time/eval_s",
)


class NonFiniteLoss(RuntimeError):
    """The loss (or the gradient norm) of a step is NaN or Inf; raised on every rank at the same window."""

    def __init__(self, step: int, what: str, value: float) -> None:
        super().__init__(
            f"training stopped at step {step}: the {what} is {value} (not finite); no checkpoint is written from "
            f"step {step} on. Lower train.lr, keep train.grad_clip > 0, or use precision=bf16 rather than fp16"
        )
        self.step = step


@dataclass(frozen=True)
class Workload:
    """Work per optimizer step, for throughput and MFU."""

    tokens_per_step: int
    samples_per_step: int
    flops_per_token: float
    peak_flops: float | None  # per device; None: no MFU
    num_devices: int


@dataclass
class _Pending:
    loss_sum: torch.Tensor | None
    num_microbatches: int
    grad_norm: torch.Tensor | None


@dataclass
class Telemetry:
    runtime: Runtime
    strategy: Strategy
    sink: Sink
    workload: Workload
    tracker: CommTracker | None = None
    activations: ActivationMeter | None = None
    moe: Any = None  # an MoE model's router load (telemetry/moe.py RouterLoad)
    live: LiveMeter | None = None  # peak of all live tensors on the CPU (CUDA: the allocator's peak)
    # The first step whose peak of live tensors is reported (live_step): the one LiveMeter follows on the CPU; on
    # CUDA every window ending there or later. None: the run ends before the optimizer's state exists.
    live_step: int | None = None
    # fp16 loss scaling: a non-finite gradient norm means the scaler skipped that step (counted, not fatal).
    skips_allowed: bool = False
    _host: HostPeak = field(default_factory=HostPeak)
    _window: list[_Pending] = field(default_factory=list)
    _window_start_s: float = 0.0
    step_end_s: list[float] = field(default_factory=list)
    start_s: float = 0.0
    history: list[list[dict[str, Any]]] = field(default_factory=list)  # rank 0: records of every window
    step_losses: list[float] = field(default_factory=list)  # rank 0: global loss of every logged step
    skipped_steps: int = 0  # fp16: steps the loss scaler skipped
    first_step_wall: float | None = None  # wall clock (epoch s) when this process finished its first step
    _checkpoint_s: float = 0.0  # time the window's steps waited for checkpoint saves
    _setup_peaks: dict[str, int] = field(default_factory=dict)  # memory/setup_peak_*: set-up's peaks, read at start
    # Set-up's memory milestones (session._strategy): resident bytes before the model was built, peak once loaded.
    setup_memory: dict[str, int] = field(default_factory=dict)
    setup_anon: AnonPeak | None = None  # sampling anonymous memory since set-up began; stopped at start()
    eval_losses: list[tuple[int, float]] = field(default_factory=list)  # (step, held-out loss) of every evaluation
    _eval: dict[str, float] = field(default_factory=dict)  # the evaluation at the window's last step, for its records
    _eval_end_s: float | None = None  # when it ended: the next window starts there

    def restore(self, *, losses: list[float], history: list[list[dict[str, Any]]], skipped_steps: int = 0,
                eval_losses: list[Any] = ()) -> None:
        """Continue a resumed run's record: the losses of the steps before it, and the windows metrics.jsonl holds."""
        self.step_losses = list(losses)
        self.history = list(history)
        self.skipped_steps = skipped_steps
        self.eval_losses = [(int(s), float(v)) for s, v in eval_losses]

    def evaluate(self, step: int, run: Any) -> float:
        """Evaluate at `step` (a logged one; every rank calls this before `log`): `run()` gives this rank's
        eval_step outputs. Their loss over the held-out batches, wherever the losses live, goes into the window's
        records as `eval/loss` and `eval/perplexity`. The step's own time ends before it (the clock is read after
        a device sync) and the next window starts after it; its collectives are not counted as training's."""
        if synchronize(self.strategy.devices):
            self.step_end_s[-1] = time.perf_counter()
        start = time.perf_counter()
        with self.tracker.paused() if self.tracker is not None else contextlib.nullcontext():
            local = [(float(o.loss_sum.detach().float().cpu()) if o.loss_sum is not None else None, o.num_microbatches)
                     for o in run()]
            everyone = self._gather({"parts": local})
        loss = mean_loss([part for r in everyone for part in r["parts"]])
        self._eval_end_s = time.perf_counter()
        self._eval = {"eval/loss": loss, "eval/perplexity": perplexity(loss), "time/eval_s": self._eval_end_s - start}
        self.eval_losses.append((step, loss))
        return loss

    def add_checkpoint_time(self, seconds: float) -> None:
        """A save blocked the training this long; reported in the next window as `time/checkpoint_s` per step.

        A save follows its step's window (a checkpoint step is a logged one): what it allocated (state dicts,
        host staging copies) is not the next window's training, so the peaks start again after it."""
        self._checkpoint_s += seconds
        self._reset_peaks()

    def start(self) -> None:
        # Before the first step: what set-up itself held.
        self._setup_peaks = setup_peaks(self._host, self.strategy.devices, anon=self.setup_anon)
        self._setup_peaks.update(self.setup_memory)
        log.info("set-up peak: %s", describe_setup_peaks(self._setup_peaks))
        self._reset_peaks()
        if self.tracker is not None:
            self.tracker.drain()  # set-up traffic (DDP's initial broadcast, ...) is not a step's
        self.start_s = self._window_start_s = time.perf_counter()

    def measuring(self, step: int, *, live: bool = False) -> Any:
        """Context for the step itself: activation bytes are counted on the first step of each logging window,
        and on the CPU the peak of all live tensors once, on the step the loop names `live` (`live_step`: a
        warm-up step where the run is long enough, since torch's MemTracker makes it several times slower).

        Every step saves the same tensors (same shapes, same graph), so one step per window gives the window's
        peak; counting every step would cost each step a Python call per saved tensor and per release."""
        stack = contextlib.ExitStack()
        if live and self.live is not None:
            stack.enter_context(self.live.measuring(self.strategy.model_state()))
        if self.activations is not None and not self._window:
            stack.enter_context(self.activations.measuring())
        return stack

    def step_end(self, step: int, out: StepOutput) -> None:
        self._window.append(_Pending(out.loss_sum, out.num_microbatches, out.grad_norm))
        if self.first_step_wall is None:  # start-up cost: from the process's start to the first step's end
            synchronize(self.strategy.devices)  # once: the GPU's work, not only its queueing, is the first step's
            self.first_step_wall = time.time()
        self.step_end_s.append(time.perf_counter())
        self.sink.on_step(step)

    def log(self, step: int) -> None:
        """Close the window ending at `step` (1-based); every rank must call it."""
        if not self._window:
            return
        if self._eval_end_s is None and synchronize(self.strategy.devices):  # the one sync: at the window's end,
            self.step_end_s[-1] = time.perf_counter()  # not in a step (every GPU of dp); evaluate() did it already
        first_step = step - len(self._window) + 1
        local = self._local_record(step)
        gathered = self._gather(local)
        self._add_transfers(gathered, len(self._window))
        records, losses, norms = self._add_global(gathered)
        self._window, self._window_start_s = [], self._eval_end_s or self.step_end_s[-1]
        self._eval, self._eval_end_s = {}, None
        self._checkpoint_s = 0.0
        self._reset_peaks()
        if self.runtime.is_main:
            self.history.append(records)
            self.sink.log(step, records)
        bad = self._first_non_finite(losses, norms, first_step=first_step)
        if bad is not None:
            self._stop(bad)

    def _first_non_finite(
        self, losses: list[float], norms: list[float | None], *, first_step: int
    ) -> NonFiniteLoss | None:
        for i, (loss, norm) in enumerate(zip(losses, norms)):
            if not math.isfinite(loss):
                return NonFiniteLoss(first_step + i, "loss", loss)
            if norm is not None and not math.isfinite(norm) and not self.skips_allowed:
                return NonFiniteLoss(first_step + i, "gradient norm", norm)
        return None

    def _stop(self, error: NonFiniteLoss) -> None:
        """Rank 0 says why; every rank waits until it has, then all raise (a rank exiting first would let the
        launcher kill rank 0 before it speaks)."""
        if self.runtime.is_main:
            log.error("%s", error)
        if self.runtime.has_group and dist.is_initialized() and dist.get_world_size() > 1:
            with self.tracker.paused() if self.tracker is not None else contextlib.nullcontext():
                dist.barrier()
        raise error

    # ------------------------------------------------------------------ building records
    def _local_record(self, step: int) -> dict[str, Any]:
        n = len(self._window)
        rec: dict[str, Any] = {
            "step": step, "rank": self.runtime.rank, "node": self.runtime.node, "local_rank": self.runtime.local_rank,
        }
        state = self.strategy.model_state()
        rec.update(state.bytes())
        rec.update(state.by_dtype())
        if self.activations is not None:
            rec["memory/activations_bytes"] = self.activations.peak_bytes
            for dtype, nbytes in self.activations.peak_by_dtype.items():
                rec[f"memory/by_dtype/activations/{dtype}_bytes"] = nbytes
            if self.activations.weights_peak_bytes:
                rec["memory/weight_copies_bytes"] = self.activations.weights_peak_bytes
        rec.update(cuda_peaks(self.strategy.devices))
        if "memory/peak_allocated_bytes" in rec:  # on CUDA the allocator's peak is every live tensor's,
            if self.live_step is not None and step >= self.live_step:  # once the optimizer's state exists
                rec["memory/peak_live_bytes"] = rec["memory/peak_allocated_bytes"]
        elif self.live is not None and self.live.peak_bytes:  # in the window of the step it followed
            rec["memory/peak_live_bytes"] = self.live.peak_bytes
            for category, nbytes in self.live.peak_by_category.items():
                rec[f"memory/peak_live/{category}_bytes"] = nbytes
            self.live.peak_bytes, self.live.peak_by_category = 0, {}
        rec["memory/peak_rss_bytes"] = self._host.peak_bytes()
        rec.update(self._setup_peaks)
        if self.tracker is not None:
            totals = self.tracker.drain()
            rec.update(comm_keys(totals, n, multi_node=self.tracker.multi_node))
            # Issue times on the host's monotonic clock (CUDA events are mapped onto it): comparable across the
            # ranks of a host, so each call's wait for late peers is split out (`wait_s`), on gloo and on NCCL.
            rec["_comm_calls"] = {op: t.calls for op, t in totals.items()}
            rec["_comm_group_size"] = {op: t.group_size for op, t in totals.items()}
        rec.update(self.strategy.extra_metrics())
        if self.moe is not None:
            rec.update(self.moe.drain())
        rec["time/step_s"] = (self.step_end_s[-1] - self._window_start_s) / n
        comm_s = total_comm_s(rec) if self.tracker is not None else None
        if comm_s is not None:  # collective time (an upper bound of the exposed part) and the rest; neither
            rec["time/comm_s"] = comm_s  # where some collective ran untimed (`comm/untimed_count`)
            rec["time/compute_s"] = max(rec["time/step_s"] - comm_s, 0.0)
        rec["time/checkpoint_s"] = self._checkpoint_s / n
        rec["_losses"] = [
            (float(p.loss_sum.detach().float().cpu()) if p.loss_sum is not None else None, p.num_microbatches)
            for p in self._window
        ]
        rec["_grad_norms"] = [
            float(p.grad_norm.detach().float().cpu()) if p.grad_norm is not None else None for p in self._window
        ]
        rec["lr"] = self.strategy.lr
        return rec

    def _gather(self, local: dict[str, Any]) -> list[dict[str, Any]]:
        """Every rank's record, on every rank (so each can judge the window's losses itself)."""
        if not (self.runtime.has_group and dist.is_initialized()) or dist.get_world_size() == 1:
            return [local]
        out: list[Any] = [None] * dist.get_world_size()
        with self.tracker.paused() if self.tracker is not None else contextlib.nullcontext():
            dist.all_gather_object(out, local)
        return out

    @staticmethod
    def _add_transfers(records: list[dict[str, Any]], num_steps: int) -> None:
        """Each rank's time waiting for its peers (`comm/<op>/wait_s`), and bus bandwidth from the rest."""
        if "_comm_calls" not in records[0]:
            return
        split = peer_wait({r["rank"]: r["_comm_calls"] for r in records}, {r["rank"]: r["node"] for r in records})
        for r in records:
            for op, t in split[r["rank"]].items():
                if f"comm/{op}/time_s" not in r:  # some of its calls untimed: no split of a time not known
                    continue
                r[f"comm/{op}/wait_s"] = t.wait_s / num_steps
                if t.timed_bytes:
                    r[f"comm/{op}/busbw_gbps"] = busbw_gbps(op, t.timed_bytes, t.transfer_s, r["_comm_group_size"][op])

    def _add_global(
        self, records: list[dict[str, Any]]
    ) -> tuple[list[dict[str, Any]], list[float], list[float | None]]:
        """Loss over the global batch (wherever it lives), throughput and MFU, the same on every record; also
        each step's global loss and gradient norm."""
        num_steps = len(records[0]["_losses"])
        losses, norms = [], []
        for i in range(num_steps):
            losses.append(mean_loss([r["_losses"][i] for r in records]))
            # The global norm: every rank that computed it holds the same value.
            norms.append(next((r["_grad_norms"][i] for r in records if r["_grad_norms"][i] is not None), None))
        if self.runtime.is_main:
            self.step_losses.extend(losses)
        finite_norms = [v for v in norms if v is not None and math.isfinite(v)]
        skipped = sum(1 for v in norms if v is not None and not math.isfinite(v)) if self.skips_allowed else 0
        self.skipped_steps += skipped
        step_s = records[0]["time/step_s"]
        w = self.workload
        glob: dict[str, Any] = {
            "loss": sum(losses) / len(losses),
            "grad_norm": sum(finite_norms) / len(finite_norms) if finite_norms else None,
            "throughput/tokens_per_s": w.tokens_per_step / step_s if step_s > 0 else 0.0,
            "throughput/samples_per_s": w.samples_per_step / step_s if step_s > 0 else 0.0,
        }
        if w.peak_flops:
            glob["mfu"] = glob["throughput/tokens_per_s"] * w.flops_per_token / (w.peak_flops * w.num_devices)
        if self.skips_allowed:
            glob["train/skipped_steps"] = skipped
        glob.update(self._eval)
        out = []
        for r in records:
            r = {k: v for k, v in r.items() if not k.startswith("_")}
            r.update(glob)
            out.append(r)
        return out, losses, norms

    def _reset_peaks(self) -> None:
        if self.activations is not None:
            self.activations.reset_peak()
        self._host.reset()
        reset_cuda_peaks(self.strategy.devices)

    # ------------------------------------------------------------------ summary
    def mfu(self, step_s: float) -> float | None:
        """Model FLOPs utilisation at `step_s` per step; None where the device's peak is unknown (CPU)."""
        w = self.workload
        if not w.peak_flops or step_s <= 0:
            return None
        return w.tokens_per_step / step_s * w.flops_per_token / (w.peak_flops * w.num_devices)

    def mean_step_s(self, warmup_steps: int) -> float:
        """Mean wall-clock step time on this rank, leaving out the first `warmup_steps` steps."""
        ends = self.step_end_s
        if not ends:
            return 0.0
        if warmup_steps >= len(ends) or warmup_steps == 0:
            return (ends[-1] - self.start_s) / len(ends)
        return (ends[-1] - ends[warmup_steps - 1]) / (len(ends) - warmup_steps)

    def median_step_s(self, warmup_steps: int) -> float | None:
        """Median wall-clock step on this rank, leaving out the first `warmup_steps` steps: each step from the end
        of the one before (the first from the start). Unlike the mean, one slow step does not move it: on this
        CPU the step after a 2-step warm-up ran 1.2-1.9x the later ones (ddp and zero2, 12 launches logging every
        step), and a launch's mean over 8 steps moved with it.

        None on a GPU: a step's end is read there when its work was queued, not done (the loop synchronises once a
        logging window, never each step), so single steps are not timed; the mean over the windows is."""
        ends = self.step_end_s
        if any(d.type == "cuda" for d in self.strategy.devices):
            return None
        if not ends:
            return 0.0
        spans = [b - a for a, b in zip([self.start_s, *ends[:-1]], ends)]
        return statistics.median(spans[warmup_steps:] if warmup_steps < len(spans) else spans)

    def per_rank_summary(self, warmup_end: int = 0) -> list[dict[str, Any]]:
        """Rank 0: for every rank the peak of each memory figure (over all steps) and the per-step mean of
        every other per-rank figure (collectives, step time, pipeline/bubble_fraction, ...) over the windows
        after step `warmup_end`: the first steps carry set-up traffic (ZeRO-3 traces the model, a pipeline
        shakes hands) that is not what a step costs. The training loop closes a window at `warmup_end`, so
        none straddles it (one that did would count as steady)."""
        if not self.history:
            return []
        out = []
        for rank in range(len(self.history[0])):
            windows = [records[rank] for records in self.history]
            steps = [w["step"] for w in windows]
            spans = [s - p for s, p in zip(steps, [0] + steps[:-1])]
            steady = [i for i, s in enumerate(steps) if s > warmup_end] or list(range(len(windows)))
            row: dict[str, Any] = {"rank": rank, "node": windows[-1].get("node"), "local_rank": windows[-1].get("local_rank")}
            # Every window's keys: a figure measured in one window only (memory/peak_live_*) is kept too.
            for key in dict.fromkeys(k for w in windows for k in w):
                values = [w.get(key) for w in windows]
                if key in GLOBAL_KEYS or "/" not in key or not any(isinstance(v, (int, float)) for v in values):
                    continue
                if key.startswith("memory/"):
                    row[key] = max(v for v in values if isinstance(v, (int, float)))
                elif all(isinstance(values[i], (int, float)) for i in steady):
                    row[key] = sum(values[i] * spans[i] for i in steady) / sum(spans[i] for i in steady)
            out.append(row)
        return out


def synchronize(devices: list[torch.device]) -> bool:
    """Wait for the work queued on these CUDA devices; False (nothing waited for) on the CPU."""
    cuda = [d for d in devices if d.type == "cuda"]
    for d in cuda:
        torch.cuda.synchronize(d)
    return bool(cuda)


def mean_loss(parts: list[tuple[float | None, int]]) -> float:
    """The mean micro-batch loss over the global batch from each rank's (loss sum, micro-batches): the ranks that
    hold a loss (all under data parallelism, a pipeline's last stages); NaN if none does."""
    held = [(s, n) for s, n in parts if s is not None]
    total = sum(n for _, n in held)
    return sum(s for s, _ in held) / total if total else float("nan")


def perplexity(loss: float) -> float:
    """exp(loss), capped at exp(80) so that a diverged loss reads as a huge number, not an overflow."""
    return math.exp(min(loss, 80.0))


def setup_peaks(host: HostPeak, devices: list[torch.device], *, anon: AnonPeak | None = None) -> dict[str, int]:
    """This process's peaks of set-up, read at its end (nothing reset them yet):
    - memory/setup_peak_anon_bytes: anonymous resident memory, what the process allocated, sampled by `anon` (which
      this stops) from the start of set-up (session.build_session, after imports and the process group);
    - memory/setup_peak_rss_bytes: resident memory from the process's start (VmHWM, imports included: it starts
      again at exec, where Linux's ru_maxrss keeps the launcher's), with the pages of memory-mapped weight files
      the rank read: shared page cache, which the kernel can drop;
    - on CUDA, the allocator's peak."""
    out = {"memory/setup_peak_rss_bytes": host.peak_bytes()}
    peak = anon.stop() if anon is not None else None
    if peak is not None:
        out["memory/setup_peak_anon_bytes"] = peak
    cuda = [d for d in devices if d.type == "cuda"]
    if cuda:
        out["memory/setup_peak_allocated_bytes"] = max(torch.cuda.max_memory_allocated(d) for d in cuda)
    return out


def describe_setup_peaks(peaks: dict[str, int]) -> str:
    """One line for the log: set-up's anonymous peak, then its resident one (VmHWM)."""
    mib = 2**20
    anon = peaks.get("memory/setup_peak_anon_bytes")
    parts = [f"{anon / mib:.1f} MiB anonymous"] if anon is not None else []
    parts.append(f"{peaks['memory/setup_peak_rss_bytes'] / mib:.1f} MiB resident (pages of mapped files included)")
    if "memory/setup_peak_allocated_bytes" in peaks:
        parts.append(f"{peaks['memory/setup_peak_allocated_bytes'] / mib:.1f} MiB allocated on the device")
    return ", ".join(parts)


def live_step(*, start_step: int, last_step: int, warmup_steps: int) -> int | None:
    """The first step whose peak of all live tensors is reported, None where the run ends before it.

    A torch optimizer makes its state (AdamW's moments) at its first step(), so the peak of a fresh run's first
    step misses it (14% under torch's FSDPMemTracker, measured, which agrees byte for byte from the second step
    on); a resumed run loads the state with the checkpoint before its first step (DCP's load and DeepSpeed's engine
    alike: a resumed fsdp and zero2 run's first step had it, measured), so that step has it. Not before `start_step + warmup_steps` either, as far as the run has a
    step after that: on the CPU the step MemTracker follows is the last warm-up step (warmup_steps: those
    wanted, that one included), except where the run is too short (a fresh run of 2 steps: step 2)."""
    first_with_state = 2 if start_step == 0 else 1
    step = start_step + max(min(warmup_steps, last_step - start_step - 1), first_with_state)
    return step if step <= last_step else None

