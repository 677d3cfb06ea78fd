"""Tensor parallelism applied to a model on DTensor (what it does: `dist_train/strategies/tp.py`'s docstring).

One of the functions dist_train.parallel.apply runs in its fixed order. Imported only when a run applies tensor
parallelism: DTensor and torch's parallel styles cost about 0.8 s to import.
"""

from __future__ import annotations

import types
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.distributed.tensor.placement_types import _StridedShard

from dist_train.contracts import full_of, place_like
from dist_train.model import model_layout, transformer_blocks


def _resolved(block: nn.Module) -> nn.Module:
    """The block itself, under activation checkpointing's wrapper if there is one."""
    return getattr(block, "_checkpoint_wrapped_module", block)


class _Conv1DStyle:
    """Mixin: transformers' `Conv1D` stores its weight transposed (in x out), so split the other dimension."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:  # type: ignore[override]
        if type(module).__name__ != "Conv1D":
            return super()._apply(module, device_mesh)  # type: ignore[misc]
        # nn.Linear's (out, in) weight: colwise Shard(0), rowwise Shard(1). Conv1D's is (in, out).
        weight_dim = 1 if isinstance(self, ColwiseParallel) else 0
        bias = Shard(0) if isinstance(self, ColwiseParallel) else Replicate()
        if isinstance(self, RowwiseParallel):
            self.desired_input_layouts = (Shard(-1),)

        def partition(name: str, mod: nn.Module, mesh: DeviceMesh) -> None:
            _distribute(mod, "weight", mesh, Shard(weight_dim), self.src_data_rank)  # type: ignore[attr-defined]
            _distribute(mod, "bias", mesh, bias, self.src_data_rank)  # type: ignore[attr-defined]

        return distribute_module(
            module, device_mesh, partition,
            lambda mod, inputs, mesh: self._prepare_input_fn(  # type: ignore[attr-defined]
                self.input_layouts, self.desired_input_layouts, mod, inputs, mesh  # type: ignore[attr-defined]
            ),
            lambda mod, outputs, mesh: self._prepare_output_fn(  # type: ignore[attr-defined]
                self.output_layouts, self.use_local_output, mod, outputs, mesh  # type: ignore[attr-defined]
            ),
        )


class Colwise(_Conv1DStyle, ColwiseParallel):
    """torch's ColwiseParallel, for nn.Linear and transformers' Conv1D."""


class Rowwise(_Conv1DStyle, RowwiseParallel):
    """torch's RowwiseParallel, for nn.Linear and transformers' Conv1D."""


def _distribute(module: nn.Module, name: str, mesh: DeviceMesh, placement: Any, src_data_rank: int | None) -> None:
    p = getattr(module, name, None)
    if p is None or isinstance(p, DTensor):
        return
    t = distribute_tensor(p.data, mesh, [placement], src_data_rank=src_data_rank)
    module.register_parameter(name, nn.Parameter(t, requires_grad=p.requires_grad))


class FusedColwiseConv1D(nn.Module):
    """A fused [q | k | v] Conv1D (GPT-2's c_attn), column-parallel by head: each rank computes its heads of all three.

    Keeps the Conv1D's parameter names (`weight`, `bias`), so state dicts match transformers'."""

    def __init__(self, conv: nn.Module, mesh: DeviceMesh, *, parts: int, src_data_rank: int | None) -> None:
        super().__init__()
        self.mesh = mesh
        self.weight = conv.weight
        self.bias = conv.bias
        _distribute(self, "weight", mesh, _StridedShard(1, split_factor=parts), src_data_rank)
        _distribute(self, "bias", mesh, _StridedShard(0, split_factor=parts), src_data_rank)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Identity in forward; in backward the ranks' partial input gradients are summed: all-reduced, or,
        # when the input is a gathered DTensor (sequence parallelism), reduce-scattered back to the sequence
        # shards by that gather's backward.
        if not isinstance(x, DTensor):
            x = DTensor.from_local(x, self.mesh, [Replicate()], run_check=False)
        x = x.to_local(grad_placements=[Partial()])
        weight, bias = self.weight.to_local(), self.bias.to_local()  # type: ignore[attr-defined]
        out = torch.addmm(bias, x.reshape(-1, x.size(-1)), weight)
        return out.view(*x.shape[:-1], weight.size(1))


class Replicated(ParallelStyle):
    """Every rank holds the module whole and computes it on the same input: parameters become `Replicate`
    DTensors (so one optimizer and one norm see only DTensors), inputs and outputs stay local tensors."""

    def __init__(self, src_data_rank: int | None = None) -> None:
        super().__init__()
        self.src_data_rank = src_data_rank

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def partition(name: str, mod: nn.Module, mesh: DeviceMesh) -> None:
            for pname, _ in list(mod.named_parameters(recurse=False)):
                _distribute(mod, pname, mesh, Replicate(), self.src_data_rank)

        def inputs(mod: nn.Module, args: tuple[Any, ...], mesh: DeviceMesh) -> tuple[Any, ...]:
            return tuple(
                DTensor.from_local(a, mesh, [Replicate()], run_check=False)
                if isinstance(a, torch.Tensor) and not isinstance(a, DTensor) else a
                for a in args
            )

        def outputs(mod: nn.Module, out: Any, mesh: DeviceMesh) -> Any:
            if isinstance(out, tuple):  # an MoE router's (logits, weights, indices)
                return tuple(o.to_local() if isinstance(o, DTensor) else o for o in out)
            return out.to_local() if isinstance(out, DTensor) else out

        return distribute_module(module, device_mesh, partition, inputs, outputs)


class HeadNorm(ParallelStyle):
    """transformers' `replicated_with_grad_allreduce` for a norm applied per attention head (Qwen3's q_norm and
    k_norm): its weight stays whole on every rank (a `Replicate` DTensor), its input is this rank's heads, marked
    split on the heads dimension, so the weight's gradient, a sum over every rank's heads, is all-reduced: once, in
    backward, by a hook (`_whole_gradient`). Left `Partial`, every use of it (the gradient norm, clipping, each of the
    optimizer's updates) all-reduced it again: 4 times a step under AdamW, 2 under SGD (measured); under fsdp_tp FSDP2's
    reduction did once a step. Now once per micro-batch, whatever the optimizer and the strategy."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def partition(name: str, mod: nn.Module, mesh: DeviceMesh) -> None:
            for pname, _ in list(mod.named_parameters(recurse=False)):
                _distribute(mod, pname, mesh, Replicate(), None)

        def inputs(mod: nn.Module, args: tuple[Any, ...], mesh: DeviceMesh) -> tuple[Any, ...]:
            for p in mod.parameters(recurse=False):  # on the parameter as trained: built on meta, it is replaced
                if not getattr(p, "_whole_gradient", False):  # when filled, which drops hooks registered before
                    p.register_hook(_whole_gradient)
                    p._whole_gradient = True
            x = args[0]
            return (DTensor.from_local(x, mesh, [Shard(x.ndim - 2)], run_check=False), *args[1:])

        def outputs(mod: nn.Module, out: Any, mesh: DeviceMesh) -> Any:
            return out.to_local() if isinstance(out, DTensor) else out

        return distribute_module(module, device_mesh, partition, inputs, outputs)


def _whole_gradient(grad: Any) -> Any:
    """A gradient partial over the tensor-parallel ranks, summed (one all-reduce), as its parameter is whole."""
    if isinstance(grad, DTensor) and any(isinstance(p, Partial) for p in grad.placements):
        return grad.redistribute(grad.device_mesh, [Replicate()] * grad.device_mesh.ndim)
    return grad


def tp_plan(config: Any, block: nn.Module, *, sequence_parallel: bool = False,
            experts_by_ep: bool = False) -> dict[str, ParallelStyle]:
    """Per transformer block: which projection is split how (paths relative to the block), from transformers'
    own plan for the architecture, or the one dist_train/architectures.py writes where transformers has none.

    With sequence parallelism the residual stream between the projections is split by sequence: the
    norms run on each rank's tokens (torch's `SequenceParallel`), attention's and the MLP's input is
    all-gathered on entry, and the row-parallel outputs are reduce-scattered instead of all-reduced."""
    from dist_train.parallel.plans import GATHERING_STYLES, block_sequence_parallel_plan, block_tp_plan

    row = {"output_layouts": Shard(1)} if sequence_parallel else {}
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    plan: dict[str, ParallelStyle] = {}
    styles = block_tp_plan(config, experts_by_ep=experts_by_ep)
    if experts_by_ep:  # an MoE layer has no dense MLP (Qwen3-MoE's plan names both; mlp_only_layers are dense)
        styles = {path: style for path, style in styles.items() if _has(block, path)}
    gathering = sorted({s for s in styles.values() if s in GATHERING_STYLES})
    if sequence_parallel and gathering:
        raise ValueError(f"model.arch={config.model_type}'s tensor-parallel plan uses {', '.join(gathering)}, which "
                         "keeps attention and the MLP whole on every rank: sequence parallelism cannot split them; "
                         "use strategy.sequence_parallel=false")
    for path, style in styles.items():
        if style == "colwise":
            plan[path] = Colwise()
        elif style == "rowwise":
            plan[path] = Rowwise(**row)
        elif style == "colwise_gather_output":  # the split output all-gathered whole
            plan[path] = Colwise(output_layouts=Replicate(), use_local_output=True)
        elif style == "rowwise_split_input":  # a whole input, each rank taking its slice of the last dimension
            plan[path] = Rowwise(input_layouts=Replicate())
        elif style == "colwise_fused_qkv":  # replaced by FusedColwiseConv1D before the plan is applied
            continue
        else:  # replicated_with_grad_allreduce
            weight = block.get_submodule(path).weight
            if weight.shape != (head_dim,):
                raise ValueError(f"{config.model_type}: {path} ({style}) normalises {tuple(weight.shape)}, not one "
                                 f"attention head ({head_dim}): splitting it is not supported")
            plan[path] = HeadNorm()
    if sequence_parallel:
        roles = block_sequence_parallel_plan(config)
        if not set(roles) <= {name for name, _ in block.named_children()}:
            raise ValueError(f"{config.model_type}: sequence parallelism needs blocks laid out as Llama's "
                             f"({', '.join(sorted(roles))}); use strategy.sequence_parallel=false")
        plan |= {name: _SEQUENCE_PARALLEL_ROLES[role]() for name, role in roles.items()}
    return plan


def _has(block: nn.Module, path: str) -> bool:
    try:
        block.get_submodule(path)
    except AttributeError:
        return False
    return True


def _gather_input() -> ParallelStyle:
    """The module's first argument arrives split by sequence and is used whole (an all-gather)."""
    return PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))


