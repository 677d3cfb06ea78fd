"""Create (or update) a W&B workspace view and Report for one experiment group, from the keys its runs logged.

    python launch/dashboard.py outputs/compare-20261122-080000 [logger.project=P] [logger.entity=E] [group=G]

Without an API key or network it writes the same specification to <dir>/dashboard.json and says how to create
it later (see dist_train/dashboard.py).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

from dist_train.dashboard import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
