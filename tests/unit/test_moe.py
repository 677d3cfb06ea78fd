"""Mixture-of-Experts models (issue 42, first part): the tiny_moe preset and MoE model directories, counted by the
estimator as transformers builds them, and what is refused in one line. Training under each strategy:
tests/launched/test_moe.py."""

from __future__ import annotations

import json
import math

import pytest
import torch

from dist_train.config import ModelConfig
from dist_train.estimate.compose import model_config
from dist_train.estimate.memory import layer_activation_bytes
from dist_train.estimate.shapes import ModelShape
from dist_train.model import build_model
from dist_train.pretrained import resolve_model
from tests.moe_support import gpt_oss_dir, qwen2_moe_config, qwen2_moe_dir


def _counts(model: torch.nn.Module) -> tuple[int, int]:
    """(expert, dense) parameters of a built model: transformers' stacked experts are `*.experts.*`."""
    expert = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    return expert, sum(p.numel() for p in model.parameters()) - expert


def test_the_estimators_expert_and_dense_counts_are_the_built_models():
    cfg = ModelConfig(**model_config("tiny_moe"))
    built = build_model(cfg, seed=0, empty=torch.device("meta"))
    shape = ModelShape.from_config(model_config("tiny_moe"))
    expert, dense = _counts(built)
    assert shape.num_layers * shape.expert_params == expert and shape.dense_params == dense
    assert shape.num_params == expert + dense == 281_280
    # a token passes through its top-2 of 8 experts: a quarter of the experts' parameters, all the dense ones
    assert shape.active_params == dense + expert * 2 // 8
    # MFU's N, in training (session.py) and in the advisor (model_flops_per_token): the active parameters, not all
    from dist_train.estimate.step_time import model_flops_per_token
    from dist_train.model import count_params, idle_expert_params
    from dist_train.telemetry.flops import flops_per_token

    assert count_params(built) - idle_expert_params(built, cfg.experts_per_token) == shape.active_params
    assert model_flops_per_token(shape, 128) == flops_per_token(
        num_params=shape.active_params, num_embedding_params=shape.embedding_params(), num_layers=4, hidden_size=64,
        seq_len=128) < flops_per_token(num_params=shape.num_params, num_embedding_params=shape.embedding_params(),
                                       num_layers=4, hidden_size=64, seq_len=128)
    # the experts run as the preset pins them, whatever transformers would choose on this machine
    assert built.config._experts_implementation == "eager"


def _mixtral_dir(tmp_path, **extra):
    from transformers import MixtralConfig

    MixtralConfig(vocab_size=256, hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=128,
                  **extra).save_pretrained(tmp_path)
    return tmp_path


def test_a_mixtral_directory_fills_the_experts_and_is_counted_as_built(tmp_path):
    model = ModelConfig(name="hf", path=str(_mixtral_dir(tmp_path)))
    resolve_model(model)
    assert (model.num_experts, model.experts_per_token, model.moe_ffn_hidden_size, model.moe_layers) == (4, 2, 32, None)
    built = build_model(model, seed=0, empty=torch.device("meta"))
    shape = ModelShape.from_config(model)
    expert, dense = _counts(built)
    assert (shape.num_layers * shape.expert_params, shape.dense_params) == (expert, dense)


def test_a_gpt_oss_directory_is_counted_as_built_its_biases_and_sinks_included(tmp_path):
    """GPT-OSS's experts carry a bias on each projection (E x 2I, E x h) and its router one (E); its attention a sink
    logit per head. Each counted where it is: the experts' biases with the experts (expert parallelism splits them by
    expert), the rest dense; an E x h expert bias told from the router's E x h matrix by the estimator's ExpertDims."""
    model = ModelConfig(name="hf", path=str(gpt_oss_dir(tmp_path)))
    resolve_model(model)
    assert (model.num_experts, model.experts_per_token, model.moe_ffn_hidden_size) == (8, 2, 32)
    built = build_model(model, seed=0, empty=torch.device("meta"))
    shape = ModelShape.from_config(model)
    expert, dense = _counts(built)
    assert (shape.num_layers * shape.expert_params, shape.dense_params) == (expert, dense)
    assert shape.num_params == 159_448
    # per layer: each expert's 3 h I weights and 2I + h biases; the router's E x h and E; 4 sink logits
    assert shape.params_per_expert == 3 * 64 * 32 + 2 * 32 + 64 and shape.router_params == 8 * 64 + 8
    experts_module = [n for n, _ in built.named_parameters() if ".0.mlp.experts." in n]
    assert sum(shape.is_experts(d) for d in shape.layer_modules()[-1]) == len(experts_module) == 4
    assert [d for d in shape.layer_modules()[-2] if shape.is_experts(d)] == []  # the router's (8, 64) is not


