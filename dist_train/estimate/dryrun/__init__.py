"""The dry run: the real strategy code for one rank of an N-rank job, in one process here, with no GPU.

    python -m dist_train.estimate strategy=fsdp model=70b world_size=1024 dryrun.ranks=[0,1023] format=json

For each asked rank a fresh process (`python -m dist_train.estimate.dryrun`) joins torch's fake process group
(`backend="fake"`: every collective returns at once, with no peer and no data) as that rank of `world_size`, builds
the model under FakeTensorMode (tensors with shapes and no storage: a 70B model costs no memory), assembles the rank
through training's own builder (session.transform_model and attach_neftune: LoRA, activation checkpointing, the
strategy's set-up, NEFTune), and runs one training step. What the rank would hold and send is read
with the same code a training run uses, on the second step (the first makes the optimizer's state): the strategy's model state by category, the collectives the CommTracker
sees, and the peak of all live tensors that torch's MemTracker follows (it works under FakeTensorMode). The figures
use the keys of summary.json's `ranks[]`.

Strategies: ddp, fsdp, hsdp, tp, fsdp_tp, the pipelines (gpipe, 1f1b, pp_dp) and the DeepSpeed ZeRO stages (without offload,
which needs a GPU). The others are refused with one line saying why (NOT_YET). Where the real code reads a value back
after a collective (a pipeline's shape vote, DeepSpeed's order and overflow checks), the collective still runs and the
read-back takes a healthy run's answer (DDP's shape check and bucket regrouping, likewise); each such place is one
function below.
"""

from dist_train.estimate.dryrun.families import DRYRUN_FAMILIES, NOT_YET, supported
from dist_train.estimate.dryrun.rank import run_rank, training_run
from dist_train.estimate.dryrun.rows import dryrun_rows, dryrun_section, run_ranks

__all__ = ["DRYRUN_FAMILIES", "NOT_YET", "dryrun_rows", "dryrun_section", "run_rank", "run_ranks", "supported",
           "training_run"]
