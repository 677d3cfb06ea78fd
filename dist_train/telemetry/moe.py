"""Mixture-of-Experts load, per rank and per MoE layer: how many (token, expert) pairs the router sent to each
expert in the logging window, from this rank's own tokens.

A forward pre-hook on each experts module (transformers' stacked experts, `architectures.expert_modules`) reads
the router's top-k indices as the block hands them over, and adds a `bincount` of them on the device: no host sync
in the step. A checkpointed block's recomputation in backward routes the same tokens again, so pairs are counted
only outside backward (`torch._C._current_graph_task_id() == -1`). At the window's end (`drain`) the counts come to
the host once, and become, for each layer L:

- `moe/layer{L}/tokens_per_expert`: the counts (a list, in metrics.jsonl only);
- `moe/layer{L}/maxvio`: (most loaded expert - mean) / mean, the MaxVio of Wang et al. 2024 (0 when balanced);
- `moe/layer{L}/dead_experts`: experts that received no pair;

and over the layers `moe/maxvio` (the worst layer), `moe/dead_experts` (summed) and `moe/expert_utilisation` (the
mean fraction of experts that received a pair). Under expert parallelism (fsdp_ep, ep), `moe/layer{L}/ep_overload` is
the rows this rank's experts received over the pairs it routed: every rank routes the same number of pairs, so the
mean over the EP group is 1 and the largest is the most loaded rank's overload (`moe/ep_overload`, the worst layer;
W&B's `/max` over ranks). Under tensor parallelism with strategy.ep every rank of a tp group holds the same tokens:
each counts only the share it dispatches. `memory/expert_params_bytes` is the part of `memory/params_bytes` that
experts hold (also under ZeRO-3's partitions; `memory/expert_grads_bytes` and `memory/expert_optimizer_bytes` come
with the strategy's ModelState, contracts.py, where its optimizer is torch's, and under ZeRO).

The loads are this rank's tokens, not the global batch's: summing `tokens_per_expert` over ranks gives the global
load, and no collective is added to the step to do so. summary.json's `moe_load` does that sum over every window
and rank (`run_load`), per layer, with its MaxVio and dead experts.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

from dist_train.contracts import local_tensor
from dist_train.parallel_dims import share_bounds


def maxvio(counts: list[int]) -> float:
    """(most loaded - mean) / mean of one layer's tokens per expert; 0 for no tokens."""
    mean = sum(counts) / len(counts)
    return (max(counts) - mean) / mean if mean else 0.0


def run_load(history: list[list[dict[str, Any]]]) -> dict[str, Any] | None:
    """summary.json's `moe_load`: each MoE layer's tokens per expert over every logged window and every rank (the
    run's global load), its MaxVio and dead experts; None for a dense model."""
    totals: dict[int, list[int]] = {}
    for records in history:
        for rec in records:
            for key, value in rec.items():
                if key.startswith("moe/layer") and key.endswith("/tokens_per_expert"):
                    layer = int(key[len("moe/layer"):].split("/")[0])
                    totals[layer] = [a + b for a, b in zip(totals[layer], value)] if layer in totals else list(value)
    if not totals:
        return None
    return {f"layer{layer}": {"tokens_per_expert": c, "maxvio": maxvio(c), "dead_experts": c.count(0)}
            for layer, c in sorted(totals.items())}


def _layer_index(name: str, position: int) -> int:
    found = re.search(r"layers\.(\d+)\.", name)
    return int(found.group(1)) if found else position


class RouterLoad:
    """Tokens per expert of each MoE layer of `model` on this rank (see the module's docstring)."""

    def __init__(self, model: nn.Module) -> None:
        from dist_train.architectures import expert_modules

        ids = {id(m) for m in expert_modules(model)}
        named = [(n, m) for n, m in model.named_modules() if id(m) in ids]
        self.modules: dict[int, nn.Module] = {_layer_index(n, i): m for i, (n, m) in enumerate(named)}
        self._counts: dict[int, torch.Tensor] = {}
        self._handles = [m.register_forward_pre_hook(self._hook(layer), with_kwargs=True)
                         for layer, m in self.modules.items()]

    def _hook(self, layer: int) -> Any:
        @torch.compiler.disable  # train.compile: eager, where expert parallelism's dispatch breaks the graph anyway
        def count(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            if torch._C._current_graph_task_id() != -1:  # a checkpointed block recomputed in backward
                return
            index = args[1] if len(args) > 1 else kwargs["top_k_index"]
            if getattr(module, "tp_size", 1) > 1:  # tensor parallelism: each rank holds the tokens, dispatches a share
                start, end = share_bounds(index.shape[0], size=module.tp_size, rank=module.tp_rank)
                index = index[start:end]
            experts = int(getattr(module, "num_global_experts", 0) or module.num_experts)
            counts = torch.bincount(index.detach().reshape(-1), minlength=experts)
            self._counts[layer] = counts if layer not in self._counts else self._counts[layer] + counts
        return count

    def __bool__(self) -> bool:
        return bool(self.modules)

    def drain(self) -> dict[str, Any]:
        """The window's metrics (see the module's docstring); the counts start again."""
        out: dict[str, Any] = {}
        worst, dead, used, overload = 0.0, 0, [], 0.0
        for layer in sorted(self._counts):
            counts = self._counts[layer].tolist()
            vio, zeros = maxvio(counts), counts.count(0)
            out[f"moe/layer{layer}/tokens_per_expert"] = counts
            out[f"moe/layer{layer}/maxvio"] = vio
            out[f"moe/layer{layer}/dead_experts"] = zeros
            worst, dead = max(worst, vio), dead + zeros
            used.append(1 - zeros / len(counts))
            module = self.modules[layer]
            received = getattr(module, "received_rows", None)
            if received is not None:
                routed = sum(counts)
                ratio = received / routed if routed else 0.0
                out[f"moe/layer{layer}/ep_overload"] = ratio
                overload = max(overload, ratio)
                module.received_rows = 0
        if used:
            out.update({"moe/maxvio": worst, "moe/dead_experts": dead,
                        "moe/expert_utilisation": sum(used) / len(used)})
        if overload:
            out["moe/ep_overload"] = overload
        out["memory/expert_params_bytes"] = expert_param_bytes(self.modules.values())
        self._counts = {}
        return out

    def close(self) -> None:
        for h in self._handles:
            h.remove()


def expert_param_bytes(modules: Any) -> int:
    """Bytes of the experts' parameters this rank stores: a DTensor's local shard, a ZeRO-3 partition (`ds_tensor`),
    otherwise the whole tensor."""
    total = 0
    for module in modules:
        for p in module.parameters():
            t = getattr(p, "ds_tensor", None)
            t = local_tensor(p) if t is None else t
            total += t.numel() * t.element_size()
    return total
