"""Where this process runs: rank, world, device and backend, decided once at start-up.

On CUDA every process gets one GPU (its local rank) and NCCL; without GPUs every process runs on the
CPU with gloo. A run launched without torchrun (`python launch/train.py`) still gets a one-process
group when its strategy needs one (DDP, FSDP), so the same code path runs everywhere.
"""

from __future__ import annotations

import os
import socket
import tempfile
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from dist_train.contracts import Runtime


def _env_int(name: str, default: int) -> int:
    return int(os.environ.get(name, default))


def init_runtime(*, needs_group: bool, timeout_s: float = 600.0, device_type: str = "auto") -> Runtime:
    """Pick the device (`pick_device`) and, if `needs_group`, start the default process group on it.

    `timeout_s` (runtime.timeout_s) bounds how long a collective waits for its peers: a rank that hangs, or
    whose node vanishes without its process exiting, ends the job after that long instead of never.
    """
    global _STARTED_GROUP
    rank = _env_int("RANK", 0)
    local_rank = _env_int("LOCAL_RANK", 0)
    world_size = _env_int("WORLD_SIZE", 1)
    local_world_size = _env_int("LOCAL_WORLD_SIZE", world_size)

    device = this_process_device(device_type)
    backend = "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
        backend = "nccl"

    node = node_name()
    if not needs_group:
        return Runtime(rank, local_rank, world_size, local_world_size, device, None, timeout_s, node, (node,))

    if not dist.is_initialized():
        kwargs: dict = {"backend": backend, "timeout": timedelta(seconds=timeout_s)}
        if device.type == "cuda":
            kwargs["device_id"] = device  # eager NCCL init, bound to this rank's GPU
        if "MASTER_ADDR" not in os.environ or "RANK" not in os.environ:
            # Launched without torchrun (or by `accelerate launch --cpu`, which sets MASTER_ADDR and no ranks):
            # a one-process group through a private file store.
            fd, path = tempfile.mkstemp(prefix="dist_train_pg_")
            os.close(fd)
            os.unlink(path)
            kwargs.update(init_method=f"file://{path}", rank=0, world_size=1)
        elif restart_needs_own_namespace():
            store, _, _ = next(dist.rendezvous("env://", rank, world_size, timeout=timedelta(seconds=timeout_s)))
            attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
            kwargs.update(store=dist.PrefixStore(f"dist_train/attempt{attempt}/", store), rank=rank, world_size=world_size)
        dist.init_process_group(**kwargs)
        _STARTED_GROUP = True
    nodes: list[str] = [""] * dist.get_world_size()
    dist.all_gather_object(nodes, node)
    return Runtime(rank, local_rank, world_size, local_world_size, device, backend, timeout_s, node, tuple(nodes))


def this_process_device(want: str) -> torch.device:
    """`pick_device` for this process's LOCAL_RANK and LOCAL_WORLD_SIZE (torchrun's; WORLD_SIZE without one)."""
    world_size = _env_int("WORLD_SIZE", 1)
    return pick_device(want=want, local_rank=_env_int("LOCAL_RANK", 0),
                       local_world_size=_env_int("LOCAL_WORLD_SIZE", world_size))


