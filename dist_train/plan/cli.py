"""`python launch/plan.py [training overrides] cluster.* plan.* [format=json]`: which configuration, how fast, how
much memory; then, with plan.verify=K, checked by real runs. `--help` lists every option with its default."""

from __future__ import annotations

import json
import re
import shlex
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional


from dist_train.config import CHECKPOINTING, checkpointing_mode
from dist_train.estimate.args import parse_options, split_options
from dist_train.estimate.render import human_bytes, human_count, human_seconds, text_table
from dist_train.estimate.shapes import ModelShape
from dist_train.estimate.hardware import ClusterArgs, Hardware, apply_overrides, default_profile_dir, resolve, save_profile
from dist_train.plan.search import SEARCHED, Candidate, Search, search


@dataclass
class PlanOptions:
    top: int = 5  # configurations shown, best first
    verify: int = 0  # run the best K here for plan.steps steps, predicted beside measured, then refit the profile
    steps: int = 10  # steps of each verified or calibrating run (the first are warm-up, not timed)
    # measure this machine first (cpu: done by itself when no profile is stored, with short runs of the model under
    # ddp and each strategy family searched, in <out_dir>/calibration)
    calibrate: bool = False
    profile_dir: Optional[str] = None  # where measured profiles are kept; null: ~/.cache/dist_train/profiles
    strategies: list[str] = field(default_factory=lambda: list(SEARCHED))  # the strategies searched
    micro_batch_sizes: list[int] = field(default_factory=list)  # tried; empty: every power of two that fits
    # activation checkpointing, tried: none | full | selective (true = full, false = none)
    checkpointing: list[str] = field(default_factory=lambda: list(CHECKPOINTING))
    optimizers: list[str] = field(default_factory=list)  # empty: the training config's optimizer only
    distinct: bool = True  # one configuration per strategy and degrees (its fastest); false: every one
    memory_fraction: float = 0.9  # the share of a device's memory a configuration may fill at its peak
    # expert parallelism: the busiest rank's received rows over its balanced share (moe/ep_overload), at most each
    # configuration's ep (capped there); 1 = balanced routing
    ep_overload: float = 1.0
    out_dir: Optional[str] = None  # plan.verify's and a cpu calibration's runs; null: outputs/plan-<time>
    timeout_s: float = 900.0  # per verified or calibrating run

    def __post_init__(self) -> None:
        if self.top < 1:
            raise ValueError(f"plan.top={self.top} must be >= 1")
        if self.verify < 0 or self.steps < 3:
            raise ValueError(f"plan.verify={self.verify} must be >= 0 and plan.steps={self.steps} >= 3 (the first "
                             "steps are warm-up, not timed)")
        if not 0 < self.memory_fraction <= 1:
            raise ValueError(f"plan.memory_fraction={self.memory_fraction} must be in (0, 1]")
        bad = [s for s in self.strategies if s not in SEARCHED]
        if bad:
            raise ValueError(f"plan.strategies: {', '.join(bad)} cannot be searched; allowed: {', '.join(SEARCHED)}")
        if not self.ep_overload >= 1:  # NaN too
            raise ValueError(f"plan.ep_overload={self.ep_overload} must be >= 1 (1 = balanced routing)")
        if any(b < 1 for b in self.micro_batch_sizes):
            raise ValueError(f"plan.micro_batch_sizes={self.micro_batch_sizes}: each must be >= 1")


@dataclass
class PlanArgs:
    cluster: ClusterArgs = field(default_factory=ClusterArgs)
    plan: PlanOptions = field(default_factory=PlanOptions)
    format: str = "text"

    def __post_init__(self) -> None:
        if self.format not in ("text", "json"):
            raise ValueError(f"format={self.format!r} is not supported; allowed: text, json")


_OWN = ("cluster", "plan", "format")

