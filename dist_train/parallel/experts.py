"""Expert parallelism: each rank of an `ep` group holds E/ep of every MoE layer's experts, and the tokens travel to
them (one all-to-all of the routed rows forward, one back; each mirrored in backward). Imported only by the runs
that use it.

transformers lays an MoE layer's experts out as one module of stacked 3-D tensors (`gate_up_proj` E x 2I x h,
`down_proj` E x h x I: Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE), called with every token's hidden state, its top-k
expert indices and weights. Here:

- `shard_experts` makes those tensors DTensors sharded by expert (Shard(0)) over the `ep` mesh dimension, and
  replaces the module's forward with `dispatch`, which runs the module's own computation (transformers' eager loop,
  per expert) on the rows this rank's experts receive;
- `dispatch` sorts the (token, k) pairs by expert, exchanges the per-expert counts (one small all-to-all), sends each
  row to its expert's rank and brings the results back (`dist.all_to_all_single`, looked up when called, so that
  telemetry counts and times every call; gloo takes uneven splits with this form only), then weights and sums the
  k results of each token on the rank that owns it. A rank that receives no rows still runs both exchanges and
  keeps its (empty) share in the graph: its experts' gradients are zeros, and every collective still runs;
- under tensor parallelism (tp, fsdp_tp with strategy.ep) every rank of a tp group holds the same tokens: each
  dispatches its contiguous share of them (`_Share`) and the results are all-gathered over tp (`_Gather`); in
  backward the shares' gradients are all-gathered, so the router's and the residual stream's stay whole;
- under train.compile `dispatch` runs eager (`torch.compiler.disable`), one graph break in each compiled block: its
  counts change every micro-batch, and dynamo traced into it recompiled at each new one.

Gradients: a rank's expert gradient already sums the contributions of every rank whose tokens it computed, so the
right division is by the number of distinct batches (the data-parallel degree), not by the expert group's size:
parallel/apply.py passes it. The design and its traps: ../shared/DESIGN-moe.md.
"""

from __future__ import annotations

import types
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dist_train.architectures import expert_modules
from dist_train.parallel_dims import share_bounds


class _AllToAll(torch.autograd.Function):
    """Rows to their destination ranks (`send[r]` rows to rank r, `recv[r]` from it); backward sends the gradients
    back the same way."""

    @staticmethod
    def forward(ctx: Any, rows: torch.Tensor, send: list[int], recv: list[int], group: Any) -> torch.Tensor:
        ctx.send, ctx.recv, ctx.group = send, recv, group
        return _exchange(rows, send, recv, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        return _exchange(grad, ctx.recv, ctx.send, ctx.group), None, None, None


def _exchange(rows: torch.Tensor, send: list[int], recv: list[int], group: Any) -> torch.Tensor:
    out = rows.new_empty((sum(recv), *rows.shape[1:]))
    dist.all_to_all_single(out, rows.contiguous(), output_split_sizes=recv, input_split_sizes=send, group=group)
    return out


def _exchange_gathered(rows: torch.Tensor, *, group: Any, size: int) -> torch.Tensor:
    """Every rank's `rows` (each the same count, padded), concatenated in rank order."""
    out = rows.new_empty((rows.shape[0] * size, *rows.shape[1:]))
    dist.all_gather_single(out, rows.contiguous(), group=group)
    return out


class _Share(torch.autograd.Function):
    """Under tensor parallelism: this rank's share of rows that every rank of its tp group holds whole (tokens
    split in tp contiguous chunks, the last ones shorter). Backward: every rank's share's gradient all-gathered, so
    the whole tensor's gradient (the router's through it) is whole on every rank, as the residual stream's is."""

    @staticmethod
    def forward(ctx: Any, whole: torch.Tensor, group: Any, size: int, rank: int) -> torch.Tensor:
        ctx.group, ctx.size, ctx.rows = group, size, whole.shape[0]
        start, end = share_bounds(whole.shape[0], size=size, rank=rank)
        return whole[start:end]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, None, None, None]:
        return _gather_shares(grad, group=ctx.group, size=ctx.size, rows=ctx.rows), None, None, None


