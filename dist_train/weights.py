"""Where a model's weights come from, and how each rank takes only the part it holds.

Two sources, one interface (`WeightSource`): a model directory's files (`pretrained.ModelDir`), and `SeededInit`,
the random init drawn block by block from the run's seed. Both hand out tensors by name, one unit at a time (a
file, or a block), so a rank filling its shard holds its shard plus one unit, never the whole model.

`materialize` fills a model built without storage (`build_model(empty=...)`), after the strategy has sharded or
split it: a model on meta (FSDP2 and TP DTensors, a pipeline stage's own layers, or a whole model) gets storage
and its values (`_fill_meta`); a model built under DeepSpeed's zero.Init gets its ZeRO-3 partitions
(`_fill_partitions`).
"""

from __future__ import annotations

import copy
import functools
import hashlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from dist_train.contracts import local_tensor, place_like

# Names that wrappers put inside a parameter's name and that the files (and the unwrapped model) do not have:
# activation checkpointing's wrapper (its state dict hooks drop it, `named_parameters` does not).
_WRAPPER_PARTS = ("._checkpoint_wrapped_module",)


class WeightSource:
    """Tensors by name, read one unit at a time. A subclass gives `locations` ({tensor name: its unit}) and
    `_open_unit(unit)`: a handle with safetensors' `get_slice`/`get_tensor`, or a mapping of name to tensor."""

    locations: dict[str, Any]

    def _open_unit(self, unit: Any) -> Any:
        raise NotImplementedError

    @functools.cached_property
    def _handles(self) -> dict[Any, Any]:
        return {}

    def _handle(self, unit: Any) -> Any:
        """Each unit opened once, until `by_unit` moves past it."""
        if unit not in self._handles:
            self._handles[unit] = self._open_unit(unit)
        return self._handles[unit]

    def by_unit(self, targets: dict[str, tuple[str, Any]]) -> Iterator[tuple[str, str, Any]]:
        """`targets` ({name: (name in the source, tensor)}) one unit at a time, each unit dropped once its tensors
        are read: what the source holds at once (a file's mapped pages, a drawn block) stays within one unit."""
        order = sorted(targets.items(), key=lambda item: str(self.locations[item[1][0]]))
        current = None
        for name, (source, tensor) in order:
            unit = self.locations[source]
            if current is not None and unit != current:
                self._handles.pop(current, None)
            current = unit
            yield name, source, tensor
        if current is not None:
            self._handles.pop(current, None)

    def read(self, name: str, start: int | None = None, stop: int | None = None) -> torch.Tensor:
        """Tensor `name`, or only its rows [start, stop) (dim 0): from safetensors, only those bytes are read."""
        return self._read(self.locations[name], name, start, stop)

    def _read(self, unit: Any, name: str, start: int | None = None, stop: int | None = None) -> torch.Tensor:
        handle = self._handle(unit)
        if start is None:
            return handle.get_tensor(name) if hasattr(handle, "get_tensor") else handle[name]
        return handle.get_slice(name)[start:stop] if hasattr(handle, "get_slice") else handle[name][start:stop]


