"""Sweeping knobs besides the strategy (`compare.sweep`), and what each knob changed.

`compare.sweep='{precision:[fp32,bf16],train.activation_checkpointing:[none,full]}'` runs every strategy once
per combination of the values, as rows `ddp+precision=bf16+train.activation_checkpointing=full` (the same
per-row overrides `compare.strategies` takes). Each row is judged against the single run of the same training
config (verdict.py matches config hashes), so a bf16 ddp row is compared with bf16 single.

What a knob changed is read back from the runs, not from the sweep: the knobs of a set of runs are the training
settings whose value differs between them (a config group by its name, `precision=bf16`, when its name differs). So a
report rebuilt from run directories (`compare.from=`) finds the same knobs and the same effects. An effect pairs
two runs of the same strategy config that differ in one knob only, and gives the change of each memory category
and of the step time, measured and predicted.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any, Optional

from dist_train.compare.settings import NOT_KNOBS, StrategySpec, flatten, override_value

# Config groups chosen by name (conf/<group>/<name>.yaml): a knob by its name, not by the fields it sets.
NAMED_GROUPS = ("model", "precision", "optimizer", "data", "peft")
# Measured categories an effect reports (the row's worst rank), with the estimator's counterpart where it has one.
EFFECT_CATEGORIES = ("params", "grads", "optimizer", "activations", "weight_copies", "peak_live")


def expand(strategies: list[str], sweep: dict[str, list[Any]]) -> list[StrategySpec]:
    """One spec per (combination of knob values, strategy): the combinations outermost, in the order given."""
    specs = [StrategySpec.parse(s) for s in strategies]
    if not sweep:
        return specs
    out = []
    for combo in itertools.product(*sweep.values()):
        knobs = tuple(f"{k}={override_value(v)}" for k, v in zip(sweep, combo))
        for spec in specs:
            out.append(StrategySpec(label="+".join((spec.label, *knobs)), name=spec.name,
                                    overrides=(*spec.overrides, *knobs)))
    return out


# ------------------------------------------------------------------ knobs and effects, read from the runs
def _settings(config: dict[str, Any]) -> dict[str, Any]:
    """The run's training settings, dotted (`train.seq_len`, `precision.name`)."""
    return flatten({group: value for group, value in config.items() if group not in NOT_KNOBS})


def _varying(settings: list[dict[str, Any]]) -> list[str]:
    """The settings whose value differs between runs; a named group whose name differs is one knob, `precision`
    (not `precision.name` and every field its YAML sets), while a field swept under one name stays a knob."""
    def differs(key: str, runs: list[dict[str, Any]]) -> bool:
        return len({json.dumps(s.get(key), sort_keys=True) for s in runs}) > 1

    keys = sorted({k for s in settings for k in s})
    varying = [k for k in keys if differs(k, settings)]
    renamed = [g for g in NAMED_GROUPS if f"{g}.name" in varying]

    def follows_the_name(key: str) -> bool:  # it differs only where the group's name does (the name's YAML sets it)
        group = key.split(".", 1)[0]
        if group not in renamed:
            return False
        names = {json.dumps(s.get(f"{group}.name")) for s in settings}
        return not any(differs(key, [s for s in settings if json.dumps(s.get(f"{group}.name")) == n]) for n in names)

    return [k for k in varying if not follows_the_name(k) and k not in {f"{g}.name" for g in renamed}] + renamed


def _knob_value(settings: dict[str, Any], knob: str) -> Any:
    return settings.get(f"{knob}.name") if knob in NAMED_GROUPS else settings.get(knob)


def _load(run_dir: str) -> Optional[dict[str, Any]]:
    from omegaconf import OmegaConf

    path = Path(run_dir) / "config.yaml"
    return OmegaConf.to_container(OmegaConf.load(path), resolve=True) if path.is_file() else None  # type: ignore[return-value]


def add_knobs(rows: list[dict[str, Any]]) -> list[str]:
    """Sets row["knobs"] ({knob: value}) on every row with a config, and returns the knobs: the settings whose
    value differs between the rows. Also row["strategy_config"], the identity of the strategy a row ran."""
    settings: dict[int, dict[str, Any]] = {}
    for i, row in enumerate(rows):
        config = _load(row["run_dir"])
        if config is None:
            continue
        settings[i] = _settings(config)
        row["strategy_config"] = json.dumps({**config["strategy"], "world_size": row.get("world_size")}, sort_keys=True)
    knobs = sorted(_varying(list(settings.values())))
    for i, s in settings.items():
        rows[i]["knobs"] = {k: _knob_value(s, k) for k in knobs}
    return knobs


def knob_effects(rows: list[dict[str, Any]], knobs: list[str]) -> list[dict[str, Any]]:
    """For each knob and each ok row whose value of it is not the first value seen (the reference), the row of
    the same strategy config with the reference value and every other knob the same: how the second differs."""
    ok = [r for r in rows if r["status"] == "ok" and "knobs" in r]
    effects = []
    for knob in knobs:
        reference = next((r["knobs"][knob] for r in ok), None)
        for row in ok:
            if row["knobs"][knob] == reference:
                continue
            base = next((b for b in ok if b["strategy_config"] == row["strategy_config"]
                         and b["knobs"][knob] == reference
                         and all(b["knobs"][k] == row["knobs"][k] for k in knobs if k != knob)), None)
            if base is not None:
                effects.append(_effect(knob, base, row, knobs))
    return effects


def _ratio(new: Optional[float], old: Optional[float]) -> Optional[float]:
    if new is None or old is None:
        return None
    if old == 0:
        return None if new else 0.0
    return new / old - 1.0


def _effect(knob: str, base: dict[str, Any], row: dict[str, Any], knobs: list[str]) -> dict[str, Any]:
    effect: dict[str, Any] = {
        "knob": knob, "from": base["knobs"][knob], "to": row["knobs"][knob],
        "strategy": json.loads(base["strategy_config"])["name"],
        "row": row["strategy"], "reference_row": base["strategy"],
        "others": {k: row["knobs"][k] for k in knobs if k != knob},
        "step_s": _ratio(row["step_s"], base["step_s"]),
        "final_loss": (row["final_loss"], base["final_loss"]),
    }
    for cat in EFFECT_CATEGORIES:
        measured = (row.get(f"mem_{cat}_max_bytes"), base.get(f"mem_{cat}_max_bytes"))
        predicted = (row.get(f"pred_{cat}_bytes"), base.get(f"pred_{cat}_bytes"))
        if not any(measured) and not any(predicted):
            continue
        effect[cat] = {"measured": _ratio(measured[0] or 0, measured[1] or 0),
                       "predicted": _ratio(*predicted) if None not in predicted else None,
                       "bytes": measured}
    return effect
