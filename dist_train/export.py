"""Export a checkpoint of any strategy as a plain `transformers` directory (`save_pretrained`).

    python launch/export.py outputs/fsdp-xxxx/checkpoints/step-00000100 exported/
    python launch/export.py outputs/fsdp-xxxx/checkpoints exported/       # its newest complete checkpoint
    python launch/export.py outputs/single-xxxx/checkpoints exported/ --merge   # a LoRA run: also the merged model

The model is rebuilt from the config the checkpoint stored, then its weights are read back on one process:
a torch.distributed.checkpoint (DCP) checkpoint is resharded into full tensors, whatever strategy and world
size wrote it (FSDP shards, pipeline stages, DDP replicas); a DeepSpeed ZeRO checkpoint is consolidated from
its fp32 master partitions by DeepSpeed's own zero_to_fp32. The result loads with
`AutoModelForCausalLM.from_pretrained(out_dir)`, with no dist_train and no process group.

A LoRA run (peft=lora | qlora) is rebuilt with its adapters, as training built it, and exported as the adapter in
peft's own format (adapter_config.json + adapter_model.safetensors: `PeftModel.from_pretrained(base, out_dir)`).
`merge=True` also folds the adapters into the base weights with peft's LoraLayer.merge (QLoRA: over the base
dequantized to fp32) and writes that plain model to `out_dir`, the adapter then to `out_dir/adapter`: with
adapter_config.json beside config.json, `from_pretrained(out_dir)` would apply the adapter a second time.
"""

from __future__ import annotations

import copy
import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from dist_train.checkpoint.layout import read_marker, read_trainer_state, resolve_resume

LORA = ("lora", "qlora")
ADAPTER_SUBDIR = "adapter"  # with merge=True, where the adapter goes (out_dir itself holds the merged model)


@dataclass
class Exported:
    """What `export_pretrained` wrote into `out_dir`."""

    checkpoint: Path  # the checkpoint it read
    peft: str  # the run's peft.name: none | lora | qlora
    adapter_dir: Optional[Path]  # a LoRA run: the adapter in peft's format
    model_dir: Optional[Path]  # a full transformers model (merged, for a LoRA run); None: the adapter only
    base: Optional[str]  # a LoRA run: the base model's directory (model.path), None for a built-in model


def _check_out_dir(out_dir: Path, *, overwrite: bool) -> None:
    """One line, before anything is read, where the export would replace what `out_dir` holds."""
    if out_dir.exists() and not out_dir.is_dir():
        raise ValueError(f"{out_dir} is a file: name a new or empty directory to export into")
    held = sorted(p.name for p in out_dir.iterdir()) if out_dir.is_dir() else []
    if held and not overwrite:
        shown = ", ".join(held[:3]) + (", ..." if len(held) > 3 else "")
        raise ValueError(f"{out_dir} already holds {len(held)} file(s) ({shown}): export into a new or empty "
                         "directory, or add --overwrite to write over what it holds")


# What transformers' and peft's from_pretrained read from a directory, and what an export writes: --overwrite removes
# these first, so that nothing of an earlier model or export is read with the new one (an adapter_config.json left
# beside merged weights would load the old adapter over them). Other files (a tokenizer, a README) stay.
MODEL_FILES = ("config.json", "generation_config.json", "model.safetensors", "model-*-of-*.safetensors",
               "model.safetensors.index.json", "pytorch_model*.bin", "pytorch_model.bin.index.json",
               "adapter_config.json", "adapter_model.safetensors", "adapter_model.bin", "dist_train.json")


def _clear_model_files(out_dir: Path) -> None:
    """MODEL_FILES and the merged export's adapter subdirectory, removed from `out_dir` (once every weight is read)."""
    if not out_dir.is_dir():
        return
    for pattern in MODEL_FILES:
        for path in out_dir.glob(pattern):
            path.unlink()
    shutil.rmtree(out_dir / ADAPTER_SUBDIR, ignore_errors=True)


