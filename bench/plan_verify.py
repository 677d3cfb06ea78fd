"""The advisor checked against real runs on this machine: predicted beside measured step time and peak memory.

    python bench/plan_verify.py            # writes the 'plan-verify' section of docs/BENCHMARKS.md

With a fresh profile directory: pass 0 calibrates the cpu profile (matmul FLOP/s at the model's shapes, memory
bandwidth, gloo collectives) and runs `plan.verify` on every strategy layout the search ranks for 2 processes,
then refits the profile's efficiency and per-strategy overheads from those runs. Passes 1..R repeat the same
command with the stored profile: new runs, predicted with what earlier passes measured, as a user's next plan
would be. Per pass: each configuration's step and peak error, and the rank correlation (Spearman) of predicted and
measured step times, over all of them and over the best four predicted (what plan.verify=4 would run).
The issue's targets: step within 35%, peak within 15%, rank correlation >= 0.5.
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

from dist_train.plan.verify import spearman  # noqa: E402

TRAINING = ["model=tiny", "model.hidden_size=256", "train.seq_len=128", "train.global_batch_size=8", "logger=none"]


def command(profiles: Path, out: Path, *, steps: int) -> list[str]:
    return [PYTHON, "launch/plan.py", *TRAINING, "cluster.gpu=cpu", "cluster.gpus_per_node=2", "plan.top=8",
            "plan.verify=8", f"plan.steps={steps}", f"plan.profile_dir={profiles}", f"plan.out_dir={out}",
            "format=json"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--passes", type=int, default=2, help="passes after the calibrating one")
    parser.add_argument("--steps", type=int, default=10, help="steps of each verified run (3 are warm-up)")
    parser.add_argument("--no-write", action="store_true", help="print the tables, leave docs/BENCHMARKS.md alone")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="plan-verify-"))
    profiles = root / "profiles"
    per_run, per_pass = [], []
    for p in range(args.passes + 1):
        proc, seconds = run(command(profiles, root / f"pass{p}", steps=args.steps), timeout=3600)
        verify = json.loads(proc.stdout)["verify"]
        runs = [r for r in verify["runs"] if r["status"] == "ok"]
        steps = [abs(r["error"]["step_s"]) for r in runs]
        peaks = [abs(r["error"]["peak_bytes"]) for r in runs]
        top4 = runs[:4]
        rho4 = spearman([r["predicted"]["step_s"] for r in top4], [r["measured"]["step_s"] for r in top4])
        rho = verify["rank_correlation"]
        ok = len(runs) == len(verify["runs"]) and max(steps) <= 0.35 and max(peaks) <= 0.15 and rho is not None \
            and rho >= 0.5
        per_pass.append([p, "calibrate + verify + refit" if p == 0 else "verify with the stored profile + refit",
                         f"{len(runs)}/{len(verify['runs'])}", f"{100 * max(steps):.0f}%", f"{100 * max(peaks):.0f}%",
                         f"{rho:.2f}" if rho is not None else "n/a", f"{rho4:.2f}" if rho4 is not None else "n/a",
                         ("yes" if ok else "**no**") if p else "(fits what it predicts next)", f"{seconds:.0f}"])
        for r in verify["runs"]:
            m, pr, e = r["measured"], r["predicted"], r["error"]
            per_run.append([p, " ".join(r["overrides"]), f"{1e3 * pr['step_s']:.0f}",
                            f"{1e3 * m['step_s']:.0f}" if m["step_s"] else r["status"],
                            f"{100 * e['step_s']:+.0f}%" if e["step_s"] is not None else "",
                            f"{pr['peak_bytes'] / 2**20:.1f}", f"{m['peak_bytes'] / 2**20:.1f}" if m["peak_bytes"] else "",
                            f"{100 * e['peak_bytes']:+.0f}%" if e["peak_bytes"] is not None else ""])
        print(per_pass[-1], flush=True)
    summary = md_table(["pass", "what", "runs ok", "worst step error", "worst peak error", "rank corr. (all)",
                        "rank corr. (best 4)", "targets met", "wall s"], per_pass)
    detail = md_table(["pass", "configuration", "step pred ms", "measured ms", "error", "peak pred MiB",
                       "measured MiB", "error"], per_run)
    print(summary + "\n\n" + detail)
    if not args.no_write:
        write_section(
            "plan-verify", "The advisor against real runs: predicted and measured step time and peak memory",
            summary + "\n\n" + detail,
            command="python bench/plan_verify.py   # each pass: " + shlex.join(command(Path("P"), Path("OUT"),
                                                                                        steps=args.steps)[1:]),
            note="2 processes (gloo) on this machine, model=tiny at hidden 256 (3.3M parameters), 8 sequences of "
                 "128 tokens a step. Measured step: summary.json's median after the warm-up steps; measured peak: the "
                 "worst rank's peak of live tensors (MemTracker). Predicted peak: the estimator's, plus DeepSpeed's "
                 "reduction bucket for zero3. A step's time on these 2 shared cores moves by up to 20% between "
                 "runs of the same configuration, which is why these targets are a benchmark and not a test.")


if __name__ == "__main__":
    main()
