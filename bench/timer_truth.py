"""Do dist_train's collective timers tell the truth? Bus bandwidth reported during training against a
standalone microbenchmark (bench/collectives.py) of the same message sizes on the same backend.

    python bench/timer_truth.py              # writes the 'timers' section of docs/BENCHMARKS.md

For ddp (all_reduce) and fsdp (all_gather, reduce_scatter), a training run reports each op's bytes, count and
bus bandwidth per step (summary.json, per rank, warm-up left out); the microbenchmark then runs that op alone
at the run's mean message size (bytes / count). Target: within 10%.

Training's bus bandwidth counts the transfer only: a rank's time before the group's last member issued the
same collective, or before its previous collective on that group finished, is reported apart as
`comm/<op>/wait_s` (nccl-tests time after a barrier, one collective at a time).

On a CPU a collective that overlaps computation shares the cores with it, so the microbenchmark also runs
beside a computing thread (`collectives.py --beside-compute`): training's figure should lie between that
and the idle one. The tracker's times are also checked against torch's own records of the same steps
(bench/profile_collectives.py: torch.profiler's gloo events).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import TORCHRUN, last_json, md_table, run, spread, write_section  # noqa: E402
from overhead import dist_train_cmd  # noqa: E402

OPS = {"ddp": ("all_reduce",), "fsdp": ("all_gather", "reduce_scatter")}


def measured(strategy: str, steps: int, run_dir: Path) -> dict[str, dict[str, float]]:
    run(dist_train_cmd(strategy, steps, run_dir))
    ranks = json.loads((run_dir / "summary.json").read_text())["ranks"]
    out = {}
    for op in OPS[strategy]:
        per_rank = [r for r in ranks if r.get(f"comm/{op}/count")]
        count = sum(r[f"comm/{op}/count"] for r in per_rank) / len(per_rank)
        nbytes = sum(r[f"comm/{op}/bytes"] for r in per_rank) / len(per_rank)
        busbw = sum(r[f"comm/{op}/busbw_gbps"] for r in per_rank) / len(per_rank)
        out[op] = {"message_bytes": nbytes / count, "count": count, "busbw_gbps": busbw}
    return out


def against_profiler(strategy: str, ops: tuple[str, ...]) -> list[list[str]]:
    proc, _ = run([*TORCHRUN, "--nproc_per_node=2", "bench/profile_collectives.py", f"--strategy={strategy}",
                   "--steps=10"])
    got = last_json(proc.stdout)
    rows = []
    for op in ops:
        ours, theirs = got["tracker"].get(op), got["profiler"].get(op)
        if ours and theirs:
            # gloo: a reduce-scatter is the clone in the caller's thread, then the all-reduce (see the note)
            seconds = theirs["time_s"] + got["profiler"].get(f"{op}_clone", {}).get("time_s", 0.0)
            rows.append([strategy, op, f"{ours['time_s'] * 1e3:.1f}", f"{ours['transfer_s'] * 1e3:.1f}",
                         f"{seconds * 1e3:.1f}", f"{ours['time_s'] / seconds:.2f}"])
    return rows


def microbenchmark(cases: list[str], iterations: int, *, beside_compute: bool) -> dict[str, float]:
    proc, _ = run([*TORCHRUN, "--nproc_per_node=2", "bench/collectives.py", *cases, f"--iterations={iterations}",
                   *(["--beside-compute"] if beside_compute else [])])
    return {op: got["busbw_gbps"] for op, got in last_json(proc.stdout).items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--iterations", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=3, help="alternating training / microbenchmark pairs")
    args = parser.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="dist_train_timers_"))
    # (strategy, op) -> per repeat: (training's figures, busbw alone, busbw beside a computing thread)
    triples: dict[tuple[str, str], list[tuple[dict[str, float], float, float]]] = {}
    for repeat in range(args.repeats):  # alternate, so that the machine's drift lands on every side
        for strategy, ops in OPS.items():
            ours = measured(strategy, args.steps, scratch / f"{strategy}-{repeat}")
            cases = [f"{op}:{int(ours[op]['message_bytes'])}" for op in ops]
            alone = microbenchmark(cases, args.iterations, beside_compute=False)
            busy = microbenchmark(cases, args.iterations, beside_compute=True)
            for op in ops:
                triples.setdefault((strategy, op), []).append((ours[op], alone[op], busy[op]))
    rows = []
    for (strategy, op), runs in triples.items():
        first = runs[0][0]
        inside = sum(1 for o, alone, busy in runs if busy <= o["busbw_gbps"] <= alone)
        rows.append([strategy, op, f"{first['message_bytes'] / 2**20:.2f} MiB", f"{first['count']:.0f}",
                     f"{statistics.median(o['busbw_gbps'] for o, _, _ in runs):.3f}",
                     f"{statistics.median(a for _, a, _ in runs):.3f}",
                     f"{statistics.median(b for _, _, b in runs):.3f}",
                     spread([o["busbw_gbps"] / alone for o, alone, _ in runs]), f"{inside} of {len(runs)}"])
    header = ["strategy", "op", "mean message", "calls/step", "busbw in training (GB/s)", "busbw alone (GB/s)",
              "busbw beside compute (GB/s)", "training / alone, median [min, max]", "training between the two"]
    print(md_table(header, rows))
    checks = [row for strategy, ops in OPS.items() for row in against_profiler(strategy, ops)]
    body = "\n\n".join([
        md_table(header, rows),
        f"Medians of {args.repeats} alternating rounds (a training run, then the microbenchmark at its mean message "
        "size, alone and beside a thread multiplying matrices). Bus bandwidth in training counts only the transfer: "
        "the time before the group's last member issued the collective, or before this rank's previous collective on "
        "the group finished, is `comm/<op>/wait_s`. A collective that overlaps computation shares the 2 cores with "
        "it: FSDP's prefetched all-gathers and its reduce-scatters in backward do, ddp's single bucket all-reduce "
        "after backward does not.",
        "The tracker against torch.profiler's records of the same training steps (time per step, rank 0):",
        md_table(["strategy", "op", "tracker ms/step", "tracker transfer ms/step", "torch.profiler ms/step",
                  "tracker / profiler"], checks),
        "gloo's profiler event runs from the call to completion, waiting for the peer included, as the tracker's "
        "whole time does. gloo runs a reduce-scatter as an all-reduce of a clone of the whole buffer: the profiler's "
        "figure for it is the clone, made in the caller's thread (`c10d::_reduce_scatter_base_`), plus the "
        "`gloo:all_reduce` events of that buffer (the gradient norm's all-reduce, a functional collective that the "
        "tracker counts but does not time, left out).",
    ])
    cmd = f"python bench/timer_truth.py --steps {args.steps} --iterations {args.iterations} --repeats {args.repeats}"
    write_section("timers", "Timer truth: collective bandwidth in training against a microbenchmark", body, command=cmd)


if __name__ == "__main__":
    main()
