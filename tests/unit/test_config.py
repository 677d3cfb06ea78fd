"""Config errors: found before any process group starts, one line naming the key and what is allowed."""

from __future__ import annotations

import pytest
import torch

from dist_train.checks import validate
from dist_train.config import ConfigError
from dist_train.session import experiment_group
from tests.helpers import run_config


def test_defaults_validate_for_one_and_two_processes():
    for world in (1, 2):
        _, run = run_config()
        validate(run, world)
        assert run.strategy.name == "ddp" and run.model.name == "tiny"


@pytest.mark.parametrize(
    ("overrides", "world", "needle"),
    [
        (["train.global_batch_size=10", "train.micro_batch_size=4"], 1, "train.global_batch_size=10"),
        (["train.global_batch_size=6", "train.micro_batch_size=2"], 2, "data-parallel size (2)"),
        (["train.steps=-1"], 1, "train.steps=-1 must be >= 1"),
        (["strategy=dp"], 2, "strategy=dp"),
        (["strategy=dp", "strategy.device_ids=[]"], 1, "strategy.device_ids=[] must be distinct GPU indices"),
        (["strategy=dp", "strategy.device_ids=[1,1]"], 1, "strategy.device_ids=[1, 1] must be distinct"),
        (["strategy=single"], 2, "strategy=single"),
        (["data=textfile"], 1, "data.path"),
        (["data=textfile", "data.path=/nonexistent/file.txt"], 1, "data.path='/nonexistent/file.txt'"),
        # a key the chosen group does not read is not ignored: it names the group that reads it
        (["data.path=tale.bin"], 1, "/tale.bin is set but data=synthetic reads no file; pick data=tokens"),
        (["data.dtype=uint32"], 1, "data.dtype=uint32 is read only by data=tokens"),
        (["peft.rank=16"], 1, "peft.rank=16 is set but peft=none trains the whole model; pick peft=lora or peft=qlora"),
        (["peft=lora", "peft.quant_type=fp4"], 1, "peft.quant_type=fp4 is read only by peft=qlora"),
        (["strategy.name=banana"], 1, "strategy.name='banana' is not supported; allowed:"),
        (["precision.name=fp8"], 1, "precision.name='fp8'"),
        (["train.activation_checkpointing=some"], 1,
         "train.activation_checkpointing='some' is not supported; allowed: none, full, selective (true = full"),
        (["train.checkpoint_every=0"], 1, "train.checkpoint_every=0 must be >= 1"),
        (["train.seq_len=4096"], 1, "train.seq_len=4096 exceeds model.max_seq_len"),
        (["model.num_heads=5"], 1, "model.hidden_size=64 must be divisible by model.num_heads=5"),
        (["strategy=tp"], 3, "strategy=tp splits model.num_heads=4 3 ways"),
        (["strategy=tp", "model.arch=llama", "model.num_kv_heads=1"], 2, "model.num_kv_heads=1 2 ways"),
        (["strategy=tp", "model=tiny_moe"], 2, "strategy=tp: model.num_experts=8: tensor parallelism here does not "
         "split experts (transformers' moe_tp_experts and packed_colwise are not applied); split them by expert with "
         "strategy.ep"),
        (["strategy=ddp_tp", "model=tiny_moe"], 4, "strategy=ddp_tp with strategy.tp=2: model.num_experts=8"),
        (["strategy=ddp_tp", "model=tiny_moe", "strategy.ep=2"], 4, "strategy=ddp_tp with strategy.ep=2: expert "
         "parallelism beside tensor parallelism is built with FSDP2 (fsdp_tp), not with whole replicas (ddp_tp)"),
        (["strategy=tp", "model=tiny_moe", "strategy.ep=4"], 2, "strategy.ep=4 must divide the number of processes "
         "(2): the experts' mesh is (efsdp 2/4) x (ep 4)"),
        (["strategy=fsdp_tp", "model=tiny_moe", "strategy.ep=3"], 6, "strategy=fsdp_tp with strategy.tp=2: "
         "strategy.ep=3 must divide model.num_experts=8"),
        (["strategy=tp", "strategy.ep=2"], 2, "strategy=tp: strategy.ep=2 splits experts, and model tiny has none"),
        (["strategy=tp", "model=tiny_moe", "strategy.ep=2", "strategy.sequence_parallel=true"], 2,
         "strategy=tp with strategy.ep=2 and strategy.sequence_parallel=true is not built yet"),
        (["model=tiny_moe", "model.experts_per_token=9"], 1,
         "model.experts_per_token=9 must be between 1 and model.num_experts=8"),
        (["model=tiny_moe", "model.experts_implementation=grouped_mm", "model.moe_ffn_hidden_size=36"], 1,
         "model.experts_implementation=grouped_mm needs model.hidden_size (64) and the experts' width (36) to be "
         "multiples of 8"),
        (["strategy=fsdp_ep"], 2, "strategy=fsdp_ep: model tiny has no experts (model.num_experts=0)"),
        (["strategy=fsdp_ep", "model=tiny_moe", "strategy.ep=3"], 6, "strategy.ep=3 must divide model.num_experts=8"),
        (["strategy=fsdp_ep", "model=tiny_moe", "strategy.ep=4"], 2, "strategy.ep=4 must divide the number of "
         "processes (2)"),
        (["strategy=ep"], 2, "strategy=ep: model tiny has no experts (model.num_experts=0)"),
        (["strategy=ep", "model=tiny_moe", "strategy.ep=4"], 6, "strategy.ep=4 must divide the number of processes "
         "(6): the experts' mesh is (edp 6/4) x (ep 4)"),
        (["strategy=ep", "model=tiny_moe", "strategy.dp_mode=shard"], 2, "strategy.dp_mode='shard' is not supported; "
         "allowed: fsdp, replicate"),
        (["model=tiny_moe", "model.experts_implementation=fused"], 1,
         "model.experts_implementation='fused' is not supported; allowed: eager, grouped_mm, batched_mm"),
        (["strategy=accelerate", "strategy.plugin=zero"], 2, "strategy.plugin='zero' is not supported; allowed: ddp"),
        (["strategy=accelerate", "strategy.plugin=deepspeed", "strategy.zero_stage=4"], 2, "ZeRO stage 4 is not 1, 2 or 3"),
        (["strategy=accelerate", "strategy.plugin=deepspeed", "precision=fp16"], 2, "precision=fp16 needs a GPU"),
    ],
)
def test_bad_values_are_one_clear_line(overrides, world, needle):
    _, run = run_config(*overrides)
    with pytest.raises(ConfigError) as err:
        validate(run, world)
    message = str(err.value)
    assert needle in message and "\n" not in message


