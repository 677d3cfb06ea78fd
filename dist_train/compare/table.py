"""One row per strategy, read from what its run left behind (summary.json, metrics.jsonl).

Memory: per category, the max over ranks of each rank's peak, and the spread (max - min) over ranks.
Time: the run's mean step time (warm-up steps left out, as summary.json does; `timed_steps` of them, and compare
warns below MIN_TIMED_STEPS); the collective time of
the same steps from metrics.jsonl, averaged over ranks. Async collectives overlap compute, so their
time is an upper bound of the communication the step waits for; compute = step - comm, clipped at 0. Where some
collective ran untimed (`comm/<op>/untimed_count` in metrics.jsonl) both are None: n/a in the report, never 0.
Bytes: buffer bytes per step (nccl-tests convention), the max over ranks; on several nodes also the bytes of
the collectives whose process group spans nodes (inter-node), as each rank's telemetry classified them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from dist_train.compare.runner import RunResult

MEMORY_CATEGORIES = ("params", "grads", "optimizer", "activations")
# Held only for a moment (see dist_train/estimate/memory.py): autocast's weight copies, ZeRO-3's gathered
# parameters, ZeRO's fp32 gradient partition at the optimizer step. Peaks, like activations.
TRANSIENT_CATEGORIES = ("weight_copies", "gathered_params", "step_grads")
# Every memory figure a run reports per rank (memory/<figure>_bytes): the categories, then the process peaks, then
# set-up's (before the first step: the peak once the weights were in, and the peak of all of set-up, anonymous and
# resident: the resident one counts the pages of memory-mapped weight files a rank read, shared page cache).
# peak_live: every live tensor at the peak, what decides out-of-memory (beside the categories it adds gathered
# parameters, unsharded gradients, collective buffers, temporaries).
MEMORY_FIGURES = (*MEMORY_CATEGORIES, *TRANSIENT_CATEGORIES, "peak_live", "peak_rss", "peak_allocated",
                  "load_peak_rss", "setup_peak_anon", "setup_peak_rss", "setup_peak_allocated")
from dist_train.telemetry.bandwidth import COMM_OPS  # one list of ops for telemetry and the report


def read_run(run_dir: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    summary = json.loads((run_dir / "summary.json").read_text())
    metrics_path = run_dir / "metrics.jsonl"
    records = [json.loads(ln) for ln in metrics_path.read_text().splitlines() if ln.strip()] if metrics_path.is_file() else []
    return summary, records


def base_row(result: RunResult) -> dict[str, Any]:
    return {
        "strategy": result.spec.label,
        "strategy_name": result.spec.name,
        "status": "ok" if result.ok else ("timeout" if result.returncode is None else "failed"),
        "reason": result.reason,
        "run_dir": str(result.run_dir),
        "log": str(result.log_path),
        "wall_s": round(result.seconds, 2),
    }


def build_row(result: RunResult) -> dict[str, Any]:
    row = base_row(result)
    if not result.ok:
        return row
    summary, records = read_run(result.run_dir)
    ranks = summary.get("ranks", [])
    row.update({
        "world_size": summary["world_size"], "nodes": summary.get("nodes", 1),
        "data_parallel_size": summary["data_parallel_size"],
        "num_params": summary["num_params"], "steps": summary["steps"],
        "device_name": summary.get("device_name", "cpu"),
    })
    row.update(memory_columns(ranks))
    row.update(time_columns(summary, records))
    row.update(comm_bytes_columns(ranks))
    row.update(moe_columns(summary))
    row["final_loss"] = summary["final_loss"]
    row["losses"] = summary["losses"]
    if summary.get("final_eval_loss") is not None:  # eval.every_steps: the held-out loss at the end
        row["final_eval_loss"] = summary["final_eval_loss"]
    row["config_hash"] = _config_hash(result.run_dir)
    return row


def moe_columns(summary: dict[str, Any]) -> dict[str, Any]:
    """An MoE run's load: the worst layer's MaxVio and the dead experts over the run's global load (summary.json's
    moe_load), and under expert parallelism the most loaded rank's overload (its steady mean, the worst rank)."""
    load = summary.get("moe_load")
    if not load:
        return {}
    out = {"moe_maxvio": max(v["maxvio"] for v in load.values()),
           "moe_dead_experts": sum(v["dead_experts"] for v in load.values())}
    overloads = [r["moe/ep_overload"] for r in summary.get("ranks", []) if "moe/ep_overload" in r]
    if overloads:
        out["moe_ep_overload"] = max(overloads)
    return out


def _config_hash(run_dir: Path) -> str | None:
    from omegaconf import OmegaConf

    from dist_train.session import config_hash

    path = run_dir / "config.yaml"
    return config_hash(OmegaConf.to_container(OmegaConf.load(path), resolve=True)) if path.is_file() else None


