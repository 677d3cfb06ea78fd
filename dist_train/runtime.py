"""Where this process runs: rank, world, device and backend, decided once at start-up.

On CUDA every process gets one GPU (its local rank) and NCCL; without GPUs every process runs on the
CPU with gloo. A run launched without torchrun (`python launch/train.py`) still gets a one-process
group when its strategy needs one (DDP, FSDP), so the same code path runs everywhere.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Runtime:
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    device: torch.device
    backend: str | None  # None: no process group (strategy=single / dp)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def has_group(self) -> bool:
        return self.backend is not None

    @property
    def device_type(self) -> str:
        return self.device.type


def _env_int(name: str, default: int) -> int:
    return int(os.environ.get(name, default))


def init_runtime(*, needs_group: bool, timeout_s: float = 600.0) -> Runtime:
    """Pick the device and, if `needs_group`, start the default process group on it."""
    rank = _env_int("RANK", 0)
    local_rank = _env_int("LOCAL_RANK", 0)
    world_size = _env_int("WORLD_SIZE", 1)
    local_world_size = _env_int("LOCAL_WORLD_SIZE", world_size)

    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"

    if not needs_group:
        return Runtime(rank, local_rank, world_size, local_world_size, device, None)

    if not dist.is_initialized():
        kwargs: dict = {"backend": backend, "timeout": timedelta(seconds=timeout_s)}
        if device.type == "cuda":
            kwargs["device_id"] = device  # eager NCCL init, bound to this rank's GPU
        if "MASTER_ADDR" not in os.environ:
            # Launched without torchrun: a one-process group through a private file store.
            fd, path = tempfile.mkstemp(prefix="dist_train_pg_")
            os.close(fd)
            os.unlink(path)
            kwargs.update(init_method=f"file://{path}", rank=0, world_size=1)
        dist.init_process_group(**kwargs)
    return Runtime(rank, local_rank, world_size, local_world_size, device, backend)


def shutdown(runtime: Runtime) -> None:
    if runtime.has_group and dist.is_initialized():
        dist.destroy_process_group()
