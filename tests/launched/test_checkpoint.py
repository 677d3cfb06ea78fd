"""Checkpoints on real runs: exact resume for every strategy, resharding on load, export, atomic saves.

Each strategy trains 8 steps straight, saving after steps 4 and 8 (the `straight_run` fixture); a second
launch resumes from the step-4 checkpoint and must reproduce steps 5-8 bit for bit (fp32, CPU). The pure parts
(layout, schedule, scaler): tests/unit/test_checkpoint.py.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from dist_train.checkpoint.layout import (
    complete_checkpoints,
    partial_checkpoints,
    step_dir_name,
)
from dist_train.config import TrainConfig
from tests.conftest import CHECKPOINTED, EVALUATED, RESUMABLE
from tests.helpers import FAST, forked, forked_python, launch, metrics, rel_diff, train_ok

STEP4 = step_dir_name(4)


def _resume(strategy: str, checkpoint: Path, run_dir: Path, nproc: int, *extra: str) -> dict:
    return train_ok([f"strategy={strategy}", *FAST, "train.steps=8", *EVALUATED,
                     f"checkpoint.resume={checkpoint}", *extra], run_dir=run_dir, nproc=nproc)


# zero1 saves and loads through the same DeepSpeed optimizer class as zero2, 1f1b through the same stage
# checkpoints as gpipe (its resume is exercised by the reshard test below): their straight runs stay (the
# prediction tests read them), their resumed twins are left out for the suite's time. fsdp and zero2 resume
# bit-exact from step 4 in tests/launched/test_checkpoint_damage.py, past a damaged step-8 checkpoint; ddp, which
# writes fsdp's format (DCP), resumes bit-exact after a restart in tests/launched/test_failures.py.
BIT_EXACT = [s for s in RESUMABLE if s not in ("zero1", "1f1b", "ddp", "fsdp", "zero2")]


@pytest.mark.parametrize("strategy", BIT_EXACT)
def test_resume_reproduces_every_step_bit_for_bit(strategy, straight_run, tmp_path):
    straight_dir, straight = straight_run(strategy)
    assert [s for s, _ in complete_checkpoints(straight_dir / "checkpoints")] == [4, 8]
    ckpt = straight_dir / "checkpoints" / STEP4
    world = max(RESUMABLE[strategy], 1)
    assert sorted(p.name for p in (ckpt / "rng").iterdir()) == [f"rank{r}.pt" for r in range(world)]
    assert (ckpt / ("deepspeed" if strategy.startswith("zero") else "dcp")).is_dir()

    resumed = _resume(strategy, ckpt, tmp_path, RESUMABLE[strategy])
    assert resumed["losses"] == straight["losses"]  # 4 restored, 4 recomputed: bit-exact
    assert resumed["eval_losses"] == straight["eval_losses"]  # step 4's restored, step 8's evaluated again
    assert resumed["start_step"] == 4 and resumed["resumed_from"] == str(ckpt)
    assert sorted({r["step"] for r in metrics(tmp_path)}) == [5, 6, 7, 8]  # a fresh run dir starts at step 5

    # The save's blocking time is part of the next window's step time, and shown on its own.
    assert straight["checkpoints_saved"] == [4, 8] and straight["checkpoint_blocking_s"] > 0
    after_save = [r for r in metrics(straight_dir) if r["step"] == 5]
    assert len(after_save) == world
    assert all(0 < r["time/checkpoint_s"] <= r["time/step_s"] for r in after_save)


@pytest.mark.parametrize(("strategy", "nproc"), [("single", 0), ("ddp", 2), ("fsdp", 4), ("1f1b", 2)])
def test_fsdp_checkpoint_reshards_into_other_strategies_and_world_sizes(strategy, nproc, straight_run, tmp_path):
    fsdp_dir, fsdp = straight_run("fsdp")
    resumed = _resume(strategy, fsdp_dir / "checkpoints" / STEP4, tmp_path, nproc)
    assert resumed["world_size"] == max(nproc, 1)
    assert resumed["losses"][:4] == fsdp["losses"][:4]
    for step in range(4, 8):  # the same training continues; only the order of float additions differs
        assert rel_diff(resumed["losses"][step], fsdp["losses"][step]) < 1e-5, step


def test_a_dp_checkpoint_resumes_under_single_exactly(straight_run, tmp_path):
    """nn.DataParallel saves the model it wraps, not the wrapper: the keys are the same as everyone's."""
    dp_dir, dp = straight_run("dp")
    assert _resume("single", dp_dir / "checkpoints" / STEP4, tmp_path, 0)["losses"] == dp["losses"]


