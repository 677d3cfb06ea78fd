"""The bad inputs every entry point is tried with, and the one line each must print: the table that
tests/launched/test_bad_input.py launches and tests/unit/test_bad_input.py finds in docs/troubleshooting.md's
"Bad input the tests try"."""

from __future__ import annotations

TRAIN, ESTIMATE, COMPARE, EXPORT = "launch/train.py", "-m dist_train.estimate", "launch/compare.py", "launch/export.py"

# (entry point, arguments, what the one line must say). {ckpt}: a complete single-process checkpoint (step 2);
# {partial}: the same without its COMPLETE marker; {zero}: one whose marker says DeepSpeed's format.
CASES = [
    (TRAIN, "train.lr=-1", "train.lr=-1.0 must be > 0"),
    (TRAIN, "strategy=banana", "strategy=banana is not an option (no conf/strategy/banana.yaml); available: 1f1b,"),
    (TRAIN, "train.lr=abc", "train.lr=abc; Value 'abc' of type 'str' could not be converted to Float"),
    (TRAIN, "train.nokey=1", "Could not override 'train.nokey'; Key 'nokey' not in 'TrainConfig'"),
    (TRAIN, "train.step=2",
     "Could not override 'train.step'; Key 'step' not in 'TrainConfig'; did you mean train.steps?"),
    (TRAIN, "nonsense", "Error parsing override 'nonsense'"),
    (TRAIN, "train.global_batch_size=7", "train.global_batch_size=7 must be divisible by train.micro_batch_size"),
    (TRAIN, "strategy=gpipe", "strategy=gpipe needs at least 2 processes"),
    (TRAIN, "strategy=fsdp_tp",
     "strategy.tp=2 must divide the number of processes (1): the mesh is (data-parallel 1/2) x (tensor-parallel 2); "
     "started without a launcher, this is one process: torchrun"),
    (TRAIN, "checkpoint.every_steps=-1", "checkpoint.every_steps=-1 must be >= 0"),
    (TRAIN, "checkpoint.resume=/nonexistent", "checkpoint.resume=/nonexistent: no such file or directory"),
    (TRAIN, "checkpoint.resume={partial}", "is incomplete (no COMPLETE marker: its save was interrupted)"),
    (TRAIN, "checkpoint.resume={ckpt} model.hidden_size=32", "model.hidden_size: saved 64, now 32"),
    (TRAIN, "checkpoint.resume={zero}", "was written by strategy=zero2 (deepspeed format); strategy=ddp reads"),
    (TRAIN, "DIST_TRAIN_FAULT=boom", "DIST_TRAIN_FAULT='boom' is not <kind>@<step>[:rank<r>]"),
    (TRAIN, "runtime.timeout_s=0", "runtime.timeout_s=0.0 must be > 0"),
    (TRAIN, "strategy=zero2 precision=fp16", "strategy=zero2 with precision=fp16 needs a GPU"),
    (ESTIMATE, "optimizer=adam", "optimizer=adam is not an option (no conf/optimizer/adam.yaml); available: adafactor, adam8bit, adamw"),
    (ESTIMATE, "world_size=x", "world_size: Value 'x' of type 'str' could not be converted to Integer"),
    (ESTIMATE, "model.hidden_size=-1", "model.hidden_size=-1 must be >= 1"),
    (COMPARE, "compare.nproc=x", "compare.nproc: Value 'x' of type 'str' could not be converted to Integer"),
    (COMPARE, "compare.bogus=1", "compare.bogus: Key 'bogus' not in 'CompareConfig'"),
    (COMPARE, "train.lr=abc", "train.lr=abc; Value 'abc' of type 'str' could not be converted to Float"),
    (EXPORT, "/nonexistent out", "checkpoint=/nonexistent: no such file or directory"),
    (EXPORT, "", "the following arguments are required: checkpoint, out_dir"),
]
