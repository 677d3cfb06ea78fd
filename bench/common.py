"""What every benchmark shares: the machine it ran on, running a launch, a table, and its section of
docs/BENCHMARKS.md (each benchmark owns one section, replaced whole when it runs again); and, inside a launched
process, its device, its process group and a clock that reads finished work."""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:
    import torch

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs" / "BENCHMARKS.md"
PYTHON = sys.executable
TORCHRUN = [PYTHON, "-m", "torch.distributed.run", "--standalone"]


def env() -> dict[str, str]:
    e = dict(os.environ)
    e.update(OMP_NUM_THREADS=e.get("OMP_NUM_THREADS", "1"), WANDB_MODE="offline", PYTHONUNBUFFERED="1")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        e.pop(key, None)
    return e


def machine() -> str:
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                   if ln.startswith("model name"))
    except (OSError, StopIteration):
        pass
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return f"{os.cpu_count()} CPU cores ({cpu}), {gpu}, torch {torch.__version__}, Python {platform.python_version()}"


def local_device() -> torch.device:
    """This process's device, chosen as dist_train's runtime chooses it: its local rank's GPU (made current) and
    else the CPU. NCCL takes one GPU per process: fewer GPUs than processes on the node is an error."""
    import torch

    if not torch.cuda.is_available():
        return torch.device("cpu")
    num_local, num_gpus = int(os.environ.get("LOCAL_WORLD_SIZE", "1")), torch.cuda.device_count()
    if num_local > num_gpus:
        raise RuntimeError(f"{num_local} processes on this node but {num_gpus} GPU(s): NCCL needs one GPU per "
                           "process (CUDA_VISIBLE_DEVICES= runs them on the CPU with gloo)")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    torch.cuda.set_device(device)
    return device


def init_group(device: torch.device) -> None:
    """The default process group on `device`'s backend: NCCL bound to the GPU, gloo on the CPU."""
    import torch.distributed as dist

    dist.init_process_group(dist.get_default_backend_for_device(device),
                            device_id=None if device.type == "cpu" else device)


def end_process() -> None:
    """End a launched benchmark once it has printed its results (dist_train.runtime.exit_now): gloo's threads can
    outlive destroy_process_group, and interpreter teardown then aborts now and then ("terminate called without an
    active exception", pytorch#179291), which turned a finished run into a failed one."""
    import torch.distributed as dist

    from dist_train.runtime import exit_now

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    exit_now(0)


def synchronize(device: torch.device) -> None:
    """Wait for the work queued on `device`'s current stream, so that a clock read next counts it finished (a CPU
    queues none). The current stream, not the whole device: a blocking collective and an optimizer step end on it,
    and work that other threads queue on streams of their own (collectives.py's computing thread) is not waited for."""
    import torch

    if device.type != "cpu":
        torch.accelerator.current_stream(device).synchronize()


def run(cmd: list[str], *, timeout: float = 900) -> tuple[subprocess.CompletedProcess[str], float]:
    """(the finished process, its wall-clock seconds); raises with its output when it fails."""
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=timeout)
    seconds = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"{shlex.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return proc, seconds


def last_json(text: str) -> dict[str, Any]:
    return json.loads([ln for ln in text.splitlines() if ln.startswith("{")][-1])


def spread(values: list[float]) -> str:
    """median [min, max]"""
    return f"{statistics.median(values):.3f} [{min(values):.3f}, {max(values):.3f}]"


def paired_parser(doc: str) -> argparse.ArgumentParser:
    """The options of the benchmarks that compare two variants: end-to-end pairs, then interleaved steps."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5, help="alternating end-to-end pairs")
    parser.add_argument("--steps", type=int, default=30, help="steps of each end-to-end run")
    parser.add_argument("--iterations", type=int, default=60, help="paired steps in the same processes")
    parser.add_argument("--strategies", default="ddp,fsdp")
    return parser


def iqr(result: dict[str, Any]) -> str:
    """bench/interleaved.py's median ratio with its interquartile range."""
    return f"{result['median_ratio']:.3f} [{result['q1']:.3f}, {result['q3']:.3f}]"


def md_table(headers: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def write_section(name: str, title: str, body: str, *, command: str, note: Optional[str] = None) -> None:
    """Replace (or append) the section `name` of docs/BENCHMARKS.md: date, machine, command, then `body`."""
    DOCS.parent.mkdir(parents=True, exist_ok=True)
    text = DOCS.read_text() if DOCS.is_file() else "# Benchmarks\n\nEach section is written by the script it names.\n"
    stamp = time.strftime("%Y-%m-%d")
    block = (f"<!-- bench:{name} -->\n## {title}\n\n{stamp}, {machine()}.\n\n```\n{command}\n```\n\n{body.strip()}\n"
             + (f"\n{note.strip()}\n" if note else "") + f"<!-- /bench:{name} -->")
    pattern = re.compile(rf"<!-- bench:{re.escape(name)} -->.*?<!-- /bench:{re.escape(name)} -->", re.S)
    text = pattern.sub(lambda _: block, text) if pattern.search(text) else text.rstrip() + "\n\n" + block + "\n"
    DOCS.write_text(text)
    print(f"wrote section '{name}' of {DOCS}")


def dryrun_cells(measured: dict[str, Any], diff: dict[str, Any], keys: list[str]) -> list[str]:
    """A dry-run table's cells: each figure in GiB, with its difference from the estimator's where it predicts it."""
    cells = []
    for key in keys:
        if key not in measured:
            cells.append("-")
            continue
        d = diff.get(key)
        cells.append(f"{measured[key] / 2**30:,.3f}" + ("" if d is None else f" ({d:+.2%})"))
    return cells