@pytest.mark.parametrize("strategy", ["single", "fsdp", "zero3", "gpipe"])
def test_export_loads_in_transformers_and_reproduces_the_next_loss(strategy, straight_run, tmp_path):
    """The exported weights are those after step 4: on step 5's batch they give step 5's logged loss."""
    from transformers import AutoModelForCausalLM

    from dist_train.config import DataConfig
    from dist_train.data import GlobalBatches, build_dataset
    from dist_train.model import forward_loss

    run_dir, straight = straight_run(strategy)
    out = tmp_path / "hf"
    proc = forked_python(["launch/export.py", str(run_dir / "checkpoints" / STEP4), str(out)], timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (out / "config.json").is_file() and json.loads((out / "dist_train.json").read_text())["step"] == 4
    model = AutoModelForCausalLM.from_pretrained(out).train()
    t = TrainConfig()
    batch = GlobalBatches(build_dataset(DataConfig(), vocab_size=256, seq_len=t.seq_len, seed=t.seed),
                          global_batch_size=8, dp_rank=0, dp_size=1).local_batch(4)
    with torch.no_grad():
        micro = [forward_loss(model, mb.input_ids, mb.labels) for mb in batch.split(2)]
    loss = float(sum(micro) / len(micro))
    assert rel_diff(loss, straight["losses"][4]) < 1e-5, (loss, straight["losses"][4])
    if strategy == "zero3":  # a ZeRO run trains on in dist_train: its export is a model directory (model=hf)
        from tests.helpers import FAST, train_ok

        on = train_ok(["strategy=single", *FAST, "train.steps=1", "model=hf", f"model.path={out}"],
                      run_dir=tmp_path / "on")
        first = GlobalBatches(build_dataset(DataConfig(), vocab_size=256, seq_len=t.seq_len, seed=t.seed),
                              global_batch_size=8, dp_rank=0, dp_size=1).local_batch(0)
        with torch.no_grad():
            micro = [forward_loss(model, mb.input_ids, mb.labels) for mb in first.split(2)]
        assert rel_diff(on["losses"][0], float(sum(micro) / len(micro))) < 1e-5


def test_interrupted_saves_are_never_resumed_and_are_cleaned_up(straight_run, tmp_path):
    """A `.partial` directory (save in progress when the job died) and a step directory whose COMPLETE
    marker was never written are both ignored by resume=auto; the run resumes from the newest complete one."""
    straight_dir, straight = straight_run("single")
    root = tmp_path / "checkpoints"
    shutil.copytree(straight_dir / "checkpoints" / STEP4, root / STEP4)
    shutil.copytree(straight_dir / "checkpoints" / STEP4, root / (step_dir_name(6) + ".partial"))
    shutil.copytree(straight_dir / "checkpoints" / step_dir_name(8), root / step_dir_name(8))
    (root / step_dir_name(8) / "COMPLETE").unlink()
    proc = forked(["strategy=single", *CHECKPOINTED], run_dir=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"resumed from {root / STEP4}" in proc.stderr
    assert "removing an incomplete checkpoint" in proc.stderr
    resumed = json.loads((tmp_path / "summary.json").read_text())
    assert resumed["losses"] == straight["losses"]
    assert not partial_checkpoints(root)
    assert [s for s, _ in complete_checkpoints(root)] == [4, 8]  # step 8 saved again, this time complete


def test_a_finished_run_relaunched_or_restarted_afresh_in_its_directory_writes_nothing(straight_run, tmp_path):
    """The run directory of a finished run (8 straight steps, checkpoints at 4 and 8), copied: the same command again
    says there is nothing left to train and leaves every file byte for byte, as one process (single) and as two (ddp
    under torchrun): decided in build_session on the resume point the ranks agreed on, before anything is written. checkpoint.resume=none there is refused in one line, since it would save over the earlier
    run's checkpoints; a restart of the launch (TORCHELASTIC_RESTART_COUNT > 0: torchrun's --max-restarts, as Slurm's
    requeue) is not refused: what it saves over is its own launch's. The refusal's exact output is a fresh
    interpreter's; the rest is forked (tests/forkserver.py: its output files are outside the run directory)."""
    for strategy, nproc in (("single", 0), ("ddp", 2)):
        straight_dir, _ = straight_run(strategy)
        run_dir = tmp_path / strategy
        shutil.copytree(straight_dir, run_dir)
        before = _files(run_dir)
        again = forked([f"strategy={strategy}", *CHECKPOINTED], run_dir=run_dir, nproc=nproc)
        assert again.returncode == 0, again.stderr[-3000:]
        said = [ln for ln in again.stderr.splitlines() if "nothing left to train" in ln]
        assert len(said) == 1 and f"{run_dir / 'checkpoints' / step_dir_name(8)} is at step 8" in said[0], again.stderr
        assert _files(run_dir) == before
    fresh = launch(["strategy=single", *CHECKPOINTED, "checkpoint.resume=none"], run_dir=run_dir)
    assert fresh.returncode == 2, fresh.stderr[-3000:]
    assert fresh.stderr.strip().splitlines() == [
        f"config error: checkpoint.resume=none: {run_dir / 'checkpoints'} holds 2 checkpoint(s) of an earlier run "
        f"({STEP4}, {step_dir_name(8)}), which this run would write over; start afresh in a new directory "
        "(hydra.run.dir=..., or checkpoint.dir=...), or resume from them (checkpoint.resume=auto)"]
    assert _files(run_dir) == before
    restart = forked(["strategy=single", *CHECKPOINTED, "checkpoint.resume=none"], run_dir=run_dir,
                     extra_env={"TORCHELASTIC_RESTART_COUNT": "1"})
    assert restart.returncode == 0, restart.stderr[-3000:]
    assert json.loads((run_dir / "summary.json").read_text())["losses"] == \
        pytest.approx(json.loads(before[Path("summary.json")])["losses"], rel=1e-5)  # from step 1, as ddp's were
    assert [s for s, _ in complete_checkpoints(run_dir / "checkpoints")] == [4, 8]


def test_a_finished_run_without_its_summary_says_so(straight_run, tmp_path):
    """A run that stopped after its last checkpoint and before summary.json: relaunched, it still trains and writes
    nothing, and its one line says the summary is missing and how to get one (resuming from step 4 in a new directory
    reproduces steps 5-8 bit for bit: test_resume_reproduces_every_step_bit_for_bit)."""
    straight_dir, _ = straight_run("single")
    run_dir = tmp_path / "lost"
    shutil.copytree(straight_dir, run_dir)
    (run_dir / "summary.json").unlink()
    before = _files(run_dir)
    again = forked(["strategy=single", *CHECKPOINTED], run_dir=run_dir)
    assert again.returncode == 0, again.stderr[-3000:]
    said = [ln for ln in again.stderr.splitlines() if "nothing left to train" in ln]
    assert len(said) == 1, again.stderr
    assert f"; {run_dir} has no summary.json (the run stopped after its last checkpoint, before writing it)" in said[0]
    assert "checkpoint.resume=PATH hydra.run.dir=NEW" in said[0]
    assert _files(run_dir) == before


def _files(run_dir: Path) -> dict[Path, bytes]:
    return {p.relative_to(run_dir): p.read_bytes() for p in sorted(run_dir.rglob("*")) if p.is_file()}
