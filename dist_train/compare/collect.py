"""Rows from runs that already happened: `compare.from=[PATH, ...]`, without training again.

A PATH is a run directory (it holds config.yaml, and summary.json once the run finished) or a directory of
them, e.g. a Hydra multirun sweep whose jobs ran as separate Slurm jobs, or an earlier comparison's output;
or a W&B run (`ENTITY/PROJECT/RUN_ID`) or group (`ENTITY/PROJECT/groups/NAME`), whose runs' saved files are
downloaded first.
Each run becomes a row labelled by its strategy (a comparison's runs keep their rows' labels and order); a run
without summary.json is a failed row.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from dist_train.compare.runner import RunResult
from dist_train.compare.settings import StrategySpec


def run_dirs(paths: list[str], *, cache: Path = Path("outputs/wandb-runs")) -> list[Path]:
    """The run directories named by `paths`, in the order given (a directory of runs: its runs, sorted). A path
    that is no local directory but reads as a W&B run (`ENTITY/PROJECT/RUN_ID`) or group
    (`ENTITY/PROJECT/groups/NAME`) is fetched from W&B into `cache` (see fetch_wandb_runs)."""
    found: list[Path] = []
    for text in paths:
        path = Path(text).expanduser().resolve()
        if not path.is_dir() and _wandb_path(text) is not None:
            found.extend(fetch_wandb_runs(text, cache=cache.resolve()))
            continue
        if not path.is_dir():
            raise ValueError(f"compare.from: {text} is not a directory (nor a W&B run ENTITY/PROJECT/RUN_ID or "
                             "group ENTITY/PROJECT/groups/NAME)")
        if _is_run(path):
            found.append(path)
            continue
        runs = sorted((p for p in path.iterdir() if p.is_dir() and _is_run(p)), key=_order(path))
        if not runs:
            raise ValueError(f"compare.from: {text} holds no run directory (one with config.yaml)")
        found.extend(runs)
    return found


def _wandb_path(text: str) -> tuple[str, str, str, str] | None:
    """(entity, project, "run" | "group", id or name) of a W&B run path or group path; None if `text` is neither."""
    parts = str(text).strip("/").split("/")
    if len(parts) == 3 and all(parts):
        return parts[0], parts[1], "run", parts[2]
    if len(parts) == 4 and parts[2] == "groups" and all(parts):
        return parts[0], parts[1], "group", parts[3]
    return None


def fetch_wandb_runs(text: str, *, cache: Path) -> list[Path]:
    """Download the run files every training run saves to W&B (config.yaml, summary.json, metrics.jsonl: see
    telemetry/wandb_sink.py) into `cache/<run id>/`, one run directory per run, as if it were local."""
    from dist_train.telemetry.wandb_sink import RUN_FILES, resolve_mode

    entity, project, kind, name = _wandb_path(text)  # type: ignore[misc]
    if resolve_mode("auto") != "online":
        raise ValueError(f"compare.from: {text} is not a local directory, and reading it from W&B needs an API key "
                         "(wandb login); or give the run directories")
    try:
        import wandb

        api = wandb.Api(timeout=60)
        if kind == "run":
            runs = [api.run(f"{entity}/{project}/{name}")]
        else:
            runs = [r for r in api.runs(f"{entity}/{project}", filters={"group": name}) if r.job_type == "train"]
        out = []
        for run in runs:
            target = cache / entity / project / run.id
            for file in RUN_FILES:
                run.file(file).download(root=str(target), replace=True)
            out.append(target)
    except Exception as exc:  # noqa: BLE001 - not found, no network, a rejected key: one line
        raise ValueError(f"compare.from: W&B cannot give {text}: {type(exc).__name__}: "
                         f"{(str(exc).strip().splitlines() or [''])[0]}") from exc
    if not out:
        raise ValueError(f"compare.from: the W&B group {text} holds no training run")
    return out


def _is_run(path: Path) -> bool:
    return (path / "config.yaml").is_file()


def _compared(parent: Path) -> dict[str, tuple[int, str, float]]:
    """{run directory name: (row position, row label, wall seconds)} when `parent` is a comparison's output
    (its table.json): rebuilt from its runs, the comparison reads as it did."""
    table = parent / "table.json"
    rows = json.loads(table.read_text()) if table.is_file() else []
    return {Path(r["run_dir"]).name: (i, r["strategy"], float(r.get("wall_s", 0.0))) for i, r in enumerate(rows)
            if isinstance(r, dict) and "run_dir" in r and "strategy" in r}


def _order(parent: Path) -> Any:
    """A comparison's output keeps its rows' order (its table.json); other runs: numbered ones (a multirun's
    jobs) by number, then by name."""
    position = {name: i for name, (i, _, _) in _compared(parent).items()}

    def key(path: Path) -> tuple[int, int, str]:
        if path.name in position:
            return (0, position[path.name], "")
        return (1, int(path.name), "") if path.name.isdigit() else (2, 0, path.name)

    return key


def collect(paths: list[str], *, cache: Path = Path("outputs/wandb-runs")) -> tuple[list[RunResult], dict[str, Any]]:
    """(a result per run, the first run's resolved config: the report's description of the training)."""
    dirs = run_dirs(paths, cache=cache)
    configs = [OmegaConf.to_container(OmegaConf.load(d / "config.yaml"), resolve=True) for d in dirs]
    names = [str(c["strategy"]["name"]) for c in configs]  # type: ignore[index]
    results = []
    compared = {parent: _compared(parent) for parent in {d.parent for d in dirs}}  # each table.json read once
    for run_dir, name in zip(dirs, names):
        _, label, seconds = compared[run_dir.parent].get(run_dir.name, (0, None, None))  # a comparison's own row
        if label is None:
            label = name if names.count(name) == 1 else f"{name}@{run_dir.name}"
        finished = (run_dir / "summary.json").is_file()
        reason = "" if finished else f"no summary.json: the run did not finish (see {run_dir / 'logs'})"
        results.append(RunResult(StrategySpec(label, name), run_dir, command=[], returncode=0 if finished else 1,
                                 seconds=_wall_s(run_dir) if seconds is None else seconds, reason=reason,
                                 log=_log(run_dir)))
    return results, configs[0]  # type: ignore[return-value]


def _wall_s(run_dir: Path) -> float:
    """From the first log line to summary.json (what the run took; 0 when unknown)."""
    first = run_dir / "logs" / "rank0.log"
    summary = run_dir / "summary.json"
    if not (first.is_file() and summary.is_file()):
        return 0.0
    try:
        stamp = first.read_text().split(",", 1)[0]
        start = time.mktime(time.strptime(stamp, "%Y-%m-%d %H:%M:%S"))
    except (ValueError, IndexError):
        return 0.0
    return max(0.0, summary.stat().st_mtime - start)


def _log(run_dir: Path) -> Path:
    own = run_dir / "compare.log"
    return own if own.is_file() else run_dir / "logs" / "rank0.log"