class StackedExperts(WeightSource):
    """A model directory whose files hold each expert of an MoE layer apart (transformers' save_pretrained:
    `mlp.experts.3.gate_proj.weight`, Mixtral's `block_sparse_moe.experts.3.w1.weight`), read as the built model
    stacks them (`mlp.experts.gate_up_proj`, E x 2I x h; `mlp.experts.down_proj`, E x h x I): transformers' own
    conversion for the architecture (its WeightRenamings, and its WeightConverters that stack the experts,
    MergeModulelist on dim 0, then Concatenate on dim 1 for gate and up), applied as each tensor is read. Rows
    [start, stop) of a stacked tensor are experts start to stop - 1: a rank reads only its experts' tensors."""

    def __init__(self, source: WeightSource, mapping: list[Any]) -> None:
        import re

        self.source = source
        renames = [(a, b) for t in mapping if type(t).__name__ == "WeightRenaming"
                   for a, b in zip(t.source_patterns, t.target_patterns)]
        stacks = [t for t in mapping if type(t).__name__ == "WeightConverter" and _stacks_experts(t)]
        self.saved: dict[str, str] = {}  # the model's name of each saved tensor that is not an expert's
        self.stacked: dict[str, list[dict[int, str]]] = {}  # stacked name -> per source pattern, expert -> saved
        patterns = [(conv, k, re.compile("^(.*)" + re.escape(p).replace(r"\*", r"(\d+)") + "$"))
                    for conv in stacks for k, p in enumerate(conv.source_patterns)]
        for saved in source.locations:
            name = saved
            for a, b in renames:
                name = name.replace(a, b)
            for conv, k, pattern in patterns:
                found = pattern.match(name)
                if found:
                    target = found.group(1) + conv.target_patterns[0]
                    parts = self.stacked.setdefault(target, [{} for _ in conv.source_patterns])
                    parts[k][int(found.group(2))] = saved
                    break
            else:
                self.saved[name] = saved
        self.locations = {name: source.locations[saved] for name, saved in self.saved.items()}
        self.locations.update({name: source.locations[parts[0][min(parts[0])]] for name, parts in self.stacked.items()})

    def _open_unit(self, unit: Any) -> Any:
        return self.source._open_unit(unit)

    def read(self, name: str, start: int | None = None, stop: int | None = None) -> torch.Tensor:
        if name not in self.stacked:
            return self._read(self.locations[name], self.saved[name], start, stop)
        parts = self.stacked[name]
        experts = sorted(parts[0])[start:stop]
        stacked = [torch.stack([self._read(self.source.locations[p[e]], p[e]) for e in experts]) for p in parts]
        for unit in [u for u in self._handles if u != self.locations[name]]:  # other files its experts were in:
            self._handles.pop(unit)  # by_unit holds one unit at a time, the one it files this name under
        return torch.cat(stacked, dim=1) if len(stacked) > 1 else stacked[0]


def _stacks_experts(converter: Any) -> bool:
    """A WeightConverter that stacks one tensor per expert (MergeModulelist on dim 0), then joins gate and up
    (Concatenate on dim 1): the only conversion StackedExperts does."""
    ops = [(type(op).__name__, getattr(op, "dim", None)) for op in converter.operations]
    single = all(p.count("*") == 1 for p in converter.source_patterns) and len(converter.target_patterns) == 1
    return single and ops in ([("MergeModulelist", 0)], [("MergeModulelist", 0), ("Concatenate", 1)])


def experts_stacked(source: WeightSource, model_type: str) -> WeightSource:
    """`source` read as an MoE model of `model_type` stacks its experts, where its files hold them apart and
    transformers has a conversion for it; `source` itself otherwise."""
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping

    mapping = get_checkpoint_conversion_mapping(model_type) or []
    stacked = StackedExperts(source, mapping)
    return stacked if stacked.stacked else source


def unit_seed(seed: int, unit: str) -> int:
    """The seed of one unit's draw: a hash of the run's seed and the unit's name, the same on every rank."""
    return int.from_bytes(hashlib.sha256(f"{seed}/{unit}".encode()).digest()[:8], "little") >> 1


