"""Run the plan's top candidates for a few steps through the comparison's runner, put predicted beside measured,
and refit the profile's factors from what was measured.

Each candidate is a training launch of its own (compare/runner.py: the same command, telemetry and summary as a
`launch/compare.py` row). Measured step time is summary.json's median step after the warm-up steps (one launch's
mean moved with its slowest steps; recorder.median_step_s), its mean on a GPU, which times windows only; measured peak
is the worst rank's peak of all live tensors (memory/peak_live_bytes) where the run measured it, else its peak
allocated. The refit:
- `efficiency`: for each run of a strategy without per-block work (ddp, zero1, zero2; all runs if none), the
  compute time that makes the predicted step equal the
  measured one, as a factor on the predicted compute (the median over runs);
- `overhead_s.<strategy>` (fsdp, fsdp_tp, tp, zero3, pipeline): for each run of such a strategy, what is left
  of the measured step beyond the rest of the prediction,
  per block and micro-batch (the median; kept as it was without a ZeRO-3 run).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Optional

from dist_train.estimate.memory import category_bytes
from dist_train.estimate.hardware import Hardware
from dist_train.plan.search import Candidate
from dist_train.estimate.step_time import StepTime

COMPARED_CATEGORIES = ("params", "grads", "optimizer", "activations")


@dataclass
class Verified:
    candidate: Candidate
    row: dict[str, Any]  # the comparison's row (compare/table.py build_row)

    @property
    def ok(self) -> bool:
        return self.row.get("status") == "ok"

    @property
    def step_s(self) -> Optional[float]:
        if not self.ok:
            return None
        median = self.row.get("median_step_s")  # None on a GPU (recorder.median_step_s): the mean
        return median if median is not None else self.row.get("step_s")

    @property
    def peak_bytes(self) -> Optional[float]:
        if not self.ok:
            return None
        return self.row.get("mem_peak_live_max_bytes") or self.row.get("mem_peak_allocated_max_bytes")

    @property
    def comm_s(self) -> Optional[float]:
        return self.row.get("comm_s") if self.ok else None


def run_candidates(candidates: list[Candidate], *, training: list[str], global_batch: int, nproc: int, steps: int,
                   out_dir: Path, timeout_s: float) -> list[Verified]:
    """Each candidate trained for `steps` steps, one launch after another, in out_dir/<n>-<strategy>/."""
    import sys

    from dist_train.compare.runner import run_strategy
    from dist_train.compare.settings import StrategySpec
    from dist_train.compare.table import build_row

    out = []
    for i, c in enumerate(candidates):
        label = f"{i + 1}-{c.strategy}"
        spec = StrategySpec(label=label, name=c.strategy, overrides=tuple(o for o in c.overrides
                                                                         if not o.startswith("strategy=")))
        print(f"[plan] verifying {i + 1}/{len(candidates)}: {c.label} ...", file=sys.stderr, flush=True)
        result = run_strategy(spec, training=[*training, f"train.global_batch_size={global_batch}",
                                              f"train.steps={steps}", "logger=none"],
                              nproc=nproc, out_dir=out_dir, group=out_dir.name, timeout_s=timeout_s)
        row = build_row(result)
        print(f"[plan] {label}: {row['status']} in {result.seconds:.1f} s {result.reason}", file=sys.stderr, flush=True)
        out.append(Verified(c, row))
    return out


def rel(predicted: float, measured: Optional[float]) -> Optional[float]:
    return None if not measured else (predicted - measured) / measured


def spearman(xs: list[float], ys: list[float]) -> Optional[float]:
    """Rank correlation (average ranks for ties); None below 3 pairs or when one side is constant."""
    if len(xs) < 3:
        return None

    def ranks(v: list[float]) -> list[float]:
        order = sorted(range(len(v)), key=lambda i: v[i])
        r = [0.0] * len(v)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2
            i = j + 1
        return r

    rx, ry = ranks(xs), ranks(ys)
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    sxy = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    sxx, syy = sum((a - mx) ** 2 for a in rx), sum((b - my) ** 2 for b in ry)
    return None if not sxx or not syy else sxy / (sxx * syy) ** 0.5


def summary(verified: list[Verified]) -> dict[str, Any]:
    """Per candidate predicted and measured; the rank correlation of the step times."""
    rows = []
    for v in verified:
        c, t = v.candidate, v.candidate.time
        measured_cats = {cat: max((m.get(cat, 0) for m in v.row.get("mem_per_rank", [])), default=0)
                         for cat in COMPARED_CATEGORIES} if v.ok else {}
        rows.append({
            "strategy": c.strategy, "overrides": list(c.overrides), "status": v.row.get("status"),
            "reason": v.row.get("reason", ""), "run_dir": v.row.get("run_dir"),
            "predicted": {"step_s": t.step_s, "peak_bytes": c.peak_bytes, "comm_s": t.comm_s,
                          **{f"{cat}_bytes": category_bytes(c.memory, cat) for cat in COMPARED_CATEGORIES}},
            "measured": {"step_s": v.step_s, "peak_bytes": v.peak_bytes, "comm_s": v.comm_s,
                         **{f"{cat}_bytes": b for cat, b in measured_cats.items()}},
            "error": {"step_s": rel(t.step_s, v.step_s), "peak_bytes": rel(c.peak_bytes, v.peak_bytes)},
        })
    ok = [v for v in verified if v.ok]
    rho = spearman([v.candidate.time.step_s for v in ok], [v.step_s for v in ok])  # type: ignore[misc]
    return {"runs": rows, "rank_correlation": rho}


def fit_overheads(hw: Hardware, runs: list[tuple[Candidate, float]], *, predict: Any) -> dict[str, float]:
    """Each overhead key's `overhead_s` from runs [(candidate, measured step)] of strategies with work of their own:
    the median over its runs of what the measured step takes beyond the rest of the prediction under `hw`, per
    block and micro-batch (never below 0). Keys with no run are absent."""
    per_unit: dict[str, list[float]] = {}
    for c, measured in runs:
        key = c.time.overhead_key
        if key:
            without = predict(c, replace(hw, overhead_s={**hw.overhead_s, key: 0.0}))
            per_unit.setdefault(key, []).append(max(0.0, (measured - without.step_s) / c.time.overhead_units))
    return {key: statistics.median(values) for key, values in per_unit.items()}


def plan_out_dir(p: Any) -> Path:
    """Where plan.verify's and a cpu calibration's runs go: plan.out_dir, or outputs/plan-<time>, chosen once for
    the command (both land in the same directory)."""
    import time as clock

    if not p.out_dir:
        p.out_dir = f"outputs/plan-{clock.strftime('%Y%m%d-%H%M%S')}"
    return Path(p.out_dir)


def refit(hw: Hardware, verified: list[Verified], *, predict: Any) -> tuple[Hardware, dict[str, tuple[float, float]]]:
    """The profile with `efficiency` and `overhead_s` fitted to the runs, and {factor: (before, after)}.

    `predict(candidate, hw)` gives a candidate's StepTime under a profile (the time model, bound to the shape)."""
    ok = [v for v in verified if v.ok and v.step_s]
    plain = [v for v in ok if not v.candidate.time.overhead_key] or ok
    moved: dict[str, tuple[float, float]] = {}
    new = hw
    ratios = []
    for v in plain:
        t: StepTime = v.candidate.time
        rest = t.step_s - t.compute_s - t.bubble_s
        if t.compute_s <= 0:
            continue
        # what the measured step leaves for the operations, the bubble's share and eager PyTorch's per block aside
        with_bubble = (t.compute_s + t.bubble_s) / t.compute_s
        ops = (v.step_s - rest) / with_bubble - t.layer_units * hw.layer_overhead_s  # type: ignore[operator]
        if ops > 0 and t.ops is not None and not t.ops.host_s:  # a host-bound run says nothing of the kernels
            ratios.append(t.ops.total_s / ops)
    if ratios:
        new = replace(new, efficiency=min(1.0, hw.efficiency * statistics.median(ratios)))
        moved["efficiency"] = (hw.efficiency, new.efficiency)
    fitted = fit_overheads(new, [(v.candidate, v.step_s) for v in ok], predict=predict)  # type: ignore[misc]
    if fitted:
        for key, value in fitted.items():
            moved[f"overhead_s.{key}"] = (hw.overhead_s.get(key, 0.0), value)
        new = replace(new, overhead_s={**new.overhead_s, **fitted})
    if moved:
        from datetime import date

        source = dict(new.source)
        stamp = f"refit {date.today().isoformat()} from {len(ok)} verified run(s) (plan.verify)"
        for key in moved:
            source[key.split(".")[0]] = stamp
        new = replace(new, source=source)
    return new, moved

