"""Ctrl-C and SIGTERM end training cleanly, after a step every rank agrees on.

In a terminal, Ctrl-C reaches torchrun and every worker; torchrun then forwards it to them, and Slurm's preemption
sends SIGTERM to every task. Each rank only records the signal (no KeyboardInterrupt in the middle of a collective,
no traceback). The ranks then agree on the step to stop after: at the end of every step, each starts an all-reduce
(max) of its flag, asynchronously, on a CPU group of its own, and reads the one it started at the end of the step
before. Every rank reads the same value after the same step, so all stop together, one step after the first of them
saw the signal, and without a host-device sync (gloo, on the CPU, whatever the training's backend).

Then the loop closes the window, saves a checkpoint of that step (also with checkpoint.every_steps=0, unless
checkpoint.save_on_signal=false), and rank 0 prints the newest complete checkpoint and the command that resumes from
it (`resume_command`). The launcher must give the save time: torchrun kills its workers `--shutdown-timeout` seconds
(default 30) after forwarding the signal, and Slurm `KillWait` seconds after its own (launch/slurm.sbatch asks for
the signal early, with `--signal`).
"""

from __future__ import annotations

import os
import shlex
import signal
import sys
import threading
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StopRequest:
    """Records SIGINT and SIGTERM and decides, the same on every rank, when training stops."""

    def __init__(self, *, group_needed: bool, tracker: Any = None, grace_s: float = 20.0) -> None:
        self.grace_s = grace_s  # runtime.stop_grace_s: after the signal, how long before a rank exits anyway
        self.signal: int | None = None
        self.step: int | None = None  # the step training stopped after
        self._previous = {sig: signal.signal(sig, self._record) for sig in SIGNALS}
        self._group = None
        if group_needed and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            self._group = dist.new_group(backend="gloo")  # every rank, in the same order: at set-up
            if tracker is not None:  # not the training's traffic
                tracker.ignore_group(self._group)
        self._posted: tuple[torch.Tensor, Any] | None = None
        self._deadline: threading.Timer | None = None

    def _record(self, signum: int, frame: Any) -> None:
        if self.signal is None:
            self.signal = signum
            print(f"[dist_train] rank {os.environ.get('RANK', '0')}: {signal.Signals(signum).name} received, "
                  "stopping after the next step", file=sys.stderr, flush=True)
            self._deadline = threading.Timer(self.grace_s, self._give_up, args=(signum, self.grace_s))
            self._deadline.daemon = True
            self._deadline.start()

    @staticmethod
    def _give_up(signum: int, grace_s: float) -> None:
        print(f"[dist_train] rank {os.environ.get('RANK', '0')}: not stopped {grace_s:g} s after "
              f"{signal.Signals(signum).name} (stuck outside a step): exiting", file=sys.stderr, flush=True)
        os._exit(128 + signum)

    @property
    def signal_name(self) -> str:
        return signal.Signals(self.signal).name if self.signal is not None else ""

    def after_step(self, step: int) -> bool:
        """Whether every rank stops now, after `step` (every rank calls it after every step)."""
        if self._group is None:
            stop = self.signal is not None
        else:
            stop = False
            if self._posted is not None:
                flag, work = self._posted
                work.wait()
                stop = bool(flag.item())
            flag = torch.tensor([1 if self.signal is not None else 0], dtype=torch.int32)
            self._posted = flag, dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group, async_op=True)
        if stop:
            self.step = step
            if self.signal is None:  # a peer saw it: this rank stops as one of the group
                self.signal = signal.SIGTERM
            if self._deadline is not None:  # not stuck: every rank is here, and the save may take longer than that
                self._deadline.cancel()
        return stop

    def close(self) -> None:
        """Wait for the last posted flag (every rank posted it) and give the handlers back."""
        if self._deadline is not None:
            self._deadline.cancel()
        if self._posted is not None:
            self._posted[1].wait()
            self._posted = None
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)


def resume_command(run_dir: Path, *, argv: list[str] | None = None, env: Any = os.environ) -> str:
    """The command that resumes this run: its launch (torchrun on one node as it was launched; on several, the
    same launcher as before) with its own overrides, pointed at its run directory (checkpoint.resume=auto, the
    default, finds the newest complete checkpoint there)."""
    argv = sys.argv if argv is None else argv
    keep = [a for a in argv[1:] if not a.startswith(("hydra.run.dir=", "checkpoint.resume="))]
    script = os.path.relpath(argv[0]) if argv else "launch/train.py"
    train = " ".join(shlex.quote(a) for a in [script, *keep, f"hydra.run.dir={run_dir}"])
    world, local = int(env.get("WORLD_SIZE", "1")), int(env.get("LOCAL_WORLD_SIZE", env.get("WORLD_SIZE", "1")))
    if world == 1 and "TORCHELASTIC_RUN_ID" not in env:
        return f"python {train}"
    if world == local and "TORCHELASTIC_RUN_ID" in env:  # torchrun (or dist_train.torchrun) on one node
        return f"{env.get('DIST_TRAIN_LAUNCHER', 'torchrun')} --standalone --nproc_per_node={local} {train}"
    return f"the same launch as before ({world} processes on {max(world // local, 1)} node(s)) of: python {train}"


class Interrupted(Exception):
    """Training stopped on a signal, cleanly, every rank after the same step (its report is written)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.exit_code = 128 + signum
