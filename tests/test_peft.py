"""peft=lora: the model frozen, low-rank adapters trained; the same losses as one process under ZeRO-2,
and gradients, optimizer state and gradient traffic that shrink to the adapters'."""

from __future__ import annotations

import pytest

from dist_train.checks import validate
from dist_train.config import ConfigError
from tests.helpers import FAST, assert_same_losses, last_step, train_ok
from tests.test_config import run_config

LORA = ["peft=lora", "logger=none", *FAST]
# model=tiny (GPT-2, hidden 64, MLP 256, 4 blocks), rank 8 on c_attn (64 -> 192), attention's c_proj (64 -> 64),
# c_fc (64 -> 256) and the MLP's c_proj (256 -> 64): r * (in + out) each, per block
ADAPTERS = 4 * 8 * ((64 + 192) + (64 + 64) + (64 + 256) + (256 + 64))


@pytest.mark.multiproc
def test_lora_trains_only_the_adapters_and_every_strategy_agrees(tmp_path):
    single = train_ok(["strategy=single", *LORA], run_dir=tmp_path / "single")
    assert single["num_trainable_params"] == ADAPTERS == 32_768
    total = single["num_params"]
    (rec,) = last_step(tmp_path / "single")
    assert rec["memory/params_bytes"] == 4 * total  # the base model and the adapters
    assert rec["memory/grads_bytes"] == 4 * ADAPTERS  # gradients of the adapters only
    assert 8 * ADAPTERS <= rec["memory/optimizer_bytes"] < 8 * ADAPTERS + 1024  # AdamW's moments (+ step counters)

    zero = train_ok(["strategy=zero2", *LORA], run_dir=tmp_path / "zero2", nproc=2)
    assert_same_losses(single, zero)
    for r in last_step(tmp_path / "zero2"):
        # ZeRO partitions what trains; the frozen base stays whole on every rank
        assert r["memory/params_bytes"] == 4 * total
        assert r["memory/grads_bytes"] == 4 * ADAPTERS / 2
        # only the adapters' gradients travel: reduced on each of the rank's 2 micro-batches (ZeRO-2), plus
        # the gradient norm's few bytes
        assert 2 * 4 * ADAPTERS <= r["comm/all_reduce/bytes"] <= 2 * 4 * ADAPTERS + 64


@pytest.mark.parametrize(
    ("overrides", "world", "needle"),
    [
        (["peft=lora", "strategy=tp"], 2, "peft=lora puts adapters on whole projections; strategy=tp splits them"),
        (["peft=lora", "peft.rank=0"], 1, "peft.rank=0 must be >= 1"),
    ],
)
def test_bad_lora_settings_are_one_line(overrides, world, needle):
    _, run = run_config(*overrides)
    with pytest.raises(ConfigError) as err:
        validate(run, world)
    assert needle in str(err.value) and "\n" not in str(err.value)
