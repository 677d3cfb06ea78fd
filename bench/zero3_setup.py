"""Where zero3's set-up memory goes: each step of DeepSpeed's ZeRO-3 engine, what it leaves resident and its peak,
with DeepSpeed as released and with dist_train's two set-up fixes (dist_train/strategies/_zero3_setup.py).

    python bench/zero3_setup.py                  # writes the 'zero3-setup' section of docs/BENCHMARKS.md
    python bench/zero3_setup.py --nproc 4 --layers 12 --hidden 768

Trains one step of `strategy=zero3 model=hf model.path=DIR` (the Llama-shaped directory of bench/setup_memory.py)
twice, with this file as the entry point: once as dist_train runs it, once with the fixes turned off. On rank 0 it
wraps the engine's set-up steps: before each it resets the kernel's high-water mark (`5 > /proc/self/clear_refs`),
after it reads VmRSS and VmHWM. It explains the set-up peak that bench/setup_memory.py reports for zero3.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import runpy
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import ROOT, TORCHRUN, md_table, write_section  # noqa: E402

MARK = "ZERO3_SETUP "
MIB = 2**20
# DeepSpeed's ZeRO-3 optimizer, in the order its __init__ calls them, and what each is (read from deepspeed 0.19's
# runtime/zero/stage3.py).
STEPS = {
    "_create_fp16_partitions_with_defragmentation": "copies the partitions into one flat buffer per group",
    "_create_fp32_partitions": "the fp32 master partition: released, a copy even in fp32 (it compares a torch.device "
                               "with a str); fixed, the parameters' own partition in fp32",
    "initialize_optimizer_states": "one zero gradient per sub-group (sub_group_size) and a first optimizer step",
    "_setup_for_real_optimizer": "the two steps above, then the flat gradient-partition buffer",
    "create_reduce_and_remove_grad_hooks": "released, gathers each parameter whole, one at a time, to hook it; fixed, "
                                           "hooks it partitioned (a post-accumulate-grad hook needs no data)",
    "_link_all_hp_params": "links the partitions for checkpoint access",
}


def _status() -> dict[str, int]:
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(value.split()[0]) * 1024
    return out


def _probe(argv: list[str], *, released: bool) -> None:
    """Inside each launched rank: wrap the engine's steps (rank 0 prints), then run launch/train.py; `released`:
    without dist_train's fixes to DeepSpeed's set-up."""
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3 as Stage3

    if released:
        import dist_train.strategies._deepspeed as ours

        ours.zero3_setup_fixes = lambda: contextlib.nullcontext([])

    def wrap(name: str) -> None:
        inner = getattr(Stage3, name)

        @functools.wraps(inner)
        def outer(*args, **kwargs):
            Path("/proc/self/clear_refs").write_text("5")
            before = _status()
            result = inner(*args, **kwargs)
            after = _status()
            if os.environ.get("RANK", "0") == "0":
                print(MARK + json.dumps({"step": name, "before": before, "after": after}), flush=True)
            return result

        setattr(Stage3, name, outer)

    for name in STEPS:
        wrap(name)
    sys.argv = [str(ROOT / "launch" / "train.py"), *argv]
    runpy.run_path(sys.argv[0], run_name="__main__")


def _measure(model: Path, run_dir: Path, *, nproc: int, released: bool) -> tuple[list[dict], dict]:
    """One zero3 run: the engine's steps on rank 0, and rank 0's summary."""
    import subprocess

    from common import env

    cmd = [*TORCHRUN, f"--nproc_per_node={nproc}", __file__, "--probe-released" if released else "--probe",
           "strategy=zero3", "model=hf", f"model.path={model}", "logger=none", "train.steps=1", "train.seq_len=64",
           "train.micro_batch_size=1", "optimizer=sgd", "telemetry.activations=false", f"hydra.run.dir={run_dir}"]
    done = subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        sys.exit(f"the zero3 run failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    steps = [json.loads(line[len(MARK):]) for line in done.stdout.splitlines() if line.startswith(MARK)]
    return steps, json.loads((run_dir / "summary.json").read_text())["ranks"][0]


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] in ("--probe", "--probe-released"):
        return _probe(sys.argv[2:], released=sys.argv[1] == "--probe-released")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--vocab", type=int, default=32000)
    args = parser.parse_args()
    from setup_memory import make_model

    scratch = Path(tempfile.mkdtemp(prefix="dist_train_zero3_setup_"))
    params = make_model(scratch / "model", layers=args.layers, hidden=args.hidden, vocab=args.vocab)
    weights = 4 * params

    def share(n: int) -> str:
        return f"{n / MIB:,.0f} MiB ({n / weights:.2f})"

    columns, peaks = [], {}
    for released in (True, False):
        steps, rank0 = _measure(scratch / "model", scratch / ("released" if released else "fixed"), nproc=args.nproc,
                                released=released)
        base = rank0["memory/setup_baseline_rss_bytes"]
        # The nested steps each reset the mark, so a container's own peak is only known after its last child.
        load_peak = rank0["memory/load_peak_rss_bytes"]
        cells = {"loading": ["", share(load_peak - base)]}
        for s in steps:
            cells[s["step"]] = [share(s["after"]["VmRSS"] - s["before"]["VmRSS"]), share(s["after"]["VmHWM"] - base)]
        peaks[released] = max([load_peak, *(s["after"]["VmHWM"] for s in steps)]) - base
        cells["peak"] = ["", share(peaks[released])]
        columns.append(cells)
    names = {"loading": "loading (built under zero.Init, each rank reads its partitions)", "peak": "set-up peak",
             **{step: f"`{step}`: {what}" for step, what in STEPS.items()}}
    rows = [[names[key], *columns[0].get(key, ["", ""]), *columns[1].get(key, ["", ""])]
            for key in ["loading", *STEPS, "peak"]]
    body = md_table(["rank 0, in order", "released: left resident", "released: peak above the baseline",
                     "fixed: left resident", "fixed: peak above the baseline"], rows)
    note = (f"A Llama-shaped directory of {params / 1e6:.0f}M parameters, {weights / MIB:,.0f} MiB of fp32 weights, "
            f"{args.nproc} ranks, so a partition is {1 / args.nproc:.2f} of the weights. 'released': DeepSpeed's engine "
            "as DeepSpeed builds it; 'fixed': as strategy=zero3 builds it, with the two fixes of "
            "dist_train/strategies/_zero3_setup.py (the same losses and parameters, bit for bit: tests/launched/test_zero.py). "
            "Peaks are above the baseline (what the rank held before it built the model); fractions are of the "
            "weights. A nested step resets the mark its container began with, so a container's peak covers only what "
            f"follows its last child. The set-up peak went from {peaks[True] / weights:.2f} to "
            f"{peaks[False] / weights:.2f} of the weights. What is left is DeepSpeed's design: the partition, and the "
            f"gradient partition it allocates at set-up ({2 / args.nproc:.2f} of the weights together at "
            f"{args.nproc} ranks; FSDP allocates its gradients at the first backward), with one sub-group's zero "
            "gradient (`sub_group_size`) for a moment before it.")
    write_section("zero3-setup", "Where zero3's set-up memory goes", body,
                  command=f"python bench/zero3_setup.py --nproc {args.nproc} --layers {args.layers} "
                          f"--hidden {args.hidden} --vocab {args.vocab}", note=note)


if __name__ == "__main__":
    main()
