"""What the estimator prints: the breakdown (memory per rank, collectives per step), the fit table, and the same
figures as JSON for tools."""

from __future__ import annotations

from dataclasses import asdict, replace
from typing import Any, Optional


from dist_train.estimate.comm import bus_factor, expert_crossover, predict_comm, ring_bytes, ring_volume_psi
from dist_train.estimate.fit import FitCell, FitModel, fit_table
from dist_train.estimate.memory import (
    RankMemory,
    element_bytes,
    expert_param_bytes,
    expert_state_bytes,
    kv_cache_bytes,
    predict_memory,
    setup_state_bytes,
    shards,
    with_model,
)
from dist_train.estimate.render import human_bytes, human_count, text_table
from dist_train.estimate.setup import Setup
from dist_train.estimate.shapes import ModelShape


from dist_train.estimate.args import EstimateArgs
from dist_train.estimate.fit import fit_models


def report_json(shape: ModelShape, setup: Setup, *, args: EstimateArgs,
                models: Optional[list[FitModel]] = None) -> dict[str, Any]:
    """What `report` prints, as numbers: bytes, per rank; memory categories as in RankMemory. The fit cells'
    activations are those of `fit_base(setup, args)` (the breakdown's train.seq_len)."""
    other = predict_memory(shape, replace(setup, activation_checkpointing=_other_checkpointing(setup)))
    kv_batch, kv_ctx = args.kv_batch or setup.micro_batch_size, args.kv_context or shape.max_seq_len
    return {
        "model": {**asdict(shape), "num_params": shape.num_params},
        "setup": {**asdict(with_model(shape, setup)), "resolved_regime": setup.resolved_regime,
                  "data_parallel_size": setup.data_parallel_size, "microbatches_per_step": setup.microbatches_per_step,
                  "tensor_parallel_size": setup.tensor_parallel_size},
        "bytes_per_param": asdict(setup_state_bytes(with_model(shape, setup))),
        # data-parallel sharding; tensor parallelism splits each rank's share further (setup.tensor_parallel_size)
        "sharded_over": asdict(shards(setup)),
        "memory_per_rank": [_rank_json(r) for r in predict_memory(shape, setup)],
        "activations_with_the_other_checkpointing": [r.activations for r in other],
        "kv_cache_bytes": kv_cache_bytes(shape, batch=kv_batch, context=kv_ctx, elem=element_bytes(setup.precision)),
        "communication_per_rank": [
            [{**asdict(c), "ring_bytes": c.ring_bytes(setup.comm_group_size)} for c in colls]
            for colls in predict_comm(shape, setup)
        ],
        "expert_crossover": asdict(c) if (c := expert_crossover(shape, setup)) else None,
        "expert_params_bytes_per_rank": expert_param_bytes(shape, setup),
        "expert_state_bytes_per_rank": expert_state_bytes(shape, setup),
        "fit": [asdict(c) for c in fit_cells(shape, setup, args=args, models=models)],
        "fit_micro_batch": {"micro_batch_size": fit_base(setup, args).micro_batch_size, "seq_len": setup.seq_len},
        "gpu_gib": args.gpu_gib,
    }


def _other_checkpointing(setup: Setup) -> str:
    """The checkpointing the breakdown shows beside the run's own: full beside none, none beside full or
    selective."""
    return "full" if setup.activation_checkpointing == "none" else "none"


def _rank_json(rank: RankMemory) -> dict[str, float]:
    return {**asdict(rank), "model_state": rank.model_state, "working_set": rank.working_set, "total": rank.total}


def report(shape: ModelShape, setup: Setup, *, args: EstimateArgs, unlisted: bool = False,
           models: Optional[list[FitModel]] = None) -> str:
    parts = [header(shape, setup, unlisted=unlisted), memory_section(shape, setup, args=args),
             comm_section(shape, setup), fit_section(shape, setup, args=args, models=models)]
    return "\n\n".join(parts)


