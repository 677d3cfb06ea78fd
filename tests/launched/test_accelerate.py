"""strategy=accelerate: the model prepared by Hugging Face Accelerate, launched by torchrun or `accelerate launch`."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import CHECKPOINTED
from tests.helpers import FAST, ROOT, TRAIN, assert_same_losses, env, last_step, summary, train_ok


def test_accelerate_ddp_under_torchrun_matches_single_with_ddps_figures(single_run, tmp_path):
    _, single = single_run
    s = train_ok(["strategy=accelerate", *FAST], run_dir=tmp_path, nproc=2)
    assert_same_losses(single, s)
    assert "accelerate prepared the model as ddp" in (tmp_path / "logs" / "rank0.log").read_text()
    n = s["num_params"]
    for rec in last_step(tmp_path):
        assert rec["memory/params_bytes"] == rec["memory/grads_bytes"] == 4 * n  # a replica per rank
        assert rec["comm/all_reduce/bytes"] == 4 * n  # Accelerate's no_sync: one gradient all-reduce per step
        assert rec["comm/all_reduce/time_s"] > 0


def test_accelerate_launch_runs_the_same_training(single_run, tmp_path):
    """`accelerate launch --multi_gpu` is torchrun underneath; on CPU our runtime picks gloo."""
    _, single = single_run
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", str(TRAIN),
           "strategy=accelerate", *FAST, f"hydra.run.dir={tmp_path}"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    s = summary(tmp_path)
    assert s["world_size"] == 2
    assert_same_losses(single, s)


def test_accelerate_deepspeed_from_a_config_file_is_zero3_bit_for_bit(straight_run, tmp_path):
    """An accelerate config file asking for DeepSpeed ZeRO-3: Accelerate builds the engine (DeepSpeedPlugin over the
    DeepSpeed config zero3 derives from the run) and steps it through accelerator.accumulate / backward; the
    training, what each rank holds and the traffic are zero3's, except the fp32 master partition: Accelerate's engine
    is DeepSpeed's as released, which keeps one beside an fp32 partition; strategy=zero3's does not
    (strategies/_zero3_setup.py)."""
    zero_dir, zero = straight_run("zero3")
    config = tmp_path / "ds.yaml"
    config.write_text("distributed_type: DEEPSPEED\nmixed_precision: 'no'\nnum_processes: 2\n"
                      "deepspeed_config:\n  zero_stage: 3\n")
    run_dir = tmp_path / "run"
    s = train_ok(["strategy=accelerate", f"strategy.config_file={config}", *CHECKPOINTED], run_dir=run_dir, nproc=2)
    assert "accelerate prepared the model as deepspeed (ZeRO stage 3)" in (run_dir / "logs" / "rank0.log").read_text()
    assert s["losses"] == zero["losses"]
    keys = ("memory/params_bytes", "memory/grads_bytes", "memory/gathered_params_bytes", "comm/all_gather/bytes",
            "comm/reduce_scatter/bytes")
    for ours, theirs in zip(last_step(run_dir), last_step(zero_dir)):
        assert {k: ours[k] for k in keys} == {k: theirs[k] for k in keys}
        master = theirs["memory/params_bytes"]  # this rank's fp32 partition, once more
        assert ours["memory/optimizer_bytes"] == theirs["memory/optimizer_bytes"] + master
    assert (run_dir / "checkpoints" / "step-00000008" / "COMPLETE").is_file()  # DeepSpeed's own format