def export_pretrained(checkpoint: Path, out_dir: Path, *, merge: bool = False, overwrite: bool = False) -> Exported:
    """Write `out_dir` (config.json + safetensors weights; for a LoRA run the adapter, and with `merge` also the
    merged model). Nothing is written until every weight is read and merged, and nothing is written over: a
    directory that holds anything (another model, the run's own base model) is refused unless `overwrite`."""
    _check_out_dir(out_dir, overwrite=overwrite)
    from dist_train.quiet import quiet_deepspeed_on_cpu

    quiet_deepspeed_on_cpu()  # transformers imports DeepSpeed (through Accelerate) whatever the checkpoint
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    path = resolve_resume(str(checkpoint), default_root=None, key="checkpoint")
    assert path is not None  # a path never resolves to None
    state, fmt = read_trainer_state(path), read_marker(path)["format"]
    config = state["config"]
    peft = str(config.get("peft", {}).get("name", "none"))
    if merge and peft not in LORA:
        raise ValueError(f"--merge folds LoRA adapters into the model: {path} is from a run with peft={peft}, "
                         "whose export is already the whole model (drop --merge)")
    model = _model(config)
    if peft in LORA:
        _apply_lora(model, config, peft)
    if fmt == "dcp":
        _load_dcp(model, path)
    elif fmt == "deepspeed":
        _load_deepspeed(model, path)
    else:
        raise ValueError(f"{path}: unknown checkpoint format {fmt!r}")
    base = config["model"].get("path")
    if peft in LORA:
        adapter_config, adapter_weights = _adapter(model, base)
        merged = _merged(model, config, peft) if merge else None
        adapter_dir = out_dir / ADAPTER_SUBDIR if merge else out_dir
        if overwrite:
            _clear_model_files(out_dir)
        adapter_dir.mkdir(parents=True, exist_ok=True)
        _write_adapter(adapter_dir, adapter_config, adapter_weights)
        if merged is not None:
            merged.save_pretrained(out_dir)
        done = Exported(path, peft, adapter_dir, out_dir if merged is not None else None, base)
    else:
        if overwrite:
            _clear_model_files(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(out_dir)
        done = Exported(path, peft, None, out_dir, None)
    (out_dir / "dist_train.json").write_text(json.dumps(
        {"checkpoint": str(path), "step": state["step"], "strategy": state.get("strategy"), "format": fmt,
         "peft": peft, "merged": merge}, indent=1
    ))
    return done


def _model(config: dict[str, Any]) -> torch.nn.Module:
    from dist_train.config import ModelConfig
    from dist_train.model import build_model

    return build_model(ModelConfig(**config["model"]), seed=int(config["train"]["seed"]))


def _apply_lora(model: torch.nn.Module, config: dict[str, Any], name: str) -> None:
    """The adapters as training made them (session._strategy: after the build, with the run's seed), in fp32;
    QLoRA's projections then packed into 4 bits, as moving the model to its device does in training."""
    from dist_train.config import PeftConfig
    from dist_train.model import apply_lora

    apply_lora(model, PeftConfig(**{**config["peft"], "name": name}), seed=int(config["train"]["seed"]),
               compute_dtype=torch.float32)
    if name == "qlora":
        model.to("cpu")  # bitsandbytes packs a Params4bit when it is moved


def _adapter(model: torch.nn.Module, base: Optional[str]) -> tuple[Any, dict[str, torch.Tensor]]:
    """The training's LoraConfig (inject_adapter_in_model keeps it as `model.peft_config`) and the adapters'
    weights, keyed as PeftModel.save_pretrained keys them."""
    from peft import get_peft_model_state_dict

    lora_config = copy.deepcopy(model.peft_config["default"])
    lora_config.base_model_name_or_path = base
    lora_config.inference_mode = True  # as PeftModel.save_pretrained writes it
    weights = get_peft_model_state_dict(model, adapter_name="default")
    return lora_config, {f"base_model.model.{k}": v.detach().contiguous() for k, v in weights.items()}


def _write_adapter(out_dir: Path, lora_config: Any, weights: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save_file

    lora_config.save_pretrained(str(out_dir))  # adapter_config.json
    save_file(weights, str(out_dir / "adapter_model.safetensors"), metadata={"format": "pt"})


def _merged(model: torch.nn.Module, config: dict[str, Any], peft: str) -> torch.nn.Module:
    """The plain model with the adapters folded in. LoRA: `model` itself, each LoraLayer merged (peft) and
    replaced by its base layer. QLoRA: a fresh fp32 LoRA model of the same architecture (GPT-2's Conv1D layout
    back) gets the 4-bit base dequantized (peft's dequantize_bnb_weight) and the same adapters, then is merged
    the same way: merging into the 4-bit layers would quantize the adapters' small updates away."""
    if peft == "qlora":
        model = _dequantized(model, config)
    from peft.tuners.lora import LoraLayer

    for name, module in list(model.named_modules()):
        if isinstance(module, LoraLayer):
            module.merge(safe_merge=True)
            model.set_submodule(name, module.get_base_layer())
    if hasattr(model, "peft_config"):
        del model.peft_config  # a plain transformers model again
    return model


def _dequantized(qmodel: torch.nn.Module, config: dict[str, Any]) -> torch.nn.Module:
    from peft.utils.integrations import dequantize_bnb_weight
    from transformers.pytorch_utils import Conv1D

    model = _model(config)
    _apply_lora(model, config, "lora")
    weights = qmodel.state_dict()
    for key, packed in _packed_weights(qmodel):
        weight = dequantize_bnb_weight(packed, state=packed.quant_state).float()  # out x in
        weights[key] = weight.t() if isinstance(model.get_submodule(key.rsplit(".", 1)[0]), Conv1D) else weight
    model.load_state_dict({k: weights[k] for k in model.state_dict()})  # a key it lacks: KeyError, not a guess
    return model


def _load_dcp(model: torch.nn.Module, path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    from dist_train.checkpoint.dcp_io import SUBDIR

    state = {"model": model.state_dict()}  # the parameters themselves: DCP fills them in place
    dcp.load(state, checkpoint_id=str(path / SUBDIR), no_dist=True)
    _restore_quant_states(model, state["model"])
    missing, unexpected = model.load_state_dict(state["model"], strict=False)
    if missing or set(unexpected) - _quant_state_keys(model):
        raise ValueError(f"{path}: weights do not fit the model: missing {sorted(missing)}, "
                         f"unexpected {sorted(set(unexpected) - _quant_state_keys(model))}")


def _quant_state_keys(model: torch.nn.Module) -> set[str]:
    """State-dict entries that are no parameter or buffer: a 4-bit weight's scales (bitsandbytes writes them
    beside it; QLoRA). None for any other model."""
    own = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    own |= {n for n, _ in model.named_buffers(remove_duplicate=False)}
    return set(model.state_dict()) - own


def _restore_quant_states(model: torch.nn.Module, state: dict[str, Any]) -> None:
    """QLoRA: each 4-bit weight unpacks with the scales the checkpoint stored (read by DCP into `state`), not
    the ones this rebuild computed (load_state_dict leaves those alone)."""
    for key, weight in _packed_weights(model):
        from bitsandbytes.functional import QuantState

        stats = {k[len(key) + 1:]: v for k, v in state.items() if k.startswith(f"{key}.")}
        weight.quant_state = QuantState.from_dict(stats, device=weight.device)


def _packed_weights(model: torch.nn.Module) -> list[tuple[str, Any]]:
    """(state-dict key, parameter) of each bitsandbytes 4-bit weight (QLoRA's base projections)."""
    return [(k, p) for k, p in model.named_parameters() if type(p).__name__ == "Params4bit"]


def _load_deepspeed(model: torch.nn.Module, path: Path) -> None:
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    from dist_train.checkpoint.deepspeed_io import DeepSpeedIO

    weights = get_fp32_state_dict_from_zero_checkpoint(str(path / DeepSpeedIO.SUBDIR), tag=DeepSpeedIO.TAG)
    missing, unexpected = model.load_state_dict(weights, strict=False)
    # A tied head is stored once (as the embedding); anything else missing means a wrong model.
    tied = {name for name in missing if _is_tied_copy(model, name)}
    if set(missing) - tied or unexpected:
        raise ValueError(f"{path}: weights do not fit the model: missing {sorted(set(missing) - tied)}, "
                         f"unexpected {sorted(unexpected)}")


def _is_tied_copy(model: torch.nn.Module, name: str) -> bool:
    params = dict(model.named_parameters(remove_duplicate=False))
    target = params.get(name)
    return target is not None and any(p is target and n != name for n, p in params.items())
