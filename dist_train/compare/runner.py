"""Run one strategy as its own training launch, in its own directory; a failure is a result, not a crash.

single and dp run as one process (`python launch/train.py`); every other strategy under
`python -m torch.distributed.run --standalone --nproc_per_node=N`. Inside a Slurm job
(`compare.launcher=slurm`, what `sbatch launch/slurm.sbatch compare ...` sets) each strategy is a job step
instead: one torchrun per node of the allocation, N processes each, meeting at a rendezvous on the first
node (single and dp: one process on one node). Output of both streams goes to <run dir>/compare.log, and
the reason of a failure is the most telling line of it.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from dist_train.compare.settings import StrategySpec
from dist_train.config import ConfigError
from dist_train.strategies.registry import one_process

ROOT = Path(__file__).resolve().parents[2]
TRAIN = ROOT / "launch" / "train.py"


@dataclass
class RunResult:
    spec: StrategySpec
    run_dir: Path
    command: list[str]
    returncode: Optional[int]  # None: timed out
    seconds: float
    reason: str = ""  # why it failed; "" when it ran
    log: Optional[Path] = None  # None: <run dir>/compare.log (a run this comparison launched)

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and (self.run_dir / "summary.json").is_file()

    @property
    def log_path(self) -> Path:
        return self.log if self.log is not None else self.run_dir / "compare.log"


def check_rows(specs: list[StrategySpec], training: list[str], *, world_size: int,
               base_train: dict[str, Any]) -> list[str]:
    """Each row's config checked as its launch would check it (for its number of processes, with the global
    batch the comparison pins), before anything runs: one `label: reason` for each row that would fail at once."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from dist_train.checks import validate
    from dist_train.compare.settings import pinned_global_batch
    from dist_train.entry import one_line
    from dist_train.estimate.compose import compose_run

    problems = []
    for spec in specs:
        pinned = pinned_global_batch(base_train, spec, world_size=world_size)
        try:
            run = compose_run([*training, *pinned, f"strategy={spec.name}", *spec.overrides])
            validate(run, 1 if _one_process(spec.name) else world_size)
        except (ValueError, HydraException, OmegaConfBaseException) as exc:
            problems.append(f"{spec.label}: {one_line(exc)}")
    return problems


def command_for(
    spec: StrategySpec, *, training: list[str], nproc: int, run_dir: Path, group: str, launcher: str = "local"
) -> list[str]:
    prefix = _launcher(spec, nproc=nproc, run_dir=run_dir) if launcher == "slurm" else [sys.executable]
    if launcher == "local" and not _one_process(spec.name):
        prefix += ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    overrides = [*training, f"strategy={spec.name}", *spec.overrides, f"logger.group={group}",
                 f"hydra.run.dir={run_dir}"]
    return [*prefix, str(TRAIN), *overrides]


def _one_process(name: str) -> bool:
    """Whether `strategy=<name>` runs as one process (single, dp), asked of the registry: not whether the
    launch has one process per node (a CPU Slurm job runs ddp with 1 per node). A name the registry does
    not know is launched like the others, so that its row carries train.py's own one-line config error."""
    try:
        return one_process(name)
    except ConfigError:
        return False


def _launcher(spec: StrategySpec, *, nproc: int, run_dir: Path) -> list[str]:
    """A job step of the Slurm allocation this comparison runs in."""
    from dist_train import slurm

    if _one_process(spec.name):
        return [*slurm.srun_one_process(), *slurm.step_python()]
    alloc = slurm.Allocation.from_env()
    rdzv_id = f"{alloc.job_id}-{run_dir.name}"  # one rendezvous per step
    return [*slurm.srun_on_every_node(alloc), *slurm.torchrun(alloc, rdzv_id=rdzv_id, nproc_per_node=nproc)]


