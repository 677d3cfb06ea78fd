"""`python -m dist_train.estimate`: see dist_train/estimate/cli.py."""

import os
import sys

# The estimator computes nothing heavy (its dry run runs on fake tensors): one OpenMP thread, so that torch's import
# starts none and the dry run can fork its ranks from this process (estimate/dryrun/rows.py).
os.environ.setdefault("OMP_NUM_THREADS", "1")

from dist_train.estimate.cli import main  # noqa: E402

sys.exit(main())
