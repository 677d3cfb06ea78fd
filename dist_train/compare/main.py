"""Run the matrix, then build the table, verdicts, predictions, pictures, report and W&B run."""

from __future__ import annotations

import json
import shlex
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

from dist_train.compare.settings import CompareConfig, parse, pinned_global_batch, resolve_out_dir, split_argv


FAILED_ROW_EXIT = 1  # the report is written; a row failed
INTERRUPTED_EXIT = 130  # Ctrl-C: the finished rows' report is written


@dataclass
class Comparison:
    out_dir: Path
    rows: list[dict[str, Any]]
    report: Optional[Path]  # None: interrupted before any row finished
    wandb_dir: Optional[Path]
    not_run: list[str] = field(default_factory=list)  # the rows a Ctrl-C left out


def run_comparison(cfg: CompareConfig, training: list[str], *, command: str = "") -> Comparison:
    from dist_train.compare.document import fit_section, render
    from dist_train.compare.plots import make_plots
    from dist_train.compare.report import write_tables
    from dist_train.compare.runner import run_strategy
    from dist_train.compare.sweep import add_knobs, expand, knob_effects
    from dist_train.compare.table import build_row, few_timed_steps
    from dist_train.compare.verdict import add_verdicts
    from dist_train.estimate.compose import compose_training_config

    out_dir = resolve_out_dir(cfg)
    out_dir.mkdir(parents=True, exist_ok=True)
    group = cfg.group or out_dir.name
    not_run: list[str] = []
    if cfg.from_:
        from dist_train.compare.collect import collect

        results, base = collect(cfg.from_)
        specs = [r.spec for r in results]
        rows = [build_row(r) for r in results]
    else:
        base = compose_training_config(training)  # a bad training override fails here, before any run
        specs = expand(cfg.strategies, cfg.sweep)
        rows = []
        try:
            for i, spec in enumerate(specs):
                print(f"[compare] {spec.label} ({i + 1}/{len(specs)}): running ...", file=sys.stderr, flush=True)
                pinned = pinned_global_batch(base["train"], spec, world_size=_world_size(cfg))
                result = run_strategy(spec, training=[*training, *pinned], nproc=cfg.nproc, out_dir=out_dir,
                                      group=group, timeout_s=cfg.timeout_s, launcher=cfg.launcher)
                rows.append(build_row(result))
                print(f"[compare] {spec.label}: {rows[-1]['status']} in {result.seconds:.1f} s {result.reason}",
                      file=sys.stderr, flush=True)
        except KeyboardInterrupt:  # a running launch is down already (runner): report the rows that finished
            not_run = [s.label for s in specs[len(rows):]]
            specs = specs[:len(rows)]
            if not rows:
                return Comparison(out_dir, [], None, None, not_run)
            print(f"[compare] interrupted: writing the report of the {len(rows)} finished row(s)", file=sys.stderr,
                  flush=True)
    add_verdicts(rows, rtol=cfg.loss_rtol)
    noisy = few_timed_steps(rows)
    if noisy:  # report.md says it too, above its table
        print(f"[compare] warning: {noisy}", file=sys.stderr, flush=True)
    for row in rows:
        _predict_safely(row, memory_rtol=cfg.memory_rtol)
    effects = knob_effects(rows, add_knobs(rows))
    (out_dir / "effects.json").write_text(json.dumps(effects, indent=2, default=str))
    plots = make_plots(rows, out_dir)
    write_tables(rows, out_dir)
    (out_dir / "compare.json").write_text(json.dumps({"compare": asdict(cfg), "training_overrides": training,
                                                      "group": group, "command": command}, indent=2))
    dryruns: list[dict[str, Any]] = []
    if cfg.dryrun_world_sizes:
        from dist_train.compare.dryruns import run_dryruns

        dryruns = run_dryruns(specs, training, world_sizes=[int(n) for n in cfg.dryrun_world_sizes],
                              timeout_s=cfg.timeout_s)
        (out_dir / "dryruns.json").write_text(json.dumps(dryruns, indent=1))
    fit = fit_section(base, cfg, strategies=[s.name for s in specs])
    report = out_dir / "report.md"
    report.write_text(render(rows=rows, cfg=cfg, out_dir=out_dir, group=group, command=command,
                             training=training, base=base, plots=plots, fit=fit, effects=effects, dryruns=dryruns))
    wandb_dir = None
    if _wants_wandb(cfg, base):
        from dist_train.compare.wandb_log import log_comparison

        wandb_dir = log_comparison(rows, logger=base["logger"], group=group, out_dir=out_dir, images=plots)
    return Comparison(out_dir, rows, report, wandb_dir, not_run)


