"""dist_train against what its users would run instead: the same training under Accelerate, Lightning Fabric and
Hugging Face's Trainer, side by side.

    pip install -e ".[bench]"          # the peers: lightning (Fabric); transformers and accelerate are ours already
    python bench/peers.py              # writes the 'peers' section of docs/BENCHMARKS.md

Every run trains the same thing: the training config's model built by dist_train from the same seed (so the same
weights), dist_train's deterministic global batches (rank r of N takes the r-th contiguous slice, split into
micro-batches), AdamW and the LR schedule from the same config, the mean next-token cross-entropy, gradient
clipping at train.grad_clip, fp32, N processes under torchrun. What differs is what each tool does itself: the
wrapping (DDP, FSDP), gradient sync during accumulation, backward, clipping and the loop. The peers:
- dist_train itself, `launch/train.py strategy=ddp|fsdp` (telemetry on, as users run it), and again with its
  collective, activation and live-tensor telemetry off (`dist_train_bare`);
- a plain Accelerate loop (`accelerator.prepare`, `no_sync`, `accelerator.backward`, `clip_grad_norm_`): DDP, and
  FSDP2 (`FullyShardedDataParallelPlugin(fsdp_version=2)`, one unit per block) where it runs: on a CPU Accelerate
  prepares DDP whatever the plugin says, and the row says so;
- Lightning Fabric (`fabric.setup`, `no_backward_sync`, `fabric.backward`, `clip_gradients`): its `ddp` and
  `fsdp` strategies (Fabric refuses FSDP without a GPU, and the row says so);
- transformers' `Trainer` (DDP), fed the same micro-batches in the order its data loader shards them;
- torchtitan: not run; see its row.

The runs alternate (every peer once, then again, `--repeats` times). Reported, per peer and strategy:
- its steady step (the mean after the warm-up steps), as the median of the repeats with their spread, and
  dist_train's median over the peer's (above 1: dist_train is the slower);
- for Accelerate and Fabric, the same ratio from paired steps: bench/interleaved.py times dist_train's step and
  the peer's alternately in the same processes (`--paired-iterations` pairs a run, once per repeat), which cancels
  the drift of a shared machine that separate runs suffer (their medians move by ±10% here);
- time to first step, from process start;
- whether its losses match dist_train's step by step (fp32, relative 1e-5);
- the worst rank's peak host RSS since exec (VmHWM, read the same way for every peer), and the memory figures the
  peer reports itself (on a CPU only Trainer reports any).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import PYTHON, ROOT, end_process, env, md_table, write_section  # noqa: E402

def training(steps: int) -> list[str]:
    return ["model=tiny", "train.seq_len=128", "train.global_batch_size=8", "train.micro_batch_size=2",
            f"train.steps={steps}", "train.log_every=5", "precision=fp32", "logger=none"]

WARMUP = 3  # steps left out of the steady step, as dist_train's summary does
PEERS = ("dist_train", "dist_train_bare", "accelerate", "fabric", "trainer")
# the peers whose step bench/interleaved.py also times beside dist_train's in the same processes (DDP: on a CPU
# no peer runs FSDP)
PAIRED = ("accelerate", "fabric")
# dist_train_bare: dist_train with its collective, activation and live-tensor telemetry off, to tell what the
# telemetry costs from what the framework does
BARE = ["telemetry.comm=false", "telemetry.activations=false", "telemetry.peak_live=false"]
TORCHTITAN = ("torchtitan 0.3.0 is not run: it installs beside torch 2.13.0 (with triton, which it imports without "
              "declaring it), but its trainer needs a GPU (on this CPU machine `torchtitan.train --module llama3 "
              "--config llama3_debugmodel` stops at torch.cuda.set_device), and it trains its own model definitions, "
              "not a transformers model, so its losses could not be ours")

READING = ("How to read it: the ratios are dist_train's figure over the peer's (above 1, dist_train is the slower). "
           "Separate runs of the same step move by about ±10% on a shared 2-core machine (compare dist_train with "
           "and without its telemetry), so a few percent are judged by the paired column, where the two steps "
           "alternate in the same processes. No peer runs FSDP on a CPU (the rows say why; Trainer's FSDP is Accelerate's "
           "plugin, which prepares DDP on a CPU, so it has no row); on a GPU they run. "
           "Peak host RSS is mostly each stack's imports.")


# ------------------------------------------------------------------ the workers (one per process, under torchrun)
class Setup:
    """The training config's pieces, built as dist_train builds them, for a peer to train."""

    def __init__(self, overrides: list[str]) -> None:
        import torch
        import torch.distributed as dist

        from dist_train.checks import validate
        from dist_train.data import GlobalBatches, build_dataset
        from dist_train.estimate.compose import compose_run
        from dist_train.model import build_model
        from dist_train.optim import OptimizerFactory

        self.rank, self.world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        self.run = compose_run(overrides)
        validate(self.run, self.world)
        t = self.run.train
        self.steps, self.micro = t.steps, t.micro_batch_size
        local = int(os.environ.get("LOCAL_RANK", 0))
        self.device = torch.device(f"cuda:{local}" if torch.cuda.is_available() else "cpu")
        self.model = build_model(self.run.model, seed=t.seed)
        dataset = build_dataset(self.run.data, vocab_size=self.run.model.vocab_size, seq_len=t.seq_len, seed=t.seed)
        self.batches = GlobalBatches(dataset, global_batch_size=t.global_batch_size, dp_rank=self.rank,
                                     dp_size=self.world)
        self.factory = OptimizerFactory(self.run.optimizer, t, device=self.device)
        self.grad_clip = t.grad_clip
        self.dist = dist

    def micro_batches(self, step: int) -> list[Any]:
        return self.batches.local_batch(step).to(self.device).split(self.micro)


