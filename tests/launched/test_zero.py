"""DeepSpeed ZeRO 1-3: real 2-process runs against one process, DeepSpeed's own launcher, bad input. The derived
DeepSpeed config: tests/unit/test_zero.py.

Model-state bytes a rank holds for fp32 training with Adam on N=2 ranks, Psi = num_params (ZeRO paper,
section 5, with fp32 in place of fp16 parameters and gradients). Stages 1 and 2 keep an fp32 master copy of
their partition even in fp32, so their "optimizer" is Adam's two moments plus that copy = 12 bytes/param; stage
3's master partition is the parameters' own partition in fp32 (strategies/_zero3_setup.py), 8 bytes/param:

            params      grads       optimizer     total
  stage 1   4 Psi       4 Psi       12 Psi / N    14 Psi
  stage 2   4 Psi       4 Psi / N   12 Psi / N    12 Psi
  stage 3   4 Psi / N   4 Psi / N    8 Psi / N     8 Psi
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from typing import Any

import pytest

from tests.helpers import FAST, ROOT, TRAIN, assert_same_losses, env, forked, last_step, summary, train_ok

N_RANKS = 2
MICRO_PER_RANK = 2  # FAST: global batch 8 = 2 ranks x 2 micro-batches x 2 samples


# ------------------------------------------------------------------------------------------------
# Real runs: torchrun --nproc_per_node=2, compared with strategy=single.
# ------------------------------------------------------------------------------------------------


# DeepSpeed's reduction bucket as training sizes it, hidden^2 (4,096 elements for model=tiny; parallel/buckets.py):
# several reductions per micro-batch, and the larger parameters reduced outside the bucket; the same bytes.
# tests/launched/test_dryrun.py compares its dry run with these very runs.
ZERO_BUCKET: dict[int, list[str]] = {1: [], 2: [], 3: []}


def _zero_run(stage: int, fast_run: Any) -> dict[str, Any]:
    """One 2-process run per stage for the whole session (several tests read it)."""
    run_dir, summary = fast_run(f"strategy=zero{stage}", *ZERO_BUCKET[stage], nproc=N_RANKS)
    return {"dir": run_dir, "summary": summary}


# Per step, per rank, from the last (steady-state) step; n = num_params, 4n = one fp32 copy.
#   stage 1: the full gradient all-reduced once at the boundary (+ the 4-byte norm all-reduce),
#            the updated parameters all-gathered once.
#   stage 2: gradients reduced after every micro-batch (DeepSpeed's default multi-rank bucket
#            all-reduce), the updated parameters all-gathered once.
#   stage 3: gradients reduce-scattered after every micro-batch; each micro-batch gathers every
#            parameter once (the tiny model stays well under stage3_max_reuse_distance, so gathered
#            parameters live from forward to backward).
_EXPECTED_COMM = {
    1: {"all_reduce": lambda n: 4 * n + 4, "all_gather": lambda n: 4 * n, "reduce_scatter": lambda n: 0},
    2: {"all_reduce": lambda n: MICRO_PER_RANK * 4 * n + 4, "all_gather": lambda n: 4 * n, "reduce_scatter": lambda n: 0},
    3: {"all_gather": lambda n: MICRO_PER_RANK * 4 * n, "reduce_scatter": lambda n: MICRO_PER_RANK * 4 * n},
}


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_matches_single_with_expected_collectives(single_run, fast_run, stage):
    _, single = single_run
    run = _zero_run(stage, fast_run)
    s = run["summary"]
    assert_same_losses(single, s)
    assert s["world_size"] == N_RANKS and s["accumulation_steps"] == MICRO_PER_RANK
    n = s["num_params"]
    for rec in last_step(run["dir"]):
        for op, expected in _EXPECTED_COMM[stage].items():
            assert rec[f"comm/{op}/bytes"] == expected(n), (op, rec[f"comm/{op}/bytes"], expected(n))
            if expected(n):
                assert rec[f"comm/{op}/count"] >= 1 and rec[f"comm/{op}/time_s"] > 0
        assert rec["grad_norm"] == pytest.approx(last_step(single_run[0])[0]["grad_norm"], rel=1e-4)


def test_model_state_bytes_shrink_by_stage_as_zero_predicts(fast_run):
    runs = {stage: _zero_run(stage, fast_run) for stage in (1, 2, 3)}
    n = runs[1]["summary"]["num_params"]
    psi = 4 * n  # one fp32 copy of the model
    # (params, grads, optimizer) per rank in units of one fp32 copy, N = 2 (see the table above)
    # stage 3's fp32 master partition is the parameters' own (strategies/_zero3_setup.py): no second copy
    expected = {1: (1.0, 1.0, 1.5), 2: (1.0, 0.5, 1.5), 3: (0.5, 0.5, 1.0)}
    totals = {}
    for stage, run in runs.items():
        ranks = last_step(run["dir"])
        assert len(ranks) == N_RANKS
        for rec in ranks:
            got = (rec["memory/params_bytes"], rec["memory/grads_bytes"], rec["memory/optimizer_bytes"])
            p, g, o = expected[stage]
            assert got[0] == pytest.approx(p * psi, rel=1e-3), (stage, "params", got)
            # stage 2 holds whole gradients of the parameters its partition touches: the one that
            # straddles the partition boundary counts in full on both ranks (measured: 0.52 / 0.55)
            assert got[1] == pytest.approx(g * psi, rel=0.12 if stage == 2 else 1e-3), (stage, "grads", got)
            # Adam's moments (8 bytes/param) + the fp32 master copy (4, stages 1 and 2) of this rank's half;
            # the optimizer's step counter adds a few bytes
            assert got[2] == pytest.approx(o * psi, rel=1e-3), (stage, "optimizer", got)
        # what is partitioned adds up to exactly one copy across the ranks
        if stage == 3:
            assert sum(r["memory/params_bytes"] for r in ranks) == psi
        totals[stage] = max(sum(r[k] for k in ("memory/params_bytes", "memory/grads_bytes", "memory/optimizer_bytes")) for r in ranks)
    assert totals[1] > totals[2] > totals[3]
    assert totals[1] == pytest.approx(14 * n, rel=1e-3)
    assert totals[2] == pytest.approx(12 * n, rel=0.03)
    assert totals[3] == pytest.approx(8 * n, rel=1e-3)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_deepspeed_launcher_runs_zero2_like_torchrun(single_run, tmp_path):
    """`deepspeed --num_gpus 2 launch/train.py ...`: --num_gpus because there is no GPU to count. The
    launcher passes `--local_rank=N`, which launch/train.py turns into LOCAL_RANK before Hydra parses."""
    _, single = single_run
    cmd = [
        sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", str(N_RANKS),
        "--master_port", str(_free_port()),  # its default 29500 would collide with a parallel run
        str(TRAIN), "strategy=zero2", *FAST, f"hydra.run.dir={tmp_path}",
    ]
    proc = subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    s = summary(tmp_path)
    assert s["world_size"] == N_RANKS and s["strategy"] == "zero2"
    assert_same_losses(single, s)


# ------------------------------------------------------------------------------------------------
# Bad input: one line, exit code 2, before anything starts.
# ------------------------------------------------------------------------------------------------


def _assert_one_config_error(proc: subprocess.CompletedProcess[str], *needles: str) -> None:
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("config error: "), proc.stderr
    for needle in needles:
        assert needle in lines[0]


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="offload is valid where a GPU is visible")
@pytest.mark.parametrize("name", ["zero2_offload", "zero3_offload"])
def test_offload_without_gpu_is_one_line(name, tmp_path):
    proc = subprocess.run(
        [sys.executable, str(TRAIN), f"strategy={name}", "logger=none", f"hydra.run.dir={tmp_path}"],
        cwd=ROOT, env=env(), capture_output=True, text=True, timeout=120,
    )
    _assert_one_config_error(proc, f"strategy={name}", "no CUDA GPU")
    assert not (tmp_path / "logs").exists()  # nothing started


def test_zero_without_deepspeed_is_one_line(tmp_path):
    # sys.modules[name] = None is how Python marks a module as not importable
    code = (
        "import runpy, sys; sys.modules['deepspeed'] = None; "
        f"sys.argv = [{str(TRAIN)!r}, 'strategy=zero3', 'logger=none', 'hydra.run.dir={tmp_path}']; "
        f"runpy.run_path({str(TRAIN)!r}, run_name='__main__')"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env(), capture_output=True, text=True, timeout=120)
    _assert_one_config_error(proc, "strategy=zero3", "DeepSpeed", "pip install deepspeed")


def test_active_clipping_matches_single(tmp_path):
    """grad_clip=0.1 sits far below the gradient norm (~0.8): clipping acts on every step, so a
    DeepSpeed left at its own default (1.0) would drift from one process from step 2 on."""
    clip = ["train.grad_clip=0.1"]
    single = train_ok(["strategy=single", *FAST, *clip], run_dir=tmp_path / "single")
    extensions = tmp_path / "torch_extensions"  # a fresh build cache, as on a new machine
    zero = train_ok(["strategy=zero3", *FAST, *clip], run_dir=tmp_path / "zero3", nproc=N_RANKS,
                    extra_env={"TORCH_EXTENSIONS_DIR": str(extensions)})
    assert min(single["losses"]) < single["losses"][0]  # it still trains
    assert_same_losses(single, zero)
    # DeepSpeed's inference-only shared-memory all-reduce was not compiled (45 s of g++ on 2 cores)
    assert not list(extensions.glob("*shm*")), list(extensions.iterdir())


def test_zero3_setup_fixes_keep_one_partition_gather_nothing_and_train_the_same(tmp_path):
    """strategies/_zero3_setup.py: in fp32 the master partition is the parameters' own storage, making the gradient
    hooks gathers nothing, and the engine trains exactly as DeepSpeed's unpatched one; bf16 keeps its fp32 copy."""
    script = ROOT / "tests" / "scripts" / "zero3_setup_fixes.py"
    proc = forked([], run_dir=tmp_path, nproc=N_RANKS, script=script, timeout=300)  # its JSON line is what is read
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    out = json.loads([line for line in proc.stdout.splitlines() if line.startswith("{")][-1])
    for precision in ("fp32", "bf16"):
        plain, fixed = out[precision]["plain"], out[precision]["fixed"]
        assert fixed["applied"] == ["_create_fp32_partitions", "create_reduce_and_remove_grad_hooks"]
        assert fixed["gathers_in_steps"] > 0  # the counter sees DeepSpeed's all-gathers
        assert fixed["gathers_at_setup"] == 0, fixed
        assert fixed["losses"] == plain["losses"] and out[precision]["max_param_diff"] == 0.0, out[precision]
    assert all(out["fp32"]["fixed"]["master_shares_params"])
    assert not any(out["bf16"]["fixed"]["master_shares_params"])  # bf16 parameters: the fp32 master stays a copy


