"""torchrun, quiet when it is stopped: `python -m dist_train.torchrun` takes torchrun's arguments.

On Ctrl-C or SIGTERM, torchrun forwards the signal to its workers, waits for them, then dies with its own
`SignalException` traceback, after the workers have stopped cleanly and said how to resume. This runs torchrun's
own `main` and ends on such a signal with one line and the shell's exit code for it (130 for SIGINT, 143 for
SIGTERM); anything else is torchrun's behaviour, unchanged.
"""

from __future__ import annotations

import os
import sys

LAUNCHER_ENV = "DIST_TRAIN_LAUNCHER"


def main(argv: list[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.run import main as torchrun_main

    os.environ[LAUNCHER_ENV] = "python -m dist_train.torchrun"  # the workers' resume line names this launcher
    try:
        torchrun_main(argv)
    except SignalException as exc:
        print(f"torchrun: stopped by signal {int(exc.sigval)}; the workers' last lines say where", file=sys.stderr)
        return 128 + int(exc.sigval)
    return 0


if __name__ == "__main__":
    sys.exit(main())