def header(shape: ModelShape, setup: Setup, *, unlisted: bool) -> str:
    lines = [
        f"model {shape.name}: {human_count(shape.num_params)} parameters (Ψ = {shape.num_params:,}), "
        f"{shape.num_layers} layers, hidden {shape.hidden_size}, {shape.num_heads} heads "
        f"({shape.kv_heads} kv), vocab {shape.vocab_size}",
        f"strategy {setup.strategy} ({setup.family}{f' stage {setup.zero_stage}' if setup.family == 'zero' else ''}) "
        f"on {setup.world_size} ranks | precision {setup.precision} | optimizer {setup.optimizer} | "
        f"regime {setup.resolved_regime} | micro-batch {setup.micro_batch_size} x {setup.seq_len} tokens, "
        f"{setup.microbatches_per_step} per step",
    ]
    if setup.activation_checkpointing != "none" and setup.checkpoint_every > 1:
        lines.append(f"{setup.activation_checkpointing} checkpointing of one block in {setup.checkpoint_every} "
                     f"({setup.checkpointed_layers(shape.num_layers)} of {shape.num_layers}: "
                     f"train.checkpoint_every={setup.checkpoint_every})")
    if setup.ep > 1 and setup.ep_overload != 1:
        lines.append(f"the busiest EP rank's experts receive {setup.ep_overload:g} x the balanced rows (ep_overload)")
    if unlisted:
        lines.append(f"(no conf/strategy/{setup.strategy}.yaml: predicted from the strategy's name and defaults)")
    return "\n".join(lines)


def memory_section(shape: ModelShape, setup: Setup, *, args: EstimateArgs) -> str:
    ranks = predict_memory(shape, setup)
    ckpt = predict_memory(shape, replace(setup, activation_checkpointing=_other_checkpointing(setup)))
    b = setup_state_bytes(with_model(shape, setup))
    sh = shards(setup)
    show = list(range(len(ranks))) if len(set(ranks)) > 1 and len(ranks) <= 8 else [0]
    cols = [f"rank {r}" for r in show] if len(show) > 1 else ["per rank"]
    other = "with full" if _other_checkpointing(setup) == "full" else "without"
    t = setup.tensor_parallel_size
    rows: list[list[object]] = [
        ["weights", b.weights, split_over(sh.weights, t), *(human_bytes(ranks[r].params) for r in show)],
        ["gradients", b.grads, split_over(sh.grads, t), *(human_bytes(ranks[r].grads) for r in show)],
        ["master weights", b.master, split_over(sh.optimizer, t), *(human_bytes(ranks[r].master) for r in show)],
        ["optimizer state", b.optimizer, split_over(sh.optimizer, t), *(human_bytes(ranks[r].optimizer) for r in show)],
        ["= model state", b.total, "", *(human_bytes(ranks[r].model_state) for r in show)],
        ["activations", "", "", *(human_bytes(ranks[r].activations) for r in show)],
        *_transient_rows(ranks, show),
        ["= total (peak)", "", "", *(human_bytes(ranks[r].total) for r in show)],
        *([["peak of live tensors", "", "", *(human_bytes(ranks[r].peak_live) for r in show)]]
          if all(ranks[r].peak_live is not None for r in show) else []),
        [f"(activations {other} checkpointing"
         + (f" of one block in {setup.checkpoint_every})" if other == "with full" and setup.checkpoint_every > 1
            else ")"), "", "", *(human_bytes(ckpt[r].activations) for r in show)],
    ]
    kv_batch = args.kv_batch or setup.micro_batch_size
    kv_ctx = args.kv_context or shape.max_seq_len
    kv = kv_cache_bytes(shape, batch=kv_batch, context=kv_ctx, elem=element_bytes(setup.precision))
    return "\n".join([
        "memory per rank (bytes/param before sharding; GiB = 2^30 bytes)",
        text_table(["category", "bytes/param", "sharded over", *cols], rows),
        *([f"(tp {t}: each layer's matmul weights and column-parallel biases, the embedding and an untied head are "
           f"split {t} ways; norms, positions and row-parallel biases are whole on every rank)"] if t > 1 else []),
        f"KV cache for inference (2 x batch {kv_batch} x {shape.num_layers} layers x {shape.kv_heads} kv heads "
        f"x {shape.head_dim} head_dim x context {kv_ctx} x {element_bytes(setup.precision)} B): {human_bytes(kv)}",
    ])


def split_over(shards: int, tensor_parallel: int) -> str:
    """The "sharded over" cell: the ranks a category is divided over, by data-parallel sharding (FSDP, ZeRO) and
    by tensor parallelism (`2 (tp)`, `4 x 2 (dp_shard x tp)`); tensor parallelism leaves some parameters whole."""
    if tensor_parallel == 1:
        return str(shards)
    return f"{tensor_parallel} (tp)" if shards == 1 else f"{shards} x {tensor_parallel} (dp_shard x tp)"


_TRANSIENT = (
    ("weight_copies", "autocast weight copies (16-bit)"),
    ("gathered_params", "ZeRO-3 gathered parameters"),
    ("gathered_grads", "ZeRO-3 full-size gradients"),
    ("step_grads", "ZeRO fp32 step gradients"),
)