def test_a_qwen2_moe_directory_with_its_shared_expert_is_counted_as_built(tmp_path):
    """Qwen2-MoE's shared expert (a gated MLP every token takes, and its 1 x h sigmoid gate) is dense: counted with
    the dense parameters, active for every token, whole under tensor parallelism (transformers' plan has no entry for
    it). Its q/k/v biases come from its config's qkv_bias."""
    model = ModelConfig(name="hf", path=str(qwen2_moe_dir(tmp_path)))
    resolve_model(model)
    assert (model.num_experts, model.shared_expert_ffn_hidden_size, model.qkv_bias) == (8, 64, True)
    built = build_model(model, seed=0, empty=torch.device("meta"))
    shape = ModelShape.from_config(model)
    expert, dense = _counts(built)
    assert (shape.num_layers * shape.expert_params, shape.dense_params) == (expert, dense)
    assert shape.num_params == 181_952 and shape.shared_expert_params == 3 * 64 * 64 + 64
    from dist_train.model import count_params, idle_expert_params

    assert count_params(built) - idle_expert_params(built, 2) == shape.active_params
    assert shape.layer_params() - shape.layer_tp_sharded() == (  # what stays whole under tp: norms, the router,
        2 * 64 + 8 * 64 + shape.shared_expert_params + shape.expert_params)  # the shared expert, the experts (ep's)


@pytest.mark.parametrize("autocast", [False, True])
def test_a_shared_expert_keeps_what_the_estimator_says(monkeypatch, autocast):
    """What Qwen2-MoE's block saves for backward, less what the same block without its shared expert saves (its
    forward with the shared expert's lines taken out), measured with training's activation meter over one forward:
    the estimator's shared_expert_bytes, exactly, in fp32 and under bf16 autocast, for two widths."""
    from transformers import AutoModelForCausalLM
    from transformers.models.qwen2_moe import modeling_qwen2_moe

    from dist_train.estimate.memory import shared_expert_bytes
    from dist_train.telemetry.activations import ActivationMeter

    ids = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(0))

    def without_shared(self, hidden_states):
        batch, seq, h = hidden_states.shape
        x = hidden_states.view(-1, h)
        _, weights, experts = self.gate(x)
        return self.experts(x, experts, weights).reshape(batch, seq, h)

    def measured(width: int) -> int:
        config = qwen2_moe_config(shared_expert_intermediate_size=width)
        config._experts_implementation = "eager"
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config)
        meter = ActivationMeter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast), meter.measuring():
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        return meter.peak_bytes

    for width in (64, 96):
        with_shared = measured(width)
        monkeypatch.setattr(modeling_qwen2_moe.Qwen2MoeSparseMoeBlock, "forward", without_shared)
        without = measured(width)
        monkeypatch.undo()
        shape = ModelShape.from_config({**model_config("tiny_moe"), "shared_expert_ffn_hidden_size": width})
        # 2 layers of 2 x 64 tokens
        assert with_shared - without == 2 * 128 * shared_expert_bytes(shape, 2 if autocast else 4, autocast=autocast)


def test_moe_layers_among_dense_ones_are_refused_by_the_estimator_in_one_line(tmp_path):
    from transformers import Qwen3MoeConfig

    Qwen3MoeConfig(vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                   num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8,
                   num_experts_per_tok=2, mlp_only_layers=[0]).save_pretrained(tmp_path)
    model = ModelConfig(name="hf", path=str(tmp_path))
    resolve_model(model)
    assert model.moe_layers == [1, 2, 3]
    with pytest.raises(ValueError, match=r"MoE layers \[1, 2, 3\] of 4 \(dense MLP layers between them\) are not "
                                         "modelled yet"):
        ModelShape.from_config(model)
    assert json.loads((tmp_path / "config.json").read_text())["mlp_only_layers"] == [0]  # the directory untouched


@pytest.mark.parametrize("impl", ["eager", "grouped_mm", "batched_mm"])
def test_an_moe_layer_keeps_what_the_estimator_says_beside_a_dense_layer_of_that_width(impl):
    """What tiny_moe saves for backward, less what the same model with a dense MLP k x I wide saves, measured with
    training's activation meter over one forward: the estimator's difference, exactly, for each experts
    implementation, in fp32 and under bf16 autocast (memory.moe_routing_bytes: the router's softmax and top-k, each
    pair's indices, weight and rows; batched_mm's gathered expert matrices; grouped_mm's offsets, and its rows in
    fp32 where its autocast is not registered; under autocast the router's one cast of its input, and the experts'
    16-bit weights as weight copies, not activations)."""
    from dist_train.model import _GROUPED_MM_AUTOCAST
    from dist_train.telemetry.activations import ActivationMeter

    moe_cfg = {**model_config("tiny_moe"), "experts_implementation": impl}
    dense_cfg = {**model_config("tiny_moe"), "num_experts": 0, "ffn_hidden_size": 2 * 32}
    ids = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(0))

    def measured(cfg: dict, autocast: bool) -> int:
        model = build_model(ModelConfig(**cfg), seed=0)
        meter = ActivationMeter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast), meter.measuring():
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        return meter.peak_bytes

    for autocast in (False, True):
        # grouped_mm under autocast multiplies in fp32 until a bf16 run registers it (model.autocast_grouped_mm,
        # global to the process: this test leaves it as it finds it, and predicts either)
        fp32 = autocast and impl == "grouped_mm" and "cpu" not in _GROUPED_MM_AUTOCAST
        one = dict(micro_batch_size=2, seq_len=64, elem=2 if autocast else 4, autocast=autocast,
                   norm_elem=4 if autocast else 0)
        predicted = 4 * (layer_activation_bytes(ModelShape.from_config(moe_cfg), experts_fp32=fp32, **one)
                         - layer_activation_bytes(ModelShape.from_config(dense_cfg), **one))
        assert measured(moe_cfg, autocast) - measured(dense_cfg, autocast) == predicted, (impl, autocast)


