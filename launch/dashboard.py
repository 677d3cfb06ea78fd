"""Create (or update) a W&B workspace view and Report for one experiment group, from the keys its runs logged.

    python launch/dashboard.py outputs/compare-20261122-080000 [logger.project=P] [logger.entity=E] [group=G]

Without an API key or network it writes the same specification to <dir>/dashboard.json and says how to create
it later (see dist_train/dashboard.py).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

from dist_train.entry import exit_on_help  # noqa: E402

# The options dist_train.dashboard accepts (its _OPTIONS; tests/launched/test_help.py checks the two agree), their
# defaults and meaning: listed here so that --help does not wait for torch to import.
OPTIONS = {
    "logger.project=P": "the W&B project (default: the one project the runs logged to)",
    "logger.entity=E": "the W&B entity (default: your W&B default entity)",
    "group=G": "the W&B group of the runs (default: the one group the runs logged to)",
    "out=FILE": "where the specification goes when W&B cannot be reached (default: <first DIR>/dashboard.json)",
}


def _help() -> str:
    from dist_train.entry import help_text, option_line

    return help_text(
        __doc__,
        usage="python launch/dashboard.py DIR... [logger.project=P] [logger.entity=E] [group=G] [out=FILE]",
        sections=[
            ("arguments:", option_line("DIR...", "run directories, directories of runs (a comparison's output, "
                                                 "a multirun sweep), or W&B paths ENTITY/PROJECT/RUN_ID or "
                                                 "ENTITY/PROJECT/groups/NAME")),
            ("options (KEY=VALUE) with their defaults:", [ln for name, note in OPTIONS.items()
                                                          for ln in option_line(name, note)]
             + option_line("-h, --help", "this help")),
        ],
        examples=[
            "python launch/dashboard.py outputs/compare-20261122-080000",
            "python launch/dashboard.py outputs/ddp-20261122-080000 outputs/fsdp-20261122-081500 group=my-experiment",
            "python launch/dashboard.py sweeps/demo logger.project=dist_train logger.entity=my-team out=dashboard.json",
        ],
    )


if __name__ == "__main__":
    exit_on_help(sys.argv[1:], _help)  # before the run directories are looked for

from dist_train.dashboard import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
