"""torchrun, checked first and quiet when stopped: `python -m dist_train.torchrun` takes torchrun's arguments.

    python -m dist_train.torchrun --standalone --nproc_per_node=2 launch/train.py strategy=fsdp

What it adds to torchrun (everything else is torchrun's own `run`, unchanged):
- **The config is checked before any worker starts.** For launch/train.py, the whole config is validated for this
  launch's world size (`--nnodes` x `--nproc_per_node`) by `launch/train.py --check-config` in a process of its own,
  exactly as every worker would validate it. Bad input is then one `config error:` line and exit code 2, and no
  worker starts (plain torchrun shows the same line among its own 40-line failure report, and exits 1). An elastic
  `--nnodes=MIN:MAX` has no world size yet: there the workers check, as under torchrun.
- **A config error found by the workers** (one the check cannot see, e.g. another node's GPUs, or a checkpoint file
  that cannot be read): the line they printed once, and exit code 2, without torchrun's report, also where torchrun
  stopped the other workers with a signal.
- **Ctrl-C or SIGTERM**: torchrun forwards the signal, waits for the workers (which stop after a step they agree on,
  save it, and say how to resume), then dies with its own `SignalException` traceback. Here that is one line and
  the shell's exit code for the signal (130 for SIGINT, 143 for SIGTERM). Ctrl-C during the check: exit 130, silent.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

LAUNCHER_ENV = "DIST_TRAIN_LAUNCHER"
TRAIN = Path(__file__).resolve().parents[1] / "launch" / "train.py"
CONFIG_ERROR_EXIT = 2  # dist_train.entry.CONFIG_ERROR_EXIT (not imported: that module is for the workers)


def main(argv: list[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    args = parse_args(sys.argv[1:] if argv is None else argv)  # torchrun's own parser, usage and errors
    os.environ[LAUNCHER_ENV] = "python -m dist_train.torchrun"  # the workers' resume line names this launcher
    try:
        code = precheck(args)
    except KeyboardInterrupt:
        return 128 + signal.SIGINT
    if code:
        return code
    try:
        run(args)
    except SignalException as exc:
        print(f"torchrun: stopped by signal {int(exc.sigval)}; the workers' last lines say where", file=sys.stderr)
        return 128 + int(exc.sigval)
    except ChildFailedError as exc:
        if failed_on_config(exc):
            return CONFIG_ERROR_EXIT  # the workers printed the line, once (dist_train.entry.report_config_error)
        raise
    return 0


def precheck(args: Any) -> int:
    """Validate launch/train.py's config for this launch's world size, in a process of its own; 0 when it is fine
    (or cannot be checked here), else the check's exit code after its one line."""
    world = world_size(args)
    if world is None or not is_train_script(args):
        return 0
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK")}
    env.update(WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world // nodes(args)), LOCAL_RANK="0")
    if not args.standalone and args.rdzv_id not in ("", "none"):
        env["TORCHELASTIC_RUN_ID"] = args.rdzv_id  # the workers' default run directory, where resume=auto looks
    else:
        env.pop("TORCHELASTIC_RUN_ID", None)
    proc = subprocess.run([sys.executable, args.training_script, "--check-config", *args.training_script_args],
                          env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True)
    if proc.returncode == 0:
        return 0  # its "config ok" line and any warning: the workers say what matters, once
    if proc.returncode == -signal.SIGINT:
        raise KeyboardInterrupt
    sys.stderr.write(proc.stderr if proc.returncode == CONFIG_ERROR_EXIT else proc.stdout + proc.stderr)
    return proc.returncode if proc.returncode > 0 else 128 - proc.returncode


def is_train_script(args: Any) -> bool:
    """Whether torchrun is about to run this project's launch/train.py (the only script with --check-config)."""
    if args.module or args.no_python:
        return False
    try:
        return Path(args.training_script).resolve() == TRAIN
    except OSError:
        return False


def nodes(args: Any) -> int:
    from torch.distributed.run import parse_min_max_nnodes

    return parse_min_max_nnodes(args.nnodes)[1]


def world_size(args: Any) -> int | None:
    """--nnodes x --nproc_per_node (torchrun's own reading of `gpu`, `cpu`, `auto`); None for an elastic range of
    nodes, or a value torchrun itself will refuse (it says so, in its own words)."""
    from torch.distributed.run import determine_local_world_size, parse_min_max_nnodes

    try:
        low, high = parse_min_max_nnodes(args.nnodes)
        local = determine_local_world_size(args.nproc_per_node)
    except (RuntimeError, ValueError):
        return None
    return high * local if low == high and local >= 1 else None


def failed_on_config(exc: Any) -> bool:
    """Whether the launch failed on bad input, whose line the workers printed once: the first worker to fail ended
    with the config-error exit code, and every other failed worker did too or was stopped by a signal, which is
    torchrun stopping the rest (a checkpoint only one rank's file of which is unreadable)."""
    failures = list((getattr(exc, "failures", {}) or {}).values())
    if not failures:
        return False
    first = min(failures, key=lambda f: getattr(f, "timestamp", 0))
    return first.exitcode == CONFIG_ERROR_EXIT and all(f.exitcode == CONFIG_ERROR_EXIT or f.exitcode < 0
                                                       for f in failures)


if __name__ == "__main__":
    sys.exit(main())
