"""What every test shares: the markers that follow the directory, the CPU-only launches, and the session-wide runs.

tests/unit/ holds the tests that start no training process, tests/launched/ those that launch real training runs
(python or torchrun, Slurm jobs included). The `multiproc` marker comes from the directory, not from the test:
`pytest_collection_modifyitems` below sets it on everything under tests/launched/ and refuses a unit test that sets
it itself, so `-m multiproc` (tests/suite.sh's two sessions) always selects what the directory says.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

from tests.helpers import FAST, train_ok

# The suite's launches run on the CPU, also on a GPU workstation (two ranks on one GPU would be refused there,
# and the CPU is what every test expects): children inherit an empty CUDA_VISIBLE_DEVICES. This process keeps
# the GPUs it already counted, which tests/launched/test_cuda.py hands back to its own launches
# (helpers.env(cuda=True)).
GPUS_SEEN = torch.cuda.device_count() if torch.cuda.is_available() else 0
os.environ.setdefault("DIST_TRAIN_TEST_CUDA_VISIBLE_DEVICES", os.environ.get("CUDA_VISIBLE_DEVICES", ""))
os.environ["CUDA_VISIBLE_DEVICES"] = ""

TESTS = Path(__file__).resolve().parent
UNIT, LAUNCHED = TESTS / "unit", TESTS / "launched"


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """`multiproc` on every test under tests/launched/; a collection error for a test under tests/unit/ that marks
    itself `multiproc`, or a test module directly under tests/ (it belongs in one of the two)."""
    misplaced = []
    for item in items:
        path = Path(item.path).resolve()
        if LAUNCHED in path.parents:
            item.add_marker(pytest.mark.multiproc)
        elif UNIT in path.parents:
            if item.get_closest_marker("multiproc") is not None:
                misplaced.append(f"{item.nodeid}: marked multiproc under tests/unit/ (a test that launches training "
                                 "processes goes in tests/launched/, which marks it)")
        elif TESTS in path.parents:
            misplaced.append(f"{item.nodeid}: a test goes in tests/unit/ (no process started) or tests/launched/")
    if misplaced:
        raise pytest.UsageError("\n".join(misplaced))


# Strategies whose resume must be bit-exact (issue 8, and tp since), and how many processes each runs.
RESUMABLE = {"single": 0, "ddp": 2, "fsdp": 2, "zero1": 2, "zero2": 2, "zero3": 2, "gpipe": 2, "1f1b": 2, "tp": 2}
NPROC = {**RESUMABLE, "dp": 0, "fsdp_tp": 4, "ddp_tp": 4}  # fsdp_tp, ddp_tp: a 2 x 2 mesh
# 8 steps, a checkpoint after step 4 and step 8, both kept; the held-out loss after each (tests/launched/test_eval.py).
EVALUATED = ["eval.every_steps=4"]
CHECKPOINTED = [*FAST, "train.steps=8", "checkpoint.every_steps=4", "checkpoint.keep_last=0", *EVALUATED]


@pytest.fixture(scope="session")
def fast_run(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., tuple[Path, dict[str, Any]]]:
    """`fast_run(*overrides, nproc=N)`: `launch/train.py <FAST> <overrides>` run to completion, once per
    session and set of overrides; returns its run directory and summary.json. Tests that read the same training
    share its run (the dry run's comparison, ZeRO's collectives, FSDP's memory): a launch costs seconds of imports."""
    cache: dict[tuple[tuple[str, ...], int], tuple[Path, dict[str, Any]]] = {}

    def run(*overrides: str, nproc: int = 0) -> tuple[Path, dict[str, Any]]:
        key = (tuple(sorted(overrides)), nproc)
        if key not in cache:
            run_dir = tmp_path_factory.mktemp("run")
            cache[key] = run_dir, train_ok([*FAST, *overrides], run_dir=run_dir, nproc=nproc)
        return cache[key]

    return run


@pytest.fixture(scope="session")
def single_run(fast_run: Callable[..., tuple[Path, dict[str, Any]]]) -> tuple[Path, dict[str, Any]]:
    """The one-process baseline every strategy is compared with (run once per session)."""
    return fast_run("strategy=single")


@pytest.fixture(scope="session")
def straight_run(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], tuple[Path, dict[str, Any]]]:
    """`straight_run(strategy)`: 8 uninterrupted steps of that strategy, checkpointed after steps 4 and 8
    (run once per session and strategy, shared by the resume, reshard, export and restart tests)."""
    cache: dict[str, tuple[Path, dict[str, Any]]] = {}

    def run(strategy: str) -> tuple[Path, dict[str, Any]]:
        if strategy not in cache:
            run_dir = tmp_path_factory.mktemp(f"straight-{strategy}")
            cache[strategy] = run_dir, train_ok([f"strategy={strategy}", *CHECKPOINTED], run_dir=run_dir,
                                                nproc=NPROC[strategy])
        return cache[strategy]

    return run
