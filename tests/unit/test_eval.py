"""Evaluation (eval.every_steps): the held-out batches (a file's tail, or streams training never draws), forward
only, without dropout or gradients; bad settings in one line. The same held-out loss under every strategy:
tests/launched/test_eval.py."""

from __future__ import annotations

import pytest
import torch

from dist_train.config import ConfigError, DataConfig, EvalConfig
from dist_train.data import build_datasets
from tests.helpers import run_config


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
