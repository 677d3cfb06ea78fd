"""The console a user watches: each window's line (labelled loss, speed, MFU, the worst rank's memory, ETA), the
per-rank line, and a warning where one rank stands out."""

from __future__ import annotations

import logging
import os

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
    assert few.startswith("rank 0 (node n0): 1.00 GiB, 500 ms/step, comm 100 ms | rank 1") and warnings == []
    many, _ = ranks_text(_records(16, rss=[1.0] * 15 + [1.5]))
    assert many.startswith("16 ranks: memory 1.00 (rank 0) to 1.50 GiB (rank 15), median 1.00")


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
