"""Train one config under several strategies and write a comparison report.

    python launch/compare.py compare.strategies=[single,ddp,fsdp,zero1,zero2,zero3,gpipe] compare.nproc=2 \
        model=tiny train.steps=5

Options are `compare.*` (see dist_train/compare/settings.py); everything else is a training override that
every run gets. The report lands in compare.out_dir (default outputs/compare-<time>/report.md).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

from dist_train.entry import exit_on_help  # noqa: E402


def _help() -> str:
    """--help: the compare.* options with the CompareConfig defaults, the exit codes, three examples."""
    from dist_train.compare.main import FAILED_ROW_EXIT, INTERRUPTED_EXIT
    from dist_train.compare.settings import CompareConfig
    from dist_train.entry import CONFIG_ERROR_EXIT, dataclass_options, help_text, option_line

    return help_text(
        __doc__,
        usage="python launch/compare.py [compare.KEY=VALUE ...] [training override ...]",
        sections=[
            ("options (compare.KEY=VALUE) with their defaults:", dataclass_options(CompareConfig, "compare.")),
            ("everything else:", [
                *option_line("GROUP=OPTION, KEY=VALUE", "a training override every row gets (see python "
                                                        "launch/train.py --help), except strategy= (the rows "
                                                        "come from compare.strategies)"),
                *option_line("hydra.run.dir=PATH", "the same as compare.out_dir=PATH"),
                *option_line("-h, --help", "this help"),
            ]),
            ("exit codes:", [
                *option_line("0", "every row ran; the report is written"),
                *option_line(str(FAILED_ROW_EXIT), "a row failed or timed out (its reason is in the report, "
                                                   "which is written)"),
                *option_line(str(CONFIG_ERROR_EXIT), "bad input: one line on stderr naming each bad option or row; "
                                                     "nothing ran"),
                *option_line(str(INTERRUPTED_EXIT), "Ctrl-C: the finished rows' report is written, with how to "
                                                    "run the rest"),
            ]),
        ],
        examples=[
            "python launch/compare.py compare.strategies=[single,ddp,fsdp] compare.nproc=2 model=tiny train.steps=5",
            "python launch/compare.py compare.strategies=[single,fsdp] model=tiny train.steps=5 "
            "'compare.sweep={precision:[fp32,bf16],train.activation_checkpointing:[none,full]}'",
            "python launch/compare.py compare.from=[sweeps/demo/two,sweeps/demo/one]   # a report of finished runs",
        ],
    )


if __name__ == "__main__":
    exit_on_help(sys.argv[1:], _help)  # before Hydra reads `--help` as an override

from dist_train.compare import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