def verify(shown: list[Candidate], plan: dict[str, Any], *, shape: Any, cfg: dict[str, Any], hw: Hardware, args: Any,
           training: list[str], global_batch: int, text: bool) -> dict[str, Any]:
    """plan.verify=K: run, compare, refit, store the refit profile; prints the tables when `text`."""
    import json
    import sys

    from dist_train.estimate.hardware import default_profile_dir, save_profile
    from dist_train.estimate.step_time import predict_step

    p = args.plan
    out_dir = plan_out_dir(p)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "plan.json").write_text(json.dumps(plan, indent=1, default=str))
    allow_tf32 = bool(cfg["train"].get("allow_tf32", False))
    verified = run_candidates(shown, training=training, global_batch=global_batch, nproc=shown[0].setup.world_size,
                              steps=p.steps, out_dir=out_dir, timeout_s=p.timeout_s)
    result = summary(verified)
    new, moved = refit(hw, verified, predict=lambda c, h: predict_step(shape, c.setup, h, allow_tf32=allow_tf32))
    result["refit"] = {k: {"before": a, "after": b} for k, (a, b) in moved.items()}
    if moved:
        result["profile"] = str(save_profile(new, Path(p.profile_dir or default_profile_dir())))
    result["out_dir"] = str(out_dir)
    (out_dir / "verify.json").write_text(json.dumps(result, indent=1, default=str))
    if text:
        print("\n" + render(result), file=sys.stdout, flush=True)
    return result


