"""`python -m dist_train.estimate`: see dist_train/estimate/cli.py."""

import sys

from dist_train.estimate.cli import main

sys.exit(main())
