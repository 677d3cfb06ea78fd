"""Which configuration for this model on this cluster: predicted memory and step time, best first, as commands.

    python launch/plan.py model=70b precision=bf16 train.seq_len=4096 train.global_batch_size=512 \
        cluster.gpu=h100 cluster.nodes=16
    python launch/plan.py model=tiny train.global_batch_size=8 cluster.gpu=cpu plan.verify=4

Options are `cluster.*`, `plan.*` and `format=`; everything else is a training override (see dist_train/plan/).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

from dist_train.plan.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
