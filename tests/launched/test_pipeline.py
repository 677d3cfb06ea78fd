"""Pipeline parallelism (gpipe / 1f1b / pp_dp) launched: bad input on the command line, and real 2- and 4-process
runs compared with one process (losses, grad norm, per-stage memory, send/recv, bubble). The stage split and the
stages in one process: tests/unit/test_pipeline.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from dist_train.checkpoint.layout import step_dir_name
from tests.conftest import CHECKPOINTED
from tests.helpers import (FAST, assert_same_losses, compare_from, last_step, launch, metrics, rel_diff, summary,
                           train_ok)
from tests.pipeline_support import BLOCK, EMBED, HEAD

TINY_LLAMA = [
    "model=llama_1b", "model.num_layers=2", "model.hidden_size=64", "model.num_heads=4", "model.num_kv_heads=2",
    "model.ffn_hidden_size=128", "model.vocab_size=256", "model.max_seq_len=128",
]

ACTIVATION_BYTES = 2 * 64 * 64 * 4  # one micro-batch of 2 x seq 64 x hidden 64, fp32


# --------------------------------------------------------------------------------------------------
# Bad input: one line naming the key, before any process group.
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "nproc", "needle"),
    [
        (["strategy=gpipe", "model.num_layers=1"], 0, "config error: model.num_layers=1"),
        (["strategy=1f1b", "strategy.num_microbatches=3"], 2, "config error: strategy.num_microbatches=3"),
    ],
)
def test_cli_bad_pipeline_input(tmp_path, overrides, nproc, needle):
    # nproc=0 runs plain python as if torchrun had set WORLD_SIZE=2: our exit code is visible (torchrun's is 1).
    extra = {"WORLD_SIZE": "2"} if nproc == 0 else None
    proc = launch([*overrides, "logger=none"], run_dir=tmp_path / "run", nproc=nproc, timeout=120, extra_env=extra)
    ours = [line for line in proc.stderr.splitlines() if line.startswith("config error:")]
    assert len(ours) == 1 and needle in ours[0], proc.stderr[-3000:]
    frames = [line for line in proc.stderr.splitlines() if line.strip().startswith('File "')]
    assert not [f for f in frames if "dist_train" in f or "launch/train.py" in f], proc.stderr[-3000:]
    if nproc == 0:
        assert proc.returncode == 2 and "Traceback" not in proc.stderr
    else:
        assert proc.returncode != 0  # torchrun reports the children's exit code 2 as its own failure
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


# --------------------------------------------------------------------------------------------------
# Real 2-process runs.
# --------------------------------------------------------------------------------------------------


def _last_records(run_dir: Path) -> list[dict[str, Any]]:
    rows = metrics(run_dir)
    last = max(r["step"] for r in rows)
    return sorted((r for r in rows if r["step"] == last), key=lambda r: r["rank"])


def _assert_same_as_single(single: tuple[Path, dict], run: tuple[Path, dict]) -> None:
    """Every step's loss and grad norm within rel 1e-5 of one process, and the same final loss."""
    (single_dir, s), (run_dir, p) = single, run
    assert len(p["losses"]) == len(s["losses"]) == 5
    for step, (a, b) in enumerate(zip(p["losses"], s["losses"]), start=1):
        assert rel_diff(a, b) < 1e-5, f"step {step}: loss {a} vs single {b}"
    assert rel_diff(p["final_loss"], s["final_loss"]) < 1e-5
    single_norms = {r["step"]: r["grad_norm"] for r in metrics(single_dir)}
    for r in metrics(run_dir):  # the global norm (all stages), identical on every rank
        assert rel_diff(r["grad_norm"], single_norms[r["step"]]) < 1e-5, f"step {r['step']} rank {r['rank']}"


def _assert_pipeline_telemetry(ranks: list[dict[str, Any]], *, micro: int, send_bytes: int) -> None:
    assert [r["pipeline/stage"] for r in ranks] == [0, 1]
    for r in ranks:
        assert r["pipeline/num_microbatches"] == micro
        # Stage 0 sends activations and receives their gradients; stage 1 the other way round.
        assert r["comm/send/bytes"] == r["comm/recv/bytes"] == send_bytes
        assert r["comm/send/count"] == r["comm/recv/count"] == micro
        assert r["comm/send/time_s"] > 0 and r["comm/recv/time_s"] > 0
        assert r["pipeline/bubble_fraction_formula"] == pytest.approx(1 / (micro + 1))
        assert 0 < r["pipeline/bubble_fraction"] < 1
        assert r["pipeline/busy_s"] < r["pipeline/schedule_s"]
        assert r["memory/activations_bytes"] > 0


