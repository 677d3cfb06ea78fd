"""What each parallelism shards and sends, declared once (dist_train/parallel/catalog.py), and the estimator reading it.

tests/launched/test_dryrun.py checks the declarations against what each strategy's real code issues (per op, per mesh
dimension, per byte); these check how the declarations compose and that the estimator sizes exactly what they say."""

from __future__ import annotations

import pytest

from dist_train.config import ModelConfig
from dist_train.estimate.comm import SIZERS, predict_comm
from dist_train.estimate.setup import IMPLIED, KNOWN_STRATEGIES, Setup
from dist_train.estimate.shapes import ModelShape
from dist_train.estimate.compose import model_config
from dist_train.parallel.catalog import EXPERT_NORM, GRADIENT_NORM, PARALLELISMS, composition
from dist_train.parallel_dims import ParallelDims

SHAPE = ModelShape.from_config(ModelConfig())
MOE_SHAPE = ModelShape.from_config(model_config("tiny_moe"))


def _setup(name: str, world_size: int, **fields) -> Setup:
    family, stage, schedule = KNOWN_STRATEGIES[name]
    return Setup(strategy=name, family=family, zero_stage=stage, schedule=schedule, world_size=world_size,
                 global_batch_size=4 * world_size, micro_batch_size=1, seq_len=64, **fields)


@pytest.mark.parametrize(("name", "world_size", "fields", "expected"), [
    ("single", 1, {}, ()),
    ("dp", 1, {}, ()),
    ("ddp", 8, {}, ("replicate",)),
    ("zero1", 8, {}, ("zero1",)),
    ("zero3", 8, {}, ("zero3",)),
    ("fsdp", 8, {}, ("fsdp",)),
    ("hsdp", 8, {"replicate": 2}, ("fsdp", "replicate")),
    ("tp", 4, {}, ("tp",)),
    ("tp", 4, {"sequence_parallel": True}, ("sequence_parallel",)),
    ("fsdp_tp", 8, {"tp": 4}, ("tp", "fsdp")),
    ("tp", 4, {"ep": 2}, ("tp", "ep", "expert_shares", "expert_fsdp")),
    ("gpipe", 4, {}, ("pipeline",)),
    ("pp_dp", 8, {"pp": 4}, ("pipeline", "replicate")),
    ("pp_dp", 8, {"pp": 4, "dp_mode": "fsdp"}, ("pipeline", "fsdp")),
    ("accelerate", 8, {"plugin": "fsdp"}, ("fsdp",)),
    ("accelerate", 8, {}, ("replicate",)),
])
def test_a_run_is_a_composition_of_the_declared_parallelisms(name, world_size, fields, expected):
    """No strategy has an entry of its own: fsdp_tp is tensor parallelism then FSDP, hsdp FSDP then replicas, pp_dp a
    pipeline then replicas or FSDP of each stage, in the order parallel/apply.py applies them."""
    setup = _setup(name, world_size, **fields)
    assert tuple(p.name for p in setup.parallelisms) == expected
    for p in setup.parallelisms:  # the run's mesh, or the experts' own (ep, efsdp)
        assert p.dim in setup.dims.mesh_dim_names + (setup.dims.expert_dims if setup.ep > 1 else ())


