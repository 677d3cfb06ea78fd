"""bench/gpu_calibrate.py without a GPU: its FLOP count is the time model's, and the profile it writes from a kept
calibration (bench/data/: an H200's, an H100's) is the one cluster.gpu= then uses, reproducing the step it was taken
from."""

from __future__ import annotations

import json
import sys

import pytest

from dist_train.estimate.hardware import PROFILES, resolve, save_profile
from dist_train.estimate.setup import Setup
from dist_train.estimate.shapes import _conf_model
from dist_train.estimate.step_time import predict_step
from tests.helpers import ROOT

sys.path.insert(0, str(ROOT / "bench"))
import gpu_calibrate  # noqa: E402

KEPT = ROOT / "bench" / "data" / "gpu_calibrate-h200-2026-11-26.json"
KEPT_BY_GPU = {"h200": KEPT, "h100": ROOT / "bench" / "data" / "gpu_calibrate-h100-2026-11-27.json"}


@pytest.mark.parametrize("model", sorted(gpu_calibrate.MODELS))
@pytest.mark.parametrize("recompute", [False, True])
def test_a_layers_flops_are_the_time_models_and_the_hand_count(model, recompute):
    """By hand: 2 FLOPs per weight and token forward (q, k, v, o; gate, up, down), twice that backward,
    attention 4 q_dim T a token, one more forward under checkpointing."""
    s, head_dim = gpu_calibrate.MODELS[model], gpu_calibrate.HEAD_DIM
    q, kv = s["heads"] * head_dim, s["kv_heads"] * head_dim
    weights = s["hidden"] * (2 * q + 2 * kv) + 3 * s["hidden"] * s["ffn"]
    for seq in gpu_calibrate.SEQS:
        want = seq * (2.0 * weights + 4.0 * q * seq) * (4 if recompute else 3)
        assert gpu_calibrate.layer_flops(model, seq, recompute=recompute) == pytest.approx(want, rel=1e-12)


@pytest.mark.parametrize("gpu", sorted(KEPT_BY_GPU))
def test_the_kept_calibration_makes_the_profile_cluster_gpu_uses(gpu, tmp_path):
    calib = json.loads(KEPT_BY_GPU[gpu].read_text())
    prof = gpu_calibrate.profile_from(calib)
    assert prof.name == gpu and prof.flops == PROFILES[gpu].flops
    assert prof.memory_bw == calib["memory_bandwidth"]["bytes_per_s"] != PROFILES[gpu].memory_bw
    assert f"measured by bench/gpu_calibrate.py on {calib['device']}" in prof.source["efficiency"]
    assert 0 < prof.efficiency < 1
    save_profile(prof, tmp_path)
    stored, how = resolve(gpu, tmp_path)
    assert stored == prof and how.startswith("stored: ")
    # The time model with that profile gives back the whole step it was calibrated on (llama_1b, one GPU,
    # 2 micro-batches of 4 x 2048, bf16 autocast): compute at the efficiency plus the optimizer's term.
    step = calib["step"]
    setup = Setup(
        strategy="single",
        family="single",
        world_size=1,
        precision="bf16",
        seq_len=step["seq"],
        micro_batch_size=step["micro_batch"],
        global_batch_size=step["micro_batch"] * step["accumulation"],
    )
    predicted = predict_step(_conf_model(step["model"]), setup, stored)
    assert predicted.step_s == pytest.approx(step["s"], rel=0.01)
    assert predicted.framework_s == predicted.exposed_comm_s == 0


def test_the_kept_calibration_renders_every_measurement():
    text = gpu_calibrate.render(json.loads(KEPT.read_text()))
    for heading in (
        "Memory bandwidth",
        "One decoder layer",
        "SDPA",
        "Matrix products",
        "A whole eager training step",
        "Fused AdamW",
        "Cross-entropy",
        "Profile written for `cluster.gpu=h200`",
    ):
        assert heading in text, heading
    # the layer with and without checkpointing, SDPA, and the layer's two predictions beside the measured times
    assert text.count("| llama-70b | 8192 |") == 5


@pytest.mark.parametrize("gpu", sorted(KEPT_BY_GPU))
def test_the_hopper_constants_are_the_ones_the_kept_calibration_fits(gpu):
    """hardware.OPS cites each Hopper GPU's own calibration for its products, attention and memory: refitting the
    kept measurements gives those numbers, and the per-operation model then predicts the measured decoder layers
    (which nothing was fitted to) within 10%."""
    calib = json.loads(KEPT_BY_GPU[gpu].read_text())
    prof = gpu_calibrate.profile_from(calib)
    ours = PROFILES[gpu]
    assert (ours.gemm_efficiency, ours.gemm_k_half) == (prof.gemm_efficiency, prof.gemm_k_half)
    assert ours.sm_count == prof.sm_count == 132
    assert (ours.attention_efficiency, ours.attention_seq_half) == (prof.attention_efficiency, prof.attention_seq_half)
    assert ours.memory_efficiency * ours.memory_bw == pytest.approx(prof.memory_bw, rel=2e-3)
    assert "measured" in ours.source["attention_efficiency"] and gpu.upper() in ours.source["attention_efficiency"]
    for layer, predicted in zip(calib["layers"], gpu_calibrate.predicted_layers(calib, prof)):
        assert predicted == pytest.approx(layer["s"], rel=0.10), layer


