"""Where gathered records go. Only rank 0 gets real sinks; every other rank gets `NullSink`."""

from __future__ import annotations

import json
import logging
import math
import os
import sys
from dataclasses import dataclass
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
# What a window's line too wide for its terminal gives up, first to last (see `progress_text`).
DROPPED_FIRST = ("tok/s", "mfu", "mean", "ppl", "where", "ms/step", "eval", "kind")
# On a terminal: rich's bar takes up to this many columns, and is left out when fewer than the least are free.
BAR_COLUMNS, LEAST_BAR_COLUMNS = 40, 10
TIME_COLUMNS = len("10:00:00")  # rich's time remaining, up to 99 hours


@dataclass(frozen=True)
class _Part:
    """A piece of a console line: `name` None is never dropped; `sep` goes before it (" | ", or "" for a detail of
    the piece before it)."""

    text: str
    name: str | None = None
    sep: str = " | "


def _join(parts: list[_Part]) -> str:
    return "".join(p.sep + p.text for p in parts)[len(parts[0].sep):] if parts else ""


def _cut(text: str, width: int | None) -> str:
    """`text`, cut to `width` columns with a closing "…" where it is longer (None: no limit)."""
    return text if width is None or len(text) <= width else text[:max(width - 1, 0)] + "…"


def _fit(parts: list[_Part], width: int | None) -> str:
    """Drop the named parts in DROPPED_FIRST order until the line fits `width`; cut what still does not fit."""
    kept = list(parts)
    for name in DROPPED_FIRST:
        if width is None or len(_join(kept)) <= width:
            break
        kept = [p for p in kept if p.name != name]
    return _cut(_join(kept), width)


def memory_of(rec: dict[str, Any]) -> tuple[int, str]:
    """A rank's peak of the window: its device allocator's on CUDA, else its resident host memory."""
    if "memory/peak_allocated_bytes" in rec:
        return int(rec["memory/peak_allocated_bytes"]), "allocated"
    return int(rec.get("memory/peak_rss_bytes", 0)), "host RSS"


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    h, rest = divmod(seconds, 3600)
    return f"{h}h{rest // 60:02d}m" if h else f"{rest // 60}m{rest % 60:02d}s"


def _window_parts(step: int, total: int, records: list[dict[str, Any]], *, window: int,
                  with_step: bool) -> list[_Part]:
    rec = records[0]
    worst = max(records, key=lambda r: memory_of(r)[0])
    nbytes, kind = memory_of(worst)
    share = (f", {nbytes / worst['device/total_memory_bytes'] * 100:.0f}% of the device"
             if worst.get("device/total_memory_bytes") else "")
    parts = [_Part(f"step {step}/{total}")] if with_step else []
    parts += [_Part(f"loss {rec['loss']:.4f}"),
              _Part(f" ({f'mean of {window} steps' if window > 1 else 'this step'})", "mean", sep="")]
    if "eval/loss" in rec:
        parts += [_Part(f"eval loss {rec['eval/loss']:.4f}", "eval"),
                  _Part(f" ppl {rec['eval/perplexity']:.2f}", "ppl", sep="")]
    parts += [_Part(f"{rec['time/step_s'] * 1e3:.0f} ms/step", "ms/step"),
              _Part(f"{rec['throughput/tokens_per_s']:,.0f} tok/s", "tok/s")]
    if rec.get("mfu") is not None:
        parts.append(_Part(f"MFU {rec['mfu'] * 100:.1f}%", "mfu"))
    parts += [_Part("peak"), _Part(f" {kind}", "kind", sep=""), _Part(f" {nbytes / GIB:.2f} GiB", sep=""),
              _Part(f" (rank {worst['rank']}{share})", "where", sep="")]
    if step < total:
        parts.append(_Part(f"ETA {_duration(rec['time/step_s'] * (total - step))}"))
    return parts


