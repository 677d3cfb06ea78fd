"""When a run saves, how a save becomes visible, what is kept, and how a run resumes.

A save at step s, on every rank:
  1. wait for the previous background save, if any (rank 0 commits it first);
  2. write into `<dir>/step-s.partial/`: rank 0 `trainer.json` (step, losses, W&B run id, config), every rank
     `rng/rank<r>.pt`, then the strategy's state through its CheckpointIO (DCP or DeepSpeed's format);
  3. commit once every rank's part is written: rank 0 renames `.partial` to `step-s`, writes `COMPLETE`
     last, then removes the oldest complete checkpoints beyond `keep_last`.
A synchronous save commits after a barrier. A background save (DCP async_save) commits when rank 0's save
finishes: DCP's coordinator, rank 0, writes the checkpoint's metadata only after every rank reported its
writes, and the RNG files and trainer.json were written before the save began. A crash at any moment
leaves a `.partial` directory, which resume ignores and the next run removes.

The data position needs no state of its own: global batch s is a pure function of the seed and s
(dist_train/data.py), so resuming after step s trains on the same samples an uninterrupted run would.
"""

from __future__ import annotations

import contextlib
import json
import logging
import random
import shutil
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from dist_train.checkpoint.layout import (
    MARKER,
    TRAINER_STATE,
    complete_checkpoints,
    partial_checkpoints,
    partial_dir,
    read_trainer_state,
    step_dir_name,
)
from dist_train.checkpoint.verify import manifest, problem
from dist_train.config import CheckpointConfig
from dist_train.contracts import Runtime

log = logging.getLogger("dist_train")


# --------------------------------------------------------------------------------------------------
# Random-number generators: per rank (dropout masks differ by rank under data parallelism).
# --------------------------------------------------------------------------------------------------


def rng_state(device: torch.device) -> dict[str, Any]:
    """This rank's generators: Python's, the CPU's and, on a GPU, its own device's only. (Every visible GPU's
    state would be saved by every rank, and a resume that sees fewer GPUs would index one that is not there.)"""
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    cuda = state.get("cuda")
    if device.type != "cuda" or cuda is None:
        return
    if isinstance(cuda, (list, tuple)):  # every visible GPU's, as earlier checkpoints saved them: this device's
        if device.index is None or device.index >= len(cuda):
            return  # not saved: the device keeps its seeded generator (only dropout would differ)
        cuda = cuda[device.index]
    torch.cuda.set_rng_state(cuda, device)


def _rng_path(directory: Path, rank: int) -> Path:
    return directory / "rng" / f"rank{rank}.pt"


# --------------------------------------------------------------------------------------------------
# The checkpointer.
# --------------------------------------------------------------------------------------------------