def test_the_advisor_splits_an_moe_models_experts_by_expert_under_tensor_parallelism_as_training_does():
    """tp and fsdp_tp take an MoE model with its experts over ep ranks of a node (strategy.ep: dividing the experts
    and the world), each layout an override the training run accepts; ddp_tp, which training refuses with ep, is
    dropped with its reason; a dense model gets no ep (and sequence parallelism, which ep refuses)."""
    from dist_train.plan.search import layouts

    moe = ModelShape.from_config(model_config("tiny_moe"))
    dense = ModelShape.from_config({**model_config("tiny_moe"), "num_experts": 0, "ffn_hidden_size": 2 * 32})
    names = ("tp", "fsdp_tp", "ddp_tp", "fsdp")
    found = [(n, f, o, r) for n, f, o, r in layouts(moe, world_size=4, gpus_per_node=4, strategies=names)]
    assert [(n, o, r) for n, _, o, r in found] == [
        ("tp", ("strategy=tp", "strategy.ep=2"), "4 does not divide the 4 heads and 2 kv heads"),
        ("tp", ("strategy=tp", "strategy.ep=4"), "4 does not divide the 4 heads and 2 kv heads"),
        ("fsdp_tp", ("strategy=fsdp_tp", "strategy.tp=2", "strategy.ep=2"), None),
        ("fsdp_tp", ("strategy=fsdp_tp", "strategy.tp=2", "strategy.ep=4"), None),
        ("ddp_tp", ("strategy=ddp_tp",), "expert parallelism beside tensor parallelism is built with fsdp_tp"),
        ("fsdp", ("strategy=fsdp",), None)]
    assert [f for n, f, _, _ in found if n == "fsdp_tp"] == [{"tp": 2, "ep": 2}, {"tp": 2, "ep": 4}]
    assert [(f, r) for n, f, _, r in layouts(dense, world_size=2, gpus_per_node=2, strategies=("tp",))] == [
        ({}, None), ({"sequence_parallel": True}, None)]  # a dense model: no ep, and sequence parallelism searched


@pytest.mark.parametrize("checkpointing", ["none", "full", "selective"])
def test_router_load_counts_each_routed_pair_once_even_when_the_block_is_recomputed(checkpointing):
    """telemetry/moe.py on tiny_moe (in process): per layer, the counts are the bincount of the routers' own top-k
    choice (read from transformers' router outputs), summing to tokens x k; a checkpointed block's recomputation in
    backward routes the same tokens again and is not counted. MaxVio and dead experts follow from the counts."""
    from dist_train.model import apply_activation_checkpointing
    from dist_train.telemetry.moe import RouterLoad, expert_param_bytes

    cfg = ModelConfig(**model_config("tiny_moe"))
    model = build_model(cfg, seed=0)
    apply_activation_checkpointing(model, checkpointing)
    load = RouterLoad(model)
    routed: dict[int, torch.Tensor] = {}

    def first_routing(layer: int):  # noqa: ANN202 - the router's own (logits, weights, indices), first forward only
        def hook(module, args, out) -> None:  # noqa: ANN001
            routed.setdefault(layer, torch.bincount(out[2].reshape(-1), minlength=8))
        return hook

    for i, layer in enumerate(model.model.layers):
        layer.mlp.gate.register_forward_hook(first_routing(i))
    ids = torch.randint(0, cfg.vocab_size, (2, 16))
    model(input_ids=ids, labels=ids).loss.backward()
    got = load.drain()
    assert sorted(load.modules) == [0, 1, 2, 3]
    for layer in range(4):
        counts = got[f"moe/layer{layer}/tokens_per_expert"]
        assert counts == routed[layer].tolist() and sum(counts) == 2 * 16 * 2
        mean = sum(counts) / 8
        assert got[f"moe/layer{layer}/maxvio"] == pytest.approx((max(counts) - mean) / mean)
        assert got[f"moe/layer{layer}/dead_experts"] == counts.count(0)
    assert got["moe/maxvio"] == max(got[f"moe/layer{i}/maxvio"] for i in range(4))
    # 4 layers x 8 experts x (gate, up, down) of 64 x 32, fp32
    assert got["memory/expert_params_bytes"] == expert_param_bytes(load.modules.values()) == 4 * 8 * 3 * 64 * 32 * 4
    assert "moe/layer0/tokens_per_expert" not in load.drain()  # the counts start again


