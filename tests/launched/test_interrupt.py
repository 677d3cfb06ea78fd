"""Ctrl-C: every rank stops cleanly after the same step, saves it, and rank 0 prints the command that resumes,
which then ends on the uninterrupted run's loss."""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys

from dist_train.interrupt import resume_command
from tests.conftest import CHECKPOINTED
from tests.helpers import ROOT, TRAIN, env, train_ok


def test_ctrl_c_stops_every_rank_cleanly_and_the_printed_command_resumes_bit_exact(straight_run, tmp_path):
    """SIGINT to the launch's process group, as a terminal's Ctrl-C sends it (torchrun and both workers), once
    rank 0 has logged step 1 of 8: each rank stops after the step they agree on (two or three steps later: the
    flag is read one step after it is posted), saves it although no periodic checkpoint was asked for (the default
    checkpoint.every_steps=0), and the launch ends with exit code 130, no traceback (`python -m
    dist_train.torchrun`: torchrun, quiet on a signal). The printed command resumes and gives the uninterrupted
    run's losses exactly."""
    _, straight = straight_run("fsdp")
    run_dir = tmp_path / "run"
    no_periodic_saves = [o for o in CHECKPOINTED if not o.startswith("checkpoint.every_steps=")]
    proc = subprocess.Popen([sys.executable, "-m", "dist_train.torchrun", "--standalone", "--nproc_per_node=2",
                             str(TRAIN), "strategy=fsdp", *no_periodic_saves, f"hydra.run.dir={run_dir}"],
                            cwd=ROOT, env=env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    seen = []
    for line in proc.stderr:
        seen.append(line)
        if "step 1/8 |" in line:
            os.killpg(proc.pid, signal.SIGINT)
            break
    _, rest = proc.communicate(timeout=180)
    stderr = "".join(seen) + rest
    assert proc.returncode == 130, stderr[-4000:]
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr, stderr[-4000:]
    stopped = next(line for line in stderr.splitlines() if "SIGINT: stopped after step" in line)
    step = int(stopped.split("stopped after step ")[1].split()[0])
    assert 1 < step < 8
    assert f"newest complete checkpoint: {run_dir}/checkpoints/step-{step:08d}" in stopped
    assert [p.name for p in (run_dir / "checkpoints").iterdir()] == [f"step-{step:08d}"]  # the signal's save only
    command = next(line for line in stderr.splitlines() if "resume with: " in line).split("resume with: ", 1)[1]
    assert command.startswith("python -m dist_train.torchrun --standalone --nproc_per_node=2 ")  # as launched
    assert command.endswith(f"hydra.run.dir={run_dir}")
    words = shlex.split(command)
    overrides = words[words.index(os.path.relpath(TRAIN, ROOT)) + 1:]
    resumed = train_ok(overrides[:-1], run_dir=run_dir, nproc=2)  # train_ok adds the same hydra.run.dir
    assert resumed["start_step"] == step and resumed["interrupted"] is None
    assert resumed["losses"] == straight["losses"]  # bit-exact, every step
    assert resumed["eval_losses"] == straight["eval_losses"]


def test_the_resume_command_names_the_launch_it_came_from(tmp_path):
    argv = ["launch/train.py", "strategy=fsdp", "checkpoint.resume=none", "hydra.run.dir=old", "train.steps=9"]
    one_node = {"TORCHELASTIC_RUN_ID": "x", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "4"}
    assert resume_command(tmp_path, argv=argv, env=one_node) == (
        f"torchrun --standalone --nproc_per_node=4 launch/train.py strategy=fsdp train.steps=9 hydra.run.dir={tmp_path}")
    assert resume_command(tmp_path, argv=argv, env={}) == (
        f"python launch/train.py strategy=fsdp train.steps=9 hydra.run.dir={tmp_path}")
    two_nodes = {"TORCHELASTIC_RUN_ID": "x", "WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8"}
    assert resume_command(tmp_path, argv=argv, env=two_nodes).startswith(
        "the same launch as before (16 processes on 2 node(s)) of: python launch/train.py strategy=fsdp")
