"""What a run leaves behind: one run directory, metrics.jsonl, summary.json, per-rank logs, an offline W&B run."""

from __future__ import annotations

import glob
import re
from pathlib import Path

import pytest

from dist_train.versions import installed_versions
from tests.helpers import FAST, forked, launch, metrics, rel_diff, train_ok
from tests.wandb_log import read_run


def test_ddp_with_wandb_offline_leaves_every_output_and_right_figures(single_run, tmp_path):
    proc = launch(["strategy=ddp", *FAST, "logger=wandb"], run_dir=tmp_path, nproc=2, extra_env={"WANDB_MODE": ""})
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "wandb sync" in proc.stderr  # the offline run says how to upload it
    s = train_ok.__globals__["summary"](tmp_path)
    n = s["num_params"]

    # metrics.jsonl: one object per rank per logged step
    rows = metrics(tmp_path)
    assert sorted((r["step"], r["rank"]) for r in rows) == [(step, rank) for step in range(1, 6) for rank in (0, 1)]
    assert {"loss", "lr", "grad_norm", "time/step_s", "throughput/tokens_per_s", "memory/peak_rss_bytes",
            "memory/activations_bytes", "comm/all_reduce/busbw_gbps"} <= set(rows[-1])
    assert "mfu" not in rows[-1]  # no known peak FLOP/s on a CPU: no made-up MFU
    # Bus bandwidth leaves out the time a rank waited for its peer to issue the same all-reduce.
    for r in rows:
        wait, time_s = r["comm/all_reduce/wait_s"], r["comm/all_reduce/time_s"]
        assert 0 <= wait <= time_s
        assert r["comm/all_reduce/busbw_gbps"] == pytest.approx(r["comm/all_reduce/bytes"] / (time_s - wait) / 1e9)

    # summary.json
    _, single = single_run
    assert rel_diff(s["final_loss"], single["final_loss"]) < 1e-5
    assert s["strategy"] == "ddp" and s["world_size"] == 2 and s["mean_step_s"] > 0 and s["median_step_s"] > 0
    assert [r["rank"] for r in s["ranks"]] == [0, 1]
    assert all(r["memory/params_bytes"] == 4 * n for r in s["ranks"])
    assert s["versions"] == installed_versions() and s["versions"]["torch"]  # the versions that produced it
    assert (tmp_path / "config.yaml").read_text().count("strategy:") == 1
    assert (tmp_path / "logs" / "rank0.log").exists() and (tmp_path / "logs" / "rank1.log").exists()

    # exactly one W&B run (rank 0 only), named by strategy and world size, whose figures match metrics.jsonl
    runs = glob.glob(str(tmp_path / "wandb" / "offline-run-*" / "run-*.wandb"))
    assert len(runs) == 1
    wb = read_run(Path(runs[0]))
    assert wb["run"]["name"] == "ddp-ws2" and wb["run"]["group"].startswith("exp-")
    last = wb["history"][-1]
    assert last["_step"] == 5
    assert last["loss"] == pytest.approx(s["final_loss"], rel=1e-9)
    assert last["comm/all_reduce/bytes/rank0"] == last["comm/all_reduce/bytes/rank1"] == 4 * n
    assert last["memory/params_bytes/rank1"] == 4 * n
    assert wb["summary"]["final_loss"] == pytest.approx(s["final_loss"], rel=1e-9)


def test_ranks_share_the_default_run_directory(tmp_path):
    """No hydra.run.dir given: both ranks must still pick one directory (torchrun's run id names it)."""
    import subprocess
    import sys

    from tests.helpers import TRAIN, env

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(TRAIN),
           "strategy=fsdp", "logger=none", "train.steps=1"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    dirs = [p for p in (tmp_path / "outputs").iterdir()]
    assert len(dirs) == 1, dirs
    assert sorted(p.name for p in (dirs[0] / "logs").iterdir()) == ["rank0.log", "rank1.log"]
    assert len(metrics(dirs[0])) == 2
    assert not list(dirs[0].glob("*.log"))  # no shared Hydra log that both ranks append to


