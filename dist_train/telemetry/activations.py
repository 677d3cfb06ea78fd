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

Under activation checkpointing (non-reentrant, dist_train.model.apply_activation_checkpointing) a block's
forward saves nothing the meter sees but its input; in backward, the block is recomputed under torch's own
saved-tensors hooks, which hide the recomputed tensors from an outer hook. `metered_checkpoint` chains the
meter in front of those hooks during the recomputation, so the one block recomputed in full is counted
(released once the recomputation's graph is dropped: the peak is the point, and it is reached right then).

Selective checkpointing (torch's `create_selective_checkpoint_contexts`, passed as the checkpoint's `context_fn`)
keeps the outputs of the ops its policy saves in a cache of its own, not through saved-tensors hooks. The meter
counts each cached output from forward until the recomputation takes it from the cache (from then on the
recomputed graph holds it, and the meter sees that as above) or the cache is dropped.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import threading
from collections.abc import Iterator
from typing import Any, SupportsIndex

import torch
from torch import nn

from dist_train.contracts import dtype_name, local_tensor


class _Saved:
    __slots__ = ("tensor", "key", "meter")

    def __init__(self, tensor: torch.Tensor | None, key: int, meter: "ActivationMeter") -> None:
        self.tensor, self.key, self.meter = tensor, key, meter

    def __del__(self) -> None:
        self.meter._release(self.key)


def _is_parameter(t: torch.Tensor) -> bool:
    """A parameter, a view of one, or a view of a DTensor parameter's local shard (expert parallelism's per-expert
    weights, `gate_up_proj.to_local()[e]`): bytes the parameter already holds, not an activation."""
    if isinstance(t, nn.Parameter) or isinstance(getattr(t, "_base", None), nn.Parameter):
        return True
    fn = t.grad_fn
    for _ in range(3):
        if fn is None or not fn.next_functions:
            return False
        name = type(fn).__name__
        if name == "_ToTorchTensorBackward":
            source = fn.next_functions[0][0]
            return isinstance(getattr(source, "variable", None), nn.Parameter)
        if name not in _VIEWS and name not in ("SelectBackward0", "SliceBackward0"):
            return False
        fn = fn.next_functions[0][0]
    return False


# Autograd nodes of views through which a saved weight copy may be seen (a Linear saves W.t()).
_VIEWS = frozenset(("TBackward0", "ViewBackward0", "TransposeBackward0", "PermuteBackward0", "ExpandBackward0",
                    "UnsafeViewBackward0", "AliasBackward0"))


def is_weight_copy(t: torch.Tensor) -> bool:
    """Whether `t` is a cast of a parameter (autocast's 16-bit weight copy), possibly through views, or of a slice of
    one (transformers' eager experts cast each expert's `gate_up_proj[e]`)."""
    fn = t.grad_fn
    for _ in range(3):
        if fn is None:
            return False
        name = type(fn).__name__
        if name == "ToCopyBackward0":
            source = fn.next_functions[0][0] if fn.next_functions else None
            for _ in range(3):
                if type(source).__name__ == "_ToTorchTensorBackward" and source.next_functions:
                    source = source.next_functions[0][0]  # a DTensor parameter's local shard (tp's fused q/k/v)
                elif (type(source).__name__ in _VIEWS or type(source).__name__ in ("SelectBackward0", "SliceBackward0")
                      ) and source.next_functions:
                    source = source.next_functions[0][0]  # one expert of stacked experts, or their transpose
                else:
                    break
            return source is not None and isinstance(getattr(source, "variable", None), nn.Parameter)
        if name not in _VIEWS or not fn.next_functions:
            return False
        fn = fn.next_functions[0][0]
    return False


_ACTIVE: "ActivationMeter | None" = None  # the meter of the step being measured (one training loop per process)


class ActivationMeter:
    def __init__(self) -> None:
        self._live: dict[int, list[Any]] = {}  # storage ptr -> [handles alive, bytes, is a weight copy, dtype]
        self.live_bytes = 0
        self.peak_bytes = 0
        self._live_by_dtype: dict[str, int] = {}
        self.peak_by_dtype: dict[str, int] = {}  # what the activations at the peak were made of
        self.weights_live_bytes = 0
        self.weights_peak_bytes = 0
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def measuring(self) -> Iterator[None]:
        global _ACTIVE
        _ACTIVE = self  # a global, not thread-local: backward may run on the autograd engine's device threads
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                yield
        finally:
            _ACTIVE = None

    @contextlib.contextmanager
    def recomputing(self) -> Iterator[None]:
        """Count what is saved here while passing it on to the hooks already in place (a checkpoint's
        recomputation stores its tensors through them)."""
        top = torch._C._autograd._top_saved_tensors_default_hooks(False)
        if top is None:
            with self.measuring():
                yield
            return
        inner_pack, inner_unpack = top

        def pack(t: torch.Tensor) -> Any:
            key = self._track(t)  # a handle without the tensor: holding it would tie it to its own graph
            return (None if key is None else _Saved(None, key, self)), inner_pack(t)

        def unpack(packed: Any) -> torch.Tensor:
            return inner_unpack(packed[1])

        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            yield

    def reset_peak(self) -> None:
        self.peak_bytes = self.live_bytes
        self.peak_by_dtype = self._composition()
        self.weights_peak_bytes = self.weights_live_bytes

    def _composition(self) -> dict[str, int]:
        """Live activation bytes by dtype, now."""
        return {k: v for k, v in self._live_by_dtype.items() if v}

    def _pack(self, t: torch.Tensor) -> Any:
        key = self._track(t)
        return t if key is None else _Saved(t, key, self)

    def _track(self, t: torch.Tensor) -> int | None:
        """Count `t`'s storage as alive; its key, or None when it is not an activation."""
        if _is_parameter(t) or t.device.type == "meta":
            return None
        if hasattr(t, "to_local"):  # a DTensor (tensor parallelism) holds its bytes in its local tensor
            with torch.no_grad():
                storage = local_tensor(t).untyped_storage()
        else:
            storage = t.untyped_storage()
        key, nbytes = storage.data_ptr(), storage.nbytes()
        if nbytes == 0:
            return None
        with self._lock:
            entry = self._live.get(key)
            if entry is None:
                copy, dtype = is_weight_copy(t), dtype_name(t.dtype)
                self._live[key] = [1, nbytes, copy, dtype]
                if copy:
                    self.weights_live_bytes += nbytes
                    self.weights_peak_bytes = max(self.weights_peak_bytes, self.weights_live_bytes)
                else:
                    self.live_bytes += nbytes
                    self._live_by_dtype[dtype] = self._live_by_dtype.get(dtype, 0) + nbytes
                    if self.live_bytes > self.peak_bytes:
                        self.peak_bytes = self.live_bytes
                        self.peak_by_dtype = self._composition()
            else:
                entry[0] += 1
        return key

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
                    self._live_by_dtype[entry[3]] -= entry[1]
                del self._live[key]


class _Recomputed:
    """A checkpointed function whose recomputation (every call after the first) the active meter counts."""

    __slots__ = ("fn", "calls")

    def __init__(self, fn: Any) -> None:
        self.fn, self.calls = fn, 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        meter = _ACTIVE
        if self.calls == 1 or meter is None:
            return self.fn(*args, **kwargs)
        with meter.recomputing():
            return self.fn(*args, **kwargs)


def _entry_handles(meter: ActivationMeter, entry: Any) -> list[_Saved]:
    """Handles that keep a cache entry's tensors counted by `meter` while the entry holds them."""
    from torch.utils._pytree import tree_leaves

    handles = []
    for leaf in tree_leaves(entry):
        tensor = getattr(leaf, "val", None)  # torch's _VersionWrapper around a cached output
        key = meter._track(tensor) if isinstance(tensor, torch.Tensor) else None
        if key is not None:
            handles.append(_Saved(None, key, meter))
    return handles


class _MeteredCache(dict):
    """One op's entries in selective checkpointing's cache as torch 2.13 keeps them (call index -> what the call
    returned, wrapped, or a marker): the meter counts the tensors of an entry while the entry holds them."""

    def __init__(self, meter: ActivationMeter) -> None:
        super().__init__()
        self.meter = meter
        self.handles: dict[int, list[_Saved]] = {}

    def __setitem__(self, index: int, entry: Any) -> None:
        super().__setitem__(index, entry)
        self.handles[index] = _entry_handles(self.meter, entry)  # an entry's previous handles, and count, dropped


class _MeteredQueue(list):
    """The same as torch before 2.12 keeps it (torch 2.11 on the GPU machines): a list per op that the forward
    appends to and the recomputation pops from the front."""

    def __init__(self, meter: ActivationMeter) -> None:
        super().__init__()
        self.meter = meter
        self.handles: list[list[_Saved]] = []

    def append(self, entry: Any) -> None:
        super().append(entry)
        self.handles.append(_entry_handles(self.meter, entry))

    def pop(self, index: SupportsIndex = -1) -> Any:
        self.handles.pop(index)
        return super().pop(index)


# the cache's per-op container, by the one torch's create_selective_checkpoint_contexts makes
_METERED = {dict: _MeteredCache, list: _MeteredQueue}


def _metered_contexts(context_fn: Any) -> Any:
    """`context_fn` whose selective-checkpointing cache the active meter counts: torch's two dispatch modes (the
    forward's, which fills the cache, and the recomputation's, which empties it) share one `storage`, a
    defaultdict of op -> its entries, which becomes one of op -> _MeteredCache (or _MeteredQueue) here. A storage
    of another form, or any other context_fn, is left as it is: the run trains, its meter misses those outputs."""

    def contexts() -> tuple[Any, Any]:
        forward, recompute = context_fn()
        meter = _ACTIVE
        storage = getattr(forward, "storage", None)
        metered = _METERED.get(getattr(storage, "default_factory", None))
        if meter is not None and metered is not None and storage is getattr(recompute, "storage", None):
            forward.storage = recompute.storage = collections.defaultdict(functools.partial(metered, meter))
        return forward, recompute

    return contexts


def metered_checkpoint(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """torch.utils.checkpoint (non-reentrant) whose recomputation the activation meter sees, and with a selective
    policy's `context_fn`, what that keeps; the `checkpoint_fn` that dist_train.model hands to torch's
    checkpoint_wrapper (which passes its own keyword arguments, `context_fn`, on with the block's)."""
    from torch.utils.checkpoint import checkpoint

    # compiled (train.compile), dynamo takes the policy at trace time and only as the function or partial it was
    # given (a closure made here is refused): the kept outputs are then inductor's, which no meter sees anyway
    if kwargs.get("context_fn") is not None and not torch.compiler.is_compiling():
        kwargs["context_fn"] = _metered_contexts(kwargs["context_fn"])
    return checkpoint(_Recomputed(fn), *args, use_reentrant=False, **kwargs)
