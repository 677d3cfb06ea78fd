"""Cut a `transformers` causal LM into pipeline stages; no torch.distributed in here.

A stage runs: the embeddings (first stage only), a contiguous range of transformer blocks, then the
final norm and the LM head (last stage only). It calls the same HF submodules in the same order with
the same arguments as the full model's forward, so each stage computes bit for bit what those layers
compute inside the unsplit model (the same-loss promise rests on this).

The stage keeps the *pruned* HF model as its only child: the modules other stages own are set to
None, so every parameter keeps its original name (``transformer.h.3.attn.c_attn.weight``), which is
what a checkpoint written per stage needs to be reassembled, and the pruned parameters can be freed.

Also here: the balanced split of blocks over stages by parameter count (a pure function).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from dist_train.model import model_layout


# --------------------------------------------------------------------------------------------------
# The split.
# --------------------------------------------------------------------------------------------------


def split_layers(
    block_params: Sequence[int], *, num_stages: int, first_extra: int = 0, last_extra: int = 0
) -> list[int]:
    """Boundaries (first block of stages 1..K-1) that minimise the largest stage's parameter count.

    Stage s holds blocks [b[s-1], b[s]); the first stage also holds `first_extra` parameters (the
    embeddings) and the last `last_extra` (final norm and LM head). Every stage gets at least one
    block. Exact (dynamic programming over cut positions); among equally good splits the one with
    the earliest cuts wins, so the result is deterministic.
    """
    n, k = len(block_params), num_stages
    if k < 1 or n < k:
        raise ValueError(f"cannot split {n} blocks into {k} stages (each stage needs at least one block)")
    prefix = [0]
    for count in block_params:
        prefix.append(prefix[-1] + count)

    def load(stage: int, lo: int, hi: int) -> int:
        extra = (first_extra if stage == 0 else 0) + (last_extra if stage == k - 1 else 0)
        return prefix[hi] - prefix[lo] + extra

    # best[s][i]: smallest possible max load when stages 0..s-1 hold blocks [0, i).
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(k + 1)]
    cut = [[0] * (n + 1) for _ in range(k + 1)]
    best[0][0] = 0
    for s in range(1, k + 1):
        for i in range(s, n - (k - s) + 1):
            for j in range(s - 1, i):
                value = max(best[s - 1][j], load(s - 1, j, i))
                if value < best[s][i]:
                    best[s][i], cut[s][i] = value, j
    bounds, i = [], n
    for s in range(k, 1, -1):
        i = cut[s][i]
        bounds.append(i)
    return bounds[::-1]


def stage_ranges(bounds: Sequence[int], *, num_layers: int) -> list[tuple[int, int]]:
    """[start, end) of the blocks of every stage, from the boundaries."""
    edges = [0, *bounds, num_layers]
    return list(zip(edges[:-1], edges[1:]))


# --------------------------------------------------------------------------------------------------
# Where the parts of a model live (dotted paths inside the HF model).
# --------------------------------------------------------------------------------------------------


def _get(model: nn.Module, path: str) -> nn.Module:
    module = model
    for part in path.split("."):
        module = getattr(module, part)
    return module


def _drop(model: nn.Module, path: str) -> None:
    parent, _, name = path.rpartition(".")
    setattr(_get(model, parent) if parent else model, name, None)  # nn.Module allows None children


def _num_params(modules: Sequence[nn.Module]) -> int:
    params = {id(p): p for m in modules for p in m.parameters()}
    return sum(p.numel() for p in params.values())


def param_counts(model: nn.Module) -> tuple[int, list[int], int]:
    """(first-stage extra, per-block counts, last-stage extra) as each stage would hold them.

    A tied head counts on the last stage too: that stage holds its own copy of the embedding matrix.
    """
    layout = model_layout(model)
    blocks = _get(model, layout.blocks)
    first = _num_params([_get(model, p) for p in layout.first])
    last = _num_params([_get(model, p) for p in layout.last])
    return first, [_num_params([b]) for b in blocks], last


def is_tied(model: nn.Module) -> bool:
    layout = model_layout(model)
    return _get(model, layout.embedding).weight is _get(model, layout.head).weight


# --------------------------------------------------------------------------------------------------
# The stage module.
# --------------------------------------------------------------------------------------------------


class Stage(nn.Module):
    """Blocks [start, end) of `model`, plus embeddings if first and norm + head if last.

    Input: token ids [batch, seq] (first stage) or hidden states [batch, seq, hidden].
    Output: hidden states, or logits [batch, seq, vocab] on the last stage.

    A model with a pipeline plan runs its own forward: the block list holds only this stage's blocks (under their
    own indices), the final norm is an identity before the last stage, and a later stage feeds the model a
    placeholder of zeros whose place the received activations take at the stage's first block. So masks (sliding
    windows per layer type), rotary embeddings, embedding scales and logit caps are the model's own code.
    """

    def __init__(self, model: nn.Module, *, start: int, end: int, is_first: bool, is_last: bool) -> None:
        super().__init__()
        self.layout = layout = model_layout(model)
        num_layers = len(_get(model, layout.blocks))
        for path in () if is_first else layout.first:
            _drop(model, path)
        for path in () if is_last else layout.last:
            _drop(model, path)
        self.start, self.end, self.is_first, self.is_last = start, end, is_first, is_last
        self._received: torch.Tensor | None = None
        if layout.generic:
            self._keep_own_blocks(model, num_layers)
        else:
            for i in [*range(start), *range(end, num_layers)]:
                _drop(model, f"{layout.blocks}.{i}")
        self.model = model  # pruned in place: parameter names stay those of the full model
        self.config = model.config

    def _keep_own_blocks(self, model: nn.Module, num_layers: int) -> None:
        """The block list keeps this stage's blocks only, under their indices in the full model (the names of
        their parameters); the model's config says as many layers, and the layer types of those (the model's
        forward indexes `config.layer_types` from 0)."""
        import copy

        blocks = _get(model, self.layout.blocks)
        for i in [*range(self.start), *range(self.end, num_layers)]:
            del blocks._modules[str(i)]
        whole = model.config
        config = copy.deepcopy(whole)
        config.num_hidden_layers = self.end - self.start
        if isinstance(getattr(config, "layer_types", None), list):
            config.layer_types = config.layer_types[self.start:self.end]
        for module in model.modules():
            if getattr(module, "config", None) is whole:
                module.config = config
        # What holds no parameter between the embedding and the blocks (a dropout), and the final norm, run only on
        # the first and last stage: elsewhere the model's forward finds identities there.
        for path in (self.layout.first[1:] if not self.is_first else ()) + (self.layout.last[:-1] if not self.is_last else ()):
            parent, _, name = path.rpartition(".")
            setattr(_get(model, parent), name, nn.Identity())
        if not self.is_first:
            next(iter(blocks)).register_forward_pre_hook(self._take_received, with_kwargs=True)

    def _take_received(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        assert self._received is not None
        if args:
            return (self._received, *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": self._received}

    def blocks(self) -> list[nn.Module]:
        module_list = _get(self.model, self.layout.blocks)
        if self.layout.generic:
            return list(module_list)
        return [module_list[i] for i in range(self.start, self.end)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.layout.stage_forward is not None:  # the model layer's own forward over some blocks (GPT-2's)
            return self.layout.stage_forward(self.model, self.blocks(), x, is_first=self.is_first,
                                             is_last=self.is_last)
        base = _get(self.model, self.layout.blocks.rpartition(".")[0])
        if self.is_first:
            inputs: dict[str, Any] = {"input_ids": x}
        else:  # the placeholder's values are never used: the first block takes `x` instead
            inputs = {"inputs_embeds": torch.zeros_like(x)}
            self._received = x
        try:
            if self.is_last:
                return self.model(**inputs, use_cache=False).logits
            return base(**inputs, use_cache=False).last_hidden_state
        finally:
            self._received = None


def build_stage(model: nn.Module, *, bounds: Sequence[int], stage_index: int) -> Stage:
    """Stage `stage_index` of len(bounds) + 1; prunes `model` in place to what that stage runs."""
    num_layers = len(_get(model, model_layout(model).blocks))
    ranges = stage_ranges(bounds, num_layers=num_layers)
    start, end = ranges[stage_index]
    return Stage(model, start=start, end=end, is_first=stage_index == 0, is_last=stage_index == len(ranges) - 1)
