"""Pipeline parallelism (gpipe / 1f1b / pp_dp) in one process: the stage split, the stages themselves (chained, they
compute what the full model computes), bad input. The real 2- and 4-process runs: tests/launched/test_pipeline.py."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from dist_train.checks import validate
from dist_train.config import ConfigError, ModelConfig, RunConfig, TrainConfig
from dist_train.strategies.pipeline import PipelineConfig
from dist_train.model import build_model
from dist_train.strategies.pipeline import bubble_formula
from dist_train.strategies.pipeline_stages import build_stage, is_tied, param_counts, split_layers, stage_ranges
from tests.pipeline_support import BLOCK, EMBED, HEAD


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