def test_the_dispatch_keeps_what_the_estimator_adds_for_expert_parallelism():
    """parallel/experts.py's dispatch on a one-rank ep mesh (every row stays, so the routing is balanced by
    construction) against transformers' own experts loop, one micro-batch of tiny_moe through the whole model: the
    activation meter's difference is memory.ep_dispatch_bytes per layer, exactly. The experts' local weights that
    each expert's products save are the parameters' own bytes, not activations (the meter sees through
    DTensor.to_local)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from dist_train.estimate.memory import ep_dispatch_bytes
    from dist_train.estimate.setup import Setup
    from dist_train.parallel.experts import shard_experts
    from dist_train.telemetry.activations import ActivationMeter

    cfg = ModelConfig(**model_config("tiny_moe"))
    ids = torch.randint(0, cfg.vocab_size, (2, 64))
    saved = []
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        for ep in (False, True):
            model = build_model(cfg, seed=0)
            if ep:
                shard_experts(model, init_device_mesh("cpu", (1,), mesh_dim_names=("ep",)))
            meter = ActivationMeter()
            with meter.measuring():
                loss = model(input_ids=ids, labels=ids).loss
            saved.append(meter.peak_bytes)
            loss.backward()
    finally:
        dist.destroy_process_group()
    shape = ModelShape.from_config(model_config("tiny_moe"))
    setup = Setup(strategy="fsdp_ep", family="fsdp", world_size=2, ep=2, micro_batch_size=2, seq_len=64)
    assert saved[1] - saved[0] == shape.num_layers * ep_dispatch_bytes(shape, setup) == 4 * 2 * 64 * 2 * (64 * 4 + 8)


def test_the_expert_parallel_crossover_is_the_hand_count_and_the_advisor_searches_ep_within_a_node():
    """estimate/comm.expert_crossover on tiny_moe (4 layers, E=8, k=2, h=64, expert width 32, fp32), 2 micro-batches
    of 2 x 64 tokens a rank: EP sends 4 T k h elements a layer and micro-batch (the counts aside), FSDP gathers the
    layer's 8 x 6,144 expert parameters twice a micro-batch and reduce-scatters them once a step; the crossover is
    where the two meet. The all-to-alls' bytes are what predict_comm sizes, less the counts. The advisor offers ep
    degrees that divide the experts and the world within a node, and none for a dense model."""
    from dist_train.estimate.comm import expert_crossover, predict_comm
    from dist_train.estimate.setup import Setup
    from dist_train.plan.search import layouts

    shape = ModelShape.from_config(model_config("tiny_moe"))
    setup = Setup(strategy="fsdp_ep", family="fsdp", world_size=4, ep=2, micro_batch_size=2, seq_len=64,
                  global_batch_size=16)
    c = expert_crossover(shape, setup)
    tokens, experts = 2 * 64, 8 * 3 * 64 * 32
    assert c.ep_bytes == 2 * 4 * 4 * tokens * 2 * 64 * 4
    assert c.gather_bytes == 4 * (2 * 2 * experts * 4 + experts * 4)
    assert c.crossover_tokens == (2 * experts * 4 + experts * 4 / 2) / (4 * 2 * 64 * 4) == 240
    (a2a,) = [x for x in predict_comm(shape, setup)[0] if x.op == "all_to_all"]
    assert a2a.bytes == c.ep_bytes + 2 * 4 * 8 * 8  # and the counts: E int64 a layer and micro-batch
    for mode in ("full", "selective"):  # the recomputation runs the dispatch's forward again
        assert expert_crossover(shape, Setup(**{**setup.__dict__, "activation_checkpointing": mode})).ep_bytes == (
            c.ep_bytes * 6 / 4)
    offered = [(name, f["ep"], why) for name, f, _, why in layouts(shape, world_size=16, gpus_per_node=8,
                                                                  strategies=("fsdp_ep", "ep"))]
    assert offered == [(name, ep, None) for name in ("fsdp_ep", "ep") for ep in (2, 4, 8)]
    dense = ModelShape.from_config({**model_config("tiny_moe"), "num_experts": 0, "ffn_hidden_size": 64})
    assert list(layouts(dense, world_size=16, gpus_per_node=8, strategies=("fsdp_ep", "ep"))) == []


@pytest.mark.parametrize(("dims", "n"), [((128, 2048), 1024), ((128,), 1024), ((2048,), 1024), ((7, 3), 4), ((8, 5), 4),
                                         ((1, 64, 32), 2)])
def test_fsdp_padding_is_torch_chunks(dims, n):
    """estimate/memory.fsdp_padded: FSDP2 holds torch.chunk's first chunk's size on every rank (the others padded
    to it), so all shards together are n times that; an MoE model's router (E x h) over more ranks than experts is
    padded to one row a rank."""
    from dist_train.estimate.memory import fsdp_padded

    assert fsdp_padded(dims, n) == torch.chunk(torch.empty(dims, device="meta"), n)[0].numel() * n


def test_fsdp_state_per_rank_counts_the_padding_at_scale():
    """Qwen3-30B-A3B's shape at 1,024 ranks: under fsdp each rank's 128-row routers and stacked experts take a padded
    row (8 times their even share); under fsdp_ep (ep 8) the 16 local experts are split by rows over 128 efsdp ranks,
    evenly, and only the routers and per-head norms pad. On tiny_moe at 4 ranks nothing pads: params / N."""
    from dist_train.estimate.memory import fsdp_rank_elements
    from dist_train.estimate.setup import Setup

    big = ModelShape.from_config({**model_config("tiny_moe"), "hidden_size": 2048, "num_layers": 48, "num_heads": 32,
                                  "num_kv_heads": 4, "head_dim": 128, "moe_ffn_hidden_size": 768, "num_experts": 128,
                                  "experts_per_token": 8, "vocab_size": 151936})
    n = 1024
    ep = fsdp_rank_elements(big, Setup(strategy="fsdp_ep", family="fsdp", world_size=n, ep=8)) / n
    plain = fsdp_rank_elements(big, Setup(strategy="fsdp", family="fsdp", world_size=n)) / n
    routed = 48 * (big.expert_params + 128 * 2048)  # experts and routers: 128 rows each, one padded row a rank
    assert plain == pytest.approx((big.num_params - routed) / n + 8 * routed / n, rel=1e-3)
    assert ep / (big.num_params / n) - 1 == pytest.approx(0.0063, abs=5e-4)
    assert plain / (big.num_params / n) > 7
    small = ModelShape.from_config(model_config("tiny_moe"))
    assert fsdp_rank_elements(small, Setup(strategy="fsdp_ep", family="fsdp", world_size=4, ep=2)) == small.num_params


def test_fsdps_gathered_block_at_the_peak_is_padded_as_fsdp2_gathers_it(monkeypatch):
    """estimate/memory.fsdp_gathered, the same 1,024-rank shape: the root (embedding, final norm, head) and the last
    block gathered, each tensor at its padded size: the 128-row routers and expert stacks 1,024 rows long (8 times
    their size), every other tensor with fewer rows than ranks, or rows that do not divide, padded too. The peak of
    live tensors counts that, in bf16, and a block's padded size twice more in backward (fsdp_backward_moment): the
    prefetched all-gather (bf16) and the reduce-scatter input (fp32). Every block without resharding."""
    from dist_train.estimate import memory
    from dist_train.estimate.memory import fsdp_gathered, predict_memory, predict_peak_live
    from dist_train.estimate.setup import Setup

    big = ModelShape.from_config({**model_config("tiny_moe"), "hidden_size": 2048, "num_layers": 48, "num_heads": 32,
                                  "num_kv_heads": 4, "head_dim": 128, "moe_ffn_hidden_size": 768, "num_experts": 128,
                                  "experts_per_token": 8, "vocab_size": 151936})
    n, block = 1024, big.layer_params()
    routed = big.expert_params + 128 * 2048  # one block's experts and router
    root = big.num_params - 48 * block
    # the block's other short tensors: k and v projections (512 rows), q and k norms (128); the root's vocabulary
    # (151,936 rows: 149 a rank) in the embedding and the head
    block_pad, root_pad = 7 * routed + 2 * 512 * 2048 + 2 * 896, 2 * 640 * 2048
    assert fsdp_gathered(big, n, reshards=True) == root + root_pad + block + block_pad
    assert fsdp_gathered(big, n, reshards=False) == big.num_params + root_pad + 48 * block_pad
    small = ModelShape.from_config(model_config("tiny_moe"))  # nothing pads at 4 ranks: real sizes
    assert fsdp_gathered(small, 4, reshards=True) == small.num_params - 3 * small.layer_params()
    setup = Setup(strategy="fsdp", family="fsdp", world_size=n, precision="bf16", micro_batch_size=1, seq_len=4096)
    rank = predict_memory(big, setup)[0]

    def backward(ranks: int) -> float:
        return memory.fsdp_backward_moment(big, setup, rank, gathered=fsdp_gathered(big, ranks, reshards=True),
                                           grads=rank.grads, reshards=True, accumulates_unsharded=False)

    padded = predict_peak_live(big, setup, rank)
    assert padded == backward(n)  # the backward's moment decides here
    monkeypatch.setattr(memory, "fsdp_padded", lambda dims, n: math.prod(dims))  # real sizes
    # gathered (root and block) in bf16, and in backward the prefetched block in bf16, the reduce-scatter in fp32
    assert padded - backward(n) == pytest.approx(2 * (root_pad + block_pad) + (2 + 4) * block_pad, rel=1e-12)
    monkeypatch.undo()  # hsdp over 2 x 512: FSDP2 shards over dp_shard, 512 ranks (a 128-row tensor 4 times its size)
    hsdp = Setup(strategy="hsdp", family="fsdp", world_size=n, replicate=2, precision="bf16", micro_batch_size=1,
                 seq_len=4096)
    assert hsdp.dims.dp_shard == 512

    def block_padded(ranks: int) -> int:
        return sum(memory.fsdp_padded(dims, ranks) for module in big.layer_modules() for dims in module)

    assert predict_peak_live(big, hsdp, rank) - predict_peak_live(big, setup, rank) == pytest.approx(2 * (
        fsdp_gathered(big, 512, reshards=True) - fsdp_gathered(big, n, reshards=True)) + (2 + 4) * (
        block_padded(512) - block_padded(n)), rel=1e-12)
    assert fsdp_gathered(big, 512, reshards=True) - (root + block) == pytest.approx(3 * routed, rel=1e-3)


def test_the_expert_dispatch_stays_out_of_compiled_graphs():
    """parallel/experts.py dispatch is torch.compiler.disable'd: traced, its host-read row counts recompiled every
    micro-batch (docs/moe.md)."""
    from dist_train.parallel import experts

    assert getattr(experts.dispatch, "_torchdynamo_disable", False)


def test_the_router_load_meter_stays_under_compile_only_where_the_experts_dispatch_runs_eager(caplog):
    """session.attach_router_load under train.compile: off where the experts run inside the compiled blocks (its
    hook would add a graph break to each), said in the log; on where every experts module's forward is expert
    parallelism's eager dispatch (parallel/experts.py sets its ep_group), whose hook runs eager there too."""
    from dist_train.architectures import expert_modules
    from dist_train.session import attach_router_load
    from dist_train.telemetry.moe import RouterLoad
    from tests.helpers import run_config

    _, run = run_config("model=tiny_moe", "train.compile=true")
    model = build_model(ModelConfig(**model_config("tiny_moe")), seed=0)
    with caplog.at_level("INFO", logger="dist_train"):
        assert attach_router_load(run, model) is None
    assert "no moe/* load metrics under train.compile without expert parallelism" in caplog.text
    modules = expert_modules(model)
    assert len(modules) > 1
    modules[0].ep_group = object()  # one dispatched, the rest compiled in their blocks: still off
    assert attach_router_load(run, model) is None
    for module in modules:
        module.ep_group = object()
    assert isinstance(attach_router_load(run, model), RouterLoad)
    assert getattr(RouterLoad(model)._hook(0), "_torchdynamo_disable", False)


