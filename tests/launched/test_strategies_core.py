"""Real 2-process runs (gloo on CPU) of DDP and FSDP compared with one process: same losses, right bytes."""

from __future__ import annotations

import re

import pytest

from dist_train.config import ModelConfig
from dist_train.model import build_model
from tests.helpers import FAST, assert_same_losses, last_step, train_ok


def test_ddp_matches_single_and_all_reduces_one_gradient_per_step(single_run, tmp_path):
    _, single = single_run
    s = train_ok(["strategy=ddp", *FAST], run_dir=tmp_path, nproc=2)
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
    # reshard_after_forward=true is fsdp's default: the run tests/launched/test_dryrun.py and
    # tests/launched/test_peak_live.py read
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
    s = train_ok(["strategy=fsdp", "train.compile=true", *FAST], run_dir=tmp_path, nproc=2)
    assert_same_losses(single, s)
    eager = last_step(single_dir)[0]["memory/activations_bytes"]
    for rec in last_step(tmp_path):
        assert 0 < rec["memory/activations_bytes"] < eager


def test_compile_is_refused_where_it_is_not_wired():
    from dist_train.checks import validate
    from dist_train.config import ConfigError
    from tests.helpers import run_config

    _, run = run_config("strategy=zero2", "train.compile=true")
    with pytest.raises(ConfigError, match=re.escape("train.compile=true runs with strategy=single | ddp | fsdp")):
        validate(run, 2)


def test_checkpointing_is_applied_inside_the_one_parallelize_and_trains_as_one_process(single_run, fast_run):
    """fsdp with train.activation_checkpointing=true: checkpointing applied by dist_train.parallel.apply between tensor
    parallelism and FSDP2 (not as a transform before the strategy), the same losses as one process, fewer saved
    activations than the same fsdp run without it. With train.checkpoint_every=2 (blocks 2 and 4 of 4) the same
    losses, and saved activations strictly between."""
    _, single = single_run
    plain_dir, _ = fast_run("strategy=fsdp", nproc=2)
    full_dir, s = fast_run("strategy=fsdp", "train.activation_checkpointing=true", nproc=2)  # true: full
    assert_same_losses(single, s)
    half_dir, half = fast_run("strategy=fsdp", "train.activation_checkpointing=full", "train.checkpoint_every=2",
                              nproc=2)
    assert_same_losses(single, half)
    plain = {r["rank"]: r["memory/activations_bytes"] for r in last_step(plain_dir)}
    halves = {r["rank"]: r["memory/activations_bytes"] for r in last_step(half_dir)}
    for rec in last_step(full_dir):
        assert 0 < rec["memory/activations_bytes"] < halves[rec["rank"]] < plain[rec["rank"]]


@pytest.mark.parametrize("strategy", ["ddp", "fsdp", "tp", "1f1b"])
def test_selective_checkpointing_trains_as_one_process_and_keeps_less_than_none(single_run, fast_run, strategy):
    """train.activation_checkpointing=selective (torchtitan's per-op policy: what the matrix products and attention
    return is kept, the rest recomputed), applied before the strategy wraps the model (ddp, a pipeline) or inside
    parallelize (fsdp, tp): the same losses as one process without checkpointing. Under fsdp the saved activations
    lie strictly between full checkpointing's and none's (the same fsdp runs as the test above)."""
    _, single = single_run
    run_dir, s = fast_run(f"strategy={strategy}", "train.activation_checkpointing=selective", nproc=2)
    assert_same_losses(single, s)
    assert "activation_checkpointing: selective" in (run_dir / "config.yaml").read_text()
    if strategy == "tp":  # the row-parallel all-reduces are kept, not sent again when a block is recomputed
        activation = 2 * 64 * 64 * 4  # one micro-batch's hidden states (2 x 64 tokens, hidden 64, fp32)
        vocab_split = 2 * activation + 3 * (2 * 64 * 4)  # as tests/launched/test_tensor_parallel.py's VOCAB_SPLIT
        for rec in last_step(run_dir):  # 4 layers x 4 all-reduces x 4 micro-batches: as without checkpointing
            assert rec["comm/all_reduce/bytes"] <= 4 * 4 * 4 * activation + 4 * vocab_split + 1024, rec
    if strategy != "fsdp":
        return
    none = {r["rank"]: r["memory/activations_bytes"] for r in last_step(fast_run("strategy=fsdp", nproc=2)[0])}
    full_dir, _ = fast_run("strategy=fsdp", "train.activation_checkpointing=true", nproc=2)
    full = {r["rank"]: r["memory/activations_bytes"] for r in last_step(full_dir)}
    for rec in last_step(run_dir):
        assert full[rec["rank"]] < rec["memory/activations_bytes"] < none[rec["rank"]], (full, rec, none)


PARALLELIZED = """
import json
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
dist.init_process_group("fake", rank=0, world_size=4, store=FakeStore())
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from dist_train.config import ModelConfig, PrecisionConfig
from dist_train.model import build_model, transformer_blocks
from dist_train.parallel.apply import Sharding, parallelize
from dist_train.parallel.mesh import build_mesh
from dist_train.parallel_dims import ParallelDims
dims = ParallelDims(4, dp_shard=2, tp=2)
model = build_model(ModelConfig(arch="llama", num_heads=4, num_kv_heads=2), seed=0)
mesh = build_mesh(dims, "cpu")
parallelize(model, mesh=mesh, dims=dims, precision=PrecisionConfig(name="fp32"), sharding=Sharding(),
            checkpointing="full")
block = transformer_blocks(model)[0]
inner = block._checkpoint_wrapped_module
q = inner.self_attn.q_proj.weight
print(json.dumps({"wrapper": type(block).__name__, "fsdp_unit": isinstance(block, FSDPModule),
                  "mesh": list(q.device_mesh.mesh_dim_names), "placements": [str(p) for p in q.placements],
                  "dtensor": isinstance(q, DTensor)}))
"""


@pytest.mark.beside
def test_parallelize_composes_tensor_parallel_checkpointing_and_fsdp_in_its_order():
    """One process as rank 0 of 4 under torch's fake process group: after parallelize, each block is checkpointed
    around its tensor-parallel projections and is one FSDP2 unit, and its weights are DTensors on (dp_shard, tp)."""
    import json
    import subprocess
    import sys

    from tests.helpers import ROOT, env

    proc = subprocess.run([sys.executable, "-c", PARALLELIZED], cwd=ROOT, env=env(), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    # FSDP2 makes the checkpointed block its unit (the class becomes FSDP<its class>)
    assert out["wrapper"] == "FSDPCheckpointWrapper" and out["fsdp_unit"] is True and out["dtensor"] is True, out
    assert out["mesh"] == ["dp_shard", "tp"], out
    # q_proj split by output column over tp (S(0)), then FSDP2's rows of that over dp_shard (strided, _S(0, 2))
    assert out["placements"] == ["_S(0, 2)", "S(0)"], out
