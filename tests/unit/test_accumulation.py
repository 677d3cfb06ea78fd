"""FSDP's accumulation when the run leaves it open (strategy.reduce_every_microbatch=null, dist_train/accumulation.py):
chosen by the estimator's predicted peak of the run against 90% of the device. A real run's choice, its config.yaml
and its line: tests/launched/test_peak_live.py."""

from __future__ import annotations

from dist_train.accumulation import choose
from dist_train.estimate.compose import compose_training_config

GIB = 2**30


def _config(*overrides: str) -> dict:
    return compose_training_config(["logger=none", "strategy=fsdp", "precision=bf16", "train.seq_len=2048",
                                    "train.activation_checkpointing=true", *overrides])


def test_70b_on_64_gpus_reduces_after_every_micro_batch_where_held_gradients_would_not_fit():
    """MosaicML's MPT-70B layout (64 x 80 GB, 4 micro-batches of 2): held, the unsharded fp32 gradients alone are
    257 GiB a rank."""
    config = _config("model=70b", "train.global_batch_size=512", "train.micro_batch_size=2")
    reduce, line = choose(config, world_size=64, device_memory_bytes=80 * GIB)
    assert reduce
    assert line.startswith("4 micro-batches a step: reduce-scattered after every micro-batch") and "usable" in line


def test_7b_on_8_gpus_holds_them_and_a_cpu_always_does():
    config = _config("model=7b", "train.global_batch_size=64", "train.micro_batch_size=2")
    reduce, line = choose(config, world_size=8, device_memory_bytes=80 * GIB)
    assert not reduce and "held until the last, one reduce-scatter a step (predicted peak" in line
    # the same run where the device's memory could not hold it
    assert choose(config, world_size=8, device_memory_bytes=20 * GIB)[0]
    reduce, line = choose(config, world_size=8, device_memory_bytes=None)
    assert not reduce and "on a CPU there is no device memory to choose by" in line


def test_one_micro_batch_a_step_leaves_nothing_to_choose_and_lora_holds_its_few_gradients():
    one = _config("model=7b", "train.global_batch_size=16", "train.micro_batch_size=2")
    assert choose(one, world_size=8, device_memory_bytes=80 * GIB) == (False, "")
    lora = _config("model=7b", "train.global_batch_size=64", "train.micro_batch_size=2", "peft=lora")
    reduce, line = choose(lora, world_size=8, device_memory_bytes=80 * GIB)
    assert not reduce and "not predicted" in line and "LoRA" in line


def test_resolve_writes_the_choice_into_the_run_and_its_config(monkeypatch):
    """The training side on one (faked) 80 GB GPU: a 7B model accumulating 4 micro-batches on one device cannot hold
    its unsharded gradients beside everything else, so the run and its config (what config.yaml records) say true,
    and the line says why; an explicit choice is left alone."""
    import types

    import torch
    from omegaconf import OmegaConf

    from dist_train.accumulation import resolve
    from dist_train.estimate.compose import _compose

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: types.SimpleNamespace(total_memory=80 * GIB))
    cfg, run = _compose(["logger=none", "strategy=fsdp", "model=7b", "precision=bf16", "train.seq_len=2048",
                         "train.global_batch_size=8", "train.micro_batch_size=2",
                         "train.activation_checkpointing=true"])
    assert run.strategy.reduce_every_microbatch is None
    resolved, said = resolve(run, cfg, world_size=1, device=torch.device("cuda", 0))
    assert resolved.strategy.reduce_every_microbatch is True
    assert OmegaConf.select(cfg, "strategy.reduce_every_microbatch") is True
    assert said.startswith("strategy=fsdp: 4 micro-batches a step: reduce-scattered after every micro-batch")
    again, said = resolve(resolved, cfg, world_size=1, device=torch.device("cuda", 0))
    assert again is resolved and said == ""


def test_fsdp_ep_holds_the_dense_weights_and_its_own_experts_gradients_and_chooses_by_them():
    """fsdp_ep accumulating (Qwen3-30B-A3B's shape, 64 ranks, ep 8, 4 micro-batches of 4,096 tokens): held, a rank's
    unsharded fp32 gradients are the dense weights' and its 16 experts a layer, not all 128; on 80 GB they fit, on
    32 GB they do not, and it reduce-scatters after every micro-batch instead. ep never chooses: whole gradients."""
    from dist_train.estimate import ModelShape, setup_from_config
    from dist_train.estimate.memory import tp_rank_params
    from dist_train.estimate.render import human_bytes

    qwen3_30b = ["model=tiny_moe", "model.hidden_size=2048", "model.num_layers=48", "model.num_experts=128",
                 "model.experts_per_token=8", "model.moe_ffn_hidden_size=768", "model.num_heads=32",
                 "model.num_kv_heads=4", "model.head_dim=128", "model.vocab_size=151936", "model.ffn_hidden_size=6144",
                 "model.max_seq_len=4096"]
    config = compose_training_config(["logger=none", "strategy=fsdp_ep", "strategy.ep=8", "precision=bf16",
                                      "train.seq_len=4096", "train.activation_checkpointing=true",
                                      "train.global_batch_size=256", "train.micro_batch_size=1", *qwen3_30b])
    shape, setup = ModelShape.from_config(config["model"]), setup_from_config(config, world_size=64)
    held = 4 * tp_rank_params(shape, setup)
    experts = 48 * 128 * 3 * 2048 * 768
    assert held == 4 * (shape.num_params - experts + experts / 8)
    reduce, line = choose(config, world_size=64, device_memory_bytes=80 * GIB)
    assert not reduce and "held until the last" in line
    reduce, line = choose(config, world_size=64, device_memory_bytes=32 * GIB)
    assert reduce and f"({human_bytes(held)} a rank)" in line
    ep = compose_training_config(["logger=none", "strategy=ep", "model=tiny_moe"])
    assert ep["strategy"]["reduce_every_microbatch"] is False


def test_ep_replicas_never_choose_to_reduce_every_micro_batch(monkeypatch):
    """strategy=fsdp_ep with strategy.dp_mode=replicate (ep's layout) left at null: whole gradients either way, so
    resolve sets false and says nothing, whatever the device (a faked 1 GB GPU, where fsdp_ep would reduce)."""
    import types

    import torch

    from dist_train.accumulation import resolve
    from dist_train.estimate.compose import _compose

    cfg, run = _compose(["logger=none", "strategy=fsdp_ep", "strategy.dp_mode=replicate", "model=tiny_moe",
                         "train.global_batch_size=8", "train.micro_batch_size=2"])
    assert run.strategy.reduce_every_microbatch is None
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: types.SimpleNamespace(total_memory=2**30))
    run, line = resolve(run, cfg, world_size=2, device=types.SimpleNamespace(type="cuda"))
    assert (run.strategy.reduce_every_microbatch, line) == (False, "")
    assert cfg.strategy.reduce_every_microbatch is False
