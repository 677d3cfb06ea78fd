"""What only a GPU shows: one command for a CUDA machine.

    python bench/gpu_check.py                  # writes the 'gpu' section of docs/BENCHMARKS.md
    python bench/gpu_check.py --steps 10 --skip-tests

1. Single-GPU training of the ~1B Llama-shaped model (`model=llama_1b`, 1.50B parameters untied) in bf16, its
   blocks compiled (`train.compile`; `--no-compile` for eager) and AdamW fused:
   tokens/s, MFU against the GPU's bf16 peak (dist_train's datasheet table), CUDA allocator peaks, and memory
   by category, predicted (python -m dist_train.estimate) beside measured.
2. The test-suite subset that needs CUDA (`pytest tests/launched/test_cuda.py`): NCCL collectives timed with CUDA
   events, allocator peaks reported, `dp` across GPUs where there are several, the ZeRO offload configs.

Without a CUDA device it runs nothing, says what it could not run, and exits 0 without touching the docs.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import PYTHON, ROOT, env, md_table, run, write_section  # noqa: E402

sys.path.insert(0, str(ROOT))
from dist_train.estimate.memory import EAGER_ONLY, predicted_categories  # noqa: E402

NOT_RUN = [
    "single-GPU bf16 training of model=llama_1b: tokens/s, MFU, CUDA allocator peaks, predicted vs measured memory",
    "tests/launched/test_cuda.py: NCCL collectives timed by CUDA events, allocator peaks, dp across GPUs, "
    "offload configs",
]


def train(args: argparse.Namespace, run_dir: Path) -> dict:
    cmd = [PYTHON, "launch/train.py", "strategy=single", "model=llama_1b", "precision=bf16", "logger=none",
           f"train.seq_len={args.seq_len}", f"train.micro_batch_size={args.micro_batch}",
           f"train.global_batch_size={args.micro_batch * args.accumulation}", f"train.steps={args.steps}",
           f"train.activation_checkpointing={args.checkpointing}",
           "telemetry.warmup_steps=3", f"train.compile={str(args.compile).lower()}", f"hydra.run.dir={run_dir}"]
    run(cmd, timeout=3600)
    return json.loads((run_dir / "summary.json").read_text())


def predicted(args: argparse.Namespace) -> dict:
    proc, _ = run([PYTHON, "-m", "dist_train.estimate", "strategy=single", "model=llama_1b", "precision=bf16",
                   f"train.seq_len={args.seq_len}", f"train.micro_batch_size={args.micro_batch}",
                   f"train.global_batch_size={args.micro_batch * args.accumulation}",
                   f"train.activation_checkpointing={args.checkpointing}", "world_size=1", "format=json"])
    return json.loads(proc.stdout)["memory_per_rank"][0]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--accumulation", type=int, default=2)
    parser.add_argument("--skip-tests", action="store_true")
    parser.add_argument("--checkpointing", choices=("none", "full", "selective"), default="none",
                        help="train.activation_checkpointing")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True,
                        help="train.compile: torch.compile each block (the MFU target reaches for it)")
    args = parser.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device is visible; nothing was run. Not measured:", file=sys.stderr)
        for item in NOT_RUN:
            print(f"  - {item}", file=sys.stderr)
        return 0
    summary = train(args, Path(tempfile.mkdtemp(prefix="gpu_check_")))
    rank = summary["ranks"][0]
    pred = predicted(args)
    gib = 2**30
    # under compiled blocks inductor decides what is saved for backward: the eager activation formula does not
    # apply, and those rows are shown measured only (as the comparison report does)
    spoken_for = predicted_categories({"compile": args.compile})

    def row(label: str, predicted_bytes: float | None, measured_bytes: float) -> list[str]:
        if predicted_bytes is None:
            return [label, "(compiled: not predicted)", f"{measured_bytes / gib:.2f}", ""]
        error = f"{(predicted_bytes - measured_bytes) / measured_bytes:+.1%}" if measured_bytes else ""
        return [label, f"{predicted_bytes / gib:.2f}", f"{measured_bytes / gib:.2f}", error]

    rows = [row(cat, pred.get(cat, 0) if cat in spoken_for else None, rank.get(f"memory/{cat}_bytes", 0))
            for cat in ("params", "grads", "optimizer", "activations", "weight_copies")]
    # the allocator's peak against the estimator's peak of live tensors (the loss's backward temporaries and the
    # recomputation beside the categories), not against the categories' sum
    rows.append(row("peak allocated (CUDA) against the predicted peak of live tensors",
                    pred.get("peak_live") if set(EAGER_ONLY) <= set(spoken_for) else None,
                    rank.get("memory/peak_allocated_bytes", 0)))
    mfu = summary.get("mfu")
    body = "\n\n".join([
        md_table(["figure", "value"], [
            ["tokens/s", f"{summary['tokens_per_s']:,.0f}"], ["mean step (s)", f"{summary['mean_step_s']:.3f}"],
            ["MFU", f"{mfu:.1%}" if mfu else "(no peak FLOP/s known for this GPU: telemetry.peak_flops=...)"],
        ]),
        md_table(["memory (GiB)", "predicted", "measured", "(pred - meas) / meas"], rows),
    ])
    tests = "not run (--skip-tests)"
    if not args.skip_tests:
        proc = subprocess.run([PYTHON, "-m", "pytest", "-q", "tests/launched/test_cuda.py"], cwd=ROOT, env=env(),
                              capture_output=True, text=True)
        tests = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else proc.stderr[-500:]
        print(proc.stdout[-3000:])
    cmd = (f"python bench/gpu_check.py --steps {args.steps} --seq-len {args.seq_len} --micro-batch {args.micro_batch} "
           f"--accumulation {args.accumulation}{'' if args.compile else ' --no-compile'}"
           + (f" --checkpointing {args.checkpointing}" if args.checkpointing != "none" else ""))
    write_section("gpu", "GPU check", body + f"\n\nCUDA tests: {tests}", command=cmd)
    return 0


if __name__ == "__main__":
    sys.exit(main())
