"""Your own model (`model=hf model.path=DIR`) trained for real: each strategy starts from a directory's weights on
2 ranks (transformers' own first loss), tensor parallelism follows each architecture's own plan, Phi-3 under tp trains
as one process. The directories are made with save_pretrained (tests/own_model_support.py); nothing is downloaded.
Checking and loading them in one process: tests/unit/test_own_model.py."""

from __future__ import annotations

import json

import pytest

from tests.own_model_support import ARCHS, SEQ, make_model_dir, reference_loss


# ---------------------------------------------------------------------------------------------- training


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {"llama": make_model_dir(root, "llama", shard=True),  # an index of 9 safetensors shards
            "gpt2": make_model_dir(root, "gpt2", tie=True), "qwen3": make_model_dir(root, "qwen3"),
            "gemma": make_model_dir(root, "gemma"), "stablelm": make_model_dir(root, "stablelm"),
            "qwen3_moe": make_model_dir(root, "qwen3_moe", shard=True)}  # qwen3: for the refusals below; stablelm:
    # no pipeline plan in transformers, cut by its decoder stack; qwen3_moe: each expert saved apart


# Each strategy that loads only its own shard, on kinds of model that matter to it: sharded files (llama), a tied
# head (gpt2: zero3 partitions it once; a pipeline's last stage reads it under the embedding's name), Gemma's
# scaled embedding in a stage that runs the model's own forward; Qwen3's q/k norms under its TP plan; GPT-2's fused
# q/k/v, strided over the ranks' heads, under fsdp_tp's nested mesh; Gemma under zero.Init (transformers' own init
# indexed the padding row of an empty partition: bench/arch_matrix.py found it). ddp loads as single does, which the
# in-process test covers; bench/arch_matrix.py runs every pair.
@pytest.mark.parametrize(("strategy", "arch"), [("fsdp", "llama"), ("zero3", "llama"), ("zero3", "gpt2"),
                                                ("zero3", "gemma"), ("gpipe", "gpt2"), ("1f1b", "gemma"),
                                                ("tp", "qwen3"), ("fsdp_tp", "gpt2"), ("gpipe", "stablelm"),
                                                ("fsdp_ep", "qwen3_moe"), ("zero3", "qwen3_moe")])
def test_every_strategy_starts_from_the_directorys_weights(strategy, arch, model_dirs, tmp_path):
    """2 ranks: the first step's loss is transformers' own on the same batch (fp32, 1e-5); fsdp, tp, fsdp_tp and
    the pipelines build on meta, zero3 under zero.Init, and each rank reads only what it holds from the files. An
    MoE directory's files hold each expert apart where the model stacks them: they are read stacked, transformers'
    conversion applied per read (weights.StackedExperts), under fsdp_ep each rank only its experts' (before, every
    strategy that builds on meta failed to start: 'no weights for 4 of the model's tensors')."""
    from tests.helpers import train_ok

    d = model_dirs[arch]
    s = train_ok([f"strategy={strategy}", "model=hf", f"model.path={d}", "logger=none", "train.steps=2",
                  "train.log_every=1", f"train.seq_len={SEQ}"], run_dir=tmp_path, nproc=2)
    assert s["losses"][0] == pytest.approx(reference_loss(d, global_batch=4), rel=1e-5)
    assert all(r["memory/setup_peak_rss_bytes"] > 0 for r in s["ranks"])
    # set-up's anonymous peak and the baseline it is read against (bench/setup_memory.py): the same memory, later
    assert all(0 < r["memory/setup_baseline_anon_bytes"] <= r["memory/setup_peak_anon_bytes"] for r in s["ranks"])
    assert "each rank fills only what it holds" in (tmp_path / "logs" / "rank1.log").read_text()


def test_tensor_parallelism_follows_each_architectures_own_plan(tmp_path):
    """2 ranks, every tested architecture, with and without sequence parallelism: the loss and every parameter's
    gradient (gathered whole) as the unsplit model's, the embedding and head split by vocabulary. Qwen3's q/k norms see only each rank's heads: their gradient
    is summed over the ranks (without that it is off by 1e-2, measured)."""
    from tests.helpers import ROOT, forked

    # GPT-2 with its head tied to the embedding, as OpenAI's: both split by vocabulary, one weight; Gemma's
    # embedding scales its rows and keeps a padding row (pad_token_id=0), whose gradient stays zero
    dirs = [str(make_model_dir(tmp_path, arch, tie=arch == "gpt2")) for arch in ARCHS]
    # Phi-3: fused qkv_proj and gate_up_proj, split as transformers' plan says (colwise_gather_output,
    # rowwise_split_input); sequence parallelism is refused for it (tp_archs.py reports the refusal's line)
    dirs.append(str(make_model_dir(tmp_path, "phi3")))
    # forked from tests/forkserver.py (its imports done): the script's JSON line is what is read
    proc = forked(dirs, run_dir=None, nproc=2, script=ROOT / "tests" / "scripts" / "tp_archs.py")
    assert proc.returncode == 0, proc.stderr[-3000:]
    diffs = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(diffs) == {*ARCHS, "phi3"}
    assert "sequence parallelism cannot split them" in diffs["phi3"].pop("tp_sp"), diffs["phi3"]
    for arch, by_mode in diffs.items():
        assert set(by_mode) == ({"tp"} if arch == "phi3" else {"tp", "tp_sp"}), (arch, by_mode)
        for mode, (loss, grad) in by_mode.items():
            assert loss < 1e-5 and grad < 1e-6, (arch, mode, loss, grad)


def test_phi3_under_tp_trains_as_one_process(tmp_path):
    """Phi-3's fused projections under strategy=tp (transformers' colwise_gather_output / rowwise_split_input),
    loaded from its directory: every step's loss as one process's."""
    from tests.helpers import assert_same_losses, train_ok

    d = make_model_dir(tmp_path, "phi3")
    run = ["logger=none", "model=hf", f"model.path={d}", "train.steps=3", "train.seq_len=32",
           "train.global_batch_size=4", "train.micro_batch_size=2"]
    single = train_ok(["strategy=single", *run], run_dir=tmp_path / "single")
    tp = train_ok(["strategy=tp", *run], run_dir=tmp_path / "tp", nproc=2)
    assert_same_losses(single, tp, steps=3)
