"""What separates the strategies on a CPU, measured before the first answer: a few short runs of the run's own model.

On a GPU the per-operation model carries the step (estimate/ops.py) and the strategies differ by the bytes they move.
On a CPU the same cores run the products, gloo, autograd's dispatch and each strategy's hooks, and the strategies
differ mostly by that work, which no microbenchmark of a product or a collective shows. So `plan.calibrate` (which
a cpu profile runs by itself the first time) launches, for plan.steps steps each, through the comparison's runner as
plan.verify does:
- ddp at micro-batch 1 and at the largest micro-batch the global batch gives a rank (capped at 8): the step is
  compute / `efficiency` + `layer_overhead_s` per block and micro-batch + the rest of the prediction, two runs for
  the two unknowns (what two processes sharing the cores reach, and eager PyTorch's own cost per block);
- each strategy family with work of its own, at the larger micro-batch: fsdp (its hooks), tp (DTensor's dispatch),
  zero1, zero2 and zero3 (DeepSpeed's engine and hooks), gpipe and 1f1b (a pipeline's schedule: gpipe's step was
  13% above 1f1b's here, which one probe for both put on 1f1b's prediction): what its step takes beyond the rest of
  the prediction, per block and micro-batch, is its `overhead_s`.
plan.verify's refit then corrects these from the user's own candidates; it is no longer their source.
"""

from __future__ import annotations

import sys
from dataclasses import replace
from datetime import date
from pathlib import Path
from typing import Any, Optional

from dist_train.estimate.hardware import Hardware
from dist_train.estimate.shapes import ModelShape

# The families probed beyond ddp, each by one strategy; a family the world size cannot run is skipped.
HOOKED = ("fsdp", "tp", "zero1", "zero2", "zero3", "gpipe", "1f1b")
# Which probe stands for each searched strategy (its overhead_s key is the probe's).
PROBED_BY = {"fsdp": "fsdp", "hsdp": "fsdp", "fsdp_ep": "fsdp", "ep": "fsdp", "tp": "tp", "fsdp_tp": "tp",
             "ddp_tp": "tp", "zero1": "zero1", "zero2": "zero2", "zero3": "zero3", "gpipe": "gpipe", "1f1b": "1f1b",
             "pp_dp": "gpipe"}


def probes_for(strategies: tuple[str, ...]) -> tuple[str, ...]:
    """The probes a search over `strategies` needs: ddp (efficiency, eager per-block cost) and one per family."""
    wanted = {PROBED_BY[s] for s in strategies if s in PROBED_BY}
    return ("ddp", *[h for h in HOOKED if h in wanted])


def _candidates(shape: ModelShape, cfg: dict[str, Any], hw: Hardware, *, strategies: tuple[str, ...],
                large: int) -> list[Any]:
    """One candidate per probe: ddp at 1 and `large`, the hooked ones at `large` (pipelines at 1, their
    micro-batches being the schedule's), no checkpointing, the search's own overrides."""
    from dist_train.plan.search import search

    out = []
    for strategy in ("ddp", *[s for s in HOOKED if s in strategies]):
        sizes = [1, large] if strategy == "ddp" else [1 if strategy in ("gpipe", "1f1b") else large]
        found = search(shape, cfg, hw, nodes=1, strategies=(strategy,), micro_batch_sizes=sizes,
                       checkpointing=("none",), memory_fraction=float("inf"), distinct=False)
        for size in dict.fromkeys(sizes):
            picked = [c for c in found.ranked  # the family's plain layout (sequence parallelism shares tp's probe)
                      if c.setup.micro_batch_size == size and not c.setup.reduce_every_microbatch
                      and not c.setup.sequence_parallel]
            if picked:
                out.append(picked[0])
    return out