def help_text() -> str:
    from dist_train.entry import dataclass_options, help_text as entry_help, option_line

    from dist_train.estimate.hardware import KNOWN_GPUS

    return entry_help(
        ABOUT,
        usage="python launch/plan.py [training overrides] [cluster.KEY=VALUE] [plan.KEY=VALUE] [format=json]",
        sections=[
            (f"the cluster (cluster.gpu: {', '.join(KNOWN_GPUS)}):", dataclass_options(ClusterArgs, "cluster.")),
            ("the search (plan.KEY=VALUE):", dataclass_options(PlanOptions, "plan.")),
            ("everything else:", [
                *option_line("format=text", "text: tables for a person; json: the same for tools"),
                *option_line("GROUP=OPTION, KEY=VALUE", "a training override (see python launch/train.py --help); "
                                                        "model= also takes the estimator's presets 7b, 13b, 70b"),
                *option_line("-h, --help", "this help"),
            ]),
        ],
        examples=[
            "python launch/plan.py model=70b precision=bf16 train.seq_len=4096 train.global_batch_size=512 "
            "cluster.gpu=h100 cluster.nodes=16",
            "python launch/plan.py model=7b precision=bf16 train.seq_len=4096 train.global_batch_size=256 "
            "cluster.gpu=h100 cluster.nodes=4 format=json",
            "python launch/plan.py model=tiny train.global_batch_size=8 cluster.gpu=cpu plan.verify=4",
        ],
    )


ABOUT = """Which configuration for this model on this cluster: predicted memory and step time, best first.

Searches strategies and their degrees (ddp, zero1-3, fsdp; tp within a node; fsdp_tp; 1f1b, gpipe; pp_dp), micro-batch
sizes and activation checkpointing (none, full, selective) for the training config's model, global batch and sequence
length; predicts each one's peak memory per device (the estimator) and step time (compute operation by operation,
exposed communication, pipeline bubble, optimizer step, the framework's per-block work); drops what does not fit or
cannot run, with the reason; prints the best as commands. plan.verify=K runs the best K here for a few steps and
prints predicted beside measured. Bad input is one line on stderr, exit code 2; exit code 1 when nothing fits (the
reasons are printed) or a verified run failed.
"""


def split_args(argv: list[str]) -> tuple[list[str], list[str]]:
    return split_options(argv, _OWN)


def parse_args(own: list[str]) -> PlanArgs:
    return parse_options(PlanArgs, own)


def profile(args: PlanArgs, shape: ModelShape, cfg: dict[str, Any],
            run_overrides: Optional[list[str]] = None) -> tuple[Hardware, str]:
    """The hardware profile and how it was obtained: stored, datasheet, or measured now (`run_overrides`: the run's
    training overrides, whose model a CPU calibration times)."""
    from dist_train.plan.calibrate import calibrate

    c = args.cluster
    profile_dir = Path(args.plan.profile_dir or default_profile_dir())
    hw, how = resolve(c.gpu, profile_dir)
    if args.plan.calibrate or hw is None:
        procs = c.gpus_per_node or (hw.gpus_per_node if hw is not None and c.gpu == "cpu" else 2)
        if c.gpu != "cpu":
            import torch

            if not torch.cuda.is_available():
                raise ValueError(f"plan.calibrate=true measures this machine, which has no GPU: it cannot stand for "
                                 f"cluster.gpu={c.gpu}; use cluster.gpu=cpu, or calibrate on the GPU machine")
            procs = min(procs, torch.cuda.device_count())
        print(f"[plan] calibrating {c.gpu} on this machine ({procs} processes) ...", file=sys.stderr, flush=True)
        train = cfg["train"]
        hw = calibrate(c.gpu, shape, tokens=int(train["micro_batch_size"]) * int(train["seq_len"]),
                       precision=str(cfg["precision"]["name"]), procs=procs)
        if c.gpu == "cpu" and run_overrides is not None:  # what separates the strategies here (plan/probe.py)
            from dist_train.plan.probe import probe
            from dist_train.plan.verify import plan_out_dir

            p = args.plan
            hw = probe(hw, shape, cfg, training=run_overrides, procs=procs, steps=p.steps,
                       out_dir=plan_out_dir(p) / "calibration", timeout_s=p.timeout_s, strategies=tuple(p.strategies))
        path = save_profile(hw, profile_dir)
        how = f"measured now, stored in {path}"
    return apply_overrides(hw, c), how


