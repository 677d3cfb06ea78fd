"""The Slurm launcher's pure parts (no cluster): processes per node, ports, commands, srun's environment."""

from __future__ import annotations

import pytest

from dist_train import slurm


@pytest.mark.parametrize(
    ("env", "nproc"),
    [({}, 1), ({"SLURM_GPUS_ON_NODE": "8"}, 8), ({"SLURM_GPUS_PER_NODE": "a100:4"}, 4),
     ({"SLURM_GPUS_ON_NODE": "8", "NPROC_PER_NODE": "2"}, 2)],
)
def test_processes_per_node_follow_the_gpus_else_one(env, nproc):
    assert slurm.nproc_per_node(env) == nproc


def test_rendezvous_port_is_per_job_unless_set():
    assert slurm.rendezvous_port({"SLURM_JOB_ID": "123456"}) == 29500 + 456
    assert slurm.rendezvous_port({"SLURM_JOB_ID": "7", "DIST_TRAIN_RDZV_PORT": "4242"}) == 4242


def test_commands_for_a_two_node_job(monkeypatch):
    monkeypatch.delenv("DIST_TRAIN_SRUN_ARGS", raising=False)
    monkeypatch.setenv("DIST_TRAIN_STEP_PYTHON", "apptainer exec --nv img.sif python")
    alloc = slurm.Allocation("77", ("gpu1", "gpu2"), "10.0.0.5", nproc_per_node=8, port=29577)
    assert alloc.world_size == 16 and alloc.endpoint == "10.0.0.5:29577"
    assert slurm.srun_on_every_node(alloc)[:4] == ["srun", "--nodes=2", "--ntasks-per-node=1", "--ntasks=2"]
    cmd = slurm.torchrun(alloc, rdzv_id="77")
    assert cmd[:5] == ["apptainer", "exec", "--nv", "img.sif", "python"]
    assert {"--nnodes=2", "--nproc_per_node=8", "--rdzv_backend=c10d", "--rdzv_endpoint=10.0.0.5:29577",
            "--rdzv_id=77"} <= set(cmd)
    monkeypatch.setenv("DIST_TRAIN_SRUN_ARGS", "--container-image=x.sqsh --container-mounts=/a:/a")
    assert slurm.srun_one_process()[-2:] == ["--container-image=x.sqsh", "--container-mounts=/a:/a"]


def test_a_multi_task_srun_step_takes_its_rank_and_rendezvous_from_slurm(monkeypatch):
    monkeypatch.setattr(slurm, "node_names", lambda nodelist: ["n1", "n2"])
    monkeypatch.setattr(slurm, "node_address", lambda name: {"n1": "10.1.1.1"}[name])
    env = {"SLURM_STEP_ID": "0", "SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_LOCALID": "1",
           "SLURM_STEP_NODELIST": "n[1-2]", "SLURM_JOB_ID": "1042"}
    assert slurm.adopt_srun_env(env)
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"], env["LOCAL_WORLD_SIZE"]) == ("3", "4", "1", "2")
    assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == ("10.1.1.1", str(29500 + 42))


@pytest.mark.parametrize(
    "env",
    [{"RANK": "0", "SLURM_STEP_ID": "0", "SLURM_PROCID": "0", "SLURM_NTASKS": "2"},  # torchrun already did it
     {"SLURM_PROCID": "0", "SLURM_NTASKS": "2"},  # the batch script, not a step
     {"SLURM_STEP_ID": "0", "SLURM_PROCID": "0", "SLURM_NTASKS": "1"}],  # one task: nothing to meet
)
def test_other_processes_are_left_alone(env):
    before = dict(env)
    assert not slurm.adopt_srun_env(env) and env == before


def test_job_steps_keep_a_flight_record_that_a_timeout_dumps_beside_the_job(monkeypatch, tmp_path):
    monkeypatch.setenv("SLURM_SUBMIT_DIR", str(tmp_path))
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.delenv("TORCH_FR_BUFFER_SIZE", raising=False)
    monkeypatch.setenv("TORCH_NCCL_DUMP_ON_TIMEOUT", "0")  # a user's own setting is kept
    env = slurm.step_env()
    assert env["TORCH_FR_BUFFER_SIZE"] == "2000" and env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "0"
    assert env["TORCH_FR_DUMP_TEMP_FILE"] == str(tmp_path / "slurm-4242-fr-rank_")
