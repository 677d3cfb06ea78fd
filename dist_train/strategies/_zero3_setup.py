"""Two things DeepSpeed's ZeRO-3 engine does at set-up that cost memory and time for nothing, turned off while
`deepspeed.initialize` builds it (read from deepspeed 0.19's runtime/zero/stage3.py; each fix checks that the code
it relies on is still there and otherwise leaves DeepSpeed alone).

1. **The fp32 master partition is a second copy of an fp32 partition.** `_create_fp32_partitions` means to use the
   parameters' own partition as the master copy when it already has the master dtype on the optimizer's device
   (DeepSpeed PR 7651), but it compares `partition.device` (a torch.device) with `self.device` (a str such as
   'cpu' or 'cuda:0'), which never compare equal. An fp32 run then holds its partition twice: 4 bytes per
   parameter over N on every rank, for the whole run. While that method runs, `self.device` is the torch.device of
   the same name, so the comparison means what it says; in bf16 or fp16 the partition has another dtype and the
   master copy is made as before.
2. **Hooking every parameter gathers it whole.** `create_reduce_and_remove_grad_hooks` all-gathers each trainable
   parameter, registers its gradient hook, then partitions it again. With torch >= 2.1 DeepSpeed's
   `register_grad_hook` is `Tensor.register_post_accumulate_grad_hook`, which needs no data: the gather costs one
   all-gather of the whole model at start-up and the largest parameter in full on every rank (measured: 0.30 of
   the weights on 4 ranks of a 162M model). While that method runs, a partitioned parameter's `all_gather` and
   `partition` do nothing, so it stays partitioned, as it was and as it would be after.

Both are measured in bench/zero3_setup.py and checked by tests/launched/test_zero.py through tests/scripts/zero3_setup_fixes.py
(the master partition shares the parameters' storage in fp32; no all-gather while the engine is built; the same
losses and parameters).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Iterator
from typing import Any

import torch


def _nothing(*_: Any, **__: Any) -> None:
    return None


def _share_fp32_master(inner: Any) -> Any:
    """`_create_fp32_partitions` with `self.device` a torch.device for the duration (fix 1)."""

    @functools.wraps(inner)
    def create(self: Any, *args: Any, **kwargs: Any) -> Any:
        name = self.device
        if not isinstance(name, str):
            return inner(self, *args, **kwargs)
        self.device = torch.device(name)
        try:
            return inner(self, *args, **kwargs)
        finally:
            self.device = name

    return create


def _hook_without_gathering(inner: Any) -> Any:
    """`create_reduce_and_remove_grad_hooks` without gathering the partitioned parameters (fix 2)."""
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    @functools.wraps(inner)
    def create(self: Any, *args: Any, **kwargs: Any) -> Any:
        partitioned = [p for group in self.fp16_groups for p in group
                       if p.requires_grad and getattr(p, "ds_status", None) is ZeroParamStatus.NOT_AVAILABLE]
        saved = [(p, p.all_gather, p.partition) for p in partitioned]
        for p in partitioned:
            p.all_gather = p.partition = _nothing
        try:
            return inner(self, *args, **kwargs)
        finally:
            for p, gather, partition in saved:
                p.all_gather, p.partition = gather, partition

    return create


def _source(obj: Any) -> str:
    """`obj`'s source, or "" where it cannot be read (then the fix that needs it is not applied)."""
    try:
        return inspect.getsource(obj) if obj is not None else ""
    except (OSError, TypeError):
        return ""


def _hooks_need_no_data(stage3: Any) -> bool:
    """Whether stage 3 registers its gradient hooks with torch's post-accumulate-grad hook (no parameter data)."""
    if not hasattr(torch.Tensor, "register_post_accumulate_grad_hook"):
        return False
    return "register_post_accumulate_grad_hook" in _source(getattr(stage3, "register_grad_hook", None))


def _master_copy_compares_devices(cls: Any) -> bool:
    """Whether `_create_fp32_partitions` has the aliasing branch this fix makes reachable."""
    return ".device == self.device" in _source(getattr(cls, "_create_fp32_partitions", None))


@contextlib.contextmanager
def zero3_setup_fixes() -> Iterator[list[str]]:
    """While DeepSpeed builds a ZeRO-3 engine: its fp32 master partition is the parameters' own partition where
    both are fp32 on one device, and making its gradient hooks gathers nothing. Yields the fixes applied."""
    from deepspeed.runtime.zero import stage3

    cls = stage3.DeepSpeedZeroOptimizer_Stage3
    patches = []
    if _master_copy_compares_devices(cls):
        patches.append(("_create_fp32_partitions", _share_fp32_master))
    if _hooks_need_no_data(stage3) and hasattr(cls, "create_reduce_and_remove_grad_hooks"):
        patches.append(("create_reduce_and_remove_grad_hooks", _hook_without_gathering))
    originals = {name: cls.__dict__[name] for name, _ in patches}
    try:
        for name, fix in patches:
            setattr(cls, name, fix(originals[name]))
        yield [name for name, _ in patches]
    finally:
        for name, original in originals.items():
            setattr(cls, name, original)
