"""Slurm: one torchrun per node, meeting at a c10d rendezvous on the job's first node.

`launch/slurm.sbatch` runs `python -m dist_train.slurm <args>` on the job's first node:

    sbatch --nodes=2 --gpus-per-node=8 launch/slurm.sbatch strategy=fsdp model=llama_1b precision=bf16
    sbatch --nodes=2 launch/slurm.sbatch compare compare.strategies=[ddp,fsdp,zero2]

- processes per node: NPROC_PER_NODE if set, else the GPUs Slurm gave each node, else 1 (a CPU cluster);
- the rendezvous endpoint is the first node's address as Slurm knows it (`scontrol show node`: NodeAddr),
  which works where node names do not resolve as host names; its port is 29500 + job id mod 1000 (or
  DIST_TRAIN_RDZV_PORT); the rendezvous id is the job id;
- the config is checked first, in a one-task job step (with the job's world size): a config error is one
  line in the job's output and the job ends FAILED with exit code 2 before any node starts training;
- the job's exit code is srun's, i.e. torchrun's: 0, or 1 when a rank failed;
- before the time limit: launch/slurm.sbatch asks Slurm for SIGTERM 300 s before it (`--signal=TERM@300`); every
  rank stops after the same step and saves it (checkpoint.save_on_signal), within the 270 s torchrun gives its
  workers (TORCH_ELASTIC_SHUTDOWN_TIMEOUT; a larger lead needs both raised). The same command in the same run
  directory resumes (`sbatch --requeue` keeps the job id, which names the default run directory);
- `compare` runs launch/compare.py on the batch node; each strategy becomes a job step (`srun`) of this
  allocation, on every node (single and dp: one process on one node).

Containers: DIST_TRAIN_SRUN_ARGS adds arguments to every job step (pyxis: `--container-image=... 
--container-mounts=...`), and DIST_TRAIN_STEP_PYTHON is the command that runs Python inside a step (default:
the Python running this; e.g. `apptainer exec --nv dist_train.sif python`). This module needs only the
standard library, so the batch node needs no torch.

Also here: a process started by `srun` without torchrun (e.g. `srun --ntasks-per-node=2 python
launch/train.py`, or hydra-submitit-launcher's tasks) takes its rank, world size and rendezvous from
Slurm's environment (`adopt_srun_env`).
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TRAIN = ROOT / "launch" / "train.py"
COMPARE = ROOT / "launch" / "compare.py"
DEFAULT_PORT = 29500
# launch/slurm.sbatch's `#SBATCH --signal=TERM@300`, and the part of it torchrun's workers get to stop and save.
SIGNAL_LEAD_S = 300
SHUTDOWN_TIMEOUT_S = SIGNAL_LEAD_S - 30


# --------------------------------------------------------------------------------------------------
# What the allocation is.
# --------------------------------------------------------------------------------------------------


def _scontrol(*args: str) -> str:
    return subprocess.run(["scontrol", *args], check=True, capture_output=True, text=True).stdout


def node_names(nodelist: str) -> list[str]:
    """`n[1-2]` -> ['n1', 'n2'] (Slurm's own expansion)."""
    return _scontrol("show", "hostnames", nodelist).split()


def node_address(name: str) -> str:
    """The address Slurm knows for node `name` (NodeAddr), which need not be a resolvable host name."""
    match = re.search(r"\bNodeAddr=(\S+)", _scontrol("show", "node", name))
    if match is None:
        raise RuntimeError(f"scontrol show node {name} gave no NodeAddr")
    return match.group(1)


def gpus_per_node(env: Mapping[str, str]) -> int:
    """GPUs Slurm gave each node (SLURM_GPUS_ON_NODE, or --gpus-per-node=[type:]G), 0 if none."""
    for key in ("SLURM_GPUS_ON_NODE", "SLURM_GPUS_PER_NODE"):
        value = env.get(key, "")
        match = re.search(r"(\d+)\s*$", value)
        if match:
            return int(match.group(1))
    return 0


def nproc_per_node(env: Mapping[str, str]) -> int:
    if env.get("NPROC_PER_NODE"):
        return int(env["NPROC_PER_NODE"])
    return gpus_per_node(env) or 1


def rendezvous_port(env: Mapping[str, str]) -> int:
    if env.get("DIST_TRAIN_RDZV_PORT"):
        return int(env["DIST_TRAIN_RDZV_PORT"])
    return DEFAULT_PORT + int(env.get("SLURM_JOB_ID", "0")) % 1000  # two jobs sharing a node do not collide


@dataclass(frozen=True)
class Allocation:
    job_id: str
    nodes: tuple[str, ...]
    first_address: str
    nproc_per_node: int
    port: int

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> "Allocation":
        if "SLURM_JOB_ID" not in env:
            raise RuntimeError("not inside a Slurm job (no SLURM_JOB_ID): submit with `sbatch launch/slurm.sbatch ...`")
        nodes = tuple(node_names(env["SLURM_JOB_NODELIST"]))
        return cls(env["SLURM_JOB_ID"], nodes, node_address(nodes[0]), nproc_per_node(env), rendezvous_port(env))

    @property
    def num_nodes(self) -> int:
        return len(self.nodes)

    @property
    def world_size(self) -> int:
        return self.num_nodes * self.nproc_per_node

    @property
    def endpoint(self) -> str:
        return f"{self.first_address}:{self.port}"


# --------------------------------------------------------------------------------------------------
# Commands.
# --------------------------------------------------------------------------------------------------


def _words(name: str, default: list[str]) -> list[str]:
    value = os.environ.get(name, "").strip()
    return shlex.split(value) if value else default


def step_python() -> list[str]:
    """How a job step runs Python (DIST_TRAIN_STEP_PYTHON, e.g. inside a container), else this Python."""
    return _words("DIST_TRAIN_STEP_PYTHON", [sys.executable])


def srun_on_every_node(alloc: Allocation) -> list[str]:
    """A job step with one task per node; if one task fails, Slurm stops the others."""
    return ["srun", f"--nodes={alloc.num_nodes}", "--ntasks-per-node=1", f"--ntasks={alloc.num_nodes}",
            "--kill-on-bad-exit=1", *_words("DIST_TRAIN_SRUN_ARGS", [])]


def srun_one_process() -> list[str]:
    return ["srun", "--nodes=1", "--ntasks=1", "--kill-on-bad-exit=1", *_words("DIST_TRAIN_SRUN_ARGS", [])]


def torchrun(alloc: Allocation, *, rdzv_id: str, nproc_per_node: int | None = None) -> list[str]:
    return [
        *step_python(), "-m", "torch.distributed.run", f"--nnodes={alloc.num_nodes}",
        f"--nproc_per_node={nproc_per_node or alloc.nproc_per_node}", "--rdzv_backend=c10d",
        f"--rdzv_endpoint={alloc.endpoint}", f"--rdzv_id={rdzv_id}",
    ]


def step_env() -> dict[str, str]:
    env = dict(os.environ)
    # torchrun's rendezvous store is kept across restarts (--max-restarts) unless told otherwise, and a restarted
    # rank can then read the failed attempt's addresses (pytorch#135712); across nodes only this avoids it.
    env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    # launch/slurm.sbatch asks Slurm for SIGTERM SIGNAL_LEAD_S seconds before the time limit; torchrun forwards it and
    # kills its workers this many seconds later: time for them to finish the step, save it and exit (`--signal`).
    env.setdefault("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", str(SHUTDOWN_TIMEOUT_S))
    env.update({k: v for k, v in flight_recorder_env(env).items() if k not in env})  # the user's settings win
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return env


def flight_recorder_env(env: Mapping[str, str]) -> dict[str, str]:
    """torch's NCCL flight recorder for a multi-node job: each rank keeps its last 2000 collectives and, when a
    collective times out (a hung or lost rank), dumps them beside the job's output as slurm-<job>-fr-rank_<r>
    (read them with `torchfrtrace`), instead of leaving a timeout with no trace of who waited for whom."""
    prefix = Path(env.get("SLURM_SUBMIT_DIR", os.getcwd())) / f"slurm-{env.get('SLURM_JOB_ID', 'job')}-fr-rank_"
    return {"TORCH_FR_BUFFER_SIZE": "2000", "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
            "TORCH_FR_DUMP_TEMP_FILE": str(prefix)}


def check_config(args: list[str], *, world_size: int) -> int:
    """Validate the training config for the job's world size, in the training's environment, before any node
    starts training: 0, or 2 after the one `config error:` line."""
    env = step_env()
    env.update(RANK="0", WORLD_SIZE=str(world_size))
    # --quiet: the failing check's own line is the message; srun's "task 0: Exited with exit code 2" adds nothing
    cmd = [*srun_one_process(), "--quiet", *step_python(), str(TRAIN), "--check-config", *args]
    return subprocess.run(cmd, env=env).returncode


def train(alloc: Allocation, args: list[str]) -> int:
    code = check_config(args, world_size=alloc.world_size)
    if code != 0:
        return code
    print(f"[dist_train.slurm] job {alloc.job_id}: {alloc.num_nodes} node(s) x {alloc.nproc_per_node} process(es), "
          f"rendezvous at {alloc.endpoint}", file=sys.stderr, flush=True)
    cmd = [*srun_on_every_node(alloc), *torchrun(alloc, rdzv_id=alloc.job_id), str(TRAIN), *args]
    return subprocess.run(cmd, env=step_env()).returncode


def compare(alloc: Allocation, args: list[str]) -> int:
    if not any(a.startswith("compare.nproc=") for a in args):
        args = [*args, f"compare.nproc={alloc.nproc_per_node}"]
    return subprocess.run([sys.executable, str(COMPARE), "compare.launcher=slurm", *args], env=step_env()).returncode


def main(argv: list[str] | None = None) -> int:
    from dist_train.entry import exit_on_help, help_text

    argv = sys.argv[1:] if argv is None else argv
    exit_on_help(argv, lambda: help_text(
        __doc__, usage="sbatch [SBATCH OPTIONS] launch/slurm.sbatch [compare] [GROUP=OPTION ...] [KEY=VALUE ...]  "
                       "(inside a job: python -m dist_train.slurm ...)",
        sections=[("environment:", ["  NPROC_PER_NODE, DIST_TRAIN_RDZV_PORT, DIST_TRAIN_SRUN_ARGS, "
                                    "DIST_TRAIN_STEP_PYTHON, TORCH_ELASTIC_SHUTDOWN_TIMEOUT (see above)"])],
        examples=["sbatch --nodes=2 --gpus-per-node=8 launch/slurm.sbatch strategy=fsdp model=llama_1b precision=bf16",
                  "sbatch --nodes=2 launch/slurm.sbatch compare compare.strategies=[ddp,fsdp]"]))
    if "SLURM_JOB_ID" not in os.environ:
        print("dist_train.slurm runs inside a Slurm job: submit it with sbatch launch/slurm.sbatch ... (--help says "
              "more)", file=sys.stderr)
        return 2
    alloc = Allocation.from_env()
    if argv[:1] == ["compare"]:
        return compare(alloc, argv[1:])
    return train(alloc, argv)


# --------------------------------------------------------------------------------------------------
# srun without torchrun.
# --------------------------------------------------------------------------------------------------


def adopt_srun_env(env: MutableMapping[str, str] = os.environ) -> bool:
    """A task of an srun step with several tasks and no torchrun: set RANK, WORLD_SIZE, LOCAL_RANK,
    LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT from Slurm's variables, as torchrun would. Returns whether
    it did. Nothing changes under torchrun (RANK set), outside an srun step, or for a one-task step."""
    if "RANK" in env or "SLURM_STEP_ID" not in env or "SLURM_PROCID" not in env:
        return False
    if int(env.get("SLURM_NTASKS", "1")) <= 1:
        return False
    nodes = node_names(env["SLURM_STEP_NODELIST"])
    env["RANK"] = env["SLURM_PROCID"]
    env["WORLD_SIZE"] = env["SLURM_NTASKS"]
    env["LOCAL_RANK"] = env.get("SLURM_LOCALID", "0")
    env["LOCAL_WORLD_SIZE"] = str(int(env["SLURM_NTASKS"]) // len(nodes))
    env["MASTER_ADDR"] = node_address(nodes[0])
    env["MASTER_PORT"] = str(rendezvous_port(env))
    return True


if __name__ == "__main__":
    sys.exit(main())