def progress_text(step: int, total: int, records: list[dict[str, Any]], *, window: int, width: int | None = None,
                  with_step: bool = False) -> str:
    """The window's line: (with `with_step`, `step s/total`), its loss (the mean of its steps, labelled so), the
    held-out loss and perplexity after an evaluation, speed, MFU where the peak is known, the worst rank's memory
    (with its rank, and its share of the device on CUDA) and the time left at this window's pace.

    Within `width` columns (None: no limit) it gives up, first to last: tok/s, MFU, the "(mean of N steps)"
    label, the held-out perplexity, the worst rank's "(rank r, x% of the device)", ms/step, the held-out loss,
    the kind of memory ("host RSS", "allocated"). Step/total, loss, the worst rank's memory and the ETA always
    stay; they are cut with "…" only where even they do not fit (below about 55 columns). Each rank's step time
    and memory are on the per-rank lines too."""
    return _fit(_window_parts(step, total, records, window=window, with_step=with_step), width)


def ranks_text(records: list[dict[str, Any]], *, width: int | None = None) -> tuple[list[str], list[str]]:
    """The per-rank lines: each rank's memory peak, step time and collective time in the window (the spread and
    the extremes beyond LIST_RANKS ranks), and a warning for each figure where one rank stands out from the
    median. One line where it fits `width` (None: no limit); else a short row per rank (its node last, and only
    where the ranks span several nodes) or the summary in three rows, each cut to `width` if need be."""
    if len(records) <= LIST_RANKS:
        line = " | ".join(f"rank {r['rank']} (node {r.get('node', 0)}): {_rank_figures(r)}" for r in records)
        many_nodes = len({r.get("node", 0) for r in records}) > 1
        rows = [f"rank {r['rank']}: {_rank_figures(r)}" + (f" (node {r.get('node', 0)})" if many_nodes else "")
                for r in records]
    else:
        line, rows = _ranks_summary(records)
    lines = [line] if width is None or len(line) <= width else [_cut(row, width) for row in rows]
    return lines, _standing_out(records)


def _rank_figures(r: dict[str, Any]) -> str:
    comm = f", comm {r['time/comm_s'] * 1e3:.0f} ms" if "time/comm_s" in r else ""
    if not comm and r.get("comm/untimed_count"):  # collectives ran, some untimed: their time is not known, not 0
        comm = ", comm n/a"
    return f"{memory_of(r)[0] / GIB:.2f} GiB, {r['time/step_s'] * 1e3:.0f} ms/step{comm}"


def _ranks_summary(records: list[dict[str, Any]]) -> tuple[str, list[str]]:
    """Beyond LIST_RANKS ranks: the memory's spread and extremes and the slowest rank, as a line and as rows."""
    import statistics

    mem = sorted(records, key=lambda r: memory_of(r)[0])
    (least, low), (most, high) = [(r["rank"], memory_of(r)[0] / GIB) for r in (mem[0], mem[-1])]
    median = statistics.median(memory_of(r)[0] for r in records) / GIB
    slow = max(records, key=lambda r: r["time/step_s"])
    slowest = f"slowest rank {slow['rank']} {slow['time/step_s'] * 1e3:.0f} ms/step"
    line = (f"{len(records)} ranks: memory {low:.2f} (rank {least}) to {high:.2f} GiB (rank {most}), median "
            f"{median:.2f}; {slowest}")
    rows = [f"{len(records)} ranks, memory median {median:.2f} GiB",
            f"least {low:.2f} GiB (rank {least}), most {high:.2f} GiB (rank {most})", slowest]
    return line, rows


def _standing_out(records: list[dict[str, Any]]) -> list[str]:
    import statistics

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
    return warnings


def plain_width() -> int | None:
    """The columns plain lines may take: $COLUMNS where set (as `shutil.get_terminal_size` reads it), less what the
    console's log format puts before each message; None without COLUMNS (a log file or a pipe keeps whole lines).
    Plain lines go to stderr only when it is no terminal, so the terminal size shutil would ask is not theirs."""
    columns = os.environ.get("COLUMNS", "")
    if not columns.isdigit() or int(columns) == 0:
        return None
    return max(int(columns) - _log_prefix_columns(), 1)


def _log_prefix_columns() -> int:
    """What the handlers writing to stderr print before a message (session.setup_logging's `[rank0] `)."""
    record = logging.LogRecord(log.name, logging.INFO, __file__, 0, "", None, None)
    handlers = [*logging.getLogger().handlers, *log.handlers]
    return max((len(h.format(record)) for h in handlers
                if getattr(h, "stream", None) in (sys.stderr, sys.__stderr__)), default=0)


