"""The comparison's dry-run rows (`compare.dryrun_world_sizes=[64,1024]`): each strategy at world sizes this machine
cannot run, as the dry run computes it (`python -m dist_train.estimate ... dryrun.ranks=[0,N-1]`): the real strategy
code under a fake process group and fake tensors, beside the estimator. Marked as dry runs: nothing was trained."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

from dist_train.compare.report import md_table
from dist_train.compare.settings import StrategySpec
from dist_train.estimate.render import human_bytes

# What the report shows of each dry-run rank (the figures summary.json's ranks[] has, under the same keys)
SHOWN = ("memory/params_bytes", "memory/grads_bytes", "memory/optimizer_bytes", "memory/peak_live_bytes",
         "comm/all_gather/bytes", "comm/reduce_scatter/bytes", "comm/all_reduce/bytes", "comm/send/bytes")


def run_dryruns(specs: list[StrategySpec], training: list[str], *, world_sizes: list[int],
                timeout_s: float) -> list[dict[str, Any]]:
    """Per strategy row and world size: the dry run of its first and last rank, or why it has none (one line).

    The training overrides are the comparison's own, without the global batch it pins for its measured rows: a
    null train.global_batch_size is micro_batch_size x the data-parallel ranks of each world size."""
    out = []
    for spec in specs:
        for n in world_sizes:
            ranks = sorted({0, n - 1})
            print(f"[compare] {spec.label}: dry run as ranks {ranks} of {n} ...", file=sys.stderr, flush=True)
            cmd = [sys.executable, "-m", "dist_train.estimate", *training, f"strategy={spec.name}", *spec.overrides,
                   f"world_size={n}", f"dryrun.ranks=[{','.join(map(str, ranks))}]", f"dryrun.timeout_s={timeout_s}",
                   "format=json"]
            row: dict[str, Any] = {"strategy": spec.label, "world_size": n}
            limit_s = timeout_s * len(ranks) + 60  # each rank's own limit, one after the other, and the start-up
            try:
                proc = subprocess.run(cmd, capture_output=True, text=True, timeout=limit_s)
            except subprocess.TimeoutExpired:
                row["skipped"] = f"over {limit_s:.0f} s"
            else:
                if proc.returncode == 0:
                    row["ranks"] = json.loads(proc.stdout)["dryrun"]["ranks"]
                else:
                    lines = proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"]
                    row["skipped"] = lines[-1].removeprefix("config error: ")
            out.append(row)
    return out


def dryrun_table(rows: list[dict[str, Any]]) -> str:
    """One line per dry-run rank: each shown figure, with its difference from the estimator's prediction."""
    shown = [k for k in SHOWN if any(k in r["measured"] for row in rows for r in row.get("ranks", []))]
    shown = shown or list(SHOWN[:3])
    lines = []
    for row in rows:
        if "ranks" not in row:
            lines.append([row["strategy"], f"{row['world_size']:,}", "-",
                          f"no dry run: {row['skipped']}", *[""] * (len(shown) - 1)])
            continue
        for r in row["ranks"]:
            cells = []
            for key in shown:
                value, diff = r["measured"].get(key), r["diff"].get(key)
                cells.append("-" if value is None else human_bytes(value) + ("" if diff is None else f" ({diff:+.1%})"))
            lines.append([row["strategy"], f"{row['world_size']:,}", str(r["rank"]), *cells])
    headers = ["strategy", "world size", "rank", *(k.split("/", 1)[1].removesuffix("_bytes") for k in shown)]
    return md_table(headers, lines)


DRYRUN_INTRO = """\
Dry runs, not measurements: for world sizes this comparison did not run (`compare.dryrun_world_sizes`), each
strategy's real set-up and training step as its first and last rank, under torch's fake process group and fake
tensors (no data, no GPU, nothing trained). Memory by category and collective bytes per step, with the estimator's
prediction for the same rank in parentheses (dry run / predicted - 1). A strategy the dry run does not cover says
why."""
