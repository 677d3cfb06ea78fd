"""The README's launcher, `python -m dist_train.torchrun`: bad input is one line and exit 2 before any worker starts.

Plain torchrun starts every worker, each finds the error, one prints it, and torchrun adds its 40-line failure
report and exits 1 (tests/launched/test_bad_input.py checks that the line is still there exactly once). The
launcher checks the whole config for the launch's world size first, in a process of its own.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import pytest

from dist_train import torchrun
from tests.helpers import ROOT, TRAIN, env

# (processes, arguments, the line). Each names something a user got wrong through torchrun.
CASES = [
    (2, "strategy=fsdpp", "config error: strategy=fsdpp is not an option (no conf/strategy/fsdpp.yaml); available: "),
    (2, "train.steps=-1", "config error: train.steps=-1 must be >= 1"),
    (2, "model=hf", "config error: model=hf needs model.path=DIR"),
    (2, "model=hf model.path=~/no-such-model", f"config error: model.path='{Path.home()}/no-such-model' is not a "),
    (3, "train.global_batch_size=4", "config error: train.global_batch_size=4 must be divisible by "
                                     "train.micro_batch_size (2) x data-parallel size (3) = 6"),
]


def _launch(nproc: int, args: str, run_dir: Path) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "dist_train.torchrun", "--standalone", f"--nproc_per_node={nproc}", str(TRAIN),
           *args.split(), "logger=none", f"hydra.run.dir={run_dir}"]
    return subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=180)


def test_bad_input_through_the_launcher_is_one_line_exit_2_and_no_worker(tmp_path):
    with ThreadPoolExecutor(2) as pool:  # each is a few seconds of imports; no worker should ever start
        procs = list(pool.map(lambda i: _launch(CASES[i][0], CASES[i][1], tmp_path / f"run{i}"), range(len(CASES))))
    for (nproc, args, says), proc in zip(CASES, procs):
        lines = proc.stderr.splitlines()
        assert proc.returncode == 2, (args, proc.stderr[-3000:])
        assert len(lines) == 1 and lines[0].startswith(says), (args, proc.stderr[-3000:])
        assert proc.stdout == ""  # no worker: no "[rank0]" line, no torchrun banner
    assert list(tmp_path.iterdir()) == []  # no run directory was made


def test_the_launch_world_size_is_torchruns_own_reading_of_its_arguments():
    from torch.distributed.run import parse_args

    def world(*argv: str) -> int | None:
        return torchrun.world_size(parse_args([*argv, str(TRAIN)]))

    assert world("--nproc_per_node=4") == 4
    assert world("--nnodes=2", "--nproc_per_node=8") == 16
    assert world("--nnodes=1:4", "--nproc_per_node=8") is None  # elastic: the workers check, at their size
    assert world("--nproc_per_node=cpu") == os.cpu_count()


def test_only_this_projects_train_script_is_checked_first():
    from torch.distributed.run import parse_args

    assert torchrun.is_train_script(parse_args([str(TRAIN)]))
    assert not torchrun.is_train_script(parse_args(["other.py"]))
    assert not torchrun.is_train_script(parse_args(["-m", "launch.train"]))


def test_ctrl_c_during_the_check_ends_quietly_with_130(monkeypatch, capsys):
    """Ctrl-C while the config is being checked (a few seconds of imports): no worker, no traceback, exit 130."""
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(torchrun.subprocess, "run", interrupted)
    monkeypatch.setattr("torch.distributed.run.run", lambda args: pytest.fail("workers started"))
    assert torchrun.main(["--standalone", "--nproc_per_node=2", str(TRAIN), "strategy=ddp"]) == 128 + signal.SIGINT
    assert capsys.readouterr().err == ""


def test_workers_that_all_failed_on_their_config_end_the_launch_with_2():
    failure = SimpleNamespace(exitcode=2)
    assert torchrun.failed_on_config(SimpleNamespace(failures={0: failure, 1: failure}))
    assert not torchrun.failed_on_config(SimpleNamespace(failures={0: failure, 1: SimpleNamespace(exitcode=1)}))
    assert not torchrun.failed_on_config(SimpleNamespace(failures={}))
    # one rank found it (a checkpoint file only it reads); torchrun then stopped the other with a signal
    first, stopped = SimpleNamespace(exitcode=2, timestamp=10), SimpleNamespace(exitcode=-9, timestamp=40)
    assert torchrun.failed_on_config(SimpleNamespace(failures={0: first, 1: stopped}))
    # a worker killed first (out of memory, say) is not bad input, whatever the others said after it
    killed = SimpleNamespace(exitcode=-9, timestamp=5)
    assert not torchrun.failed_on_config(SimpleNamespace(failures={0: first, 1: killed}))


def test_an_unreadable_checkpoint_names_its_first_failure_in_one_sentence():
    """dist_train/checkpoint/manager.py: DCP's CheckpointException (a BaseException) by the first rank's own
    exception, and torch.load's unpickling error without its advice to load with weights_only=False."""
    import pickle

    from torch.distributed.checkpoint.api import CheckpointException

    from dist_train.checkpoint.manager import _first_failure

    unpickling = pickle.UnpicklingError("Weights only load failed. Re-running `torch.load` with `weights_only` set "
                                        "to `False` will likely succeed.\nPlease file an issue")
    assert _first_failure(unpickling) == "UnpicklingError: Weights only load failed"
    wrapped = CheckpointException("CheckpointException ranks:{0: ...}", {0: (ValueError("bad offset\nmore"), None)})
    assert _first_failure(wrapped) == "ValueError: bad offset"
