"""The seeded random init (weights.SeededInit): the architecture's own init, drawn block by block, so that a
tensor's values depend on the seed and its name only, whatever a strategy shards or splits."""

from __future__ import annotations

import pytest
import torch

from dist_train.config import ModelConfig
from dist_train.model import build_model, transformer_blocks, weight_source
from dist_train.weights import SeededInit, materialize
from tests.own_model_support import ARCHS


def _config(arch: str):
    from transformers import AutoConfig

    return AutoConfig.for_model(arch, vocab_size=256, max_position_embeddings=128, **ARCHS[arch])


@pytest.mark.parametrize("arch", list(ARCHS))
def test_the_seeded_init_is_the_architectures_own(arch):
    """Per tensor, what transformers' own construction gives: the same values where it draws nothing (norms'
    ones, Gemma's zeros, biases' zeros, rotary frequencies), and random tensors at its scale (GPT-2's residual projections at
    1/sqrt(2 n_layer) of the rest)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(_config(arch))
    torch.manual_seed(1)
    again = dict(AutoModelForCausalLM.from_config(_config(arch)).state_dict())
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(_config(arch))
    reference = _meta(arch)
    materialize(model, SeededInit(reference, seed=0, blocks=list(transformer_blocks(reference))), "cpu")
    ours = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    theirs = {**dict(hf.named_parameters()), **dict(hf.named_buffers())}
    assert ours.keys() == theirs.keys()
    for name, t in theirs.items():
        mine = ours[name]
        if name not in again or torch.equal(again[name], t):  # not drawn: a constant, or computed
            assert torch.equal(mine, t), name
        else:
            ratio = (mine.float().std() / t.float().std()).item()
            assert 0.8 < ratio < 1.25, (name, ratio)
            assert not torch.equal(mine, t), name  # drawn by us, not left from transformers' construction


def _meta(arch: str):
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(_config(arch))


def test_a_tensors_values_depend_on_the_seed_and_its_name_only():
    """A stage that draws only its own blocks, or draws them in another order, gets the values one process has;
    another seed gets others; and the run's generator is where `manual_seed(seed)` put it."""
    cfg = ModelConfig(arch="llama", num_layers=3, hidden_size=32, num_heads=4, vocab_size=64)
    whole = build_model(cfg, seed=5)
    after_build = torch.rand(3)
    torch.manual_seed(5)
    assert torch.equal(after_build, torch.rand(3))

    source = weight_source(cfg, seed=5)
    assert isinstance(source, SeededInit)
    last = "model.layers.2.mlp.down_proj.weight"
    alone = source.read(last)  # only block 2 drawn
    assert torch.equal(alone, whole.get_parameter(last))
    rows = source.read(last, 3, 7)
    assert torch.equal(rows, whole.get_parameter(last)[3:7])
    other = weight_source(cfg, seed=6).read(last)
    assert not torch.equal(other, alone)
    # one unit at a time: moving to the next unit drops the previous one
    source = weight_source(cfg, seed=5)
    targets = {n: (n, p) for n, p in whole.named_parameters()}
    held = []
    for _, name, _ in source.by_unit(targets):
        source.read(name)
        held.append(len(source._handles))
    assert max(held) == 1 and not source._handles
