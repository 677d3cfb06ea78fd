"""Issue DTensor's functional collectives through c10d, so that the tracker holds their `Work` and can time them.

torch's functional collectives (`torch.distributed._functional_collectives`: what DTensor's redistribute, tensor
parallelism's all-reduces and loss_parallel call) issue the collective from a C++ op that keeps its `Work` in a
registry only `wait_tensor` reads: Python never sees it, so neither its future (gloo) nor an event after it (CUDA)
can end a timing. For an eager call that records no autograd, the functions here do what that C++ op does -- the
same output tensor, the same ProcessGroup collective, asynchronous, its work registered on the output for
`wait_tensor` -- from Python, and hand the work back to be timed like any other asynchronous collective. Nothing
waits here: the caller waits where it always did (the `AsyncCollectiveTensor`'s first use).

A call being traced (compile, the dry run's fake tensors), one whose input records autograd (the C++ ops carry
backward formulas) or one in a shape not handled here returns None: it goes to torch's op unchanged, counted
and untimed (the record then says so: `comm/<op>/untimed_count`, no `time_s`).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.distributed.distributed_c10d as c10d

# torch 2.13 names them *_single (the *_tensor names warn that they are deprecated); an older torch has only those
_ALL_GATHER = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"
_REDUCE_SCATTER = "reduce_scatter_single" if hasattr(dist, "reduce_scatter_single") else "reduce_scatter_tensor"

_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.AVG, "product": dist.ReduceOp.PRODUCT,
               "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}

Issued = tuple[torch.Tensor, Any, list[torch.Tensor]]  # (what the call returns, the work, the buffers it uses)


def _process_group(group: Any, tag: str) -> Any:
    resolved = funcol._resolve_group(group, tag)
    return c10d._resolve_process_group(resolved) if isinstance(resolved, str) else resolved


def _eager(tensor: Any) -> bool:
    """Whether a call on `tensor` can be issued here: a plain dense real tensor, no tracing, no autograd recorded,
    not in the forward of a block under selective activation checkpointing. That forward runs under a dispatch mode
    that keeps the outputs of the ops it knows by name: torch's functional all-reduce is one it keeps
    (dist_train.model._SAVED_OPS), a copy reduced in place here would be recomputed, and backward would send it
    again."""
    return (type(tensor) is torch.Tensor and not tensor.is_complex() and not tensor.is_sparse
            and not (torch.is_grad_enabled() and tensor.requires_grad) and not funcol._are_we_tracing()
            and _selective_mode("_CachingTorchDispatchMode") is None)


def _selective_mode(kind: str) -> Any:
    """Selective activation checkpointing's dispatch mode of this kind (torch.utils.checkpoint's: the forward's
    `_CachingTorchDispatchMode`, the recomputation's `_CachedTorchDispatchMode`) where one is active, else None;
    another mode (torch's MemTracker on a measured step) may sit above it."""
    from torch.utils import checkpoint
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    cls = getattr(checkpoint, kind, None)
    return next((m for m in _get_current_dispatch_mode_stack() if cls is not None and isinstance(m, cls)), None)


def _registered(output: torch.Tensor, work: Any) -> torch.Tensor:
    """`output` as the functional collective hands it back: an AsyncCollectiveTensor whose first use waits."""
    if work is not None:
        torch._C._distributed_c10d._register_work(output, work)
    return funcol._maybe_wrap_tensor(output)


def all_reduce(issue: Callable[..., Any], a: dict[str, Any]) -> Issued | None:
    """funcol.all_reduce(self, reduceOp, group, tag): a contiguous copy, reduced in place."""
    op = _REDUCE_OPS.get(str(a["reduceOp"]).lower())
    if op is None or not _eager(a["self"]):
        return None
    out = a["self"].clone(memory_format=torch.contiguous_format)
    work = issue(dist.all_reduce, out, op=op, group=_process_group(a["group"], a.get("tag", "")), async_op=True)
    return _registered(out, work), work, [out]


def all_gather_single(issue: Callable[..., Any], a: dict[str, Any]) -> Issued | None:
    """funcol.all_gather_single(self, gather_dim, group, tag): gathered along dim 0, then (as torch does) moved to
    `gather_dim`, waiting first only where torch's view of the chunks cannot be used."""
    x, gather_dim = a["self"], a["gather_dim"]
    if not _eager(x) or not x.is_contiguous() or x.dim() == 0:
        return None
    group = _process_group(a["group"], a.get("tag", ""))
    n = group.size()
    out = x.new_empty((x.shape[0] * n, *x.shape[1:]))
    work = issue(getattr(dist, _ALL_GATHER), out, x, group=group, async_op=True)
    res = _registered(out, work)
    if gather_dim != 0:
        if isinstance(res, funcol.AsyncCollectiveTensor):  # torch's own rule (_functional_collectives.py)
            shape = list(res.shape)
            between = 1
            for size in shape[1:gather_dim]:
                between *= size
            if not (shape[0] == n and between == 1):
                res = res.wait()
        res = funcol._maybe_view_chunk_cat(res, n, gather_dim)
    return res, work, [x, out]


def reduce_scatter_single(issue: Callable[..., Any], a: dict[str, Any]) -> Issued | None:
    """funcol.reduce_scatter_single(self, reduceOp, scatter_dim, group, tag): `scatter_dim` moved to dim 0 first
    (as torch does), then each rank keeps its reduced share of dim 0."""
    x, scatter_dim = a["self"], a["scatter_dim"]
    op = _REDUCE_OPS.get(str(a["reduceOp"]).lower())
    if op is None or not _eager(x) or x.dim() == 0:
        return None
    group = _process_group(a["group"], a.get("tag", ""))
    n = group.size()
    if x.size(scatter_dim) % n:
        return None  # torch's op raises its own error for this
    if scatter_dim != 0:
        x = funcol._chunk_or_narrow_cat(x, n, narrow_dim=scatter_dim, cat_dim=0)
    x = x.contiguous()
    out = x.new_empty((x.shape[0] // n, *x.shape[1:]))
    work = issue(getattr(dist, _REDUCE_SCATTER), out, x, op=op, group=group, async_op=True)
    return _registered(out, work), work, [x, out]


# funcol's name -> the op of torch's own that it calls (what a dispatch mode sees)
_OPS = {"all_reduce": "all_reduce", "all_gather_tensor": "all_gather_into_tensor",
        "all_gather_single": "all_gather_into_tensor", "reduce_scatter_tensor": "reduce_scatter_tensor",
        "reduce_scatter_single": "reduce_scatter_tensor", "broadcast": "broadcast"}


def served_from_cache(name: str) -> bool:
    """Whether this call of funcol's `name` sends nothing: selective activation checkpointing is recomputing a
    block (torch's _CachedTorchDispatchMode is the dispatch mode) and hands back the output it kept in forward
    for this call (its next entry for the op, by call order, is a kept output, not a marker to recompute)."""
    from torch.utils import checkpoint

    mode = _selective_mode("_CachedTorchDispatchMode")
    if mode is None or name not in _OPS:
        return False
    op = getattr(torch.ops._c10d_functional, _OPS[name]).default
    entry = mode.storage.get(op, {}).get(mode.func_counter[op])
    return entry is not None and entry is not getattr(checkpoint, "_RECOMPUTE", None)


# funcol's name -> how to issue it here; the torch helpers each one relies on must exist in this torch
ISSUERS: dict[str, Callable[[Callable[..., Any], dict[str, Any]], Issued | None]] = {
    name: fn for name, fn, needs in (
        ("all_reduce", all_reduce, ("_maybe_wrap_tensor", "_are_we_tracing", "_resolve_group")),
        ("all_gather_single", all_gather_single, ("_maybe_wrap_tensor", "_are_we_tracing", "_resolve_group",
                                                  "_maybe_view_chunk_cat", "AsyncCollectiveTensor")),
        ("reduce_scatter_single", reduce_scatter_single, ("_maybe_wrap_tensor", "_are_we_tracing", "_resolve_group",
                                                          "_chunk_or_narrow_cat")),
    ) if all(hasattr(funcol, n) for n in needs) and hasattr(torch._C._distributed_c10d, "_register_work")
}
