"""How step time, per-rank memory and communication grow with the model and with the number of ranks.

    python bench/scaling.py          # writes the 'scaling' section of docs/BENCHMARKS.md and docs/scaling.png

Every strategy at three model sizes (GPT-2, 4 layers, hidden 128 / 256 / 512) on 1, 2 and 4 processes (gloo;
this machine has 2 cores, so 4 processes share them); pipelines need 2 processes or more. Per run: mean step
time, the worst rank's model state (params + grads + optimizer), and collective time and bus bytes per step
(bytes x the nccl-tests bus factor, what a rank's links carry). Then, per strategy, a least-squares fit of
collective time against bus bytes, comm_s = latency + bus_bytes / bandwidth: how its communication grows.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import DOCS, PYTHON, TORCHRUN, md_table, run, write_section  # noqa: E402

from dist_train.telemetry.bandwidth import COMM_OPS, busbw_factor  # noqa: E402

HIDDEN = (128, 256, 512)
PROCS = (1, 2, 4)
STRATEGIES = ("ddp", "fsdp", "zero2", "zero3", "gpipe")


def launch(strategy: str, hidden: int, nproc: int, steps: int, run_dir: Path) -> dict:
    overrides = [f"strategy={strategy}", "logger=none", "model.num_layers=4", f"model.hidden_size={hidden}",
                 "model.num_heads=4", "model.max_seq_len=128", "train.seq_len=128", "train.global_batch_size=8",
                 "train.micro_batch_size=2", f"train.steps={steps}", "telemetry.warmup_steps=2",
                 f"hydra.run.dir={run_dir}"]
    cmd = [*TORCHRUN, f"--nproc_per_node={nproc}", "launch/train.py", *overrides] if nproc > 1 or strategy != "single" \
        else [PYTHON, "launch/train.py", *overrides]
    run(cmd, timeout=1800)
    summary = json.loads((run_dir / "summary.json").read_text())
    ranks = summary["ranks"]
    state = max(sum(r.get(f"memory/{c}_bytes", 0) for c in ("params", "grads", "optimizer")) for r in ranks)
    comm_s = sum(sum(r.get(f"comm/{op}/time_s", 0) for op in COMM_OPS) for r in ranks) / len(ranks)
    bus = max(sum(r.get(f"comm/{op}/bytes", 0) * busbw_factor(op, nproc) for op in COMM_OPS) for r in ranks)
    return {"strategy": strategy, "hidden": hidden, "nproc": nproc, "params": summary["num_params"],
            "step_s": summary["mean_step_s"], "state_bytes": state, "comm_s": comm_s, "bus_bytes": bus}


def fit(points: list[dict]) -> tuple[float, float, float]:
    """(latency s, bandwidth GB/s, R^2) of comm_s = latency + bus_bytes / bandwidth, least squares."""
    xs = [p["bus_bytes"] / 1e9 for p in points]
    ys = [p["comm_s"] for p in points]
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
    latency = my - slope * mx
    ss_tot = sum((y - my) ** 2 for y in ys)
    ss_res = sum((y - latency - slope * x) ** 2 for x, y in zip(xs, ys))
    return latency, (1 / slope if slope > 0 else float("inf")), (1 - ss_res / ss_tot if ss_tot else 1.0)


def plot(points: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    colors = dict(zip(STRATEGIES, plt.rcParams["axes.prop_cycle"].by_key()["color"]))  # one colour a strategy
    for strategy in STRATEGIES:
        for hidden, marker, style in zip(HIDDEN, ("o", "s", "^"), (":", "--", "-")):
            ps = sorted((p for p in points if p["strategy"] == strategy and p["hidden"] == hidden),
                        key=lambda p: p["nproc"])
            if not ps:
                continue
            look = dict(marker=marker, linestyle=style, color=colors[strategy], label=f"{strategy} h{hidden}")
            axes[0].plot([p["nproc"] for p in ps], [p["step_s"] * 1e3 for p in ps], **look)
            axes[1].plot([p["nproc"] for p in ps], [p["state_bytes"] / 2**20 for p in ps], **look)
        ps = [p for p in points if p["strategy"] == strategy and p["nproc"] > 1]
        axes[2].scatter([p["bus_bytes"] / 2**20 for p in ps], [p["comm_s"] * 1e3 for p in ps], label=strategy,
                        color=colors[strategy])
    for ax, (title, ylabel) in zip(axes, (("step time", "ms/step"), ("model state, worst rank", "MiB"),
                                          ("communication", "collective ms/step"))):
        ax.set_title(title)
        ax.set_ylabel(ylabel)
        ax.set_xlabel("processes" if title != "communication" else "bus MiB/step")
        ax.grid(alpha=0.3)
    axes[0].set_xticks(PROCS)
    axes[1].set_xticks(PROCS)
    axes[0].legend(fontsize=6, ncol=2)
    axes[2].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def points_from_table() -> list[dict]:
    """The points of the scaling section's table (as rounded there), for --replot."""
    section = DOCS.read_text().split("<!-- bench:scaling -->", 1)[1].split("<!-- /bench:scaling -->", 1)[0]
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in section.splitlines()
            if line.startswith("| ") and line.count("|") == 8 and not line.startswith("| strategy")]
    sizes = sorted({float(r[1].rstrip("M")) for r in rows})
    return [dict(strategy=r[0], hidden=HIDDEN[sizes.index(float(r[1].rstrip("M")))], nproc=int(r[2]),
                 step_s=float(r[3]) / 1e3, state_bytes=float(r[4]) * 2**20, comm_s=float(r[5]) / 1e3,
                 bus_bytes=float(r[6]) * 2**20) for r in rows]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--replot", action="store_true",
                        help="only redraw docs/scaling.png from the table in docs/BENCHMARKS.md (no training)")
    args = parser.parse_args()
    if args.replot:
        plot(points_from_table(), DOCS.parent / "scaling.png")
        return
    scratch = Path(tempfile.mkdtemp(prefix="dist_train_scaling_"))
    points = []
    for strategy in STRATEGIES:
        for hidden in HIDDEN:
            for nproc in PROCS:
                if strategy == "gpipe" and nproc == 1:
                    continue
                point = launch(strategy, hidden, nproc, args.steps, scratch / f"{strategy}-{hidden}-{nproc}")
                points.append(point)
                print(json.dumps(point), flush=True)
    picture = DOCS.parent / "scaling.png"
    plot(points, picture)
    rows = [[p["strategy"], f"{p['params'] / 1e6:.2f}M", p["nproc"], f"{p['step_s'] * 1e3:.0f}",
             f"{p['state_bytes'] / 2**20:.1f}", f"{p['comm_s'] * 1e3:.1f}", f"{p['bus_bytes'] / 2**20:.1f}"]
            for p in points]
    fits = []
    for strategy in STRATEGIES:
        ps = [p for p in points if p["strategy"] == strategy and p["nproc"] > 1]
        latency, bandwidth, r2 = fit(ps)
        fits.append([strategy, f"{latency * 1e3:.2f}", f"{bandwidth:.2f}", f"{r2:.2f}"])
    body = "\n\n".join([
        md_table(["strategy", "params", "processes", "ms/step", "model state MiB (worst rank)", "collective ms/step",
                  "bus MiB/step"], rows),
        "Fit per strategy over its multi-process runs: collective time = latency + bus bytes / bandwidth. A "
        "negative latency means the points do not sit on one line (4 processes share 2 cores, so time per byte "
        "grows with the process count). For gpipe the send/recv time is mostly a stage waiting for its neighbour "
        "(bubble), which grows with the stages' compute, not with the bytes: its 'bandwidth' is not a link's.",
        md_table(["strategy", "latency ms/step", "effective bandwidth GB/s", "R²"], fits),
        f"![scaling]({picture.name})",
    ])
    write_section("scaling", "Scaling with model size and ranks", body, command=f"python bench/scaling.py --steps {args.steps}")


if __name__ == "__main__":
    main()
