"""What dist_train's telemetry costs: the same training with collective and activation telemetry on and off.

    python bench/telemetry_cost.py           # writes the 'telemetry' section of docs/BENCHMARKS.md

Telemetry must not change what it measures: no synchronisation in the step, so the overlap of communication
with computation stays as it was and the step time does not move (target: <= 3%). Measured two ways, for ddp
and fsdp: end to end (alternating runs of `launch/train.py` with `telemetry.comm` and `telemetry.activations`
true, then false), and interleaved step by step in the same processes (bench/interleaved.py --vs
telemetry-off). Both variants log every 10 steps (the default) and write metrics.jsonl.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import iqr, md_table, paired_parser, run, spread, write_section  # noqa: E402
from overhead import dist_train_cmd, interleaved  # noqa: E402


def end_to_end(strategy: str, *, repeats: int, steps: int, scratch: Path) -> list[float]:
    ratios = []
    for i in range(repeats):
        step_s = {}
        for on in ((True, False) if i % 2 == 0 else (False, True)):
            run_dir = scratch / f"{strategy}-{i}-{on}"
            flag = str(on).lower()
            run([*dist_train_cmd(strategy, steps, run_dir), f"telemetry.comm={flag}", f"telemetry.activations={flag}"])
            step_s[on] = json.loads((run_dir / "summary.json").read_text())["mean_step_s"]
        ratios.append(step_s[True] / step_s[False])
    return ratios


def main() -> None:
    args = paired_parser(__doc__).parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="dist_train_telemetry_"))
    rows = []
    for strategy in args.strategies.split(","):
        e2e = end_to_end(strategy, repeats=args.repeats, steps=args.steps, scratch=scratch)
        inter = interleaved(strategy, iterations=args.iterations, vs="telemetry-off")
        rows.append([strategy, spread(e2e), iqr(inter)])
        print(md_table(["strategy", "end to end", "interleaved"], rows[-1:]), flush=True)
    body = md_table(["strategy", "step time on / off, end to end", "step time on / off, interleaved (median [IQR])"],
                    rows)
    note = (f"Same model and batch as the overhead section. End to end: median [min, max] of {args.repeats} "
            f"alternating pairs of {args.steps}-step runs; interleaved: {args.iterations} paired steps. Target: <= 1.03.")
    cmd = f"python bench/telemetry_cost.py --repeats {args.repeats} --steps {args.steps} --iterations {args.iterations}"
    write_section("telemetry", "Telemetry cost", body, command=cmd, note=note)


if __name__ == "__main__":
    main()
