"""memory/peak_live_bytes: the estimator's side of fsdp's strategy.reduce_every_microbatch (gradient memory traded
for traffic), and which step is followed. Against torch's own tracker and the estimator on real runs:
tests/launched/test_peak_live.py."""

from __future__ import annotations

import pytest

from dist_train.estimate import ModelShape, predict_comm, predict_memory
from dist_train.estimate.setup import Setup


def test_estimator_reduce_every_microbatch_trades_gradient_memory_for_traffic():
    shape = ModelShape(name="llama-7b", arch="llama", num_layers=32, hidden_size=4096, num_heads=32, vocab_size=32000,
                       max_seq_len=4096, ffn_hidden_size=11008)
    base = dict(strategy="fsdp", family="fsdp", world_size=64, micro_batch_size=1, seq_len=4096, global_batch_size=512)
    once, every = Setup(**base), Setup(**base, reduce_every_microbatch=True)
    m = once.microbatches_per_step
    assert m == 8

    def reduce_scatter(setup):
        return sum(c.bytes for c in predict_comm(shape, setup)[0] if c.op == "reduce_scatter")

    assert reduce_scatter(every) == m * reduce_scatter(once) == m * 4 * shape.num_params
    held_once, held_every = predict_memory(shape, once)[0].peak_live, predict_memory(shape, every)[0].peak_live
    # Every rank holds the whole model's fp32 gradients instead of its 1/64th.
    assert held_once - held_every == pytest.approx(4 * shape.num_params * (1 - 1 / 64))


@pytest.mark.parametrize(("strategy", "family", "stage"), [("single", "single", 0), ("tp", "tp", 0),
                                                           ("zero1", "zero", 1)])
def test_one_micro_batch_a_step_peaks_at_one_end_of_backward(strategy, family, stage):
    """Without a micro-batch before it, backward starts with no gradient and ends with every one: the peak is the
    larger of its start (every activation, the loss's temporaries) and its end (the model state, the first block's
    activations), not both at once; with two micro-batches the first's gradients are there from the start. ZeRO-1
    beside it its reduction bucket."""
    from dist_train.estimate.memory import activation_bytes, backward_start_extra, element_bytes

    shape = ModelShape(name="llama-7b", arch="llama", num_layers=32, hidden_size=4096, num_heads=32, vocab_size=32000,
                       max_seq_len=4096, ffn_hidden_size=11008)
    n = 1 if strategy == "single" else 8
    for seq, mbs in ((256, 1), (4096, 2)):  # activations below the gradients, and above them
        one = Setup(strategy=strategy, family=family, zero_stage=stage, world_size=n, micro_batch_size=mbs,
                    seq_len=seq, global_batch_size=mbs * (1 if strategy == "tp" else n),
                    zero_reduce_bucket_size=shape.hidden_size**2 if stage else None)  # as training sizes it
        two = Setup(**{**one.__dict__, "global_batch_size": 2 * one.global_batch_size})
        assert (one.microbatches_per_step, two.microbatches_per_step) == (1, 2)
        bucket = one.zero_reduce_bucket_size * element_bytes(one.precision) if stage else 0.0
        rank = predict_memory(shape, one)[0]
        loss = backward_start_extra(shape, one)
        start = rank.total - rank.grads + loss
        end = rank.model_state + activation_bytes(shape, setup=one, num_layers=1, with_head=False, in_flight=1)
        assert rank.peak_live == max(start, end) + bucket
        assert (end > start) == (seq == 256), (strategy, seq, start, end)  # each end decides one of the two
        accumulating = predict_memory(shape, two)[0]
        assert accumulating.peak_live == accumulating.total + backward_start_extra(shape, two) + bucket


@pytest.mark.parametrize(("start", "steps", "warmup", "live", "timing_warmup"), [
    (0, 1, 1, None, 0),  # a fresh run of one step: no step holds the optimizer's state
    (0, 2, 1, 2, 1),  # step 2 is followed, and it is the one timed step (never all of them warm-up)
    (0, 3, 1, 2, 2),
    (0, 5, 1, 2, 2),  # FAST: telemetry.warmup_steps=1 plus the followed step
    (0, 5, 0, 2, 2),  # no warm-up asked for: still not step 1, and the followed step is not timed
    (0, 10, 3, 4, 4),
    (4, 8, 1, 6, 2),  # resumed after step 4: the checkpoint brought the optimizer's state
    (4, 5, 1, 5, 0),  # resumed with one step left: that one
])
def test_the_followed_step_holds_the_optimizers_state_and_is_a_warmup_step_where_the_run_allows(
        start, steps, warmup, live, timing_warmup):
    from types import SimpleNamespace

    from dist_train.telemetry.recorder import live_step
    from dist_train.train import warmup_steps

    step = live_step(start_step=start, last_step=steps, warmup_steps=warmup + 1)  # on the CPU: one more
    assert step == live
    session = SimpleNamespace(start_step=start, run=SimpleNamespace(train=SimpleNamespace(steps=steps),
                                                                    telemetry=SimpleNamespace(warmup_steps=warmup)),
                              telemetry=SimpleNamespace(live=object() if step is not None else None, live_step=step))
    assert warmup_steps(session) == timing_warmup
    # CUDA (the allocator's peak of every window from then on, no extra warm-up step): from step 2 of a fresh run
    assert live_step(start_step=start, last_step=steps, warmup_steps=0) == (
        None if start == 0 and steps == 1 else start + (2 if start == 0 else 1))
