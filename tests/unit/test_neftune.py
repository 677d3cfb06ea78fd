"""NEFTune: noise on the token embeddings in training only, the same noise for a sample however a strategy
splits the batch, made on the output's device without a host synchronisation. Runs that train with it:
tests/launched/test_neftune.py."""

from __future__ import annotations

from typing import Any

import torch

from dist_train.config import ModelConfig
from dist_train.model import NEFTune, apply_neftune, build_model


def _noisy_embeddings(*, alpha: float = 5.0, seed: int = 3, step: int = 7):
    """The tiny model's embedding with NEFTune on, the same embedding without, and the hook."""
    model, clean = build_model(ModelConfig(), seed=0), build_model(ModelConfig(), seed=0)
    hook = apply_neftune(model, alpha=alpha, seed=seed)
    hook.begin_step(step)
    return model, clean, hook


def _ids(rows: int, *, seed: int, seq_len: int = 32) -> torch.Tensor:
    return torch.randint(0, 256, (rows, seq_len), generator=torch.Generator().manual_seed(seed))


def test_neftune_perturbs_training_embeddings_only_and_per_sample():
    model, clean, hook = _noisy_embeddings()
    ids = _ids(4, seed=0)
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


def test_neftune_noise_is_the_samples_own_wherever_it_sits():
    model, clean, hook = _noisy_embeddings()
    emb, ref = model.get_input_embeddings(), clean.get_input_embeddings()
    first, second = _ids(4, seed=0), _ids(3, seed=1)
    second[2] = first[1]  # one sample in two batches, at rows 1 and 2, among different neighbours

    a, b = emb(first) - ref(first), emb(second) - ref(second)
    assert torch.equal(a[1], b[2])
    # the other samples' noise differs from it and from each other's (rows 0 and 1 of the second batch too)
    noises = [a[0], a[1], a[2], a[3], b[0], b[1]]
    assert all(not torch.equal(x, y) for i, x in enumerate(noises) for y in noises[i + 1:])
    # two samples one token apart get unrelated noise, not a shifted copy
    near = first[1:2].clone()
    near[0, -1] = (near[0, -1] + 1) % 256
    assert (emb(near) - ref(near) - a[1]).abs().mean() > 0.5 * a[1].abs().mean()
    hook.begin_step(8)  # and the same sample at the next step
    assert not torch.equal(emb(first[1:2])[0] - ref(first[1:2])[0], a[1])


def test_neftune_noise_is_uniform_in_minus_one_to_one():
    model, clean, _ = _noisy_embeddings(alpha=1.0)
    ids = _ids(16, seed=2)
    emb, ref = model.get_input_embeddings(), clean.get_input_embeddings()
    u = ((emb(ids) - ref(ids)) * (32 * 64) ** 0.5).flatten()  # 32768 draws, back to [-1, 1)
    assert -1 - 1e-5 <= u.min() and u.max() < 1 + 1e-5
    assert u.mean().abs() < 0.02  # a uniform's mean 0; its standard error here is 0.003
    assert (u.square().mean() - 1 / 3).abs() < 0.02  # and variance 1/3
    counts = torch.histc(u, bins=8, min=-1, max=1)
    assert counts.min() > 0.9 * len(u) / 8 and counts.max() < 1.1 * len(u) / 8  # each bin within 10% of 1/8


def test_neftune_mixing_is_splitmix64_bit_for_bit():
    """The hash in int64 tensor ops (wrapping products, arithmetic shifts masked into logical ones) gives
    splitmix64's published outputs (seed 1234567) and a plain-integer reference's, negative states included."""
    mask = (1 << 64) - 1

    def reference(x: int) -> int:
        z = x & mask
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
        return z ^ (z >> 31)

    def signed(x: int) -> int:
        return (x & mask) - (1 << 64) if (x & mask) >> 63 else x & mask

    states = [signed(1234567 + i * 0x9E3779B97F4A7C15) for i in range(1, 4)] + [-1, -(1 << 63), (1 << 63) - 1, 0]
    z = torch.tensor(states)
    got = [x & mask for x in NEFTune._splitmix64_(z, torch.empty_like(z)).tolist()]
    assert got[:3] == [6457827717110365317, 3203168211198807973, 9817491932198370423]
    assert got == [reference(s) for s in states]


def test_neftune_hook_never_waits_for_the_device(monkeypatch):
    """Issue 21: no `.cpu()`, `.item()`, `.tolist()` or int() of a tensor in the hook (each a device-to-host
    copy that blocks the host on a GPU), not even the first time it meets a sequence length."""
    model, clean, _ = _noisy_embeddings()
    emb, ref = model.get_input_embeddings(), clean.get_input_embeddings()
    ids = _ids(4, seed=0)
    expected = ref(ids)
    calls: list[str] = []

    def forbid(name: str):
        def blocked(*args: Any, **kwargs: Any):
            calls.append(name)
            raise AssertionError(f"NEFTune's hook called Tensor.{name}: a host synchronisation")
        return blocked

    for name in ("cpu", "item", "tolist", "numpy", "__int__", "__float__", "__bool__", "__index__"):
        monkeypatch.setattr(torch.Tensor, name, forbid(name))
    noisy = emb(ids)
    monkeypatch.undo()
    assert calls == []
    assert not torch.equal(noisy, expected)
