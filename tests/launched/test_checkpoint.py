"""Checkpoints: exact resume for every strategy, resharding on load, export, atomic saves, and the pure parts.

Each strategy trains 8 steps straight, saving after steps 4 and 8 (the `straight_run` fixture); a second
launch resumes from the step-4 checkpoint and must reproduce steps 5-8 bit for bit (fp32, CPU).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dist_train.checkpoint.layout import (
    complete_checkpoints,
    partial_checkpoints,
    resolve_resume,
    step_dir_name,
)
from dist_train.config import CheckpointConfig, TrainConfig
from dist_train.telemetry.sinks import JsonlSink
from tests.conftest import CHECKPOINTED, EVALUATED, RESUMABLE
from tests.helpers import FAST, ROOT, env, launch, metrics, rel_diff, train_ok

STEP4 = step_dir_name(4)


def _resume(strategy: str, checkpoint: Path, run_dir: Path, nproc: int, *extra: str) -> dict:
    return train_ok([f"strategy={strategy}", "logger=none", *FAST, "train.steps=8", *EVALUATED,
                     f"checkpoint.resume={checkpoint}", *extra], run_dir=run_dir, nproc=nproc)


# zero1 saves and loads through the same DeepSpeed optimizer class as zero2, 1f1b through the same stage
# checkpoints as gpipe (its resume is exercised by the reshard test below): their straight runs stay (the
# prediction tests read them), their resumed twins are left out for the suite's time. ddp, fsdp and zero2 resume
# bit-exact from step 4 in tests/test_checkpoint_damage.py, past a damaged step-8 checkpoint.
BIT_EXACT = [s for s in RESUMABLE if s not in ("zero1", "1f1b", "ddp", "fsdp", "zero2")]


@pytest.mark.multiproc
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


@pytest.mark.multiproc
@pytest.mark.parametrize(("strategy", "nproc"), [("single", 0), ("ddp", 2), ("fsdp", 4), ("1f1b", 2)])
def test_fsdp_checkpoint_reshards_into_other_strategies_and_world_sizes(strategy, nproc, straight_run, tmp_path):
    fsdp_dir, fsdp = straight_run("fsdp")
    resumed = _resume(strategy, fsdp_dir / "checkpoints" / STEP4, tmp_path, nproc)
    assert resumed["world_size"] == max(nproc, 1)
    assert resumed["losses"][:4] == fsdp["losses"][:4]
    for step in range(4, 8):  # the same training continues; only the order of float additions differs
        assert rel_diff(resumed["losses"][step], fsdp["losses"][step]) < 1e-5, step


@pytest.mark.multiproc
def test_a_dp_checkpoint_resumes_under_single_exactly(straight_run, tmp_path):
    """nn.DataParallel saves the model it wraps, not the wrapper: the keys are the same as everyone's."""
    dp_dir, dp = straight_run("dp")
    assert _resume("single", dp_dir / "checkpoints" / STEP4, tmp_path, 0)["losses"] == dp["losses"]


@pytest.mark.multiproc
@pytest.mark.parametrize("strategy", ["single", "fsdp", "zero3", "gpipe"])
def test_export_loads_in_transformers_and_reproduces_the_next_loss(strategy, straight_run, tmp_path):
    """The exported weights are those after step 4: on step 5's batch they give step 5's logged loss."""
    from transformers import AutoModelForCausalLM

    from dist_train.config import DataConfig
    from dist_train.data import GlobalBatches, build_dataset
    from dist_train.model import forward_loss

    run_dir, straight = straight_run(strategy)
    out = tmp_path / "hf"
    proc = subprocess.run([sys.executable, "launch/export.py", str(run_dir / "checkpoints" / STEP4), str(out)],
                          cwd=ROOT, env=env(), capture_output=True, text=True, timeout=300)
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

        on = train_ok(["strategy=single", "logger=none", *FAST, "train.steps=1", "model=hf", f"model.path={out}"],
                      run_dir=tmp_path / "on")
        first = GlobalBatches(build_dataset(DataConfig(), vocab_size=256, seq_len=t.seq_len, seed=t.seed),
                              global_batch_size=8, dp_rank=0, dp_size=1).local_batch(0)
        with torch.no_grad():
            micro = [forward_loss(model, mb.input_ids, mb.labels) for mb in first.split(2)]
        assert rel_diff(on["losses"][0], float(sum(micro) / len(micro))) < 1e-5


