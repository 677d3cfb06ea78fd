"""NEFTune in real runs: a run with it differs from the plain one and still learns, and every strategy trains
like one process. The noise itself: tests/unit/test_neftune.py."""

from __future__ import annotations

from typing import Any

import pytest

from tests.helpers import FAST, assert_same_losses, train_ok

NEFTUNE = [*FAST, "train.neftune_alpha=5"]


@pytest.fixture(scope="module")
def neftune_single(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return train_ok(["strategy=single", *NEFTUNE], run_dir=tmp_path_factory.mktemp("neftune-single"))


def test_neftune_run_differs_from_the_plain_one_and_still_learns(single_run, neftune_single):
    _, plain = single_run
    assert neftune_single["losses"] != plain["losses"]
    assert neftune_single["losses"][-1] < neftune_single["losses"][0]


@pytest.mark.parametrize("strategy", ["ddp", "gpipe", "tp"])
def test_neftune_trains_every_strategy_like_one_process(neftune_single, strategy, fast_run):
    """Data parallelism, micro-batches, a pipeline's first stage and tensor parallelism's replicated ids: each
    sample gets the noise it gets in one process, so the losses agree. (The ddp run is the one the dry run's
    NEFTune check reads: tests/launched/test_dryrun.py.)"""
    _, run = fast_run(f"strategy={strategy}", "train.neftune_alpha=5", nproc=2)
    assert_same_losses(neftune_single, run)