class ConsoleProgress:
    """A rich progress bar on a terminal; a plain line per logged step otherwise (CI logs, files). Each window
    also gets the per-rank line (or rows), and a warning where one rank stands out. Both fit the terminal's width
    (rich's; $COLUMNS for plain lines): see `progress_text`, `ranks_text` and `_fit_bar`. `console`: a rich Console
    to draw the bar on (default: stderr's, where stderr is a terminal)."""

    def __init__(self, *, total_steps: int, description: str, done: int = 0, console: Any = None) -> None:
        self.total = total_steps
        self.start = self.last_step = done
        self.description = description
        self._progress = None
        if console is None and sys.stderr.isatty():
            from rich.console import Console

            console = Console(stderr=True)
        self.interactive = console is not None
        if console is not None:
            self._start_bar(console, done=done)

    def _start_bar(self, console: Any, *, done: int) -> None:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        self._description = TextColumn("[bold]{task.description}")
        self._bar = BarColumn(bar_width=BAR_COLUMNS)
        self._count = MofNCompleteColumn()
        self._time = TimeRemainingColumn()
        self._stats = TextColumn("{task.fields[stats]}", markup=False)
        self._progress = Progress(self._description, self._bar, self._count, self._time, self._stats,
                                  console=console)
        self._task = self._progress.add_task(self.description, total=self.total, completed=done, stats="")
        self._progress.start()

    def _fit_bar(self, parts: list[_Part]) -> str:
        """Lay the bar's columns out for the console's width now; return the stats that fit beside them.

        What gives way, first to last: the bar (its length, then all of it: M/N says the same), rich's time
        remaining (the stats' ETA says it), the stats' fields in `progress_text`'s order, the description (the
        strategy and world size, named at start-up). M/N and the stats' essentials always stay."""
        full = len(_join(parts))
        essential = len(_join([p for p in parts if p.name is None]))
        count = 2 * len(str(self.total)) + 1
        room = self._progress.console.width - count - (len(self.description) + 1) - (TIME_COLUMNS + 1) - 1
        columns = [self._description, self._bar, self._count, self._time, self._stats]
        bar = min(BAR_COLUMNS, room - full - 1)
        if bar >= LEAST_BAR_COLUMNS:
            self._bar.bar_width = bar
        else:
            columns.remove(self._bar)
            if room < full:
                columns.remove(self._time)
                room += TIME_COLUMNS + 1
            if room < essential:
                columns.remove(self._description)
                room += len(self.description) + 1
        self._progress.columns = tuple(columns)
        return _fit(parts, max(room, 1))

    def on_step(self, step: int) -> None:
        if self._progress is not None:
            self._progress.update(self._task, completed=step)

    def log(self, step: int, records: list[dict[str, Any]]) -> None:
        first, window, self.last_step = self.last_step == self.start, step - self.last_step, step
        if self._progress is not None:
            self._draw(step, records, window=window)
        else:
            self._write(step, records, window=window)
        warnings = [] if first else _standing_out(records)  # the first window carries set-up's one-off work
        for line in warnings:
            log.warning("step %d: %s", step, line)

    def _draw(self, step: int, records: list[dict[str, Any]], *, window: int) -> None:
        assert self._progress is not None
        stats = self._fit_bar(_window_parts(step, self.total, records, window=window, with_step=False))
        self._progress.update(self._task, completed=step, stats=stats)
        head = f"step {step}: "
        for line in ranks_text(records, width=max(self._progress.console.width - len(head), 1))[0]:
            self._progress.console.print(head + line, highlight=False, markup=False)

    def _write(self, step: int, records: list[dict[str, Any]], *, window: int) -> None:
        width = plain_width()
        log.info("%s", progress_text(step, self.total, records, window=window, width=width, with_step=True))
        head = f"step {step} ranks | "
        for line in ranks_text(records, width=None if width is None else max(width - len(head), 1))[0]:
            log.info("%s%s", head, line)

    def finish(self, summary: dict[str, Any]) -> None:
        if self._progress is not None:
            self._progress.stop()