@pytest.mark.parametrize(("overrides", "world"), [
    (["strategy=tp", "model=tiny_moe", "strategy.ep=2"], 2),
    (["strategy=fsdp_tp", "model=tiny_moe", "strategy.tp=2", "strategy.ep=4"], 4),  # an EP group of two TP groups
    # every layer MoE: no dense MLP for tensor parallelism to split, whatever its width
    (["strategy=tp", "model=tiny_moe", "strategy.ep=2", "model.ffn_hidden_size=35"], 2),
])
def test_tensor_parallelism_takes_an_moe_model_with_its_experts_split_by_ep(overrides, world):
    _, run = run_config(*overrides)
    validate(run, world)


@pytest.mark.parametrize(("given", "mode"), [("true", "full"), ("false", "none"), ("True", "full"), ("none", "none"),
                                             ("full", "full"), ("selective", "selective")])
def test_checkpointing_takes_three_modes_and_the_booleans_as_aliases(given, mode):
    _, run = run_config(f"train.activation_checkpointing={given}")
    validate(run, 1)
    assert run.train.activation_checkpointing == mode


def test_textfile_needs_a_byte_vocab(tmp_path):
    path = tmp_path / "t.txt"
    path.write_text("hello world " * 50)
    _, run = run_config("data=textfile", f"data.path={path}", "model.vocab_size=128")
    with pytest.raises(ConfigError, match="model.vocab_size=256 or more"):
        validate(run, 1)


