"""Set-up's peak of anonymous memory (memory/setup_peak_anon_bytes): the sampler on its own, the peaks read when
set-up ends, and the comparison report's column. Checked against a sampler outside the ranks on a real launch:
tests/launched/test_setup_memory.py."""

from __future__ import annotations

import gc
import time

import pytest
import torch

from dist_train.telemetry.memory import AnonPeak, HostPeak, anon_bytes
from dist_train.telemetry.recorder import setup_peaks

MB = 10**6
MIB = 2**20

pytestmark = pytest.mark.skipif(anon_bytes() is None, reason="needs Linux's /proc/self/statm")


def _wait_for(condition, timeout_s: float = 30.0) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


def test_the_sampler_keeps_the_peak_of_an_allocation_that_came_and_went():
    sampler = AnonPeak().start()
    before = sampler.peak_bytes
    block = torch.ones(50_000_000)  # 200 MB, written: anonymous pages
    # Held until the sampler's thread has read it (not for a guessed time); then freed.
    assert _wait_for(lambda: sampler.peak_bytes >= before + 195 * MB), (before, sampler.peak_bytes)
    del block
    after = anon_bytes()
    peak = sampler.stop()
    assert peak >= before + 195 * MB and after < peak - 150 * MB, (before, peak, after)  # a peak, not the level
    assert sampler.stop() == peak  # stopping again changes nothing


def test_a_sampler_dropped_without_stop_ends_its_thread():
    sampler = AnonPeak().start()
    thread = sampler._thread
    assert thread is not None and thread.is_alive()
    del sampler
    gc.collect()
    thread.join(timeout=10)
    assert not thread.is_alive()


def test_setup_peaks_stops_the_sampler_and_reports_both_peaks():
    sampler = AnonPeak().start()
    peaks = setup_peaks(HostPeak(), [torch.device("cpu")], anon=sampler)
    assert sampler._thread is None  # stopped: set-up is over
    assert peaks["memory/setup_peak_anon_bytes"] == sampler.peak_bytes > 0
    # VmHWM counts what anonymous memory does, and file pages beside (this process's libraries at least)
    assert peaks["memory/setup_peak_rss_bytes"] > peaks["memory/setup_peak_anon_bytes"]


def test_the_comparison_report_shows_the_setup_peak_anonymous_beside_the_resident_one():
    from dist_train.compare.report import summary_table
    from dist_train.compare.table import memory_columns

    ranks = [{"memory/setup_peak_anon_bytes": 300 * MIB, "memory/setup_peak_rss_bytes": 500 * MIB},
             {"memory/setup_peak_anon_bytes": 310 * MIB, "memory/setup_peak_rss_bytes": 520 * MIB}]
    row = {"strategy": "fsdp", "status": "ok", "world_size": 2, "step_s": 0.1, "compute_s": 0.08, "comm_s": 0.02,
           "tokens_per_s": 100.0, "comm_bytes_per_step": 0.0, "final_loss": 1.0, **memory_columns(ranks)}
    assert row["mem_setup_peak_anon_max_bytes"] == 310 * MIB and row["mem_setup_peak_anon_spread_bytes"] == 10 * MIB
    header, _, body = summary_table([row]).splitlines()
    cells = dict(zip(header.split(" | "), body.split(" | ")))
    assert cells["set-up peak anon"] == "310.00 MiB (±10.00 MiB)", cells
    assert cells["set-up peak RSS"] == "520.00 MiB (±20.00 MiB)", cells


def test_the_collector_is_turned_on_and_the_imports_frozen_once_only():
    """runtime.imports_done acts after launch/train.py's own gc.disable() only: under Hydra's multirun (one job after
    another in one process) a later job's call leaves the collector and its frozen objects as they are."""
    import gc

    from dist_train.runtime import imports_done

    before = gc.get_freeze_count()
    assert gc.isenabled()
    imports_done()  # the collector already on: nothing to do
    assert gc.isenabled() and gc.get_freeze_count() == before
    gc.disable()
    try:
        imports_done()
        assert gc.isenabled() and gc.get_freeze_count() > before
    finally:
        gc.enable()
        if before == 0:  # nothing of this process was frozen before the test
            gc.unfreeze()
