"""The console a user watches: each window's line (labelled loss, speed, MFU, the worst rank's memory, ETA), the
per-rank line, and a warning where one rank stands out. A real run's lines at 80 columns:
tests/launched/test_console.py."""

from __future__ import annotations

import io
import logging
import os
import re
import sys

import pytest

from dist_train.telemetry.sinks import GIB, ConsoleProgress, progress_text, ranks_text


def _records(n: int, *, rss: list[float] | None = None, step_s: list[float] | None = None, **extra) -> list[dict]:
    rss = rss or [1.0] * n
    step_s = step_s or [0.5] * n
    return [{"rank": r, "node": f"n{r // 4}", "loss": 2.5, "time/step_s": step_s[r], "time/comm_s": 0.1,
             "throughput/tokens_per_s": 4096.0, "memory/peak_rss_bytes": int(rss[r] * GIB), **extra}
            for r in range(n)]


def test_the_window_line_labels_its_loss_and_names_the_worst_rank_and_the_time_left():
    line = progress_text(10, 300, _records(4, rss=[1, 1, 3, 1]), window=10)
    assert "loss 2.5000 (mean of 10 steps)" in line
    assert "peak host RSS 3.00 GiB (rank 2)" in line
    assert "ETA 2m25s" in line  # 290 steps left at 0.5 s
    assert "MFU" not in line  # no known peak (CPU)
    last = progress_text(300, 300, _records(1), window=1)
    assert "(this step)" in last and "ETA" not in last
    # on CUDA: the allocator's peak and its share of the device, and MFU
    cuda = _records(2, **{"memory/peak_allocated_bytes": 60 * GIB, "device/total_memory_bytes": 80 * GIB, "mfu": 0.42})
    line = progress_text(5, 10, cuda, window=5)
    assert "peak allocated 60.00 GiB (rank 0, 75% of the device)" in line and "MFU 42.0%" in line


def test_the_per_rank_line_lists_few_ranks_and_sums_up_many():
    few, warnings = ranks_text(_records(2))
    assert len(few) == 1 and warnings == []
    assert few[0].startswith("rank 0 (node n0): 1.00 GiB, 500 ms/step, comm 100 ms | rank 1")
    many, _ = ranks_text(_records(16, rss=[1.0] * 15 + [1.5]))
    assert many == ["16 ranks: memory 1.00 (rank 0) to 1.50 GiB (rank 15), median 1.00; slowest rank 0 500 ms/step"]


# The window of a CUDA run with every field: eval, MFU, the device's share.
FULL = {"memory/peak_allocated_bytes": 60 * GIB, "device/total_memory_bytes": 80 * GIB, "mfu": 0.42,
        "eval/loss": 2.7, "eval/perplexity": 14.88}
PREFIX = len("[rank0] ")  # session.setup_logging's console format, which a user sees before every line


def test_at_160_columns_the_window_line_gives_up_only_its_least_fields():
    whole = progress_text(10, 300, _records(4, **FULL), window=10, with_step=True)
    assert len(whole) > 160 - PREFIX  # so something must give way
    line = progress_text(10, 300, _records(4, **FULL), window=10, width=160 - PREFIX, with_step=True)
    assert line == ("step 10/300 | loss 2.5000 | eval loss 2.7000 ppl 14.88 | 500 ms/step | "
                    "peak allocated 60.00 GiB (rank 0, 75% of the device) | ETA 2m25s")
    assert "tok/s" not in line and "MFU" not in line and "mean of" not in line  # the first three to go


def test_at_80_columns_the_window_line_keeps_step_eta_loss_and_memory():
    line = progress_text(10, 300, _records(4, rss=[1, 1, 3, 1], **FULL), window=10, width=80 - PREFIX,
                         with_step=True)
    assert line == "step 10/300 | loss 2.5000 | peak allocated 60.00 GiB | ETA 2m25s"
    cpu = progress_text(1000, 100000, _records(4, rss=[1, 1, 3, 1]), window=10, width=80 - PREFIX, with_step=True)
    assert cpu == "step 1000/100000 | loss 2.5000 | peak host RSS 3.00 GiB | ETA 13h45m"
    narrow = progress_text(10, 300, _records(1), window=10, width=55, with_step=True)
    assert narrow == "step 10/300 | loss 2.5000 | peak 1.00 GiB | ETA 2m25s"  # the kind of memory goes last


