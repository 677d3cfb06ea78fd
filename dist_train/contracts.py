"""The contracts every part of dist_train shares, in one module that imports nothing else of the project.

- Batch: the tokens one rank trains on in one step.
- Runtime: where this process runs (rank, world, device, backend, node), decided once at start-up.
- ModelState: the tensors a rank holds for parameters, gradients and optimizer state (what telemetry counts).
- StepOutput, Strategy, CheckpointIO: what a strategy hands the loop, telemetry and the checkpointer.
- StrategyFamily: how a strategy module registers its names with the registry
  (dist_train/strategies/registry.py).

Everything above this module (config, data, runtime, strategies, telemetry, checkpoint, compare) may import
it; it imports only torch and the standard library, so no import of it can close a cycle.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, ContextManager, Protocol

import torch
from torch import nn

@dataclass
class Batch:
    input_ids: torch.Tensor  # [batch, seq_len] int64
    labels: torch.Tensor  # [batch, seq_len] int64, input_ids shifted by one

    def __len__(self) -> int:
        return self.input_ids.size(0)

    def split(self, size: int) -> list["Batch"]:
        return [Batch(i, l) for i, l in zip(self.input_ids.split(size), self.labels.split(size))]

    def pinned(self) -> "Batch":
        """In page-locked host memory, from which a copy to the GPU can run asynchronously."""
        return Batch(self.input_ids.pin_memory(), self.labels.pin_memory())

    def to(self, device: torch.device) -> "Batch":
        if device.type == "cuda":  # from pinned host memory (pinned here unless the prefetcher did) the
            # copy is asynchronous: it overlaps with what the GPU is still computing
            pinned = self if self.input_ids.is_pinned() else self.pinned()
            return Batch(pinned.input_ids.to(device, non_blocking=True), pinned.labels.to(device, non_blocking=True))
        return self

    @property
    def num_tokens(self) -> int:
        return self.input_ids.numel()


@dataclass(frozen=True)
class Runtime:
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    device: torch.device
    backend: str | None  # None: no process group (strategy=single / dp)
    # How long a collective waits for its peers (runtime.timeout_s); groups created later use it too.
    timeout_s: float = 600.0
    node: str = ""  # this process's node (Slurm's node name, else the host name)
    nodes: tuple[str, ...] = ()  # every rank's node, by rank: which collectives cross nodes

    @property
    def timeout(self) -> timedelta:
        return timedelta(seconds=self.timeout_s)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def has_group(self) -> bool:
        return self.backend is not None

    @property
    def device_type(self) -> str:
        return self.device.type


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The part of `t` this rank stores (a DTensor's local shard, otherwise `t` itself)."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def whole_numel(t: torch.Tensor) -> int:
    """Elements of a parameter as the model sees it: a ZeRO-3 partitioned one (zero.Init) holds none locally and
    carries its whole count as `ds_numel`; a DTensor's numel is already the whole tensor's; QLoRA's packed 4-bit
    weight (bitsandbytes' Params4bit) keeps the unpacked shape in its `quant_state`."""
    state = getattr(t, "quant_state", None)
    if state is not None and getattr(state, "shape", None) is not None:
        return int(torch.Size(state.shape).numel())
    return int(getattr(t, "ds_numel", None) or t.numel())


def full_of(t: Any) -> torch.Tensor:
    """A DTensor's whole tensor. Under fsdp_tp a strided bias is sharded twice on one dimension (FSDP2's
    `_StridedShard(0, 2)` over TP's `_StridedShard(0, 3)`), which `full_tensor()` reassembles in the wrong
    order in torch 2.13 (measured); gathering the outer mesh dimensions first, one at a time, is right."""
    from torch.distributed.tensor import Replicate

    placements = list(t.placements)
    for i in range(len(placements) - 1):
        placements[i] = Replicate()
        t = t.redistribute(placements=placements)
    return t.full_tensor()


def place_like(full: torch.Tensor, current: Any) -> Any:
    """`full` laid out as the DTensor `current` is, each rank keeping its own part (no communication). 1-D (tp,
    fsdp): DTensor does it. 2-D (dp, tp) of fsdp_tp: TP's split on the inner dimension by DTensor, then FSDP2's
    chunk of that by hand, on its dim (0; fsdp_ep's experts split by rows: 1) (DTensor's own scatter of the nested
    placements is wrong too, see `full_of`); ddp_tp's replicas (Replicate on the outer dimension) keep TP's split
    whole, as ep's replicas keep their experts."""
    from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

    mesh = current.device_mesh
    if mesh.ndim == 1:
        return distribute_tensor(full, mesh, current.placements, src_data_rank=None)
    inner = mesh[mesh.mesh_dim_names[1]]
    local = distribute_tensor(full, inner, [current.placements[1]], src_data_rank=None).to_local()
    outer = current.placements[0]
    if type(outer) is not Replicate:
        local = local.chunk(mesh.size(0), dim=outer.dim)[mesh.get_local_rank(0)]
    return DTensor.from_local(local.contiguous(), mesh, current.placements, run_check=False,
                              shape=current.shape, stride=current.stride())


def _storages(tensors: Iterable[torch.Tensor | None]) -> dict[tuple[int, int], tuple[int, torch.dtype]]:
    """The distinct storages behind `tensors` (views of one buffer count once): bytes and dtype of each."""
    seen: dict[tuple[int, int], tuple[int, torch.dtype]] = {}
    for t in _with_scales(tensors):
        t = local_tensor(t)
        if t.device.type == "meta":
            continue
        nbytes = t.numel() * t.element_size()
        try:
            storage = t.untyped_storage()
            # A fake tensor's storage (the dry run's FakeTensorMode) has no data (no address): its handle instead.
            fake = getattr(t, "fake_mode", None) is not None
            key = (storage._cdata if fake else storage.data_ptr(), t.storage_offset())
        except (RuntimeError, NotImplementedError):
            key = (id(t), 0)
        if nbytes >= seen.get(key, (0, t.dtype))[0]:
            seen[key] = (nbytes, t.dtype)
    return seen


def _with_scales(tensors: Iterable[torch.Tensor | None]) -> Iterator[torch.Tensor]:
    """The tensors, and with a quantized weight (bitsandbytes' Params4bit, QLoRA) the scales it is unpacked by."""
    for t in tensors:
        if t is None:
            continue
        yield t
        state = getattr(t, "quant_state", None)
        while state is not None:  # with double quantization the scales are quantized again (state2)
            yield from (v for v in vars(state).values() if isinstance(v, torch.Tensor))
            state = getattr(state, "state2", None)


def tensor_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """Bytes of the distinct storages behind `tensors` (views of one buffer count once)."""
    return sum(n for n, _ in _storages(tensors).values())


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def tensor_bytes_by_dtype(tensors: Iterable[torch.Tensor | None]) -> dict[str, int]:
    """tensor_bytes split by dtype ({"float32": ..., "bfloat16": ...})."""
    out: dict[str, int] = {}
    for nbytes, dtype in _storages(tensors).values():
        out[dtype_name(dtype)] = out.get(dtype_name(dtype), 0) + nbytes
    return out


@dataclass
class ModelState:
    """The tensors a rank holds for each category; strategies know where they live."""

    params: list[torch.Tensor] = field(default_factory=list)
    grads: list[torch.Tensor | None] = field(default_factory=list)
    optimizer: list[torch.Tensor] = field(default_factory=list)
    # An MoE model's experts' part of the three (a torch optimizer's state, keyed by parameter), None where there is
    # none (ZeRO's flat partitions, split by strategies/_deepspeed.py, come as bytes of their own)
    experts: ModelState | None = None

    def bytes(self) -> dict[str, int]:
        out = {
            "memory/params_bytes": tensor_bytes(self.params),
            "memory/grads_bytes": tensor_bytes(self.grads),
            "memory/optimizer_bytes": tensor_bytes(self.optimizer),
        }
        if self.experts is not None:  # memory/expert_params_bytes, memory/expert_grads_bytes, ...
            out.update({k.replace("memory/", "memory/expert_"): v for k, v in self.experts.bytes().items()})
        return out

    def by_dtype(self) -> dict[str, int]:
        """The same bytes split by dtype, as the study notes count them (fp32 master, bf16 weights, fp32
        moments): `memory/by_dtype/<category>/<dtype>_bytes`."""
        out: dict[str, int] = {}
        for category, tensors in (("params", self.params), ("grads", self.grads), ("optimizer", self.optimizer)):
            for dtype, nbytes in tensor_bytes_by_dtype(tensors).items():
                out[f"memory/by_dtype/{category}/{dtype}_bytes"] = nbytes
        return out


@dataclass
class StepOutput:
    """What one optimizer step leaves behind; tensors stay on the device (no sync in the step)."""

    loss_sum: torch.Tensor | None  # sum of this rank's micro-batch mean losses (None: the loss is elsewhere)
    num_microbatches: int  # how many micro-batch losses loss_sum holds
    grad_norm: torch.Tensor | None  # global gradient norm before clipping


class CheckpointIO(Protocol):
    """How a strategy writes and reads its whole training state (model, optimizer, LR schedule, loss scaler)
    into one checkpoint directory, sharded where the strategy is sharded. Every rank calls both."""

    format: str  # recorded in the checkpoint; a strategy resumes only from a format it reads

    def save(self, directory: Path, *, background: bool, group: Any = None) -> Future | None:
        """Write into `directory`. background=True may return a Future that completes once every rank's part
        is written (the caller must not change `directory` before); `group`: the process group to use then."""

    def load(self, directory: Path) -> None: ...


class Strategy(Protocol):
    name: str

    def setup(self, model: nn.Module) -> None:
        """Wrap/shard/split `model` (built on the CPU, identical on every rank) and build the optimizer."""

    def empty_model_context(self) -> ContextManager[Any]:
        """Where a model is built without weights when this strategy's config `loads_own_shard` (the meta device,
        DeepSpeed's zero.Init); `setup` then has each rank fill only what it holds (StrategyContext.materialize)."""

    def train_step(self, batch: Batch) -> StepOutput:
        """One optimizer step over this rank's share of the global batch."""

    def eval_step(self, batch: Batch) -> StepOutput:
        """The loss of this rank's share of a held-out global batch: forward only, no gradient, the model in eval
        mode; `loss_sum` None where this rank computes no loss (a pipeline's earlier stages)."""

    def model_state(self) -> ModelState:
        """The parameters, gradients and optimizer state this rank holds (local shards only)."""

    def state_dict(self) -> dict[str, Any]:
        """{"model": ..., "optimizer": ...} in the layout torch.distributed.checkpoint saves (sharded where sharded)."""

    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def checkpoint_io(self) -> CheckpointIO:
        """The on-disk checkpoint format of this strategy (torch.distributed.checkpoint, DeepSpeed's own)."""

    @property
    def lr(self) -> float: ...

    @property
    def devices(self) -> list[torch.device]:
        """Devices whose memory this rank should report (several for nn.DataParallel)."""

    def extra_metrics(self) -> dict[str, float]:
        """Strategy-specific figures of the window just closed (e.g. `pipeline/bubble_fraction`); {} if none.

        Called once per logging window on every rank, after the window's steps; keys carry a prefix.
        """



@dataclass(frozen=True)
class StrategyFamily:
    """One strategy module's registration: its schema, the names it answers to and how to build it.

    `names` maps every `strategy=<name>` of the family to the schema values that name implies (Lightning's
    `register_strategies` does the same: `zero3` -> stage=3); conf/strategy/<name>.yaml sets the same values,
    and tests/unit/test_structure.py checks that they agree.
    """

    family: str  # the schema's name in Hydra's ConfigStore: conf/strategy/*.yaml extend /schema/strategy/<family>
    schema: type  # the config dataclass (a dist_train.config.StrategyConfig)
    names: Mapping[str, Mapping[str, Any]]
    build: Callable[[Any, Any], "Strategy"]  # build(cfg, ctx) -> Strategy

    def config(self, name: str) -> Any:
        """The schema instance `strategy=<name>` gets before any override."""
        return self.schema(name=name, **self.names[name])