def _gather_kwarg_input() -> ParallelStyle:
    """As _gather_input, for a module given its input by keyword (transformers' decoder layers call attention so)."""
    return PrepareModuleInput(input_kwarg_layouts={"hidden_states": Shard(1)},
                              desired_input_kwarg_layouts={"hidden_states": Replicate()})


_SEQUENCE_PARALLEL_ROLES = {"norm": SequenceParallel, "gather_input": _gather_input,
                            "gather_kwarg_input": _gather_kwarg_input}


def _split_sequence(mesh: DeviceMesh) -> Any:
    """A forward pre-hook: the module's first argument, whole on every rank, becomes this rank's slice of
    the sequence (no communication; its gradient is all-gathered in backward)."""

    def hook(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        whole = DTensor.from_local(args[0], mesh, [Replicate()], run_check=False)
        return (whole.redistribute(mesh, [Shard(1)]).to_local(), *args[1:])

    return hook


def _split_vocabulary(model: nn.Module, mesh: DeviceMesh) -> None:
    """The token embedding and the LM head split by vocabulary row (Megatron's and torchtitan's layout).

    The embedding looks up the ids in this rank's rows and all-reduces the result (`_vocab_parallel_lookup`);
    the head (torch's ColwiseParallel) computes each rank's vocabulary slice of the logits, left as a DTensor
    that `loss_parallel` (see TPStrategy) reduces without gathering: the max, the sum of exponentials and the
    target's logit are all-reduced per token. A tied head shares the embedding's sharded weight (both store
    vocab x hidden)."""
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    tied = head is not None and head.weight is embed.weight
    if type(embed).forward is nn.Embedding.forward or hasattr(embed, "embed_scale"):  # Gemma's scales its rows
        _distribute(embed, "weight", mesh, Shard(0), None)
        # Shard(0)'s rows: torch.chunk's, ceil(vocab / t) per rank, the last ranks' fewer
        vocab, per_rank = embed.weight.shape[0], -(-embed.weight.shape[0] // mesh.size())
        first = min(mesh.get_local_rank() * per_rank, vocab)
        embed.vocab_rows = (first, first + embed.weight.to_local().shape[0])
        embed.forward = types.MethodType(_vocab_parallel_lookup, embed)
    else:  # an embedding with its own forward: torch's style (its gradient is computed whole on every rank)
        parallelize_module(embed, mesh, RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
                           src_data_rank=None)
    if head is None:
        return
    parallelize_module(head, mesh, ColwiseParallel(input_layouts=Replicate(), output_layouts=Shard(-1),
                                                   use_local_output=False), src_data_rank=None)
    if tied:
        head.weight = embed.weight


def _vocab_parallel_lookup(self: nn.Embedding, ids: torch.Tensor) -> torch.Tensor:
    """Megatron's VocabParallelEmbedding as an nn.Embedding's forward: ids outside this rank's rows look up
    row 0 and are zeroed, and the ranks' partial results are all-reduced. Unlike torch's RowwiseParallel
    (torch 2.13), the weight's gradient is this rank's rows only, not the whole table on every rank (measured).
    A padding row (`padding_idx`, whose gradient stays zero) is on one rank: its index in that rank's rows."""
    weight = self.weight
    first, end = self.vocab_rows  # type: ignore[misc]
    local_ids = ids - first
    outside = (local_ids < 0) | (local_ids >= end - first)
    pad = None if self.padding_idx is None or not first <= self.padding_idx < end else self.padding_idx - first
    rows = F.embedding(local_ids.masked_fill(outside, 0), weight.to_local(), pad, self.max_norm, self.norm_type,
                       self.scale_grad_by_freq, self.sparse)
    rows = rows.masked_fill(outside.unsqueeze(-1), 0)
    out = DTensor.from_local(rows, weight.device_mesh, [Partial()], run_check=False)
    out = out.redistribute(weight.device_mesh, [Replicate()]).to_local()
    scale = getattr(self, "embed_scale", None)
    return out if scale is None else out * scale.to(out.dtype)


def parallelize(model: nn.Module, mesh: DeviceMesh, *, sequence_parallel: bool = False,
                experts_by_ep: bool = False) -> nn.Module:
    """Shard each block's projections, the token embedding and the LM head over `mesh` (1-D) and replicate the
    rest, in place. `experts_by_ep`: an MoE model's experts are left to expert parallelism (parallel/experts.py
    shards them next, over the experts' mesh); its routers are replicated, as the norms.

    Sequence parallelism: the first block takes its rank's slice of the sequence, the final norm runs on
    it too, and its output is gathered whole for the head (and for any reshape before it)."""
    from dist_train.architectures import expert_modules
    from dist_train.parallel.plans import block_tp_plan, per_rank_attributes

    tp, config = mesh.size(), model.config
    blocks = transformer_blocks(model)
    fused = [path for path, style in block_tp_plan(config, experts_by_ep=experts_by_ep).items()
             if style == "colwise_fused_qkv"]
    per_rank = per_rank_attributes(config)
    for block in blocks:
        inner = _resolved(block)
        for path in fused:  # each rank runs its heads of q, k and v
            inner.set_submodule(path, FusedColwiseConv1D(inner.get_submodule(path), mesh, parts=3, src_data_rank=None))
        for path in per_rank:  # what one rank computes: its heads, their width
            parent, _, name = path.rpartition(".")
            owner = inner.get_submodule(parent)  # "" is the block itself
            setattr(owner, name, getattr(owner, name) // tp)
        # Every rank built the same weights from the seed: nothing to broadcast.
        parallelize_module(inner, mesh, tp_plan(config, inner, sequence_parallel=sequence_parallel,
                                                experts_by_ep=experts_by_ep), src_data_rank=None)
    if sequence_parallel:
        _resolved(blocks[0]).register_forward_pre_hook(_split_sequence(mesh))
        norm = model.get_submodule(model_layout(model).last[0])  # the final norm
        parallelize_module(norm, mesh, SequenceParallel(), src_data_rank=None)
        parallelize_module(norm, mesh, PrepareModuleOutput(
            output_layouts=(Shard(1),), desired_output_layouts=(Replicate(),), use_local_output=True))
    _split_vocabulary(model, mesh)
    experts = {id(m) for m in expert_modules(model)} if experts_by_ep else set()
    for module in list(model.modules()):
        if id(module) not in experts and any(not isinstance(p, DTensor) for p in module.parameters(recurse=False)):
            parallelize_module(module, mesh, Replicated(), src_data_rank=None)
    return model


def _strided(t: Any) -> bool:
    return isinstance(t, DTensor) and any(isinstance(p, _StridedShard) for p in t.placements)


def contiguous(t: Any) -> Any:
    """A `_StridedShard` DTensor as plain `Shard` on the same dimension (one contiguous block per rank)."""
    if not _strided(t):
        return t
    t = t.detach()
    placements = [Shard(p.dim) if isinstance(p, _StridedShard) else p for p in t.placements]
    return distribute_tensor(full_of(t), t.device_mesh, placements, src_data_rank=None)


def like(loaded: Any, current: Any) -> Any:
    """`loaded` in `current`'s placements where `current` is a `_StridedShard` DTensor (see TPStrategy)."""
    if isinstance(current, dict) and isinstance(loaded, dict):
        return {k: like(v, current.get(k)) for k, v in loaded.items()}
    if _strided(current) and isinstance(loaded, DTensor):
        return place_like(full_of(loaded.detach()), current)
    return loaded
