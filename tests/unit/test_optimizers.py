"""Optimizers that save memory (optimizer=adamw|sgd|adafactor|lion|adam8bit|lomo): the state each one keeps,
measured on the tensors and predicted by the estimator; LOMO's fused update; the combinations refused."""

from __future__ import annotations

import pytest
import torch

from dist_train.checks import validate
from dist_train.config import ConfigError, ModelConfig, OptimizerConfig, TrainConfig
from dist_train.contracts import tensor_bytes
from dist_train.estimate import ModelShape
from dist_train.estimate.compose import model_config
from dist_train.estimate.memory import predict_memory, state_bytes
from dist_train.estimate.setup import Setup
from dist_train.estimate.shapes import PRESETS
from dist_train.model import build_model, forward_loss
from dist_train.optim import OptimizerFactory
from dist_train.telemetry.memory import optimizer_state_tensors
from tests.helpers import run_config

TINY = ModelConfig()  # GPT-2, 4 blocks, hidden 64, vocab 256, 128 positions: 241,024 parameters
TINY_MOE = ModelConfig(**model_config("tiny_moe"))  # Qwen3-MoE: each layer's experts two 3-D stacks (E x 2I x h...)


def _one_step(name: str, *, steps: int = 1, config: ModelConfig = TINY,
              **optimizer: object) -> tuple[torch.nn.Module, torch.optim.Optimizer, list]:
    model = build_model(config, seed=0)
    train = TrainConfig(lr=0.05, grad_clip=0.0)
    opt = OptimizerFactory(OptimizerConfig(name=name, **optimizer), train).build(model.parameters())
    ids = torch.randint(0, config.vocab_size, (2, 17), generator=torch.Generator().manual_seed(1))
    losses = []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = forward_loss(model, ids[:, :-1], ids[:, 1:])
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return model, opt, losses


def _state_bytes(opt: torch.optim.Optimizer) -> int:
    """Distinct storages, as the memory telemetry counts them (bitsandbytes shares its code books)."""
    seen, total = set(), 0
    for t in optimizer_state_tensors(opt):
        key = t.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            total += t.numel() * t.element_size()
    return total


@pytest.mark.parametrize(
    ("name", "rel"),
    # adamw / adafactor: the estimator leaves out the one-element step counters (53 tensors x 4 B)
    [("adamw", 1e-3), ("lion", 0), ("adafactor", 1e-2), ("adam8bit", 0), ("lomo", 0), ("sgd", 0)],
)
def test_each_optimizers_state_is_what_the_estimator_predicts(name, rel):
    extra = {"momentum": 0.9} if name == "sgd" else {}
    model, opt, _ = _one_step(name, **extra)
    measured = _state_bytes(opt)
    setup = Setup(strategy="single", family="single", optimizer=name, momentum=extra.get("momentum", 0.0),
                  micro_batch_size=2, seq_len=16)
    predicted = predict_memory(ModelShape.from_config(TINY), setup)[0].optimizer
    assert predicted == pytest.approx(measured, rel=rel, abs=0)
    if name in ("adafactor", "adam8bit"):  # kept tensor by tensor: an MoE model's 3-D expert stacks too (adafactor
        # keeps a row and a column vector per expert matrix, E·(m + n); counted as m + n + E until 2026-11-28)
        _, opt, _ = _one_step(name, config=TINY_MOE)
        predicted = predict_memory(ModelShape.from_config(model_config("tiny_moe")), setup)[0].optimizer
        assert predicted == pytest.approx(_state_bytes(opt), rel=rel, abs=0)
    n = sum(p.numel() for p in model.parameters())
    per_param = measured / n
    expected_range = {"adamw": (8, 8.01), "lion": (4, 4), "sgd": (4, 4), "adam8bit": (2, 2.2),
                      "adafactor": (0.1, 0.2), "lomo": (0, 0)}[name]
    assert expected_range[0] <= per_param <= expected_range[1], per_param


def test_lomo_is_sgd_applied_inside_backward_without_keeping_gradients():
    lomo_model, lomo, lomo_losses = _one_step("lomo", steps=3)
    sgd_model, _, sgd_losses = _one_step("sgd", steps=3)
    assert lomo_losses == sgd_losses
    for a, b in zip(lomo_model.parameters(), sgd_model.parameters()):
        assert torch.equal(a, b)
    assert all(p.grad is None for p in lomo_model.parameters())  # each freed right after its update
    assert tensor_bytes(optimizer_state_tensors(lomo)) == 0
    assert lomo.take_grad_norm() > 0  # the norm of the last step's gradients, summed as they went by


@pytest.mark.parametrize(
    ("overrides", "world", "needle"),
    [
        (["strategy=fsdp", "optimizer=adafactor"], 2, "optimizer=adafactor factors each matrix's second moment"),
        (["strategy=zero2", "optimizer=adam8bit"], 2, "strategy=zero2 hands the optimizer shards"),
        (["strategy=tp", "optimizer=adam8bit"], 2, "strategy=tp hands the optimizer shards"),
        (["strategy=ddp", "optimizer=lomo", "train.grad_clip=0"], 2, "it runs with strategy=single only"),
        (["strategy=single", "optimizer=lomo", "train.grad_clip=0", "train.global_batch_size=8"], 1,
         "cannot accumulate 4 micro-batches"),
        (["strategy=single", "optimizer=lomo", "train.global_batch_size=2"], 1, "set train.grad_clip=0 (now 1.0)"),
        (["strategy=single", "optimizer=lomo", "train.global_batch_size=2", "train.grad_clip=0", "precision=fp16"], 1,
         "optimizer=lomo with precision=fp16"),
    ],
)
def test_optimizers_that_cannot_work_under_a_strategy_are_refused_in_one_line(overrides, world, needle):
    _, run = run_config(*overrides)
    with pytest.raises(ConfigError) as err:
        validate(run, world)
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_optimizers_that_can_work_validate():
    for overrides, world in [(["strategy=fsdp", "optimizer=lion"], 2), (["strategy=ddp", "optimizer=adafactor"], 2),
                             (["strategy=gpipe", "optimizer=adam8bit"], 2),
                             (["strategy=single", "optimizer=lomo", "train.global_batch_size=2", "train.grad_clip=0"], 1)]:
        _, run = run_config(*overrides)
        validate(run, world)


def test_70b_in_fp16_by_optimizer_follows_the_notes():
    """Every state tensor in fp16 ("pure"): weights 2 + gradients 2 + the optimizer's state, per parameter."""
    llama = PRESETS["70b"]
    gb = {}
    for name in ("adamw", "sgd", "lion", "adam8bit", "adafactor", "lomo"):
        setup = Setup(strategy="single", family="single", precision="fp16", optimizer=name, regime="pure",
                      momentum=0.9 if name == "sgd" else 0.0)
        gb[name] = predict_memory(llama, setup)[0].model_state / 1e9
    n = llama.num_params / 1e9
    assert gb["adamw"] == pytest.approx(8 * n)  # the notes: about 560 GB for 70B
    assert gb["sgd"] == gb["lion"] == pytest.approx(6 * n)
    assert gb["lomo"] == pytest.approx(2 * n)  # no state, no gradients kept
    assert 6 * n < gb["adam8bit"] < 6.1 * n  # two 1-byte moments (and their block scales) whatever the dtype
    assert 4 * n < gb["adafactor"] < 4.01 * n
    assert state_bytes(precision="fp16", optimizer="adamw", regime="pure").total == 8