class _Gather(torch.autograd.Function):
    """The inverse of _Share: every rank's share all-gathered whole. Backward: the whole gradient (the same on every
    rank of the group) cut to this rank's share, with no communication."""

    @staticmethod
    def forward(ctx: Any, share: torch.Tensor, group: Any, size: int, rank: int, rows: int) -> torch.Tensor:
        ctx.bounds = share_bounds(rows, size=size, rank=rank)
        return _gather_shares(share, group=group, size=size, rows=rows)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None, None]:
        start, end = ctx.bounds
        return grad[start:end], None, None, None, None


def _gather_shares(share: torch.Tensor, *, group: Any, size: int, rows: int) -> torch.Tensor:
    """The `rows` whole, from every rank's share (`share_bounds`): each padded to ceil(rows / size) for the
    all-gather. Only the last non-empty share is short, so the rows are the gathered tensor's first `rows`."""
    per = -(-rows // size)
    padded = share if share.shape[0] == per else torch.cat([share, share.new_zeros((per - share.shape[0],
                                                                                    *share.shape[1:]))])
    return _exchange_gathered(padded, group=group, size=size)[:rows]


def shard_experts(model: nn.Module, mesh: Any, *, tp_mesh: Any = None) -> None:
    """Each experts module's stacked tensors sharded by expert over `mesh` (1-D, the ep dimension), its forward
    replaced by `dispatch`. In place. `tp_mesh`: the tensor-parallel dimension whose ranks hold the same tokens
    (each dispatches its share of them)."""
    from torch.distributed.tensor import Shard, distribute_tensor

    ep = mesh.size()
    for module in expert_modules(model):
        if getattr(module, "has_post_expert_norm", False) or not getattr(module, "has_gate", True):
            raise ValueError(f"{type(module).__name__}: expert parallelism runs experts as a gated projection, then "
                             "down (transformers' has_gate, without has_post_expert_norm); this architecture's are not "
                             "that: train it with fsdp, ddp, a ZeRO stage or a pipeline")
        experts = int(module.gate_up_proj.shape[0])
        assert experts % ep == 0, (experts, ep)  # checked with the config (strategies/fsdp_ep.py)
        for name, full in list(module.named_parameters(recurse=False)):  # the stacked matrices, and any biases
            assert full.shape[0] == experts, (name, tuple(full.shape))  # one row per expert (GPT-OSS's biases too)
            setattr(module, name, nn.Parameter(distribute_tensor(full.detach(), mesh, [Shard(0)], src_data_rank=None),
                                               requires_grad=full.requires_grad))
        module.ep_group, module.ep_size = mesh.get_group(), ep
        module.tp_group = tp_mesh.get_group() if tp_mesh is not None and tp_mesh.size() > 1 else None
        module.tp_size = tp_mesh.size() if module.tp_group is not None else 1
        module.tp_rank = tp_mesh.get_local_rank() if module.tp_group is not None else 0
        module.num_global_experts, module.num_local_experts = experts, experts // ep
        module.received_rows = 0  # rows this rank's experts received outside backward (telemetry/moe.py)
        module.forward = types.MethodType(dispatch, module)


def parallelize_experts(model: nn.Module, mesh: Any, *, precision: Any, divide_by: int,
                        reshard_after_forward: bool, tp_mesh: Any = None) -> None:
    """parallel/apply.py's experts step: each experts module sharded over `mesh["ep"]` (`shard_experts`), then
    FSDP2 over `mesh["efsdp"]`, its own unit. An expert's gradient sums every rank's tokens, so FSDP2 divides it by
    `divide_by`, the number of distinct batches, not by the efsdp group; where that group has more than one rank the
    wire carries a plain sum (FSDP2 would otherwise pre-multiply, which gloo rejects, and NCCL zeroes in bf16 up to
    torch 2.13: pytorch/pytorch#190747) and the division is local."""
    from torch.distributed.fsdp import fully_shard

    from dist_train.parallel.fsdp import mixed_precision

    from torch.distributed.tensor import Shard

    shard_experts(model, mesh["ep"], tp_mesh=tp_mesh)
    outer = mesh[mesh.mesh_dim_names[0]]  # efsdp, or edp (strategy=ep)
    if mesh.mesh_dim_names[0] == "edp" and outer.size() > 1:  # whole copies over edp, their gradients all-reduced
        _replicate_experts(model, outer, precision=precision, divide_by=divide_by)
        return
    # FSDP2 over efsdp; also over a one-rank edp, where it holds them whole and sends nothing (FSDP2's replicate
    # would still all-reduce each experts module's gradients with itself: measured, one call per layer)
    efsdp = outer
    for experts in expert_modules(model):
        # FSDP2 splits dim 0, the experts: with more efsdp ranks than this rank's experts each would hold a padded
        # row (Qwen3-30B-A3B on 1,024 ranks, ep 8: 16 experts over 128 ranks, 6.7 times the even share, found by the
        # dry run). Then it splits each expert's rows instead (dim 1), as torchtitan does.
        placement = (lambda _: Shard(1)) if efsdp.size() > experts.num_local_experts else None
        fully_shard(experts, mesh=efsdp, mp_policy=mixed_precision(precision),
                    reshard_after_forward=reshard_after_forward, shard_placement_fn=placement)
        experts.set_gradient_divide_factor(float(divide_by))
        if efsdp.size() > 1:
            experts.set_force_sum_reduction_for_comms(True)


def _replicate_experts(model: nn.Module, edp: Any, *, precision: Any, divide_by: int) -> None:
    """strategy=ep's experts: FSDP2's replicate over `edp`, the ranks holding the same E/ep experts whole, each
    experts module its own unit (one all-reduce of its fp32 gradients a step; the dense replicas' own all-reduce
    then leaves them out), divided by `divide_by` as parallelize_experts says. Without set_force_sum_reduction_for_comms:
    replicate divides locally, then all-reduces with SUM (gloo and NCCL alike); with it, torch 2.13 divides twice,
    before and after the all-reduce (measured on 4 ranks, ep 2: the gradients were divide_by^2 too small)."""
    from dist_train.parallel.fsdp import mixed_precision

    from torch.distributed._composable.replicate_with_fsdp import replicate

    for experts in expert_modules(model):
        replicate(experts, mesh=edp, mp_policy=mixed_precision(precision))
        experts.set_gradient_divide_factor(float(divide_by))


@dataclass
class Route:
    """Where one micro-batch's (token, k) pairs go: their order sorted by expert (so by the rank that owns it), the
    rows sent to and received from each rank of the ep group, and for each of this rank's experts the positions of
    its rows among those received (grouped by source rank, then expert)."""

    order: torch.Tensor
    send: list[int]
    recv: list[int]
    local_rows: list[torch.Tensor]


def route(module: nn.Module, top_k_index: torch.Tensor) -> Route:
    """The router's choice, counted and exchanged: one all-to-all of the per-expert counts, read on the host (the
    row exchanges need their sizes). The dry run routes balanced instead (estimate/dryrun/fake.py)."""
    ep, local = module.ep_size, module.num_local_experts
    flat = top_k_index.reshape(-1)
    order = torch.argsort(flat, stable=True)  # (token, k) pairs grouped by expert, so by the rank that owns it
    per_expert = torch.bincount(flat, minlength=module.num_global_experts)
    with torch.no_grad():  # counts per (destination rank, its local expert), exchanged: what each rank receives
        received = torch.empty_like(per_expert)
        dist.all_to_all_single(received, per_expert, group=module.ep_group)
    received_per = received.view(ep, local)  # [source rank, local expert]
    # What arrives is grouped by source rank, then expert: each row's local expert, then each expert's rows.
    local_expert = torch.repeat_interleave(torch.arange(local, device=flat.device).repeat(ep),
                                           received_per.reshape(-1))
    return Route(order, per_expert.view(ep, local).sum(1).tolist(), received_per.sum(1).tolist(),
                 [torch.nonzero(local_expert == e, as_tuple=True)[0] for e in range(local)])


@torch.compiler.disable  # train.compile: runs eager, the block's one graph break (see the docstring)
def dispatch(module: nn.Module, hidden: torch.Tensor, top_k_index: torch.Tensor,
             top_k_weights: torch.Tensor) -> torch.Tensor:
    """The experts module's forward under expert parallelism: (tokens, h) in, (tokens, h) out, as transformers'
    own, for this rank's tokens. Under tensor parallelism, where every rank of the tp group holds the same tokens,
    each dispatches its share and the results are all-gathered (`_Share`, `_Gather`)."""
    tp_group = getattr(module, "tp_group", None)
    if tp_group is not None:
        rows, size, rank = hidden.shape[0], module.tp_size, module.tp_rank
        start, end = share_bounds(rows, size=size, rank=rank)
        share = _dispatch(module, _Share.apply(hidden, tp_group, size, rank), top_k_index[start:end],
                          _Share.apply(top_k_weights, tp_group, size, rank))
        return _Gather.apply(share, tp_group, size, rank, rows)
    return _dispatch(module, hidden, top_k_index, top_k_weights)


def _dispatch(module: nn.Module, hidden: torch.Tensor, top_k_index: torch.Tensor,
              top_k_weights: torch.Tensor) -> torch.Tensor:
    r = route(module, top_k_index)  # looked up at call time: the dry run swaps in a balanced router
    token = r.order // top_k_index.shape[1]  # each sorted pair's token
    if torch._C._current_graph_task_id() == -1:  # not a checkpointed block's recomputation
        module.received_rows += sum(r.recv)
    rows = _AllToAll.apply(hidden[token], r.send, r.recv, module.ep_group)
    out = _local_experts(module, rows, r.local_rows)
    back = _AllToAll.apply(out, r.recv, r.send, module.ep_group)
    # back[i] is pair order[i]'s expert output: weight it and sum each token's k of them.
    weights = top_k_weights.reshape(-1)[r.order].unsqueeze(-1).to(back.dtype)
    combined = torch.zeros_like(hidden)
    combined.index_add_(0, token, (back * weights).to(hidden.dtype))
    return combined


def _local_experts(module: nn.Module, rows: torch.Tensor, local_rows: list[torch.Tensor]) -> torch.Tensor:
    """This rank's experts on the rows they received (transformers' eager computation, one expert at a time; expert
    e's rows at `local_rows[e]`). The weights are this rank's shards; an expert that received nothing, or a rank
    that received nothing, still touches its weights and the received rows, so that their gradients exist (zeros),
    every rank reduces the same tensors, and every rank runs the exchanges' backward."""
    weights = {name: p.to_local() for name, p in module.named_parameters(recurse=False)}
    # Built from the rows and the weights, not beside them: with no row received, the exchange that brought them
    # must still run its backward (the peers wait in it), and every local expert still gets a (zero) gradient.
    out = rows * 0.0
    touched = sum(w.sum() for w in weights.values()) * 0.0
    for e, idx in enumerate(local_rows):
        if idx.numel() == 0:
            continue
        hidden = one_expert(module, rows[idx], e, weights)
        out = out.index_add(0, idx, hidden.to(out.dtype))
    return out + touched


def one_expert(module: nn.Module, rows: torch.Tensor, e: int, weights: dict[str, torch.Tensor]) -> torch.Tensor:
    """Expert `e`'s output for `rows`, as transformers' eager loop computes it, from the layout its experts class
    declares (`use_experts_implementation`: `is_transposed`, in x out as GPT-OSS stores them, else out x in;
    `has_bias`; its `_apply_gate`, which splits gate from up, concatenated or GPT-OSS's interleaved and clamped).
    `weights`: the module's stacked tensors by name, this rank's experts (the dry run passes the module's own)."""
    transposed, biased = getattr(module, "is_transposed", False), getattr(module, "has_bias", False)

    def project(x: torch.Tensor, name: str) -> torch.Tensor:
        y = x @ weights[name][e] if transposed else nn.functional.linear(x, weights[name][e])
        return y + weights[f"{name}_bias"][e] if biased else y

    def gate(x: torch.Tensor) -> torch.Tensor:  # transformers' default, for a class without its decorator
        gate_out, up = x.chunk(2, dim=-1)
        return module.act_fn(gate_out) * up

    return project(getattr(module, "_apply_gate", gate)(project(rows, "gate_up_proj")), "down_proj")
