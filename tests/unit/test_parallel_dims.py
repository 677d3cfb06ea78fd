"""The parallel degrees (dist_train/parallel_dims.py): one object, validated once, that every reader agrees with."""

from __future__ import annotations

import pytest

from dist_train.config import ConfigError
from dist_train.estimate.setup import IMPLIED, NOT_MODELLED, setup_from_config
from dist_train.parallel_dims import ParallelDims
from dist_train.strategies.registry import available, default_config


def test_degrees_that_do_not_multiply_to_the_world_are_one_line_naming_them():
    with pytest.raises(ConfigError) as err:
        ParallelDims(8, dp_shard=3, tp=2)
    assert str(err.value) == ("the parallel degrees (dp_shard 3 x tp 2 = 6) must multiply to the number of processes "
                              "(8)")
    with pytest.raises(ConfigError, match="ep=3 must divide dp_shard x cp = 4"):
        ParallelDims(4, dp_shard=4, ep=3)
    with pytest.raises(ConfigError, match="must be >= 1"):
        ParallelDims(4, dp_shard=4, tp=0)


def test_rank_layout_is_row_major_pp_dp_replicate_dp_shard_cp_tp():
    """torchtitan's order: a TP group is consecutive ranks (one node's GPUs), pipeline stages the farthest apart."""
    fsdp_tp = ParallelDims(8, dp_shard=4, tp=2)
    assert fsdp_tp.coordinates(5) == {"pp": 0, "dp_replicate": 0, "dp_shard": 2, "cp": 0, "tp": 1}
    assert fsdp_tp.group_ranks(5, "tp") == [4, 5]
    assert fsdp_tp.group_ranks(5, "dp_shard") == [1, 3, 5, 7]
    assert [fsdp_tp.data_parallel_rank(r) for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    pipeline = ParallelDims(8, pp=4, dp_replicate=2)  # rank = stage x replicas + replica
    assert [pipeline.coordinates(r)["pp"] for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert [pipeline.data_parallel_rank(r) for r in range(8)] == [0, 1] * 4
    assert pipeline.group_ranks(3, "pp") == [1, 3, 5, 7]
    hsdp = ParallelDims(8, dp_replicate=2, dp_shard=4)  # a replica is consecutive ranks, one node
    assert hsdp.group_ranks(6, "dp_shard") == [4, 5, 6, 7] and hsdp.group_ranks(6, "dp_replicate") == [2, 6]
    assert [hsdp.data_parallel_rank(r) for r in range(8)] == list(range(8))  # every rank its own slice
    assert hsdp.data_parallel == 8 and hsdp.mesh_dim_names == ("dp_replicate", "dp_shard") and hsdp.mesh_shape == (2, 4)


def test_the_batch_arithmetic_is_the_degrees():
    dims = ParallelDims(8, dp_shard=4, tp=2)
    assert dims.microbatches(global_batch_size=32, micro_batch_size=2) == 4  # 32 / (2 x 4 slices)
    assert dims.microbatches(global_batch_size=32, micro_batch_size=2, num_microbatches=8) == 8  # a schedule's own
    dims.check_batch(global_batch_size=32, micro_batch_size=2)
    with pytest.raises(ConfigError, match=r"global_batch_size=12 must be divisible by train.micro_batch_size \(2\) x "
                                          r"data-parallel size \(4\) = 8"):
        dims.check_batch(global_batch_size=12, micro_batch_size=2)


def _strategy_dict(name: str) -> dict:
    from dataclasses import asdict

    return asdict(default_config(name))


@pytest.mark.parametrize("name", sorted(available()))
def test_the_estimator_reads_the_same_degrees_as_training(name, monkeypatch):
    """The estimator's Setup and the strategy's own config give the same ParallelDims, at every world size the
    strategy takes: the degrees are described once (a family that changed its layout would fail here)."""
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")  # hsdp's default: one replica per node of 4
    config = default_config(name)
    if name in NOT_MODELLED:  # refused in one line rather than predicted wrong
        with pytest.raises(ValueError, match=f"strategy={name}: the estimator does not model"):
            setup_from_config({"strategy": _strategy_dict(name)}, world_size=4)
        return
    worlds = [1] if not config.needs_process_group else [2, 4, 8, 16]
    checked = 0
    for world in worlds:
        try:
            want = config.parallel_dims(world)
        except ConfigError:
            continue  # degrees that do not fit this world (fsdp_tp's tp=2 on 1 rank, ...)
        got = setup_from_config({"strategy": _strategy_dict(name)}, world_size=world).dims
        assert got == want, (name, world, got, want)
        if name in IMPLIED:  # named without its config (the advisor's candidates): what the name implies
            assert setup_from_config({}, world_size=world, strategy=name).dims == want, (name, world)
        assert config.data_parallel_size(world) == got.data_parallel
        checked += 1
    assert checked, name


def test_hsdp_is_one_replica_per_node_unless_told_and_refuses_one_replica(monkeypatch):
    from dist_train.strategies.fsdp import FSDPConfig

    hsdp = FSDPConfig(name="hsdp", replicate=None)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert hsdp.parallel_dims(32).describe() == "dp_replicate 4 x dp_shard 8"  # 4 nodes of 8
    with pytest.raises(ConfigError) as err:
        hsdp.check(8)  # one node
    assert str(err.value) == ("strategy=hsdp needs at least 2 replicas of at least 2 ranks; one per node gives 1 "
                              "replica(s) of 8 on 8 processes: set strategy.replicate (e.g. 2 with 4 processes) or "
                              "use strategy=fsdp")
    with pytest.raises(ConfigError, match=r"strategy.replicate=3 must divide the number of processes \(8\)"):
        FSDPConfig(name="hsdp", replicate=3).check(8)
    assert FSDPConfig(name="hsdp", replicate=2).parallel_dims(8).describe() == "dp_replicate 2 x dp_shard 4"
    assert FSDPConfig().parallel_dims(8).describe() == "dp_shard 8"  # plain fsdp: one replica


def test_each_layout_is_declared_once_and_the_state_it_shards_is_zeros_arithmetic():
    """parallel_dims.layout_dims is what the strategies' parallel_dims and the estimator's Setup.dims return (the
    test above checks the two agree); what each parallelism over dp_shard partitions (parallel/catalog.py,
    tests/unit/test_parallel_catalog.py) is what the estimator's memory model divides by dp_shard."""
    from dist_train.estimate.memory import shards
    from dist_train.estimate.setup import Setup
    from dist_train.parallel_dims import layout_dims

    assert layout_dims("fsdp", 16, replicas=2).describe() == "dp_replicate 2 x dp_shard 8"
    assert layout_dims("pipeline", 8, stages=4, stage_dp="dp_shard").describe() == "pp 4 x dp_shard 2"
    assert layout_dims("fsdp_tp", 2, tp=2).mesh_dim_names == ("dp_shard", "tp")  # FSDP kept at degree 1
    with pytest.raises(ValueError, match="layout 'ep' unknown; known: one, replicate"):
        layout_dims("ep", 8)
    z1 = shards(Setup(strategy="zero1", family="zero", zero_stage=1, world_size=8))
    hsdp = shards(Setup(strategy="hsdp", family="fsdp", world_size=8, replicate=2))
    assert (z1.weights, z1.grads, z1.optimizer) == (1, 1, 8) and (hsdp.weights, hsdp.optimizer) == (4, 4)