def test_expert_parallelism_borrows_from_the_replicas_where_nothing_shards():
    """strategy=ep's degrees: whole replicas over every rank (dp_replicate), ep borrowed from them, the experts' mesh
    (edp, ep); fsdp_ep's borrows from dp_shard, (efsdp, ep). An ep that does not divide the ranks it borrows from is
    one line naming them."""
    from dist_train.errors import ConfigError
    from dist_train.parallel_dims import ParallelDims, layout_dims

    ep = layout_dims("ddp_tp", 8, tp=1, ep=2)
    assert (ep.dp_replicate, ep.dp_shard, ep.expert_dims, ep.degree("edp"), ep.degree("efsdp")) == (
        8, 1, ("edp", "ep"), 4, 1)
    fsdp_ep = layout_dims("fsdp", 8, ep=2)
    assert (fsdp_ep.expert_dims, fsdp_ep.degree("efsdp"), fsdp_ep.degree("edp")) == (("efsdp", "ep"), 4, 1)
    with pytest.raises(ConfigError, match=r"^expert-parallel degree ep=3 must divide dp_replicate = 8$"):
        ParallelDims(8, dp_replicate=8, ep=3)
    with pytest.raises(ConfigError, match=r"^expert-parallel degree ep=3 must divide dp_shard x cp = 8$"):
        ParallelDims(8, dp_shard=8, ep=3)


