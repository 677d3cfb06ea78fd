"""Train one model under one strategy.

    torchrun --standalone --nproc_per_node=2 launch/train.py strategy=fsdp
    python launch/train.py strategy=single
    python launch/train.py --check-config strategy=fsdp      # validate only (for WORLD_SIZE, default 1)
"""

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

import hydra  # noqa: E402
from omegaconf import DictConfig  # noqa: E402
from torch.distributed.elastic.multiprocessing.errors import record  # noqa: E402

from dist_train.strategies.registry import register_configs  # noqa: E402
from dist_train.entry import mark_running, run_hydra_app  # noqa: E402
from dist_train.rundir import register_resolvers  # noqa: E402

register_configs()
register_resolvers()


_CHECK_ONLY = False  # --check-config: validate for WORLD_SIZE and exit, start nothing


def _accept_launcher_args(argv: list[str]) -> list[str]:
    """Take off the command line what Hydra would reject.

    --local_rank=N (the deepspeed launcher, torch.distributed.launch) becomes LOCAL_RANK, as torchrun passes
    it; --check-config only validates the config (for WORLD_SIZE) and exits: 0, or 2 with the one line.
    """
    global _CHECK_ONLY
    kept, i = [], 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--check-config":
            _CHECK_ONLY = True
        elif arg.startswith(("--local_rank=", "--local-rank=")):
            os.environ.setdefault("LOCAL_RANK", arg.split("=", 1)[1])
        elif arg in ("--local_rank", "--local-rank") and i + 1 < len(argv):
            os.environ.setdefault("LOCAL_RANK", argv[i + 1])
            i += 1
        else:
            kept.append(arg)
        i += 1
    return kept


@hydra.main(config_path="../conf", config_name="config", version_base="1.3")
def _main(cfg: DictConfig) -> None:
    from dist_train.train import main

    try:
        code = main(cfg, check_only=_CHECK_ONLY)
    except BaseException as exc:  # the training's own failure, not bad input: keep its traceback
        raise mark_running(exc)
    if code:
        sys.exit(code)  # also where Hydra runs this elsewhere (a submitit job)


@record  # under torchrun: the failing rank's exception goes into the launcher's failure summary
def _launch() -> int:
    try:
        return run_hydra_app(_main)
    except SystemExit as stop:  # main()'s own exit code (NaN stop, ...): ended below like any other
        if isinstance(stop.code, int):
            return stop.code
        raise


if __name__ == "__main__":
    sys.argv[1:] = _accept_launcher_args(sys.argv[1:])
    exit_code = _launch()
    from dist_train.runtime import leave

    leave(exit_code)  # a process that ran a process group ends here (see leave); the others below
    sys.exit(exit_code)
