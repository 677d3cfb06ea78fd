"""Weights & Biases: one W&B run per training launch, initialised by rank 0 only.

Rank 0 logs every rank's figures (gathered), so one run holds the whole job: per-rank keys end in
`/rank<r>` (`memory/params_bytes/rank1`), and the max over ranks is logged as `/max` so a dashboard can
compare strategies on their worst rank. Loss, lr, grad norm, throughput and MFU are job-wide. Without an
API key the run is offline: nothing touches the network, and the end of the run says how to sync it.

Trouble with W&B never stops or slows training. An unreachable server (checked in a few seconds before
`wandb.init`, which would otherwise retry for `logger.init_timeout_s`), a rejected key, or any other failure
of an online start: the run logs offline instead. An offline start that fails, or any later error while
logging: W&B is off for the rest of the run. Each fallback is said once, as one warning line.
A resumed run continues the same W&B run (`resume="allow"` with the run id its checkpoint stored).
"""

from __future__ import annotations

import logging
import netrc
import os
import socket
from pathlib import Path
from typing import Any, Optional
from urllib.parse import urlparse

from dist_train.config import LoggerConfig
from dist_train.telemetry.recorder import GLOBAL_KEYS

log = logging.getLogger("dist_train")

_NOT_FIGURES = ("step", "rank", "local_rank")
# What a run's summary keeps of each series (wandb.define_metric): memory its peak, times and rates their mean.
SUMMARIES = (("memory/*", "max"), ("time/*", "mean"), ("comm/*", "mean"), ("throughput/*", "mean"), ("mfu", "mean"),
             ("loss", "last"), ("grad_norm", "mean"))
_REACH_TIMEOUT_S = 5.0
# What a run directory holds that a comparison reads (compare/table.py), saved into each W&B run.
RUN_FILES = ("config.yaml", "summary.json", "metrics.jsonl")


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


def unreachable(base_url: str, timeout_s: float = _REACH_TIMEOUT_S) -> Optional[str]:
    """Why the W&B server at `base_url` cannot be reached (a TCP connect), or None if it can."""
    url = urlparse(base_url)
    host = url.hostname or ""
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return None
    except OSError as exc:
        return f"{host}:{port}: {exc.strerror or exc}"


def _never_issued(records: list[dict[str, Any]]) -> set[str]:
    """Collective prefixes (`comm/<op>`, `comm/<dim>/<op>`) that no rank issued in this window: no series for them
    (metrics.jsonl keeps their zeros)."""
    prefixes = {k[: -len("/count")] for rec in records for k in rec if k.startswith("comm/") and k.endswith("/count")}
    return {p for p in prefixes if not any(rec.get(f"{p}/count") for rec in records)}


