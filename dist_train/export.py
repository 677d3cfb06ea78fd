"""Export a checkpoint of any strategy as a plain `transformers` directory (`save_pretrained`).

    python launch/export.py outputs/fsdp-xxxx/checkpoints/step-00000100 exported/
    python launch/export.py outputs/fsdp-xxxx/checkpoints exported/       # its newest complete checkpoint

The model is rebuilt from the config the checkpoint stored, then its weights are read back on one process:
a torch.distributed.checkpoint (DCP) checkpoint is resharded into full tensors, whatever strategy and world
size wrote it (FSDP shards, pipeline stages, DDP replicas); a DeepSpeed ZeRO checkpoint is consolidated from
its fp32 master partitions by DeepSpeed's own zero_to_fp32. The result loads with
`AutoModelForCausalLM.from_pretrained(out_dir)`, with no dist_train and no process group.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from dist_train.checkpoint.layout import read_marker, read_trainer_state, resolve_resume


def export_pretrained(checkpoint: Path, out_dir: Path) -> Path:
    """Write `out_dir` (config.json + safetensors weights); return the checkpoint that was exported."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    path = resolve_resume(str(checkpoint), default_root=None, key="checkpoint")
    assert path is not None  # a path never resolves to None
    state, fmt = read_trainer_state(path), read_marker(path)["format"]
    model = _model(state["config"])
    if fmt == "dcp":
        _load_dcp(model, path)
    elif fmt == "deepspeed":
        _load_deepspeed(model, path)
    else:
        raise ValueError(f"{path}: unknown checkpoint format {fmt!r}")
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    (out_dir / "dist_train.json").write_text(json.dumps(
        {"checkpoint": str(path), "step": state["step"], "strategy": state.get("strategy"), "format": fmt}, indent=1
    ))
    return path


def _model(config: dict[str, Any]) -> torch.nn.Module:
    from dist_train.config import ModelConfig
    from dist_train.model import build_model

    return build_model(ModelConfig(**config["model"]), seed=int(config["train"]["seed"]))


def _load_dcp(model: torch.nn.Module, path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    from dist_train.checkpoint.dcp_io import SUBDIR

    state = {"model": model.state_dict()}  # the parameters themselves: DCP fills them in place
    dcp.load(state, checkpoint_id=str(path / SUBDIR), no_dist=True)
    model.load_state_dict(state["model"])


def _load_deepspeed(model: torch.nn.Module, path: Path) -> None:
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    from dist_train.strategies._deepspeed import DeepSpeedIO

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
