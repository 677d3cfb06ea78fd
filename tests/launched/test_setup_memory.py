"""Set-up's peak of anonymous memory (memory/setup_peak_anon_bytes): the sampler inside each rank, checked against
a sampler outside the ranks on a real launch; and the sampler on its own."""

from __future__ import annotations

import gc
import re
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

from dist_train.telemetry.memory import AnonPeak, HostPeak, anon_bytes
from dist_train.telemetry.recorder import setup_peaks
from tests.helpers import ROOT, TRAIN, env

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


# ---------------------------------------------------------------------------------------------- a real launch
def _model_dir(root: Path) -> Path:
    """A Llama directory of 60M parameters in one safetensors file (240 MB of fp32 weights): large beside what a
    rank's imports hold, so that set-up's share shows. tests/test_own_model.py's directories are kilobytes."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model("llama", vocab_size=32000, hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
                               num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=128,
                               tie_word_embeddings=False)
    model = AutoModelForCausalLM.from_config(cfg)
    out = root / "llama-60m"
    model.save_pretrained(out, max_shard_size="5GB")
    return out


def _sample_ranks(proc: subprocess.Popen, *, interval_s: float) -> dict[int, int]:
    """Each worker's peak of `rss - shared` (psutil, from /proc/<pid>/statm: anonymous resident memory, the figure
    a rank samples of itself), read every interval_s from outside until the launch ends, by rank. A worker counts
    from when its environment names its RANK (after exec: not the launcher's memory in a child not yet exec'd)."""
    launcher = psutil.Process(proc.pid)
    peaks: dict[int, int] = {}
    ranks: dict[int, int] = {}
    while proc.poll() is None:
        for child in launcher.children():
            try:
                if child.pid not in ranks:
                    rank = child.environ().get("RANK")
                    if rank is None:
                        continue
                    ranks[child.pid] = int(rank)
                mem = child.memory_info()
                peaks[child.pid] = max(peaks.get(child.pid, 0), mem.rss - mem.shared)
            except psutil.Error:  # gone, or not yet readable
                continue
        time.sleep(interval_s)
    return {ranks[pid]: peak for pid, peak in peaks.items()}


@pytest.mark.multiproc
def test_each_ranks_setup_peak_anon_is_what_a_sampler_outside_it_sees(tmp_path):
    """fsdp on 2 ranks loads a 240 MB safetensors directory; DIST_TRAIN_FAULT=raise@1 stops every rank just before
    step 1, after its telemetry has read set-up's peaks and logged them. So what a sampler outside the ranks sees
    over the whole life of each worker is set-up's peak: before set-up come the imports, whose memory stays and
    which set-up adds to; after it, an exception's few bytes. So the comparison covers the set-up window only. A completed run
    would add step 1's gradients and optimizer state, which the outside sampler could not tell from set-up.

    The figure compared is the rank's log line ("set-up peak: ... MiB anonymous"), made from the same dict the
    records get as memory/setup_peak_anon_bytes (tests above: setup_peaks). Both samplers read every 20 ms: a
    rise and fall shorter than that can be seen by one and missed by the other. The largest such here is a rank's
    rows of the largest tensor (the embedding or the head: 32.8 MB of 65.5 MB), read and copied into its shard;
    the tolerance is that, plus 16 MiB for the kernel's batched counters and the outside sampler's delays on a busy
    machine."""
    model = _model_dir(tmp_path)
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(TRAIN),
           "strategy=fsdp", "model=hf", f"model.path={model}", "logger=none", "train.seq_len=32",
           f"hydra.run.dir={run_dir}"]
    with open(tmp_path / "out.txt", "w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env(DIST_TRAIN_FAULT="raise@1"), stdout=out, stderr=out, text=True)
        try:
            outside = _sample_ranks(proc, interval_s=0.02)
        finally:
            proc.wait(timeout=300)
    said = (tmp_path / "out.txt").read_text()
    assert proc.returncode != 0 and "injected failure (DIST_TRAIN_FAULT=raise@1" in said, said[-3000:]
    assert sorted(outside) == [0, 1], outside
    for rank in (0, 1):
        log = (run_dir / "logs" / f"rank{rank}.log").read_text()
        found = re.search(r"set-up peak: ([\d.]+) MiB anonymous", log)
        assert found, log[-2000:]
        inside = float(found.group(1)) * MIB
        assert abs(inside - outside[rank]) <= 32.8 * MB + 16 * MIB, (rank, inside, outside[rank])
