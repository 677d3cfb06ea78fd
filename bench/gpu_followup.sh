#!/usr/bin/env bash
# What the next GPU session should measure first (about 5 minutes on one H100 or H200), each figure kept under
# OUT (default: gpu_followup/). The open questions it answers (docs/BENCHMARKS.md, 'Selective checkpointing and MoE
# blocks on an H200'):
#   1. grouped_mm experts under a bf16 run's autocast now multiply in bf16 (model.autocast_grouped_mm): the whole
#      MoE step that took 176 ms before, predicted 42.7 ms now;
#   2. the eager experts' step, 435 ms against 82 predicted: the MoE blocks under autocast over fp32 weights
#      (gpu_calibrate.py --only moe_autocast) against the same blocks in bf16;
#   3. selective checkpointing's host time, which the profiles take from one host-bound layer of an H200
#      (hardware.SELECTIVE_HOST_S): measured directly on a layer too small to hide it (--only selective_host);
#   4. the CUDA tests (tests/launched/test_cuda.py), grouped_mm against eager among them.
# On a machine without network, install the wheels first (docs/GPU.md, section 1), then:
#   bash bench/gpu_followup.sh [OUT]
set -u
out=${1:-gpu_followup}
mkdir -p "$out"
py=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
"$py" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null || {
  echo "gpu_followup: no CUDA device is visible; nothing was run"; exit 0; }
model="model=tiny_moe model.hidden_size=2048 model.num_heads=16 model.num_kv_heads=4 model.head_dim=128
  model.ffn_hidden_size=6144 model.num_experts=64 model.experts_per_token=8 model.moe_ffn_hidden_size=1024
  model.num_layers=2 model.vocab_size=32000 model.max_seq_len=4096"
for impl in grouped_mm eager; do
  # shellcheck disable=SC2086  # the overrides are words
  timeout 120 "$py" launch/train.py strategy=single $model model.experts_implementation=$impl precision=bf16 \
    train.seq_len=4096 train.micro_batch_size=1 train.global_batch_size=2 train.steps=10 telemetry.warmup_steps=3 \
    logger=none "hydra.run.dir=$out/moe_$impl" > "$out/moe_$impl.log" 2>&1
  echo "moe step, $impl: rc=$?; $(tail -1 "$out/moe_$impl.log")"
done
timeout 150 "$py" bench/gpu_calibrate.py --only moe_autocast,moe,selective_host --out "$out/moe_blocks.json" \
  --no-docs > "$out/moe_blocks.log" 2>&1
echo "MoE blocks: rc=$?; tables: $py bench/gpu_calibrate.py --from $out/moe_blocks.json"
DIST_TRAIN_TEST_FORK=0 timeout 300 "$py" -m pytest -q tests/launched/test_cuda.py > "$out/cuda_tests.log" 2>&1
echo "CUDA tests: rc=$?; $(tail -1 "$out/cuda_tests.log")"