def test_the_fit_table_prices_each_expert_layout_by_its_name_and_refuses_only_tensor_parallelism():
    """fit.strategies=[ddp,fsdp_ep,ep] on an MoE model: ep holds the dense weights whole and E/ep of the experts, so
    less than ddp; fsdp_ep's FSDP2 less again (each by what its name implies, not the run's own strategy fields: before,
    fsdp_ep was priced as plain fsdp and ep as fsdp_tp at tp 2). Training refuses tensor parallelism for an MoE model,
    and the table says so for tp, fsdp_tp and ddp_tp only: ep, which the estimator models as ddp_tp's replicas at tp 1,
    is priced."""
    from dist_train.estimate.fit import FitModel, fit_cell
    from dist_train.estimate.memory import expert_param_bytes, predict_memory
    from dist_train.estimate.setup import Setup

    shape = ModelShape.from_config(model_config("tiny_moe"))
    base = Setup(strategy="ddp", family="ddp", world_size=8, micro_batch_size=1, seq_len=64)
    refused = dict.fromkeys(("tp", "fsdp_tp", "ddp_tp"), "model.num_experts=8: tensor parallelism here splits dense "
                                                         "blocks only")
    model = FitModel(shape.name, shape.num_params, shape, refused=refused)
    cells = {s: fit_cell(model, base=base, strategy=s, world_size=8, gpu_bytes=2**40)
             for s in ("ddp", "fsdp_ep", "ep", "ddp_tp")}
    assert cells["ddp_tp"].peak_bytes is None and cells["ddp_tp"].note == refused["ddp_tp"]
    assert cells["ddp"].peak_bytes > cells["ep"].peak_bytes > cells["fsdp_ep"].peak_bytes
    # ep's model state: the dense weights whole, E/2 experts (strategy=ep's default ep of 2), fp32 AdamW's 16 B each
    ep = Setup(strategy="ep", family="fsdp_tp", world_size=8, micro_batch_size=1, seq_len=64, tp=1,
               dp_mode="replicate", ep=2)
    held = shape.dense_params + shape.num_layers * shape.expert_params / 2
    assert predict_memory(shape, ep)[0].model_state == 16 * held
    assert expert_param_bytes(shape, ep) == 4 * shape.num_layers * shape.expert_params / 2


