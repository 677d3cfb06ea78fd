"""DeepSpeed ZeRO 1-3: the DeepSpeed config dist_train derives (batch sizes, clipping, precision, stage and offload,
`strategy.extra` merged over it), with no DeepSpeed and no process. Real 2-process runs and bad input on the command
line: tests/launched/test_zero.py."""

from __future__ import annotations

from typing import Any

import pytest

from dist_train.config import PrecisionConfig, TrainConfig
from dist_train.parallel_dims import ParallelDims
from dist_train.strategies._deepspeed import deep_merge, deepspeed_config
from dist_train.strategies.zero import ZeroConfig

N_RANKS = 2  # the data-parallel size the configs below are derived for


# ------------------------------------------------------------------------------------------------
# The derived DeepSpeed config (pure; no DeepSpeed, no processes).
# ------------------------------------------------------------------------------------------------


def _ds(zero: ZeroConfig | None = None, **train: Any) -> dict[str, Any]:
    return deepspeed_config(
        zero=zero or ZeroConfig(name="zero2", stage=2),
        train=TrainConfig(**{"global_batch_size": 8, **train}),  # resolved, as validation leaves it
        precision=PrecisionConfig(name="fp32"),
        dims=ParallelDims(N_RANKS, dp_shard=N_RANKS),
    )


def test_batch_sizes_and_accumulation_follow_the_run():
    cfg = _ds(global_batch_size=32, micro_batch_size=4)
    assert cfg["train_batch_size"] == 32
    assert cfg["train_micro_batch_size_per_gpu"] == 4
    assert cfg["gradient_accumulation_steps"] == 4  # 32 / (4 x 2 ranks)
    # DeepSpeed's own consistency rule holds
    assert cfg["train_batch_size"] == 4 * cfg["gradient_accumulation_steps"] * N_RANKS


@pytest.mark.parametrize("clip", [0.0, 0.5, 3.0])
def test_gradient_clipping_follows_train_grad_clip(clip):
    # DeepSpeed would clip at 1.0 if the key were missing
    assert _ds(grad_clip=clip)["gradient_clipping"] == clip


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_precision_maps_to_deepspeed_sections(precision):
    cfg = deepspeed_config(
        zero=ZeroConfig(name="zero1", stage=1), train=TrainConfig(global_batch_size=8),
        precision=PrecisionConfig(name=precision), dims=ParallelDims(1),
    )
    assert cfg["bf16"]["enabled"] == (precision == "bf16")
    assert cfg["fp16"]["enabled"] == (precision == "fp16")


def test_stage_and_offload_reach_zero_optimization():
    z3 = _ds(ZeroConfig(name="zero3_offload", stage=3, offload_optimizer=True, offload_params=True))
    zo = z3["zero_optimization"]
    assert zo["stage"] == 3
    assert zo["offload_optimizer"]["device"] == "cpu" and zo["offload_param"]["device"] == "cpu"
    assert zo["stage3_param_persistence_threshold"] == 0  # every parameter partitioned
    z1 = _ds(ZeroConfig(name="zero1", stage=1))["zero_optimization"]
    assert z1 == {"stage": 1}
    # our torch optimizer is accepted by ZeRO (and by offload) without DeepSpeed's own optimizer
    assert z3["zero_allow_untested_optimizer"] is True and z3["zero_force_ds_cpu_optimizer"] is False
    assert "optimizer" not in z3 and "scheduler" not in z3


def test_extra_is_deep_merged_over_the_derived_config():
    extra = {"zero_optimization": {"reduce_bucket_size": 1000, "stage3_param_persistence_threshold": 10},
             "gradient_clipping": 2.0, "comms_logger": {"enabled": True}}
    cfg = _ds(ZeroConfig(name="zero3", stage=3, extra=extra), grad_clip=1.0)
    assert cfg["zero_optimization"] == {
        "stage": 3, "stage3_param_persistence_threshold": 10, "reduce_bucket_size": 1000,
    }  # merged key by key: the derived `stage` survives
    assert cfg["gradient_clipping"] == 2.0  # the user's explicit choice wins
    assert cfg["comms_logger"] == {"enabled": True}
    assert cfg["train_batch_size"] == 8  # untouched keys stay