def render(result: dict[str, Any]) -> str:
    from dist_train.compare.report import pct
    from dist_train.estimate.render import human_bytes as b, human_seconds as s, text_table

    rows, cats = [], []
    for i, r in enumerate(result["runs"]):
        pr, me, err = r["predicted"], r["measured"], r["error"]
        name = f"{i + 1}. {' '.join(r['overrides'])}"
        if r["status"] != "ok":
            rows.append([name, s(pr["step_s"]), r["status"], "", b(pr["peak_bytes"]), "", "", "", ""])
            continue
        rows.append([name, s(pr["step_s"]), s(me["step_s"]), pct(err["step_s"]), b(pr["peak_bytes"]),
                     b(me["peak_bytes"]), pct(err["peak_bytes"]), s(pr["comm_s"]),
                     "n/a" if me["comm_s"] is None else s(me["comm_s"])])  # None: some collective untimed
        cats.append([f"{i + 1}.", *(f"{b(pr[f'{c}_bytes'])} / {b(me.get(f'{c}_bytes'))}" for c in COMPARED_CATEGORIES)])
    rho = result["rank_correlation"]
    lines = [
        f"verified: {len(result['runs'])} configuration(s), runs in {result['out_dir']}",
        text_table(["configuration", "step pred", "measured", "error", "peak pred", "measured", "error",
                    "comm pred", "measured"], rows),
        "memory per category, worst rank, predicted / measured:",
        text_table(["", *COMPARED_CATEGORIES], cats),
        "rank correlation of predicted and measured step times (Spearman): "
        + ("n/a (fewer than 3 runs)" if rho is None else f"{rho:.2f}"),
        "(comm measured: the collectives dist_train times; tensor parallelism's DTensor all-reduces are counted in "
        "bytes but not timed)",
    ]
    for key, moved in result.get("refit", {}).items():
        before, after = moved["before"], moved["after"]
        change = f" ({100 * (after - before) / before:+.0f}%)" if before else ""
        lines.append(f"refit {key}: {before:.4g} -> {after:.4g}{change}")
    if result.get("profile"):
        lines.append(f"profile stored: {result['profile']} (the next plan uses it)")
    return "\n".join(lines)
