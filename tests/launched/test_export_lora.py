"""launch/export.py on LoRA runs: the adapter in peft's format, and with --merge the merged model, both giving the
next step's logged loss; the merged directory trains on in dist_train (model=hf model.path=). QLoRA: the same,
merged over its 4-bit base dequantized to fp32.

One training run per kind (model=tiny, one process, 5 steps, a checkpoint after step 4): the exported weights are
those after step 4, so on step 5's batch they must give step 5's logged loss. A --merge refused without adapters:
tests/unit/test_export_lora.py."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch

from dist_train.checkpoint.layout import read_trainer_state, step_dir_name
from tests.helpers import FAST, forked_python, rel_diff, train_ok

STEP4 = step_dir_name(4)
CHECKPOINTED = ["strategy=single", *FAST, "checkpoint.every_steps=4", "checkpoint.keep_last=0"]
ADAPTER_FILES = {"adapter_config.json", "adapter_model.safetensors"}


def _run(kind: str, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[float]]:
    run_dir = tmp_path_factory.mktemp(kind)
    return run_dir, train_ok([f"peft={kind}", *CHECKPOINTED], run_dir=run_dir)["losses"]


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[float]]:
    return _run("lora", tmp_path_factory)


def export(checkpoint: Path, out: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    """launch/export.py, forked from tests/forkserver.py (its imports done): its output and files are what is read."""
    return forked_python(["launch/export.py", str(checkpoint), str(out), *extra], timeout=300)


def loss_on(model: torch.nn.Module, step_index: int) -> float:
    """The mean micro-batch loss of the model on the global batch of step `step_index + 1` (the run's data)."""
    from dist_train.config import DataConfig, TrainConfig
    from dist_train.data import GlobalBatches, build_dataset
    from dist_train.model import forward_loss

    t = TrainConfig()
    batch = GlobalBatches(build_dataset(DataConfig(), vocab_size=256, seq_len=t.seq_len, seed=t.seed),
                          global_batch_size=8, dp_rank=0, dp_size=1).local_batch(step_index)
    model.train()  # as in training (model=tiny has no dropout)
    with torch.no_grad():
        micro = [forward_loss(model, mb.input_ids, mb.labels) for mb in batch.split(2)]
    return float(sum(micro) / len(micro))


def base_model(checkpoint: Path) -> torch.nn.Module:
    """The run's base model without adapters, built as export builds it (model=tiny has no model.path)."""
    from dist_train.export import _model

    return _model(read_trainer_state(checkpoint)["config"])


def peft_loss(base: torch.nn.Module, adapter_dir: Path) -> float:
    from peft import PeftModel

    return loss_on(PeftModel.from_pretrained(base, str(adapter_dir)), 4)


@pytest.mark.beside
def test_lora_export_merges_reproduces_the_next_loss_and_trains_on(lora_run, tmp_path):
    from transformers import AutoModelForCausalLM

    run_dir, losses = lora_run
    checkpoint = run_dir / "checkpoints" / STEP4
    out = tmp_path / "merged"
    proc = export(checkpoint, out, "--merge")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "merged model" in proc.stdout and f"model.path={out}" in proc.stdout and "PeftModel" in proc.stdout
    # the merged model at the top, the adapter beside it in adapter/: an adapter_config.json next to config.json
    # would make from_pretrained(out) apply the adapter a second time on top of the merged weights
    assert (out / "config.json").is_file() and not (out / "adapter_config.json").exists()
    assert ADAPTER_FILES <= {p.name for p in (out / "adapter").iterdir()}
    meta = json.loads((out / "dist_train.json").read_text())
    assert (meta["step"], meta["peft"], meta["merged"]) == (4, "lora", True)

    merged = AutoModelForCausalLM.from_pretrained(out)
    assert not any("lora_" in name for name, _ in merged.named_parameters())
    loss = loss_on(merged, 4)
    assert rel_diff(loss, losses[4]) < 1e-5, (loss, losses[4])
    base = base_model(checkpoint)
    assert rel_diff(loss_on(base, 4), losses[4]) > 1e-5  # the adapters' 4 steps show: the check above can fail
    adapted = peft_loss(base, out / "adapter")
    assert rel_diff(adapted, losses[4]) < 1e-5, (adapted, losses[4])

    # dist_train trains on from the merged directory (new adapters start at B = 0: the model's own loss)
    on = train_ok(["strategy=single", *FAST, "train.steps=1", "model=hf", f"model.path={out}",
                   "peft=lora"], run_dir=tmp_path / "on")
    assert rel_diff(on["losses"][0], loss_on(merged, 0)) < 1e-5, (on["losses"][0], loss_on(merged, 0))


@pytest.mark.beside
def test_qlora_export_writes_the_adapter_and_merges_over_the_dequantized_base(tmp_path_factory, tmp_path):
    from transformers import AutoModelForCausalLM

    from dist_train.export import export_pretrained
    from dist_train.model import default_lora_targets, quantize_base

    run_dir, losses = _run("qlora", tmp_path_factory)
    checkpoint = run_dir / "checkpoints" / STEP4
    # without --merge: the adapter only, no model of its own (in-process: the CLI is run in the LoRA test)
    adapter_only = tmp_path / "adapter"
    done = export_pretrained(checkpoint, adapter_only)
    assert (done.adapter_dir, done.model_dir) == (adapter_only, None)
    assert {p.name for p in adapter_only.iterdir()} == ADAPTER_FILES | {"dist_train.json"}
    assert json.loads((adapter_only / "adapter_config.json").read_text())["r"] == 8
    # over the base quantized as training quantized it (the same weights and seed: the same 4-bit values)
    base = base_model(checkpoint)
    quantize_base(base, default_lora_targets(base), quant_type="nf4", compute_dtype=torch.float32)
    base = base.to("cpu")  # bitsandbytes packs the 4-bit weights on the move
    assert rel_diff(loss_on(base, 4), losses[4]) > 1e-5  # without the adapters: not step 5's loss
    adapted = peft_loss(base, adapter_only)
    assert rel_diff(adapted, losses[4]) < 1e-5, (adapted, losses[4])

    # merged into the same directory (--overwrite): the adapter-only export's files go, so that from_pretrained
    # finds the merged model and no adapter_config.json beside it; a file of the user's own (a tokenizer) stays
    out = adapter_only
    (out / "tokenizer.json").write_text("{}")
    assert export_pretrained(checkpoint, out, merge=True, overwrite=True).model_dir == out
    assert not (out / "adapter_config.json").exists() and (out / "adapter" / "adapter_config.json").is_file()
    assert (out / "tokenizer.json").read_text() == "{}"
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config  # a plain fp32 model: the 4-bit base dequantized
    merged = AutoModelForCausalLM.from_pretrained(out)
    assert {p.dtype for p in merged.parameters()} == {torch.float32}
    # Training computed each 4-bit projection by dequantizing it to fp32 (CPU, compute dtype fp32), so the merged
    # model (that same dequantized weight + the adapters' product) needs no looser tolerance than LoRA's.
    loss = loss_on(merged, 4)
    assert rel_diff(loss, losses[4]) < 1e-5, (loss, losses[4])