def test_deep_merge_does_not_alias_its_inputs():
    base = {"a": {"b": 1}}
    extra = {"a": {"c": [1]}}
    out = deep_merge(base, extra)
    out["a"]["c"].append(2)
    assert base == {"a": {"b": 1}} and extra == {"a": {"c": [1]}}


# ------------------------------------------------------------------------------------------------
# The buckets follow the model (issue 41), as transformers' "auto" sizes them, and the estimator reads the same sizes.
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("hidden", [64, 768, 4096])
def test_buckets_follow_the_models_width(hidden):
    z1 = deepspeed_config(zero=ZeroConfig(name="zero1", stage=1), train=TrainConfig(global_batch_size=8),
                          precision=PrecisionConfig(name="fp32"), dims=ParallelDims(1), hidden_size=hidden)
    assert z1["zero_optimization"] == {"stage": 1, "reduce_bucket_size": hidden**2}  # no stage-3 key below stage 3
    z3 = deepspeed_config(zero=ZeroConfig(name="zero3", stage=3), train=TrainConfig(global_batch_size=8),
                          precision=PrecisionConfig(name="fp32"), dims=ParallelDims(1),
                          hidden_size=hidden)["zero_optimization"]
    assert z3["reduce_bucket_size"] == hidden**2 and z3["stage3_prefetch_bucket_size"] == int(0.9 * hidden**2)
    assert z3["stage3_param_persistence_threshold"] == 0  # this project's, not transformers' 10 x hidden
    # allgather_bucket_size allocates nothing (parallel/buckets.py): DeepSpeed's default stays
    assert "allgather_bucket_size" not in z3


def test_without_a_width_deepspeeds_defaults_stay():
    assert "reduce_bucket_size" not in _ds(ZeroConfig(name="zero3", stage=3))["zero_optimization"]


def test_strategy_extra_wins_over_the_sizes_from_the_model():
    extra = {"zero_optimization": {"reduce_bucket_size": 100000, "stage3_prefetch_bucket_size": 0}}
    zo = deepspeed_config(zero=ZeroConfig(name="zero3", stage=3, extra=extra), train=TrainConfig(global_batch_size=8),
                          precision=PrecisionConfig(name="fp32"), dims=ParallelDims(1),
                          hidden_size=768)["zero_optimization"]
    assert zo["reduce_bucket_size"] == 100000 and zo["stage3_prefetch_bucket_size"] == 0


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("extra", [{}, {"zero_optimization": {"reduce_bucket_size": 100000,
                                                             "stage3_prefetch_bucket_size": 1234}}])
def test_the_estimator_reads_the_sizes_training_configures(stage, extra):
    """One source (parallel/buckets.py): the Setup built from a run config, resolved against the model, carries the
    bucket sizes DeepSpeed is given for that run, with or without strategy.extra."""
    from dist_train.config import ModelConfig
    from dist_train.estimate.memory import with_model
    from dist_train.estimate.setup import setup_from_config
    from dist_train.estimate.shapes import ModelShape

    model = ModelConfig(hidden_size=768, num_heads=12)
    run = {"strategy": {"name": f"zero{stage}", "stage": stage, "extra": extra}, "precision": {"name": "fp32"},
           "train": {"micro_batch_size": 2, "global_batch_size": 8}, "optimizer": {}}
    setup = with_model(ModelShape.from_config(model), setup_from_config(run, world_size=2))
    zo = deepspeed_config(zero=ZeroConfig(name=f"zero{stage}", stage=stage, extra=extra),
                          train=TrainConfig(global_batch_size=8), precision=PrecisionConfig(name="fp32"),
                          dims=ParallelDims(2, dp_shard=2), hidden_size=model.hidden_size)["zero_optimization"]
    assert setup.zero_reduce_bucket_size == zo["reduce_bucket_size"]
    if stage == 3:
        assert setup.zero3_prefetch_bucket_size == zo["stage3_prefetch_bucket_size"]