@dataclass
class Checkpointer:
    cfg: CheckpointConfig
    root: Path
    runtime: Runtime
    io: Any  # the strategy's CheckpointIO
    total_steps: int
    tracker: Any = None  # telemetry's CommTracker: a checkpoint's collectives are not the training's
    group: Any = None  # gloo group for background saves (None: synchronous, or no process group)
    background: bool = False
    saved_steps: list[int] = field(default_factory=list)
    blocking_s: float = 0.0  # the time steps waited for saves (summary.json)
    _pending: Optional[tuple[int, Path, Future]] = None

    @classmethod
    def build(
        cls, cfg: CheckpointConfig, *, root: Path, runtime: Runtime, io: Any, total_steps: int,
        tracker: Any = None,
    ) -> "Checkpointer":
        """Every rank calls this (it may create a process group, which is collective)."""
        background = cfg.async_save and cfg.every_steps > 0 and io.format == "dcp"
        group = None
        if background and runtime.has_group:
            # Background writes coordinate on a gloo group of their own, never interleaved with the
            # training's collectives (DCP's async save needs a CPU backend even beside NCCL).
            group = dist.new_group(backend="gloo", timeout=runtime.timeout)
            if tracker is not None:
                tracker.ignore_group(group)
        me = cls(cfg, root, runtime, io, total_steps, tracker=tracker, group=group, background=background)
        if runtime.is_main and (cfg.every_steps > 0 or cfg.save_on_signal):
            me._remove_partials()
        return me

    def due(self, step: int) -> bool:
        every = self.cfg.every_steps
        return every > 0 and (step % every == 0 or step == self.total_steps)

    # ---------------------------------------------------------------- saving
    def save(self, step: int, trainer_state: dict[str, Any]) -> float:
        """Save the state after `step`; returns the seconds this call blocked the training."""
        start = time.perf_counter()
        self.wait()
        directory = partial_dir(self.root, step)
        directory.mkdir(parents=True, exist_ok=True)
        if self.runtime.is_main:
            (directory / TRAINER_STATE).write_text(json.dumps({**trainer_state, "step": step}, indent=1))
        rng = _rng_path(directory, self.runtime.rank)
        rng.parent.mkdir(parents=True, exist_ok=True)
        torch.save(rng_state(self.runtime.device), rng)
        with self._quiet():
            future = self.io.save(directory, background=self.background, group=self.group)
        if future is not None:
            self._pending = (step, directory, future)
        else:
            with self._quiet():
                if self.runtime.has_group:
                    dist.barrier()  # every rank's part is on disk
            self._commit(step, directory)
        elapsed = time.perf_counter() - start
        self.blocking_s += elapsed
        return elapsed

    def poll(self) -> None:
        """Commit a background save that has finished; never waits."""
        if self._pending is not None and self._pending[2].done():
            self.wait()

    def wait(self) -> None:
        """Wait for the background save in flight, if any; rank 0 then commits it. A failed save stops the run."""
        if self._pending is None:
            return
        step, directory, future = self._pending
        self._pending = None
        try:
            future.result()
        except Exception as exc:
            raise RuntimeError(f"checkpoint of step {step} failed to write to {directory}: {exc}") from exc
        self._commit(step, directory)

    def finish(self) -> None:
        self.wait()

    def _commit(self, step: int, directory: Path) -> None:
        self.saved_steps.append(step)
        if not self.runtime.is_main:
            return
        final = self.root / step_dir_name(step)
        if final.exists():  # a step saved again after a resume from an earlier checkpoint
            _set_aside_or_remove(final)
        directory.rename(final)
        # Every file with its size, so that damage after the commit is found before a resume (verify.problem).
        marker = {"step": step, "format": self.io.format, "world_size": self.runtime.world_size,
                  "committed_at": time.strftime("%Y-%m-%dT%H:%M:%S"), "files": manifest(final)}
        (final / MARKER).write_text(json.dumps(marker))  # last: from here on the checkpoint counts
        log.info("checkpoint step %d: %s", step, final)
        self._prune()

    def _prune(self) -> None:
        keep = self.cfg.keep_last
        if keep <= 0:
            return
        for _, path in complete_checkpoints(self.root)[:-keep]:
            shutil.rmtree(path, ignore_errors=True)

    def _remove_partials(self) -> None:
        for path in partial_checkpoints(self.root):
            log.warning("removing an incomplete checkpoint (its save was interrupted): %s", path)
            shutil.rmtree(path, ignore_errors=True)

    def _quiet(self) -> Any:
        return self.tracker.paused() if self.tracker is not None else contextlib.nullcontext()

    # ---------------------------------------------------------------- resuming
    def load(self, path: Path) -> dict[str, Any]:
        """Load the strategy's state and this rank's RNG states from a complete checkpoint; return trainer.json."""
        rng = _rng_path(path, self.runtime.rank)
        failure, state = None, None
        with self._quiet():
            # damage the pre-flight check cannot see (a tensor's bytes, an RNG file's): name the checkpoint. DCP's
            # CheckpointException is a BaseException, not an Exception.
            try:
                self.io.load(path)
            except (Exception, CheckpointException) as exc:
                failure = _first_failure(exc)
                if self.io.format == "deepspeed":
                    # DeepSpeed's load goes on into collectives of its own after each rank read its files (ZeRO-3's
                    # persistent parameters): the others may be in one, which no agreement here would match. This
                    # rank stops alone; the launcher stops the rest.
                    raise UnreadableCheckpoint(_unreadable(path, f"rank {self.runtime.rank}: {failure}")) from None
            if failure is None:
                try:
                    state = torch.load(rng, weights_only=True) if rng.is_file() else None
                except Exception as exc:
                    failure = _first_failure(exc)
        if self.runtime.has_group:  # one rank's file alone may fail: every rank stops here with its line
            failures: list[Optional[str]] = [None] * self.runtime.world_size
            dist.all_gather_object(failures, failure)
            failure = next((f"rank {r}: {f}" for r, f in enumerate(failures) if f is not None), None)
        if failure is not None:
            raise UnreadableCheckpoint(_unreadable(path, failure))
        if state is not None:
            set_rng_state(state, self.runtime.device)
        else:  # resumed on more ranks than saved: the new ranks keep their seeded generators
            log.warning("checkpoint %s has no RNG state for rank %d; it keeps its own", path, self.runtime.rank)
        return read_trainer_state(path)


def _unreadable(path: Path, failure: str) -> str:
    return (f"checkpoint {path} could not be loaded ({failure}); if its files are damaged, resume from an older one "
            "with checkpoint.resume=PATH")


class UnreadableCheckpoint(RuntimeError):
    """A checkpoint that passed the pre-flight check (verify.py) but whose files could not be read: bad input, not a
    fault of the training, so launch/train.py makes it one `config error:` line (exit 2), as it does a checkpoint
    the pre-flight check finds damaged."""


def _first_failure(exc: BaseException) -> str:
    """`Type: first line` of what failed: for DCP's CheckpointException, the first rank's own exception (its message
    holds every rank's traceback). Never torch.load's advice to retry with weights_only=False (unsafe)."""
    failures = getattr(exc, "failures", None)
    if isinstance(exc, CheckpointException) and isinstance(failures, dict) and failures:
        inner = next(iter(failures.values()))
        exc = inner[0] if isinstance(inner, tuple) else inner
    lines = str(exc).strip().splitlines()
    first = lines[0].split(". ")[0] if lines else ""  # its first sentence
    return f"{type(exc).__name__}: {first[:200]}" if first else type(exc).__name__


def _set_aside_or_remove(final: Path) -> None:
    """A checkpoint about to be replaced by a new save of its step: removed when whole (it is the same training), but
    set aside as `<name>.damaged-<time>` when damaged: the run resumed before it, and damage is kept to be looked at,
    never deleted."""
    why = problem(final)
    if not why:
        shutil.rmtree(final)
        return
    aside = final.with_name(f"{final.name}.damaged-{time.strftime('%Y%m%d-%H%M%S')}")
    final.rename(aside)
    log.warning("checkpoint %s was damaged (%s): set aside as %s", final.name, why, aside)
