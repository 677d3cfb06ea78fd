"""Rehearse a failure: `DIST_TRAIN_FAULT=<kind>@<step>[:rank<r>]` makes rank r fail on purpose at a step.

    raise   the rank raises an exception before the step (a bug, an out-of-memory error)
    kill    the rank sends itself SIGKILL (the kernel's OOM killer, a lost node)
    hang    the rank stops and sleeps: its peers wait in a collective until runtime.timeout_s
    nan     the rank's parameters become NaN, so the step's loss is NaN (default: every rank)
    overflow  precision=fp16: the rank's first gradient (its shard) holds an inf when the loss scaler looks, as
            after a local fp16 overflow; every rank must then skip that step

Only the first attempt of a launch fails (TORCHELASTIC_RESTART_COUNT=0), so a job restarted by
`torchrun --max-restarts` recovers: this is how a user checks that restarts resume, and how the tests do,
without killing processes at a moment that depends on timing.
"""

from __future__ import annotations

import os
import re
import signal
import time
from dataclasses import dataclass
from typing import Any, Optional

ENV = "DIST_TRAIN_FAULT"
KINDS = ("raise", "kill", "hang", "nan", "overflow")
_SPEC = re.compile(r"^(?P<kind>[a-z]+)@(?P<step>\d+)(?::rank(?P<rank>\d+))?$")


class InjectedFault(RuntimeError):
    """The exception `raise` injects."""


@dataclass(frozen=True)
class Fault:
    kind: str
    step: int
    rank: Optional[int]  # None: every rank

    @classmethod
    def from_env(cls) -> Optional["Fault"]:
        """The fault asked for, or None. ValueError (one line) for a malformed value."""
        text = os.environ.get(ENV, "").strip()
        if not text:
            return None
        match = _SPEC.match(text)
        if match is None or match.group("kind") not in KINDS or int(match.group("step")) < 1:
            raise ValueError(
                f"{ENV}={text!r} is not <kind>@<step>[:rank<r>] with kind one of {', '.join(KINDS)} and step >= 1"
            )
        rank = match.group("rank")
        return cls(match.group("kind"), int(match.group("step")), int(rank) if rank is not None else None)

    def applies(self, *, step: int, rank: int) -> bool:
        first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        return first_attempt and step == self.step and (self.rank is None or self.rank == rank)

    def inject(self, *, step: int, rank: int, strategy: Any) -> None:
        """Fail now, if this fault is for this step and rank (before the step's forward)."""
        if not self.applies(step=step, rank=rank):
            return
        where = f"{ENV}={self.kind}@{self.step}: rank {rank}, step {step}"
        if self.kind == "raise":
            raise InjectedFault(f"injected failure ({where})")
        if self.kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if self.kind == "hang":
            while True:  # peers give up after runtime.timeout_s; the launcher then stops this process
                time.sleep(1)
        if self.kind == "nan":
            _poison(strategy)
        if self.kind == "overflow":
            global _OVERFLOW_PENDING
            _OVERFLOW_PENDING = True


_OVERFLOW_PENDING = False


def overflow_if_injected(params: list[Any]) -> None:
    """Put the injected overflow into this rank's first gradient, once (called just before fp16 unscales)."""
    global _OVERFLOW_PENDING
    if not _OVERFLOW_PENDING:
        return
    _OVERFLOW_PENDING = False
    import torch

    from dist_train.contracts import local_tensor

    with torch.no_grad():
        for p in params:
            if p.grad is not None and local_tensor(p.grad).numel():
                local_tensor(p.grad).view(-1)[0] = float("inf")
                return


def _poison(strategy: Any) -> None:
    import torch

    from dist_train.contracts import local_tensor

    with torch.no_grad():
        for t in strategy.model_state().params:
            local = local_tensor(t)
            if local.is_floating_point():
                local.fill_(float("nan"))