def fit_ddp(hw: Hardware, runs: list[tuple[Any, float]], *, predict: Any) -> tuple[float, float]:
    """(efficiency, layer_overhead_s) from ddp runs [(candidate, measured step)] at two micro-batch sizes or more:
    measured - the rest = ops / efficiency + layer_overhead_s x blocks x micro-batches, least squares through the
    origin in the two unknowns, each kept in its range (efficiency <= 1, overhead >= 0)."""
    rows = []
    for c, measured in runs:
        t = predict(c, replace(hw, efficiency=1.0, layer_overhead_s=0.0))
        rest = t.step_s - t.compute_s - t.bubble_s
        rows.append((t.ops.total_s, t.layer_units, measured - rest))
    sxx = sum(o * o for o, _, _ in rows)
    syy = sum(u * u for _, u, _ in rows)
    sxy = sum(o * u for o, u, _ in rows)
    sxz = sum(o * z for o, _, z in rows)
    syz = sum(u * z for _, u, z in rows)
    det = sxx * syy - sxy * sxy
    x, y = ((sxz * syy - syz * sxy) / det, (syz * sxx - sxz * sxy) / det) if det > 0 else (0.0, -1.0)
    if y < 0 or x <= 0:  # nothing per block to see: all of it is compute
        x, y = sxz / sxx, 0.0
    if x < 1:  # faster than the products measured alone: the products' rate, the rest per block
        x, y = 1.0, max(0.0, (syz - sxy) / syy)
    return 1.0 / x, y


def probe(hw: Hardware, shape: ModelShape, cfg: dict[str, Any], *, training: list[str], procs: int, steps: int,
          out_dir: Path, timeout_s: float, strategies: Optional[tuple[str, ...]] = None) -> Hardware:
    """`hw` with efficiency, layer_overhead_s and the overhead_s of each family among `strategies` (the search's;
    None: all) fitted from short runs here."""
    from dist_train.estimate.step_time import predict_step
    from dist_train.plan.verify import fit_overheads, run_candidates

    train = cfg["train"]
    global_batch = int(train.get("global_batch_size") or int(train["micro_batch_size"]) * procs)
    large = max(1, min(8, global_batch // procs))
    allow_tf32 = bool(train.get("allow_tf32", False))
    cands = _candidates(shape, cfg, hw, strategies=probes_for(strategies or tuple(PROBED_BY)), large=large)
    print(f"[plan] calibrating: {len(cands)} short runs of {shape.name} ({', '.join(c.label for c in cands)}) ...",
          file=sys.stderr, flush=True)
    verified = run_candidates(cands, training=training, global_batch=global_batch, nproc=procs, steps=steps,
                              out_dir=out_dir, timeout_s=timeout_s)
    ok = [(v.candidate, v.step_s) for v in verified if v.ok and v.step_s]
    failed = [v for v in verified if not (v.ok and v.step_s)]
    if failed:
        print("[plan] calibration runs that failed (their strategies keep no overhead): "
              + "; ".join(f"{v.candidate.strategy}: {v.row.get('reason', '')}"[:160] for v in failed),
              file=sys.stderr, flush=True)

    def predict(c: Any, h: Hardware) -> Any:
        return predict_step(shape, c.setup, h, allow_tf32=allow_tf32)

    when = date.today().isoformat()
    where = f"measured {when} by plan.calibrate: {len(ok)} short runs of {shape.name} here ({out_dir})"
    ddp = [(c, s) for c, s in ok if c.strategy == "ddp"]
    new, source = hw, dict(hw.source)
    if len({c.setup.micro_batch_size for c, _ in ddp}) >= 2:
        eff, per_block = fit_ddp(hw, ddp, predict=predict)
        new = replace(new, efficiency=eff, layer_overhead_s=per_block)
        source["efficiency"] = source["layer_overhead_s"] = f"{where}: ddp at two micro-batch sizes, fitted"
    overhead = fit_overheads(new, ok, predict=predict)
    if overhead:
        new = replace(new, overhead_s={**new.overhead_s, **overhead})
        source["overhead_s"] = f"{where}: each family's step beyond the rest of the prediction"
    return replace(new, source=source)
