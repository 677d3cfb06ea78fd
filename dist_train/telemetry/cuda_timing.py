"""CUDA timing of collectives: events on the rank's own device, never a future, a watcher thread or a host wait.

`telemetry/comm.py` decides what is a collective and how big it is; this module times those whose tensors
live on a GPU (gloo's CPU collectives are timed on the wall clock there).

- Start: an event on the caller's current stream, recorded before the call is issued (NCCL's stream waits for
  that point, so nothing of the collective runs before it).
- End of a call the caller made blocking (NCCL: the current stream waits for the collective, the host does
  not): an event on the current stream after the call returns. The call is issued as asked; forcing
  `async_op=True` on it would take it off the caller's stream and change the schedule being measured.
- End of an asynchronous call: a side stream is made to wait for the work (`work.wait()` under that stream
  blocks the stream, not the host), then an event on it. This needs no future, so it also times the single
  coalesced work NCCL returns for `batch_isend_irecv` (1F1B), which has none.

Events are recorded on the device of the call's tensors (a watcher thread or a future's callback would record
on its own current device: cuda:0 on every rank). They are read when a logging window closes: the end events
are synchronised there, never in the step, and each start is placed on the host's `time.perf_counter` clock
through an anchor event recorded on an idle stream at that moment. The ranks of a host then compare issue
times as on gloo (`comm.peer_wait`): the time before the last peer reached the collective, or before this
rank's previous collective on the group ended, is waiting (`wait_s`), not transfer.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

import torch


def cuda_device(tensors: Iterable[Any]) -> torch.device | None:
    """The device of the first CUDA tensor of `tensors`; None for a CPU collective (timed the gloo way)."""
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.device.type == "cuda":
            return t.device
    return None


def _record(stream: Any) -> Any:
    event = torch.cuda.Event(enable_timing=True)
    event.record(stream)
    return event


class CudaTimer:
    """Start and end events of one rank's collectives, and their place on the host clock."""

    def __init__(self) -> None:
        self._side: dict[Any, Any] = {}  # device -> stream made to wait on works, for their end events
        self._idle: dict[Any, Any] = {}  # device -> stream nothing else uses, for the clock's anchor

    def start(self, device: torch.device) -> Any:
        return _record(torch.cuda.current_stream(device))

    def end_now(self, device: torch.device) -> Any:
        """The end of a call that was blocking as asked: its stream has already been made to wait for it."""
        return _record(torch.cuda.current_stream(device))

    def end_after(self, work: Any, device: torch.device, tensors: Iterable[Any]) -> Any:
        """The end of an asynchronous call's `work`, without blocking the host or the caller's streams.

        NCCL's `wait()` also releases the tensors it kept for the caching allocator (they are safe once the
        *waiting* stream passes the collective); recording them on the side stream first keeps their memory
        from being reused before the collective has finished, should the caller drop them before its own wait.
        """
        side = self._stream(self._side, device)
        for t in tensors:
            if isinstance(t, torch.Tensor):
                t.record_stream(side)
        try:
            with torch.cuda.device(device), torch.cuda.stream(side):
                work.wait()
        except Exception:  # the caller sees the failure itself when it waits; this call stays untimed
            return None
        return _record(side)

    def host_starts(self, spans: list[tuple[Any, Any, Any]]) -> list[float]:
        """`time.perf_counter` time at which each (device, start event, end event) started on its GPU.

        Only when a logging window closes: the end events are synchronised, then an anchor event is recorded
        on an idle stream of each device (it runs at once, so its GPU time is the host time of the call) and
        each start is placed before it by the events' elapsed time.
        """
        for _, _, end in spans:
            end.synchronize()
        anchors: dict[Any, tuple[float, Any]] = {}
        for device, _, _ in spans:
            if device not in anchors:
                before = time.perf_counter()
                anchor = _record(self._stream(self._idle, device))
                after = time.perf_counter()
                anchor.synchronize()
                anchors[device] = ((before + after) / 2, anchor)
        out = []
        for device, start, _ in spans:
            host_s, anchor = anchors[device]
            out.append(host_s - start.elapsed_time(anchor) / 1e3)
        return out

    @staticmethod
    def _stream(cache: dict[Any, Any], device: torch.device) -> Any:
        if device not in cache:
            cache[device] = torch.cuda.Stream(device=device)
        return cache[device]