@pytest.mark.multiproc
def test_interrupted_saves_are_never_resumed_and_are_cleaned_up(straight_run, tmp_path):
    """A `.partial` directory (save in progress when the job died) and a step directory whose COMPLETE
    marker was never written are both ignored by resume=auto; the run resumes from the newest complete one."""
    straight_dir, straight = straight_run("single")
    root = tmp_path / "checkpoints"
    shutil.copytree(straight_dir / "checkpoints" / STEP4, root / STEP4)
    shutil.copytree(straight_dir / "checkpoints" / STEP4, root / (step_dir_name(6) + ".partial"))
    shutil.copytree(straight_dir / "checkpoints" / step_dir_name(8), root / step_dir_name(8))
    (root / step_dir_name(8) / "COMPLETE").unlink()
    proc = launch(["strategy=single", *CHECKPOINTED], run_dir=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"resumed from {root / STEP4}" in proc.stderr
    assert "removing an incomplete checkpoint" in proc.stderr
    resumed = json.loads((tmp_path / "summary.json").read_text())
    assert resumed["losses"] == straight["losses"]
    assert not partial_checkpoints(root)
    assert [s for s, _ in complete_checkpoints(root)] == [4, 8]  # step 8 saved again, this time complete


# -------------------------------------------------------------------- pure parts
def _fake_checkpoint(root: Path, step: int, *, complete: bool = True) -> Path:
    path = root / step_dir_name(step)
    path.mkdir(parents=True)
    if complete:
        (path / "COMPLETE").write_text("{}")
    return path


def test_layout_counts_only_complete_checkpoints(tmp_path):
    _fake_checkpoint(tmp_path, 2)
    newest = _fake_checkpoint(tmp_path, 10)
    _fake_checkpoint(tmp_path, 12, complete=False)  # renamed, marker not yet written
    (tmp_path / (step_dir_name(14) + ".partial")).mkdir()
    (tmp_path / "step-abc").mkdir()
    assert [s for s, _ in complete_checkpoints(tmp_path)] == [2, 10]
    assert resolve_resume("auto", default_root=tmp_path) == newest
    assert resolve_resume(str(tmp_path), default_root=None) == newest.resolve()
    assert resolve_resume("none", default_root=tmp_path) is None
    assert resolve_resume("auto", default_root=tmp_path / "missing") is None
    with pytest.raises(ValueError, match="is incomplete"):
        resolve_resume(str(tmp_path / step_dir_name(12)), default_root=None)
    with pytest.raises(ValueError, match="holds no complete checkpoint"):
        resolve_resume(str(tmp_path / "step-abc"), default_root=None)


def test_checkpoint_due_every_n_steps_and_at_the_end(tmp_path):
    from dist_train.checkpoint.manager import Checkpointer

    ckpt = Checkpointer(CheckpointConfig(every_steps=4), tmp_path, runtime=None, io=None, total_steps=10)
    assert [s for s in range(1, 11) if ckpt.due(s)] == [4, 8, 10]
    never = Checkpointer(CheckpointConfig(every_steps=0), tmp_path, runtime=None, io=None, total_steps=10)
    assert not any(never.due(s) for s in range(1, 11))


def test_metrics_jsonl_keeps_the_steps_before_a_resume_once(tmp_path):
    path = tmp_path / "metrics.jsonl"
    rows = [{"step": s, "rank": r, "loss": float(s)} for s in range(1, 7) for r in (1, 0)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 7, "ra')  # cut short by a crash
    sink = JsonlSink(path, keep_through_step=4)
    sink.log(5, [{"step": 5, "rank": 0}, {"step": 5, "rank": 1}])
    sink.finish({})
    steps = [json.loads(line)["step"] for line in path.read_text().splitlines()]
    assert steps == [1, 1, 2, 2, 3, 3, 4, 4, 5, 5]
    assert [[r["rank"] for r in window] for window in sink.kept] == [[0, 1]] * 4
    JsonlSink(path).finish({})  # a fresh start begins an empty file
    assert path.read_text() == ""


def test_lr_schedule_position_and_loss_scaler_round_trip():
    from dist_train.config import OptimizerConfig, PrecisionConfig
    from dist_train.optim import OptimizerFactory
    from dist_train.contracts import Runtime
    from dist_train.strategies.base import LocalOptimizer, StrategyContext

    t = TrainConfig(steps=10, lr_schedule="cosine", lr_warmup_steps=2)
    runtime = Runtime(0, 0, 1, 1, torch.device("cpu"), None)
    ctx = StrategyContext(runtime=runtime, train=t, precision=PrecisionConfig("fp16"),
                          optimizer=OptimizerFactory(OptimizerConfig(), t))
    a = LocalOptimizer(ctx, [torch.nn.Parameter(torch.ones(3))])
    for step in range(5):
        a.zero_grad()
        a.backward((a.params[0] * (float("inf") if step == 2 else 1.0)).sum())  # step 3 overflows: scale halves
        a.step()
    b = LocalOptimizer(ctx, [torch.nn.Parameter(torch.ones(3))])
    b.load_extra_state(json.loads(json.dumps(a.extra_state())))  # plain values only: JSON survives
    assert b.lr == a.lr and b.scheduler.last_epoch == 5
    assert b.scaler.get_scale() == a.scaler.get_scale() == 2.0**15


def test_non_finite_loss_stops_and_fp16_skips_are_counted():
    from types import SimpleNamespace

    from dist_train.telemetry.recorder import NonFiniteLoss, Telemetry, Workload

    def telemetry(skips_allowed: bool) -> Telemetry:
        runtime = SimpleNamespace(rank=0, is_main=True, has_group=False, device=torch.device("cpu"))
        return Telemetry(runtime=runtime, strategy=None, sink=None, skips_allowed=skips_allowed,
                         workload=Workload(tokens_per_step=1, samples_per_step=1, flops_per_token=1.0,
                                           peak_flops=None, num_devices=1))

    def record(losses, norms):
        return {"rank": 0, "time/step_s": 1.0, "_losses": [(v, 1) for v in losses], "_grad_norms": norms}

    fp16 = telemetry(skips_allowed=True)
    records, losses, norms = fp16._add_global([record([2.0, 2.0, 2.0], [1.0, float("inf"), float("nan")])])
    assert records[0]["train/skipped_steps"] == 2 and fp16.skipped_steps == 2
    assert fp16._first_non_finite(losses, norms, first_step=5) is None  # skipped, not fatal
    fp32 = telemetry(skips_allowed=False)
    _, losses, norms = fp32._add_global([record([2.0, 2.0], [1.0, float("inf")])])
    assert fp32._first_non_finite(losses, norms, first_step=5).step == 6
    _, losses, norms = fp32._add_global([record([2.0, float("nan")], [1.0, 1.0])])
    error = fp32._first_non_finite(losses, norms, first_step=1)
    assert isinstance(error, NonFiniteLoss) and "step 2: the loss is nan" in str(error)
