"""report.md, table.csv and table.json: the comparison as a person and as a program read it."""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any, Optional

from dist_train.compare.settings import as_overrides, override_value
from dist_train.compare.sweep import EFFECT_CATEGORIES
from dist_train.compare.table import COMM_OPS, MEMORY_CATEGORIES, MEMORY_FIGURES, TRANSIENT_CATEGORIES
from dist_train.estimate.render import human_bytes

# Scalar columns of table.csv, in order (a column absent from every row is left out).
CSV_COLUMNS = [
    "strategy", "knobs", "status", "reason", "verdict", "agrees", "world_size", "nodes", "data_parallel_size", "num_params",
    "steps", "timed_steps",
    "step_s", "median_step_s", "pred_step_s", "err_step_s", "pred_step_profile", "compute_s", "comm_s", "tokens_per_s",
    *(f"comm_{op}_s" for op in COMM_OPS),
    *(f"mem_{c}_{k}_bytes" for c in MEMORY_FIGURES
      for k in ("max", "spread")),
    "comm_bytes_per_step", "comm_inter_node_bytes_per_step", *(f"comm_{op}_bytes" for op in COMM_OPS),
    "final_loss", "loss_dev", "loss_max_rel_dev", "final_eval_loss", "moe_maxvio", "moe_dead_experts", "moe_ep_overload",
    *(f"{p}_{c}" for c in ("params", "grads", "optimizer", "activations", *TRANSIENT_CATEGORIES, "peak_live")
      for p in ("pred", "err")),
    "model_state_ok", "prediction_ok", "pred_regime", "pred_comm_bytes_per_step", "err_comm_bytes",
    "run_dir", "log", "wall_s",
]


# The predicted memory columns are stored as pred_<category>_bytes; every other column under its own name.
_PREDICTED_BYTES = {f"pred_{c}" for c in ("params", "grads", "optimizer", "activations", *TRANSIENT_CATEGORIES,
                                          "peak_live")}


def _csv_key(name: str) -> str:
    return f"{name}_bytes" if name in _PREDICTED_BYTES else name


