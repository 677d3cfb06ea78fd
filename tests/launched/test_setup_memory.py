"""Set-up's peak of anonymous memory (memory/setup_peak_anon_bytes): the sampler inside each rank, checked against
a sampler outside the ranks on a real launch. The sampler on its own: tests/unit/test_setup_memory.py."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from dist_train.telemetry.memory import anon_bytes
from tests.helpers import ROOT, TRAIN, env, forked_python

MB = 10**6
MIB = 2**20

pytestmark = pytest.mark.skipif(anon_bytes() is None, reason="needs Linux's /proc/self/statm")


# ---------------------------------------------------------------------------------------------- a real launch
def _model_dir(root: Path) -> Path:
    """A Llama directory of 60M parameters in one safetensors file (240 MB of fp32 weights): large beside what a
    rank's imports hold, so that set-up's share shows. tests/own_model_support.py's directories are kilobytes."""
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


def test_pythons_collector_is_on_again_when_the_training_starts(tmp_path):
    """launch/train.py turns Python's collector off for its imports (their collections were 10-13% of a run's
    start-up) and on again, with the imports' objects frozen, before the training's `main`: a run never trains with
    the collector off, where a cycle holding a tensor would be freed only at exit."""
    proc = forked_python(["tests/collector_script.py", "model=tiny", "logger=none", f"hydra.run.dir={tmp_path}"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen["exit"] in (0, None) and seen["enabled"] is True, seen
    assert seen["frozen"] > seen["frozen_before"], seen  # Hydra's config, at least, made since this process began