@pytest.mark.parametrize(("width", "lines"), [
    (160, ["rank 0 (node n0): 1.00 GiB, 500 ms/step, comm 100 ms | rank 1 (node n0): 1.00 GiB, 500 ms/step, "
           "comm 100 ms"]),
    (80, ["rank 0: 1.00 GiB, 500 ms/step, comm 100 ms", "rank 1: 1.00 GiB, 500 ms/step, comm 100 ms"]),
])
def test_the_per_rank_line_fits_or_becomes_a_row_per_rank(width, lines):
    head = len("[rank0] step 10 ranks | ")
    assert ranks_text(_records(2), width=width - head)[0] == lines


def test_rows_name_the_node_last_where_ranks_span_nodes_and_the_summary_splits():
    rows, _ = ranks_text(_records(8), width=80 - 24)
    assert rows[0] == "rank 0: 1.00 GiB, 500 ms/step, comm 100 ms (node n0)" and rows[7].endswith("(node n1)")
    summary, _ = ranks_text(_records(16, rss=[1.0] * 15 + [1.5]), width=80 - 24)
    untimed = [{k: v for k, v in r.items() if k != "time/comm_s"} | {"comm/untimed_count": 43} for r in _records(2)]
    assert ranks_text(untimed, width=56)[0][0] == "rank 0: 1.00 GiB, 500 ms/step, comm n/a"
    assert summary == ["16 ranks, memory median 1.00 GiB", "least 1.00 GiB (rank 0), most 1.50 GiB (rank 15)",
                       "slowest rank 0 500 ms/step"]
    assert all(len(row) <= 20 for row in ranks_text(_records(8), width=20)[0])  # cut where nothing else fits


def test_plain_lines_fit_columns_with_the_log_prefix(caplog, monkeypatch):
    monkeypatch.setattr("sys.stderr.isatty", lambda: False, raising=False)
    monkeypatch.setenv("COLUMNS", "80")
    handler = logging.StreamHandler(sys.stderr)  # as session.setup_logging's console handler
    handler.setFormatter(logging.Formatter("[rank0] %(message)s"))
    logging.getLogger().addHandler(handler)
    try:
        with caplog.at_level(logging.INFO, logger="dist_train"):
            ConsoleProgress(total_steps=300, description="fsdp x2").log(10, _records(2, **FULL))
    finally:
        logging.getLogger().removeHandler(handler)
    lines = [PREFIX * "x" + r.getMessage() for r in caplog.records]
    assert lines[0].endswith("step 10/300 | loss 2.5000 | peak allocated 60.00 GiB | ETA 2m25s")
    assert lines[1].endswith("step 10 ranks | rank 0: 60.00 GiB, 500 ms/step, comm 100 ms") and len(lines) == 3
    assert max(len(line) for line in lines) <= 80


def _drawn(width: int, records: list[dict]) -> tuple[str, list[str]]:
    """The rich bar as a terminal `width` columns wide shows it after one window, and the lines printed above it."""
    from rich.console import Console

    out = io.StringIO()
    console = ConsoleProgress(total_steps=300, description="fsdp x2",
                              console=Console(file=out, force_terminal=True, width=width, color_system=None))
    console.log(10, records)
    bar = io.StringIO()
    Console(file=bar, width=width, color_system=None).print(console._progress.get_renderable())
    console.finish({})
    printed = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", out.getvalue()).replace("\r", "\n").splitlines()
    return bar.getvalue().rstrip("\n"), [ln for ln in printed if ln.startswith("step ")]


def test_the_bar_at_80_columns_keeps_the_count_eta_loss_and_memory():
    bar, ranks = _drawn(80, _records(2, rss=[1, 3]))
    # no bar, no rich time remaining (the stats' ETA says it), then the stats' fields give way in their order
    assert bar == "fsdp x2  10/300 loss 2.5000 | 500 ms/step | peak host RSS 3.00 GiB | ETA 2m25s"
    assert ranks == ["step 10: rank 0: 1.00 GiB, 500 ms/step, comm 100 ms",
                     "step 10: rank 1: 3.00 GiB, 500 ms/step, comm 100 ms"]