def write_tables(rows: list[dict[str, Any]], out_dir: Path) -> tuple[Path, Path]:
    columns = [c for c in CSV_COLUMNS if any(_csv_key(c) in r for r in rows)]
    csv_path, json_path = out_dir / "table.csv", out_dir / "table.json"
    with open(csv_path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(columns)
        for r in rows:
            writer.writerow([_csv_cell(r.get(_csv_key(c))) for c in columns])
    json_path.write_text(json.dumps(rows, indent=2, default=str))
    return csv_path, json_path


def _csv_cell(value: Any) -> Any:
    if isinstance(value, dict):  # knobs: as the overrides that set them
        return as_overrides(value)
    return "" if value is None else value


# ------------------------------------------------------------------ Markdown pieces
def md_table(headers: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def ms(seconds: Optional[float]) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.1f}"


def timed_ms(row: dict[str, Any], key: str) -> str:
    """A measured time column in ms; "n/a" where it is None (some collective ran untimed: compare/table.py)."""
    return "n/a" if row.get(key) is None else ms(row[key])


def pct(err: Optional[float]) -> str:
    return "n/a" if err is None else f"{err * 100:+.1f}%"


def mem_cell(row: dict[str, Any], cat: str) -> str:
    if f"mem_{cat}_max_bytes" not in row:
        return "-"
    spread = row[f"mem_{cat}_spread_bytes"]
    return human_bytes(row[f"mem_{cat}_max_bytes"]) + (f" (±{human_bytes(spread)})" if spread else "")


def verdict_mark(row: dict[str, Any]) -> str:
    return {True: "OK", False: "DIFFERS", None: "-"}[row.get("agrees")] if row["status"] == "ok" else "FAILED"


# The summary table's memory columns: set-up's peak anonymous (what set-up allocated) beside its peak resident (which
# counts the pages of memory-mapped weight files a rank read).
SUMMARY_MEMORY = (*MEMORY_CATEGORIES, "peak_live", "peak_rss", "setup_peak_anon", "setup_peak_rss")


def summary_table(rows: list[dict[str, Any]]) -> str:
    held_out = any("final_eval_loss" in r for r in rows)  # eval.every_steps: a column for the held-out loss
    headers = ["strategy", "ranks", "step ms", "compute ms", "comm ms", "tokens/s",
               "params (max, ±spread)", "grads", "optimizer", "activations", "peak live", "peak RSS", "set-up peak anon",
               "set-up peak RSS",
               "comm bytes/step", "final loss", *(["eval loss"] if held_out else []), "Δ vs single", "verdict"]
    body = []
    for r in rows:
        if r["status"] != "ok":
            body.append([f"**{r['strategy']}**", "-", *["-"] * (len(headers) - 3), f"FAILED: {r['reason']}"])
            continue
        body.append([
            f"**{r['strategy']}**", _ranks(r), ms(r["step_s"]), timed_ms(r, "compute_s"), timed_ms(r, "comm_s"),
            f"{r['tokens_per_s']:,.0f}", *(mem_cell(r, c) for c in SUMMARY_MEMORY),
            human_bytes(r["comm_bytes_per_step"]), f"{r['final_loss']:.6f}",
            *([f"{r['final_eval_loss']:.6f}" if "final_eval_loss" in r else "-"] if held_out else []),
            f"{r['loss_dev']:+.1e}" if "loss_dev" in r else "-", verdict_mark(r),
        ])
    return md_table(headers, body)


def _ranks(row: dict[str, Any]) -> str:
    nodes = row.get("nodes", 1)
    return f"{row['world_size']} on {nodes} nodes" if nodes > 1 else str(row["world_size"])


def comm_table(rows: list[dict[str, Any]]) -> str:
    ops = [op for op in COMM_OPS if any(f"comm_{op}_bytes" in r for r in rows)]
    inter = any("comm_inter_node_bytes_per_step" in r for r in rows)
    headers = ["strategy", *(f"{op} ms / bytes" for op in ops), "total bytes/step",
               *(["of which inter-node"] if inter else []), "predicted bytes/step", "error"]
    body = []
    for r in rows:
        if r["status"] != "ok":
            continue
        cells = [f"{ms(r.get(f'comm_{op}_s', 0.0))} / {human_bytes(r.get(f'comm_{op}_bytes', 0.0))}" for op in ops]
        crossing = [human_bytes(r["comm_inter_node_bytes_per_step"]) if "comm_inter_node_bytes_per_step" in r
                    else "-"] if inter else []
        body.append([r["strategy"], *cells, human_bytes(r["comm_bytes_per_step"]), *crossing,
                     human_bytes(r.get("pred_comm_bytes_per_step")), pct(r.get("err_comm_bytes"))])
    return md_table(headers, body)


def prediction_table(rows: list[dict[str, Any]], *, memory_rtol: float) -> str:
    transient = [c for c in (*TRANSIENT_CATEGORIES, "peak_live") if any(f"pred_{c}_bytes" in r for r in rows)]
    headers = ["strategy", "regime", "step pred / meas (err)",
               *(f"{c} pred / meas (err)" for c in ("params", "grads", "optimizer")),
               f"model state within {memory_rtol:.0%}", "activations pred / meas (err)",
               *(f"{c.replace('_', ' ')} pred / meas (err)" for c in transient)]
    body = []
    for r in rows:
        if r["status"] != "ok" or "pred_params_bytes" not in r:
            continue
        cells = [_pred_cell(r, c) for c in ("params", "grads", "optimizer", "activations", *transient)]
        body.append([r["strategy"], r["pred_regime"], _step_cell(r), *cells[:3],
                     "yes" if r["model_state_ok"] else "**NO**", *cells[3:]])
    return md_table(headers, body)


def _step_cell(row: dict[str, Any]) -> str:
    """The advisor's predicted step (dist_train/plan) beside the measured one, or why there is none."""
    if "pred_step_s" not in row:
        return row.get("pred_step_note", "-")
    return f"{ms(row['pred_step_s'])} / {ms(row['step_s'])} ({pct(row['err_step_s'])})"


def _pred_cell(row: dict[str, Any], cat: str) -> str:
    if f"pred_{cat}_bytes" not in row:
        return "-"
    return f"{human_bytes(row[f'pred_{cat}_bytes'])} / {human_bytes(row.get(f'mem_{cat}_max_bytes'))} ({pct(row[f'err_{cat}'])})"


_SHORT_DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def dtype_table(rows: list[dict[str, Any]]) -> str:
    """Worst rank's bytes per category, split by dtype (the study notes' fp32 master, bf16 weights, ...)."""
    cats = [c for c in MEMORY_CATEGORIES if any(c in r.get("mem_by_dtype", {}) for r in rows)]
    body = []
    for r in rows:
        split = r.get("mem_by_dtype")
        if r["status"] != "ok" or not split:
            continue
        cells = [", ".join(f"{_SHORT_DTYPES.get(d, d)} {human_bytes(n)}"
                           for d, n in sorted(split.get(c, {}).items(), key=lambda kv: -kv[1])) or "-" for c in cats]
        body.append([r["strategy"], *cells])
    return md_table(["strategy", *cats], body)


def runs_table(rows: list[dict[str, Any]], out_dir: Path) -> str:
    body = [[r["strategy"], r["status"], f"`{_rel(r['run_dir'], out_dir)}/`", f"[log]({_rel(r['log'], out_dir)})",
             f"{r['wall_s']:.1f}"] for r in rows]
    return md_table(["strategy", "status", "run directory (summary.json, metrics.jsonl, config.yaml)", "log",
                     "wall s"], body)


def _rel(path: str, out_dir: Path) -> str:
    try:
        return str(Path(path).relative_to(out_dir))
    except ValueError:
        return path


def effects_table(effects: list[dict[str, Any]]) -> str:
    cats = [c for c in EFFECT_CATEGORIES if any(c in e for e in effects)]
    body = []
    for e in effects:
        others = as_overrides(e["others"]) or "-"
        cells = []
        for cat in cats:
            c = e.get(cat)
            if c is None:
                cells.append("-")
                continue
            after = human_bytes(c["bytes"][0])
            pred = "" if c["predicted"] is None else f", pred {pct(c['predicted'])}"
            change = "from none" if not c["bytes"][1] and c["bytes"][0] else pct(c["measured"])
            cells.append(f"{change} ({after}{pred})")
        body.append([f"`{e['knob']}`: {override_value(e['from'])} → {override_value(e['to'])}", e["strategy"], others,
                     pct(e["step_s"]), *cells])
    return md_table(["change", "strategy", "other knobs", "step time", *(f"{c.replace('_', ' ')} measured "
                                                                           "(after; pred)" for c in cats)], body)