def test_the_estimator_sizes_every_declared_collective_and_nothing_else():
    """Each parallelism has one sizer, which returns exactly the (op, moves) its declaration lists; every collective
    predicted carries the declaration's dimension, group and overlap. Together the setups below cover every entry."""
    assert set(SIZERS) == set(PARALLELISMS)
    setups = [_setup("ddp", 8), _setup("zero1", 8), _setup("zero2", 8), _setup("zero3", 8), _setup("fsdp", 8),
              _setup("tp", 4), _setup("tp", 4, sequence_parallel=True), _setup("gpipe", 4)]
    covered = set()
    for setup in setups:
        (p,) = setup.parallelisms
        covered.add(p.name)
        stage = 0 if p.name == "pipeline" else None
        sized = SIZERS[p.name](SHAPE, setup, stage)
        assert list(sized) == [(t.op, t.moves) for t in p.traffic if t is not GRADIENT_NORM]
        colls = predict_comm(SHAPE, setup)[0]  # less what this model does not issue (tp: per-head norms)
        issued = [t for t in p.traffic if t is GRADIENT_NORM or sized[(t.op, t.moves)].calls]
        assert [(c.moves, c.overlaps, c.dim) for c in colls] == [(t.moves, t.overlaps, p.dim) for t in issued]
        assert all(c.group_size == (2 if c.op in ("send", "recv") else setup.dims.degree(p.dim)) for c in colls)
    # expert parallelism composes three: the experts split over ep, their FSDP2 over efsdp, FSDP2 over the rest
    ep = _setup("fsdp_ep", 8, ep=2)
    assert [p.name for p in ep.parallelisms] == ["ep", "expert_fsdp", "fsdp"]
    for p in ep.parallelisms:
        covered.add(p.name)
        sized = SIZERS[p.name](MOE_SHAPE, ep, None)
        assert list(sized) == [(t.op, t.moves) for t in p.traffic if t not in (GRADIENT_NORM, EXPERT_NORM)]
    colls = predict_comm(MOE_SHAPE, ep)[0]  # the experts' norm: one all-reduce over (efsdp, ep), flattened
    assert [(c.op, c.moves, c.dim, c.group_size) for c in colls] == [
        ("all_to_all", "tokens", "ep", 2),
        ("all_gather", "expert parameters", "efsdp", 4), ("reduce_scatter", "expert gradients", "efsdp", 4),
        ("all_gather", "parameters", "dp_shard", 8), ("reduce_scatter", "gradients", "dp_shard", 8),
        ("all_reduce", "gradient norm", "dp_shard", 8), ("all_reduce", "expert gradient norm", "", 8)]
    # over replicas (strategy=ep): the experts split over ep, their replicas over edp, the dense replicas over the rest
    ep = _setup("ep", 8, **IMPLIED["ep"])
    assert [p.name for p in ep.parallelisms] == ["ep", "expert_replicate", "replicate"]
    covered.update(p.name for p in ep.parallelisms)
    assert [(c.op, c.moves, c.dim, c.group_size, c.calls) for c in predict_comm(MOE_SHAPE, ep)[0]] == [
        ("all_to_all", "tokens", "ep", 2, 5 * MOE_SHAPE.num_layers * ep.microbatches_per_step),
        ("all_reduce", "expert gradients", "edp", 4, MOE_SHAPE.num_layers),
        ("all_reduce", "gradients", "dp_replicate", 8, MOE_SHAPE.num_layers + 1),
        ("all_reduce", "expert gradient norm", "ep", 2, 1)]
    # beside tensor parallelism (fsdp_tp, strategy.ep): each TP rank's share of the tokens, gathered back over tp;
    # Qwen3's per-head norms' gradients all-reduced over tp in each micro-batch's backward
    tp_ep = _setup("fsdp_tp", 8, tp=2, ep=2)
    assert [p.name for p in tp_ep.parallelisms] == ["tp", "ep", "expert_shares", "expert_fsdp", "fsdp"]
    covered.update(p.name for p in tp_ep.parallelisms)
    m, layers = tp_ep.microbatches_per_step, MOE_SHAPE.num_layers
    assert [(c.op, c.moves, c.dim, c.group_size, c.calls) for c in predict_comm(MOE_SHAPE, tp_ep)[0]] == [
        ("all_reduce", "activations", "tp", 2, 4 * layers * m), ("all_reduce", "vocabulary", "tp", 2, 5 * m),
        ("all_reduce", "norm gradients", "tp", 2, 2 * layers * m),
        ("all_to_all", "tokens", "ep", 2, 5 * layers * m),
        ("all_gather", "expert outputs", "tp", 2, 3 * layers * m),
        ("all_gather", "expert parameters", "efsdp", 4, 2 * layers * m),
        ("reduce_scatter", "expert gradients", "efsdp", 4, layers),
        ("all_gather", "parameters", "dp_shard", 4, 2 * layers * m + m),
        ("reduce_scatter", "gradients", "dp_shard", 4, layers + 1), ("all_reduce", "gradient norm", "", 8, 1),
        ("all_reduce", "expert gradient norm", "", 8, 1)]
    assert covered == set(PARALLELISMS)


