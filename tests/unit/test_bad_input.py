"""Bad input, in this process: docs/troubleshooting.md's "Bad input the tests try" table lists exactly the cases
tests/launched/test_bad_input.py launches (tests/bad_input_support.py), and the one-line formatter keeps what is wrong
and drops Hydra's noise.
"""

from __future__ import annotations

import re

import pytest

from dist_train.entry import one_line
from tests.bad_input_support import CASES
from tests.helpers import ROOT


def test_the_docs_list_exactly_the_bad_inputs_tested():
    page = (ROOT / "docs" / "troubleshooting.md").read_text()
    section = page.split("## Bad input the tests try", 1)[1].split("\n#", 1)[0]
    rows = re.findall(r"^\| `([^`]*)` \| `([^`]*)` \|", section, flags=re.M)
    tested = {(_entry_name(e), a or "(none)") for e, a, _ in CASES} | {("torchrun launch/train.py", "train.lr=-1")}
    assert set(rows) == tested


def _entry_name(entry: str) -> str:
    return "python " + entry


# -------------------------------------------------------------------- the one-line formatter
def _hydra_error(*overrides: str) -> BaseException:
    from dist_train.estimate.compose import compose_training_config

    with pytest.raises(Exception) as err:
        compose_training_config(list(overrides))
    return err.value


@pytest.mark.parametrize(
    ("overrides", "line"),
    [
        (["optimizer=adam"], "optimizer=adam is not an option (no conf/optimizer/adam.yaml); available: adafactor, "
                             "adam8bit, adamw, lion, lomo, sgd"),
        (["train.lr=abc"],
         "Error merging override train.lr=abc; Value 'abc' of type 'str' could not be converted to Float"),
        (["strategy.stage=5"], "Could not override 'strategy.stage'; Key 'stage' not in 'DDPConfig'"),
        # a key its group does not have: another group's of that name, or a close one in the same group
        (["optimizer.lr=1e-4"],
         "Could not override 'optimizer.lr'; Key 'lr' not in 'OptimizerConfig'; did you mean train.lr?"),
        (["train.step=2"],
         "Could not override 'train.step'; Key 'step' not in 'TrainConfig'; did you mean train.steps?"),
        (["train.nokey=1"], "Could not override 'train.nokey'; Key 'nokey' not in 'TrainConfig'"),
        (["--world_size"], "--world_size: options are key=value overrides, not --flags; --help lists them"),
    ],
)
def test_one_line_keeps_what_is_wrong_and_drops_hydra_noise(overrides, line):
    assert one_line(_hydra_error(*overrides)) == line


def test_did_you_mean_looks_in_the_entry_points_own_options_too():
    """launch/plan.py's and launch/compare.py's own keys (plan.*, compare.*) are suggested beside training's: a
    misspelt own key gets its close match, and a training key its namesake in either."""
    from omegaconf.errors import OmegaConfBaseException

    from dist_train.compare.settings import CompareConfig, parse
    from dist_train.estimate.args import parse_options
    from dist_train.estimate.hardware import ClusterArgs
    from dist_train.plan.cli import PlanArgs, PlanOptions

    plan = {"plan": PlanOptions, "cluster": ClusterArgs}
    with pytest.raises(OmegaConfBaseException) as err:
        parse_options(PlanArgs, ["plan.timeout=5"])
    assert one_line(err.value, plan) == "plan.timeout: Key 'timeout' not in 'PlanOptions'; did you mean plan.timeout_s?"
    assert one_line(err.value) == "plan.timeout: Key 'timeout' not in 'PlanOptions'"  # no options given: no guess
    with pytest.raises(OmegaConfBaseException) as err:
        parse(["timeout=5"])
    assert one_line(err.value, {"compare": CompareConfig}).endswith("did you mean compare.timeout_s?")
    line = one_line(_hydra_error("train.timeout_s=5"), plan)
    assert line.endswith("; did you mean plan.timeout_s or runtime.timeout_s?")
