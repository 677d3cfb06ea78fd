"""Evaluation (eval.every_steps) on real runs: the loss of held-out batches is the same under every strategy, and
the evaluation leaves the steps around it as they were. The held-out data and the evaluation itself:
tests/unit/test_eval.py."""

from __future__ import annotations

import json
import math

import pytest

from tests.conftest import RESUMABLE


def test_every_strategy_evaluates_the_same_held_out_loss(straight_run):
    """The straight runs evaluate after steps 4 and 8 (tests/conftest.py): every strategy's held-out loss is
    one process's (fp32, 1e-5), in summary.json and in the records of the window it closes."""
    _, single = straight_run("single")
    assert [s for s, _ in single["eval_losses"]] == [4, 8]
    assert single["final_eval_loss"] == single["eval_losses"][-1][1]
    assert single["final_eval_perplexity"] == pytest.approx(math.exp(single["final_eval_loss"]))
    assert single["eval_losses"][0][1] != single["eval_losses"][1][1]  # the model trained in between
    for strategy in RESUMABLE:
        run_dir, s = straight_run(strategy)
        for (step, loss), (_, expected) in zip(s["eval_losses"], single["eval_losses"], strict=True):
            assert abs(loss - expected) <= 1e-5 * abs(expected), (strategy, step, loss, expected)
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        assert {r["step"] for r in rows if "eval/loss" in r} == {4, 8}, strategy
        # The evaluation's collectives are not the step's, and it leaves nothing behind: the steps around it send
        # and hold what step 3 does (every step sends alike; FSDP2's root is resharded after the forward, ZeRO-3's
        # gathered parameters released). A pipeline stage prepares its forward again after a forward-only run of
        # its schedule: the step after holds its first step's 4-byte exchange again (torch's pipelining), once.
        by_step = {(r["step"], r["rank"]): r for r in rows}
        for rank in range(max(RESUMABLE[strategy], 1)):
            sent = {step: {k: v for k, v in by_step[(step, rank)].items() if k.endswith("/bytes")} for step in (1, 3, 4, 5)}
            assert sent[3] == sent[4] == sent[5 if strategy not in ("gpipe", "1f1b") else 3], (strategy, rank)
            if strategy in ("gpipe", "1f1b"):
                assert sent[5] == sent[1], (strategy, rank)
            held = [by_step[(step, rank)]["memory/params_bytes"] for step in (3, 4, 5)]
            assert held[0] == held[1] == held[2], (strategy, rank, held)
