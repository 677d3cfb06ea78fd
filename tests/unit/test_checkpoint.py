"""Checkpoints, the pure parts: which step directories count as complete, when a save is due, metrics.jsonl across a
resume, the learning-rate schedule and loss scaler round trip, a non-finite loss. Exact resume, resharding, export and
interrupted saves on real runs: tests/launched/test_checkpoint.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dist_train.checkpoint.layout import (
    complete_checkpoints,
    resolve_resume,
    step_dir_name,
)
from dist_train.config import CheckpointConfig, TrainConfig
from dist_train.telemetry.sinks import JsonlSink


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


def test_what_holds_no_checkpoint_says_where_they_are_or_why_none_counts(tmp_path):
    """A run directory named in place of its checkpoints/ gets a 'did you mean'; step directories without their
    marker are named, and resume=auto says at the start that it trains from step 1 (not only when a save later
    sets them aside)."""
    run_dir = tmp_path / "run"
    _fake_checkpoint(run_dir / "checkpoints", 4)
    with pytest.raises(ValueError) as err:
        resolve_resume(str(run_dir), default_root=None)
    assert str(err.value) == (f"checkpoint.resume={run_dir} holds no complete checkpoint (step-NNNNNNNN/COMPLETE); "
                              f"did you mean {run_dir / 'checkpoints'}?")
    unmarked = tmp_path / "unmarked"
    for step in (2, 4):
        _fake_checkpoint(unmarked, step, complete=False)
    with pytest.raises(ValueError, match=r"\(step-00000002, step-00000004 lack their COMPLETE marker\)"):
        resolve_resume(str(unmarked), default_root=None)
    said: list[str] = []
    assert resolve_resume("auto", default_root=unmarked, warn=said.append) is None
    assert said == [f"checkpoint.resume=auto: no complete checkpoint in {unmarked}: step-00000002, step-00000004 "
                    "lack their COMPLETE marker (a save that did not finish, or a marker removed); training starts "
                    "from step 1"]
    assert resolve_resume("auto", default_root=run_dir / "checkpoints", warn=said.append) is not None
    assert len(said) == 1  # nothing said where a checkpoint is found


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


def test_a_finished_run_without_summary_json_is_named_only_for_its_own_directory(tmp_path):
    """session.finished: a run directory whose final checkpoint has no summary.json beside it stopped before writing
    it, and the line says so; a new directory resuming another run's final checkpoint is not such a run."""
    from types import SimpleNamespace

    from dist_train.session import finished

    run_dir = tmp_path / "run"
    ckpt = run_dir / "checkpoints" / "step-00000008"
    ckpt.mkdir(parents=True)
    (ckpt / "COMPLETE").write_text(json.dumps({"step": 8}))
    run = SimpleNamespace(train=SimpleNamespace(steps=8))
    assert f"; {run_dir} has no summary.json" in finished(run, ckpt, run_dir)
    elsewhere = tmp_path / "new"
    elsewhere.mkdir()
    assert finished(run, ckpt, elsewhere).endswith("nothing left to train, and the run's files are left as they "
                                                   "were (raise train.steps to train on)")
    (run_dir / "summary.json").write_text("{}")
    assert "no summary.json" not in finished(run, ckpt, run_dir)
    assert finished(SimpleNamespace(train=SimpleNamespace(steps=9)), ckpt, run_dir) is None
