"""Train one model under one strategy.

    torchrun --standalone --nproc_per_node=2 launch/train.py strategy=fsdp
    python launch/train.py strategy=single
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

import hydra  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

from dist_train.config import register_configs  # noqa: E402
from dist_train.rundir import register_resolvers  # noqa: E402

register_configs()
register_resolvers()


@hydra.main(config_path="../conf", config_name="config", version_base="1.3")
def _main(cfg: DictConfig) -> None:
    from dist_train.train import main

    code = main(cfg)
    if code:
        sys.exit(code)


if __name__ == "__main__":
    _main()
