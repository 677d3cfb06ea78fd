"""The checkpoint format of every strategy that drives a torch optimizer: torch.distributed.checkpoint (DCP).

Each rank writes what it holds: FSDP2 its DTensor shards, a pipeline stage its own layers, DDP's replicas
once between them (DCP de-duplicates replicated tensors). Keys are parameter names, so the checkpoint
loads into any of these strategies at any world size: DCP reshards on load.
"""

from __future__ import annotations

import warnings
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Protocol

import torch.distributed as dist

SUBDIR = "dcp"


class HasStateDict(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


def _no_dist() -> bool:
    return not (dist.is_available() and dist.is_initialized())


# DCP warns that it "assumes" one process even when told so with no_dist=True: noise in every single-process run.
warnings.filterwarnings("ignore", message=r"torch\.distributed is disabled, unavailable or uninitialized, assuming")


class DcpIO:
    format = "dcp"

    def __init__(self, stateful: HasStateDict) -> None:
        self.stateful = stateful

    def save(self, directory: Path, *, background: bool, group: Any = None) -> Future | None:
        import torch.distributed.checkpoint as dcp  # here, not at import: it costs every run ~0.8 s of start-up

        path = directory / SUBDIR
        path.mkdir(parents=True, exist_ok=True)
        state = self.stateful.state_dict()
        if background:
            # Copies the state to host memory now (the step waits for that), writes it in a thread. Its
            # collectives run on `group`, a gloo group of their own, never interleaved with the training's.
            return dcp.async_save(state, checkpoint_id=str(path), process_group=group, no_dist=_no_dist())
        dcp.save(state, checkpoint_id=str(path), no_dist=_no_dist())
        return None

    def load(self, directory: Path) -> None:
        # DCP loads tensors in place into the state dict it is given (resharding as needed) and replaces the
        # plain values (LR schedule position, param groups); the strategy then applies the whole dict.
        import torch.distributed.checkpoint as dcp

        state = self.stateful.state_dict()
        dcp.load(state, checkpoint_id=str(directory / SUBDIR), no_dist=_no_dist())
        self.stateful.load_state_dict(state)
