"""Assemble report.md from the pieces in report.py, in the order a reader needs them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dist_train.compare.report import (comm_table, dtype_table, effects_table, md_table, prediction_table, runs_table,
                                       summary_table)
from dist_train.compare.dryruns import DRYRUN_INTRO, dryrun_table
from dist_train.compare.settings import CompareConfig
from dist_train.compare.table import few_timed_steps
from dist_train.estimate.render import human_bytes, human_count

CAVEATS = """\
- Memory is what each rank holds, counted from its tensors (CPU has no allocator statistics): parameters,
  gradients and optimizer state (DeepSpeed's fp32 master partition is counted under optimizer), plus
  activations saved for backward where the run measured them. "±" is the spread (max - min) over ranks.
- Collective time is summed from issue to completion on each rank and averaged over ranks; asynchronous
  collectives overlap compute, so it is an upper bound of the communication a step waits for, and
  compute = step - comm (clipped at 0) a lower bound. It includes waiting for the slowest rank.
- Bytes per step are buffer sizes as nccl-tests counts them (all-gather: gathered output; reduce-scatter:
  input), the max over ranks. Ring traffic per rank is buffer x 2(N-1)/N for an all-reduce, x (N-1)/N for
  all-gather / reduce-scatter: the ZeRO paper's 2Ψ (DDP, ZeRO-1/2) and 3Ψ (ZeRO-3, FSDP).
- Predictions come from `dist_train.estimate` with each run's own config.yaml. The optimizer column
  includes step counters in the measurement (a few bytes per tensor) and the master copy in both.
- Activations are predicted with Korthikanti et al.'s per-layer formula adapted to this model (no dropout,
  SDPA attention keeps no s² scores, fp32 log-softmax of the logits); they are shown, not judged."""


EFFECTS_INTRO = """\
Each line pairs two runs of the same strategy that differ in one knob only (the knobs are the training settings
that differ between the runs; compare.sweep sets them): the relative change of the step time and of each memory
category's worst rank, measured, with the size after the change and the estimator's predicted change."""


def _global_batch(train: dict[str, Any], nproc: int) -> str:
    """The comparison's global batch: the config's, or where it is null the one every row is pinned to
    (settings.pinned_global_batch: the micro-batch x the processes)."""
    if train["global_batch_size"] is not None:
        return str(train["global_batch_size"])
    return f"{train['micro_batch_size'] * nproc} (each row's micro-batch x {nproc} processes)"


def render(*, rows: list[dict[str, Any]], cfg: CompareConfig, out_dir: Path, group: str, command: str,
           training: list[str], base: dict[str, Any], plots: dict[str, Path], fit: str,
           effects: list[dict[str, Any]], dryruns: list[dict[str, Any]] | None = None) -> str:
    model, train = base["model"], base["train"]
    num_params = next((r["num_params"] for r in rows if "num_params" in r), None)
    noisy = few_timed_steps(rows)  # compare printed it on stderr as well
    parts = [
        f"# Strategy comparison `{out_dir.name}`",
        f"`{command}`",
        f"Model **{model['name']}** ({model['arch']}, {model['num_layers']} layers, hidden {model['hidden_size']}"
        + (f", Ψ = {num_params:,} = {human_count(num_params)} parameters" if num_params else "") + "), "
        f"precision {base['precision']['name']}, optimizer {base['optimizer']['name']}, global batch "
        f"{_global_batch(train, cfg.nproc)} x {train['seq_len']} tokens (micro-batch {train['micro_batch_size']}), "
        f"{train['steps']} steps, {cfg.nproc} processes per multi-process strategy"
        f"{' on each node of the Slurm job' if cfg.launcher == 'slurm' else ''}. Training overrides: "
        f"`{' '.join(training) or '(none)'}`. W&B group `{group}`.",
        "## Verdicts",
        "\n".join(f"- **{r['strategy']}**: {r['verdict']}" for r in rows),
        "## Table",
        *([f"**Warning:** {noisy}."] if noisy else []),
        summary_table(rows),
        *(["## Memory by dtype (worst rank of each category)", dtype_table(rows)]
          if any("mem_by_dtype" in r for r in rows) else []),
        "## Where communication goes (per step)",
        comm_table(rows),
        "## Predicted vs measured model state (worst rank's error)",
        prediction_table(rows, memory_rtol=cfg.memory_rtol),
        *(["## What each knob changes", EFFECTS_INTRO, effects_table(effects)] if effects else []),
        "## Pictures",
        "\n\n".join(f"![{name}]({path.name})" for name, path in plots.items()),
        *(["## Dry runs at other world sizes (not measured)", DRYRUN_INTRO, dryrun_table(dryruns)] if dryruns else []),
        "## Would it fit?",
        fit,
        "## Runs (every number above comes from these directories)",
        runs_table(rows, out_dir),
        "## How to read it",
        CAVEATS,
    ]
    return "\n\n".join(parts) + "\n"


def fit_section(base: dict[str, Any], cfg: CompareConfig, *, strategies: list[str]) -> str:
    """The estimator's answer for this model and for the sizes in compare.fit_models, on compare.fit_gpus."""
    from dist_train.estimate import KNOWN_STRATEGIES, ModelShape, PRESETS, fit_table, setup_from_config
    from dist_train.estimate.fit import FitModel

    shape = ModelShape.from_config(base["model"])
    models = [FitModel(shape.name, shape.num_params, shape)]
    models += [FitModel(PRESETS[m].name, PRESETS[m].num_params, PRESETS[m]) for m in cfg.fit_models if m in PRESETS]
    setup = setup_from_config(base, world_size=cfg.nproc, strategy="ddp", micro_batch_size=1)
    names = [s for s in dict.fromkeys(strategies) if s in KNOWN_STRATEGIES and s not in ("single", "dp")]
    try:
        cells = fit_table(models, base=setup, strategies=names, gpus=cfg.fit_gpus, gpu_gib=cfg.gpu_gib)
    except ValueError as exc:
        return f"(not estimated: {exc})"
    rows: dict[tuple[str, str], list[str]] = {}
    for c in cells:
        row = rows.setdefault((c.model, c.strategy), [""] * len(cfg.fit_gpus))
        row[cfg.fit_gpus.index(c.world_size)] = (
            "n/a" if c.peak_bytes is None else f"{human_bytes(c.peak_bytes)} {'yes' if c.fits else '**no**'}")
    table = md_table(["model", "strategy", *(f"{n} GPUs" for n in cfg.fit_gpus)],
                     [[m, s, *cells_] for (m, s), cells_ in rows.items()])
    return (f"Worst rank's predicted memory and whether it fits in {cfg.gpu_gib:g} GiB per GPU: model state "
            f"(precision {setup.precision}, {setup.optimizer}) + activations of one sequence at each model's "
            f"max_seq_len, no activation checkpointing; pipeline = one stage per GPU, M = K micro-batches. "
            f"More sizes and options: `python -m dist_train.estimate`.\n\n{table}")
