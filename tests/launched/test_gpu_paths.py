"""A line a GPU run takes, run on the CPU (issue 21) with two ranks: an fp16 overflow in one rank's FSDP shard skips
the step on every rank. Device choice and what each strategy is handed: tests/unit/test_gpu_paths.py."""

from __future__ import annotations

FP16 = ["strategy=fsdp", "precision=fp16", "logger=none", "model=tiny", "train.steps=5", "train.log_every=1",
        "telemetry.comm=false"]


def test_fp16_overflow_in_one_ranks_shard_skips_the_step_on_every_rank(tmp_path):
    """FSDP in fp16: an inf in rank 1's gradient shard only must skip step 3 on both ranks, as an inf on every
    rank does. DTensor reduces the scaler's found_inf over the mesh, so torch's plain GradScaler agrees; with a
    per-rank verdict rank 0 would step alone and the later losses would differ."""
    from tests.helpers import train_ok

    one = train_ok(FP16, run_dir=tmp_path / "one", nproc=2, extra_env={"DIST_TRAIN_FAULT": "overflow@3:rank1"})
    every = train_ok(FP16, run_dir=tmp_path / "every", nproc=2, extra_env={"DIST_TRAIN_FAULT": "overflow@3"})
    assert one["skipped_steps"] == every["skipped_steps"] == 1
    assert one["losses"] == every["losses"]
