"""The training run: validate, start the runtime, build (session.py), train, report. It names no strategy."""

from __future__ import annotations

import dataclasses
import gc
import json
import logging
import os
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from dist_train.checks import validate
from dist_train.config import ConfigError, RunConfig, accumulation_steps, describe_batch, world_size_from_env
from dist_train.paths import PATH_KEYS
from dist_train.session import Session, build_session, checkpoint_root, hydra_run_dir, restarted

log = logging.getLogger("dist_train")


# Exit codes: 2 a config error (before anything starts); 3 training stopped on a NaN/Inf loss.
DIVERGED_EXIT = 3


def main(cfg: DictConfig, *, check_only: bool = False) -> int:
    """Entry for launch/train.py: a config error is one line on stderr and exit code 2, before any process group.

    check_only: stop after the checks (what launch/slurm.sbatch does on the batch node before any node starts).
    """
    from dist_train.entry import report_config_error
    from dist_train.slurm import adopt_srun_env
    from dist_train.telemetry.recorder import NonFiniteLoss

    from dist_train.quiet import quiet_deepspeed_on_cpu

    adopt_srun_env()  # `srun python launch/train.py` (no torchrun): rank and world from Slurm
    quiet_deepspeed_on_cpu()
    try:
        run = to_run_config(cfg)
        world_size = world_size_from_env()
        validate(run, world_size)
        check_device(run)
        # The derived global batch (train.global_batch_size=null) is what config.yaml, W&B and checkpoints record.
        cfg.train.global_batch_size = run.train.global_batch_size
        cfg.train.activation_checkpointing = run.train.activation_checkpointing  # none | full | selective, not true
        for f in dataclasses.fields(run.model):  # model=hf: what the directory's config.json said
            cfg.model[f.name] = getattr(run.model, f.name)
        for group, key in PATH_KEYS:  # absolute, as validate made them
            cfg[group][key] = getattr(getattr(run, group), key)
        fault = fault_from_env()
        resume = resume_point(run, world_size=world_size, run_dir=Path(hydra_run_dir()))
    except ConfigError as exc:
        _remove_if_empty(Path(hydra_run_dir()))
        message = str(exc)
        if "number of processes (1)" in message and "WORLD_SIZE" not in os.environ:  # `python launch/train.py`
            message += ("; started without a launcher, this is one process: torchrun --standalone "
                        "--nproc_per_node=N launch/train.py ...")
        return report_config_error(message)  # once per launch, whichever rank fails first
    alone = without_launcher(run, world_size)
    if alone and not check_only:
        print(alone, file=sys.stderr)
    if check_only:
        _remove_if_empty(Path(hydra_run_dir()))  # Hydra made the run directory; a check writes nothing in it
        print(f"config ok: strategy={run.strategy.name} WORLD_SIZE={world_size} {describe_batch(run, world_size)}",
              file=sys.stderr)
        return 0
    from dist_train.interrupt import Interrupted

    from dist_train.checkpoint.manager import UnreadableCheckpoint
    from dist_train.session import RunFinished

    try:
        train(run, cfg, resume=resume, fault=fault)
    except UnreadableCheckpoint as exc:  # each rank that read it; shown once
        return report_config_error(str(exc))
    except RunFinished as exc:  # build_session: every rank, on the resume point they agreed on; nothing written
        _warn_once(str(exc))
        _remove_if_empty(Path(hydra_run_dir()))  # a fresh run directory, for a checkpoint elsewhere
        return 0
    except NonFiniteLoss:
        return DIVERGED_EXIT  # rank 0 has said which step, and every rank stopped there
    except Interrupted as exc:
        return exc.exit_code  # 130 (SIGINT), 143 (SIGTERM): every rank stopped cleanly; rank 0 said how to resume
    return 0


def _remove_if_empty(run_dir: Path) -> None:
    """The run directory Hydra created for a launch that trains nothing, and the default parent (outputs/) if that
    is empty too (not a parent the user named: it may have been there, empty, before)."""
    for d in (run_dir, run_dir.parent if run_dir.parent.name == "outputs" else None):
        try:
            if d is not None:
                d.rmdir()  # only an empty directory
        except OSError:
            return


