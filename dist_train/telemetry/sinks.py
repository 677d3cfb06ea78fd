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


GIB = 2**30
# A rank stands out when its figure is this much over the ranks' median, and by at least this much.
OUTLIER_RATIO, OUTLIER_MEMORY_BYTES, OUTLIER_SECONDS = 1.25, 256 * 2**20, 0.05
# Up to this many ranks, the per-rank line lists each; beyond it, the spread and the extremes.
LIST_RANKS = 8


def memory_of(rec: dict[str, Any]) -> tuple[int, str]:
    """A rank's peak of the window: its device allocator's on CUDA, else its resident host memory."""
    if "memory/peak_allocated_bytes" in rec:
        return int(rec["memory/peak_allocated_bytes"]), "allocated"
    return int(rec.get("memory/peak_rss_bytes", 0)), "host RSS"


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    h, rest = divmod(seconds, 3600)
    return f"{h}h{rest // 60:02d}m" if h else f"{rest // 60}m{rest % 60:02d}s"


def progress_text(step: int, total: int, records: list[dict[str, Any]], *, window: int) -> str:
    """The window's line: its loss (the mean of its steps, labelled so), speed, MFU where the peak is known, the
    worst rank's memory (with its share of the device on CUDA) and the time left at this window's pace."""
    rec = records[0]
    held_out = f" | eval loss {rec['eval/loss']:.4f} ppl {rec['eval/perplexity']:.2f}" if "eval/loss" in rec else ""
    mean = f"mean of {window} steps" if window > 1 else "this step"
    mfu = f" | MFU {rec['mfu'] * 100:.1f}%" if rec.get("mfu") is not None else ""
    worst = max(records, key=lambda r: memory_of(r)[0])
    nbytes, kind = memory_of(worst)
    share = (f", {nbytes / worst['device/total_memory_bytes'] * 100:.0f}% of the device"
             if worst.get("device/total_memory_bytes") else "")
    eta = f" | ETA {_duration(rec['time/step_s'] * (total - step))}" if step < total else ""
    return (f"loss {rec['loss']:.4f} ({mean}){held_out} | {rec['time/step_s'] * 1e3:.0f} ms/step | "
            f"{rec['throughput/tokens_per_s']:,.0f} tok/s{mfu} | peak {kind} {nbytes / GIB:.2f} GiB "
            f"(rank {worst['rank']}{share}){eta}")


def ranks_text(records: list[dict[str, Any]]) -> tuple[str, list[str]]:
    """Each rank's memory peak, step time and collective time in the window (the spread and the extremes beyond
    LIST_RANKS ranks), and a warning for each figure where one rank stands out from the median."""
    import statistics

    def comm(r: dict[str, Any]) -> str:
        return f", comm {r['time/comm_s'] * 1e3:.0f} ms" if "time/comm_s" in r else ""

    if len(records) <= LIST_RANKS:
        text = " | ".join(f"rank {r['rank']} (node {r.get('node', 0)}): {memory_of(r)[0] / GIB:.2f} GiB, "
                          f"{r['time/step_s'] * 1e3:.0f} ms/step{comm(r)}" for r in records)
    else:
        mem = sorted(records, key=lambda r: memory_of(r)[0])
        slow = max(records, key=lambda r: r["time/step_s"])
        text = (f"{len(records)} ranks: memory {memory_of(mem[0])[0] / GIB:.2f} (rank {mem[0]['rank']}) to "
                f"{memory_of(mem[-1])[0] / GIB:.2f} GiB (rank {mem[-1]['rank']}), median "
                f"{statistics.median(memory_of(r)[0] for r in records) / GIB:.2f}; slowest rank {slow['rank']} "
                f"{slow['time/step_s'] * 1e3:.0f} ms/step")
    warnings = []
    # Not collective time: a rank that waits for a slow peer shows the wait there, so the fast rank would stand out.
    for what, value, floor, unit in (("memory", lambda r: memory_of(r)[0], OUTLIER_MEMORY_BYTES, GIB),
                                     ("step time", lambda r: r["time/step_s"], OUTLIER_SECONDS, 1e-3)):
        if len(records) < 2:
            break
        median = statistics.median(value(r) for r in records)
        top = max(records, key=value)
        if value(top) > OUTLIER_RATIO * median and value(top) - median >= floor:
            units = "GiB" if unit == GIB else "ms"
            warnings.append(f"rank {top['rank']} (node {top.get('node', 0)}) stands out: {what} "
                            f"{value(top) / unit:.2f} {units} against a median of {median / unit:.2f} {units}")
    return text, warnings


class ConsoleProgress:
    """A rich progress bar on a terminal; a plain line per logged step otherwise (CI logs, files). Each window
    also gets the per-rank line, and a warning where one rank stands out."""

    def __init__(self, *, total_steps: int, description: str, done: int = 0) -> None:
        self.total = total_steps
        self.start = self.last_step = done
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
        first, window, self.last_step = self.last_step == self.start, step - self.last_step, step
        text = progress_text(step, self.total, records, window=window)
        per_rank, warnings = ranks_text(records)
        if first:  # the first window carries set-up's one-off work (allocation, tracing): no rank judged on it
            warnings = []
        if self._progress is not None:
            self._progress.update(self._task, completed=step, stats=text)
            self._progress.console.print(f"step {step}: {per_rank}", highlight=False)
        else:
            log.info("step %d/%d | %s", step, self.total, text)
            log.info("step %d ranks | %s", step, per_rank)
        for line in warnings:
            log.warning("step %d: %s", step, line)

    def finish(self, summary: dict[str, Any]) -> None:
        if self._progress is not None:
            self._progress.stop()