# FAST's global batch of 8 in micro-batches of 2, over one data-parallel replica: 4 micro-batches a step, the
# pipelines' default (strategy.num_microbatches=null). The 1F1B run is also the one tests/launched/test_dryrun.py reads.
@pytest.fixture(scope="module")
def gpipe_run(fast_run: Any) -> tuple[Path, dict[str, Any]]:
    return fast_run("strategy=gpipe", nproc=2)


@pytest.fixture(scope="module")
def onef1b_run(fast_run: Any) -> tuple[Path, dict[str, Any]]:
    return fast_run("strategy=1f1b", nproc=2)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_schedule_matches_single_and_reports_every_stage(single_run, gpipe_run, onef1b_run, schedule):
    run_dir, s = gpipe_run if schedule == "gpipe" else onef1b_run
    _assert_same_as_single(single_run, (run_dir, s))
    assert s["strategy"] == schedule and s["data_parallel_size"] == 1
    n = s["num_params"]
    ranks = _last_records(run_dir)
    # The balanced split of model=tiny: embeddings + blocks 0-1 | blocks 2-3 + final norm + head.
    assert [r["memory/params_bytes"] for r in ranks] == [4 * (EMBED + 2 * BLOCK), 4 * (2 * BLOCK + HEAD)]
    assert sum(r["memory/params_bytes"] for r in ranks) == 4 * n
    assert [r["memory/grads_bytes"] for r in ranks] == [r["memory/params_bytes"] for r in ranks]
    for r in ranks:
        assert r["memory/optimizer_bytes"] >= 2 * r["memory/params_bytes"]  # Adam's two moments of its stage
        assert r["comm/all_reduce/bytes"] == 4  # the squared gradient norm, summed over stages
    _assert_pipeline_telemetry(ranks, micro=4, send_bytes=4 * ACTIVATION_BYTES)
    # summary.json carries memory and send/recv for both stages too.
    assert [r["memory/params_bytes"] for r in s["ranks"]] == [r["memory/params_bytes"] for r in ranks]
    assert all(r["comm/send/bytes"] > 0 and r["comm/recv/bytes"] > 0 for r in s["ranks"])


def test_1f1b_holds_fewer_activations_than_gpipe(gpipe_run, onef1b_run):
    gpipe, onef1b = _last_records(gpipe_run[0]), _last_records(onef1b_run[0])
    # M=4, K=2: GPipe keeps all 4 micro-batches on both stages; 1F1B at most 2 on stage 0 and 1 on stage 1.
    assert gpipe[0]["memory/activations_bytes"] == pytest.approx(2 * onef1b[0]["memory/activations_bytes"], rel=0.05)
    assert gpipe[1]["memory/activations_bytes"] == pytest.approx(4 * onef1b[1]["memory/activations_bytes"], rel=0.05)
    assert onef1b[0]["memory/activations_bytes"] > onef1b[1]["memory/activations_bytes"]  # the first stage holds most


TIED = ["model.tie_embeddings=true", *FAST]