def without_launcher(run: RunConfig, world_size: int, env: Any = os.environ) -> str | None:
    """The warning for a distributed strategy started as one process without a launcher (`python
    launch/train.py strategy=fsdp`), which would otherwise train alone without a word; None when launched."""
    if world_size != 1 or "WORLD_SIZE" in env or not run.strategy.needs_process_group:
        return None
    return (f"warning: strategy={run.strategy.name} started without a launcher runs as 1 process: nothing is sharded, "
            "split or communicated. For N processes: torchrun --standalone --nproc_per_node=N launch/train.py ...")


def check_device(run: RunConfig) -> None:
    """The device choice's ConfigError (more local processes than GPUs, ...), before any group starts."""
    from dist_train.runtime import this_process_device

    this_process_device(run.runtime.device)


def fault_from_env() -> Any:
    from dist_train.faults import Fault

    try:
        return Fault.from_env()
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc


def resume_point(run: RunConfig, *, world_size: int, run_dir: Path) -> Path | None:
    """The checkpoint this run resumes from (checkpoint.resume), checked against the run; None: start fresh."""
    from dist_train.checkpoint.compat import check_resumable
    from dist_train.checkpoint.layout import complete_checkpoints, resolve_resume
    from dist_train.checkpoint.verify import problem

    root = checkpoint_root(run, run_dir)
    if run.checkpoint.resume == "none" and not restarted():  # a restart of this launch saves over its own
        earlier = complete_checkpoints(root)
        if earlier:  # a fresh start would save over them, and write its metrics and summary over the earlier run's
            names = ", ".join(p.name for _, p in earlier[:3]) + (", ..." if len(earlier) > 3 else "")
            raise ConfigError(f"checkpoint.resume=none: {root} holds {len(earlier)} checkpoint(s) of an earlier run "
                              f"({names}), which this run would write over; start afresh in a new directory "
                              "(hydra.run.dir=..., or checkpoint.dir=...), or resume from them "
                              "(checkpoint.resume=auto)")
    try:
        path = resolve_resume(run.checkpoint.resume, default_root=root, verify=problem, warn=_warn_once)
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
    if path is not None:
        check_resumable(path, run, world_size=world_size)
    return path


def _warn_once(message: str) -> None:
    """A warning before logging is set up, from one rank (every rank finds the same, from the same files)."""
    if os.environ.get("RANK", "0") == "0":
        print(f"warning: {message}", file=sys.stderr, flush=True)


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


def train(run: RunConfig, cfg: DictConfig, *, resume: Path | None = None, fault: Any = None) -> dict[str, Any] | None:
    """Train; return the summary on rank 0 (None elsewhere)."""
    from dist_train.checkpoint.manager import UnreadableCheckpoint
    from dist_train.interrupt import Interrupted
    from dist_train.runtime import init_runtime, shutdown
    from dist_train.session import RunFinished
    from dist_train.telemetry.recorder import NonFiniteLoss

    from dist_train.quiet import RepeatedWarnings

    runtime = init_runtime(needs_group=run.strategy.needs_process_group, timeout_s=run.runtime.timeout_s,
                           device_type=run.runtime.device)
    progress = Progress()
    repeated = None if run.logger.verbose else RepeatedWarnings().install()
    try:
        return _run(run, cfg, runtime, resume=resume, fault=fault, progress=progress)
    except Exception as exc:
        if isinstance(exc, Interrupted):  # a clean stop, reported by rank 0 with the command that resumes
            raise
        # NonFiniteLoss was reported by rank 0, once, with its step; UnreadableCheckpoint is main()'s one line
        if not isinstance(exc, (NonFiniteLoss, UnreadableCheckpoint, RunFinished)):
            where = f"at step {progress.step}" if progress.step else "before the first step"
            exc.add_note(f"[dist_train] rank {runtime.rank} failed {where}")
            log.error("rank %d failed %s: %s: %s", runtime.rank, where, type(exc).__name__, exc)
        # The traceback's frames hold the strategy, which holds the process group: release them (their line
        # numbers stay for the report) so the group is not destroyed under live users, which aborts at exit.
        traceback.clear_frames(exc.__traceback__)
        raise
    finally:
        if repeated is not None:
            repeated.report()
            repeated.uninstall()
        gc.collect()
        shutdown(runtime)


