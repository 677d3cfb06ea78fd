"""How long the advisor takes to answer for Llama 2 7B and 70B on 8 to 1,024 H100s.

    python bench/plan_speed.py            # writes the 'plan-speed' section of docs/BENCHMARKS.md

Runs `python launch/plan.py model=<7b|70b> precision=bf16 train.seq_len=4096 train.global_batch_size=<B>
cluster.gpu=h100 cluster.nodes=<N> format=json` (the whole command: Python start, config composition, search,
training's own checks of the best five) and tabulates its wall time, how many configurations it searched and ranked,
and its best answer. The target: under a minute each.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import PYTHON, ROOT, env, md_table, write_section  # noqa: E402

CASES = [("7b", 256, 1), ("7b", 256, 16), ("7b", 1024, 128), ("70b", 512, 1), ("70b", 512, 16), ("70b", 1024, 128)]


def command(model: str, batch: int, nodes: int) -> list[str]:
    return [PYTHON, "launch/plan.py", f"model={model}", "precision=bf16", "train.seq_len=4096",
            f"train.global_batch_size={batch}", "cluster.gpu=h100", f"cluster.nodes={nodes}", "format=json",
            "logger=none"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-write", action="store_true", help="print the table, leave docs/BENCHMARKS.md alone")
    args = parser.parse_args()
    rows = []
    for model, batch, nodes in CASES:
        start = time.perf_counter()
        proc = subprocess.run(command(model, batch, nodes), cwd=ROOT, env=env(), capture_output=True, text=True,
                              timeout=600)
        seconds = time.perf_counter() - start
        if proc.returncode not in (0, 1):  # 1: the plan ran and nothing fits, an answer too
            raise RuntimeError(f"{shlex.join(command(model, batch, nodes))} failed:\n{proc.stderr[-3000:]}")
        out = json.loads(proc.stdout)
        best = out["candidates"][0] if out["candidates"] else None
        answer = "nothing fits" if best is None else (
            f"{' '.join(best['overrides'])}: {best['predicted']['step_s']:.2f} s/step, "
            f"{100 * best['predicted']['mfu']:.0f}% MFU, {best['predicted']['peak_bytes'] / 2**30:.1f} GiB")
        rows.append([model, nodes * 8, batch, f"{seconds:.1f}", out["searched"], out["ranked"], answer])
        print(rows[-1], flush=True)
    table = md_table(["model", "H100s", "global batch", "wall s", "searched", "fit and run", "best (predicted)"], rows)
    print(table)
    if not args.no_write:
        write_section("plan-speed", "The advisor's answer time, 7B and 70B on 8 to 1,024 H100s", table,
                      command="python bench/plan_speed.py   # each case: " + shlex.join(command("70b", 512, 16)[1:]),
                      note="Datasheet H100 profile (dist_train/estimate/hardware.py): its peaks, and assumed interconnect "
                           "and efficiency figures never checked on a GPU. The answers are predictions.")


if __name__ == "__main__":
    main()