def test_zero_1_and_2_reduce_as_deepspeed_does_or_as_the_paper_says():
    """The declaration names DeepSpeed's all-reduce and the paper's reduce-scatter; the regime picks."""
    for regime, op in (("auto", "all_reduce"), ("mixed", "reduce_scatter")):
        colls = predict_comm(SHAPE, _setup("zero2", 8, regime=regime))[0]
        assert [c.op for c in colls if c.moves == "gradients"] == [op]


def test_one_gradient_norm_per_rank_over_every_dimension_that_splits_the_gradients():
    """Measured (tests/launched/test_dryrun.py): fsdp's norm runs over dp_shard; fsdp_tp's over tp x dp_shard at once,
    which telemetry counts under no one dimension; hsdp's replicas hold whole gradient shards, so not over them; ddp's
    gradients are whole after their all-reduce: no norm collective."""
    def norms(setup: Setup) -> list[tuple[str, int]]:
        return [(c.dim, c.group_size) for c in predict_comm(SHAPE, setup)[0] if c.moves == "gradient norm"]

    assert norms(_setup("fsdp", 8)) == [("dp_shard", 8)]
    assert norms(_setup("fsdp_tp", 8, tp=4)) == [("", 8)]
    assert norms(_setup("hsdp", 8, replicate=2)) == [("dp_shard", 4)]
    assert norms(_setup("ddp", 8)) == []
    assert norms(_setup("pp_dp", 8, pp=4, dp_mode="fsdp")) == [("", 8)]
    assert norms(_setup("pp_dp", 8, pp=4)) == [("pp", 4)]


def test_a_dimension_of_one_rank_sends_nothing():
    """FSDP2 issues no collective over a group of one (torch's _fsdp_param_group and foreach_reduce skip them):
    fsdp_tp on as many ranks as its tp degree keeps FSDP in the mesh, and sends only tensor-parallel traffic. The
    estimator predicted FSDP's gathers and reduce-scatters there before the catalog; the dry run never saw them."""
    colls = predict_comm(SHAPE, _setup("fsdp_tp", 2, tp=2))[0]
    assert {c.dim for c in colls} == {"tp"}
    assert composition(ParallelDims(2, dp_shard=1, tp=2, kept=("dp_shard",)), shard_with="fsdp")[-1].name == "fsdp"


def test_what_each_sharding_partitions_is_zeros_arithmetic():
    assert [PARALLELISMS[f"zero{s}"].partitions for s in (1, 2, 3)] == [
        ("optimizer",), ("grads", "optimizer"), ("weights", "grads", "optimizer")]
    assert PARALLELISMS["fsdp"].partitions == ("weights", "grads", "optimizer")
    assert PARALLELISMS["replicate"].partitions == ()
    with pytest.raises(ValueError, match="shard over dp_shard: say with what"):
        composition(ParallelDims(4, dp_shard=4))


def test_zero3_reduces_its_norm_once_per_sub_group():
    """DeepSpeed ZeRO-3 all-reduces one fp64 norm per sub-group of its partition (sub_group_size, 1e9 elements by
    default): Llama-2-70B's rank holds 1.08e9 elements on 64 ranks (2 sub-groups: 16 B, as the dry run at scale
    measured, docs/BENCHMARKS.md) and 68M on 1,024 (one: 8 B)."""
    from dist_train.estimate.shapes import PRESETS

    def norm(world_size: int, **fields) -> list[tuple[float, int]]:
        setup = Setup(strategy="zero3", family="zero", zero_stage=3, world_size=world_size, seq_len=1024, **fields)
        return [(c.bytes, c.calls) for c in predict_comm(PRESETS["70b"], setup)[0] if c.moves == "gradient norm"]

    assert norm(64) == [(16, 2)] and norm(1024) == [(8, 1)]
    assert norm(1024, zero3_sub_group_size=10**7) == [(8 * 7, 7)]