def loss_of(model: Any, mb: Any) -> Any:
    from dist_train.model import forward_loss

    return forward_loss(model, mb.input_ids, mb.labels)


def report(setup: Setup, losses: list[Any], ends: list[float], first_wall: float, memory: dict[str, Any]) -> None:
    """Rank 0 prints one JSON line: the global mean loss of each step (one all-reduce, after the timed steps),
    the steady step, the time to first step from process start, the worst rank's peak host RSS and the peer's
    own memory figures."""
    import psutil
    import torch

    local = torch.stack([torch.as_tensor(x, dtype=torch.float64) for x in losses])
    setup.dist.all_reduce(local)
    steady = (ends[-1] - ends[WARMUP - 1]) / (len(ends) - WARMUP)
    if setup.rank == 0:
        print(json.dumps({"losses": (local / setup.world).tolist(), "mean_step_s": steady,
                          "time_to_first_step_s": first_wall - psutil.Process(os.getpid()).create_time(),
                          "peak_rss_bytes": worst_peak_rss(setup), "memory": memory}), flush=True)
    else:
        worst_peak_rss(setup)


def worst_peak_rss(setup: Setup) -> int:
    """The highest peak resident set size of the ranks since exec (VmHWM, read as dist_train's HostPeak reads it,
    never reset here). Every rank calls it: one all-reduce."""
    import torch

    from dist_train.telemetry.memory import HostPeak

    peak = torch.tensor([HostPeak().peak_bytes()], dtype=torch.int64)
    setup.dist.all_reduce(peak, op=setup.dist.ReduceOp.MAX)
    return int(peak.item())


def timed_loop(setup: Setup, step: Callable[[int], Any]) -> tuple[list[Any], list[float], float]:
    losses, ends, first_wall = [], [], 0.0
    for s in range(setup.steps):
        losses.append(step(s))
        ends.append(time.perf_counter())
        if s == 0:
            first_wall = time.time()
    return losses, ends, first_wall


def accumulating_step(setup: Setup, model: Any, opt: Any, sched: Any, *, backward: Callable[[Any], None],
                      no_sync: Callable[[bool], Any], clip: Callable[[], Any] | None) -> Callable[[int], Any]:
    """One optimizer step as a hand-written loop on a peer's API: every micro-batch but the last under the peer's
    `no_sync(last)`, its `backward` of loss / micro-batches, its `clip`, then the optimizer and the schedule.
    Returns the step's mean loss, on the device."""
    def step(s: int) -> Any:
        micro = setup.micro_batches(s)
        total = 0.0
        for i, mb in enumerate(micro):
            with no_sync(i == len(micro) - 1):
                loss = loss_of(model, mb)
                backward(loss / len(micro))
            total = total + loss.detach()
        if clip is not None:
            clip()
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        return total / len(micro)

    return step


