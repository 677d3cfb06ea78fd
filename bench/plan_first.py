"""The advisor's first answer on this machine, from an empty profile directory, checked against real runs.

    python bench/plan_first.py              # 3 runs; writes the 'plan-first' section of docs/BENCHMARKS.md
    python bench/plan_first.py --runs 1 --no-write

Each run is issue 41's command with a fresh profile directory: launch/plan.py calibrates the cpu profile (products,
memory, gloo's collectives, then short runs of the model under ddp and each strategy family with work of its own,
plan/probe.py), answers, and verifies its best four (plan.verify=4). What is judged is that answer, before
plan.verify's refit: each verified configuration's step time against its measured one, and the rank correlation
(Spearman) of predicted and measured. Targets (issue 41): every step within 25%, Spearman >= 0.8, in every run.
Beside them, what a user acts on: where the advisor's first pick measured among the four, and how far its step is
above the fastest one's.

The same four configurations are then launched once more, the same command (`--no-again` leaves this out): how far
the machine's own second measurement is from its first, and its rank correlation with it, is what no prediction of
the first can be expected to beat.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import PYTHON, md_table, run, write_section  # noqa: E402

from dist_train.plan.cli import PlanOptions  # noqa: E402
from dist_train.plan.verify import spearman  # noqa: E402

TRAINING = ["model=tiny", "model.hidden_size=256", "model.num_layers=4", "train.seq_len=128",
            "train.global_batch_size=16", "logger=none"]

NOTE = ("2 processes (gloo) on this machine's 2 cores. Each run starts from an empty profile directory: "
        "the answer judged is the one calibrated in that run, before plan.verify's refit. Measured step: "
        "summary.json's median after the warm-up steps (plan.steps=10). 'Measured again': the four verified "
        "configurations launched once more right after the plan, the same command, so that the change of "
        "each and the rank correlation of the second measurement with the first show what the machine "
        "itself repeats: a prediction of the first measurement cannot be expected to do better. A step "
        "on these shared cores moves between two launches of the same configuration (that column), which "
        "is why this is a benchmark and not a test.")


def command(profiles: Path, out: Path) -> list[str]:
    return [PYTHON, "launch/plan.py", *TRAINING, "cluster.gpu=cpu", "cluster.gpus_per_node=2", "plan.verify=4",
            f"plan.profile_dir={profiles}", f"plan.out_dir={out}", "format=json"]


def again(overrides: list[str], run_dir: Path) -> float:
    """A verified configuration launched once more as plan.verify launched it: its measured step, in seconds."""
    steps = PlanOptions().steps  # command() leaves plan.steps at its default
    cmd = [PYTHON, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "launch/train.py", *TRAINING,
           f"train.steps={steps}", *overrides, f"hydra.run.dir={run_dir}"]
    run(cmd, timeout=900)  # raises with its output if it fails
    return json.loads((run_dir / "summary.json").read_text())["median_step_s"]


def first_pick(runs: list[dict]) -> str:
    """Where the advisor's first pick (runs[0], best predicted) measured among the verified runs that finished, and
    how much slower its step is than the fastest's: '1 of 4' when it was the fastest."""
    ok = [r["measured"]["step_s"] for r in runs if r["status"] == "ok" and r["measured"]["step_s"]]
    if not runs or runs[0]["status"] != "ok" or not runs[0]["measured"]["step_s"]:
        return f"did not run ({runs[0]['status'] if runs else 'none verified'})"
    mine = runs[0]["measured"]["step_s"]
    place, over = 1 + sum(t < mine for t in ok), mine / min(ok) - 1
    return f"{place} of {len(ok)}" + (f", +{100 * over:.0f}%" if over > 0 else "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3, help="fresh-profile runs, one after another")
    parser.add_argument("--no-write", action="store_true", help="print the tables, leave docs/BENCHMARKS.md alone")
    parser.add_argument("--no-again", action="store_true", help="do not launch the verified configurations again")
    args = parser.parse_args()
    per_run, detail = [], []
    for i in range(args.runs):
        root = Path(tempfile.mkdtemp(prefix="plan-first-"))
        proc, seconds = run(command(root / "profiles", root / "out"), timeout=3600)
        verify = json.loads(proc.stdout)["verify"]
        runs = [r for r in verify["runs"] if r["status"] == "ok"]
        errors = [r["error"]["step_s"] for r in runs]
        rho = verify["rank_correlation"]
        ok = len(runs) == 4 and max(abs(e) for e in errors) <= 0.25 and rho is not None and rho >= 0.8
        first = [r["measured"]["step_s"] for r in runs]
        second = [] if args.no_again else [again(r["overrides"], root / "again" / str(n)) for n, r in enumerate(runs)]
        moved = [(b - a) / a for a, b in zip(first, second)]
        picked = first_pick(verify["runs"])
        rho_again = spearman(first, second) if second else None
        second_of = {id(r): t for r, t in zip(runs, second)}
        per_run.append([i + 1, f"{len(runs)}/{len(verify['runs'])}", ", ".join(f"{100 * e:+.0f}%" for e in errors),
                        f"{100 * max(abs(e) for e in errors):.0f}%", f"{rho:.2f}" if rho is not None else "n/a",
                        "yes" if ok else "**no**", picked, ", ".join(f"{100 * m:+.0f}%" for m in moved) or "-",
                        f"{rho_again:.2f}" if rho_again is not None else "-", f"{seconds:.0f}"])
        for r in verify["runs"]:
            m, pr = r["measured"], r["predicted"]
            detail.append([i + 1, " ".join(r["overrides"]), f"{1e3 * pr['step_s']:.0f}",
                           f"{1e3 * m['step_s']:.0f}" if m["step_s"] else r["status"],
                           f"{100 * r['error']['step_s']:+.1f}%" if r["error"]["step_s"] is not None else "",
                           f"{1e3 * second_of[id(r)]:.0f}" if id(r) in second_of else "-"])
        print(per_run[-1], flush=True)
    summary = md_table(["run", "runs ok", "step error of each (best predicted first)", "worst", "Spearman",
                        "targets met", "first pick: measured place, over the fastest",
                        "measured again: change of each", "Spearman, again against first", "wall s (plan)"], per_run)
    table = md_table(["run", "configuration", "step predicted ms", "measured ms", "error", "measured again ms"],
                     detail)
    print(summary + "\n\n" + table)
    if not args.no_write:
        write_section(
            "plan-first", "The advisor's first answer on this machine, from an empty profile directory",
            summary + "\n\n" + table,
            command="python bench/plan_first.py   # each run: " + shlex.join(command(Path("P"), Path("OUT"))[1:]),
            note=NOTE)


if __name__ == "__main__":
    main()
