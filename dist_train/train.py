"""The training run: validate, start the runtime, build, train, report. It names no strategy."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from dist_train.config import ConfigError, RunConfig, accumulation_steps, validate, world_size_from_env

log = logging.getLogger("dist_train")


def main(cfg: DictConfig) -> int:
    """Entry for launch/train.py: a config error is one line on stderr and exit code 2, before any process group."""
    from dist_train.entry import report_config_error

    try:
        run = to_run_config(cfg)
        validate(run, world_size_from_env())
    except ConfigError as exc:
        return report_config_error(str(exc))  # once per launch, whichever rank fails first
    train(run, cfg)
    return 0


def to_run_config(cfg: DictConfig) -> RunConfig:
    from omegaconf.errors import OmegaConfBaseException

    from dist_train.entry import one_line

    try:
        run = OmegaConf.to_object(cfg)
    except OmegaConfBaseException as exc:  # e.g. a required value left unset (???)
        raise ConfigError(one_line(exc)) from exc
    if not isinstance(run, RunConfig):
        raise ConfigError("the config is not a dist_train RunConfig (was conf/config.yaml replaced?)")
    return run


def experiment_group(cfg: DictConfig) -> str:
    """Runs that differ only in strategy (and logging) share a W&B group: `exp-<hash of the rest>`."""
    rest = {k: v for k, v in OmegaConf.to_container(cfg, resolve=True).items() if k not in ("strategy", "logger", "telemetry")}
    return "exp-" + hashlib.sha1(json.dumps(rest, sort_keys=True).encode()).hexdigest()[:8]


def hydra_run_dir() -> str:
    from hydra.core.hydra_config import HydraConfig

    return HydraConfig.get().runtime.output_dir if HydraConfig.initialized() else os.path.abspath("outputs/run")


def setup_logging(run_dir: Path, rank: int) -> None:
    """Each rank its own file; rank 0 also to the console, the others only warnings."""
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    fmt = logging.Formatter(f"%(asctime)s [rank{rank}] %(levelname)s %(name)s: %(message)s")
    file_handler = logging.FileHandler(run_dir / "logs" / f"rank{rank}.log")
    file_handler.setFormatter(fmt)
    console = logging.StreamHandler(sys.stderr)
    console.setFormatter(logging.Formatter(f"[rank{rank}] %(message)s"))
    console.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    root = logging.getLogger()
    root.setLevel(logging.INFO)
    for handler in (file_handler, console):
        root.addHandler(handler)


def train(run: RunConfig, cfg: DictConfig) -> dict[str, Any] | None:
    """Train; return the summary on rank 0 (None elsewhere)."""
    from dist_train.runtime import init_runtime, shutdown

    runtime = init_runtime(needs_group=run.strategy.needs_process_group)
    try:
        return _train(run, cfg, runtime)
    finally:
        shutdown(runtime)


def _train(run: RunConfig, cfg: DictConfig, runtime: Any) -> dict[str, Any] | None:
    import torch

    from dist_train.data import GlobalBatches, build_dataset
    from dist_train.model import apply_activation_checkpointing, build_model, count_params
    from dist_train.optim import OptimizerFactory
    from dist_train.rundir import agree_on_run_dir
    from dist_train.strategies import StrategyContext, build_strategy
    from dist_train.telemetry.activations import ActivationMeter
    from dist_train.telemetry.comm import CommTracker
    from dist_train.telemetry.flops import embedding_params, flops_per_token, peak_flops
    from dist_train.telemetry.recorder import Telemetry, Workload
    from dist_train.telemetry.sinks import NullSink

    run_dir = Path(agree_on_run_dir(hydra_run_dir()))
    setup_logging(run_dir, runtime.rank)
    t, s = run.train, run.strategy
    dp = s.data_parallel_size(runtime.world_size)
    log.info(
        "strategy=%s world_size=%d backend=%s device=%s run_dir=%s",
        s.name, runtime.world_size, runtime.backend or "none", runtime.device, run_dir,
    )
    if runtime.is_main:
        (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))

    model = build_model(run.model, seed=t.seed)
    if t.activation_checkpointing:
        apply_activation_checkpointing(model)  # a model transform: before any strategy wraps the model
    num_params = count_params(model)
    fpt = flops_per_token(
        num_params=num_params, num_embedding_params=embedding_params(model),
        num_layers=run.model.num_layers, hidden_size=run.model.hidden_size, seq_len=t.seq_len,
    )
    tracker = CommTracker(cuda_events=runtime.device.type == "cuda").install() if run.telemetry.comm else None
    try:
        ctx = StrategyContext(
            runtime=runtime, train=t, precision=run.precision,
            optimizer=OptimizerFactory(run.optimizer, t),
            ddp_comm_hook=tracker.ddp_comm_hook if tracker is not None else None,
        )
        strategy = build_strategy(s, ctx)
        strategy.setup(model)
        batches = GlobalBatches(
            build_dataset(run.data, vocab_size=run.model.vocab_size, seq_len=t.seq_len, seed=t.seed),
            global_batch_size=t.global_batch_size, dp_rank=runtime.rank % dp, dp_size=dp,
        )
        device_name = torch.cuda.get_device_name(runtime.device) if runtime.device.type == "cuda" else "cpu"
        peak = run.telemetry.peak_flops or peak_flops(
            device_name, run.precision.name, allow_tf32=torch.backends.cuda.matmul.allow_tf32
        )
        workload = Workload(
            tokens_per_step=t.global_batch_size * t.seq_len, samples_per_step=t.global_batch_size,
            flops_per_token=fpt, peak_flops=peak,
            num_devices=runtime.world_size * len(strategy.devices),
        )
        telemetry = Telemetry(
            runtime=runtime, strategy=strategy, sink=_sinks(run, cfg, runtime, run_dir) if runtime.is_main else NullSink(), workload=workload, tracker=tracker,
            activations=ActivationMeter() if run.telemetry.activations else None,
        )
        log.info(
            "model=%s params=%s global_batch=%d micro_batch=%d accumulation=%d data_parallel=%d",
            run.model.name, f"{num_params:,}", t.global_batch_size, t.micro_batch_size,
            accumulation_steps(run, runtime.world_size), dp,
        )
        telemetry.start()
        for step in range(t.steps):
            batch = batches.local_batch(step)
            with telemetry.measuring():
                out = strategy.train_step(batch)
            telemetry.step_end(step + 1, out)
            if (step + 1) % t.log_every == 0 or step + 1 == t.steps:
                telemetry.log(step + 1)
    finally:
        if tracker is not None:
            tracker.uninstall()

    if not runtime.is_main:
        return None
    summary = _summary(run, runtime, telemetry, num_params=num_params, dp=dp, run_dir=run_dir)
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    telemetry.sink.finish(summary)
    log.info("final loss %.6f | mean step %.3f s | summary: %s", summary["final_loss"], summary["mean_step_s"], run_dir / "summary.json")
    return summary


def _sinks(run: RunConfig, cfg: DictConfig, runtime: Any, run_dir: Path) -> Any:
    from dist_train.telemetry.sinks import ConsoleProgress, FanOut, JsonlSink

    sinks: list[Any] = [
        JsonlSink(run_dir / "metrics.jsonl"),
        ConsoleProgress(total_steps=run.train.steps, description=f"{run.strategy.name} x{runtime.world_size}"),
    ]
    if run.logger.name == "wandb":
        from dist_train.telemetry.wandb_sink import WandbSink

        sinks.append(
            WandbSink(
                run.logger, run_dir=run_dir, name=f"{run.strategy.name}-ws{runtime.world_size}",
                group=run.logger.group or experiment_group(cfg),
                config=OmegaConf.to_container(cfg, resolve=True),  # type: ignore[arg-type]
            )
        )
    return FanOut(*sinks)


def _summary(run: RunConfig, runtime: Any, telemetry: Any, *, num_params: int, dp: int, run_dir: Path) -> dict[str, Any]:
    t = run.train
    mean_step_s = telemetry.mean_step_s(run.telemetry.warmup_steps)
    return {
        "strategy": run.strategy.name,
        "world_size": runtime.world_size,
        "data_parallel_size": dp,
        "model": run.model.name,
        "precision": run.precision.name,
        "num_params": num_params,
        "steps": t.steps,
        "global_batch_size": t.global_batch_size,
        "micro_batch_size": t.global_batch_size // (dp * accumulation_steps(run, runtime.world_size)),
        "accumulation_steps": accumulation_steps(run, runtime.world_size),
        "seq_len": t.seq_len,
        "final_loss": telemetry.step_losses[-1],
        "losses": telemetry.step_losses,
        "mean_step_s": mean_step_s,
        "timing_warmup_steps": min(run.telemetry.warmup_steps, t.steps - 1),
        "tokens_per_s": t.global_batch_size * t.seq_len / mean_step_s if mean_step_s > 0 else 0.0,
        "backend": runtime.backend,
        "device": str(runtime.device),
        "run_dir": str(run_dir),
        "ranks": telemetry.per_rank_summary(run.telemetry.warmup_steps),
    }