def accelerate_step(setup: Setup, strategy: str) -> Callable[[int], Any]:
    """A plain Accelerate loop's optimizer step (`accelerator.prepare`, `no_sync`, `backward`, `clip_grad_norm_`)."""
    from accelerate import Accelerator

    kwargs: dict[str, Any] = {"cpu": setup.device.type == "cpu"}
    if strategy == "fsdp":
        from accelerate import FullyShardedDataParallelPlugin

        # One FSDP unit per transformer block, then the root, as dist_train's fsdp shards (Accelerate's default
        # wraps the root only: one gather for the whole model, less work than ours)
        blocks = list(getattr(setup.model, "_no_split_modules", None) or [])
        kwargs["fsdp_plugin"] = FullyShardedDataParallelPlugin(
            fsdp_version=2, reshard_after_forward=True, auto_wrap_policy="transformer_based_wrap",
            transformer_cls_names_to_wrap=blocks)
    accelerator = Accelerator(**kwargs)
    if strategy == "fsdp" and accelerator.distributed_type.name != "FSDP":
        # Measured: on a CPU Accelerate prepares DistributedDataParallel whatever the FSDP plugin says
        raise ValueError(f"Accelerate's FSDP plugin is not used here: it prepares {accelerator.distributed_type.name} "
                         "(DDP) on a CPU")
    model = accelerator.prepare(setup.model)
    opt = accelerator.prepare(setup.factory.build(model.parameters()))
    sched = setup.factory.scheduler(opt.optimizer)  # unprepared: Accelerate would step it once per process

    clip = (lambda: accelerator.clip_grad_norm_(model.parameters(), setup.grad_clip)) if setup.grad_clip else None
    return accumulating_step(setup, model, opt, sched, backward=accelerator.backward, clip=clip,
                             no_sync=lambda last: contextlib.nullcontext() if last else accelerator.no_sync(model))


def fabric_step(setup: Setup, strategy: str) -> Callable[[int], Any]:
    """Lightning Fabric's optimizer step (`setup_module`, `no_backward_sync`, `backward`, `clip_gradients`)."""
    from lightning.fabric import Fabric

    fabric = Fabric(accelerator=setup.device.type, strategy=strategy, devices=setup.world, num_nodes=1,
                    precision="32-true")
    fabric.launch()  # under torchrun: joins the process group that is there, or starts it
    model = fabric.setup_module(setup.model)
    opt = fabric.setup_optimizers(setup.factory.build(model.parameters()))
    sched = setup.factory.scheduler(opt.optimizer if hasattr(opt, "optimizer") else opt)

    clip = (lambda: fabric.clip_gradients(model, opt, max_norm=setup.grad_clip)) if setup.grad_clip else None
    return accumulating_step(setup, model, opt, sched, backward=fabric.backward, clip=clip,
                             no_sync=lambda last: fabric.no_backward_sync(model, enabled=not last))


def loop_worker(make_step: Callable[[Setup, str], Callable[[int], Any]]) -> Callable[[Setup, str], None]:
    """A worker that trains `setup.steps` steps of the peer's step and reports them."""
    def run(setup: Setup, strategy: str) -> None:
        losses, ends, first = timed_loop(setup, make_step(setup, strategy))
        report(setup, losses, ends, first, {})

    return run


