"""Build one training run: its directory and logs, the model, the strategy, the checkpointer, the data and the
telemetry with its sinks (continuing metrics.jsonl and the W&B run after a resume). Names no strategy."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from dist_train.config import RunConfig, describe_batch

log = logging.getLogger("dist_train")


@dataclass
class Session:
    """Everything one training run is made of, built once; the loop names no strategy."""

    run: RunConfig
    cfg: DictConfig
    runtime: Any
    run_dir: Path
    strategy: Any
    batches: Any
    telemetry: Any
    checkpointer: Any
    num_params: int
    num_trainable_params: int
    flops_per_token: float
    fault: Any = None
    neftune: Any = None  # NEFTune's hook (train.neftune_alpha > 0): told each step by the loop
    moe_load: Any = None  # an MoE model's router load (telemetry/moe.py RouterLoad), read by the telemetry
    wandb: Any = None  # rank 0's W&B sink, if any: its run id goes into checkpoints
    start_step: int = 0  # steps done before this process started (resumed from a checkpoint)
    resumed_from: Path | None = None
    progress: Any = None  # Progress: the step being trained, for failure messages
    eval_batches: Any = None  # the held-out batches (eval.every_steps > 0), sliced per data-parallel rank
    stop: Any = None  # interrupt.StopRequest: Ctrl-C and SIGTERM, agreed on by every rank
    device_name: str = "cpu"  # torch.cuda.get_device_name() on a GPU: which datasheet (MFU, the plan's profile)


def build_session(
    run: RunConfig, cfg: DictConfig, runtime: Any, *, resume: Path | None, fault: Any, run_dir: Path | None = None
) -> Session:
    """Every rank builds the same session (collectively: the run directory and the resume point are agreed).

    run_dir: None = Hydra's (what launch/train.py gives); a benchmark building sessions itself passes its own."""
    import torch

    from dist_train.checkpoint.manager import Checkpointer
    from dist_train.data import GlobalBatches, Prefetcher, build_datasets
    from dist_train.rundir import agree_on_run_dir
    from dist_train.runtime import agree
    from dist_train.telemetry.comm import CommTracker
    from dist_train.telemetry.memory import AnonPeak

    run_dir = Path(agree_on_run_dir(str(run_dir) if run_dir is not None else hydra_run_dir()))
    resume = agree(resume)  # rank 0's reading of the checkpoint directory decides for everyone
    done = finished(run, resume, run_dir)
    if done:  # decided by every rank alike (their own readings may differ: a shared filesystem's cache), unwritten
        raise RunFinished(done)
    # Set-up's peak of anonymous memory (memory/setup_peak_anon_bytes), sampled until the first step.
    setup_anon = AnonPeak().start()
    setup_logging(run_dir, runtime.rank)
    t = run.train
    log.info(
        "strategy=%s world_size=%d backend=%s device=%s run_dir=%s",
        run.strategy.name, runtime.world_size, runtime.backend or "none", runtime.device, run_dir,
    )
    if runtime.is_main:
        (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
    tracker = None
    if run.telemetry.comm:
        tracker = CommTracker(cuda_events=runtime.device.type == "cuda", nodes=runtime.nodes).install()
    strategy, num_params, num_trainable, fpt, (neftune, moe_load), setup_memory = _strategy(run, runtime, tracker)
    checkpointer = Checkpointer.build(
        run.checkpoint, root=checkpoint_root(run, run_dir), runtime=runtime, io=strategy.checkpoint_io(),
        total_steps=t.steps, tracker=tracker,
    )
    saved = checkpointer.load(resume) if resume is not None else {}
    if resume is not None:
        log.info("resumed from %s: step %d done, training steps %d..%d", resume, saved["step"], saved["step"] + 1, t.steps)
    dp = run.strategy.data_parallel_size(runtime.world_size)
    dp_rank = run.strategy.data_parallel_rank(runtime.rank, runtime.world_size)
    train_data, held_out = build_datasets(run.data, run.eval, vocab_size=run.model.vocab_size, seq_len=t.seq_len,
                                          seed=t.seed)
    batches: Any = GlobalBatches(train_data, global_batch_size=t.global_batch_size, dp_rank=dp_rank, dp_size=dp)
    eval_batches = None if held_out is None else GlobalBatches(
        held_out, global_batch_size=t.global_batch_size, dp_rank=dp_rank, dp_size=dp)
    if run.data.prefetch:
        batches = Prefetcher(batches, pin=runtime.device.type == "cuda", last_step=t.steps)
    session = Session(
        run=run, cfg=cfg, runtime=runtime, run_dir=run_dir, strategy=strategy, batches=batches, telemetry=None,
        checkpointer=checkpointer, num_params=num_params, num_trainable_params=num_trainable, flops_per_token=fpt,
        fault=fault, neftune=neftune, moe_load=moe_load, eval_batches=eval_batches,
        start_step=saved.get("step", 0), resumed_from=resume,
    )
    device_name = torch.cuda.get_device_name(runtime.device) if runtime.device.type == "cuda" else "cpu"
    session.device_name = device_name
    session.telemetry = _telemetry(session, tracker, saved=saved, device_name=device_name)
    session.telemetry.setup_memory = setup_memory
    session.telemetry.setup_anon = setup_anon
    d = run.data
    data = f"data={d.name}" + (f" data.path={d.path}" if d.path else " (generated from train.seed)")
    log.info("model=%s params=%s %s %s", run.model.name, f"{num_params:,}", data, describe_batch(run, runtime.world_size))
    return session


def _strategy(run: RunConfig, runtime: Any, tracker: Any) -> tuple[Any, int, int, float, Any, dict[str, int]]:
    """The model (built identically on every rank), transformed, then set up by the strategy; its size and
    FLOPs per token are read before any wrapping shards it. Last: set-up's memory milestones, resident bytes
    just before the model was built (`memory/setup_baseline_rss_bytes`, and its anonymous part
    `memory/setup_baseline_anon_bytes`: imports, process group, the strategy's own libraries) and the peak once this rank's weights were in (`memory/load_peak_rss_bytes`), before a strategy
    allocates its training state (DeepSpeed's engine does at set-up)."""
    from dist_train.model import autocast_grouped_mm, build_model, count_params, idle_expert_params, qlora_base
    from dist_train.optim import OptimizerFactory
    from dist_train.strategies.base import StrategyContext
    from dist_train.strategies.registry import build_strategy
    from dist_train.telemetry.flops import embedding_params, flops_per_token

    import torch

    from dist_train.config import PRECISIONS

    t = run.train
    sharded = loads_own_shard(run)
    memory: dict[str, int] = {}  # set-up's memory milestones (filled below, and by the materializer)
    ctx = StrategyContext(
        runtime=runtime, train=t, precision=run.precision, optimizer=OptimizerFactory(run.optimizer, t, device=runtime.device),
        ddp_comm_hook=tracker.ddp_comm_hook if tracker is not None else None,
        materialize=_materializer(run, runtime, memory) if sharded else None, model=run.model,
    )
    strategy = build_strategy(run.strategy, ctx)
    empty = strategy.empty_model_context() if sharded else None  # DeepSpeed's is made (and imported) here
    import transformers  # noqa: F401  (what every model build imports, counted in the baseline)

    from dist_train.telemetry.memory import HostPeak, anon_bytes

    host = HostPeak()
    memory["memory/setup_baseline_rss_bytes"] = host.current_bytes()
    baseline_anon = anon_bytes()  # the same moment, anonymous memory only (memory/setup_peak_anon_bytes' baseline)
    if baseline_anon is not None:
        memory["memory/setup_baseline_anon_bytes"] = baseline_anon
    compute_dtype = getattr(torch, PRECISIONS[run.precision.name][0])  # QLoRA's 4-bit layers compute in it
    quantize = qlora_base(run.peft, compute_dtype) if run.peft.name == "qlora" else None
    if run.model.num_experts and run.model.experts_implementation == "grouped_mm" and run.precision.name == "bf16":
        autocast_grouped_mm()  # grouped_mm multiplies in bf16 under autocast too, as under FSDP2's bf16 weights
    model = build_model(run.model, seed=t.seed, empty=empty, quantize=quantize)
    if not sharded:  # the weights are all in: what loading them cost
        memory["memory/load_peak_rss_bytes"] = host.peak_bytes()
    if run.model.path is not None:
        log.info("model.path=%s: %s weights, %s", run.model.path, run.model.init,
                 "each rank fills only what it holds" if sharded else "built whole on each rank")
    transform_model(run, model, compute_dtype=compute_dtype)
    num_params, num_trainable = count_params(model), count_params(model, trainable_only=True)
    active = num_params - idle_expert_params(model, run.model.experts_per_token)  # MoE: a token's top-k experts
    fpt = flops_per_token(
        num_params=active, num_embedding_params=embedding_params(model),
        num_layers=run.model.num_layers, hidden_size=run.model.hidden_size, seq_len=t.seq_len,
    )
    strategy.setup(model)
    if tracker is not None:  # collectives also counted per device-mesh dimension (tp, dp) where there is a mesh
        tracker.name_groups(getattr(strategy, "mesh_groups", dict)())
    neftune = attach_neftune(run, model)
    return strategy, num_params, num_trainable, fpt, (neftune, attach_router_load(run, model)), memory


def transform_model(run: RunConfig, model: Any, *, compute_dtype: Any) -> None:
    """The model transforms, in place, before any strategy wraps the model: LoRA's adapters, then activation
    checkpointing, then torch.compile of each block (which then compiles the checkpointing too). A strategy that
    applies its parallelisms through dist_train.parallel.apply takes checkpointing and compile into that fixed order
    instead (tensor parallelism first: `transforms_in_parallelize`). A training run and the dry run
    (estimate/dryrun/rank.py) build a rank through this and `attach_neftune`, so they cannot differ."""
    from dist_train.model import apply_activation_checkpointing, apply_lora, compile_blocks, count_params

    t = run.train
    if run.peft.name != "none":
        apply_lora(model, run.peft, seed=t.seed, compute_dtype=compute_dtype)
        log.info("peft=%s: %s trainable parameters of %s", run.peft.name,
                 f"{count_params(model, trainable_only=True):,}", f"{count_params(model):,}")
    if run.strategy.transforms_in_parallelize:
        return
    # none | full | selective, of every block or every checkpoint_every-th
    apply_activation_checkpointing(model, t.activation_checkpointing, every=t.checkpoint_every)
    if t.compile:
        compile_blocks(model)


def attach_neftune(run: RunConfig, model: Any) -> Any:
    """NEFTune's noise hook on the token embeddings, once the strategy has wrapped the model (it survives any
    wrapping; a pipeline's first stage keeps it); None without train.neftune_alpha."""
    from dist_train.model import apply_neftune

    t = run.train
    return apply_neftune(model, alpha=t.neftune_alpha, seed=t.seed) if t.neftune_alpha > 0 else None


def attach_router_load(run: RunConfig, model: Any) -> Any:
    """An MoE model's router-load meter (telemetry/moe.py) on the wrapped model, or None: a dense model,
    telemetry.moe_load=false, nn.DataParallel (its replica threads would count on other devices) or train.compile
    where the experts run inside the compiled blocks (the meter's hook, which runs eager, would break their graphs),
    the last two said in the log. Under expert parallelism the experts' dispatch runs eager already
    (parallel/experts.py), so the compiled graphs break there anyway and the meter stays."""
    from dist_train.architectures import expert_modules
    from dist_train.telemetry.moe import RouterLoad

    if not run.model.num_experts or not run.telemetry.moe_load:
        return None
    if run.strategy.name == "dp":
        log.info("no moe/* load metrics under strategy=dp")
        return None
    if run.train.compile and not all(getattr(m, "ep_group", None) is not None for m in expert_modules(model)):
        log.info("no moe/* load metrics under train.compile without expert parallelism (strategy.ep): the meter "
                 "would break each compiled block's graph where the experts run")
        return None
    return RouterLoad(model) or None


def loads_own_shard(run: RunConfig) -> bool:
    """Whether the model is built without weights and each rank fills only what it holds, from the files or the
    seeded random init: under a strategy that can (fsdp, fsdp_tp, tp, zero3, the pipelines, fsdp_ep, ep). LoRA's
    adapters are made on the built model: it is built whole. An MoE model's files, which hold each expert apart, are
    read stacked as the model holds them (weights.StackedExperts)."""
    return run.peft.name == "none" and run.strategy.loads_own_shard


def _materializer(run: RunConfig, runtime: Any, memory: dict[str, int]) -> Any:
    from dist_train.model import weight_source
    from dist_train.telemetry.memory import HostPeak
    from dist_train.weights import materialize

    source = weight_source(run.model, run.train.seed)

    def fill(wrapped: Any) -> None:
        materialize(wrapped, source, runtime.device)
        memory["memory/load_peak_rss_bytes"] = HostPeak().peak_bytes()  # this rank's part is in: what loading cost

    return fill


def _telemetry(session: Session, tracker: Any, *, saved: dict[str, Any], device_name: str) -> Any:
    """Per-rank telemetry; rank 0 also gets the sinks, continuing metrics.jsonl and W&B after a resume."""
    import torch

    from dist_train.telemetry.activations import ActivationMeter
    from dist_train.telemetry.flops import peak_flops
    from dist_train.telemetry.recorder import Telemetry, Workload
    from dist_train.telemetry.sinks import NullSink

    run, runtime, t = session.run, session.runtime, session.run.train
    peak = run.telemetry.peak_flops or peak_flops(
        device_name, run.precision.name, allow_tf32=torch.backends.cuda.matmul.allow_tf32
    )
    workload = Workload(
        tokens_per_step=t.global_batch_size * t.seq_len, samples_per_step=t.global_batch_size,
        flops_per_token=session.flops_per_token, peak_flops=peak, num_devices=runtime.world_size * len(session.strategy.devices),
    )
    sink: Any = NullSink()
    history: list[Any] = []
    if runtime.is_main:
        sink, history = _sinks(session, resume_id=saved.get("wandb_run_id"))
    live, live_from = _live_peak(session)
    telemetry = Telemetry(
        runtime=runtime, strategy=session.strategy, sink=sink, workload=workload, tracker=tracker,
        activations=ActivationMeter() if run.telemetry.activations else None, moe=session.moe_load,
        live=live, live_step=live_from,
        skips_allowed=run.precision.loss_scaling,
    )
    if saved:
        telemetry.restore(losses=saved.get("losses", []), history=history, skipped_steps=saved.get("skipped_steps", 0),
                          eval_losses=saved.get("eval_losses", []))
    return telemetry


def _live_peak(session: Session) -> tuple[Any, int | None]:
    """The peak of all live tensors (memory/peak_live_bytes): the meter that follows one step on the CPU (torch's
    MemTracker: an extra warm-up step, as it runs several times slower; None on CUDA, whose allocator keeps the
    peak, or with telemetry.peak_live=false), and the first step whose peak is reported, one that holds the
    optimizer's state (recorder.live_step). A run that ends before such a step says so, and reports none."""
    from dist_train.telemetry.memory import LiveMeter
    from dist_train.telemetry.recorder import live_step

    run, t, devices = session.run, session.run.train, session.strategy.devices
    tracked = run.telemetry.peak_live and all(d.type == "cpu" for d in devices)
    first = live_step(start_step=session.start_step, last_step=t.steps,
                      warmup_steps=run.telemetry.warmup_steps + 1 if tracked else 0)
    if first is None and (tracked or any(d.type == "cuda" for d in devices)) and session.start_step < t.steps:
        log.info("no memory/peak_live_bytes: train.steps=%d ends before a step that holds the optimizer's state "
                 "(it is made at the first step); 2 steps or more report it", t.steps)
    return (LiveMeter() if tracked and first is not None else None), first


def _sinks(session: Session, *, resume_id: str | None) -> tuple[Any, list[Any]]:
    """Rank 0's sinks, and the metrics.jsonl windows kept from before a resume (the telemetry's history)."""
    from dist_train.telemetry.sinks import ConsoleProgress, FanOut, JsonlSink

    run, cfg, runtime = session.run, session.cfg, session.runtime
    jsonl = JsonlSink(session.run_dir / "metrics.jsonl", keep_through_step=session.start_step)
    sinks: list[Any] = [
        jsonl,
        ConsoleProgress(total_steps=run.train.steps, description=f"{run.strategy.name} x{runtime.world_size}",
                        done=session.start_step),
    ]
    if run.logger.name == "wandb":
        from dist_train.telemetry.wandb_sink import WandbSink

        session.wandb = WandbSink(
            run.logger, run_dir=session.run_dir, name=f"{run.strategy.name}-ws{runtime.world_size}",
            group=run.logger.group or experiment_group(cfg),
            config=OmegaConf.to_container(cfg, resolve=True),  # type: ignore[arg-type]
            resume_id=resume_id,
        )
        sinks.append(session.wandb)
    return FanOut(*sinks), jsonl.kept


def checkpoint_root(run: RunConfig, run_dir: Path) -> Path:
    return Path(run.checkpoint.dir).expanduser().resolve() if run.checkpoint.dir else run_dir / "checkpoints"


def experiment_group(cfg: DictConfig) -> str:
    """Runs that differ only in strategy (and logging) share a W&B group: `exp-<hash of the rest>`."""
    return "exp-" + config_hash(OmegaConf.to_container(cfg, resolve=True))  # type: ignore[arg-type]


def config_hash(config: dict[str, Any]) -> str:
    """A hash of what decides the training, leaving out how it is run and watched (strategy, logging, telemetry,
    checkpointing, timeouts): two runs with the same hash train the same model on the same data."""
    ignored = ("strategy", "logger", "telemetry", "checkpoint", "runtime")
    rest = {k: v for k, v in config.items() if k not in ignored}
    if isinstance(rest.get("data"), dict):  # prefetching changes when a batch is built, not which
        rest["data"] = {k: v for k, v in rest["data"].items() if k != "prefetch"}
    return hashlib.sha1(json.dumps(rest, sort_keys=True).encode()).hexdigest()[:8]


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


class RunFinished(Exception):
    """build_session's finding that the agreed resume point is at train.steps or past it: launch/train.py's main ends
    with the `finished` line and exit 0, nothing written."""


def finished(run: RunConfig, resume: Path | None, run_dir: Path | None = None) -> str | None:
    """The line for a resume whose checkpoint is at train.steps or past it (the run is done), or None. Such a launch
    trains nothing and writes nothing: the earlier run's summary.json and metrics stay as they were. When `run_dir`
    has no summary.json (the run stopped after its last checkpoint, before writing it), the line says so: a report
    counts that run as unfinished, and only training again writes one."""
    from dist_train.checkpoint.layout import read_marker

    if resume is None:
        return None
    step = int(read_marker(resume).get("step", 0))
    if step < run.train.steps:
        return None
    line = f"{resume} is at step {step} and train.steps={run.train.steps}: nothing left to train, and the run's " \
           "files are left as they were"
    ours = run_dir is not None and resume.resolve().is_relative_to(run_dir.resolve())  # not another run's checkpoint
    if ours and not (run_dir / "summary.json").is_file():
        return (f"{line}; {run_dir} has no summary.json (the run stopped after its last checkpoint, before writing "
                "it): its steps' figures are in metrics.jsonl; for a summary, resume from an earlier checkpoint in a "
                "new directory (checkpoint.resume=PATH hydra.run.dir=NEW), or train again there")
    return f"{line} (raise train.steps to train on)"


def restarted(env: Any = os.environ) -> bool:
    """This process is a restart of its launch (torchrun's --max-restarts, Slurm's requeue): the same run directory,
    whose checkpoints this launch saved itself."""
    return any(env.get(key, "0") not in ("", "0") for key in ("TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT"))
