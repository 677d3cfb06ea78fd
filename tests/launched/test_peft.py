"""peft=lora: the model frozen, low-rank adapters trained; the same losses as one process under ZeRO-2 and FSDP,
and gradients, optimizer state and gradient traffic that shrink to the adapters'. peft=qlora: the same over
4-bit projections. Bad settings and default targets: tests/unit/test_peft.py."""

from __future__ import annotations

from tests.helpers import FAST, assert_same_losses, last_step, train_ok

LORA = ["peft=lora", *FAST]
# model=tiny (GPT-2, hidden 64, MLP 256, 4 blocks), rank 8 on c_attn (64 -> 192), attention's c_proj (64 -> 64),
# c_fc (64 -> 256) and the MLP's c_proj (256 -> 64): r * (in + out) each, per block
ADAPTERS = 4 * 8 * ((64 + 192) + (64 + 64) + (64 + 256) + (256 + 64))


def test_lora_trains_only_the_adapters_and_every_strategy_agrees(tmp_path, fast_run):
    single = train_ok(["strategy=single", *LORA], run_dir=tmp_path / "single")
    assert single["num_trainable_params"] == ADAPTERS == 32_768
    total = single["num_params"]
    (rec,) = last_step(tmp_path / "single")
    assert rec["memory/params_bytes"] == 4 * total  # the base model and the adapters
    assert rec["memory/grads_bytes"] == 4 * ADAPTERS  # gradients of the adapters only
    assert 8 * ADAPTERS <= rec["memory/optimizer_bytes"] < 8 * ADAPTERS + 1024  # AdamW's moments (+ step counters)

    zero = train_ok(["strategy=zero2", *LORA], run_dir=tmp_path / "zero2", nproc=2)
    assert_same_losses(single, zero)
    for r in last_step(tmp_path / "zero2"):
        # ZeRO partitions what trains; the frozen base stays whole on every rank
        assert r["memory/params_bytes"] == 4 * total
        assert r["memory/grads_bytes"] == 4 * ADAPTERS / 2
        # only the adapters' gradients travel: reduced on each of the rank's 2 micro-batches (ZeRO-2), plus
        # the gradient norm's few bytes
        assert 2 * 4 * ADAPTERS <= r["comm/all_reduce/bytes"] <= 2 * 4 * ADAPTERS + 64

    fsdp_dir, fsdp = fast_run("strategy=fsdp", "peft=lora", nproc=2)  # the run the dry run's LoRA check reads
    assert_same_losses(single, fsdp)
    for r in last_step(fsdp_dir):
        # FSDP shards everything, frozen or not; only the adapters have gradients to reduce-scatter
        assert r["memory/params_bytes"] == 4 * total / 2 and r["memory/grads_bytes"] == 4 * ADAPTERS / 2
        assert r["comm/reduce_scatter/bytes"] == 4 * ADAPTERS


# model=tiny's target projections: per block c_attn 64 x 192, c_proj 64 x 64, c_fc 64 x 256, c_proj 256 x 64
TARGET_WEIGHTS = 4 * (64 * 192 + 64 * 64 + 64 * 256 + 256 * 64)


def test_qlora_packs_the_base_into_four_bits_and_ddp_agrees(tmp_path):
    """bitsandbytes' CPU backend runs its 4-bit layers too, so QLoRA is measured here, not only refused."""
    qlora = ["peft=qlora", *FAST]
    single = train_ok(["strategy=single", *qlora], run_dir=tmp_path / "single")
    assert single["num_trainable_params"] == ADAPTERS
    ddp = train_ok(["strategy=ddp", *qlora], run_dir=tmp_path / "ddp", nproc=2)
    assert_same_losses(single, ddp)
    for r in [*last_step(tmp_path / "single"), *last_step(tmp_path / "ddp")]:
        packed = r["memory/by_dtype/params/uint8_bytes"]
        # half a byte per weight, plus the double-quantized block scales (1 byte per block of 64)
        assert packed == TARGET_WEIGHTS // 2 + TARGET_WEIGHTS // 64
        # what stays fp32: embeddings, norms, biases, the head, the adapters (and the scales' own scales)
        assert r["memory/by_dtype/params/float32_bytes"] < 4 * (single["num_params"] - TARGET_WEIGHTS) + 20_000
        assert r["memory/grads_bytes"] == 4 * ADAPTERS  # the adapters train, nothing else