def trainer_worker(setup: Setup, strategy: str) -> None:
    """transformers' Trainer, DDP: its loop, accumulation, clipping and optimizer stepping, fed dist_train's
    micro-batches as one flat dataset in the order Accelerate's data-loader sharding hands them out (batch k of
    the loader goes to rank k mod N), and with dist_train's loss (labels are already shifted here)."""
    import torch
    from torch.utils.data import Dataset
    from transformers import Trainer, TrainerCallback, TrainingArguments

    world, micro = setup.world, setup.micro
    samples: list[dict[str, Any]] = []
    for s in range(setup.steps):
        per_rank = [GlobalBatchesSlice(setup, s, r) for r in range(world)]
        for i in range(len(per_rank[0])):
            for r in range(world):
                mb = per_rank[r][i]
                samples += [{"input_ids": mb.input_ids[j], "labels": mb.labels[j]} for j in range(len(mb))]

    class Samples(Dataset):
        def __len__(self) -> int:
            return len(samples)

        def __getitem__(self, i: int) -> dict[str, Any]:
            return samples[i]

    class OurLoss(Trainer):
        """dist_train's loss (labels already shifted), a mean over the micro-batch's tokens: not scaled for
        accumulation, so Trainer divides it by its accumulation steps, as dist_train does. (GPT-2 takes loss
        kwargs, and Trainer would otherwise take this loss as normalised over the whole step's tokens already.)"""

        loss_is_scaled_for_ga = False

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):  # noqa: ANN001, ANN201
            return loss_of(model, type("MB", (), inputs)())

        def _get_train_sampler(self, *args: Any, **kwargs: Any) -> Any:
            return torch.utils.data.SequentialSampler(self.train_dataset)

    ends: list[float] = []
    first = [0.0]

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):  # noqa: ANN001, ANN201
            ends.append(time.perf_counter())
            if state.global_step == 1:
                first[0] = time.time()

    losses: list[float] = []

    class Losses(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):  # noqa: ANN001, ANN201
            if logs and "loss" in logs:
                losses.append(logs["loss"])

    opt = setup.factory.build(setup.model.parameters())
    accumulation = setup.run.train.global_batch_size // (micro * world)
    args = TrainingArguments(
        output_dir=os.environ.get("PEER_OUT", "/tmp/peers-trainer"), per_device_train_batch_size=micro,
        gradient_accumulation_steps=accumulation, max_steps=setup.steps, learning_rate=setup.run.train.lr,
        max_grad_norm=setup.grad_clip, logging_steps=1, save_strategy="no", report_to=[], use_cpu=setup.device.type == "cpu",
        dataloader_drop_last=False, seed=setup.run.train.seed, disable_tqdm=True, remove_unused_columns=False,
        average_tokens_across_devices=False, ddp_backend="gloo" if setup.device.type == "cpu" else "nccl", skip_memory_metrics=False,
    )
    trainer = OurLoss(model=setup.model, args=args, train_dataset=Samples(),
                      optimizers=(opt, setup.factory.scheduler(opt)), callbacks=[Clock(), Losses()])
    metrics = trainer.train().metrics
    # Trainer logs each step's loss averaged over the processes and over its micro-batches already.
    memory = {k: v for k, v in metrics.items() if k.startswith("train_mem_cpu")}
    peak = worst_peak_rss(setup)
    if setup.rank == 0:
        import psutil

        steady = (ends[-1] - ends[WARMUP - 1]) / (len(ends) - WARMUP)
        print(json.dumps({"losses": losses[:setup.steps], "mean_step_s": steady,
                          "time_to_first_step_s": first[0] - psutil.Process(os.getpid()).create_time(),
                          "peak_rss_bytes": peak, "memory": memory}), flush=True)


def GlobalBatchesSlice(setup: Setup, step: int, rank: int) -> list[Any]:  # noqa: N802
    """Rank `rank`'s micro-batches of global batch `step`, as dist_train slices them."""
    from dist_train.data import GlobalBatches

    b = GlobalBatches(setup.batches.dataset, global_batch_size=setup.batches.global_batch_size, dp_rank=rank,
                      dp_size=setup.world)
    return b.local_batch(step).split(setup.micro)


WORKERS = {"accelerate": loop_worker(accelerate_step), "fabric": loop_worker(fabric_step), "trainer": trainer_worker}


def worker(peer: str, strategy: str, overrides: list[str]) -> None:
    import torch.distributed as dist

    setup = Setup(overrides)  # each peer starts the process group itself
    WORKERS[peer](setup, strategy)
    if dist.is_initialized():
        dist.destroy_process_group()


