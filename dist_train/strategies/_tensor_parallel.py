"""TPStrategy: a TorchStrategy for tensor-parallel models (tp, fsdp_tp). The parallelism itself is applied by
dist_train/parallel/tensor_parallel.py. Imported only by a run that uses it (DTensor is slow to import)."""

from __future__ import annotations

from typing import Any

from torch.distributed.tensor.parallel import loss_parallel

from dist_train.contracts import Batch, StepOutput
from dist_train.parallel.tensor_parallel import contiguous, like
from dist_train.strategies.torch_strategy import TorchStrategy


class TPStrategy(TorchStrategy):
    """A TorchStrategy whose logits stay split by vocabulary, and whose state dicts hold GPT-2's fused q/k/v
    shards as plain column blocks.

    The cross-entropy of the vocabulary-split logits runs under torch's `loss_parallel` (forward and backward):
    each rank computes on its slice, never the whole logits.

    torch.distributed.checkpoint writes each rank's shard as one contiguous chunk of the global tensor, which
    a `_StridedShard` (a rank's q, k and v columns) is not; on save those tensors are laid out `Shard(dim)`
    (same global values: any strategy can read them), on load put back. One tensor at a time is gathered."""

    def train_step(self, batch: Batch) -> StepOutput:
        with loss_parallel():
            return super().train_step(batch)

    def eval_step(self, batch: Batch) -> StepOutput:
        with loss_parallel():
            return super().eval_step(batch)

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        return {k: ({n: contiguous(t) for n, t in v.items()} if isinstance(v, dict) else v) for k, v in state.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(like(state, super().state_dict()))
