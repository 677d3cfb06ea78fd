"""DeepSpeed ZeRO's buckets sized from the model, as transformers' "auto" fills them
(transformers/integrations/deepspeed.py, HfTrainerDeepSpeedConfig.trainer_config_finalize). One source for the
training code's DeepSpeed config (strategies/_deepspeed.py) and the estimator (estimate/memory.py, estimate/comm.py,
through estimate/memory.with_model). Pure arithmetic: no torch.

DeepSpeed's own defaults are sized for no model in particular: a reduction bucket of 5e8 elements (2 GB in fp32),
which ZeRO-3 allocates whole at set-up and ZeRO-1/2 at every micro-batch's first reduction, and a ZeRO-3 prefetch of
5e7 elements. What is left at DeepSpeed's default, and why:
- allgather_bucket_size (stage 1 and 2) allocates nothing: the updated partitions are gathered into the parameters'
  own flat buffer, in one all_gather_into_tensor per group where torch has it (DeepSpeed's
  runtime/utils.all_gather_dp_groups); only without it does the size split the gather into calls.
- stage3_param_persistence_threshold, which transformers sets to 10 x hidden: this project keeps 0 (every parameter
  partitioned; strategies/_deepspeed.py says why), so that ZeRO-3 shards what it says and the estimator and the dry
  run are exact about it.
"""

from __future__ import annotations

# zero_optimization's keys that follow the model's width, each with the Setup field the estimator reads it as.
ZERO_BUCKET_FIELDS = {
    "reduce_bucket_size": "zero_reduce_bucket_size",
    "stage3_prefetch_bucket_size": "zero3_prefetch_bucket_size",
}


def zero_bucket_sizes(hidden_size: int) -> dict[str, int]:
    """zero_optimization's bucket sizes, in elements, for a model `hidden_size` wide, under DeepSpeed's names: the
    gradient reduction bucket (every stage) of hidden^2, ZeRO-3's prefetch of 0.9 x hidden^2 (stage 3 only)."""
    if hidden_size < 1:
        raise ValueError(f"hidden_size={hidden_size} must be >= 1 to size DeepSpeed's buckets")
    return {
        "reduce_bucket_size": hidden_size * hidden_size,
        "stage3_prefetch_bucket_size": int(0.9 * hidden_size * hidden_size),
    }