def test_an_moe_directorys_experts_are_read_stacked_and_only_the_asked_ones(tmp_path):
    """Mixtral's files hold each expert apart, under block_sparse_moe and as w1/w3/w2 (save_pretrained writes what
    transformers' conversion reads back): weights.experts_stacked reads them as the model holds them, transformers'
    own conversion applied per read. Rows [1, 3) of a stacked tensor are experts 1 and 2, equal to the loaded
    model's, and only their tensors are read (a rank holding 2 of 4 experts reads half of them)."""
    from transformers import AutoModelForCausalLM, MixtralConfig, MixtralForCausalLM

    from dist_train.pretrained import ModelDir
    from dist_train.weights import StackedExperts, experts_stacked

    cfg = MixtralConfig(vocab_size=256, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                        max_position_embeddings=128)
    torch.manual_seed(3)
    MixtralForCausalLM(cfg).save_pretrained(tmp_path)
    d = ModelDir.open(str(tmp_path))
    assert any(".block_sparse_moe.experts.3.w1.weight" in n for n in d.locations)  # saved apart, as Mixtral's
    source = experts_stacked(d, "mixtral")
    assert isinstance(source, StackedExperts)
    loaded = dict(AutoModelForCausalLM.from_pretrained(tmp_path).named_parameters())
    assert set(source.locations) == set(loaded)  # every tensor of the built model, by its own name
    read: list[str] = []
    source._read = lambda unit, name, *a, _read=source._read: read.append(name) or _read(unit, name, *a)
    for name, parts in (("model.layers.1.mlp.experts.gate_up_proj", ("w1", "w3")),
                        ("model.layers.1.mlp.experts.down_proj", ("w2",))):
        read.clear()
        assert torch.equal(source.read(name, 1, 3), loaded[name][1:3].detach())
        assert read == [f"model.layers.1.block_sparse_moe.experts.{e}.{w}.weight" for w in parts for e in (1, 2)]
        assert torch.equal(source.read(name), loaded[name].detach())
    assert torch.equal(source.read("model.layers.0.self_attn.q_proj.weight"),
                       loaded["model.layers.0.self_attn.q_proj.weight"].detach())
    # a dense directory, or one saved stacked, is read as it is
    assert experts_stacked(d, "llama") is d


def test_the_overload_knob_scales_the_busiest_ranks_experts_and_refuses_what_cannot_be(capsys):
    """ep_overload (estimator) and plan.ep_overload (advisor): the busiest EP rank's received rows over its balanced
    share. model=tiny_moe under fsdp_ep, ep=2 on 2 ranks: at 1.5, each layer's activations grow by half a balanced
    share of received rows at what a received row keeps (measured on 2 ranks: tests/launched/test_moe.py), and the
    experts' compute by half. Values it cannot take are one line each."""
    import dataclasses

    from dist_train.estimate.cli import main as estimate_main
    from dist_train.estimate.setup import Setup
    from dist_train.estimate.hardware import PROFILES
    from dist_train.estimate.step_time import predict_step

    def replace_gpus(hw, n):  # noqa: ANN001, ANN202
        return dataclasses.replace(hw, gpus_per_node=n)

    def activations(*extra: str) -> int:
        assert estimate_main(["model=tiny_moe", "strategy=fsdp_ep", "world_size=2", "format=json", *extra]) == 0
        return json.loads(capsys.readouterr().out)["memory_per_rank"][0]["activations"]

    base, over = activations(), activations("ep_overload=1.5")
    shape = ModelShape.from_config(model_config("tiny_moe"))
    pairs = 2 * 64 * 2  # the default micro-batch of 2 x 64 tokens, top-2, fp32
    assert over - base == 4 * 0.5 * pairs * ((4 * 32 + 2 * 64) * 4 + 8)  # 4 layers
    setup = Setup(strategy="fsdp_ep", family="fsdp", world_size=2, ep=2, micro_batch_size=2, seq_len=64,
                  precision="bf16")
    h100 = PROFILES["h100"]
    t1 = predict_step(shape, setup, h100).ops.gemm_s
    t2 = predict_step(shape, dataclasses.replace(setup, ep_overload=2.0), h100).ops.gemm_s
    assert t2 > t1
    # the experts' products alone, on a device without shape effects: twice the rows, twice the time
    from dist_train.estimate.ops import experts_compute

    flat = dataclasses.replace(h100, sm_count=0, gemm_k_half=0.0, memory_bw=1e30)
    one, two = (experts_compute(shape, tokens=128, ep=2, recompute="none", hw=flat, peak=1e15, element_bytes=2,
                                constants={}, overload=x)[0] for x in (1.0, 2.0))
    assert two == pytest.approx(2 * one)
    # the advisor: each expert-parallel layout at plan.ep_overload, capped at its ep (every token on one rank)
    from dist_train.estimate.cli import compose
    from dist_train.plan.search import search

    cfg, _ = compose(["model=tiny_moe", "train.global_batch_size=16"])
    for overload in (1.0, 1.5, 4.0):
        found = search(shape, cfg, replace_gpus(h100, 4), nodes=1, strategies=("fsdp_ep", "ep"), ep_overload=overload)
        assert found.ranked and {c.setup.ep_overload for c in found.ranked} == (
            {min(overload, c.setup.ep) for c in found.ranked})
    for extra, why in ((["ep_overload=0.5"], "ep_overload=0.5 must be >= 1"),
                       (["ep_overload=3"], "ep_overload=3.0 must be between 1 and strategy.ep=2"),
                       (["ep_overload=2", "strategy=ddp"], "it applies to fsdp_ep and ep only"),
                       (["ep_overload=2", "dryrun.ranks=[0]"], "the dry run routes tokens balanced")):
        assert estimate_main(["model=tiny_moe", "strategy=fsdp_ep", "world_size=2", *extra]) == 2
        err = capsys.readouterr().err
        assert why in err and len(err.strip().splitlines()) == 1, err


