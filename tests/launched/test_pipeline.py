"""Pipeline parallelism (gpipe / 1f1b / pp_dp): the stage split, the stages themselves, bad input, and real
2- and 4-process runs compared with one process (losses, grad norm, per-stage memory, send/recv, bubble)."""

from __future__ import annotations

import itertools
import random
from pathlib import Path
from typing import Any

import pytest
import torch

from dist_train.checks import validate
from dist_train.config import ConfigError, ModelConfig, RunConfig, TrainConfig
from dist_train.strategies.pipeline import PipelineConfig
from dist_train.model import build_model
from dist_train.strategies.pipeline import bubble_formula
from dist_train.strategies.pipeline_stages import build_stage, is_tied, param_counts, split_layers, stage_ranges
from dist_train.checkpoint.layout import step_dir_name
from tests.conftest import CHECKPOINTED
from tests.helpers import (FAST, assert_same_losses, compare_from, last_step, launch, metrics, rel_diff, summary,
                           train_ok)

TINY_LLAMA = [
    "model=llama_1b", "model.num_layers=2", "model.hidden_size=64", "model.num_heads=4", "model.num_kv_heads=2",
    "model.ffn_hidden_size=128", "model.vocab_size=256", "model.max_seq_len=128",
]

# Parameters of model=tiny (GPT-2, hidden 64, 4 blocks, vocab 256, 128 positions), counted by hand.
EMBED = 256 * 64 + 128 * 64  # wte + wpe
BLOCK = 2 * 64 * 2 + (64 * 192 + 192) + (64 * 64 + 64) + (64 * 256 + 256) + (256 * 64 + 64)  # 2 LNs, attn, mlp
HEAD = 2 * 64 + 256 * 64  # ln_f + lm_head
ACTIVATION_BYTES = 2 * 64 * 64 * 4  # one micro-batch of 2 x seq 64 x hidden 64, fp32


# --------------------------------------------------------------------------------------------------
# The split (pure).
# --------------------------------------------------------------------------------------------------


def _max_load(counts: list[int], bounds: list[int], first: int, last: int) -> int:
    ranges = stage_ranges(bounds, num_layers=len(counts))
    loads = [sum(counts[a:b]) for a, b in ranges]
    loads[0] += first
    loads[-1] += last
    return max(loads)


def test_split_balances_blocks_and_counts_embeddings_and_head():
    assert split_layers([10] * 4, num_stages=2) == [2]
    assert split_layers([10] * 4, num_stages=4) == [1, 2, 3]
    # Heavy embeddings push blocks to the later stages, a heavy head to the earlier ones.
    assert split_layers([10] * 6, num_stages=2, first_extra=40) == [1]
    assert split_layers([10] * 6, num_stages=2, last_extra=40) == [5]
    # model=tiny: 24,576 + 2 blocks | 2 blocks + 16,512 beats any other cut.
    assert split_layers([BLOCK] * 4, num_stages=2, first_extra=EMBED, last_extra=HEAD) == [2]
    assert stage_ranges([1, 3], num_layers=5) == [(0, 1), (1, 3), (3, 5)]


def test_split_is_optimal_against_brute_force():
    rng = random.Random(0)
    for _ in range(200):
        n, k = rng.randint(1, 7), rng.randint(1, 4)
        if n < k:
            continue
        counts = [rng.randint(1, 100) for _ in range(n)]
        first, last = rng.randint(0, 150), rng.randint(0, 150)
        got = split_layers(counts, num_stages=k, first_extra=first, last_extra=last)
        assert len(got) == k - 1 and all(a < b for a, b in zip([0, *got], [*got, n]))
        best = min(_max_load(counts, list(c), first, last) for c in itertools.combinations(range(1, n), k - 1))
        assert _max_load(counts, got, first, last) == best


def test_split_refuses_more_stages_than_blocks():
    with pytest.raises(ValueError, match="3 blocks into 4 stages"):
        split_layers([1, 2, 3], num_stages=4)


def test_bubble_formula():
    assert bubble_formula(num_stages=2, num_microbatches=4) == pytest.approx(1 / 5)
    assert bubble_formula(num_stages=4, num_microbatches=8) == pytest.approx(3 / 11)


