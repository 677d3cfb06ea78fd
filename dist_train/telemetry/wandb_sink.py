"""Weights & Biases: one W&B run per training launch, initialised by rank 0 only.

Rank 0 logs every rank's figures (gathered), so one run holds the whole job: per-rank keys end in
`/rank<r>` (`memory/params_bytes/rank1`), and the max over ranks is logged as `/max` so a dashboard can
compare strategies on their worst rank. Loss, lr, grad norm, throughput and MFU are job-wide. Without an
API key the run is offline: nothing touches the network, and the end of the run says how to sync it.
"""

from __future__ import annotations

import logging
import netrc
import os
from pathlib import Path
from typing import Any

from dist_train.config import LoggerConfig
from dist_train.telemetry.recorder import GLOBAL_KEYS

log = logging.getLogger("dist_train")

_NOT_FIGURES = ("step", "rank")


def resolve_mode(mode: str) -> str:
    """`auto` means online only when an API key is configured; WANDB_MODE in the environment wins."""
    env = os.environ.get("WANDB_MODE")
    if env == "":
        del os.environ["WANDB_MODE"]  # wandb rejects an empty mode; empty means unset
    elif env:
        return env
    if mode != "auto":
        return mode
    return "online" if has_api_key() else "offline"


def has_api_key() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        hosts = netrc.netrc().hosts
    except (FileNotFoundError, netrc.NetrcParseError, OSError):
        return False
    return any("wandb" in host for host in hosts)


def wandb_payload(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Flatten one window's per-rank records into W&B keys."""
    data: dict[str, Any] = {k: records[0][k] for k in GLOBAL_KEYS if records[0].get(k) is not None}
    for rec in records:
        for key, value in rec.items():
            per_rank = key not in GLOBAL_KEYS and key not in _NOT_FIGURES and "/" in key
            if per_rank and isinstance(value, (int, float)):
                data[f"{key}/rank{rec['rank']}"] = value
                data[f"{key}/max"] = max(data.get(f"{key}/max", value), value)
    return data


class WandbSink:
    def __init__(self, cfg: LoggerConfig, *, run_dir: Path, name: str, group: str, config: dict[str, Any]) -> None:
        import wandb

        self.mode = resolve_mode(cfg.mode)
        self.run = wandb.init(
            project=cfg.project,
            entity=cfg.entity,
            group=group,
            name=name,
            job_type="train",
            config=config,
            dir=str(run_dir),
            mode=self.mode,
            settings=wandb.Settings(console="off", x_disable_stats=True, silent=True),
        )

    def on_step(self, step: int) -> None:
        pass

    def log(self, step: int, records: list[dict[str, Any]]) -> None:
        self.run.log(wandb_payload(records), step=step)

    def finish(self, summary: dict[str, Any]) -> None:
        for key, value in summary.items():
            if not isinstance(value, (list, dict)):
                self.run.summary[key] = value
        worst: dict[str, Any] = {}
        for row in summary.get("ranks", []):
            for key, value in row.items():
                if key != "rank":
                    self.run.summary[f"peak/{key}/rank{row['rank']}"] = value
                    worst[key] = max(worst.get(key, value), value)
        for key, value in worst.items():  # the worst rank: what a group dashboard compares strategies on
            self.run.summary[f"peak/{key}/max"] = value
        run_dir = Path(self.run.dir).parent  # .../wandb/offline-run-<time>-<id>
        self.run.finish()
        if self.mode == "offline":
            log.info("W&B offline run: %s  (upload with: wandb sync %s)", run_dir, run_dir)
        else:
            log.info("W&B run: %s", getattr(self.run, "url", run_dir))
