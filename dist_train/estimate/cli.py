"""`python -m dist_train.estimate [training overrides] [estimator options]` (`--help` says the same).

Training overrides (`model=llama_1b strategy=zero3 precision=bf16 train.seq_len=2048 ...`) are composed
with Hydra's compose API from conf/, exactly as launch/train.py would. `model=` also takes the estimator's
presets (`7b`, `13b`, `70b`, or the names its tables print, `llama2-7b`, ...): they become `model.*` overrides
of the default model group before composing, so the training config is still checked as training would check
it, later `model.<key>=` overrides still apply, and training itself accepts only conf/model/*.yaml.
Estimator options are plain `key=value` pairs, typed by :class:`EstimateArgs`:

    world_size=8 gpu_gib=80 regime=auto activation_checkpointing=true kv_batch=1 kv_context=4096
    fit.models=[7b,70b,llama_1b] fit.params=[175e9] fit.gpus=[8,64,1024] fit.strategies=[ddp,zero3]
    format=json      # the same figures as JSON, in bytes, for tools

One printout describes one model at one sequence length: the breakdown and the fit table both use the training
config's `train.seq_len` (and, unless fit.micro_batch_size says otherwise, its `train.micro_batch_size`).

The options are estimate/args.py, the printout estimate/report.py; this module composes the run and drives them.
"""
from __future__ import annotations

import json
import subprocess
import sys
from typing import Any, Optional

from omegaconf.errors import OmegaConfBaseException

from dist_train.estimate.args import DryRunArgs, FitArgs, checkpointing_option, help_text, parse_args, split_args
from dist_train.estimate.compose import check_as_training
from dist_train.estimate.dryrun import dryrun_rows, dryrun_section, supported
from dist_train.estimate.fit import fit_models, model_refusals
from dist_train.estimate.report import report, report_json
from dist_train.estimate.setup import setup_from_config
from dist_train.estimate.shapes import PRESETS, ModelShape, find_preset


def resolve_model_choice(training: list[str]) -> list[str]:
    """`model=7b` (a preset, by its key or by the name the tables print) as `model.*` overrides placed before the
    user's own `model.<key>=` (which win, as they would over a config group's values); a conf/model name is left
    to Hydra; anything else is a ValueError naming both lists."""
    from dist_train.estimate.compose import model_groups, shape_overrides

    choices = [a for a in training if a.split("=", 1)[0] == "model"]
    if not choices:
        return training
    name = choices[-1].split("=", 1)[1]
    groups = model_groups()
    if name in groups:
        return training
    preset = find_preset(name)
    if preset is None:
        printed = ", ".join(s.name for s in PRESETS.values())
        raise ValueError(f"model={name} is not an option (no conf/model/{name}.yaml); available: {', '.join(groups)} "
                         f"(or the presets by the names the tables print: {printed})")
    return shape_overrides(preset) + [a for a in training if a not in choices]


def compose(training: list[str]) -> tuple[dict[str, Any], Optional[str]]:
    """The training config, and the strategy name when its YAML does not exist (yet)."""
    from dist_train.estimate.compose import compose_training_config

    from hydra.errors import MissingConfigException

    try:
        return compose_training_config(training), None
    except Exception as exc:  # noqa: BLE001 - only a strategy with no YAML is retried; the rest re-raise
        names = [a.split("=", 1)[1] for a in training if a.startswith("strategy=")]
        missing = isinstance(exc, MissingConfigException) or isinstance(exc.__cause__, MissingConfigException)
        if not names or not missing or f"strategy/{names[-1]}" not in str(exc):
            raise
        rest = [a for a in training if not a.startswith(("strategy=", "strategy."))]
        return compose_training_config(rest), names[-1]


def main(argv: list[str] | None = None) -> int:
    """Bad input of any kind (our checks, Hydra's composition, OmegaConf's types) is one `config error:` line."""
    from hydra.errors import HydraException

    from dist_train.config import ConfigError
    from dist_train.entry import one_line, print_help, report_config_error
    from dist_train.paths import expand_overrides

    argv = expand_overrides(sys.argv[1:] if argv is None else list(argv))  # model.path=~/m, as the shell left it
    if "--help" in argv or "-h" in argv:  # before Hydra's override parser, which cannot read it
        print_help(help_text())
        return 0
    own, training = split_args(argv)
    try:
        args = parse_args(own)
        cfg, unlisted = compose(resolve_model_choice(training))
        shape = ModelShape.from_config(cfg["model"])
        checkpointing = checkpointing_option(args.activation_checkpointing, cfg["train"])
        # LoRA: the estimator does not model its adapters (setup_from_config says so); the dry run measures them
        adapters = str((cfg.get("peft") or {}).get("name", "none")) != "none" and bool(args.dryrun.ranks)
        setup = setup_from_config(
            {**cfg, "peft": {"name": "none"}} if adapters else cfg, world_size=args.world_size, regime=args.regime,
            ep_overload=args.ep_overload, **checkpointing, **({"strategy": unlisted} if unlisted else {}),
        )
        if args.ep_overload > max(setup.ep, 1) or (args.ep_overload != 1 and setup.ep <= 1):
            raise ValueError(f"ep_overload={args.ep_overload} must be between 1 and strategy.ep={setup.ep} (every "
                             "token on one rank's experts); it applies to fsdp_ep and ep only")
        dryrun_overrides = resolve_model_choice(training)
        if args.dryrun.ranks:
            why_not = supported(setup.family, setup.strategy, num_experts=shape.num_experts,
                                experts_implementation=str(cfg["model"].get("experts_implementation") or "eager"))
            if why_not:
                raise ValueError(why_not)
        refused: dict[str, str] = {}
        if unlisted is None:  # a strategy with no YAML yet: nothing of training's to check it against
            # training's checks, training's line; the dry run runs here, so it is checked for this machine
            run = check_as_training(dryrun_overrides, world_size=args.world_size, here=bool(args.dryrun.ranks))
            refused = model_refusals(run)
        models = fit_models(shape, names=args.fit.models, params=args.fit.params, refused=refused)
    except ConfigError as exc:  # our own checks' line, as launch/train.py prints it
        return report_config_error(str(exc))
    except (ValueError, OmegaConfBaseException, HydraException) as exc:
        return report_config_error(one_line(exc, {"fit": FitArgs, "dryrun": DryRunArgs}))
    dry: list[dict[str, Any]] = []
    if args.dryrun.ranks:
        try:
            dry = dryrun_rows(dryrun_overrides, shape, setup, ranks=list(args.dryrun.ranks),
                              timeout_s=args.dryrun.timeout_s, predict=not adapters)
        except (RuntimeError, subprocess.TimeoutExpired) as exc:
            print(f"dry run failed: {one_line(exc)}", file=sys.stderr)
            return 1
    if adapters:  # no prediction to print beside it: the dry run's own figures, and why
        note = (f"peft={cfg['peft']['name']}: the estimator does not model LoRA adapters yet; the dry run's figures "
                "are measured with them, nothing is predicted")
        if args.format == "json":
            print(json.dumps({"note": note, "dryrun": {"world_size": args.world_size, "ranks": dry}}, indent=1))
        else:
            print(note + "\n\n" + dryrun_section(dry, world_size=args.world_size))
        return 0
    if args.format == "json":
        out = report_json(shape, setup, args=args, models=models)
        if dry:
            out["dryrun"] = {"world_size": args.world_size, "ranks": dry}
        print(json.dumps(out, indent=1))
    else:
        print(report(shape, setup, args=args, unlisted=unlisted is not None, models=models))
        if dry:
            print("\n" + dryrun_section(dry, world_size=args.world_size))
    return 0