# --------------------------------------------------------------------------------------------------
# Stages (one process): chained stages compute exactly what the full model computes.
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "cfg",
    [
        ModelConfig(tie_embeddings=True),
        ModelConfig(arch="llama", num_layers=3, num_kv_heads=2, ffn_hidden_size=128),
    ],
    ids=["gpt2-tied", "llama"],
)
def test_chained_stages_equal_the_full_model(cfg):
    full = build_model(cfg, seed=7)
    first, blocks, last = param_counts(full)
    bounds = split_layers(blocks, num_stages=3, first_extra=first, last_extra=last)
    ids = torch.randint(cfg.vocab_size, (2, 16))
    expected = full(input_ids=ids).logits
    stages = [build_stage(build_model(cfg, seed=7), bounds=bounds, stage_index=s) for s in range(3)]
    x = ids
    for stage in stages:
        x = stage(x)
    assert torch.equal(x, expected)
    # Pruned in place: each stage keeps only its parameters, under the full model's names.
    names = [{n for n, _ in s.model.named_parameters()} for s in stages]
    assert set().union(*names) <= {n for n, _ in full.named_parameters(remove_duplicate=False)}
    assert not names[0] & names[1] and not names[1] & names[2]
    assert is_tied(full) == cfg.tie_embeddings


# Sliding windows shorter than the sequence and alternating layer types, so a stage that indexed its layers' types
# or masks from 0 would show; Gemma scales its embeddings, Qwen3 normalises q and k, Qwen2 has q/k/v biases.
OTHER_ARCHS = {
    "mistral": dict(sliding_window=5),
    "qwen2": dict(use_sliding_window=True, sliding_window=5, max_window_layers=1),
    "qwen3": dict(layer_types=["full_attention", "sliding_attention", "full_attention", "sliding_attention"],
                  use_sliding_window=True, sliding_window=5, head_dim=16),
    "gemma": dict(head_dim=16),
    # no pipeline plan in transformers: plain decoder stacks, cut by their structure (dist_train.model._stack_layout);
    # Falcon with one key/value head (multi-query) and its parallel attention and MLP
    "stablelm": dict(num_key_value_heads=4),
    "falcon": dict(num_kv_heads=1),
}