def test_grouped_mm_experts_multiply_in_bf16_under_autocast_once_registered():
    """torch does not autocast its grouped matrix product and transformers' grouped_mm experts cast their input to
    the weights' dtype: under bf16 autocast over fp32 weights (single, ddp, the pipelines) they multiplied in fp32
    (an H200 step: docs/BENCHMARKS.md). model.autocast_grouped_mm, which a bf16 run's set-up calls, makes them bf16:
    here on the CPU, model=tiny_moe, the experts' outputs are bf16, the experts' fp32 weights get fp32 gradients,
    and the loss is the eager experts' within bf16's rounding."""
    from dist_train.model import autocast_grouped_mm

    ids = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(0))

    from torch.utils._python_dispatch import TorchDispatchMode

    class Products(TorchDispatchMode):  # the dtypes the experts' matrix products run in
        def __init__(self) -> None:
            super().__init__()
            self.dtypes: set = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
            if func in (torch.ops.aten._grouped_mm.default, torch.ops.aten.mm.default):
                self.dtypes.add(args[0].dtype)
            return func(*args, **(kwargs or {}))

    def run(impl: str) -> tuple[float, set, torch.nn.Module]:
        model = build_model(ModelConfig(**{**model_config("tiny_moe"), "experts_implementation": impl}), seed=0)
        with torch.autocast("cpu", dtype=torch.bfloat16), Products() as seen:
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss.item(), seen.dtypes, model

    _, before, _ = run("grouped_mm")
    autocast_grouped_mm(("cpu",))
    loss, after, model = run("grouped_mm")
    eager, eager_dtypes, _ = run("eager")
    assert torch.float32 in before and after == eager_dtypes == {torch.bfloat16}
    experts = [m for m in model.modules() if type(m).__name__.endswith("Experts")]
    assert experts and all(p.dtype == p.grad.dtype == torch.float32 and p.grad.abs().sum() > 0
                           for m in experts for p in m.parameters())
    assert loss == pytest.approx(eager, rel=2e-2)


@pytest.mark.parametrize("rows", [0, 1, 5, 128, 129])
@pytest.mark.parametrize("size", [1, 2, 3, 8])
def test_the_tensor_parallel_ranks_shares_of_an_moe_layers_tokens_cover_them_once(rows, size):
    """Under tensor parallelism with strategy.ep each TP rank dispatches a contiguous share of the tokens every rank
    holds (parallel_dims.share_bounds): in rank order they cover every row once, none above ceil(rows / size), the
    last ones shorter or empty where the rows do not divide."""
    from dist_train.parallel_dims import share_bounds

    bounds = [share_bounds(rows, size=size, rank=rank) for rank in range(size)]
    assert bounds[0][0] == 0 and bounds[-1][1] == rows
    assert all(end == start for (_, end), (start, _) in zip(bounds, bounds[1:]))
    assert all(0 <= end - start <= -(-rows // size) for start, end in bounds)


def test_an_mxfp4_directory_is_refused_by_the_meta_reader_naming_the_two_ways_out():
    """GPT-OSS's published experts are MXFP4 blocks and scales: a model built on meta finds no tensor of its own name,
    and the one line says they are quantized and what to do, not only that weights are missing."""
    from types import SimpleNamespace

    from dist_train.weights import source_names

    experts = "model.layers.0.mlp.experts.down_proj"
    source = SimpleNamespace(path="/ckpt", locations={"lm_head.weight": 0, f"{experts}_blocks": 0,
                                                      f"{experts}_scales": 0})
    with pytest.raises(ValueError, match=r"^/ckpt: 1 of the model's tensors are saved quantized \(e\.g\. "
                                         rf"'{experts}_blocks' and its _scales: MXFP4\).*Mxfp4Config\(dequantize=True\)"
                                         r".*\(single, ddp, zero1, zero2\)$"):
        source_names(torch.nn.Module(), source, {experts: None, "lm_head.weight": None})
    with pytest.raises(ValueError, match=r"^/ckpt: no weights for 1 of the model's tensors"):  # anything else
        source_names(torch.nn.Module(), source, {"model.norm.weight": None})
    # under activation checkpointing a model built on meta is read with its blocks wrapped: the same line
    wrapped = "model.layers.0._checkpoint_wrapped_module.mlp.experts.down_proj"
    with pytest.raises(ValueError, match=rf"saved quantized \(e\.g\. '{experts}_blocks'"):
        source_names(torch.nn.Module(), source, {wrapped: None, "lm_head.weight": None})