@dataclass
class Progress:
    step: int = 0  # the step being trained (1-based); 0 before the first


def _run(run: RunConfig, cfg: DictConfig, runtime: Any, *, resume: Path | None, fault: Any, progress: Progress) -> Any:
    """Build and train in a frame of its own: when it returns, the strategy is gone before the group is."""
    from dist_train.interrupt import StopRequest

    from dist_train.accumulation import resolve as resolve_accumulation

    run, accumulation = resolve_accumulation(run, cfg, world_size=runtime.world_size, device=runtime.device)
    session = build_session(run, cfg, runtime, resume=resume, fault=fault)
    if accumulation:  # said once the run's log is open
        log.info("%s", accumulation)
    session.progress = progress
    session.stop = StopRequest(group_needed=runtime.has_group, tracker=session.telemetry.tracker,
                               grace_s=run.runtime.stop_grace_s)
    try:
        return _fit(session)
    finally:
        session.stop.close()
        if session.telemetry.tracker is not None:
            session.telemetry.tracker.uninstall()
        if hasattr(session.batches, "close"):  # the prefetch thread
            session.batches.close()


def _fit(session: Session) -> dict[str, Any] | None:
    """Train, then report; a NaN/Inf stop (every rank at once, all alive) first completes the save in flight."""
    from dist_train.telemetry.recorder import NonFiniteLoss

    from dist_train.interrupt import Interrupted

    try:
        _loop(session)
    except NonFiniteLoss:
        session.checkpointer.finish()
        raise
    session.checkpointer.finish()
    summary = _report(session)
    stop = session.stop
    if stop is not None and stop.step is not None:
        if session.runtime.is_main:
            _say_how_to_resume(session, stop)
        raise Interrupted(stop.signal)
    return summary


def _say_how_to_resume(session: Session, stop: Any) -> None:
    """Rank 0, after a signal: where training stopped, the newest complete checkpoint, the command that resumes."""
    from dist_train.checkpoint.layout import resolve_resume
    from dist_train.checkpoint.verify import problem
    from dist_train.interrupt import resume_command

    t = session.run.train
    try:
        newest = resolve_resume("auto", default_root=checkpoint_root(session.run, session.run_dir), verify=problem)
    except ValueError:
        newest = None
    head = f"{stop.signal_name}: stopped after step {stop.step} of {t.steps}"
    if newest is None:
        log.warning("%s; no checkpoint to resume from (checkpoint.save_on_signal=false, checkpoint.every_steps=%d): a "
                    "new run starts from step 1", head, session.run.checkpoint.every_steps)
        return
    log.warning("%s; newest complete checkpoint: %s", head, newest)
    log.warning("resume with: %s", resume_command(session.run_dir))


def _loop(session: Session) -> None:
    """The loop: a step, its window's telemetry (which stops a NaN/Inf run), a checkpoint when one is due."""
    telemetry, t = session.telemetry, session.run.train
    if session.start_step >= t.steps:
        log.warning("the checkpoint is at step %d, train.steps=%d: nothing left to train", session.start_step, t.steps)
        return
    telemetry.start()
    for step in range(session.start_step + 1, t.steps + 1):
        train_one_step(session, step)
        if session.stop is not None and session.stop.after_step(step) and step < t.steps:
            _stop_after(session, step)
            return


def _stop_after(session: Session, step: int) -> None:
    """Every rank, after the step they agreed to stop at: close its window, and save it (unless this step was saved
    already, or checkpoint.save_on_signal=false), also where no periodic checkpoint is set: a stopped run can always
    resume."""
    session.telemetry.log(step)  # a no-op where this step closed a window
    checkpointer = session.checkpointer
    if session.run.checkpoint.save_on_signal and not checkpointer.due(step):
        session.telemetry.add_checkpoint_time(checkpointer.save(step, _trainer_state(session, step)))