def test_a_kept_moe_measurement_renders_its_models_and_makes_no_profile():
    """`--only moe` (bench/data/gpu_moe-h100-2026-11-27.json): a table row per model, implementation and token count,
    and no hardware profile, since nothing a profile takes was measured (a stored one is not overwritten)."""
    calib = json.loads((ROOT / "bench" / "data" / "gpu_moe-h100-2026-11-27.json").read_text())
    assert gpu_calibrate.profile_from(calib) is None
    text = gpu_calibrate.render(calib)
    assert "Profile written" not in text
    for m in gpu_calibrate.MOE_MODELS:
        assert text.count(f"| {m['model']} |") == 2 * len(gpu_calibrate.MOE_TOKENS), m["model"]


def test_selective_checkpointings_kept_bytes_on_an_h200_are_the_estimators():
    """bench/data/gpu_calibrate-h200-2026-11-27.json measured each decoder layer's bytes left for backward by its
    forward (the output included) under none, full and selective (dist_train's policy, torch 2.11 on an H200).
    Selective keeps what the estimator says (estimate/memory.py selective_kept_bytes) beside the output, at both
    sizes and sequences, to the allocator's 1 KiB more: flash attention's RNG seed and offset, two 8-byte tensors
    in a 512-byte block each. Full keeps the output alone; none keeps more than selective."""
    from dist_train.estimate.memory import selective_kept_bytes

    calib = json.loads((ROOT / "bench" / "data" / "gpu_calibrate-h200-2026-11-27.json").read_text())
    kept = {(r["model"], r["seq"], r["checkpointing"]): r["saved_bytes"] for r in calib["layers"]}
    assert len(kept) == len(gpu_calibrate.MODELS) * len(gpu_calibrate.SEQS) * 3
    for model in gpu_calibrate.MODELS:
        shape = gpu_calibrate.layer_shape(model)
        for seq in gpu_calibrate.SEQS:
            output = seq * shape.hidden_size * 2
            assert kept[model, seq, "full"] == output
            formula = selective_kept_bytes(shape, micro_batch_size=1, seq_len=seq, elem=2)
            assert kept[model, seq, "selective"] == formula + output + 2 * 512
            assert kept[model, seq, "none"] > kept[model, seq, "selective"]
    assert "| llama-70b | 8192 | selective |" in gpu_calibrate.render(calib)


def test_selective_checkpointing_waits_for_its_host_where_the_kernels_are_shorter():
    """The H200's kept layers (bench/data/gpu_calibrate-h200-2026-11-27.json): Llama 8B's layer at 4,096 tokens took
    15.6 ms under selective against 11.9 ms of kernels by the model, more than under full checkpointing: the host,
    running every op through selective checkpointing's dispatch mode, is what it waited for. gpu_calibrate finds that
    floor in the file (hardware.SELECTIVE_HOST_S); with it each selective layer is max(kernels, host): that one
    within 1%, the others (kernels longer than the host) as before, and none and full untouched."""
    from dataclasses import replace

    from dist_train.estimate.hardware import SELECTIVE_HOST_S

    calib = json.loads((ROOT / "bench" / "data" / "gpu_calibrate-h200-2026-11-27.json").read_text())
    hw = PROFILES["h200"]
    assert gpu_calibrate.selective_host_s(calib, hw) == pytest.approx(SELECTIVE_HOST_S, abs=1e-4)
    assert hw.selective_host_s == SELECTIVE_HOST_S and "measured" in hw.source["selective_host_s"]
    kernels = gpu_calibrate.predicted_layers(calib, replace(hw, selective_host_s=0.0))
    floored = gpu_calibrate.predicted_layers(calib, hw)
    for row, before, after in zip(calib["layers"], kernels, floored):
        if row["checkpointing"] == "selective":
            assert after == pytest.approx(max(before, SELECTIVE_HOST_S), rel=1e-12)
        else:
            assert after == before
        if (row["model"], row["seq"], row["checkpointing"]) == ("llama-8b", 4096, "selective"):
            assert before < 0.8 * row["s"] and after == pytest.approx(row["s"], rel=0.01)
    # the step divides the compute by the profile's efficiency (0.9 here: the 8B row's kernels 13.2 ms, still under the
    # host's): the floor holds after it, the kernels scale
    slow = replace(hw, efficiency=0.9)
    for row, before in zip(calib["layers"], gpu_calibrate.predicted_layers(calib, replace(slow, selective_host_s=0))):
        if row["checkpointing"] == "selective":
            after = gpu_calibrate.predicted_layers({"layers": [row]}, slow)[0]
            assert after / 0.9 == pytest.approx(max(before / 0.9, SELECTIVE_HOST_S), rel=1e-12)
    # a file with the dedicated measurement (--only selective_host) takes that instead, and makes a profile of it
    dedicated = {**calib, "selective_host": [{"model": "llama-8b", "seq": 128, "checkpointing": "none", "s": 0.004},
                                             {"model": "llama-8b", "seq": 128, "checkpointing": "selective",
                                              "s": 0.012}]}
    assert gpu_calibrate.selective_host_s(dedicated, hw) == 0.012
    only = {k: v for k, v in dedicated.items() if k in ("device", "sms", "torch", "date", "selective_host")}
    prof = gpu_calibrate.profile_from(only)
    assert prof.selective_host_s == 0.012 and "128 tokens" in prof.source["selective_host_s"]


def test_a_profile_stored_before_the_selective_host_floor_takes_the_built_in_one():
    from dist_train.estimate.hardware import Hardware

    stored = PROFILES["h100"].to_json()
    del stored["selective_host_s"]
    stored["source"] = {k: v for k, v in stored["source"].items() if k != "selective_host_s"}
    back = Hardware.from_json(stored)
    assert back.selective_host_s == PROFILES["h100"].selective_host_s > 0 and back.source["selective_host_s"]
