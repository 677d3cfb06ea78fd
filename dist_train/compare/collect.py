"""Rows from runs that already happened: `compare.from=[PATH, ...]`, without training again.

A PATH is a run directory (it holds config.yaml, and summary.json once the run finished) or a directory of
them, e.g. a Hydra multirun sweep whose jobs ran as separate Slurm jobs, or an earlier comparison's output.
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


def run_dirs(paths: list[str]) -> list[Path]:
    """The run directories named by `paths`, in the order given (a directory of runs: its runs, sorted)."""
    found: list[Path] = []
    for text in paths:
        path = Path(text).expanduser().resolve()
        if not path.is_dir():
            raise ValueError(f"compare.from: {text} is not a directory")
        if _is_run(path):
            found.append(path)
            continue
        runs = sorted((p for p in path.iterdir() if p.is_dir() and _is_run(p)), key=_order(path))
        if not runs:
            raise ValueError(f"compare.from: {text} holds no run directory (one with config.yaml)")
        found.extend(runs)
    return found


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


def collect(paths: list[str]) -> tuple[list[RunResult], dict[str, Any]]:
    """(a result per run, the first run's resolved config: the report's description of the training)."""
    dirs = run_dirs(paths)
    configs = [OmegaConf.to_container(OmegaConf.load(d / "config.yaml"), resolve=True) for d in dirs]
    names = [str(c["strategy"]["name"]) for c in configs]  # type: ignore[index]
    results = []
    for run_dir, name in zip(dirs, names):
        _, label, seconds = _compared(run_dir.parent).get(run_dir.name, (0, None, None))  # a comparison's own row
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
