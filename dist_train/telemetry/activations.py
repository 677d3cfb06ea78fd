"""Activation memory: the bytes autograd keeps alive for backward, measured live.

A saved-tensors hook sees every tensor the graph saves for backward. Each saved tensor is wrapped in a
small handle whose finaliser runs when autograd releases it (after its backward, or when the graph is
freed), so the meter knows the bytes alive at any moment and keeps their peak. Parameters (and views of
them) are not activations and are skipped; a storage saved several times counts once.

Under bf16/fp16 autocast a matrix product saves a 16-bit copy of its fp32 weight for backward. Those copies
grow with the parameters, not with the tokens, so they are counted apart (`weights_peak_bytes`): a saved
tensor is a weight copy when its autograd history is a cast (`ToCopyBackward0`, possibly seen through a view)
of a parameter. This is what
micro-batching, pipeline schedules (GPipe keeps every micro-batch's activations until backward, 1F1B at
most K) and activation checkpointing change. It works on CPU and GPU alike; it does not see memory that
autograd does not save (temporaries freed inside forward), and it only sees the thread that runs the
step (nn.DataParallel's replica threads are not seen).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from dist_train.contracts import local_tensor


class _Saved:
    __slots__ = ("tensor", "key", "meter")

    def __init__(self, tensor: torch.Tensor, key: int, meter: "ActivationMeter") -> None:
        self.tensor, self.key, self.meter = tensor, key, meter

    def __del__(self) -> None:
        self.meter._release(self.key)


def _is_parameter(t: torch.Tensor) -> bool:
    return isinstance(t, nn.Parameter) or isinstance(getattr(t, "_base", None), nn.Parameter)


# Autograd nodes of views through which a saved weight copy may be seen (a Linear saves W.t()).
_VIEWS = frozenset(("TBackward0", "ViewBackward0", "TransposeBackward0", "PermuteBackward0", "ExpandBackward0",
                    "UnsafeViewBackward0", "AliasBackward0"))


def is_weight_copy(t: torch.Tensor) -> bool:
    """Whether `t` is a cast of a parameter (autocast's 16-bit weight copy), possibly through views."""
    fn = t.grad_fn
    for _ in range(3):
        if fn is None:
            return False
        name = type(fn).__name__
        if name == "ToCopyBackward0":
            source = fn.next_functions[0][0] if fn.next_functions else None
            if type(source).__name__ == "_ToTorchTensorBackward" and source.next_functions:
                source = source.next_functions[0][0]  # the local shard of a DTensor parameter (tp's fused q/k/v)
            return source is not None and isinstance(getattr(source, "variable", None), nn.Parameter)
        if name not in _VIEWS or not fn.next_functions:
            return False
        fn = fn.next_functions[0][0]
    return False


class ActivationMeter:
    def __init__(self) -> None:
        self._live: dict[int, list[int]] = {}  # storage ptr -> [handles alive, storage bytes, is a weight copy]
        self.live_bytes = 0
        self.peak_bytes = 0
        self.weights_live_bytes = 0
        self.weights_peak_bytes = 0
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def measuring(self) -> Iterator[None]:
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            yield

    def reset_peak(self) -> None:
        self.peak_bytes = self.live_bytes
        self.weights_peak_bytes = self.weights_live_bytes

    def _pack(self, t: torch.Tensor) -> Any:
        if _is_parameter(t) or t.device.type == "meta":
            return t
        if hasattr(t, "to_local"):  # a DTensor (tensor parallelism) holds its bytes in its local tensor
            with torch.no_grad():
                storage = local_tensor(t).untyped_storage()
        else:
            storage = t.untyped_storage()
        key, nbytes = storage.data_ptr(), storage.nbytes()
        if nbytes == 0:
            return t
        with self._lock:
            entry = self._live.get(key)
            if entry is None:
                copy = is_weight_copy(t)
                self._live[key] = [1, nbytes, copy]
                if copy:
                    self.weights_live_bytes += nbytes
                    self.weights_peak_bytes = max(self.weights_peak_bytes, self.weights_live_bytes)
                else:
                    self.live_bytes += nbytes
                    self.peak_bytes = max(self.peak_bytes, self.live_bytes)
            else:
                entry[0] += 1
        return _Saved(t, key, self)

    @staticmethod
    def _unpack(saved: Any) -> torch.Tensor:
        return saved.tensor if isinstance(saved, _Saved) else saved

    def _release(self, key: int) -> None:
        with self._lock:
            entry = self._live.get(key)
            if entry is None:
                return
            entry[0] -= 1
            if entry[0] == 0:
                if entry[2]:
                    self.weights_live_bytes -= entry[1]
                else:
                    self.live_bytes -= entry[1]
                del self._live[key]
