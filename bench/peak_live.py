"""The peak that decides out-of-memory: memory/peak_live_bytes measured beside the categories and the prediction.

    python bench/peak_live.py             # writes the 'peak-live' section of docs/BENCHMARKS.md

Trains a few steps of `model=tiny` per configuration and reads, from summary.json, the worst rank's peak of all
live tensors (torch's MemTracker over one step, on the CPU), the sum of dist_train's categories (params, grads,
optimizer, activations, weight copies), and the estimator's `predicted_memory_bytes.peak_live`.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import PYTHON, TORCHRUN, md_table, run, write_section  # noqa: E402

KIB = 1024
CATEGORIES = ("params", "grads", "optimizer", "activations", "weight_copies", "gathered_params")
# DeepSpeed's reduction bucket of 100,000 elements (dist_train's own is hidden^2, 4,096 for model=tiny: the last case;
# DeepSpeed's default, 5e8, would be 2 GB in fp32 and hide the rest of the peak)
SMALL_BUCKET = "+strategy.extra.zero_optimization.reduce_bucket_size=100000"
# (label, processes, overrides): accumulation is two micro-batches per rank and step at 2 ranks.
CASES = [
    ("single, 4 micro-batches", 0, ["strategy=single"]),
    ("single, 1 micro-batch", 0, ["strategy=single", "train.global_batch_size=2"]),
    ("fsdp, 1 micro-batch", 2, ["strategy=fsdp", "train.global_batch_size=4"]),
    ("fsdp, 2 micro-batches", 2, ["strategy=fsdp"]),
    ("fsdp, 2 micro-batches, reduce_every_microbatch", 2, ["strategy=fsdp", "strategy.reduce_every_microbatch=true"]),
    ("fsdp, 2 micro-batches, reshard_after_forward=false", 2, ["strategy=fsdp", "strategy.reshard_after_forward=false"]),
    ("fsdp, 2 micro-batches, bf16", 2, ["strategy=fsdp", "precision=bf16"]),
    ("ddp, 2 micro-batches", 2, ["strategy=ddp"]),
    ("tp, 4 micro-batches", 2, ["strategy=tp"]),
    ("tp, 1 micro-batch", 2, ["strategy=tp", "train.global_batch_size=2"]),
    ("fsdp_tp tp=2 on 4 ranks, 2 micro-batches", 4, ["strategy=fsdp_tp", "strategy.tp=2"]),
    ("zero1, 2 micro-batches, 100,000-element bucket", 2, ["strategy=zero1", SMALL_BUCKET]),
    ("zero1, 1 micro-batch, bucket of hidden^2", 2, ["strategy=zero1", "train.global_batch_size=4"]),
    ("zero2, 2 micro-batches, 100,000-element bucket", 2, ["strategy=zero2", SMALL_BUCKET]),
    ("zero2, 1 micro-batch, 100,000-element bucket", 2, ["strategy=zero2", SMALL_BUCKET, "train.global_batch_size=4"]),
    # above every parameter of tiny (16,384 elements), below a block (about 54,000): the first reduction still comes
    # before the peak
    ("zero2, 2 micro-batches, 20,000-element bucket", 2,
     ["strategy=zero2", "+strategy.extra.zero_optimization.reduce_bucket_size=20000"]),
    ("zero2, 2 micro-batches, bucket of hidden^2 (4,096 elements)", 2, ["strategy=zero2"]),
    ("zero2, 1 micro-batch, bucket of hidden^2", 2, ["strategy=zero2", "train.global_batch_size=4"]),
    ("zero3, 2 micro-batches, bucket of hidden^2", 2, ["strategy=zero3"]),
    ("zero3, 2 micro-batches, bf16", 2, ["strategy=zero3", "precision=bf16"]),
    # under full checkpointing (tiny's vocabulary makes the loss's backward a large part of the peak)
    ("ddp, 2 micro-batches, full checkpointing", 2, ["strategy=ddp", "train.activation_checkpointing=full"]),
    ("fsdp, 2 micro-batches, full checkpointing", 2, ["strategy=fsdp", "train.activation_checkpointing=full"]),
    ("zero2, 2 micro-batches, full checkpointing", 2, ["strategy=zero2", "train.activation_checkpointing=full"]),
    ("zero3, 2 micro-batches, full checkpointing", 2, ["strategy=zero3", "train.activation_checkpointing=full"]),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="dist_train_peak_live_"))
    rows = []
    for i, (label, nproc, overrides) in enumerate(CASES):
        launcher = [PYTHON] if nproc == 0 else [*TORCHRUN, f"--nproc_per_node={nproc}"]
        run_dir = scratch / str(i)
        run([*launcher, "launch/train.py", "model=tiny", "logger=none", f"train.steps={args.steps}",
             "train.global_batch_size=8", "train.micro_batch_size=2", *overrides, f"hydra.run.dir={run_dir}"])
        out = json.loads((run_dir / "summary.json").read_text())
        worst = max(out["ranks"], key=lambda r: r["memory/peak_live_bytes"])
        live = worst["memory/peak_live_bytes"]
        categories = sum(worst.get(f"memory/{c}_bytes", 0) for c in CATEGORIES)
        parts = ", ".join(f"{k.split('/')[-1][:-len('_bytes')]} {v / KIB:,.0f}" for k, v in worst.items()
                          if k.startswith("memory/peak_live/"))
        predicted = (out.get("predicted_memory_bytes") or {}).get("peak_live")
        rows.append([label, f"{live / KIB:,.0f}", parts, f"{categories / KIB:,.0f}", f"{live / categories - 1:+.1%}",
                     "-" if predicted is None else f"{predicted / KIB:,.0f} ({predicted / live - 1:+.1%})"])
        print(md_table(["case"], [[label]]).splitlines()[-1], rows[-1][1:], flush=True)
    headers = ["run (model=tiny)", "peak of live tensors, KiB", "made of, KiB", "sum of the categories, KiB",
               "peak over the categories", "predicted, KiB (error)"]
    note = ("Worst rank of each run. The categories are what dist_train reports per rank (params, grads, optimizer, "
            "activations, weight copies, ZeRO-3's gathered parameters); the peak of live tensors is torch's "
            "MemTracker over one step, seeded with what the rank holds (memory/peak_live_bytes; its composition in "
            "MemTracker's categories: params sharded and gathered, grads sharded and unsharded, temporaries made in "
            "backward). Predicted: the estimator's predicted_memory_bytes.peak_live, where it models the strategy "
            "(all but the pipelines); '-' where it does not. "
            "DeepSpeed's peak holds its reduction bucket, reduce_bucket_size elements of fp32 allocated whole "
            "(hidden^2 as dist_train sizes it, dist_train/parallel/buckets.py, unless strategy.extra sets it); "
            "larger parameters are reduced outside it.")
    write_section("peak-live", "The peak of all live tensors", md_table(headers, rows),
                  command=f"python bench/peak_live.py --steps {args.steps}", note=note)


if __name__ == "__main__":
    main()