def wandb_payload(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Flatten one window's per-rank records into W&B keys."""
    data: dict[str, Any] = {k: records[0][k] for k in GLOBAL_KEYS if records[0].get(k) is not None}
    silent = _never_issued(records)
    for rec in records:
        for key, value in rec.items():
            per_rank = key not in GLOBAL_KEYS and key not in _NOT_FIGURES and "/" in key
            if per_rank and key.startswith("comm/") and key.rsplit("/", 1)[0] in silent:
                continue
            if per_rank and isinstance(value, (int, float)):
                data[f"{key}/rank{rec['rank']}"] = value
                data[f"{key}/max"] = max(data.get(f"{key}/max", value), value)
    return data


class WandbSink:
    def __init__(
        self, cfg: LoggerConfig, *, run_dir: Path, name: str, group: str, config: dict[str, Any],
        resume_id: Optional[str] = None,
    ) -> None:
        self.run: Any = None
        self.run_dir = run_dir
        self.mode = resolve_mode(cfg.mode)
        self._init_kwargs = dict(
            project=cfg.project, entity=cfg.entity, group=group, name=name, job_type="train", config=config,
            dir=str(run_dir), init_timeout_s=cfg.init_timeout_s,
            **({"id": resume_id, "resume": "allow"} if resume_id else {}),
        )
        self._start()

    @property
    def run_id(self) -> Optional[str]:
        return getattr(self.run, "id", None)

    def _start(self) -> None:
        if self.mode == "online":
            import wandb

            why = unreachable(wandb.setup().settings.base_url)  # WANDB_BASE_URL, `wandb login --host`, ...
            if why is None:
                try:
                    self.run = self._init("online")
                    return
                except Exception as exc:  # noqa: BLE001 - a key rejected, a timeout, ...: offline instead
                    why = _first_line(exc)
            log.warning("W&B: cannot log online (%s); logging offline instead", why)
            self.mode = "offline"
        if self.mode == "disabled":
            return
        try:
            self.run = self._init(self.mode)
        except Exception as exc:  # noqa: BLE001 - e.g. the run directory refuses the files
            self._off(exc)

    def _init(self, mode: str) -> Any:
        import wandb

        kwargs = dict(self._init_kwargs)
        timeout_s = kwargs.pop("init_timeout_s")
        run = wandb.init(
            mode=mode, **kwargs,
            settings=wandb.Settings(console="off", x_disable_stats=True, silent=True, init_timeout=timeout_s),
        )
        for pattern, summary in SUMMARIES:
            run.define_metric(pattern, summary=summary)
        return run

    def _off(self, exc: BaseException) -> None:
        log.warning("W&B: %s; W&B is off for the rest of this run (metrics.jsonl and summary.json go on)",
                    _first_line(exc))
        self.run = None
        self.mode = "disabled"

    def on_step(self, step: int) -> None:
        pass

    def log(self, step: int, records: list[dict[str, Any]]) -> None:
        if self.run is None:
            return
        try:
            self.run.log(wandb_payload(records), step=step)
        except Exception as exc:  # noqa: BLE001 - never let logging stop the training
            self._off(exc)

    def finish(self, summary: dict[str, Any]) -> None:
        if self.run is None:
            return
        try:
            self._write_summary(summary)
            self._save_run_files()
            run_dir = Path(self.run.dir).parent  # .../wandb/offline-run-<time>-<id>
            self.run.finish()
        except Exception as exc:  # noqa: BLE001
            self._off(exc)
            return
        if self.mode == "offline":
            log.info("W&B offline run: %s  (upload with: wandb sync %s)", run_dir, run_dir)
        else:
            log.info("W&B run: %s", getattr(self.run, "url", run_dir))

    def _save_run_files(self) -> None:
        """The run directory's config.yaml, summary.json and metrics.jsonl go into the W&B run's files: from them
        `compare.from=<entity/project/run id>` rebuilds the run's row without the run directory."""
        import shutil

        for name in RUN_FILES:  # what lies in the run's own files directory is uploaded with it (now, or at sync)
            path = self.run_dir / name
            if path.is_file():
                shutil.copyfile(path, Path(self.run.dir) / name)

    def _write_summary(self, summary: dict[str, Any]) -> None:
        for key, value in summary.items():
            if not isinstance(value, (list, dict)):
                self.run.summary[key] = value
        worst: dict[str, Any] = {}
        least: dict[str, Any] = {}
        for row in summary.get("ranks", []):
            for key, value in row.items():
                if key not in ("rank", "node", "local_rank"):
                    self.run.summary[f"peak/{key}/rank{row['rank']}"] = value
                    worst[key] = max(worst.get(key, value), value)
                    if key.startswith("memory/"):
                        least[key] = min(least.get(key, value), value)
        for key, value in worst.items():  # the worst rank: what a group dashboard compares strategies on
            self.run.summary[f"peak/{key}/max"] = value
            if key in least:  # how unevenly the ranks hold it (a pipeline's stages, dp's master GPU)
                self.run.summary[f"peak/{key}/spread"] = value - least[key]
        for category, value in (summary.get("predicted_memory_bytes") or {}).items():
            self.run.summary[f"predicted/memory/{category}_bytes"] = value


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")