def test_the_bar_at_160_columns_shows_everything():
    bar, ranks = _drawn(160, _records(2, rss=[1, 3]))
    assert len(bar) <= 160 and "━" in bar and "-:--:--" in bar and "…" not in bar
    assert bar.endswith(" 10/300 -:--:-- loss 2.5000 (mean of 10 steps) | 500 ms/step | 4,096 tok/s | "
                        "peak host RSS 3.00 GiB (rank 1) | ETA 2m25s")
    assert ranks == ["step 10: rank 0 (node n0): 1.00 GiB, 500 ms/step, comm 100 ms | "
                     "rank 1 (node n0): 3.00 GiB, 500 ms/step, comm 100 ms"]


@pytest.mark.parametrize(("rss", "step_s", "says"), [
    ([1, 1, 1, 2], None, "rank 3 (node n0) stands out: memory 2.00 GiB against a median of 1.00 GiB"),
    (None, [0.5, 0.9, 0.5, 0.5], "rank 1 (node n0) stands out: step time 900.00 ms against a median of 500.00 ms"),
])
def test_a_rank_that_stands_out_is_named(rss, step_s, says):
    _, warnings = ranks_text(_records(4, rss=rss, step_s=step_s))
    assert warnings == [says]


def test_small_differences_are_not_warnings():
    # 20 % over the median, or 1.5x of a tiny figure: noise, not a finding
    assert ranks_text(_records(4, rss=[1, 1, 1, 1.2]))[1] == []
    assert ranks_text(_records(4, rss=[0.1, 0.1, 0.1, 0.15]))[1] == []


def test_the_console_logs_both_lines_and_warns_from_the_second_window_on(caplog, monkeypatch):
    monkeypatch.setattr("sys.stderr.isatty", lambda: False, raising=False)
    monkeypatch.delenv("COLUMNS", raising=False)  # a log: whole lines
    console = ConsoleProgress(total_steps=20, description="fsdp x4")
    lopsided = _records(4, rss=[1, 1, 1, 2])
    with caplog.at_level(logging.INFO, logger="dist_train"):
        console.log(10, lopsided)
        first = [r.getMessage() for r in caplog.records]
        console.log(20, lopsided)
    assert first[0].startswith("step 10/20 | loss 2.5000 (mean of 10 steps)") and first[1].startswith("step 10 ranks |")
    assert len(first) == 2  # the first window: set-up's one-off work, no rank judged on it
    assert caplog.records[-1].levelno == logging.WARNING and "rank 3 (node n0) stands out" in caplog.records[-1].getMessage()


def test_a_repeated_warning_is_shown_once_then_counted(monkeypatch):
    """Libraries that enter warnings.catch_warnings reset Python's once-per-place registry, so torch's backward-hook
    warnings came back every ZeRO-3 step; here each is shown once and the end names the repeats."""
    import warnings

    from dist_train.quiet import RepeatedWarnings

    shown = []
    monkeypatch.setattr(warnings, "showwarning", lambda message, *a, **k: shown.append(str(message)))
    repeated = RepeatedWarnings().install()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            for _ in range(3):
                warnings.warn("hook fired again", UserWarning, stacklevel=1)
            warnings.warn("once only", UserWarning, stacklevel=1)
    finally:
        repeated.uninstall()
    assert shown == ["hook fired again", "once only"]
    assert [line.split(" at ")[0] for line in repeated.summary()] == ["3 x UserWarning"]
    assert repeated.summary()[0].endswith("hook fired again")


def test_deepspeed_is_told_the_cpu_where_there_is_no_cuda(monkeypatch):
    import torch

    from dist_train.quiet import quiet_deepspeed_on_cpu

    monkeypatch.setenv("DS_ACCELERATOR", "unset at the end")  # so that monkeypatch removes what the call sets
    monkeypatch.delenv("DS_ACCELERATOR")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    quiet_deepspeed_on_cpu()
    assert os.environ["DS_ACCELERATOR"] == "cpu"
    monkeypatch.setenv("DS_ACCELERATOR", "cuda")  # a choice already made is kept
    quiet_deepspeed_on_cpu()
    assert os.environ["DS_ACCELERATOR"] == "cuda"