class SeededInit(WeightSource):
    """One random init, drawn block by block, that every strategy shares whatever it shards or splits.

    The units are the transformer blocks and every other module that holds tensors of its own (the embeddings,
    the final norm, the head). Each is made on the CPU on its own and initialised by the architecture's own
    `_init_weights` (GPT-2's scaled residual projections, Gemma's norms, ...), in the order `nn.Module.apply`
    visits it, with the global generator seeded from (seed, the unit's name) and restored afterwards. So a
    tensor's values depend only on the seed and its name, not on which rank draws it or what else that rank
    holds: the same weights for one process, for an FSDP rank's rows, a pipeline stage's layers or a ZeRO-3
    partition, with one block held at a time.

    reference: the whole model, built on the meta device (no storage); blocks: its transformer blocks."""

    def __init__(self, reference: nn.Module, seed: int, *, blocks: list[nn.Module]) -> None:
        self.reference, self.seed = reference, seed
        names = {id(m): n for n, m in reference.named_modules()}
        in_blocks = {id(m) for b in blocks for m in b.modules()}
        self.units: dict[str, tuple[nn.Module, bool]] = {names[id(b)]: (b, True) for b in blocks}
        for name, module in reference.named_modules():
            own = next(module.parameters(recurse=False), None) is not None or next(module.buffers(recurse=False), None) is not None
            if own and id(module) not in in_blocks:
                self.units[name] = (module, False)
        owner = {}
        for unit, (module, whole) in self.units.items():
            tensors = list(module.named_parameters(remove_duplicate=False)) + list(module.named_buffers()) if whole else \
                list(module.named_parameters(recurse=False)) + list(module.named_buffers(recurse=False))
            owner.update({_join(unit, n): unit for n, _ in tensors})
        # The tensors a state dict holds: parameters once (a tied head is its embedding), persistent buffers.
        buffers = set(reference.state_dict()) - set(dict(reference.named_parameters(remove_duplicate=False)))
        saved = set(dict(reference.named_parameters())) | buffers
        self.locations = {name: unit for name, unit in owner.items() if name in saved}

    def _open_unit(self, unit: Any) -> dict[str, torch.Tensor]:
        module, whole = self.units[unit]
        if not whole:  # its own tensors only: not its children (they are units of their own)
            module = copy.copy(module)
            module._modules = {}
        made = copy.deepcopy(module).to_empty(device="cpu")
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            torch.manual_seed(unit_seed(self.seed, unit))
            made.apply(self.reference._init_weights)
        return {_join(unit, n): t for n, t in [*made.named_parameters(), *made.named_buffers()]}


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def materialize(model: nn.Module, source: WeightSource, device: Any) -> None:
    """Storage and values for a model built without weights, after its strategy sharded or split it: each rank
    takes from `source` only what it holds."""
    with torch.no_grad():
        if any(hasattr(p, "ds_tensor") for p in model.parameters()):
            _fill_partitions(model, source)
        else:
            _fill_meta(model, source, device)


def _clean(name: str) -> str:
    for part in _WRAPPER_PARTS:
        name = name.replace(part, "")
    return name


def _saved_name(model: nn.Module, name: str, saved: dict[str, Any]) -> str | None:
    """The name under which the source holds `name`: itself (without wrappers' parts), or for a tied head whose
    embedding this process does not hold (a pipeline's last stage), the embedding it is tied to (transformers'
    `_tied_weights_keys`)."""
    name = _clean(name)
    if name in saved:
        return name
    tied = getattr(model, "_tied_weights_keys", None)
    source = tied.get(name) if isinstance(tied, dict) and getattr(model.config, "tie_word_embeddings", False) else None
    return source if source in saved else None


def source_names(model: nn.Module, source: WeightSource, tensors: dict[str, Any]) -> dict[str, tuple[str, Any]]:
    """{model's name: (name in the source, what it fills)}, or one error naming a tensor the source does not hold."""
    saved = source.locations
    out, missing = {}, []
    for name, tensor in tensors.items():
        held = _saved_name(model, name, saved)
        if held is None:
            missing.append(name)
        else:
            out[name] = (held, tensor)
    if missing:
        where = getattr(source, "path", type(source).__name__)
        quantized = sorted(f"{_clean(name)}_blocks" for name in missing if f"{_clean(name)}_blocks" in saved)
        if quantized:  # GPT-OSS's published checkpoints: the experts in MXFP4, blocks and scales
            raise ValueError(
                f"{where}: {len(quantized)} of the model's tensors are saved quantized (e.g. {quantized[0]!r} and its "
                "_scales: MXFP4), which a model built on meta cannot read; save a dequantized copy once (transformers: "
                "from_pretrained(DIR, quantization_config=Mxfp4Config(dequantize=True)), then save_pretrained) or "
                "use a strategy that loads through from_pretrained (single, ddp, zero1, zero2)")
        raise ValueError(f"{where}: no weights for {len(missing)} of the model's tensors, e.g. "
                         f"{sorted(map(_clean, missing))[0]!r} (it holds {len(saved)}, e.g. {sorted(saved)[0]!r})")
    return out


