"""An MoE model (model=tiny_moe: Qwen3-MoE, 8 experts, top-2, every layer MoE) under the strategies that run one:
the same losses as one process, and the estimator's figures for each rank (compare.from); and under expert
parallelism (strategy=fsdp_ep), the same losses, gradient norms and, after the last step, every expert's and router's
weights, with its all-to-alls counted and timed; and beside tensor parallelism (tp, fsdp_tp with strategy.ep), the
same."""

from __future__ import annotations

import functools
import json
from dataclasses import replace
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from dist_train.checkpoint.layout import step_dir_name
from dist_train.estimate import ModelShape, setup_from_config
from dist_train.estimate.comm import predict_comm
from dist_train.estimate.memory import ep_dispatch_bytes, expert_param_bytes, expert_state_bytes
from dist_train.estimate.setup import Setup
from tests.helpers import FAST, ROOT, assert_same_losses, compare_from, forked, last_step, metrics, train_ok
from tests.launched.test_dryrun import dry_run
from tests.moe_support import gpt_oss_dir, qwen2_moe_dir

# 5 steps of 2 micro-batches of 2 x 64 tokens, a checkpoint after the last
MOE = [*FAST, "model=tiny_moe", "checkpoint.every_steps=5"]


@pytest.fixture(scope="module")
def single_moe(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("moe-single")
    return run_dir, train_ok(["strategy=single", *MOE], run_dir=run_dir)


# Weights compared after plain SGD: Adam divides each gradient by its own running size, so an element whose gradient
# is float noise (an expert's row that few tokens reached) moves by up to the learning rate either way.
SGD = ["optimizer=sgd", "train.lr=0.05"]


@pytest.fixture(scope="module")
def single_moe_sgd(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("moe-single-sgd")
    return run_dir, train_ok(["strategy=single", *MOE, *SGD], run_dir=run_dir)


@functools.lru_cache(maxsize=None)
def _exported(run_dir: Path, out: Path) -> dict:
    """The weights after the last step, as launch/export.py writes them for transformers (dist_train.export, which
    it runs: any strategy's checkpoint, read in this process). Cached: one process's run is compared by several
    tests (launch/export.py itself is tested in tests/launched/test_checkpoint.py and test_export_lora.py)."""
    from safetensors.torch import load_file

    from dist_train.export import export_pretrained

    export_pretrained(run_dir / "checkpoints" / step_dir_name(5), out)
    return load_file(out / "model.safetensors")


def _assert_dry_run_equals(overrides: list[str], real: dict, *, nproc: int, a2a: float = 0.0) -> None:
    """The dry run of the same config (estimate/dryrun: the real code under a fake group and FakeTensorMode, routing
    balanced) against the real run's summary, first and last rank: parameters, gradients and optimizer state, and
    every collective's calls and bytes per step; the all-to-alls' bytes, which follow the routing, are `a2a` (the
    estimator's balanced figure) in the dry run."""
    proc = dry_run(overrides, world_size=nproc, ranks=[0, nproc - 1])
    assert proc.returncode == 0, proc.stderr[-3000:]
    for got in json.loads(proc.stdout)["dryrun"]["ranks"]:
        measured, want = got["measured"], real["ranks"][got["rank"]]
        for key in ("memory/params_bytes", "memory/grads_bytes", "memory/optimizer_bytes"):
            assert measured[key] == want[key], (got["rank"], key)
        for key, value in want.items():
            if key.startswith("comm/") and key.endswith(("/count", "/bytes")) and value:
                expected = a2a if key.endswith("all_to_all/bytes") else value
                assert measured[key] == expected, (got["rank"], key, measured[key], expected)


def _assert_ops_as_predicted(rec: dict, predicted: list) -> None:
    """One rank's calls of each collective op as the estimator's list for it, and its bytes but the all-to-alls'
    (which follow the routing: the callers compare them summed over an EP group)."""
    for op in ("all_gather", "reduce_scatter", "all_reduce", "all_to_all"):
        assert rec[f"comm/{op}/count"] == sum(c.calls for c in predicted if c.op == op), op
        if op != "all_to_all":
            assert rec[f"comm/{op}/bytes"] == sum(c.bytes for c in predicted if c.op == op), op


def _grad_norms(run_dir: Path) -> list[float]:
    return [r["grad_norm"] for r in metrics(run_dir) if r["rank"] == 0]


def _assert_trains_as_one_process(run_dir: Path, s: dict, single_run: tuple[Path, dict], tmp_path: Path, *,
                                  routed: int = 4 * (8 * 3 + 1)) -> None:
    """The run's loss and gradient norm of every step within 1e-6 of one process's on the same global batch, and
    every expert's and router's weights after the last step (as launch/export.py writes them): `routed` tensors,
    tiny_moe's by default (per layer each expert's gate, up and down projection, which transformers saves one by
    one, and the router)."""
    single_dir, single = single_run
    for got, want in zip(s["losses"], single["losses"], strict=True):
        assert abs(got - want) < 1e-6, (s["losses"], single["losses"])
    for got, want in zip(_grad_norms(run_dir), _grad_norms(single_dir), strict=True):
        assert abs(got - want) < 1e-6 * want, (_grad_norms(run_dir), _grad_norms(single_dir))
    ours, theirs = _exported(run_dir, tmp_path / "ours"), _exported(single_dir, single_dir / "exported")
    names = [n for n in theirs if ".mlp.experts." in n or ".mlp.gate." in n or ".mlp.router." in n]
    assert len(names) == routed, names
    for name in names:
        assert ours[name].shape == theirs[name].shape, name
        assert (ours[name] - theirs[name]).abs().max() < 1e-6, (name, (ours[name] - theirs[name]).abs().max())


@pytest.mark.beside  # all: balances tests/suite.sh's two sessions
@pytest.mark.parametrize("strategy", ["fsdp_ep", "ep"])
@pytest.mark.parametrize("nproc", [2, 4])
def test_expert_parallel_trains_as_one_process_to_every_expert_weight(strategy, nproc, single_moe_sgd, tmp_path):
    """strategy=fsdp_ep, ep=2: on 2 ranks each holds 4 of the 8 experts (efsdp 1); on 4 ranks, each pair of ranks
    holding the same 4 shards them again (efsdp 2, FSDP2's forced-sum path). strategy=ep, ep=2: the dense weights
    whole on every rank; on 4 ranks each pair holding the same 4 experts all-reduces their gradients (edp 2, FSDP2's
    replicate, whose forced-sum path would divide them twice: measured). Against one process on the same global
    batch: the loss and the gradient norm of every step within 1e-6, and each expert's and router's weights after
    the last step (after SGD: see SGD). A loss alone would hardly do: the classic bug, expert gradients scaled by the
    expert group's size instead of the number of batches, moved the step-2 loss by 5e-6 here (measured on 2 ranks,
    dividing by world / 2), which this test's 1e-6 catches; the weights and gradient norms are compared too."""
    single_dir, single = single_moe_sgd
    run_dir = tmp_path / strategy
    s = train_ok([f"strategy={strategy}", "strategy.ep=2", *MOE, *SGD], run_dir=run_dir, nproc=nproc)
    assert s["data_parallel_size"] == nproc
    _assert_trains_as_one_process(run_dir, s, single_moe_sgd, tmp_path)

    # The all-to-alls, per MoE layer and micro-batch: the counts, the rows there and back, both mirrored in backward
    layers, micro, tokens, k, hidden = 4, 8 // (2 * nproc), 2 * 64, 2, 64  # a global batch of 8, micro-batches of 2
    ranks = last_step(run_dir)
    for rec in ranks:
        assert rec["comm/ep/all_to_all/count"] == rec["comm/all_to_all/count"] == 5 * layers * micro
        assert rec["comm/ep/all_to_all/time_s"] > 0
    # over an ep group, every row sent is received once: its ranks send 4 x T x k rows of h fp32 per layer and
    # micro-batch (forward and backward, there and back), plus the counts, 8 int64 each
    for group in ([0, 1], [2, 3])[: nproc // 2]:
        sent = sum(ranks[r]["comm/ep/all_to_all/bytes"] for r in group)
        assert sent == len(group) * layers * micro * (4 * tokens * k * hidden * 4 + 8 * 8)
        # The router's load on each rank's own tokens (telemetry/moe.py), and what each rank's 4 experts received
        # from its group: its overload, received over routed (1 when balanced).
        for pos, r in enumerate(group):
            for layer in range(layers):
                counts = ranks[r][f"moe/layer{layer}/tokens_per_expert"]
                assert len(counts) == 8 and sum(counts) == micro * tokens * k
                received = sum(sum(ranks[s][f"moe/layer{layer}/tokens_per_expert"][4 * pos:4 * pos + 4]) for s in group)
                assert ranks[r][f"moe/layer{layer}/ep_overload"] == pytest.approx(received / (micro * tokens * k))
    # each rank stores 4 of the 8 experts of each layer (4 x 4 x 3 x 64 x 32 fp32), under fsdp_ep halved again by
    # efsdp on 4 ranks, as the estimator predicts them (estimate/memory.py expert_param_bytes)
    config = OmegaConf.to_container(OmegaConf.load(run_dir / "config.yaml"), resolve=True)
    shape, setup = ModelShape.from_config(config["model"]), setup_from_config(config, world_size=nproc)
    share = nproc if strategy == "fsdp_ep" else 2
    assert [rec["memory/expert_params_bytes"] for rec in ranks] == [4 * 8 * 3 * 64 * 32 * 4 // share] * nproc == (
        [expert_param_bytes(shape, setup)] * nproc)
    # and their gradients and SGD's momentum buffers (conf/optimizer/sgd.yaml), the same shards in fp32, as the
    # estimator predicts them apart (expert_state_bytes)
    state = expert_state_bytes(shape, setup)
    assert [(r["memory/expert_grads_bytes"], r["memory/expert_optimizer_bytes"]) for r in ranks] == (
        [(4 * 8 * 3 * 64 * 32 * 4 // share,) * 2] * nproc) == [(state["grads"], state["optimizer"])] * nproc
    # The peak of live tensors (estimate/memory.py predict_peak_live: the dense weights gathered as FSDP2 or its
    # replicate holds them, the experts over their own group) within 10% on every rank, whose routing is not the
    # estimator's balanced one
    peak = s["predicted_memory_bytes"]["peak_live"]
    for rank in s["ranks"]:
        assert abs(rank["memory/peak_live_bytes"] - peak) <= 0.10 * peak, (peak, rank["memory/peak_live_bytes"])

    # The estimator's collectives for this run (estimate/comm.py): each rank's gathers, reductions and norms exactly,
    # calls and bytes; the all-to-alls at balanced routing, which each EP group's ranks send together exactly
    predicted = predict_comm(shape, setup)[0]
    for rec in ranks:
        _assert_ops_as_predicted(rec, predicted)
        if nproc == 4:  # the experts' FSDP, or their replicas' all-reduce, over its own ranks
            key = "efsdp/all_gather" if strategy == "fsdp_ep" else "edp/all_reduce"
            dim, op = key.split("/")
            assert rec[f"comm/{key}/bytes"] == sum(c.bytes for c in predicted if c.dim == dim and c.op == op) > 0
    a2a = sum(c.bytes for c in predicted if c.op == "all_to_all")
    for group in ([0, 1], [2, 3])[: nproc // 2]:
        assert sum(ranks[r]["comm/all_to_all/bytes"] for r in group) == len(group) * a2a
    if nproc == 2:  # each rank's parameters, gradients and optimizer state as the estimator predicts them
        rows = compare_from(tmp_path / "compare", single_dir, run_dir)
        assert rows[strategy]["model_state_ok"] is True, rows[strategy]
    # the dry run (balanced routing) as the real run, its first and last rank; its all-to-alls are the estimator's
    _assert_dry_run_equals([f"strategy={strategy}", "strategy.ep=2", *MOE, *SGD], s, nproc=nproc, a2a=a2a)


@pytest.mark.beside
@pytest.mark.parametrize(("strategy", "nproc"), [("tp", 2), ("fsdp_tp", 4)])
def test_tensor_parallel_splits_the_experts_by_expert_as_one_process(strategy, nproc, single_moe_sgd, tmp_path):
    """strategy.ep=2 beside tensor parallelism of degree 2: attention split by heads and the routers whole on each TP
    rank, the experts split by expert over the same 2 ranks (tp: efsdp 1; fsdp_tp on 4 ranks: efsdp 2, FSDP2's
    forced-sum path, over the data-parallel pair). The TP ranks hold the same tokens: each sends its half to the
    experts and the results are all-gathered. Against one process on the same global batch: the loss and the
    gradient norm of every step within 1e-6, and every expert's and router's weights after the last step. Dispatching
    every token from both TP ranks would double the experts' gradients; gathering the shares' gradients on one rank
    only would leave the router's a half on each."""
    single_dir, single = single_moe_sgd
    run_dir = tmp_path / strategy
    degrees = ["strategy.tp=2"] if strategy == "fsdp_tp" else []
    s = train_ok([f"strategy={strategy}", *degrees, "strategy.ep=2", *MOE, *SGD], run_dir=run_dir, nproc=nproc)
    assert s["data_parallel_size"] == nproc // 2
    _assert_trains_as_one_process(run_dir, s, single_moe_sgd, tmp_path)

    # Per MoE layer and micro-batch, on each rank: 5 all-to-alls over ep (the counts, its half of the rows there and
    # back, both mirrored in backward), and 3 all-gathers over tp: the halves' outputs forward, their input and
    # routing weights' gradients backward, each the whole micro-batch's rows
    layers, micro, tokens, k, hidden = 4, 8 // (2 * (nproc // 2)), 2 * 64, 2, 64
    ranks = last_step(run_dir)
    for rec in ranks:
        assert rec["comm/ep/all_to_all/count"] == 5 * layers * micro
        assert rec["comm/tp/all_gather/count"] == 3 * layers * micro
        assert rec["comm/tp/all_gather/bytes"] == layers * micro * (2 * tokens * hidden + tokens * k) * 4
    for group in ([0, 1], [2, 3])[: nproc // 2]:  # an ep group, here a tp group: each rank sends half the tokens
        sent = sum(ranks[r]["comm/ep/all_to_all/bytes"] for r in group)
        assert sent == len(group) * layers * micro * (4 * tokens // 2 * k * hidden * 4 + 8 * 8)
        for r in group:  # the router's load on the half each rank dispatches; the group's adds up to its tokens
            for layer in range(layers):
                assert sum(ranks[r][f"moe/layer{layer}/tokens_per_expert"]) == micro * tokens // 2 * k
    # summary.json's run-wide load: every (token, expert) pair of the 5 steps of 8 x 64 tokens, top-2, once
    assert [sum(v["tokens_per_expert"]) for v in s["moe_load"].values()] == [5 * 8 * 64 * 2] * 4
    # each rank stores 4 of the 8 experts of each layer, halved again by efsdp on 4 ranks, and their gradients and
    # SGD's momentum as the estimator predicts them (estimate/memory.py expert_state_bytes)
    config = OmegaConf.to_container(OmegaConf.load(run_dir / "config.yaml"), resolve=True)
    shape, setup = ModelShape.from_config(config["model"]), setup_from_config(config, world_size=nproc)
    state = expert_state_bytes(shape, setup)
    assert [(r["memory/expert_params_bytes"], r["memory/expert_grads_bytes"], r["memory/expert_optimizer_bytes"])
            for r in ranks] == [(4 * 8 * 3 * 64 * 32 * 4 // nproc,) * 3] * nproc == (
        [(state["params"], state["grads"], state["optimizer"])] * nproc)
    # The estimator's collectives (parallel/catalog.py's tp, ep, expert_shares, expert_fsdp and fsdp): every rank's
    # calls and bytes of each op exactly, the all-to-alls' bytes at balanced routing, which each ep group sends
    # together exactly; the peak of live tensors within 10% on every rank
    predicted = predict_comm(shape, setup)[0]
    for rec in ranks:
        assert rec["comm/tp/all_gather/bytes"] == sum(c.bytes for c in predicted if c.moves == "expert outputs")
        _assert_ops_as_predicted(rec, predicted)
    a2a = sum(c.bytes for c in predicted if c.op == "all_to_all")
    for group in ([0, 1], [2, 3])[: nproc // 2]:
        assert sum(ranks[r]["comm/all_to_all/bytes"] for r in group) == len(group) * a2a
    peak = s["predicted_memory_bytes"]["peak_live"]
    for rank in s["ranks"]:
        assert abs(rank["memory/peak_live_bytes"] - peak) <= 0.10 * peak, (peak, rank["memory/peak_live_bytes"])
    if nproc == 2:  # parameters, gradients and optimizer state as predicted
        rows = compare_from(tmp_path / "compare", single_dir, run_dir)
        assert rows[strategy]["model_state_ok"] is True, rows[strategy]
    # the dry run as the real run, its first and last rank
    _assert_dry_run_equals([f"strategy={strategy}", "strategy.ep=2", *MOE, *SGD], s, nproc=nproc, a2a=a2a)


# ddp (its buckets hold the stacked experts like any parameter), FSDP2 (one block, experts included, per all-gather),
# DeepSpeed's ZeRO-3 (its own partitioning of the 3-D expert tensors) and a pipeline (1F1B over 2 stages).
# Directories of the architectures whose experts differ from tiny_moe's (tests/moe_support.py): how each is made,
# its parameters, and the tensors compared after the last step, per layer (GPT-OSS: the two stacked matrices and their
# biases, and the router's weight and bias; Qwen2-MoE: each expert's three projections, saved apart, and the router)
OTHER_MOE = {"gpt_oss": (gpt_oss_dir, 159_448, 4 + 2, 3 * 64 * 32 + 2 * 32 + 64),
             "qwen2_moe": (qwen2_moe_dir, 181_952, 8 * 3 + 1, 3 * 64 * 32)}


@pytest.mark.beside
@pytest.mark.parametrize("arch", sorted(OTHER_MOE))
def test_other_moe_architectures_train_under_expert_parallelism_as_one_process_and_are_predicted(
        arch, tmp_path_factory, tmp_path):
    """GPT-OSS: experts stored in x out with a bias on each projection, gate and up interleaved and clamped, a biased
    router, attention sinks; the dispatch runs each expert as its class declares (parallel/experts.py one_expert) and
    splits the biases by expert with the matrices. Qwen2-MoE: a shared expert beside the routed ones, dense, and
    routing weights not renormalised. Under fsdp_ep on 2 ranks (ep 2), against one process: the loss and gradient
    norm of every step within 1e-6, and after the last step every expert's tensors and the router's. Each rank's
    experts' bytes, its collectives, its model state (compare.from) and the dry run are the estimator's, biases,
    sinks and shared expert counted."""
    make, num_params, routed, per_expert = OTHER_MOE[arch]
    model_dir = make(tmp_path_factory.mktemp(arch))
    overrides = [*FAST, "model=hf", f"model.path={model_dir}", "checkpoint.every_steps=5", *SGD]
    single = (tmp_path / "single", train_ok(["strategy=single", *overrides], run_dir=tmp_path / "single"))
    run_dir = tmp_path / "fsdp_ep"
    s = train_ok(["strategy=fsdp_ep", "strategy.ep=2", *overrides], run_dir=run_dir, nproc=2)
    _assert_trains_as_one_process(run_dir, s, single, tmp_path, routed=2 * routed)

    config = OmegaConf.to_container(OmegaConf.load(run_dir / "config.yaml"), resolve=True)
    shape, setup = ModelShape.from_config(config["model"]), setup_from_config(config, world_size=2)
    assert s["num_params"] == shape.num_params == num_params
    state = expert_state_bytes(shape, setup)
    ranks = last_step(run_dir)
    for rec in ranks:  # 4 of the 8 experts of each of the 2 layers, biases included, and their SGD momentum
        assert rec["memory/expert_params_bytes"] == expert_param_bytes(shape, setup) == 2 * 4 * per_expert * 4
        assert (rec["memory/expert_grads_bytes"], rec["memory/expert_optimizer_bytes"]) == (
            state["grads"], state["optimizer"])
    predicted = predict_comm(shape, setup)[0]
    for rec in ranks:
        _assert_ops_as_predicted(rec, predicted)
    a2a = sum(c.bytes for c in predicted if c.op == "all_to_all")
    assert sum(rec["comm/all_to_all/bytes"] for rec in ranks) == 2 * a2a
    rows = compare_from(tmp_path / "compare", single[0], run_dir)
    assert rows["fsdp_ep"]["model_state_ok"] is True, rows["fsdp_ep"]
    _assert_dry_run_equals(["strategy=fsdp_ep", "strategy.ep=2", *overrides], s, nproc=2, a2a=a2a)


@pytest.mark.beside
def test_compiled_expert_parallel_blocks_train_as_one_process(single_moe, tmp_path):
    """train.compile=true under fsdp_ep: each block compiled before the experts are split and FSDP2 shards it. The
    dispatch runs eager (torch.compiler.disable), so dynamo breaks the block's graph around it; the losses are one
    process's, the all-to-alls counted as an eager run's (5 a layer and micro-batch), and the router-load meter, whose
    hook runs eager there too, counts every pair each rank routed, its overload the rows its experts received."""
    single_dir, single = single_moe
    # 2 of the 5 steps: compiling took most of the 5 (31 s of the suite, up to 74 on a busy machine)
    s = train_ok(["strategy=fsdp_ep", "train.compile=true", *MOE, "train.steps=2"], run_dir=tmp_path, nproc=2)
    assert_same_losses({**single, "losses": single["losses"][:2]}, s, steps=2)
    # every gradient, the experts' included, as one process's (a loss moves too little): the first step's norm,
    # before AdamW's per-element division lifts the compiled kernels' float noise (step 2: 3.3e-6 apart, measured)
    got, want = _grad_norms(tmp_path)[0], _grad_norms(single_dir)[0]
    assert abs(got - want) < 1e-6 * want, (_grad_norms(tmp_path), _grad_norms(single_dir))
    ranks = last_step(tmp_path)
    for rec in ranks:
        assert rec["comm/ep/all_to_all/count"] == 5 * 4 * 2
    # each rank routes its 2 micro-batches of 2 x 64 tokens to 2 experts each, in each of the 4 layers; ranks 0 and 1
    # hold experts 0-3 and 4-7, so what each received is the pairs both routed to its four
    for layer in range(4):
        counts = [rec[f"moe/layer{layer}/tokens_per_expert"] for rec in ranks]
        assert [len(c) for c in counts] == [8, 8] and [sum(c) for c in counts] == [2 * 2 * 64 * 2] * 2, counts
        for pos, rec in enumerate(ranks):
            received = sum(sum(c[4 * pos:4 * pos + 4]) for c in counts)
            assert rec[f"moe/layer{layer}/ep_overload"] == pytest.approx(received / (2 * 2 * 64 * 2))
    assert "no moe/* load metrics" not in (tmp_path / "logs" / "rank0.log").read_text()


@pytest.mark.beside
def test_fsdp_ep_reduces_every_micro_batch_as_predicted(single_moe_sgd, tmp_path):
    """strategy.reduce_every_microbatch=true under fsdp_ep, 4 ranks, ep 2 (efsdp 2), micro-batches of 1, so 2 a step:
    the losses of one process within 1e-6, the dense weights' and the experts' reduce-scatters after each micro-batch,
    calls and bytes as the estimator predicts them, and the peak of live tensors within 10% of its prediction, which
    holds sharded gradients only."""
    _, single = single_moe_sgd
    s = train_ok(["strategy=fsdp_ep", "strategy.ep=2", "strategy.reduce_every_microbatch=true", *MOE, *SGD,
                  "train.micro_batch_size=1"], run_dir=tmp_path, nproc=4)
    for got, want in zip(s["losses"], single["losses"], strict=True):
        assert abs(got - want) < 1e-6, (s["losses"], single["losses"])
    config = OmegaConf.to_container(OmegaConf.load(tmp_path / "config.yaml"), resolve=True)
    setup = setup_from_config(config, world_size=4)
    assert setup.reduce_every_microbatch and setup.microbatches_per_step == 2
    predicted = predict_comm(ModelShape.from_config(config["model"]), setup)[0]
    for rec in last_step(tmp_path):
        for dim in ("dp_shard", "efsdp"):
            (rs,) = [c for c in predicted if c.op == "reduce_scatter" and c.dim == dim]
            assert (rec[f"comm/{dim}/reduce_scatter/count"], rec[f"comm/{dim}/reduce_scatter/bytes"]) == (
                rs.calls, rs.bytes), dim
        assert rec["comm/efsdp/reduce_scatter/count"] == 2 * 4  # 4 MoE layers, 2 micro-batches
    peak = s["predicted_memory_bytes"]["peak_live"]
    for rank in s["ranks"]:
        assert abs(rank["memory/peak_live_bytes"] - peak) <= 0.10 * peak, (peak, rank["memory/peak_live_bytes"])


@pytest.mark.beside  # balances tests/suite.sh's two sessions; shares no fixture with the launched session
@pytest.mark.parametrize("strategy", ["ddp", "fsdp", "zero2", "zero3", "1f1b"])
def test_an_moe_model_trains_as_one_process_does_and_is_predicted(strategy, single_moe, tmp_path):
    single_dir, single = single_moe
    run_dir = tmp_path / strategy
    s = train_ok([f"strategy={strategy}", *MOE], run_dir=run_dir, nproc=2)
    assert_same_losses(single, s)
    assert s["num_params"] == single["num_params"] == 281_280
    config = OmegaConf.to_container(OmegaConf.load(run_dir / "config.yaml"), resolve=True)
    shape, setup = ModelShape.from_config(config["model"]), setup_from_config(config, world_size=2)
    if strategy == "zero2":  # whole parameters; the flat partitions cut across them: the ranks' expert parts add up
        # to every expert's fp32 gradient (reduced every micro-batch), master copy and AdamW's two moments
        ranks, experts = last_step(run_dir), 4 * 8 * 3 * 64 * 32  # (not predicted per rank: estimator None)
        assert [r["memory/expert_params_bytes"] for r in ranks] == [experts * 4] * 2
        assert sum(r["memory/expert_grads_bytes"] for r in ranks) == experts * 4
        assert sum(r["memory/expert_optimizer_bytes"] for r in ranks) == experts * (4 + 8)
        assert all(0 < r["memory/expert_optimizer_bytes"] < r["memory/optimizer_bytes"] for r in ranks)
        assert expert_state_bytes(shape, setup) is None
    for rank, rec in enumerate(last_step(run_dir) if strategy != "zero2" else []):
        assert rec["memory/params_bytes"] > 0
        # whole, FSDP2's shard, ZeRO-3's partition of each, or a pipeline stage's layers': as the estimator predicts
        ours = rec["memory/expert_params_bytes"]
        assert ours == expert_param_bytes(shape, setup, rank=rank), (strategy, rank, ours)
        # the experts' fp32 gradients and AdamW's two moments of them (a pipeline stage: its own layers'), and under
        # torch's optimizers a step count for each of the 8 expert tensors; ZeRO-3's partitions of each, its moments
        # flat per sub-group (no step count of their own)
        tensors = 0 if strategy == "zero3" else 2 * (4 if strategy != "1f1b" else 2)  # gate_up_proj, down_proj
        assert rec["memory/expert_grads_bytes"] == ours > 0, strategy
        assert rec["memory/expert_optimizer_bytes"] == 2 * ours + 4 * tensors, strategy
        state = expert_state_bytes(shape, setup, rank=rank)  # the estimator's, step counters aside
        assert (state["grads"], state["optimizer"] + 4 * tensors) == (
            rec["memory/expert_grads_bytes"], rec["memory/expert_optimizer_bytes"]), strategy
    # Step 1, the same weights everywhere: the ranks' router loads add up to one process's, layer by layer (under
    # 1f1b each stage counts its own layers, under their model-wide numbers)
    first = [r for r in metrics(run_dir) if r["step"] == 1]
    (one,) = [r for r in metrics(single_dir) if r["step"] == 1]
    for layer in range(4):
        key = f"moe/layer{layer}/tokens_per_expert"
        assert [sum(c) for c in zip(*(r[key] for r in first if key in r))] == one[key], key
    # summary.json's run-wide load: every (token, expert) pair of the 5 steps of 8 x 64 tokens, top-2, per layer
    assert [sum(v["tokens_per_expert"]) for v in s["moe_load"].values()] == [5 * 8 * 64 * 2] * 4
    if strategy == "ddp":  # the dry run's balanced routing changes no byte ddp holds or sends
        _assert_dry_run_equals([f"strategy={strategy}", *MOE], s, nproc=2)
    rows = compare_from(tmp_path / "compare", single_dir, run_dir)
    assert rows[strategy]["moe_maxvio"] == max(v["maxvio"] for v in s["moe_load"].values()) > 0
    assert rows[strategy]["model_state_ok"] is True, rows[strategy]  # params, grads, optimizer: as predicted
    if strategy in ("ddp", "fsdp"):  # where the estimator models the peak of live tensors
        assert rows[strategy]["prediction_ok"] is True, rows[strategy]


@pytest.mark.beside
def test_a_rank_whose_experts_receive_no_token_stays_in_every_exchange_with_zero_gradients(tmp_path):
    """Every token of both ranks routed to rank 0's experts (tests/ep_dispatch_script.py): no hang; each rank's output
    and input gradient are transformers' own module's with all 8 experts; rank 0's expert gradients sum both ranks'
    tokens, and rank 1's, whose experts received nothing, are zeros (they still exist: the reduction has them); what
    rank 0 keeps for backward beyond rank 1 is what the estimator's ep_overload adds.
    Before the received rows were kept in the graph, rank 1 skipped the first exchange's backward and rank 0 waited
    in it."""
    proc = forked([], run_dir=tmp_path, nproc=2, script=ROOT / "tests" / "ep_dispatch_script.py", timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = [json.loads((tmp_path / f"ep_dispatch.rank{r}.json").read_text()) for r in (0, 1)]
    for rank in found:
        assert rank["output"] < 1e-6 and rank["input_grad"] < 1e-6, rank
        assert rank["gate_up_proj_grad"] < 1e-6 and rank["down_proj_grad"] < 1e-6, rank  # relative to the largest
    assert not found[0]["gate_up_proj_grad_all_zero"] and not found[0]["down_proj_grad_all_zero"]
    assert found[1]["gate_up_proj_grad_all_zero"] and found[1]["down_proj_grad_all_zero"]
    # The estimator's overload knob (ep_overload): rank 0's experts received both ranks' 2 x 24 x 2 rows, twice the
    # balanced share, rank 1's none. What rank 0 keeps beyond rank 1 is those 96 rows at what the estimator adds per
    # row beyond the balanced share (estimate/memory.py ep_dispatch_bytes at ep_overload 2 against 1, per sent row).
    shape = ModelShape(name="e", arch="llama", num_layers=1, hidden_size=16, num_heads=1, vocab_size=1, max_seq_len=24,
                       num_experts=8, experts_per_token=2, moe_ffn_hidden_size=8)
    balanced = Setup(strategy="fsdp_ep", family="fsdp", world_size=2, ep=2, micro_batch_size=1, seq_len=24)
    per_row = (ep_dispatch_bytes(shape, replace(balanced, ep_overload=2.0)) - ep_dispatch_bytes(shape, balanced)) / 48
    assert found[0]["saved_bytes"] - found[1]["saved_bytes"] == 96 * per_row


@pytest.mark.beside
def test_a_checkpointed_expert_parallel_run_recomputes_the_dispatch_as_predicted(tmp_path):
    """fsdp_ep on 2 ranks with selective checkpointing, 2 steps: the recomputation in backward runs the dispatch's
    forward again (counts, rows there and back), so 8 all-to-alls a layer and micro-batch, and the bytes the two ranks
    send together are the estimator's 6 T k h elements plus the counts twice, per layer and micro-batch."""
    run_dir = tmp_path / "fsdp_ep"
    train_ok(["strategy=fsdp_ep", "strategy.ep=2", *MOE, "train.steps=2", "checkpoint.every_steps=0",
              "train.activation_checkpointing=selective"], run_dir=run_dir, nproc=2)
    config = OmegaConf.to_container(OmegaConf.load(run_dir / "config.yaml"), resolve=True)
    (a2a,) = [c for c in predict_comm(ModelShape.from_config(config["model"]), setup_from_config(config, world_size=2))[0]
              if c.op == "all_to_all"]
    ranks = last_step(run_dir)
    layers, micro, tokens, k, hidden = 4, 2, 2 * 64, 2, 64
    assert [r["comm/all_to_all/count"] for r in ranks] == [a2a.calls] * 2 == [8 * layers * micro] * 2
    assert sum(r["comm/all_to_all/bytes"] for r in ranks) == 2 * a2a.bytes == (
        2 * layers * micro * (6 * tokens * k * hidden * 4 + 2 * 8 * 8))


@pytest.mark.beside
def test_more_expert_fsdp_ranks_than_local_experts_split_each_expert_instead(tmp_path):
    """2 experts, ep 2, on 4 ranks: one expert per rank, FSDP2 over 2 ranks. Split by expert (dim 0) each rank would
    hold a padded expert; split by rows (dim 1) each holds half of one, the even share, and trains as one process
    (found by the dry run of Qwen3-30B-A3B at 1,024 ranks: 6.7 times the even share)."""
    two = ["model.num_experts=2", "model.experts_per_token=1", "train.steps=3", "checkpoint.every_steps=0"]
    single = train_ok(["strategy=single", *MOE, *two], run_dir=tmp_path / "single")
    s = train_ok(["strategy=fsdp_ep", "strategy.ep=2", *MOE, *two], run_dir=tmp_path / "fsdp_ep", nproc=4)
    for got, want in zip(s["losses"], single["losses"], strict=True):
        assert abs(got - want) < 1e-6, (s["losses"], single["losses"])
    # 4 layers x 2 experts x (gate, up, down) of 64 x 32, fp32, over 4 ranks, as the estimator predicts (by rows)
    config = OmegaConf.to_container(OmegaConf.load(tmp_path / "fsdp_ep" / "config.yaml"), resolve=True)
    predicted = expert_param_bytes(ModelShape.from_config(config["model"]), setup_from_config(config, world_size=4))
    assert [r["memory/expert_params_bytes"] for r in s["ranks"]] == [4 * 2 * 3 * 64 * 32 * 4 // 4] * 4 == [predicted] * 4
