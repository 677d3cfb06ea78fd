"""Train one config under several strategies and write a comparison report.

    python launch/compare.py compare.strategies=[single,ddp,fsdp,zero1,zero2,zero3,gpipe] compare.nproc=2 \
        model=tiny train.steps=5

Options are `compare.*` (see dist_train/compare/settings.py); everything else is a training override that
every run gets. The report lands in compare.out_dir (default outputs/compare-<time>/report.md).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

from dist_train.compare import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