def pick_device(*, want: str, local_rank: int, local_world_size: int, env: Any = os.environ) -> torch.device:
    """One GPU per local rank (cuda:LOCAL_RANK, as DeepSpeed and Accelerate assume), else the CPU.

    want: runtime.device (auto: CUDA when a GPU is visible). Two cases need care:
    - a launcher that binds each task to its own GPU (`srun --gpus-per-task=1`) leaves one visible GPU per
      process, whatever its local rank: that GPU, cuda:0;
    - more local processes than visible GPUs otherwise: NCCL refuses two ranks on one GPU ("Duplicate GPU
      detected"), so this is a ConfigError naming both numbers, before any group starts.
    """
    from dist_train.config import ConfigError

    if want == "cpu" or (want == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ConfigError("runtime.device=cuda but no CUDA GPU is visible to this process; allowed here: auto, cpu")
    count = torch.cuda.device_count()
    if count == 1 and gpu_per_task(env):
        return torch.device("cuda", 0)
    if local_world_size > count or local_rank >= count:
        raise ConfigError(
            f"{local_world_size} processes on this node (LOCAL_WORLD_SIZE) but {count} visible GPU(s) "
            f"(CUDA_VISIBLE_DEVICES={env.get('CUDA_VISIBLE_DEVICES', 'unset')}): one GPU per process, since NCCL "
            f"refuses two ranks on one GPU; launch at most {count} per node (--nproc_per_node={count}), or train "
            "on the CPU with runtime.device=cpu"
        )
    return torch.device("cuda", local_rank)


def gpu_per_task(env: Any = os.environ) -> bool:
    """Whether Slurm gave each task a GPU of its own (`--gpus-per-task=1`, or `--gpu-bind` to one device)."""
    return env.get("SLURM_GPUS_PER_TASK", "").strip() == "1" or env.get("SLURM_GPU_BIND", "").startswith("single:1")


def node_name() -> str:
    """Slurm's name for this node (virtual nodes on one host differ), else the host name."""
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()


def restart_needs_own_namespace() -> bool:
    """Whether this torchrun launch needs its process group keyed by restart attempt.

    torchrun's agent hosts the store the workers rendezvous on, and keeps it across restarts; the process
    group's keys (gloo's peer addresses, NCCL's unique id) carry no attempt in their names. A restarted rank
    can then read the dead attempt's address before its peer has written the new one, and fail to connect
    (pytorch#135712; seen here). Within one node every worker has the same TORCHELASTIC_RESTART_COUNT, so
    it can name the attempt. Across nodes the count is per agent and may differ (pytorch#108158): there,
    launch torchrun with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (launch/slurm.sbatch does), which gives each
    attempt a fresh store.
    """
    return (
        os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        and os.environ.get("GROUP_WORLD_SIZE", "1") == "1"
        and "TORCHELASTIC_RESTART_COUNT" in os.environ
    )


def imports_done() -> None:
    """Python's collector on again once a launch script's imports are done (launch/train.py turns it off before
    them), with the objects they made frozen out of later collections (gc.freeze: about 590k of torch, transformers
    and Hydra, which every full collection would otherwise scan again). The collections the imports triggered cost
    about 8% of a one-process run of model=tiny (farm-bench, 8 pairs: 0.92x the CPU time, median).

    Once: with the collector already on (Hydra's multirun calls the task again for every job in one process), it
    does nothing, so a later job does not freeze what the jobs before it left alive."""
    import gc

    if gc.isenabled():
        return
    gc.freeze()
    gc.enable()


def shutdown(runtime: Runtime) -> None:
    if runtime.has_group and dist.is_initialized():
        dist.destroy_process_group()


def leave(code: int) -> None:
    """End a process that ran a process group without Python's interpreter finalization.

    Gloo's worker threads and the objects they hold can outlive destroy_process_group (pytorch#179291);
    when the interpreter then tears down, a rank that finished its work and wrote everything aborted with
    "terminate called without an active exception" (SIGABRT) in about 1 launch of 100 here, turning a
    finished run into a failed job. Everything this project writes is closed by then (metrics, summary,
    checkpoints, W&B's run); the streams and log handlers are flushed here, then the process exits with
    `code` at once. A process that never started a group exits normally.
    """
    if _STARTED_GROUP:
        exit_now(code)


def exit_now(code: int) -> None:
    """`leave` for a process that started its process group itself (a benchmark, a test script), after it destroyed
    it: everything flushed (W&B's service stopped), then exit with `code` at once."""
    import logging
    import sys

    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    if "wandb" in sys.modules:
        sys.modules["wandb"].teardown()  # stop W&B's service process, which atexit would have done
    os._exit(code)


_STARTED_GROUP = False


def agree(value: Any) -> Any:
    """Rank 0's `value` on every rank (a no-op without a process group): one decision, taken once."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]