def test_experiment_group_ignores_strategy_but_not_the_model():
    a, _ = run_config("strategy=ddp")
    b, _ = run_config("strategy=fsdp")
    c, _ = run_config("strategy=ddp", "model.num_layers=2")
    assert experiment_group(a) == experiment_group(b) != experiment_group(c)


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU Accelerate runs FSDP")
def test_an_accelerate_fsdp_config_is_refused_on_cpu_instead_of_silently_becoming_ddp(tmp_path):
    config = tmp_path / "fsdp.yaml"
    config.write_text("distributed_type: FSDP\nmixed_precision: 'no'\nnum_processes: 2\nfsdp_config:\n"
                      "  fsdp_version: 2\n")
    _, run = run_config("strategy=accelerate", f"strategy.config_file={config}")
    with pytest.raises(ConfigError, match="Accelerate runs FSDP on GPUs only"):
        validate(run, 2)
    config.write_text("distributed_type: MULTI_GPU\nmixed_precision: bf16\n")
    _, run = run_config("strategy=accelerate", f"strategy.config_file={config}")
    with pytest.raises(ConfigError, match="says mixed_precision=bf16 but precision=fp32"):
        validate(run, 2)


@pytest.mark.parametrize("world", [1, 2, 3, 8, 16, 64])
@pytest.mark.parametrize("strategy", ["ddp", "fsdp", "zero3"])
def test_the_cards_command_needs_no_batch_keys_at_any_world_size(strategy, world):
    """`torchrun --nproc_per_node=N launch/train.py strategy=S`: a null global batch is micro x N, one micro-batch."""
    _, run = run_config(f"strategy={strategy}")
    assert run.train.global_batch_size is None
    validate(run, world)
    assert run.train.global_batch_size == run.train.micro_batch_size * world
    assert run.strategy.microbatches_per_step(run.train, world) == 1


@pytest.mark.parametrize(
    ("overrides", "world", "accumulation"),
    [
        (["strategy=tp", "model.num_heads=8", "model.hidden_size=64"], 8, 8),  # dp 1: the 8 micro-batches accumulate
        (["strategy=fsdp_tp"], 8, 2),
        (["strategy=fsdp_tp", "strategy.tp=4"], 64, 4),
        (["strategy=gpipe", "model.num_layers=8"], 8, 8),  # as many micro-batches as stages
        (["strategy=1f1b", "model.num_layers=3"], 3, 3),
        (["strategy=pp_dp", "strategy.pp=4", "strategy.schedule=1f1b"], 16, 4),
        (["strategy=pp_dp", "strategy.pp=2", "strategy.dp_mode=fsdp"], 64, 2),
    ],
)
def test_a_null_global_batch_fits_any_pipeline_or_tp_degree(overrides, world, accumulation):
    """Every strategy with N processes trains micro x N samples a step: the same samples as ddp."""
    _, run = run_config(*overrides)
    validate(run, world)
    assert run.train.global_batch_size == 2 * world
    assert run.strategy.microbatches_per_step(run.train, world) == accumulation


def test_an_explicit_global_batch_that_does_not_divide_stays_an_error():
    _, run = run_config("strategy=fsdp", "train.global_batch_size=8")
    with pytest.raises(ConfigError, match=r"train.global_batch_size=8 must be divisible .* = 16"):
        validate(run, 8)