def test_zero3_prefetch_fills_the_live_limit_as_predicted(fast_run):
    """With no reuse and a live limit of 50,000 elements (a fifth of model=tiny), DeepSpeed's prefetch keeps the
    gathered set at the limit and goes over it by at most one module (each module's entry prefetches at least one
    parameter while fewer than the limit are gathered): the estimator's gathered_params is that bound, and the
    run's peak of gathered parameters (its coordinator's count, memory/gathered_params_bytes) lies within one
    module of it, on every rank. The estimator used to take the prefetch bucket for the limit: 81,304 B here."""
    limit = "+strategy.extra.zero_optimization.stage3_max_live_parameters=50000"
    no_reuse = "+strategy.extra.zero_optimization.stage3_max_reuse_distance=0"
    run_dir, out = fast_run("strategy=zero3", limit, no_reuse, nproc=N_RANKS)
    predicted = out["predicted_memory_bytes"]["gathered_params"]
    largest_module = 4 * 16_640  # c_fc with its bias, fp32 (tests/unit/test_estimate.py)
    assert predicted == 4 * 50_000 + largest_module
    for rec in last_step(run_dir):
        gathered = rec["memory/gathered_params_bytes"]
        assert predicted - largest_module <= gathered <= predicted, (gathered, predicted)
    # and the peak of all live tensors (estimate/memory.py predict_peak_live: the categories, these gathered
    # parameters among them, plus the loss's backward and the reduction bucket) within 5% on every rank
    peak = out["predicted_memory_bytes"]["peak_live"]
    for rank in out["ranks"]:
        assert abs(rank["memory/peak_live_bytes"] - peak) <= 0.05 * peak, (rank["memory/peak_live_bytes"], peak)
