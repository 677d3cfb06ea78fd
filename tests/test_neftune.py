"""NEFTune: noise on the token embeddings in training only, the same noise for a sample however a strategy
splits the batch, and a run that trains with it."""

from __future__ import annotations

import torch

from dist_train.config import ModelConfig
from dist_train.model import apply_neftune, build_model
from tests.helpers import FAST, train_ok


def test_neftune_perturbs_training_embeddings_only_and_per_sample():
    model = build_model(ModelConfig(), seed=0)
    clean = build_model(ModelConfig(), seed=0)
    hook = apply_neftune(model, alpha=5.0, seed=3)
    hook.begin_step(7)
    ids = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(0))
    emb, ref = model.get_input_embeddings(), clean.get_input_embeddings()

    model.eval()  # evaluation: untouched, to the bit
    assert torch.equal(model(ids).logits, clean.eval()(ids).logits)

    model.train()
    noisy = emb(ids)
    delta = noisy - ref(ids)
    bound = 5.0 / (32 * 64) ** 0.5  # alpha / sqrt(seq_len * hidden)
    assert 0 < delta.abs().max() <= bound * (1 + 1e-6)
    # a sample's noise does not depend on its neighbours (data parallelism and micro-batches split the batch)
    assert torch.equal(emb(ids[2:3]) - ref(ids[2:3]), delta[2:3])
    # ... but it does on the step: fresh noise every step
    hook.begin_step(8)
    assert not torch.equal(emb(ids) - ref(ids), delta)


def test_neftune_run_differs_from_the_plain_one_and_still_learns(single_run, tmp_path):
    _, plain = single_run
    noisy = train_ok(["strategy=single", "logger=none", *FAST, "train.neftune_alpha=5"], run_dir=tmp_path)
    assert noisy["losses"] != plain["losses"]
    assert noisy["losses"][-1] < noisy["losses"][0]
