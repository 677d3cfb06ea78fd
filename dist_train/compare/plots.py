"""The comparison's pictures (matplotlib, PNG, no display needed)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only: no display on a cluster node

import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

from dist_train.compare.table import COMM_OPS, MEMORY_CATEGORIES  # noqa: E402
from dist_train.compare.verdict import is_baseline  # noqa: E402

MIB = 2**20


def ok_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in rows if r["status"] == "ok"]


def _save(fig: Any, path: Path) -> Path:
    for ax in fig.axes:  # long row labels (a sweep's `ddp+precision=bf16+...`) slant instead of overlapping
        labels = ax.get_xticklabels()
        if any(len(t.get_text()) > 12 for t in labels):
            plt.setp(labels, rotation=30, ha="right", fontsize=7)
    fig.tight_layout()
    legends = [ax.get_legend() for ax in fig.axes if ax.get_legend() is not None]
    for legend in legends:  # out of tight_layout (the axes keep their size), into the saved picture
        legend.set_in_layout(True)
    fig.savefig(path, dpi=110, bbox_inches="tight", bbox_extra_artists=legends)
    plt.close(fig)
    return path


def memory_per_rank(rows: list[dict[str, Any]], path: Path) -> Path:
    """A bar per (strategy, rank), stacked by category: where each rank's memory goes."""
    labels, stacks = [], {cat: [] for cat in MEMORY_CATEGORIES}
    for row in ok_rows(rows):
        for rank, mem in enumerate(row["mem_per_rank"]):
            labels.append(f"{row['strategy']}\nr{rank}")
            for cat in MEMORY_CATEGORIES:
                stacks[cat].append(mem.get(cat, 0) / MIB)
    fig, ax = plt.subplots(figsize=(max(6, 0.6 * len(labels) + 2), 4.5))
    bottom = [0.0] * len(labels)
    for cat in MEMORY_CATEGORIES:
        ax.bar(labels, stacks[cat], bottom=bottom, label=cat)
        bottom = [b + v for b, v in zip(bottom, stacks[cat])]
    ax.set_ylabel("MiB per rank (peak of each category)")
    ax.set_title("Memory per rank by category")
    _legend_outside(ax)
    ax.tick_params(axis="x", labelsize=8)
    return _save(fig, path)


def step_time(rows: list[dict[str, Any]], path: Path) -> Path:
    """Step time split into compute and (an upper bound of exposed) communication; a strategy whose collectives
    were not all timed (comm_s None) gets one bar for its whole step, not a split."""
    rs = ok_rows(rows)
    names = [r["strategy"] for r in rs]
    timed = [r["comm_s"] is not None for r in rs]
    compute = [r["compute_s"] * 1e3 if t else 0.0 for r, t in zip(rs, timed)]
    comm = [min(r["comm_s"], r["step_s"]) * 1e3 if t else 0.0 for r, t in zip(rs, timed)]
    fig, ax = plt.subplots(figsize=(max(6, 0.9 * len(names) + 2), 4.5))
    ax.bar(names, compute, label="compute (step - comm)")
    ax.bar(names, comm, bottom=compute, label="collectives (upper bound: may overlap compute)")
    if not all(timed):
        ax.bar(names, [0.0 if t else r["step_s"] * 1e3 for r, t in zip(rs, timed)], hatch="//", color="lightgrey",
               label="whole step (collectives not all timed: no split)")
    ax.set_ylabel("ms per step")
    ax.set_title("Step time: compute vs communication")
    _legend_outside(ax)
    return _save(fig, path)


def comm_bytes(rows: list[dict[str, Any]], path: Path) -> Path:
    rs = ok_rows(rows)
    names = [r["strategy"] for r in rs]
    fig, ax = plt.subplots(figsize=(max(6, 0.9 * len(names) + 2), 4.5))
    bottom = [0.0] * len(rs)
    for op in COMM_OPS:
        values = [r.get(f"comm_{op}_bytes", 0.0) / MIB for r in rs]
        if any(values):
            ax.bar(names, values, bottom=bottom, label=op)
            bottom = [b + v for b, v in zip(bottom, values)]
    ax.set_ylabel("MiB per step (buffer size, worst rank)")
    ax.set_title("Bytes per step by collective")
    _legend_outside(ax)
    return _save(fig, path)