def _world_size(cfg: CompareConfig) -> int:
    """Processes of a multi-process row: compare.nproc here, or per node of the Slurm job."""
    if cfg.launcher != "slurm":
        return cfg.nproc
    from dist_train.slurm import Allocation

    return cfg.nproc * Allocation.from_env().num_nodes


def _predict_safely(row: dict[str, Any], *, memory_rtol: float) -> None:
    """A strategy the estimator cannot model keeps its measured row, with the reason."""
    from dist_train.compare.predicted import add_prediction

    try:
        add_prediction(row, memory_rtol=memory_rtol)
    except (ValueError, KeyError, FileNotFoundError) as exc:
        row["prediction_error"] = f"{type(exc).__name__}: {exc}"


def _wants_wandb(cfg: CompareConfig, base: dict[str, Any]) -> bool:
    return cfg.wandb if cfg.wandb is not None else base["logger"]["name"] == "wandb"


def main(argv: list[str] | None = None) -> int:
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from dist_train.entry import one_line, report_config_error

    from dist_train.paths import expand_overrides

    argv = expand_overrides(sys.argv[1:] if argv is None else argv)  # compare.out_dir=~/x, model.path=~/m
    command = "python launch/compare.py " + " ".join(shlex.quote(a) for a in argv)
    try:
        own, training = split_argv(argv)
        cfg = parse(own)
        # A bad training override fails here, once, before any strategy runs (not once per row).
        from dist_train.estimate.compose import compose_training_config

        if cfg.from_:
            from dist_train.compare.collect import run_dirs

            run_dirs(cfg.from_)
        else:
            from dist_train.compare.runner import check_rows
            from dist_train.compare.sweep import expand

            base = compose_training_config(training)
            # Every row checked before the first runs: a typo in the last one is not found an hour in.
            problems = check_rows(expand(cfg.strategies, cfg.sweep), training, world_size=_world_size(cfg),
                                  base_train=base["train"])
            if problems:
                return report_config_error("compare.strategies: " + "; ".join(problems))
    except (ValueError, OmegaConfBaseException, HydraException) as exc:
        return report_config_error(one_line(exc, {"compare": CompareConfig}))
    result = run_comparison(cfg, training, command=command)
    if result.report is None:
        print("interrupted before any row finished: nothing to report", file=sys.stderr)
        return INTERRUPTED_EXIT
    for row in result.rows:
        print(f"{row['strategy']:>12}  {row['verdict']}")
    print(f"report: {result.report}")
    failed = [row["strategy"] for row in result.rows if row["status"] != "ok"]
    if result.wandb_dir is not None:
        print(f"W&B comparison run: {result.wandb_dir}")
    offline = sorted(result.out_dir.glob("*/wandb/offline-run-*")) + sorted(result.out_dir.glob("wandb/offline-run-*"))
    if offline:  # as training says at its end: nothing reached W&B yet
        print(f"W&B runs logged offline: {len(offline)}; upload with: wandb sync {result.out_dir}/*/wandb/offline-run-* "
              f"{result.out_dir}/wandb/offline-run-*")
        print(f"then a dashboard for the group: python launch/dashboard.py {result.out_dir}")
    if result.not_run:
        rest = ",".join(result.not_run)
        print(f"interrupted: {len(result.rows)} row(s) ran, not {rest}. To finish: the same command with "
              f"compare.strategies=[{rest}] compare.out_dir=OUT2, then one report of both: python launch/compare.py "
              f"compare.from=[{result.out_dir},OUT2]", file=sys.stderr)
        return INTERRUPTED_EXIT
    if failed:
        print(f"{len(failed)} of {len(result.rows)} row(s) failed: {', '.join(failed)} (their reasons are in the "
              "report)", file=sys.stderr)
        return FAILED_ROW_EXIT
    return 0
