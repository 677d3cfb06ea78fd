"""The dry run seen from the estimator: each asked rank run in a process of its own, beside the prediction for the
same keys, and the table that prints them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dist_train.estimate.setup import Setup
    from dist_train.estimate.shapes import ModelShape


def run_ranks(overrides: list[str], *, world_size: int, ranks: list[int], timeout_s: float) -> list[dict[str, Any]]:
    """Each rank in its own process (a process joins one process group), one after the other."""
    out = []
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                             "MASTER_PORT", "LOCAL_WORLD_SIZE")}
    for rank in ranks:
        proc = subprocess.run([sys.executable, "-m", "dist_train.estimate.dryrun", "--world-size", str(world_size),
                               "--rank", str(rank)], input=json.dumps(overrides), capture_output=True, text=True,
                              timeout=timeout_s, env=env)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith('{"rank"')]
        if proc.returncode != 0 or not lines:
            tail = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
            raise RuntimeError(f"dry run of rank {rank} of {world_size} failed: {tail}")
        out.append(json.loads(lines[-1]))
    return out


def dryrun_rows(overrides: list[str], shape: ModelShape, setup: Setup, *, ranks: list[int],
                timeout_s: float, predict: bool = True) -> list[dict[str, Any]]:
    """Per asked rank: the dry run's figures (summary.json's ranks[] keys), the prediction for the same keys, and
    their relative difference (dry run / predicted - 1). predict=False (LoRA, which the estimator does not model):
    the dry run's figures alone."""
    from dist_train.estimate.comm import predict_comm
    from dist_train.estimate.memory import category_bytes, predict_memory

    measured = run_ranks(overrides, world_size=setup.world_size, ranks=ranks, timeout_s=timeout_s)
    if not predict:
        return [{"rank": m["rank"], "measured": {k: v for k, v in m.items() if k != "rank"}, "predicted": {},
                 "diff": {}} for m in measured]
    predicted_ranks, comm = predict_memory(shape, setup), predict_comm(shape, setup)
    rows = []
    for m in measured:
        r = m["rank"]
        predicted: dict[str, float] = {f"memory/{c}_bytes": category_bytes(predicted_ranks[r], c)
                                       for c in ("params", "grads", "optimizer")}
        if predicted_ranks[r].peak_live is not None:
            predicted["memory/peak_live_bytes"] = predicted_ranks[r].peak_live
        for c in comm[r] if r < len(comm) else comm[0]:
            key = f"comm/{c.op}/bytes"
            predicted[key] = predicted.get(key, 0.0) + c.bytes
        diff = {k: (m[k] / v - 1 if v else None) for k, v in predicted.items() if k in m}
        rows.append({"rank": r, "measured": {k: v for k, v in m.items() if k != "rank"}, "predicted": predicted,
                     "diff": diff})
    return rows


def dryrun_section(rows: list[dict[str, Any]], *, world_size: int) -> str:
    """The dry run's rows as a text table: per rank, what it measured, the prediction and the difference."""
    from dist_train.estimate.render import human_bytes, text_table

    keys = list(dict.fromkeys(k for row in rows for k in (*row["measured"], *row["predicted"])))
    table = []
    for key in keys:
        cells: list[object] = [key]
        for row in rows:
            m, p, d = row["measured"].get(key), row["predicted"].get(key), row["diff"].get(key)
            fmt = (lambda v: f"{v:,.0f}") if key.endswith("/count") else (
                (lambda v: f"{v:,.1f} s") if key.endswith("_s") else human_bytes)
            cells += [fmt(m) if m is not None else "-", human_bytes(p) if p is not None else "-",
                      f"{d:+.1%}" if d is not None else "-"]
        table.append(cells)
    headers = ["figure", *(h for row in rows for h in (f"rank {row['rank']} dry run", "predicted", "diff"))]
    return "\n".join([
        f"dry run: the real strategy code as each rank of {world_size}, one process each here (fake process group, "
        "FakeTensorMode: no data, no GPU); comm per step",
        text_table(headers, table),
    ])
