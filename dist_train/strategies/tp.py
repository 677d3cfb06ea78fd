"""Tensor parallelism (Megatron-style) on DTensor: every rank holds a slice of each block's matmul weights.

Per block, attention's query/key/value projection and the MLP's first projection are split by output
column (each rank computes its own heads and its own slice of the intermediate), attention's output
projection and the MLP's second projection by input row; the partial outputs of the row-parallel
projections are summed by one all-reduce each in forward, and the gradients of the column-parallel inputs
by one all-reduce each in backward. Everything else (embeddings, norms, the head, row-parallel biases) is
replicated: a `Replicate` DTensor, so one optimizer and one gradient norm cover all parameters.

Every rank sees the whole batch (data-parallel size 1): the ranks of a TP group compute one model together.

- Llama (`nn.Linear`): torch's `ColwiseParallel` / `RowwiseParallel` on q/k/v, gate/up and o, down.
- GPT-2 (transformers' `Conv1D`, weight stored as in x out): the same two styles, with the weight's split
  dimension swapped. Its query/key/value projection is one fused `c_attn` whose output is [q | k | v]: a rank
  must hold its heads of each of the three, which `_StridedShard(1, split_factor=3)` describes (rank r holds
  columns r of q, r of k and r of v), so the full tensor keeps transformers' layout. That projection runs on
  the local shard, with DTensor doing its backward all-reduce.

The machinery lives in `_tensor_parallel.py`, imported only by a tp run (DTensor is slow to import).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, ContextManager

import torch
from torch import nn

from dist_train.config import RunConfig, StrategyConfig, require
from dist_train.contracts import StrategyFamily
from dist_train.strategies.base import StrategyContext
from dist_train.strategies.torch_strategy import TorchStrategy


@dataclass
class TPConfig(StrategyConfig):
    """Tensor parallelism across all processes (TP degree = world size, data-parallel size 1)."""

    name: str = "tp"

    def data_parallel_size(self, world_size: int) -> int:
        return 1

    def check_run(self, run: RunConfig, world_size: int) -> None:
        super().check_run(run, world_size)
        m = run.model
        require(m.arch in ("gpt2", "llama"), f"strategy=tp supports model.arch gpt2 or llama, not {m.arch}")
        kv = m.num_kv_heads or m.num_heads
        ffn = m.ffn_hidden_size or 4 * m.hidden_size
        for field, value in (("num_heads", m.num_heads), ("num_kv_heads", kv), ("ffn_hidden_size", ffn)):
            require(
                value % world_size == 0,
                f"strategy=tp splits model.{field}={value} across {world_size} processes: it must be divisible "
                f"by the number of processes",
            )


class TPWrapper:
    def __init__(self, cfg: TPConfig, ctx: StrategyContext) -> None:
        self.cfg, self.ctx = cfg, ctx

    def wrap(self, model: nn.Module) -> nn.Module:
        from torch.distributed.device_mesh import init_device_mesh

        from dist_train.strategies._tensor_parallel import parallelize

        rt = self.ctx.runtime
        mesh = init_device_mesh(rt.device.type, (rt.world_size,), mesh_dim_names=("tp",))
        return parallelize(model.to(rt.device), mesh, arch=model.config.model_type)

    def no_sync(self, wrapped: nn.Module) -> ContextManager[Any]:
        return contextlib.nullcontext()  # no data parallelism: no gradient sync to hold back

    def devices(self) -> list[torch.device]:
        return [self.ctx.runtime.device]


class TPStrategy(TorchStrategy):
    """A TorchStrategy whose state dicts hold GPT-2's fused q/k/v shards as plain column blocks.

    torch.distributed.checkpoint writes each rank's shard as one contiguous chunk of the global tensor, which
    a `_StridedShard` (a rank's q, k and v columns) is not; on save those tensors are laid out `Shard(dim)`
    (same global values: any strategy can read them), on load put back. One tensor at a time is gathered."""

    def state_dict(self) -> dict[str, Any]:
        from dist_train.strategies._tensor_parallel import contiguous

        state = super().state_dict()
        return {k: ({n: contiguous(t) for n, t in v.items()} if isinstance(v, dict) else v) for k, v in state.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        from dist_train.strategies._tensor_parallel import like

        super().load_state_dict(like(state, super().state_dict()))


def build(cfg: TPConfig, ctx: StrategyContext) -> TorchStrategy:
    return TPStrategy(cfg.name, ctx, TPWrapper(cfg, ctx))


FAMILY = StrategyFamily(family="tp", schema=TPConfig, names={"tp": {}}, build=build)