def test_dp_on_cpu_runs_says_it_parallelises_nothing_and_matches_single(single_run, tmp_path):
    proc = forked(["strategy=dp", *FAST], run_dir=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "parallelises nothing" in proc.stderr
    _, single = single_run
    s = train_ok.__globals__["summary"](tmp_path)
    assert s["losses"] == pytest.approx(single["losses"], rel=1e-6)


def test_ddp_runs_without_torchrun_as_one_process(single_run, tmp_path):
    s = train_ok(["strategy=ddp", *FAST], run_dir=tmp_path)
    _, single = single_run
    assert s["world_size"] == 1 and s["accumulation_steps"] == 4
    assert s["losses"] == pytest.approx(single["losses"], rel=1e-5)


def test_text_and_token_files_train_on_the_same_windows_and_ranks_agree(tmp_path):
    """data=textfile (bytes) on one process against data=tokens (the same text prepared with the byte tokenizer,
    memory-mapped) under fsdp on two: the same samples in the same order, so the same losses."""
    import subprocess
    import sys

    from tests.helpers import ROOT, env

    text = tmp_path / "corpus.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 200)
    tokens = tmp_path / "corpus.bin"
    proc = subprocess.run([sys.executable, "launch/prepare_tokens.py", str(text), str(tokens)], cwd=ROOT, env=env(),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert tokens.stat().st_size == 2 * text.stat().st_size  # one uint16 per byte
    one = train_ok(["strategy=single", "data=textfile", f"data.path={text}", *FAST],
                   run_dir=tmp_path / "single")
    two = train_ok(["strategy=fsdp", "data=tokens", f"data.path={tokens}", *FAST],
                   run_dir=tmp_path / "fsdp", nproc=2)
    assert two["losses"] == pytest.approx(one["losses"], rel=1e-5)
    assert one["losses"][-1] < one["losses"][0]  # repetitive English is learnable in 5 steps
    # the data source is named where a user looks: the summary and the first lines of the log
    assert (one["data"], one["data_path"], two["data"], two["data_path"]) == ("textfile", str(text), "tokens", str(tokens))
    log = (tmp_path / "fsdp" / "logs" / "rank0.log").read_text()
    assert f"data=tokens data.path={tokens}" in log
    # the console a user watches: each window's labelled loss, the worst rank's memory and the time left, then
    # every rank's line
    assert re.search(r"step 2/5 \| loss \d\.\d{4} \(this step\) \| .* \| peak host RSS \d+\.\d\d GiB \(rank [01]\) "
                     r"\| ETA 0m\d\ds", log), log[-3000:]
    assert re.search(r"step 2 ranks \| rank 0 \(node .*\): .* GiB, \d+ ms/step, comm \d+ ms \| rank 1 ", log), log[-3000:]


def test_two_agents_meet_through_a_rendezvous_endpoint_like_two_nodes(single_run, tmp_path):
    """The multi-node path: two torchrun agents (one process each) join through c10d at an endpoint."""
    import socket
    import subprocess
    import sys

    from tests.helpers import TRAIN, env

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=1",
           "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{port}", "--rdzv_id=dt-test-job",
           str(TRAIN), "strategy=ddp", *FAST]
    agents = [subprocess.Popen(cmd, cwd=tmp_path, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
              for _ in range(2)]
    outs = [a.communicate(timeout=300) for a in agents]
    assert all(a.returncode == 0 for a in agents), outs[0][1][-3000:] + outs[1][1][-3000:]
    run_dir = tmp_path / "outputs" / "ddp-dt-test-job"  # named from the shared rendezvous id
    s = train_ok.__globals__["summary"](run_dir)
    assert s["world_size"] == 2
    assert s["losses"] == pytest.approx(single_run[1]["losses"], rel=1e-5)
    assert sorted(p.name for p in (run_dir / "logs").iterdir()) == ["rank0.log", "rank1.log"]
