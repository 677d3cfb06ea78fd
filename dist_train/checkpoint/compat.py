"""Can this run resume from that checkpoint? Checked before any process group starts (a ConfigError line).

What must match for "resume" to mean "continue the same training": the checkpoint format the strategy
reads; for DeepSpeed's per-rank format, the ZeRO stage and the world size; the model; the data, seed, global
batch and sequence length (which fix the samples of every step); whether an fp16 loss scaler is part of the
state. Everything else may change (more steps, another learning rate, another DCP strategy or world size).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dist_train.checkpoint.layout import read_marker, read_trainer_state
from dist_train.config import ConfigError, PrecisionConfig, RunConfig

# Keys whose saved value must equal this run's (dotted, under the resolved config).
_SAME = ("train.seq_len", "train.global_batch_size", "train.seed", "data.name", "data.path", "data.noise")
_MODEL_KEYS_IGNORED = ("name",)


def check_resumable(path: Path, run: RunConfig, *, world_size: int) -> dict[str, Any]:
    """Raise ConfigError naming what differs; return the checkpoint's trainer state."""
    key = f"checkpoint.resume={path}"
    marker, state = read_marker(path), read_trainer_state(path)
    saved_cfg = state.get("config", {})
    ours, theirs = run.strategy.checkpoint_format, marker.get("format")
    saved_strategy = state.get("strategy", "?")
    if theirs != ours:
        raise ConfigError(
            f"{key} was written by strategy={saved_strategy} ({theirs} format); strategy={run.strategy.name} reads "
            f"{ours} checkpoints only. Resume with a {theirs} strategy, or export the weights with "
            f"`python launch/export.py {path} OUT_DIR`"
        )
    if theirs == "deepspeed":
        saved_stage = saved_cfg.get("strategy", {}).get("stage")
        if saved_stage != getattr(run.strategy, "stage", None) or marker.get("world_size") != world_size:
            raise ConfigError(
                f"{key} holds DeepSpeed ZeRO-{saved_stage} partitions of {marker.get('world_size')} ranks; it reloads "
                f"only with ZeRO-{saved_stage} on {marker.get('world_size')} ranks (this run: "
                f"strategy={run.strategy.name}, WORLD_SIZE={world_size})"
            )
    differences = _differences(saved_cfg, run)
    if differences:
        raise ConfigError(
            f"{key} was saved for a different training ({'; '.join(differences)}); resuming needs the same model, "
            "data, seed, global batch and sequence length (or start afresh in a new hydra.run.dir)"
        )
    return state


def _differences(saved: dict[str, Any], run: RunConfig) -> list[str]:
    from dataclasses import asdict

    now = {"model": asdict(run.model), "train": asdict(run.train), "data": asdict(run.data)}
    out = []
    for name, value in now["model"].items():
        if name not in _MODEL_KEYS_IGNORED and _saved(saved, "model", name) != value:
            out.append(f"model.{name}: saved {saved.get('model', {}).get(name)!r}, now {value!r}")
    for dotted in _SAME:
        group, name = dotted.split(".")
        was, now_value = _saved(saved, group, name), now[group][name]
        if was != now_value:
            out.append(f"{dotted}: saved {was!r}, now {now_value!r}")
    was = PrecisionConfig(**saved.get("precision", {}))
    if was.loss_scaling != run.precision.loss_scaling:
        out.append(f"precision: saved {saved.get('precision', {}).get('name')!r}, now {run.precision.name!r} "
                   "(an fp16 loss scaler is part of the state only in fp16)")
    return out


def _saved(saved: dict[str, Any], group: str, name: str) -> Any:
    """A saved value as this run's config holds it: a path option absolute (a checkpoint written before paths were
    made absolute holds it as typed, relative to the directory the run was started in, which is where we are)."""
    from dist_train.paths import PATH_KEYS, user_path

    value = saved.get(group, {}).get(name)
    return user_path(value) if (group, name) in PATH_KEYS and isinstance(value, str) and value else value
