"""Real Slurm jobs on a real (local) Slurm cluster: two virtual nodes on this host (tests/slurm/cluster.sh).

The cluster is started by the tests (Debian's slurm-wlm is installed when missing, which needs root) and
stopped at the end. Jobs are submitted exactly as docs/slurm.md says: `sbatch --nodes=N launch/slurm.sbatch ...`.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest

from dist_train.telemetry.bandwidth import COMM_OPS
from tests.helpers import FAST, ROOT, TRAIN, env, metrics

pytestmark = pytest.mark.slurm

CLUSTER = ROOT / "tests" / "slurm" / "cluster.sh"
LAB = ROOT / ".slurm-local"
SBATCH = ROOT / "launch" / "slurm.sbatch"


@pytest.fixture(scope="module")
def slurm() -> dict[str, str]:
    proc = subprocess.run([str(CLUSTER), "start"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"could not start the local Slurm cluster:\n{proc.stdout}\n{proc.stderr}"
    environment = env(SLURM_CONF=str(LAB / "etc" / "slurm.conf"), PYTHON=sys.executable)
    yield environment
    subprocess.run([str(CLUSTER), "stop"], capture_output=True, text=True, timeout=120)


def submit(slurm: dict[str, str], out: Path, *args: str, nodes: int, nproc: int | None = None) -> str:
    environment = dict(slurm)
    if nproc is not None:
        environment["NPROC_PER_NODE"] = str(nproc)
    out.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(
        ["sbatch", "--parsable", f"--nodes={nodes}", f"--output={out}/slurm-%j.out", str(SBATCH), *args],
        cwd=ROOT, env=environment, capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip().split(";")[0]


def job(slurm: dict[str, str], job_id: str) -> dict[str, str]:
    text = subprocess.run(["scontrol", "show", "job", job_id], env=slurm, capture_output=True, text=True).stdout
    return dict(field.split("=", 1) for field in text.split() if "=" in field)


def wait(slurm: dict[str, str], job_id: str, timeout_s: float = 300) -> dict[str, str]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        info = job(slurm, job_id)
        if info.get("JobState") not in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING", None):
            return info
        time.sleep(1)
    raise AssertionError(f"job {job_id} still {job(slurm, job_id).get('JobState')} after {timeout_s} s")


def output(out: Path, job_id: str) -> str:
    return (out / f"slurm-{job_id}.out").read_text()


PARITY = ("ddp", "fsdp", "zero2")
# The strategies whose one-node run is a Slurm job too (where Slurm places both ranks); the others' is the suite's
# forked run of the same overrides (conftest's fast_run: the same training, without a job's fresh interpreters).
ONE_NODE_JOB = ("ddp",)


@pytest.fixture(scope="module")
def parity_jobs(slurm, tmp_path_factory) -> dict[tuple[str, int], tuple[str, Path]]:
    """Every strategy as a 2-node job (1 process per node), ONE_NODE_JOB's also as a 1-node job (2 processes), all
    queued at once."""
    root = tmp_path_factory.mktemp("parity")
    jobs = {}
    for strategy in PARITY:
        for nodes, nproc in ((2, 1), (1, 2))[:2 if strategy in ONE_NODE_JOB else 1]:
            run_dir = root / f"{strategy}-{nodes}"
            job_id = submit(slurm, root, f"strategy={strategy}", *FAST, f"hydra.run.dir={run_dir}",
                            nodes=nodes, nproc=nproc)
            jobs[(strategy, nodes)] = (job_id, run_dir)
    return jobs


@pytest.mark.parametrize("strategy", PARITY)
def test_two_nodes_end_on_the_loss_of_one_node(strategy, slurm, parity_jobs, fast_run):
    runs = {}
    for nodes in (2, 1):
        if (strategy, nodes) not in parity_jobs:  # one node, not a job: the same overrides, forked
            run_dir, _ = fast_run(f"strategy={strategy}", nproc=2)
        else:
            job_id, run_dir = parity_jobs[(strategy, nodes)]
            info = wait(slurm, job_id)
            assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), output(run_dir.parent, job_id)[-3000:]
        runs[nodes] = json.loads((run_dir / "summary.json").read_text()), metrics(run_dir)
    (two, two_rows), (one, one_rows) = runs[2], runs[1]
    assert two["world_size"] == one["world_size"] == 2 and (two["nodes"], one["nodes"]) == (2, 1)
    assert two["losses"] == pytest.approx(one["losses"], rel=1e-6)
    # Every rank says where it ran; on two nodes the gradient traffic crosses nodes, on one it does not.
    assert {(r["node"], r["local_rank"]) for r in two_rows} == {("n1", 0), ("n2", 0)}
    (node,) = {r["node"] for r in one_rows}  # whichever node Slurm picked, both ranks are on it
    assert {r["local_rank"] for r in one_rows} == {0, 1}
    if strategy in ONE_NODE_JOB:
        assert node in ("n1", "n2")
    last = max(r["step"] for r in two_rows)
    for rec in (r for r in two_rows if r["step"] == last):
        crossing = sum(v for k, v in rec.items() if k.endswith("/inter_node_bytes"))
        # every op's bytes once (comm/<op>/bytes; the per-mesh-dimension keys comm/<dim>/<op>/bytes repeat them)
        total = sum(rec.get(f"comm/{op}/bytes", 0.0) for op in COMM_OPS)
        assert crossing == total > 0
    assert not any(k.endswith("/inter_node_bytes") for r in one_rows for k in r)


def test_a_failing_job_ends_failed_with_the_training_exit_code_and_its_line(slurm, tmp_path):
    job_id = submit(slurm, tmp_path, "strategy=ddp", "logger=none", "train.lr=-1", f"hydra.run.dir={tmp_path}/run",
                    nodes=2)
    info = wait(slurm, job_id)
    assert (info["JobState"], info["ExitCode"]) == ("FAILED", "2:0")
    lines = [ln for ln in output(tmp_path, job_id).splitlines() if ln.startswith("config error:")]
    assert lines == ["config error: train.lr=-1.0 must be > 0"]
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def _training_processes(run_dir: Path) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter(["cmdline", "status"]):
        cmdline = " ".join(proc.info["cmdline"] or [])
        if f"hydra.run.dir={run_dir}" in cmdline and proc.info["status"] != psutil.STATUS_ZOMBIE:
            found.append(proc)
    return found


def test_scancel_leaves_no_training_process(slurm, tmp_path):
    run_dir = tmp_path / "run"
    job_id = submit(slurm, tmp_path, "strategy=ddp", "logger=none", "train.steps=100000", f"hydra.run.dir={run_dir}",
                    nodes=2)
    deadline = time.monotonic() + 180
    while not (run_dir / "metrics.jsonl").is_file():
        assert time.monotonic() < deadline, output(tmp_path, job_id)[-3000:]
        time.sleep(0.5)
    running = _training_processes(run_dir)
    assert len(running) >= 4  # a torchrun and a worker on each node
    subprocess.run(["scancel", job_id], env=slurm, check=True)
    assert wait(slurm, job_id)["JobState"] == "CANCELLED"
    deadline = time.monotonic() + 30  # Slurm's KillWait (5 s) then SIGKILL
    while _training_processes(run_dir) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not _training_processes(run_dir)


def test_compare_runs_every_strategy_as_a_job_step(slurm, tmp_path):
    out = tmp_path / "cmp"
    job_id = submit(slurm, tmp_path, "compare", "compare.strategies=[single,ddp]", "compare.wandb=false",
                    "logger=none", "model=tiny", "train.steps=3", f"compare.out_dir={out}", nodes=2)
    info = wait(slurm, job_id)
    assert info["JobState"] == "COMPLETED", output(tmp_path, job_id)[-3000:]
    rows = {r["strategy"]: r for r in json.loads((out / "table.json").read_text())}
    assert rows["ddp"]["nodes"] == 2 and rows["ddp"]["agrees"] is True, rows["ddp"]["verdict"]
    assert rows["ddp"]["comm_inter_node_bytes_per_step"] == rows["ddp"]["comm_bytes_per_step"] > 0
    report = (out / "report.md").read_text()
    assert "2 on 2 nodes" in report and "of which inter-node" in report


def test_a_sweep_of_jobs_is_collected_into_one_report(slurm, tmp_path):
    """docs/slurm.md's example: strategies as separate Slurm jobs (hydra-submitit-launcher), one report."""
    sweep = tmp_path / "sweep"

    def multirun(strategies: str, tasks: int, subdir: str) -> None:
        cmd = [sys.executable, str(TRAIN), "-m", "hydra/launcher=submitit_slurm", "hydra.launcher.nodes=1",
               f"hydra.launcher.tasks_per_node={tasks}", "hydra.launcher.timeout_min=10", f"strategy={strategies}",
               "logger=none", "model=tiny", "train.steps=3", "train.global_batch_size=8",  # one batch for 1 and 2
               f"hydra.sweep.dir={sweep / subdir}"]
        proc = subprocess.run(cmd, cwd=ROOT, env=slurm, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]

    multirun("ddp,fsdp", 2, "two-processes")
    multirun("single", 1, "one-process")
    out = tmp_path / "report"
    proc = subprocess.run([sys.executable, "launch/compare.py", f"compare.from=[{sweep / 'two-processes'},"
                           f"{sweep / 'one-process'}]", f"compare.out_dir={out}", "compare.wandb=false"],
                          cwd=ROOT, env=slurm, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {r["strategy"]: r for r in json.loads((out / "table.json").read_text())}
    assert set(rows) == {"ddp", "fsdp", "single"}
    for name in ("ddp", "fsdp"):
        assert rows[name]["world_size"] == 2 and rows[name]["agrees"] is True, rows[name]["verdict"]


def test_cluster_script_is_idempotent(slurm):
    again = subprocess.run([str(CLUSTER), "start"], capture_output=True, text=True, timeout=120)
    assert again.returncode == 0 and "up: n1=" in again.stdout
    assert "started" not in again.stdout and "installing" not in again.stdout  # nothing new: the same cluster


def _cluster(lab: Path, action: str = "start", **variables: str) -> subprocess.CompletedProcess[str]:
    """tests/slurm/cluster.sh for another cluster, in `lab`, beside the one the tests use."""
    return subprocess.run([str(CLUSTER), action], env={**os.environ, "LAB": str(lab), **variables},
                          capture_output=True, text=True, timeout=180)


@pytest.fixture
def other_lab():
    """A directory for a second cluster, stopped and removed afterwards. Not under pytest's tmp_path: munged wants
    every directory above its socket open to all, and pytest makes its own private."""
    lab = Path(tempfile.mkdtemp(prefix="dist_train-slurm-"))
    lab.chmod(0o755)
    yield lab
    _cluster(lab, "stop")
    shutil.rmtree(lab, ignore_errors=True)


def _ctld_port(lab: Path) -> int:
    return int(re.search(r"^SlurmctldPort=(\d+)$", (lab / "etc" / "slurm.conf").read_text(), re.M).group(1))


def _ports(lab: Path) -> set[int]:
    """The ports a cluster's slurm.conf gives slurmctld and the slurmd of each node."""
    first, last = map(int, re.search(r" Port=\[(\d+)-(\d+)\]", (lab / "etc" / "slurm.conf").read_text()).groups())
    return {_ctld_port(lab), *range(first, last + 1)}


def _processes_of(lab: Path) -> list[str]:
    """The command lines of live processes that name `lab`: a cluster's daemons all do (config, key, socket)."""
    return [" ".join(p.info["cmdline"]) for p in psutil.process_iter(["cmdline"])
            if str(lab) in " ".join(p.info["cmdline"] or [])]


def test_a_second_cluster_picks_other_free_ports(slurm, other_lab):
    proc = _cluster(other_lab)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "up: n1=idle n2=idle" in proc.stdout
    assert len(_ports(other_lab)) == 3 and not _ports(other_lab) & _ports(LAB)
    assert _cluster(other_lab, "stop").returncode == 0
    assert not _processes_of(other_lab)


def test_a_failed_start_stops_what_it_started_and_names_the_daemon_and_its_log(slurm, other_lab):
    """slurmctld forced onto the running cluster's port cannot bind it and exits; munged, started first, is stopped."""
    taken = _ctld_port(LAB)  # the tests' cluster's
    proc = _cluster(other_lab, CTLD_PORT=str(taken))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "started munged" in proc.stdout and "stopped munged" in proc.stdout
    last = proc.stderr.splitlines()[-1]
    assert last.startswith("[slurm cluster] start failed: slurmctld ") and last.endswith(
        f"its log: {other_lab}/log/slurmctld.log"), last
    assert "Address already in use" in (other_lab / "log" / "slurmctld.log").read_text()
    assert not _processes_of(other_lab)