@pytest.mark.parametrize("arch", list(OTHER_ARCHS))
def test_stages_of_any_model_with_a_pipeline_plan_equal_the_full_model(arch):
    """The model's own forward, cut by transformers' base_model_pp_plan (or, without one, by its decoder stack): the
    same logits bit for bit and the same gradients for every parameter, through 3 stages of 4 blocks (placeholder
    and hook included)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(arch, **{**dict(vocab_size=128, hidden_size=64, intermediate_size=128,
                                               num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                                               max_position_embeddings=64, tie_word_embeddings=False),
                                        **OTHER_ARCHS[arch]})  # tied: the gpt2-tied case above

    def build() -> torch.nn.Module:
        torch.manual_seed(7)
        return AutoModelForCausalLM.from_config(cfg)

    full = build()
    ids = torch.randint(128, (2, 16))
    full(input_ids=ids).logits.sum().backward()
    stages = [build_stage(build(), bounds=[1, 3], stage_index=s) for s in range(3)]
    x = ids
    for stage in stages:
        x = stage(x)
    assert torch.allclose(x, full(input_ids=ids).logits, rtol=0, atol=1e-6)
    x.sum().backward()
    grads = {n: p.grad for s in stages for n, p in s.model.named_parameters()}
    assert set(grads) == {n for n, _ in full.named_parameters()}  # every parameter on exactly one stage
    for name, p in full.named_parameters():
        assert torch.allclose(grads[name], p.grad, rtol=1e-5, atol=1e-6), name


def test_a_model_without_a_pipeline_plan_is_refused_saying_why():
    from transformers import AutoConfig

    from dist_train.model import layout_of

    with pytest.raises(ValueError, match="model.arch=opt has no pipeline plan"):
        layout_of(AutoConfig.for_model("opt"))


# --------------------------------------------------------------------------------------------------
# Bad input: one line naming the key, before any process group.
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("strategy", "model", "train", "precision", "world", "needle"),
    [
        (PipelineConfig(), ModelConfig(num_layers=1), None, "fp32", 2, "model.num_layers=1"),
        (PipelineConfig(num_microbatches=3), None, None, "fp32", 2, "strategy.num_microbatches=3 must divide"),
        (PipelineConfig(split_points=[5]), None, None, "fp32", 2, "strategy.split_points=[5]"),
        (PipelineConfig(split_points=[2]), None, None, "fp32", 3, "strategy.split_points=[2]"),
        (PipelineConfig(split_points=[2, 2]), None, None, "fp32", 3, "strategy.split_points=[2, 2]"),
        (PipelineConfig(name="1f1b", schedule="1f1b", num_microbatches=2), None, None, "fp32", 4,
         "strategy.num_microbatches=2 must be >= the 4 pipeline stages"),
        (PipelineConfig(), None, TrainConfig(global_batch_size=8, micro_batch_size=3), "fp32", 2,
         "train.micro_batch_size=3"),
        (PipelineConfig(), None, None, "fp16", 2, "precision=fp16"),
        (PipelineConfig(), None, None, "fp32", 1, "WORLD_SIZE=1"),
        (PipelineConfig(schedule="1f1b"), None, None, "fp32", 2, "strategy.schedule='1f1b' contradicts"),
        # pp_dp: K stages of world / K replicas each
        (PipelineConfig(name="pp_dp", pp=3), None, None, "fp32", 4, "strategy.pp=3 must divide the number of processes (4)"),
        (PipelineConfig(name="pp_dp", pp=1), None, None, "fp32", 4, "strategy.pp=1 must be >= 2"),
        (PipelineConfig(name="pp_dp", pp=2, dp_mode="zero"), None, None, "fp32", 4, "strategy.dp_mode='zero'"),
        (PipelineConfig(name="pp_dp", pp=2), None, TrainConfig(global_batch_size=6, micro_batch_size=1), "fp32", 8,
         "must be divisible by the 4 data-parallel replicas"),
        (PipelineConfig(name="pp_dp", pp=2), None, TrainConfig(global_batch_size=8, micro_batch_size=3), "fp32", 4,
         "the 4 samples per replica (4) must be divisible by train.micro_batch_size=3"),
        (PipelineConfig(name="pp_dp", pp=4), ModelConfig(num_layers=3), None, "fp32", 8, "(strategy.pp=4)"),
    ],
)
def test_bad_pipeline_config_is_one_line(strategy, model, train, precision, world, needle):
    run = RunConfig(strategy=strategy, model=model or ModelConfig(), train=train or TrainConfig())
    run.precision.name = precision
    with pytest.raises(ConfigError) as err:
        validate(run, world)
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_good_pipeline_configs_validate():
    validate(RunConfig(strategy=PipelineConfig(num_microbatches=8), train=TrainConfig(global_batch_size=8)), 2)
    validate(RunConfig(strategy=PipelineConfig(split_points=[1, 3])), 3)
    validate(RunConfig(strategy=PipelineConfig(name="1f1b", schedule="1f1b")), 4)  # null: 2 x 4 = 8, 4 micro-batches
    validate(RunConfig(strategy=PipelineConfig(name="pp_dp", pp=2, dp_mode="fsdp")), 4)


@pytest.mark.multiproc
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
# pipelines' default (strategy.num_microbatches=null). The 1F1B run is also the one tests/test_dryrun.py reads.
@pytest.fixture(scope="module")
def gpipe_run(fast_run: Any) -> tuple[Path, dict[str, Any]]:
    return fast_run("strategy=gpipe", nproc=2)


@pytest.fixture(scope="module")
def onef1b_run(fast_run: Any) -> tuple[Path, dict[str, Any]]:
    return fast_run("strategy=1f1b", nproc=2)


@pytest.mark.multiproc
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


@pytest.mark.multiproc
def test_1f1b_holds_fewer_activations_than_gpipe(gpipe_run, onef1b_run):
    gpipe, onef1b = _last_records(gpipe_run[0]), _last_records(onef1b_run[0])
    # M=4, K=2: GPipe keeps all 4 micro-batches on both stages; 1F1B at most 2 on stage 0 and 1 on stage 1.
    assert gpipe[0]["memory/activations_bytes"] == pytest.approx(2 * onef1b[0]["memory/activations_bytes"], rel=0.05)
    assert gpipe[1]["memory/activations_bytes"] == pytest.approx(4 * onef1b[1]["memory/activations_bytes"], rel=0.05)
    assert onef1b[0]["memory/activations_bytes"] > onef1b[1]["memory/activations_bytes"]  # the first stage holds most


TIED = ["model.tie_embeddings=true", "logger=none", *FAST]


@pytest.fixture(scope="module")
def tied_single(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """One process with tied input/output embeddings, the baseline of the tied pipelines."""
    run_dir = tmp_path_factory.mktemp("tied-single")
    return run_dir, train_ok(["strategy=single", *TIED], run_dir=run_dir)


@pytest.mark.multiproc
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


@pytest.mark.multiproc
def test_llama_1f1b_with_more_microbatches_matches_single(tmp_path):
    common = [*TINY_LLAMA, "logger=none", *FAST]
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


@pytest.mark.multiproc
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


@pytest.mark.multiproc
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
    alone = train_ok(["strategy=single", "logger=none", *FAST, "train.steps=8", f"checkpoint.resume={step4}"],
                     run_dir=tmp_path / "alone")
    for step in range(4, 8):
        assert rel_diff(alone["losses"][step], s["losses"][step]) < 1e-6, step
