"""Every configuration worth predicting for a model on a cluster, predicted, filtered and ranked.

The space: the strategies and their degrees (ddp, zero1-3, fsdp on all ranks; tp within a node; fsdp_tp with
tp = 2, 4, ... up to a node; one stage per rank for 1f1b and gpipe; pp_dp for every pp that divides the ranks,
replicated or FSDP-sharded, GPipe or 1F1B), every micro-batch size that divides the global batch, activation
checkpointing none, full and selective, FSDP's two ways to accumulate gradients over several micro-batches (held unsharded, or
reduce-scattered after each), and the optimizers the user allows. The global batch and the sequence length are the
user's: every candidate trains the same samples. A configuration that cannot hold (out of memory at the
profile's memory x plan.memory_fraction) or cannot run (tp that does not divide the heads, more stages than
layers) is dropped with its reason; the rest are ranked by predicted step time.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from itertools import product
from typing import Any, Optional

from dist_train.config import CHECKPOINTING, checkpointing_mode
from dist_train.estimate.fit import worst_rank
from dist_train.estimate.memory import RankMemory, predict_memory, with_model
from dist_train.estimate.setup import Setup, family_of, setup_from_config
from dist_train.estimate.shapes import ModelShape
from dist_train.estimate.hardware import GIB, Hardware
from dist_train.estimate.step_time import StepTime, predict_step

# What the search enumerates. dp (torch DataParallel: one process drives every GPU) and accelerate (the user's
# own Accelerate set-up) are left out: neither is a configuration to choose by degrees.
SEARCHED = ("single", "ddp", "zero1", "zero2", "zero3", "fsdp", "hsdp", "tp", "fsdp_tp", "ddp_tp", "1f1b", "gpipe",
            "pp_dp", "fsdp_ep", "ep")


@dataclass(frozen=True)
class Candidate:
    strategy: str
    overrides: tuple[str, ...]  # what launch/train.py needs beyond the user's own overrides
    setup: Setup
    memory: RankMemory  # the worst rank's
    time: StepTime

    @property
    def layout(self) -> tuple[str, ...]:
        """The strategy and its degrees, without micro-batch, checkpointing and optimizer."""
        return tuple(o for o in self.overrides if o.startswith("strategy"))

    @property
    def label(self) -> str:
        return " ".join(self.overrides)

    @property
    def peak_bytes(self) -> float:
        return self.memory.peak  # the peak of all live tensors where modelled (a pipeline: its categories')


@dataclass(frozen=True)
class Rejected:
    strategy: str
    overrides: tuple[str, ...]
    reason: str


@dataclass
class Search:
    ranked: list[Candidate]
    rejected: list[Rejected] = field(default_factory=list)
    world_size: int = 1
    global_batch_size: int = 1


def _degrees(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _powers_of_two(limit: int) -> list[int]:
    out, b = [], 1
    while b <= limit:
        out.append(b)
        b *= 2
    return out


def _ep_overrides(experts: dict[str, int]) -> tuple[str, ...]:
    return tuple(f"strategy.ep={ep}" for ep in experts.values())


def layouts(shape: ModelShape, *, world_size: int, gpus_per_node: int,
            strategies: tuple[str, ...]) -> Iterator[tuple[str, dict[str, Any], tuple[str, ...], Optional[str]]]:
    """(strategy, Setup fields, overrides, why it cannot run or None) for each strategy and degree."""
    w, heads, kv = world_size, shape.num_heads, shape.kv_heads
    # an MoE model under tensor parallelism: its experts split by expert over ep ranks of a node (strategy.ep)
    expert_degrees = [{}] if not shape.num_experts else [
        {"ep": ep} for ep in _degrees(min(w, gpus_per_node)) if ep > 1 and not shape.num_experts % ep and not w % ep]
    for name in strategies:
        if shape.num_experts and name == "ddp_tp":  # what strategies/fsdp_tp.py refuses
            yield name, {}, (f"strategy={name}",), "expert parallelism beside tensor parallelism is built with fsdp_tp"
            continue
        if shape.num_experts and name in ("tp", "fsdp_tp") and not expert_degrees:
            yield name, {}, (f"strategy={name}",), (f"no expert-parallel degree divides the {shape.num_experts} "
                                                    f"experts and {w} ranks within a node of {gpus_per_node}")
            continue
        if name == "single":
            if w == 1:
                yield name, {}, (f"strategy={name}",), None
            continue
        if w == 1:
            yield name, {}, (f"strategy={name}",), "needs more than one process"
            continue
        if name in ("ddp", "zero1", "zero2", "zero3", "fsdp"):
            yield name, {}, (f"strategy={name}",), None
        elif name == "hsdp":  # replicas of whole nodes: one per node (strategy=hsdp's default layout) down to 2,
            # each of 2 ranks or more (what training requires: strategy=hsdp's check)
            replicas = [r for r in reversed(_degrees(w // gpus_per_node)) if r >= 2 and w // r >= 2]
            if not replicas:
                yield name, {}, (f"strategy={name}",), (f"needs 2 replicas of whole nodes, each of 2 ranks or more: "
                                                        f"{w} rank(s) on {w // gpus_per_node} node(s) of {gpus_per_node}")
            for replicate in replicas:  # a model that does not fit a node shards over more
                yield name, {"replicate": replicate}, (f"strategy={name}", f"strategy.replicate={replicate}"), None
        elif name == "tp":
            why = None
            if w > gpus_per_node:
                why = f"tp over {w} ranks would span nodes; fsdp_tp keeps tp within a node"
            elif heads % w or kv % w:
                why = f"{w} does not divide the {heads} heads and {kv} kv heads"
            yield from _tp_layouts(name, knobs={}, overrides=(f"strategy={name}",), expert_degrees=expert_degrees,
                                   why=why)
        elif name in ("fsdp_tp", "ddp_tp"):
            for tp in _degrees(min(w, gpus_per_node)):
                if tp == 1 or tp == w or gpus_per_node % tp:
                    continue
                why = f"tp={tp} does not divide the {heads} heads and {kv} kv heads" if heads % tp or kv % tp else None
                yield from _tp_layouts(name, knobs={"tp": tp}, overrides=(f"strategy={name}", f"strategy.tp={tp}"),
                                       expert_degrees=expert_degrees, why=why)
        elif name in ("fsdp_ep", "ep"):  # experts over ep ranks of a node, as torchtitan places them; dense weights
            # FSDP-sharded (fsdp_ep) or whole replicas (ep)
            if not shape.num_experts:
                continue  # a dense model: nothing to split
            for ep in _degrees(min(w, gpus_per_node)):
                if ep > 1 and not shape.num_experts % ep and not w % ep:
                    yield name, {"ep": ep}, (f"strategy={name}", f"strategy.ep={ep}"), None
        elif name in ("1f1b", "gpipe"):
            why = f"{w} stages > {shape.num_layers} layers" if w > shape.num_layers else None
            yield name, {}, (f"strategy={name}",), why
        elif name == "pp_dp":
            for pp in _degrees(w):
                if pp == 1 or pp == w:
                    continue
                for mode in ("replicate", "fsdp"):
                    for schedule in ("gpipe", "1f1b"):
                        why = f"{pp} stages > {shape.num_layers} layers" if pp > shape.num_layers else None
                        yield name, {"pp": pp, "dp_mode": mode, "schedule": schedule}, (
                            f"strategy={name}", f"strategy.pp={pp}", f"strategy.dp_mode={mode}",
                            f"strategy.schedule={schedule}"), why


def _tp_layouts(name: str, *, knobs: dict[str, Any], overrides: tuple[str, ...], expert_degrees: list[dict[str, int]],
                why: Optional[str]) -> Iterator[tuple[str, dict[str, Any], tuple[str, ...], Optional[str]]]:
    """A tensor-parallel layout at each expert-parallel degree; for a dense model (no experts), sequence parallelism
    inside each TP group too (torchtitan's; not built beside expert parallelism)."""
    for experts in expert_degrees:
        yield name, {**knobs, **experts}, (*overrides, *_ep_overrides(experts)), why
        if not experts:
            yield name, {**knobs, "sequence_parallel": True}, (*overrides, "strategy.sequence_parallel=true"), why


def _accumulations(name: str, microbatches: int) -> tuple[bool, ...]:
    """FSDP's two ways to accumulate over several micro-batches (strategy.reduce_every_microbatch): keep every
    unsharded fp32 gradient until the last micro-batch (4 B/param held, one reduce-scatter a step), or reduce-scatter
    after each (4 B/param / N held, M reduce-scatters), as torchtitan does; fsdp_ep's the same for its dense weights
    and each rank's experts. Searched both; one micro-batch: no choice."""
    return (False, True) if name in ("fsdp", "hsdp", "fsdp_ep") and microbatches > 1 else (False,)


def search(shape: ModelShape, cfg: dict[str, Any], hw: Hardware, *, nodes: int, strategies: tuple[str, ...] = SEARCHED,
           micro_batch_sizes: Optional[list[int]] = None, checkpointing: tuple[str, ...] = CHECKPOINTING,
           optimizers: Optional[list[str]] = None, memory_fraction: float = 0.9, ep_overload: float = 1.0,
           check: Optional[Callable[[Candidate], Optional[str]]] = None, top: int = 0,
           distinct: bool = False) -> Search:
    """Ranked candidates and the rejected ones; with `distinct`, only the fastest of each layout (strategy and
    degrees) is ranked. `check(candidate)`: why training would refuse it, or None; asked
    of the fastest candidates in order until `top` pass (it composes a config, too slow for every one)."""
    w = nodes * hw.gpus_per_node
    train = cfg["train"]
    global_batch = int(train.get("global_batch_size") or int(train["micro_batch_size"]) * w)
    budget = hw.memory_bytes * memory_fraction
    allow_tf32 = bool(train.get("allow_tf32", False))
    ranked: list[Candidate] = []
    rejected: list[Rejected] = []
    base_optimizer = str(cfg["optimizer"]["name"])
    for name, extra, strategy_overrides, why in layouts(shape, world_size=w, gpus_per_node=hw.gpus_per_node,
                                                        strategies=strategies):
        if why:
            rejected.append(Rejected(name, strategy_overrides, why))
            continue
        family, stage, schedule = family_of(name)
        base = setup_from_config(cfg, world_size=w, strategy=name)
        base = replace(base, family=family, zero_stage=stage, schedule=extra.get("schedule", schedule),
                       global_batch_size=global_batch, num_microbatches=None, split_points=None,
                       **{k: v for k, v in extra.items() if k != "schedule"})
        if base.ep > 1:  # the busiest EP rank's received rows, at most all of its group's (plan.ep_overload)
            base = replace(base, ep_overload=min(ep_overload, base.ep))
        dp = base.data_parallel_size
        if global_batch < dp:
            rejected.append(Rejected(name, strategy_overrides, f"global batch {global_batch} is not a multiple of "
                                                               f"micro-batch 1 x {dp} data-parallel ranks"))
            continue
        sizes = micro_batch_sizes or _powers_of_two(global_batch // dp)
        for optimizer in optimizers or [base_optimizer]:
            for b in sizes:
                mb = (f"train.micro_batch_size={b}",)
                opt = () if optimizer == base_optimizer else (f"optimizer={optimizer}",)
                if global_batch % (b * dp):
                    rejected.append(Rejected(name, strategy_overrides + mb + opt,
                                             f"global batch {global_batch} is not a multiple of micro-batch {b} x "
                                             f"{dp} data-parallel ranks"))
                    continue
                modes = [checkpointing_mode(c) for c in checkpointing]  # true and false stay full and none
                for ckpt, reduce in product(modes, _accumulations(name, global_batch // (b * dp))):
                    overrides = (strategy_overrides + (("strategy.reduce_every_microbatch=true",) if reduce else ())
                                 + mb + (f"train.activation_checkpointing={ckpt}",) + opt)
                    setup = with_model(shape, replace(base, micro_batch_size=b, activation_checkpointing=ckpt,
                                                      optimizer=optimizer, reduce_every_microbatch=reduce))
                    ranks = predict_memory(shape, setup)
                    memory = worst_rank(ranks)
                    peak = memory.peak
                    if peak > budget:
                        rejected.append(Rejected(name, overrides, f"out of memory: {peak / GIB:.1f} GiB > "
                                                                  f"{budget / GIB:.1f} GiB usable"))
                        continue
                    step = predict_step(shape, setup, hw, allow_tf32=allow_tf32,
                                        model_state_bytes=max(r.model_state for r in ranks))
                    ranked.append(Candidate(name, overrides, setup, memory, step))
    # At equal predicted time (a CPU profile with no memory-bound term), less recomputation first.
    ranked.sort(key=lambda c: (c.time.step_s, CHECKPOINTING.index(c.setup.activation_checkpointing), c.peak_bytes))
    if distinct:
        seen: set[tuple[str, ...]] = set()
        ranked = [c for c in ranked if not (c.layout in seen or seen.add(c.layout))]  # the fastest of each layout
    if check is not None and top:
        ranked, refused = _checked(ranked, check, top)
        rejected += refused
    return Search(ranked, rejected, world_size=w, global_batch_size=global_batch)


def _checked(ranked: list[Candidate], check: Callable[[Candidate], Optional[str]],
             top: int) -> tuple[list[Candidate], list[Rejected]]:
    """The ranking without the candidates training would refuse, checked from the fastest until `top` pass."""
    kept, refused, passed = [], [], 0
    for c in ranked:
        if passed < top:
            why = check(c)
            if why:
                refused.append(Rejected(c.strategy, c.overrides, why))
                continue
            passed += 1
        kept.append(c)
    return kept, refused
