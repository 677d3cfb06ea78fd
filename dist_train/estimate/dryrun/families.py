"""Which strategies the dry run covers, and why the others are refused (one line each)."""

from __future__ import annotations

# Strategy families whose set-up and step run under a fake process group and FakeTensorMode (tested at world
# sizes 2 and 4 against real gloo runs: tests/launched/test_dryrun.py; fsdp_ep and ep, which the estimator models as
# fsdp and as ddp_tp's replicas at tp 1, and an MoE model under ddp: tests/launched/test_moe.py). MoE tokens are
# routed balanced there (fake.py).
DRYRUN_FAMILIES = ("ddp", "fsdp", "tp", "fsdp_tp", "pipeline", "zero")
# Why the others do not run there yet (each found by trying it).
NOT_YET = {
    "dp": "nn.DataParallel is one process",
    "single": "one process: the estimator and a real run need no dry run",
    "accelerate": "Accelerate prepares the model with real tensors",
}


def supported(family: str, strategy: str, *, experts_implementation: str = "eager", num_experts: int = 0) -> str | None:
    """None when the dry run covers this strategy and model, else why not (one line)."""
    if num_experts and experts_implementation != "eager":
        return (f"model.experts_implementation={experts_implementation}: the dry run routes tokens through the eager "
                "experts loop only (its balanced stand-in, estimate/dryrun/fake.py); the estimator alone still "
                "predicts it (drop dryrun.ranks)")
    if family in DRYRUN_FAMILIES:
        return None
    why = NOT_YET.get(family, "not tried yet")
    return (f"strategy={strategy}: the dry run covers {', '.join(DRYRUN_FAMILIES)} so far ({why}); "
            "the estimator alone still predicts it (drop dryrun.ranks)")
