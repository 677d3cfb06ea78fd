"""model=tiny's parameters by pipeline part, counted by hand: the split tests/unit/test_pipeline.py computes and the
per-stage memory tests/launched/test_pipeline.py measures."""

# Parameters of model=tiny (GPT-2, hidden 64, 4 blocks, vocab 256, 128 positions), counted by hand.
EMBED = 256 * 64 + 128 * 64  # wte + wpe
BLOCK = 2 * 64 * 2 + (64 * 192 + 192) + (64 * 64 + 64) + (64 * 256 + 256) + (256 * 64 + 64)  # 2 LNs, attn, mlp
HEAD = 2 * 64 + 256 * 64  # ln_f + lm_head
