"""The comparison as its own W&B run, in the same group as the training runs it compares.

It holds a W&B Table (one row per strategy, the scalar columns of table.csv), bar charts built from that
table (so a dashboard compares strategies with no hand work), the pictures, and `<strategy>/<metric>`
summary values. Offline unless an API key is configured, as every run here (wandb_sink.resolve_mode).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from dist_train.compare.report import CSV_COLUMNS, _csv_key

CHARTS = (
    ("step_s", "step time (s)"),
    ("tokens_per_s", "tokens per second"),
    ("comm_bytes_per_step", "collective bytes per step"),
    ("mem_optimizer_max_bytes", "optimizer state bytes, worst rank"),
    ("loss_max_rel_dev", "max relative loss deviation from single"),
)
SUMMARY_KEYS = ("step_s", "pred_step_s", "err_step_s", "compute_s", "comm_s", "tokens_per_s", "comm_bytes_per_step", "final_loss",
                "loss_max_rel_dev", "mem_params_max_bytes", "mem_grads_max_bytes", "mem_optimizer_max_bytes",
                "mem_activations_max_bytes", "err_params", "err_grads", "err_optimizer")


def _cell(value: Any) -> Any:
    if value is None or isinstance(value, (int, float, str, bool)):
        return value
    return str(value)


def log_comparison(rows: list[dict[str, Any]], *, logger: dict[str, Any], group: str, out_dir: Path,
                   images: dict[str, Path]) -> Optional[Path]:
    """Returns the W&B run's local directory."""
    import wandb

    from dist_train.telemetry.wandb_sink import resolve_mode

    mode = resolve_mode(str(logger.get("mode", "auto")))
    run = wandb.init(
        project=logger.get("project", "dist_train"), entity=logger.get("entity"), group=group, name=f"compare-{group}",
        job_type="compare", dir=str(out_dir), mode=mode, config={"strategies": [r["strategy"] for r in rows]},
        settings=wandb.Settings(console="off", x_disable_stats=True, silent=True),
    )
    columns = [c for c in CSV_COLUMNS if any(_csv_key(c) in r for r in rows)]
    table = wandb.Table(columns=columns, data=[[_cell(r.get(_csv_key(c))) for c in columns] for r in rows])
    payload: dict[str, Any] = {"comparison": table}
    for key, title in CHARTS:
        if key in columns:
            payload[f"chart/{key}"] = wandb.plot.bar(table, "strategy", key, title=title)
    payload.update({f"picture/{name}": wandb.Image(str(path)) for name, path in images.items()})
    run.log(payload)
    for r in rows:
        run.summary[f"{r['strategy']}/status"] = r["status"]
        for key in SUMMARY_KEYS:
            if r.get(key) is not None:
                run.summary[f"{r['strategy']}/{key}"] = r[key]
    local = Path(run.dir).parent
    run.finish()
    return local
