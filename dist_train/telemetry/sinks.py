"""Where gathered records go. Only rank 0 gets real sinks; every other rank gets `NullSink`."""

from __future__ import annotations

import json
import logging
import math
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
    """metrics.jsonl: one JSON object per rank per logged step."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._file = path.open("a", buffering=1)

    def on_step(self, step: int) -> None:
        pass

    def log(self, step: int, records: list[dict[str, Any]]) -> None:
        for rec in records:
            self._file.write(json.dumps({k: _json_safe(v) for k, v in rec.items()}) + "\n")

    def finish(self, summary: dict[str, Any]) -> None:
        self._file.close()


def progress_text(rec: dict[str, Any]) -> str:
    return (
        f"loss {rec['loss']:.4f} | {rec['time/step_s'] * 1e3:.0f} ms/step | "
        f"{rec['throughput/tokens_per_s']:,.0f} tok/s"
    )


class ConsoleProgress:
    """A rich progress bar on a terminal; a plain line per logged step otherwise (CI logs, files)."""

    def __init__(self, *, total_steps: int, description: str) -> None:
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
            self._task = self._progress.add_task(description, total=total_steps, stats="")
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
