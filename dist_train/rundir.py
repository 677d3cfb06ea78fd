"""One run directory for every rank of a launch.

Each rank runs `@hydra.main` itself, so a timestamped directory can differ between ranks. The default
directory is named from something all ranks of a launch share: torchrun's rendezvous id
(TORCHELASTIC_RUN_ID, a fresh uuid under --standalone), else the Slurm job id, else a timestamp (one
process). After the process group starts, rank 0's choice is broadcast, so even a launch with no shared
id (static rendezvous) writes into one directory. `hydra.run.dir=PATH` overrides all of this.
"""

from __future__ import annotations

import os
import time

from omegaconf import OmegaConf

_NO_ID = ("", "none")


def run_tag(prefix: str = "run") -> str:
    """`<prefix>-<YYYYmmdd-HHMMSS>-<launch id>`; the timestamp is only in the single-process case."""
    launch_id = os.environ.get("TORCHELASTIC_RUN_ID", "")
    if launch_id in _NO_ID:
        launch_id = os.environ.get("SLURM_JOB_ID", "")
    if launch_id not in _NO_ID:
        return f"{prefix}-{launch_id[:12]}"
    return f"{prefix}-{time.strftime('%Y%m%d-%H%M%S')}"


def register_resolvers() -> None:
    if not OmegaConf.has_resolver("dist_train.run_tag"):
        OmegaConf.register_new_resolver("dist_train.run_tag", run_tag)


def agree_on_run_dir(local_choice: str) -> str:
    """Every rank adopts rank 0's directory (a no-op without a process group)."""
    from dist_train.runtime import agree

    return agree(local_choice)