def loss_curves(rows: list[dict[str, Any]], path: Path) -> Path:
    """Loss per step, and below it each run's difference from its single baseline: strategies that agree draw
    one line on top, so the lower panel is where they can be told apart."""
    from dist_train.compare.verdict import baseline_row

    rs = ok_rows(rows)
    fig, (ax, diff) = plt.subplots(2, 1, figsize=(8, 6.5), sharex=True, gridspec_kw={"height_ratios": [3, 2]})
    for i, r in enumerate(rs):
        steps = list(range(1, len(r["losses"]) + 1))
        style = {**_LINE_STYLES[i % len(_LINE_STYLES)], "color": f"C{i % 10}"}  # the same look in both panels
        if is_baseline(r):
            ax.plot(steps, r["losses"], label=r["strategy"], linewidth=3, alpha=0.4, color=style["color"])
            continue
        ax.plot(steps, r["losses"], label=r["strategy"], linewidth=1.2, **style)
        base = baseline_row(rows, like=r)
        if base is not None and len(base["losses"]) == len(r["losses"]):
            diff.plot(steps, [a - b for a, b in zip(r["losses"], base["losses"])], label=r["strategy"],
                      linewidth=1.0, **style)
    ax.set_ylabel("loss (global batch)")
    ax.set_title("Loss curves (single = thick line)")
    diff.axhline(0.0, color="grey", linewidth=0.8)
    diff.set_ylabel("loss - single's")
    diff.set_xlabel("step")
    diff.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers
    _legend_outside(ax)
    return _save(fig, path)


_LINE_STYLES = [{"marker": m, "linestyle": ls, "markersize": 5}
                for ls in ("-", "--", ":") for m in ("o", "s", "^", "v", "D", "x", "+")]


def _legend_outside(ax: Any) -> None:
    """A legend to the right of the axes: it can never cover a bar or a line."""
    if ax.get_legend_handles_labels()[0]:
        legend = ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0, fontsize=8)
        legend.set_in_layout(False)  # see _save


def predicted_vs_measured(rows: list[dict[str, Any]], path: Path) -> Path:
    rs = [r for r in ok_rows(rows) if "pred_params_bytes" in r]
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(rs) + 2), 4.5))
    x = list(range(len(rs)))
    for offset, (label, prefix) in ((-0.2, ("predicted", "pred_")), (0.2, ("measured", "mem_"))):
        bottom = [0.0] * len(rs)
        for i, cat in enumerate(("params", "grads", "optimizer")):
            key = (lambda c: f"pred_{c}_bytes") if prefix == "pred_" else (lambda c: f"mem_{c}_max_bytes")
            values = [r.get(key(cat), 0) / MIB for r in rs]
            ax.bar([xi + offset for xi in x], values, width=0.38, bottom=bottom, color=f"C{i}",
                   alpha=1.0 if prefix == "mem_" else 0.45, label=f"{cat} ({label})")
            bottom = [b + v for b, v in zip(bottom, values)]
    ax.set_xticks(x, [r["strategy"] for r in rs])
    ax.set_ylabel("MiB, worst rank")
    ax.set_title("Model state: predicted (light, left) vs measured (dark, right)")
    _legend_outside(ax)
    return _save(fig, path)


def make_plots(rows: list[dict[str, Any]], out_dir: Path) -> dict[str, Path]:
    """All pictures; a comparison with no successful run still gets (empty) axes, never an exception."""
    return {
        "memory_per_rank": memory_per_rank(rows, out_dir / "memory_per_rank.png"),
        "step_time": step_time(rows, out_dir / "step_time.png"),
        "comm_bytes": comm_bytes(rows, out_dir / "comm_bytes.png"),
        "loss_curves": loss_curves(rows, out_dir / "loss_curves.png"),
        "predicted_vs_measured": predicted_vs_measured(rows, out_dir / "predicted_vs_measured.png"),
    }
