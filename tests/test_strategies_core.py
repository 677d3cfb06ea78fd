"""Real 2-process runs (gloo on CPU) of DDP and FSDP compared with one process: same losses, right bytes."""

from __future__ import annotations

import re

import pytest

from dist_train.config import ModelConfig
from dist_train.model import build_model
from tests.helpers import FAST, assert_same_losses, last_step, train_ok

pytestmark = pytest.mark.multiproc



def test_ddp_matches_single_and_all_reduces_one_gradient_per_step(single_run, tmp_path):
    _, single = single_run
    s = train_ok(["strategy=ddp", "logger=none", *FAST], run_dir=tmp_path, nproc=2)
    assert_same_losses(single, s)
    assert s["world_size"] == 2 and s["accumulation_steps"] == 2
    n = s["num_params"]
    for rec in last_step(tmp_path):
        assert rec["memory/params_bytes"] == 4 * n  # a full fp32 replica on every rank
        assert rec["memory/grads_bytes"] == 4 * n
        assert rec["memory/optimizer_bytes"] >= 8 * n  # Adam's two fp32 moments (+ step counters)
        # no_sync during accumulation: exactly one gradient's worth all-reduced per step
        assert rec["comm/all_reduce/bytes"] == 4 * n
        assert rec["comm/all_reduce/time_s"] > 0
        assert rec["comm/all_gather/count"] == 0 and rec["comm/reduce_scatter/count"] == 0


@pytest.mark.parametrize("reshard", [True, False])
def test_fsdp_matches_single_and_holds_half_the_model_state(single_run, fast_run, reshard):
    _, single = single_run
    # reshard_after_forward=true is fsdp's default: the run tests/test_dryrun.py and tests/test_peak_live.py read
    run_dir, s = fast_run("strategy=fsdp", *([] if reshard else ["strategy.reshard_after_forward=false"]), nproc=2)
    assert_same_losses(single, s)
    n = s["num_params"]
    ranks = last_step(run_dir)
    assert sum(r["memory/params_bytes"] for r in ranks) == 4 * n  # the shards add up to one copy
    for rec in ranks:
        assert rec["memory/params_bytes"] == pytest.approx(2 * n, rel=0.02)  # half of 4 bytes/param
        assert rec["memory/grads_bytes"] == pytest.approx(2 * n, rel=0.02)
        assert rec["comm/reduce_scatter/bytes"] == 4 * n  # one gradient reduce-scattered per step
        assert rec["comm/all_gather/count"] > 0 and rec["comm/all_gather/time_s"] > 0
    # resharding after forward gathers each block again in backward; the root (embeddings, final norm, head) is
    # gathered once per micro-batch either way (FSDP2 keeps the root's parameters from forward to backward)
    gathered = ranks[0]["comm/all_gather/bytes"]
    blocks, micro = 4, 2  # 2 micro-batches per rank
    block_gathers = 2 if reshard else 1
    block_params = sum(p.numel() for p in build_model(ModelConfig(), seed=0).transformer.h.parameters())
    assert gathered == pytest.approx(4 * micro * (block_gathers * block_params + (n - block_params)), rel=0.01)
    assert ranks[0]["comm/all_gather/count"] == micro * (blocks * block_gathers + 1)


def test_compiled_blocks_train_as_eager_under_fsdp(single_run, tmp_path):
    """train.compile=true: each block compiled before FSDP2 shards it (torchtitan's order). The same losses as the
    eager single process; inductor recomputes cheap ops in backward, so fewer bytes stay saved."""
    single_dir, single = single_run
    s = train_ok(["strategy=fsdp", "train.compile=true", "logger=none", *FAST], run_dir=tmp_path, nproc=2)
    assert_same_losses(single, s)
    eager = last_step(single_dir)[0]["memory/activations_bytes"]
    for rec in last_step(tmp_path):
        assert 0 < rec["memory/activations_bytes"] < eager


def test_compile_is_refused_where_it_is_not_wired():
    from dist_train.checks import validate
    from dist_train.config import ConfigError
    from tests.test_config import run_config

    _, run = run_config("strategy=zero2", "train.compile=true")
    with pytest.raises(ConfigError, match=re.escape("train.compile=true runs with strategy=single | ddp | fsdp")):
        validate(run, 2)