def test_check_config_says_which_batch_it_chose(tmp_path):
    import subprocess
    import sys

    from tests.helpers import TRAIN, env

    proc = subprocess.run([sys.executable, str(TRAIN), "--check-config", "strategy=fsdp"], capture_output=True,
                          text=True, env={**env(), "WORLD_SIZE": "8"}, cwd=tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "global_batch=16 = micro_batch 2 x accumulation 1 x data_parallel 8" in proc.stderr.splitlines()[-1]


DATA_PARALLEL = "micro_batch 2 x accumulation 2 x data_parallel 2"
# every strategy: (processes, extra overrides, how the batch line splits global_batch=8 of micro-batches of 2)
BATCH_LINES = {
    "single": (1, [], "micro_batch 2 x accumulation 4 x data_parallel 1"),
    "dp": (1, [], "micro_batch 2 x accumulation 4 x data_parallel 1 | nn.DataParallel over every visible GPU"),
    **{name: (2, [], DATA_PARALLEL)
       for name in ("ddp", "fsdp", "zero1", "zero2", "zero2_offload", "zero3", "zero3_offload", "accelerate")},
    "tp": (2, [], "micro_batch 2 x accumulation 4 x data_parallel 1 | tensor_parallel 2"),
    "fsdp_tp": (4, ["strategy.tp=2"], "micro_batch 2 x accumulation 2 x data_parallel 2 | tensor_parallel 2"),
    "ddp_tp": (4, ["strategy.tp=2"], "micro_batch 2 x accumulation 2 x data_parallel 2 | tensor_parallel 2"),
    "fsdp_ep": (2, ["model=tiny_moe"], "micro_batch 2 x accumulation 2 x data_parallel 2"),
    "ep": (2, ["model=tiny_moe"], "micro_batch 2 x accumulation 2 x data_parallel 2"),
    "gpipe": (2, [], "micro_batch 2 x pipeline_microbatches 4 x data_parallel 1 | pipeline_stages 2"),
    "1f1b": (2, [], "micro_batch 2 x pipeline_microbatches 4 x data_parallel 1 | pipeline_stages 2"),
    "pp_dp": (4, ["strategy.pp=2"], "micro_batch 2 x pipeline_microbatches 2 x data_parallel 2 | pipeline_stages 2"),
    "hsdp": (4, ["strategy.replicate=2"], "micro_batch 2 x accumulation 1 x data_parallel 4 (replicas 2 x shards 2)"),
}


def test_the_batch_lines_cover_every_strategy():
    from dist_train.strategies.registry import available

    assert set(BATCH_LINES) == set(available())


@pytest.mark.parametrize("name", sorted(BATCH_LINES))
def test_the_batch_line_names_the_split_as_the_strategy_makes_it(name):
    """Data-parallel replicas and accumulation as the strategy itself counts them (a tp or pipeline run has one
    replica, not one per process), and the tensor-parallel degree or pipeline stages that split each replica."""
    from dist_train.config import accumulation_steps, describe_batch

    world, extra, split = BATCH_LINES[name]
    _, run = run_config(f"strategy={name}", "train.global_batch_size=8", "train.micro_batch_size=2", *extra)
    if not name.endswith("_offload"):  # those are refused without a GPU (tested elsewhere); the batch is the same
        validate(run, world)
    line = describe_batch(run, world)
    assert line == f"global_batch=8 = {split}"
    dp = run.strategy.data_parallel_size(world)
    assert f"x data_parallel {dp}" in line and f" {accumulation_steps(run, world)} x data_parallel" in line
    assert 2 * accumulation_steps(run, world) * dp == 8  # the line's product is the global batch


def test_a_pipelines_batch_line_gives_the_micro_batch_its_schedule_feeds():
    from dist_train.config import describe_batch

    _, run = run_config("strategy=gpipe", "train.global_batch_size=8", "train.micro_batch_size=2",
                        "strategy.num_microbatches=2")
    validate(run, 2)
    assert describe_batch(run, 2) == (
        "global_batch=8 = micro_batch 4 x pipeline_microbatches 2 x data_parallel 1 | pipeline_stages 2")


@pytest.mark.parametrize("gpus", range(1, 9))
def test_the_cuda_tests_are_valid_at_every_gpu_count(gpus, monkeypatch):
    """tests/launched/test_cuda.py runs only on a GPU machine; its overrides are checked here, for 1 to 8 GPUs."""
    from tests.launched.test_cuda import RUNS

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # the offload configs need a GPU
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    for name, (overrides, nproc) in RUNS.items():
        _, run = run_config(*overrides(gpus))
        validate(run, gpus if nproc == "gpus" else nproc)


def test_a_distributed_strategy_without_a_launcher_says_it_runs_alone():
    from dist_train.train import without_launcher

    _, fsdp = run_config("strategy=fsdp")
    assert without_launcher(fsdp, 1, env={}).startswith(
        "warning: strategy=fsdp started without a launcher runs as 1 process")
    assert without_launcher(fsdp, 1, env={"WORLD_SIZE": "1"}) is None  # torchrun --nproc_per_node=1: as asked
    assert without_launcher(fsdp, 2, env={}) is None
    _, single = run_config("strategy=single")
    assert without_launcher(single, 1, env={}) is None


def test_a_check_leaves_no_run_directory_behind(tmp_path):
    """--check-config and a config error train nothing: the run directory Hydra made, and an outputs/ that only
    held it, are removed; a directory with something in it is left alone."""
    from dist_train.train import _remove_if_empty

    run_dir = tmp_path / "outputs" / "fsdp-1"
    run_dir.mkdir(parents=True)
    _remove_if_empty(run_dir)
    assert not (tmp_path / "outputs").exists()
    kept = tmp_path / "outputs" / "old-run"
    kept.mkdir(parents=True)
    run_dir.mkdir()
    _remove_if_empty(run_dir)
    assert not run_dir.exists() and kept.is_dir()