def memory_columns(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for cat in MEMORY_FIGURES:
        values = [r[f"memory/{cat}_bytes"] for r in ranks if f"memory/{cat}_bytes" in r]
        if values:
            out[f"mem_{cat}_max_bytes"] = max(values)
            out[f"mem_{cat}_spread_bytes"] = max(values) - min(values)
    out["mem_per_rank"] = [{cat: r.get(f"memory/{cat}_bytes", 0) for cat in (*MEMORY_CATEGORIES, *TRANSIENT_CATEGORIES)}
                           for r in ranks]
    by_dtype = {}
    for cat in MEMORY_CATEGORIES:  # the split of the rank that holds the most of the category
        prefix = f"memory/by_dtype/{cat}/"
        worst = max(ranks, key=lambda r: r.get(f"memory/{cat}_bytes", 0), default=None)
        split = {k[len(prefix):-len("_bytes")]: v for k, v in (worst or {}).items() if k.startswith(prefix) and v}
        if split:
            by_dtype[cat] = split
    if by_dtype:
        out["mem_by_dtype"] = by_dtype
    return out


def timed_windows(records: list[dict[str, Any]], warmup_steps: int) -> list[tuple[int, list[dict[str, Any]]]]:
    """(steps in window, per-rank records) of the logging windows after the warm-up steps."""
    by_step: dict[int, list[dict[str, Any]]] = {}
    for r in records:
        by_step.setdefault(r["step"], []).append(r)
    steps = sorted(by_step)
    spans = [(s, s - p) for s, p in zip(steps, [0] + steps[:-1])]
    kept = [(n, by_step[s]) for s, n in spans if s > warmup_steps]
    return kept or [(n, by_step[s]) for s, n in spans]


def time_columns(summary: dict[str, Any], records: list[dict[str, Any]]) -> dict[str, Any]:
    """Step time, tokens/s, and the collective time per op and in all. An op some of whose calls ran untimed in
    the timed windows (`comm/<op>/untimed_count`: a functional collective torch issued itself) has no time:
    `comm_<op>_s`, `comm_s` and `compute_s` are then None (n/a), never the timed part read as the whole."""
    step_s = summary["mean_step_s"]
    windows = timed_windows(records, summary.get("timing_warmup_steps", 0))
    total_steps = sum(n for n, _ in windows) or 1
    out: dict[str, Any] = {"step_s": step_s, "median_step_s": summary.get("median_step_s"),
                           "tokens_per_s": summary["tokens_per_s"], "timed_steps": timed_steps(summary)}
    comm_s: float | None = 0.0
    for op in COMM_OPS:
        if any(r.get(f"comm/{op}/untimed_count") for _, recs in windows for r in recs):
            out[f"comm_{op}_s"] = comm_s = None
            continue
        key = f"comm/{op}/time_s"
        per_step = sum(n * _mean(r.get(key, 0.0) for r in recs) for n, recs in windows) / total_steps
        if per_step > 0:
            out[f"comm_{op}_s"] = per_step
        comm_s = None if comm_s is None else comm_s + per_step
    out["comm_s"] = comm_s
    out["compute_s"] = None if comm_s is None else max(step_s - comm_s, 0.0)
    return out


# A step time from fewer timed steps is noise on a shared machine: single's mean of 3 timed steps (a 5-step run)
# ranged 20-433 ms across reruns here. compare warns below this (`few_timed_steps`).
MIN_TIMED_STEPS = 5


def timed_steps(summary: dict[str, Any]) -> int:
    """Steps a run's mean step time comes from: the steps this run's processes ran (after a resume, from
    start_step + 1; to an interrupt's step), less the warm-up steps summary.json leaves out."""
    done = summary.get("steps_done", summary["steps"])
    return max(done - summary.get("start_step", 0) - summary.get("timing_warmup_steps", 0), 0)


def few_timed_steps(rows: list[dict[str, Any]], *, minimum: int = MIN_TIMED_STEPS) -> str | None:
    """One line naming each finished row whose step time comes from fewer than `minimum` timed steps, and how many
    steps would give `minimum`; None when every row has enough."""
    few = [r for r in rows if r["status"] == "ok" and r.get("timed_steps", minimum) < minimum]
    if not few:
        return None
    # the steps each row ran beyond its timed ones (warm-up, and a resume's earlier steps) are the same next time
    needed = max(r["steps"] - r["timed_steps"] + minimum for r in few)
    listed = ", ".join(f"{r['strategy']} {r['timed_steps']}" for r in few)
    return (f"step times from fewer than {minimum} timed steps (noise, not a measurement): {listed}; "
            f"train.steps={needed} or more times {minimum} steps of each (the first are warm-up, "
            "telemetry.warmup_steps)")


def comm_bytes_columns(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    totals = [0.0] * len(ranks)
    for op in COMM_OPS:
        values = [r.get(f"comm/{op}/bytes", 0.0) for r in ranks]
        totals = [t + v for t, v in zip(totals, values)]
        if any(values):
            out[f"comm_{op}_bytes"] = max(values)
    out["comm_bytes_per_step"] = max(totals) if totals else 0.0
    inter = [sum(v for k, v in r.items() if k.endswith("/inter_node_bytes")) for r in ranks]
    if any(k.endswith("/inter_node_bytes") for r in ranks for k in r):
        out["comm_inter_node_bytes_per_step"] = max(inter)
    return out


def _mean(values: Any) -> float:
    values = list(values)
    return sum(values) / len(values) if values else 0.0
