"""Where gathered records go. Only rank 0 gets real sinks; every other rank gets `NullSink`."""

from __future__ import annotations

import json
import logging
import math
import os
import sys
from pathlib import Path
from typing import Any, Protocol

log = logging.getLogger("dist_train")


class Sink(Protocol):
    def on_step(self, step: int) -> None:
        """Called on every step (cheap: no host sync has happened)."""

    def log(self, step: int, records: list[dict[str, Any]]) -> None:
        """One record per rank, in rank order, for the window ending at `step`."""

    def finish(self, summary: dict[str, Any]) -> None: ...


class NullSink:
    def on_step(self, step: int) -> None:
        pass

    def log(self, step: int, records: list[dict[str, Any]]) -> None:
        pass

    def finish(self, summary: dict[str, Any]) -> None:
        pass


class FanOut:
    def __init__(self, *sinks: Sink) -> None:
        self.sinks = sinks

    def on_step(self, step: int) -> None:
        for s in self.sinks:
            s.on_step(step)

    def log(self, step: int, records: list[dict[str, Any]]) -> None:
        for s in self.sinks:
            s.log(step, records)

    def finish(self, summary: dict[str, Any]) -> None:
        for s in self.sinks:
            s.finish(summary)


def _json_safe(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None  # JSON has no NaN/inf
    return value


class JsonlSink:
    """metrics.jsonl: one JSON object per rank per logged step.

    A run that resumes after step s keeps the records of steps <= s and drops any later ones (a crashed
    attempt may have logged steps that were never checkpointed), so every step appears exactly once. A
    fresh start (s = 0) begins an empty file. `kept` holds the records kept, per logged step.
    """

    def __init__(self, path: Path, *, keep_through_step: int = 0) -> None:
        self.path = path
        self.kept = _keep_through(path, keep_through_step)
        self._file = path.open("a", buffering=1)

    def on_step(self, step: int) -> None:
        pass

    def log(self, step: int, records: list[dict[str, Any]]) -> None:
        for rec in records:
            self._file.write(json.dumps({k: _json_safe(v) for k, v in rec.items()}) + "\n")

    def finish(self, summary: dict[str, Any]) -> None:
        self._file.close()


def _keep_through(path: Path, step: int) -> list[list[dict[str, Any]]]:
    """Rewrite `path` (atomically) with only the records of steps <= `step`; return them grouped by step."""
    rows: list[dict[str, Any]] = []
    if path.is_file() and step > 0:
        for line in path.read_text().splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:  # a line cut short by a crash
                continue
            if isinstance(row, dict) and isinstance(row.get("step"), int) and row["step"] <= step:
                rows.append(row)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    os.replace(tmp, path)
    windows: dict[int, list[dict[str, Any]]] = {}
    for row in rows:
        windows.setdefault(row["step"], []).append(row)
    return [sorted(w, key=lambda r: r.get("rank", 0)) for _, w in sorted(windows.items())]


def progress_text(rec: dict[str, Any]) -> str:
    held_out = f" | eval loss {rec['eval/loss']:.4f} ppl {rec['eval/perplexity']:.2f}" if "eval/loss" in rec else ""
    return (
        f"loss {rec['loss']:.4f}{held_out} | {rec['time/step_s'] * 1e3:.0f} ms/step | "
        f"{rec['throughput/tokens_per_s']:,.0f} tok/s"
    )


class ConsoleProgress:
    """A rich progress bar on a terminal; a plain line per logged step otherwise (CI logs, files)."""

    def __init__(self, *, total_steps: int, description: str, done: int = 0) -> None:
        self.total = total_steps
        self.interactive = sys.stderr.isatty()
        self._progress = None
        if self.interactive:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self._progress = Progress(
                TextColumn("[bold]{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeRemainingColumn(),
                TextColumn("{task.fields[stats]}"),
                console=Console(stderr=True),
            )
            self._task = self._progress.add_task(description, total=total_steps, completed=done, stats="")
            self._progress.start()

    def on_step(self, step: int) -> None:
        if self._progress is not None:
            self._progress.update(self._task, completed=step)

    def log(self, step: int, records: list[dict[str, Any]]) -> None:
        text = progress_text(records[0])
        if self._progress is not None:
            self._progress.update(self._task, completed=step, stats=text)
        else:
            log.info("step %d/%d | %s", step, self.total, text)

    def finish(self, summary: dict[str, Any]) -> None:
        if self._progress is not None:
            self._progress.stop()