def candidate_check(training: list[str], global_batch: int, world_size: int, *, here: bool):  # noqa: ANN201
    """Why launch/train.py would refuse a candidate (its own checks, for world_size processes, and its line), or
    None. `here`: for this machine (cluster.gpu=cpu); else for a machine with GPUs (estimate.compose)."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from dist_train.config import ConfigError
    from dist_train.entry import one_line
    from dist_train.estimate.compose import check_as_training

    def check(c: Candidate) -> Optional[str]:
        try:
            check_as_training([*training, f"train.global_batch_size={global_batch}", *c.overrides],
                              world_size=world_size, here=here)
        except ConfigError as exc:
            return str(exc)
        except (ValueError, HydraException, OmegaConfBaseException) as exc:
            return one_line(exc)
        return None

    return check


def command(c: Candidate, *, training: list[str], global_batch: int, nodes: int, gpus_per_node: int) -> str:
    args = " ".join(shlex.quote(_plain(a)) for a in [*training, f"train.global_batch_size={global_batch}",
                                                     *c.overrides])
    if nodes > 1:
        return f"sbatch --nodes={nodes} --gpus-per-node={gpus_per_node} launch/slurm.sbatch {args}"
    if c.setup.world_size == 1:
        return f"python launch/train.py {args}"
    return f"torchrun --nproc_per_node={gpus_per_node} launch/train.py {args}"


def _plain(override: str) -> str:
    """`model.name='llama2-70b'` (how the estimator's presets are written) as `model.name=llama2-70b`: Hydra reads
    both alike, and the shell needs no quotes for the second."""
    key, sep, value = override.partition("=")
    if sep and len(value) > 2 and value[0] == value[-1] == "'" and re.fullmatch(r"[A-Za-z][\w.-]*", value[1:-1]):
        return f"{key}={value[1:-1]}"
    return override


PARTS = (("compute_s", "compute"), ("exposed_comm_s", "exposed communication"), ("bubble_s", "pipeline bubble"),
         ("optimizer_s", "optimizer step"), ("framework_s", "ZeRO-3 module fetches"))


def why_lost(c: Candidate, winner: Candidate) -> str:
    """What makes `c` slower than the winner: the part of the step that grew the most."""
    ratio = c.time.step_s / winner.time.step_s
    key, label = max(PARTS, key=lambda p: getattr(c.time, p[0]) - getattr(winner.time, p[0]))
    extra = getattr(c.time, key) - getattr(winner.time, key)
    return f"{ratio:.2f}x the best step: {label} +{human_seconds(extra)}"


def candidate_json(c: Candidate, cmd: str) -> dict[str, Any]:
    t = c.time
    return {
        "strategy": c.strategy, "overrides": list(c.overrides), "command": cmd,
        "predicted": {"step_s": t.step_s, "peak_bytes": c.peak_bytes, "tokens_per_s": t.tokens_per_s, "mfu": t.mfu,
                      "compute_s": t.compute_s, "exposed_comm_s": t.exposed_comm_s, "comm_s": t.comm_s,
                      "bubble_s": t.bubble_s, "optimizer_s": t.optimizer_s, "framework_s": t.framework_s,
                      # compute_s by kind of operation (estimate/ops.py), eager PyTorch's per-block cost apart
                      "compute_ops": {**asdict(t.ops), "per_block_s": t.compute_s - t.ops.total_s} if t.ops else {},
                      "memory": {**asdict(c.memory), "total": c.memory.total}},
    }


def losers(result: Search, shown: list[Candidate]) -> list[dict[str, Any]]:
    """Each strategy not shown, by its best candidate, with why it lost; each with nothing ranked, with why not."""
    out: list[dict[str, Any]] = []
    shown_names = {c.strategy for c in shown}
    best: dict[str, Candidate] = {}
    for c in result.ranked:
        best.setdefault(c.strategy, c)
    for name, c in best.items():
        if name not in shown_names:
            out.append({"strategy": name, "overrides": list(c.overrides), "step_s": c.time.step_s,
                        "why": why_lost(c, result.ranked[0])})
    dropped: dict[str, list[str]] = {}
    for r in result.rejected:
        if r.strategy not in best:
            dropped.setdefault(r.strategy, []).append(r.reason)
    for name, reasons in dropped.items():
        out.append({"strategy": name, "overrides": [], "step_s": None, "why": "dropped: " + _reasons(reasons)})
    return out


def _reasons(reasons: list[str]) -> str:
    """The distinct reasons, out-of-memory ones folded into the smallest need."""
    oom = [r for r in reasons if r.startswith("out of memory")]
    rest = list(dict.fromkeys(r for r in reasons if not r.startswith("out of memory")))
    if oom:
        rest.append(f"out of memory in all {len(oom)} configuration(s) that could run, the least: "
                    f"{min(oom, key=lambda r: float(r.split(':')[1].split()[0]))[len('out of memory: '):]}")
    return "; ".join(rest[:3]) + (f" (+{len(rest) - 3} more)" if len(rest) > 3 else "")


def main(argv: Optional[list[str]] = None) -> int:
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from dist_train.entry import one_line, print_help, report_config_error
    from dist_train.paths import expand_overrides
    from dist_train.estimate.cli import compose, resolve_model_choice

    argv = expand_overrides(sys.argv[1:] if argv is None else list(argv))  # model.path=~/m, as the shell left it
    if "--help" in argv or "-h" in argv:
        print_help(help_text())
        return 0
    own, user_training = split_args(argv)
    try:
        args = parse_args(own)
        training = resolve_model_choice(user_training)
        cfg, unlisted = compose(training)
        if unlisted:
            raise ValueError(f"strategy={unlisted}: no conf/strategy/{unlisted}.yaml; the plan chooses the strategy "
                             "(plan.strategies= limits the search)")
        training = _searched_overrides(training, args.plan)
        shape = ModelShape.from_config(cfg["model"])
        hw, how = profile(args, shape, cfg, training)
        world = args.cluster.nodes * hw.gpus_per_node
        if args.plan.verify:
            _check_verifiable(args, world)
        result = _search(shape, cfg, hw, args, training)
    except (ValueError, OmegaConfBaseException, HydraException) as exc:
        return report_config_error(one_line(exc, {"plan": PlanOptions, "cluster": ClusterArgs}))
    except RuntimeError as exc:  # calibration's own runs
        print(f"plan failed: {one_line(exc)}", file=sys.stderr)
        return 1
    shown = result.ranked[:args.plan.top]
    cmds = [command(c, training=training, global_batch=result.global_batch_size, nodes=args.cluster.nodes,
                    gpus_per_node=hw.gpus_per_node) for c in shown]
    out: dict[str, Any] = {
        "model": {"name": shape.name, "num_params": shape.num_params},
        "cluster": {**asdict(args.cluster), "world_size": world, "gpus_per_node": hw.gpus_per_node},
        "hardware": {**hw.to_json(), "how": how},
        "global_batch_size": result.global_batch_size, "seq_len": int(cfg["train"]["seq_len"]),
        "precision": str(cfg["precision"]["name"]), "optimizer": str(cfg["optimizer"]["name"]),
        "searched": len(result.ranked) + len(result.rejected), "ranked": len(result.ranked),
        "candidates": [candidate_json(c, cmd) for c, cmd in zip(shown, cmds)],
        "others": losers(result, shown),
        "rejected": [{"strategy": r.strategy, "overrides": list(r.overrides), "reason": r.reason}
                     for r in result.rejected],
    }
    if args.format == "text":
        print(render(out, shown, hw))
    if args.plan.verify and shown:
        from dist_train.plan.verify import verify

        out["verify"] = verify(shown[:args.plan.verify], out, shape=shape, cfg=cfg, hw=hw, args=args,
                               training=training, global_batch=result.global_batch_size, text=args.format == "text")
        for candidate, run in zip(out["candidates"], out["verify"]["runs"]):
            candidate["measured"] = {**run["measured"], "status": run["status"], "run_dir": run["run_dir"]}
    if args.format == "json":
        print(json.dumps(out, indent=1, default=str))
    failed = [r for r in out.get("verify", {}).get("runs", []) if r["status"] != "ok"]
    return 0 if shown and not failed else 1


def _searched_overrides(training: list[str], plan: PlanOptions) -> list[str]:
    """The training overrides without what each candidate sets itself. An explicit train.micro_batch_size= or
    train.activation_checkpointing= narrows the search to it (unless plan.* says otherwise); strategy= is refused,
    since the plan chooses it; the global batch is pinned from the composed config."""
    kept = []
    for arg in training:
        key, _, value = arg.lstrip("+~").partition("=")
        if key == "strategy" or key.startswith("strategy."):
            raise ValueError(f"{arg}: the plan chooses the strategy and its settings; plan.strategies=[...] limits "
                             "the search")
        if key == "train.micro_batch_size" and not plan.micro_batch_sizes:
            plan.micro_batch_sizes = [int(value)]
        elif key == "train.activation_checkpointing" and plan.checkpointing == list(CHECKPOINTING):
            plan.checkpointing = [checkpointing_mode(value)]
        if key not in ("train.global_batch_size", "train.micro_batch_size", "train.activation_checkpointing"):
            kept.append(arg)
    return kept


def _check_verifiable(args: PlanArgs, world: int) -> None:
    if args.cluster.nodes != 1:
        raise ValueError(f"plan.verify runs the candidates here, on one node; cluster.nodes={args.cluster.nodes}")
    if args.cluster.gpu != "cpu":
        import torch

        have = torch.cuda.device_count()
        if have < world:
            raise ValueError(f"plan.verify runs the candidates here: cluster.gpu={args.cluster.gpu} with {world} "
                             f"devices, and this machine has {have} GPU(s); use cluster.gpu=cpu here")


def _search(shape: ModelShape, cfg: dict[str, Any], hw: Hardware, args: PlanArgs, training: list[str]) -> Search:
    p = args.plan
    world = args.cluster.nodes * hw.gpus_per_node
    train = cfg["train"]
    global_batch = int(train.get("global_batch_size") or int(train["micro_batch_size"]) * world)
    return search(shape, cfg, hw, nodes=args.cluster.nodes, strategies=tuple(p.strategies),
                  micro_batch_sizes=list(p.micro_batch_sizes) or None,
                  checkpointing=tuple(checkpointing_mode(c, "plan.checkpointing") for c in p.checkpointing),
                  optimizers=list(p.optimizers) or None, memory_fraction=p.memory_fraction, ep_overload=p.ep_overload,
                  check=candidate_check(training, global_batch, world, here=args.cluster.gpu == "cpu"),
                  top=max(p.top, p.verify),
                  distinct=p.distinct)


def render(out: dict[str, Any], shown: list[Candidate], hw: Hardware) -> str:
    c = out["cluster"]
    head = [
        f"plan for {out['model']['name']} ({human_count(out['model']['num_params'])} parameters) on {c['nodes']} "
        f"node(s) x {c['gpus_per_node']} {c['gpu']} = {c['world_size']} devices; global batch "
        f"{out['global_batch_size']} x {out['seq_len']} tokens, {out['precision']}, {out['optimizer']}",
        f"profile ({out['hardware']['how']}): " + _describe(hw),
        f"searched {out['searched']} configurations: {out['ranked']} fit and can run, "
        f"{out['searched'] - out['ranked']} dropped",
    ]
    if not shown:
        return "\n".join([*head, "", "nothing fits:", *(f"  {o['strategy']}: {o['why']}" for o in out["others"])])
    rows = []
    for i, cand in enumerate(shown):
        t = cand.time
        rows.append([f"{i + 1}. {cand.label}", human_seconds(t.step_s), f"{t.tokens_per_s:,.0f}",
                     f"{100 * t.mfu:.1f}%", human_bytes(cand.peak_bytes), human_seconds(t.compute_s),
                     human_seconds(t.exposed_comm_s), human_seconds(t.bubble_s), human_seconds(t.optimizer_s + t.framework_s)])
    table = text_table(["configuration", "step", "tokens/s", "MFU", "peak/device", "compute", "exposed comm",
                        "bubble", "optimizer+fw"], rows)
    cmds = [f"  {i + 1}. {cand['command']}" for i, cand in enumerate(out["candidates"])]
    others = [f"  {o['strategy']}: {o['why']}" for o in out["others"]]
    return "\n".join([*head, "", table, "", "commands:", *cmds, "", "the rest:", *others])


def _describe(hw: Hardware) -> str:
    from dist_train.plan.calibrate import describe

    assumed = sorted(k for k, v in hw.source.items() if v.startswith("assumed"))
    fitted = hw.fitted_to()
    return describe(hw) + (f" (assumed, never measured here: {', '.join(assumed)})" if assumed else "") + \
        (f" (fitted to published runs: {'; '.join(fitted)})" if fitted else "")