def _fill_meta(model: nn.Module, source: WeightSource, device: Any) -> None:
    """Storage on `device` for a model built on meta, filled from `source`. A plain tensor (a pipeline stage's own
    layers, a whole model) is read whole; a DTensor whose placements are dim-0 shards or replicas (FSDP2) reads
    only its rows; any other DTensor (TP's column and row splits, GPT-2's fused q/k/v, fsdp_tp's nested shards)
    reads the tensor whole, one at a time, and keeps its own part.

    The non-persistent buffers (rotary frequencies) are recomputed by transformers' own init of the modules that
    hold them (`to_empty` leaves garbage there, transformers#34234), with the global generator left as it was;
    every parameter and saved buffer then comes from the source. A tied head shares the embedding's parameter,
    which is filled once."""
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    empty = {n for n, t in [*model.named_parameters(), *model.named_buffers()] if local_tensor(t).is_meta}
    _to_empty(model, device)
    with torch.random.fork_rng(devices=[]):
        for module in model.modules():
            if next(module.buffers(recurse=False), None) is not None:
                model._init_weights(module)
    tensors = {n: t for n, t in model.named_parameters() if n in empty}
    tensors.update({n: b for n, b in model.named_buffers() if n in empty and _clean(n) in source.locations})
    for name, held, target in source.by_unit(source_names(model, source, tensors)):
        if not isinstance(target, DTensor):
            target.copy_(source.read(held))
            continue
        placements = target.placements
        if all(type(p) is Replicate or (type(p) is Shard and p.dim == 0) for p in placements):
            shape, offset = compute_local_shape_and_global_offset(target.shape, target.device_mesh, placements)
            if shape[0]:
                target.to_local().copy_(source.read(held, offset[0], offset[0] + shape[0]))
        else:
            target.to_local().copy_(place_like(source.read(held).to(target.device), target).to_local())


def _to_empty(model: nn.Module, device: Any) -> None:
    """Storage on `device` for the tensors still on meta (what is already real, QLoRA's packed layers, stays),
    keeping tied parameters tied: `to_empty` gives each module's slot its own new tensor, so a head tied to its
    embedding would come out as two (measured, torch 2.13)."""
    slots: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in model.modules():
        for name, p in module._parameters.items():
            if p is not None:
                slots.setdefault(id(p), []).append((module, name))
    for module in model.modules():
        if any(local_tensor(t).is_meta for t in [*module.parameters(recurse=False), *module.buffers(recurse=False)]):
            module.to_empty(device=device, recurse=False)
    for (first, first_name), *others in (s for s in slots.values() if len(s) > 1):
        for module, name in others:
            module._parameters[name] = first._parameters[first_name]


def _fill_partitions(model: nn.Module, source: WeightSource) -> None:
    """ZeRO-3 partitions of a model built under zero.Init, filled from `source`. DeepSpeed lays each parameter out
    flat, padded to a multiple of its group's size, and rank r holds elements [r p, (r + 1) p) (its `ds_tensor`):
    each rank reads only the rows that cover its elements. Buffers are not partitioned: the saved ones are read
    whole."""
    import torch.distributed as dist

    params = dict(model.named_parameters())
    buffers = {n: b for n, b in model.named_buffers() if _clean(n) in source.locations}
    for name, held, param in source.by_unit(source_names(model, source, params)):
        local = param.ds_tensor
        size = local.ds_numel
        lo = size * dist.get_rank(group=param.ds_process_group)
        hi = min(lo + size, param.ds_numel)
        local.zero_()  # the padding past the last element
        if lo >= hi:
            continue
        row = param.ds_numel // param.ds_shape[0] if len(param.ds_shape) else 1
        first, last = lo // row, -(-hi // row)
        rows = source.read(held, first, last) if len(param.ds_shape) else source.read(held)
        local[: hi - lo].copy_(rows.reshape(-1)[lo - first * row: hi - first * row])
    for name, held, buffer in source.by_unit(source_names(model, source, buffers)):
        buffer.copy_(source.read(held))
