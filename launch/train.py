"""Train one model under one strategy.

    torchrun --standalone --nproc_per_node=2 launch/train.py strategy=fsdp
    python launch/train.py strategy=single
    python launch/train.py --check-config strategy=fsdp      # validate only (for WORLD_SIZE, default 1)

Pick one option per config group (`strategy=fsdp model=hf`) and override any key (`train.steps=100`); the run
directory holds the resolved config, metrics.jsonl, summary.json, per-rank logs and checkpoints.
"""

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

from dist_train.entry import exit_on_help  # noqa: E402

CONF = Path(__file__).resolve().parent.parent / "conf"


def _help() -> str:
    """--help: the config groups and their options (from conf/), the main keys with the dataclasses' defaults."""
    from dist_train import config as c
    from dist_train.entry import config_groups, dataclass_options, help_text, option_line, yaml_note

    groups = config_groups(CONF)
    group_lines = [ln for name, options, default in groups
                   for ln in option_line(name, ", ".join(o + ("*" if o == default else "") for o in options))]
    strategies = next((options for name, options, _ in groups if name == "strategy"), [])
    flags = [
        *option_line("--check-config", "validate the config for WORLD_SIZE processes (default 1) and exit, "
                                       "starting nothing: 0, or 2 with one line saying what is wrong"),
        *option_line("-h, --help", "this help"),
        *option_line("--cfg job", "print the composed config, every key with its value, and exit (Hydra)"),
        *option_line("hydra.run.dir=PATH", "the run directory (default outputs/<strategy>-<time or launch id>); "
                                           "the same command in the same directory resumes"),
        *option_line("-m, --multirun", "one run per combination of comma-separated values, e.g. -m "
                                       "strategy=single,ddp (Hydra; directories under hydra.sweep.dir)"),
        *option_line("--hydra-help", "Hydra's own options"),
    ]
    keys = [*dataclass_options(c.TrainConfig, "train."), *dataclass_options(c.EvalConfig, "eval."),
            *dataclass_options(c.CheckpointConfig, "checkpoint."), *dataclass_options(c.RuntimeConfig, "runtime."),
            "  and every key of model.*, data.*, optimizer.*, peft.*, precision.*, logger.*, telemetry.*, strategy.*:",
            "  see them with their values for a choice of groups with --cfg job (schemas: dist_train/config.py)"]
    return help_text(
        __doc__,
        usage="python launch/train.py [--check-config] [GROUP=OPTION ...] [KEY=VALUE ...]\n"
              "       torchrun --nproc_per_node=N launch/train.py [--check-config] [GROUP=OPTION ...] [KEY=VALUE ...]",
        sections=[
            ("flags:", flags),
            ("config groups (GROUP=OPTION, * the default; one YAML file each in conf/GROUP/):", group_lines),
            ("strategies (strategy=NAME):", [ln for s in strategies
                                             for ln in option_line(s, yaml_note(CONF / "strategy" / f"{s}.yaml"))]),
            ("keys (KEY=VALUE) with their defaults:", keys),
        ],
        examples=[
            "python launch/train.py strategy=single train.steps=5                  # one process, the tiny model",
            "torchrun --standalone --nproc_per_node=2 launch/train.py strategy=fsdp  # two processes, FSDP2",
            "python launch/train.py model=hf model.path=DIR data=tokens data.path=OUT.bin  "
            "# your own model (launch/prepare_tokens.py writes OUT.bin)",
            "WORLD_SIZE=8 python launch/train.py --check-config strategy=fsdp      # validate for 8 processes",
        ],
    )


if __name__ == "__main__":
    exit_on_help(sys.argv[1:], _help)  # before Hydra and torch are imported: Hydra's own help lists internals

import gc  # noqa: E402

gc.disable()  # Python's collector, during the imports: back on in _main (dist_train.runtime.imports_done)

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

    `~` starting a value is expanded (dist_train.paths); --local_rank=N (the deepspeed launcher,
    torch.distributed.launch) becomes LOCAL_RANK, as torchrun passes it; --check-config only validates the config (for WORLD_SIZE) and exits: 0, or 2 with the one line.
    """
    global _CHECK_ONLY
    from dist_train.paths import expand_overrides

    argv = expand_overrides(argv)  # `model.path=~/x`: the `~` the shell left, which Hydra's lexer refuses
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
    from dist_train.runtime import imports_done
    from dist_train.train import main

    imports_done()
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