@pytest.fixture(scope="module")
def tied_single(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """One process with tied input/output embeddings, the baseline of the tied pipelines."""
    run_dir = tmp_path_factory.mktemp("tied-single")
    return run_dir, train_ok(["strategy=single", *TIED], run_dir=run_dir)


def test_tied_embeddings_stay_tied_across_stages(tied_single, tmp_path):
    # Explicit split points too: one block on stage 0, three on stage 1.
    overrides = ["strategy=gpipe", "strategy.split_points=[1]", *TIED]
    proc = launch(overrides, run_dir=tmp_path / "pp", nproc=2)
    # The stages call transformers' current API (a renamed argument warned on every rank, issue 39).
    assert proc.returncode == 0 and "FutureWarning" not in proc.stderr, proc.stderr[-4000:]
    run = (tmp_path / "pp", summary(tmp_path / "pp"))
    _assert_same_as_single(tied_single, run)
    ranks = _last_records(run[0])
    assert [r["pipeline/num_blocks"] for r in ranks] == [1, 3]
    # Each end holds its own copy of the shared 256 x 64 matrix: one copy more than the model has.
    assert sum(r["memory/params_bytes"] for r in ranks) == 4 * (run[1]["num_params"] + 256 * 64)
    for r in ranks:  # the norm, plus the tied gradient summed between the first and the last stage
        assert r["comm/all_reduce/bytes"] == 4 + 4 * 256 * 64
    _assert_pipeline_telemetry(ranks, micro=4, send_bytes=4 * ACTIVATION_BYTES)


def test_llama_1f1b_with_more_microbatches_matches_single(tmp_path):
    common = [*TINY_LLAMA, *FAST]
    single = (tmp_path / "single", train_ok(["strategy=single", *common], run_dir=tmp_path / "single"))
    # 8 micro-batches of 1 (train.micro_batch_size=2 is overridden); single runs 4 of 2: same mean loss.
    overrides = ["strategy=1f1b", "strategy.num_microbatches=8", *common]
    run = (tmp_path / "pp", train_ok(overrides, run_dir=tmp_path / "pp", nproc=2))
    _assert_same_as_single(single, run)
    ranks = _last_records(run[0])
    assert sum(r["memory/params_bytes"] for r in ranks) == 4 * run[1]["num_params"]
    assert [r["pipeline/micro_batch_size"] for r in ranks] == [1, 1]
    _assert_pipeline_telemetry(ranks, micro=8, send_bytes=8 * (1 * 64 * 64 * 4))


# --------------------------------------------------------------------------------------------------
# pp_dp: 2 stages x 2 replicas on 4 processes (rank = stage * 2 + replica).
# --------------------------------------------------------------------------------------------------
STAGE_PARAMS = {0: EMBED + 2 * BLOCK, 1: 2 * BLOCK + HEAD}  # model=tiny split 2 + 2 blocks


def test_pp_dp_replicated_stages_match_single_with_tied_embeddings(tied_single, tmp_path):
    """Each stage whole on both replicas (DDP): one all-reduce of its gradients over them per step, the tied
    embedding/head gradient summed within each replica, the same losses as one process."""
    run = (tmp_path / "pp_dp", train_ok(["strategy=pp_dp", *TIED], run_dir=tmp_path / "pp_dp", nproc=4))
    _assert_same_as_single(tied_single, run)
    assert run[1]["data_parallel_size"] == 2
    for r in _last_records(run[0]):
        own = STAGE_PARAMS[r["rank"] // 2]
        assert r["pipeline/num_replicas"] == 2 and r["pipeline/stage"] == r["rank"] // 2
        assert r["memory/params_bytes"] == 4 * own
        assert r["comm/dp_replicate/all_reduce/bytes"] == 4 * own
        # the norm over the pipeline's stages, and the tied gradient between its first and last stage (with
        # 2 stages, that pair is the pipeline's group too)
        assert r["comm/pp/all_reduce/bytes"] == 4 + 4 * 256 * 64
        assert r["comm/all_reduce/bytes"] == 4 * own + 4 + 4 * 256 * 64
        assert r["comm/pp/send/bytes"] == r["comm/pp/recv/bytes"] == 2 * ACTIVATION_BYTES
    for r in run[1]["ranks"]:  # summary.json's: the peak of live tensors over a step
        own = STAGE_PARAMS[r["rank"] // 2]
        # DDP per stage: at the peak the stage's weights once (torch's FSDP-based replicate held an unsharded copy
        # beside them), and its gradients once, the buckets the micro-batches accumulate into
        assert r["memory/peak_live/params_bytes"] == r["memory/peak_live/grads_bytes"] == 4 * own, r


def test_pp_dp_fsdp_stages_match_single_predicted_and_resume_under_one_process(straight_run, tmp_path):
    """FSDP2 inside each stage, 1F1B: half a stage per rank, the traffic the estimator predicts by mesh
    dimension, and a checkpoint one process resumes from."""
    single_dir, single = straight_run("single")
    run_dir = tmp_path / "pp_dp"
    s = train_ok(["strategy=pp_dp", "strategy.dp_mode=fsdp", "strategy.schedule=1f1b", *CHECKPOINTED],
                 run_dir=run_dir, nproc=4)
    assert_same_losses(single, s, steps=8)
    for r in last_step(run_dir):
        own = STAGE_PARAMS[r["rank"] // 2]
        assert r["memory/params_bytes"] == pytest.approx(4 * own / 2, rel=0.01)
        assert r["comm/dp_shard/reduce_scatter/bytes"] == 4 * own
        # 2 micro-batches: each block gathered for both forwards and once at the first backward, the root once
        assert r["comm/dp_shard/all_gather/bytes"] == 4 * (3 * 2 * BLOCK + own - 2 * BLOCK)
        assert r["comm/pp/send/bytes"] == r["comm/pp/recv/bytes"] == 2 * ACTIVATION_BYTES
    rows = compare_from(tmp_path / "compare", single_dir, run_dir)
    assert rows["pp_dp"]["prediction_ok"] is True, rows["pp_dp"]
    assert rows["pp_dp"]["agrees"] is True, rows["pp_dp"]["verdict"]
    step4 = run_dir / "checkpoints" / step_dir_name(4)
    alone = train_ok(["strategy=single", *FAST, "train.steps=8", f"checkpoint.resume={step4}"],
                     run_dir=tmp_path / "alone")
    for step in range(4, 8):
        assert rel_diff(alone["losses"][step], s["losses"][step]) < 1e-6, step
