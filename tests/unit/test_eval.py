"""Evaluation (eval.every_steps): the loss of held-out batches, forward only, the same under every strategy."""

from __future__ import annotations

import json
import math

import pytest
import torch

from dist_train.config import ConfigError, DataConfig, EvalConfig
from dist_train.data import build_datasets
from tests.conftest import RESUMABLE
from tests.unit.test_config import run_config


@pytest.mark.multiproc
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


def test_a_file_holds_out_its_tail_and_training_never_reads_it(tmp_path):
    path = tmp_path / "t.txt"
    path.write_bytes(bytes(range(200)) * 5)  # 1,000 bytes
    data = DataConfig(name="textfile", path=str(path))
    train, held_out = build_datasets(data, EvalConfig(every_steps=1, holdout=0.2), vocab_size=256, seq_len=9, seed=0)
    assert len(train.tokens) == 800 and len(held_out.tokens) == 200
    assert bytes(held_out.tokens) == (bytes(range(200)) * 5)[800:]
    whole, none = build_datasets(data, EvalConfig(every_steps=0), vocab_size=256, seq_len=9, seed=0)
    assert none is None and len(whole.tokens) == 1000  # evaluation off: training reads the whole file
    other = tmp_path / "eval.txt"
    other.write_bytes(b"held out " * 20)
    train, held_out = build_datasets(data, EvalConfig(every_steps=1, path=str(other)), vocab_size=256, seq_len=9, seed=0)
    assert len(train.tokens) == 1000 and bytes(held_out.tokens) == b"held out " * 20


def test_synthetic_held_out_batches_are_streams_training_never_draws():
    train, held_out = build_datasets(DataConfig(), EvalConfig(every_steps=1), vocab_size=256, seq_len=16, seed=3)
    seen = {tuple(row.tolist()) for step in range(50) for row in train.batch(step, 8)}
    assert not seen & {tuple(row.tolist()) for i in range(4) for row in held_out.batch(i, 8)}
    assert torch.equal(held_out.batch(1, 8), held_out.batch(1, 8))  # the same batches at every evaluation


def test_evaluation_is_without_dropout_or_gradients_and_leaves_the_model_training():
    from dist_train.config import ModelConfig, PrecisionConfig
    from dist_train.contracts import Batch
    from dist_train.model import build_model
    from dist_train.strategies.base import evaluate

    model = build_model(ModelConfig(dropout=0.5), seed=0)
    tokens = torch.randint(256, (4, 17))
    batch = Batch(input_ids=tokens[:, :-1], labels=tokens[:, 1:])
    first, second = (evaluate(model, batch, micro_batch_size=2, precision=PrecisionConfig(), device=torch.device("cpu"))
                     for _ in range(2))
    assert first.num_microbatches == 2 and torch.equal(first.loss_sum, second.loss_sum)  # dropout off
    assert model.training and all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize(("overrides", "needle"), [
    (["eval.every_steps=-1"], "eval.every_steps=-1 must be >= 0"),
    (["eval.every_steps=2", "eval.batches=0"], "eval.batches=0 must be >= 1"),
    (["eval.holdout=1.5"], r"eval.holdout=1.5 must be in \(0, 1\)"),
    (["eval.path=/nonexistent"], "data=synthetic reads none"),
])
def test_bad_eval_settings_are_one_line(overrides, needle):
    from dist_train.checks import validate

    with pytest.raises(ConfigError, match=needle):
        validate(run_config(*overrides)[1], 1)