def train_one_step(session: Session, step: int) -> None:
    """One iteration of the loop (1-based `step`): the step, its telemetry, a checkpoint when one is due."""
    telemetry, checkpointer, t = session.telemetry, session.checkpointer, session.run.train
    if session.progress is not None:
        session.progress.step = step
    if session.fault is not None:
        session.fault.inject(step=step, rank=session.runtime.rank, strategy=session.strategy)
    batch = session.batches.local_batch(step - 1)
    if session.neftune is not None:
        session.neftune.begin_step(step)
    with telemetry.measuring(step, live=step == telemetry.live_step):
        out = session.strategy.train_step(batch)
    telemetry.step_end(step, out)
    checkpointer.poll()
    save = checkpointer.due(step)
    # The warm-up closes a window of its own, so that the steady figures of summary.json leave it out exactly.
    warmed_up = step == session.start_step + warmup_steps(session)
    evaluate = eval_due(session, step)
    if save or step % t.log_every == 0 or step == t.steps or warmed_up or evaluate:
        if evaluate:  # before the window closes, so that its records carry eval/loss
            telemetry.evaluate(step, lambda: [session.strategy.eval_step(session.eval_batches.local_batch(i))
                                              for i in range(session.run.eval.batches)])
        telemetry.log(step)  # a checkpoint step is always a logged one: a NaN run is never saved
    if save:
        telemetry.add_checkpoint_time(checkpointer.save(step, _trainer_state(session, step)))


def eval_due(session: Session, step: int) -> bool:
    """Evaluate after every eval.every_steps optimizer steps and after the last (eval.every_steps=0: never)."""
    every = session.run.eval.every_steps
    return session.eval_batches is not None and every > 0 and (step % every == 0 or step == session.run.train.steps)


def warmup_steps(session: Session) -> int:
    """This process's first steps that summary.json's steady figures leave out (lazy initialisation, DDP's
    bucket rebuild, ZeRO-3's parameter trace, a pipeline's handshake): telemetry.warmup_steps, fewer when
    the run is shorter, never all of them. On the CPU with telemetry.peak_live, through the step whose live tensors
    torch's MemTracker follows (it runs several times slower): one more, and at least 2 on a fresh run, whose first
    step makes the optimizer's state (recorder.live_step). A run too short to leave a step after that one (a fresh
    run of 2 steps) times the followed step."""
    t = session.run.train
    live = getattr(session.telemetry, "live", None)
    wanted = session.run.telemetry.warmup_steps if live is None else session.telemetry.live_step - session.start_step
    return max(0, min(wanted, t.steps - session.start_step - 1))


def _trainer_state(session: Session, step: int) -> dict[str, Any]:
    """What a checkpoint needs besides the strategy's tensors (rank 0 writes it)."""
    t = session.run.train
    return {
        "step": step,
        "samples_seen": step * t.global_batch_size,
        "losses": session.telemetry.step_losses[:step],
        "eval_losses": [[s, v] for s, v in session.telemetry.eval_losses if s <= step],
        "skipped_steps": session.telemetry.skipped_steps,
        "wandb_run_id": session.wandb.run_id if session.wandb is not None else None,
        "strategy": session.run.strategy.name,
        "world_size": session.runtime.world_size,
        "config": OmegaConf.to_container(session.cfg, resolve=True),
    }


def _since_process_start(wall: float | None) -> float | None:
    """Seconds from this process's start (imports, Hydra, model, strategy set-up included) to `wall`."""
    import psutil

    return None if wall is None else wall - psutil.Process().create_time()


def _report(session: Session) -> dict[str, Any] | None:
    if not session.runtime.is_main:
        return None
    telemetry, run_dir = session.telemetry, session.run_dir
    summary = _summary(session)
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    telemetry.sink.finish(summary)
    held_out = (f" | eval loss {summary['final_eval_loss']:.6f} (perplexity {summary['final_eval_perplexity']:.2f})"
                if summary["final_eval_loss"] is not None else "")
    log.info("final loss %.6f (step %d's)%s | mean step %.3f s | summary: %s", summary["final_loss"],
             summary["steps_done"], held_out, summary["mean_step_s"], run_dir / "summary.json")
    return summary


