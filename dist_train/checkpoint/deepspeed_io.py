"""DeepSpeed's own checkpoint format (strategy=zero<N>, Accelerate with DeepSpeed): what each rank writes and reads
through the engine. torch.distributed.checkpoint's format is dcp_io.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any


class DeepSpeedIO:
    """DeepSpeed's own checkpoint: each rank writes its ZeRO partition (fp32 master weights, Adam moments),
    data-parallel rank 0 the module state (every rank under stage 3), plus the LR schedule and step counters.

    It reloads on the same ZeRO stage and world size; `python launch/export.py` consolidates it into one
    set of weights (DeepSpeed's zero_to_fp32) for any other use.
    """

    format = "deepspeed"
    SUBDIR = "deepspeed"
    TAG = "state"

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    def save(self, directory: Path, *, background: bool, group: Any = None) -> None:
        # Synchronous whatever `background` says: DeepSpeed's engine saves in the caller's thread.
        self.engine.save_checkpoint(str(directory / self.SUBDIR), tag=self.TAG, save_latest=False)
        return None

    def load(self, directory: Path) -> None:
        path, _ = self.engine.load_checkpoint(
            str(directory / self.SUBDIR), tag=self.TAG, load_optimizer_states=True, load_lr_scheduler_states=True
        )
        if path is None:
            raise RuntimeError(f"DeepSpeed found no checkpoint under {directory / self.SUBDIR}")
