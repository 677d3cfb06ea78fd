"""The estimator's prediction for each run, from the run's own config.yaml, beside what the run measured.

Every category is compared rank by rank (a pipeline's stages differ) and the row keeps, per category, the
worst rank's signed error (predicted - measured) / measured. The measured optimizer bytes include the
master copy where a strategy keeps one (DeepSpeed counts its fp32 partition there) and a few bytes of
step counters; the prediction's optimizer column is optimizer state + master weights. Transient buffers
(weight copies, ZeRO-3's gathered parameters, ZeRO's fp32 step gradients) are compared where the run
measured them or the estimator predicts them. `model_state_ok`: params, grads and optimizer within
`memory_rtol`; `prediction_ok`: every compared category within it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from omegaconf import OmegaConf

from dist_train.estimate import ModelShape, predict_comm, predict_memory, setup_from_config
from dist_train.compare.table import TRANSIENT_CATEGORIES
from dist_train.estimate.memory import category_bytes, predicted_categories

STATE_CATEGORIES = ("params", "grads", "optimizer")


def rel_error(predicted: float, measured: float) -> Optional[float]:
    if measured == 0:
        return 0.0 if predicted == 0 else None
    return (predicted - measured) / measured


def add_prediction(row: dict[str, Any], *, memory_rtol: float) -> None:
    """Adds pred_* and err_* columns and model_state_ok to an ok row."""
    if row["status"] != "ok":
        return
    cfg = OmegaConf.to_container(OmegaConf.load(Path(row["run_dir"]) / "config.yaml"), resolve=True)
    if (cfg.get("peft") or {}).get("name", "none") != "none":  # type: ignore[union-attr]
        # Measured, not predicted: a row of made-up figures would be worse than none.
        row["model_state_ok"] = row["prediction_ok"] = None
        row["pred_note"] = "not predicted: the estimator does not model LoRA adapters yet"
        return
    setup = setup_from_config(cfg, world_size=row["world_size"])  # type: ignore[arg-type]
    shape = ModelShape.from_config(cfg["model"])  # type: ignore[index]
    ranks = predict_memory(shape, setup)
    measured = row["mem_per_rank"]
    state_ok = all_ok = True
    categories = predicted_categories(cfg.get("train") or {})  # type: ignore[arg-type]
    if "activations" not in categories:
        row["pred_note"] = "activations and weight copies not predicted under train.compile"
    for cat in categories:
        pred = [category_bytes(r, cat) for r in ranks]
        meas = [m.get(cat, 0) for m in measured]
        if cat in TRANSIENT_CATEGORIES and not any(pred) and not any(meas):
            continue  # neither held nor predicted by this strategy and precision
        errs = [rel_error(p, m) for p, m in zip(pred, meas)]
        worst = max(errs, key=lambda e: float("inf") if e is None else abs(e)) if errs else None
        row[f"pred_{cat}_bytes"] = max(pred)
        row[f"err_{cat}"] = worst
        ok = worst is not None and abs(worst) <= memory_rtol
        state_ok = state_ok and (ok or cat not in STATE_CATEGORIES)
        all_ok = all_ok and ok
    # The peak of all live tensors, where the estimator models it: shown beside the categories, not part of the
    # verdict (it adds buffers the categories leave out, measured on the CPU only where telemetry.peak_live).
    live = [r.peak_live for r in ranks]
    measured_live = row.get("mem_peak_live_max_bytes")
    if "activations" in categories and all(v is not None for v in live) and measured_live:
        row["pred_peak_live_bytes"] = max(live)
        row["err_peak_live"] = rel_error(max(live), measured_live)
    row["model_state_ok"] = state_ok
    row["prediction_ok"] = all_ok
    row["pred_regime"] = setup.regime_description
    add_comm_prediction(row, shape=shape, setup=setup)
    add_step_prediction(row, shape=shape, setup=setup, train=cfg.get("train") or {})  # type: ignore[arg-type]


def add_step_prediction(row: dict[str, Any], *, shape: ModelShape, setup: Any, train: dict[str, Any],
                        profile_dir: Optional[Path] = None) -> None:
    """pred_step_s and err_step_s: the advisor's time model (dist_train/plan) for the run's device, with this
    machine's stored profile of it (plan.calibrate, plan.verify) or the datasheet's; pred_step_profile says which.
    A device with no profile (a CPU never calibrated here, an unknown GPU) gets pred_step_note instead."""
    from dataclasses import replace

    from dist_train.estimate.hardware import default_profile_dir, profile_for_device, resolve
    from dist_train.estimate.step_time import predict_step

    device = row.get("device_name", "cpu")
    name = profile_for_device(device)
    hw, how = resolve(name, profile_dir or default_profile_dir()) if name else (None, "")
    if hw is None:
        row["pred_step_note"] = (f"no profile of {device}" if name is None else
                                 "no cpu profile yet (python launch/plan.py cluster.gpu=cpu plan.calibrate=true)")
        return
    hw = replace(hw, gpus_per_node=max(1, row["world_size"] // max(1, row.get("nodes", 1))))
    step = predict_step(shape, setup, hw, allow_tf32=bool(train.get("allow_tf32", False)))
    row["pred_step_s"] = step.step_s
    row["err_step_s"] = rel_error(step.step_s, row.get("step_s", 0.0))
    fitted = hw.fitted_to()
    row["pred_step_profile"] = f"{hw.name}, {how}" + (f"; fitted to {'; '.join(fitted)}" if fitted else "")


def add_comm_prediction(row: dict[str, Any], *, shape: ModelShape, setup: Any) -> None:
    per_rank = predict_comm(shape, setup)
    totals = [sum(c.bytes for c in colls) for colls in per_rank]
    row["pred_comm_bytes_per_step"] = max(totals) if totals else 0.0
    for colls in per_rank[:1] if setup.family != "pipeline" else per_rank:
        for c in colls:
            key = f"pred_comm_{c.op}_bytes"
            row[key] = max(row.get(key, 0.0), c.bytes)
    row["err_comm_bytes"] = rel_error(row["pred_comm_bytes_per_step"], row.get("comm_bytes_per_step", 0.0))