def run_strategy(spec: StrategySpec, *, training: list[str], nproc: int, out_dir: Path, group: str,
                 timeout_s: float, launcher: str = "local") -> RunResult:
    run_dir = out_dir / spec.dirname
    run_dir.mkdir(parents=True, exist_ok=True)
    cmd = command_for(spec, training=training, nproc=nproc, run_dir=run_dir, group=group, launcher=launcher)
    env = dict(os.environ)
    env.pop("RANK", None)  # a comparison launched from inside a rank must not leak its identity
    env.pop("WORLD_SIZE", None)
    start = time.perf_counter()
    with open(run_dir / "compare.log", "w") as log:
        log.write("$ " + " ".join(cmd) + "\n")
        log.flush()
        code = _run_logged(cmd, env=env, log=log, timeout_s=timeout_s)
    result = RunResult(spec, run_dir, cmd, code, time.perf_counter() - start)
    if code is None:
        result.reason = f"timed out after {timeout_s:g} s (compare.timeout_s)"
    elif not result.ok:
        result.reason = failure_reason((run_dir / "compare.log").read_text(errors="replace"), code)
    return result


def _run_logged(cmd: list[str], *, env: dict[str, str], log: Any, timeout_s: float) -> Optional[int]:
    """Exit code, or None after a timeout. The launch gets its own session so that a timeout stops
    torchrun's workers too (killing torchrun alone would orphan them)."""
    # In the directory compare was started in: relative paths among the overrides mean what the user meant.
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        return proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        _stop_group(proc)
        return None
    except BaseException:  # Ctrl-C on the comparison: take the launch down with it
        _stop_group(proc)
        raise


def _stop_group(proc: subprocess.Popen) -> None:
    for sig, grace_s in ((signal.SIGTERM, 15), (signal.SIGKILL, 5)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=grace_s)
            return


_FRAME = re.compile(r'File "([^"]+)", line (\d+)')
# An exception line starts at column 0 ("pkg.mod.SomeError: message"); traceback code lines are indented.
_ERROR = re.compile(r"^((?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*(?:Error|Exception|Interrupt)\b.*)$")
# Hydra reports a bad override in prose, without an exception name.
_HYDRA = re.compile(r"Could not (find|load|override|append)|not in struct|mismatched input|Error (merging|parsing)")
_LAUNCHER = ("torch.distributed.elastic", "ChildFailedError")  # torchrun's own report of a child's failure


def failure_reason(log_text: str, returncode: int) -> str:
    """The first config error or Hydra complaint, else the last exception of a training process (with
    where it was raised), else torchrun's own exception (e.g. a signal), else the last line."""
    lines = [re.sub(r"^\[(?:rank|default)\d*\]:? ?", "", ln.rstrip()) for ln in log_text.splitlines()]
    lines = [ln for ln in lines if ln.strip() and not ln.startswith("$ ")]
    config = [ln.strip() for ln in lines if ln.startswith("config error:") or _HYDRA.search(ln)]
    if config:
        return f"{config[0]} (exit {returncode})"
    errors = [(i, m.group(1)) for i, ln in enumerate(lines) if (m := _ERROR.match(ln))]
    ours = [(i, e) for i, e in errors if not any(n in e for n in _LAUNCHER)]
    if ours:
        i, text = ours[-1]
        return f"{text[:300]}{_where(lines[max(0, i - 12):i])} (exit {returncode})"
    launcher = [e for _, e in errors if "ChildFailedError" not in e]
    if launcher:
        short = re.sub(r"^(?:\w+\.)+", "", launcher[-1])  # SignalException: ..., without the module path
        return f"{short[:300]} (exit {returncode})"
    rest = [ln.strip() for ln in lines if "HYDRA_FULL_ERROR" not in ln]
    return f"{(rest[-1] if rest else 'no output')[:300]} (exit {returncode})"


def _where(before: list[str]) -> str:
    """` at file.py:N` of the innermost frame printed before the error line, if any."""
    frames = [m for ln in before if (m := _FRAME.search(ln))]
    return f" at {Path(frames[-1].group(1)).name}:{frames[-1].group(2)}" if frames else ""