def _transient_rows(ranks: list[RankMemory], show: list[int]) -> list[list[object]]:
    """Buffers held for a moment (see dist_train/estimate/memory.py), the rows that apply to this run."""
    rows: list[list[object]] = []
    for attr, label in _TRANSIENT:
        if any(getattr(ranks[r], attr) for r in show):
            rows.append([label, "", "", *(human_bytes(getattr(ranks[r], attr)) for r in show)])
    return rows


def comm_section(shape: ModelShape, setup: Setup) -> str:
    per_rank = predict_comm(shape, setup)
    worst = max(range(len(per_rank)), key=lambda r: ring_bytes(per_rank[r], group_size=setup.comm_group_size))
    colls = per_rank[worst]
    if not colls:
        return "communication per step: none (one process)"
    n = setup.comm_group_size
    psi = shape.num_params
    rows = [[c.op, human_bytes(c.bytes), f"{c.elem} B", f"{bus_factor(c.op, c.group_size or n):.3f}", human_bytes(c.ring_bytes(n)),
             f"{c.ring_elements(n) / psi:.3f} Ψ", c.what] for c in colls]
    total_ring = ring_bytes(colls, group_size=n)
    crossover = expert_crossover(shape, setup)
    return "\n".join([
        f"communication per optimizer step, rank {worst} (buffer = nccl-tests size, ring = what the rank sends)",
        text_table(["collective", "buffer", "element", "bus factor", "ring traffic", "ring volume", "what"], rows),
        f"total ring traffic {human_bytes(total_ring)} = {ring_volume_psi(colls, group_size=n, num_params=psi):.3f} Ψ "
        "elements (ZeRO paper: DDP / ZeRO-1 / ZeRO-2 2Ψ, ZeRO-3 / FSDP 3Ψ per micro-batch, each x (N-1)/N)",
        *([crossover.line(setup.micro_batch_size * setup.seq_len)] if crossover else []),
    ])


def fit_base(setup: Setup, args: EstimateArgs) -> Setup:
    """The run's setup at the fit table's micro-batch; the sequence length stays the run's train.seq_len."""
    return replace(setup, micro_batch_size=args.fit.micro_batch_size or setup.micro_batch_size)


def fit_cells(shape: ModelShape, setup: Setup, *, args: EstimateArgs,
              models: Optional[list[FitModel]] = None) -> list[FitCell]:
    f = args.fit
    return fit_table(fit_models(shape, names=f.models, params=f.params) if models is None else models, base=fit_base(setup, args),
                     strategies=f.strategies, gpus=f.gpus, gpu_gib=args.gpu_gib, seq_len=setup.seq_len)


def fit_section(shape: ModelShape, setup: Setup, *, args: EstimateArgs,
                models: Optional[list[FitModel]] = None) -> str:
    f = args.fit
    models = fit_models(shape, names=f.models, params=f.params) if models is None else models
    cells = fit_cells(shape, setup, args=args, models=models)
    base = fit_base(setup, args)
    rows, index = [], {}
    for c in cells:
        key = (c.model, c.strategy)
        if key not in index:
            index[key] = len(rows)
            rows.append([c.model, c.strategy] + [""] * len(f.gpus))
        cell = "n/a" if c.peak_bytes is None else f"{human_bytes(c.peak_bytes)} {'ok' if c.fits else 'NO'}"
        rows[index[key]][2 + f.gpus.index(c.world_size)] = cell + (" *" if c.note == "model state only" else "")
    mb = "train.micro_batch_size" if f.micro_batch_size is None else "fit.micro_batch_size"
    short = [f"{m.name} (max_seq_len {m.shape.max_seq_len})" for m in models
             if m.shape is not None and m.shape.max_seq_len < setup.seq_len]
    refusals = dict.fromkeys(f"n/a: {c.model} {c.strategy}: launch/train.py refuses it: {c.note}" for c in cells
                             if c.peak_bytes is None and c.note in models[0].refused.values())
    return "\n".join([
        f"fits in {args.gpu_gib:g} GiB per GPU? worst rank's GiB: model state + activations of one micro-batch of "
        f"{base.micro_batch_size} x {setup.seq_len} tokens ({mb} x train.seq_len, every model), plus what the peak "
        "of live tensors adds where it is predicted (gathered parameters, DeepSpeed's reduction bucket, "
        "the loss's backward, FSDP2's gathers and reductions in backward), "
        f"{'no' if setup.activation_checkpointing == 'none' else setup.activation_checkpointing} activation "
        "checkpointing; "
        "pipeline: one stage per GPU, M = K micro-batches; * = model state only",
        text_table(["model", "strategy", *(f"N={n}" for n in f.gpus)], rows),
        *([f"predicted at {setup.seq_len} tokens beyond the max_seq_len of: {', '.join(short)}"] if short else []),
        *refusals,
    ])
