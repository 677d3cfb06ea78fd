"""A test-only launcher that pays the imports once: launches forked from a process that already imported torch.

A launch of `launch/train.py` under torchrun spends most of its CPU importing: about 5-6 s per rank (torch,
transformers, Hydra, W&B, peft) before the first step of a model that trains in a fraction of a second. On the
suite's 2 cores that was most of the suite's time. This server imports those modules once (never running any
of them) and forks each launch from there:

- an *agent* per launch, in a process group of its own (what the test kills on a timeout), with the launch's
  environment, working directory and output files;
- with nproc >= 1, one *worker* per rank with the variables torchrun's `--standalone` agent sets (RANK,
  LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT, TORCHELASTIC_RUN_ID, TORCHELASTIC_RESTART_COUNT, ...), rendezvousing
  on a TCPStore the agent hosts, as torchrun's does (TORCHELASTIC_USE_AGENT_STORE=True); the agent waits for its
  workers and, when one fails, stops the others (SIGTERM, then SIGKILL) and exits 1, as torchrun does;
- with nproc 0, the agent runs the script itself (`python launch/train.py`).

A worker runs the script with runpy as `__main__`, the same code path as a fresh interpreter after its imports.
What forking changes, and which tests therefore keep the real launcher (tests/helpers.py `launch`, the default):
torchrun's own messages and exit codes on failure, signals, and per-process figures of the start-up (RSS before
the first import). `train_ok` (a run expected to succeed, read through its files) uses this server unless
DIST_TRAIN_TEST_FORK=0.

Protocol (one pytest session, one server, one launch at a time): a JSON line per request on stdin
({argv, env, cwd, nproc, stdout, stderr}; argv as python's after the interpreter: a script and its arguments, or -m
and a module); the server answers `{"pid": agent}` at once and `{"rc": code}` when the agent ends.
"""

from __future__ import annotations

import gc
import importlib
import json
import os
import runpy
import signal
import socket
import sys
import time
import uuid
from typing import Any

# What every launch of launch/train.py imports (measured: -X importtime), with what it imports later, while it runs
# (wandb.init's launch inputs: 0.7 s a forked run), and nothing that starts a thread at import (deepspeed does, and
# prints its accelerator warning: the ZeRO runs import it themselves; pandas, which W&B's summary imports, starts
# pyarrow's jemalloc thread).
PRELOAD = (
    "torch", "torch.distributed", "torch.distributed.fsdp", "torch.distributed.tensor",
    "torch.distributed.checkpoint", "torch.distributed.elastic.multiprocessing.errors",
    "transformers", "transformers.models.llama.modeling_llama", "transformers.models.gpt2.modeling_gpt2",
    "hydra", "omegaconf", "wandb", "wandb.sdk.launch.inputs.internal", "peft",
    "dist_train.train", "dist_train.session", "dist_train.strategies.registry",
    "dist_train.estimate", "dist_train.telemetry.recorder", "torch.distributed._tools.mem_tracker",
    "dist_train.pretrained", "dist_train.model",
)
STOP_GRACE_S = 30.0  # torchrun's agent gives its workers 30 s between SIGTERM and SIGKILL


def threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _worker(argv: list[str]) -> None:
    """Become `python argv...` after its imports (`argv`: a script and its arguments, or `-m module ...`): threads,
    sys.argv and sys.path[0] as the interpreter sets them, then the code as __main__.

    Its exit (SystemExit, or an uncaught exception's traceback and 1) unwinds to the interpreter's top level, so
    that the process ends as a fresh one would, finalization and atexit included (launch/train.py ends ranks that
    ran a process group itself, with os._exit)."""
    import torch

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1") or 1))
    if argv[0] == "-m":
        sys.argv = [argv[1], *argv[2:]]
        sys.path[0] = os.getcwd()
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(argv)
        sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
        runpy.run_path(argv[0], run_name="__main__")
    sys.exit(0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _agent(req: dict[str, Any]) -> None:
    """The forked launch: its own process group, environment, directory and output; then the script itself
    (nproc 0) or its workers, whose exit code it returns as torchrun would."""
    os.setpgid(0, 0)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    for fd, path in ((1, req["stdout"]), (2, req["stderr"])):
        out = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o644)
        os.dup2(out, fd)
        os.close(out)
    os.environ.clear()
    os.environ.update(req["env"])
    os.chdir(req["cwd"])
    nproc = int(req["nproc"])
    if nproc == 0:
        _worker(req["argv"])
    port, run_id = _free_port(), uuid.uuid4().hex
    pids = []
    for rank in range(nproc):
        pid = os.fork()
        if pid == 0:
            os.environ.update(
                RANK=str(rank), LOCAL_RANK=str(rank), GROUP_RANK="0", ROLE_RANK=str(rank), ROLE_NAME="default",
                WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc), GROUP_WORLD_SIZE="1", ROLE_WORLD_SIZE=str(nproc),
                MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TORCHELASTIC_RESTART_COUNT="0",
                TORCHELASTIC_MAX_RESTARTS="0", TORCHELASTIC_RUN_ID=run_id, TORCHELASTIC_USE_AGENT_STORE="True",
                TORCH_NCCL_ASYNC_ERROR_HANDLING="1",
            )
            _worker(req["argv"])
        pids.append(pid)
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", port, world_size=nproc, is_master=True, wait_for_workers=False)  # noqa: F841
    sys.exit(_wait(pids))


def _wait(pids: list[int]) -> int:
    """Wait for the workers; the first to fail stops the rest (torchrun: exit 1 when any worker failed)."""
    running, failed, deadline = set(pids), False, None
    while running:
        if deadline is not None and time.monotonic() > deadline:
            for pid in running:
                os.kill(pid, signal.SIGKILL)
            deadline = float("inf")
        pid, status = os.waitpid(-1, os.WNOHANG) if deadline is not None else os.waitpid(-1, 0)
        if pid == 0:
            time.sleep(0.05)
            continue
        running.discard(pid)
        if os.waitstatus_to_exitcode(status) != 0 and not failed:
            failed = True
            print(f"forkserver: a worker (pid {pid}) exited with {os.waitstatus_to_exitcode(status)}; "
                  "stopping the others", file=sys.stderr, flush=True)
            for other in running:
                os.kill(other, signal.SIGTERM)
            deadline = time.monotonic() + STOP_GRACE_S
    return 1 if failed else 0


def serve(answers: int) -> None:
    for line in sys.stdin:
        req = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            os.close(answers)
            _agent(req)  # never returns: its SystemExit unwinds to the top level
        os.write(answers, (json.dumps({"pid": pid}) + "\n").encode())
        _, status = os.waitpid(pid, 0)
        os.write(answers, (json.dumps({"rc": os.waitstatus_to_exitcode(status)}) + "\n").encode())


def main() -> None:
    answers = os.dup(1)  # the answers' pipe; the launches' own output goes to their files
    os.dup2(2, 1)
    started = time.perf_counter()
    for name in PRELOAD:
        importlib.import_module(name)
    # The imports' objects out of the collector's reach. Otherwise each launch's collections, and the interpreter's
    # teardown at its end, touch every one of them and copy the pages they sit on (copy-on-write): a forked
    # single-process run of model=tiny_moe ended 2.3 s after its last file was written, 0.5 s with this.
    gc.freeze()
    ready = {"ready": round(time.perf_counter() - started, 2), "threads": threads()}
    os.write(answers, (json.dumps(ready) + "\n").encode())
    if ready["threads"] != 1:  # forking a process with threads is unsafe: the client falls back to torchrun
        return
    serve(answers)


if __name__ == "__main__":
    main()
