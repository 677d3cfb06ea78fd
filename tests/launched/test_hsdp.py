"""HSDP (strategy=hsdp): 2 replicas x 2 shards on 4 processes against one process: same losses, half the model
state per rank, each collective on its mesh dimension, the estimator's prediction, and a bit-exact resume."""

from __future__ import annotations

import pytest

from dist_train.checkpoint.layout import step_dir_name
from tests.conftest import CHECKPOINTED
from tests.helpers import FAST, assert_same_losses, compare_from, last_step, train_ok


HSDP = ["strategy=hsdp", "strategy.replicate=2"]


@pytest.mark.beside  # balances tests/suite.sh's two sessions (the launched one reached 24:02 on a fresh clone of 5401e40)
def test_hsdp_on_2x2_matches_single_holds_half_and_names_each_dimensions_traffic(straight_run, tmp_path):
    single_dir, single = straight_run("single")
    run_dir = tmp_path / "hsdp"
    s = train_ok([*HSDP, *CHECKPOINTED], run_dir=run_dir, nproc=4)
    assert_same_losses(single, s, steps=8)
    assert s["world_size"] == 4 and s["data_parallel_size"] == 4  # every rank trains its own quarter of the batch
    n = s["num_params"]
    for rec in last_step(run_dir):
        # sharded within a replica (2 ranks), not across the 4: half of the fp32 weights, gradients, AdamW's moments
        assert rec["memory/params_bytes"] == rec["memory/grads_bytes"] == 4 * n // 2, rec["rank"]
        assert 8 * n // 2 <= rec["memory/optimizer_bytes"] <= 8 * n // 2 + 1024  # + AdamW's step counters
        # FSDP's gathers and reduce-scatter inside the replica, one per step (1 micro-batch a rank) ...
        assert rec["comm/dp_shard/reduce_scatter/bytes"] == rec["comm/reduce_scatter/bytes"] == 4 * n
        assert rec["comm/dp_shard/all_gather/bytes"] == rec["comm/all_gather/bytes"] > 0
        # ... and across the replicas only each rank's gradient shard, all-reduced once a step
        assert rec["comm/dp_replicate/all_reduce/bytes"] == 4 * n // 2
        assert rec.get("comm/dp_replicate/all_gather/bytes", 0) == 0
    rows = compare_from(tmp_path / "compare", single_dir, run_dir)
    assert rows["hsdp"]["prediction_ok"] is True, rows["hsdp"]
    assert rows["hsdp"]["agrees"] is True, rows["hsdp"]["verdict"]

    step4 = run_dir / "checkpoints" / step_dir_name(4)
    resumed = train_ok([*HSDP, *FAST, "train.steps=8", f"checkpoint.resume={step4}"],
                       run_dir=tmp_path / "resumed", nproc=4)
    assert resumed["losses"] == s["losses"]