# ------------------------------------------------------------------ the orchestrator
def launch(peer: str, strategy: str, *, nproc: int, steps: int, out: Path) -> dict[str, Any]:
    """One run of a peer; its JSON line (dist_train: read from summary.json)."""
    torchrun = [PYTHON, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    if peer.startswith("dist_train"):
        run_dir = out / f"{peer}-{strategy}-{time.monotonic_ns()}"
        cmd = [*torchrun, "launch/train.py", *training(steps), f"strategy={strategy}", f"hydra.run.dir={run_dir}",
               *(BARE if peer == "dist_train_bare" else [])]
    else:
        cmd = [*torchrun, "bench/peers.py", "--worker", peer, "--strategy", strategy, "--steps", str(steps)]
    e = {**env(), "PEER_OUT": str(out / "trainer")}
    proc = subprocess.run(cmd, cwd=ROOT, env=e, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        lines = (proc.stderr + proc.stdout).strip().splitlines()
        said = [ln.strip() for ln in lines if "Error: " in ln and "ChildFailedError" not in ln] or lines[-1:]
        return {"error": said[0][-300:], "command": shlex.join(cmd[1:])}
    if peer.startswith("dist_train"):
        s = json.loads((run_dir / "summary.json").read_text())
        # since exec, as the peers' figure: set-up's peak or the steady window's (telemetry resets VmHWM per window)
        peak = max(max(r.get("memory/peak_rss_bytes", 0), r.get("memory/setup_peak_rss_bytes", 0))
                   for r in s["ranks"])
        return {"losses": s["losses"], "mean_step_s": s["mean_step_s"],
                "time_to_first_step_s": s["time_to_first_step_s"], "peak_rss_bytes": peak,
                "memory": {k: max(r.get(k, 0) for r in s["ranks"])
                           for k in ("memory/peak_rss_bytes", "memory/peak_live_bytes")}}
    return json.loads([ln for ln in proc.stdout.splitlines() if ln.startswith("{")][-1])


def paired(peer: str, strategy: str, *, nproc: int, iterations: int) -> dict[str, Any]:
    """bench/interleaved.py's paired comparison: dist_train's step and the peer's, alternating in the same
    processes; its JSON line (median_ratio = dist_train's step / the peer's, with q1 and q3)."""
    cmd = [PYTHON, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           "bench/interleaved.py", "--vs", peer, "--strategy", strategy, "--iterations", str(iterations)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        lines = (proc.stderr + proc.stdout).strip().splitlines()
        return {"error": ([ln for ln in lines if "Error: " in ln] or lines[-1:])[0][-300:]}
    return json.loads([ln for ln in proc.stdout.splitlines() if ln.startswith("{")][-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--strategy", default="ddp", help=argparse.SUPPRESS)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=100, help=f"steps of each run (the first {WARMUP} not timed)")
    parser.add_argument("--paired-iterations", type=int, default=200,
                        help="paired steps of each in-process comparison with Accelerate and Fabric (0: none)")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--strategies", default="ddp,fsdp")
    parser.add_argument("--peers", default=",".join(PEERS))
    parser.add_argument("--no-write", action="store_true", help="print the table, leave docs/BENCHMARKS.md alone")
    args = parser.parse_args()
    if args.steps <= WARMUP:
        parser.error(f"--steps {args.steps}: more than the {WARMUP} warm-up steps")
    if args.worker:
        worker(args.worker, args.strategy, training(args.steps))
        return
    import tempfile

    out = Path(tempfile.mkdtemp(prefix="peers-"))
    peers = args.peers.split(",")
    results: dict[tuple[str, str], list[dict[str, Any]]] = {}
    pairs: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for rep in range(args.repeats):
        for strategy in args.strategies.split(","):
            for peer in peers:
                if peer == "trainer" and strategy != "ddp":
                    continue
                got = launch(peer, strategy, nproc=args.nproc, steps=args.steps, out=out)
                results.setdefault((peer, strategy), []).append(got)
                print(f"[peers] {rep + 1}/{args.repeats} {peer} {strategy}: "
                      f"{got.get('mean_step_s', got.get('error'))}", file=sys.stderr, flush=True)
            for peer in [p for p in PAIRED if p in peers and strategy == "ddp" and args.paired_iterations]:
                got = paired(peer, strategy, nproc=args.nproc, iterations=args.paired_iterations)
                pairs.setdefault((peer, strategy), []).append(got)
                print(f"[peers] {rep + 1}/{args.repeats} {peer} {strategy} paired: "
                      f"{got.get('median_ratio', got.get('error'))}", file=sys.stderr, flush=True)
    table = render(results, pairs)
    print(table)
    (out / "peers.json").write_text(json.dumps({f"{p} {s}": runs for (p, s), runs in results.items()}
                                               | {f"{p} {s} paired": v for (p, s), v in pairs.items()}, indent=1))
    if not args.no_write:
        write_section("peers", "dist_train against Accelerate, Lightning Fabric and transformers' Trainer", table,
                      command=f"python bench/peers.py --repeats {args.repeats} --nproc {args.nproc}",
                      note=f"Training: {' '.join(training(args.steps))}, {args.nproc} processes (gloo, 1 thread each). "
                           + READING)


def _median(values: list[float]) -> str:
    return f"{statistics.median(values) * 1e3:.0f} [{min(values) * 1e3:.0f}, {max(values) * 1e3:.0f}]"


def _paired(runs: list[dict[str, Any]]) -> str:
    """The paired runs' median ratios: their median, [lowest, highest], and the widest interquartile range."""
    if not runs:
        return ""
    if any("error" in r for r in runs):
        return "failed: " + next(r["error"] for r in runs if "error" in r)
    ratios = [r["median_ratio"] for r in runs]
    return (f"{statistics.median(ratios):.3f} [{min(ratios):.3f}, {max(ratios):.3f}]; "
            f"steps' IQR {min(r['q1'] for r in runs):.2f}-{max(r['q3'] for r in runs):.2f}")


def _memory(figures: dict[str, Any]) -> str:
    return ", ".join(f"`{k}` {v / 2**20:.0f} MiB" for k, v in figures.items() if v) or "none on a CPU"


def render(results: dict[tuple[str, str], list[dict[str, Any]]],
           pairs: dict[tuple[str, str], list[dict[str, Any]]] | None = None) -> str:
    pairs = pairs or {}
    rows = []
    for (peer, strategy), runs in results.items():
        base = [r for r in results.get(("dist_train", strategy), []) if "error" not in r]
        if any("error" in r for r in runs):
            rows.append([peer, strategy, "failed: " + next(r["error"] for r in runs if "error" in r),
                         *[""] * 6])
            continue
        steps = [r["mean_step_s"] for r in runs]
        firsts = [r["time_to_first_step_s"] for r in runs]
        # dist_train's figure over the peer's: above 1, dist_train is the slower
        ratio = statistics.median([r["mean_step_s"] for r in base]) / statistics.median(steps) if base else None
        first_ratio = (statistics.median([r["time_to_first_step_s"] for r in base]) / statistics.median(firsts)
                       if base else None)
        ours = base[0]["losses"] if base else []
        theirs = runs[0]["losses"]
        worst = max((abs(a - b) / abs(b) for a, b in zip(theirs, ours)), default=None)
        rows.append([peer, strategy, _median(steps), f"{ratio:.3f}" if ratio else "",
                     _paired(pairs.get((peer, strategy), [])),
                     f"{statistics.median(firsts):.1f} s ({first_ratio:.2f})" if first_ratio else "",
                     "" if worst is None else f"{worst:.1e}" + (" (match)" if worst <= 1e-5 else " (**differ**)"),
                     f"{max(r['peak_rss_bytes'] for r in runs) / 2**20:.0f} MiB", _memory(runs[0]["memory"])])
    rows.append(["torchtitan", "-", "not run", *[""] * 5, TORCHTITAN])
    return md_table(["peer", "strategy", "steady step ms, median [min, max]", "dist_train ÷ peer, separate runs",
                     "dist_train ÷ peer, paired steps in one process: median of runs [min, max]",
                     "time to first step (dist_train ÷ peer)", "worst loss difference",
                     "peak host RSS, worst rank", "memory figures it reports itself"], rows)


if __name__ == "__main__":
    main()
    end_process()  # after the results are out: no interpreter teardown for gloo's threads to abort