def _summary(session: Session) -> dict[str, Any]:
    from dist_train.telemetry.moe import run_load
    from dist_train.telemetry.recorder import perplexity
    from dist_train.versions import installed_versions

    run, runtime, telemetry = session.run, session.runtime, session.telemetry
    t = run.train
    dp = run.strategy.data_parallel_size(runtime.world_size)
    accumulation = accumulation_steps(run, runtime.world_size)
    warmup = warmup_steps(session)
    mean_step_s = telemetry.mean_step_s(warmup)
    return {
        "strategy": run.strategy.name,
        "world_size": runtime.world_size,
        "nodes": len(set(runtime.nodes)),
        "data_parallel_size": dp,
        "model": run.model.name,
        "data": run.data.name,  # synthetic | textfile | tokens
        "data_path": run.data.path,
        "precision": run.precision.name,
        "num_params": session.num_params,
        "num_trainable_params": session.num_trainable_params,
        "steps": t.steps,
        "steps_done": session.stop.step if session.stop is not None and session.stop.step else t.steps,
        "interrupted": session.stop.signal_name if session.stop is not None and session.stop.step else None,
        "global_batch_size": t.global_batch_size,
        "micro_batch_size": t.global_batch_size // (dp * accumulation),
        "accumulation_steps": accumulation,
        "seq_len": t.seq_len,
        "final_loss": telemetry.step_losses[-1],
        "losses": telemetry.step_losses,
        # held-out loss: [step, loss] of every evaluation (eval.every_steps), and the last one with its perplexity
        "eval_losses": [[s, v] for s, v in telemetry.eval_losses],
        "final_eval_loss": telemetry.eval_losses[-1][1] if telemetry.eval_losses else None,
        "final_eval_perplexity": perplexity(telemetry.eval_losses[-1][1]) if telemetry.eval_losses else None,
        # Timing covers the steps this process ran (after a resume: from start_step + 1).
        "start_step": session.start_step,
        "resumed_from": str(session.resumed_from) if session.resumed_from else None,
        "mean_step_s": mean_step_s,
        "median_step_s": telemetry.median_step_s(warmup),
        "time_to_first_step_s": _since_process_start(telemetry.first_step_wall),
        "timing_warmup_steps": warmup,
        "tokens_per_s": t.global_batch_size * t.seq_len / mean_step_s if mean_step_s > 0 else 0.0,
        "mfu": telemetry.mfu(mean_step_s),
        "skipped_steps": telemetry.skipped_steps,
        "checkpoints_saved": session.checkpointer.saved_steps,
        "checkpoint_blocking_s": session.checkpointer.blocking_s,
        "backend": runtime.backend,
        "device": str(runtime.device),
        "device_name": session.device_name,
        "run_dir": str(session.run_dir),
        "ranks": telemetry.per_rank_summary(session.start_step + warmup),
        "moe_load": run_load(telemetry.history),  # an MoE model's tokens per expert over the run (telemetry/moe.py)
        "predicted_memory_bytes": predicted_memory(session),
        "versions": installed_versions(),  # torch, transformers, ... as installed: what produced these figures
    }


def predicted_memory(session: Session) -> dict[str, float] | None:
    """The estimator's worst-rank bytes per memory category for this very run (its config and world size), so
    that a dashboard puts them beside the measured peaks; None where the estimator does not model the run."""
    from dist_train.estimate import ModelShape, predict_memory, setup_from_config
    from dist_train.estimate.memory import category_bytes, predicted_categories

    config = OmegaConf.to_container(session.cfg, resolve=True)
    try:
        ranks = predict_memory(ModelShape.from_config(config["model"]),
                               setup_from_config(config, world_size=session.runtime.world_size))
    except (ValueError, KeyError) as exc:
        log.info("no predicted memory in the summary: %s", exc)
        return None
    out = {cat: max(category_bytes(r, cat) for r in ranks) for cat in predicted_categories(config["train"])}
    if all(r.peak_live is not None for r in ranks) and "activations" in out:  # modelled, and eager
        out["peak_live"] = max(r.peak_live for r in ranks)
    return out
