"""Where zero3's set-up memory goes: each step of DeepSpeed's ZeRO-3 engine, what it leaves resident and its peak.

    python bench/zero3_setup.py                  # writes the 'zero3-setup' section of docs/BENCHMARKS.md
    python bench/zero3_setup.py --nproc 4 --layers 12 --hidden 768

Trains one step of `strategy=zero3 model=hf model.path=DIR` (the Llama-shaped directory of bench/setup_memory.py)
with this file as the entry point. On rank 0 it wraps the engine's set-up steps: before each it resets the kernel's
high-water mark (`5 > /proc/self/clear_refs`), after it reads VmRSS and VmHWM. It explains the set-up peak that
bench/setup_memory.py reports for zero3.
"""

from __future__ import annotations

import argparse
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
    "_create_fp32_partitions": "the master partition: a copy even in fp32 (it compares torch.device with a str)",
    "initialize_optimizer_states": "one zero gradient per sub-group (sub_group_size) and a first optimizer step",
    "_setup_for_real_optimizer": "the two steps above, then the flat gradient-partition buffer",
    "create_reduce_and_remove_grad_hooks": "gathers each parameter whole, one at a time, to hook it",
    "_link_all_hp_params": "links the partitions for checkpoint access",
}


def _status() -> dict[str, int]:
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(value.split()[0]) * 1024
    return out


def _probe(argv: list[str]) -> None:
    """Inside each launched rank: wrap the engine's steps (rank 0 prints), then run launch/train.py."""
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3 as Stage3

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


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--probe":
        return _probe(sys.argv[2:])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--vocab", type=int, default=32000)
    args = parser.parse_args()
    import subprocess

    from common import env
    from setup_memory import make_model

    scratch = Path(tempfile.mkdtemp(prefix="dist_train_zero3_setup_"))
    params = make_model(scratch / "model", layers=args.layers, hidden=args.hidden, vocab=args.vocab)
    weights = 4 * params
    cmd = [*TORCHRUN, f"--nproc_per_node={args.nproc}", __file__, "--probe", "strategy=zero3", "model=hf",
           f"model.path={scratch / 'model'}", "logger=none", "train.steps=1", "train.seq_len=64",
           "train.micro_batch_size=1", "optimizer=sgd", "telemetry.activations=false",
           f"hydra.run.dir={scratch / 'run'}"]
    done = subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        sys.exit(f"the zero3 run failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    steps = [json.loads(line[len(MARK):]) for line in done.stdout.splitlines() if line.startswith(MARK)]
    rank0 = json.loads((scratch / "run" / "summary.json").read_text())["ranks"][0]
    base = rank0["memory/setup_baseline_rss_bytes"]

    def share(n: int) -> str:
        return f"{n / MIB:,.0f} MiB ({n / weights:.2f})"

    # The nested steps each reset the mark, so a container's own peak is only known after its last child.
    load_peak = rank0["memory/load_peak_rss_bytes"]
    rows = [["loading (built under zero.Init, each rank reads its partitions)", "", share(load_peak - base),
             share(load_peak - base)]]
    for s in steps:
        rows.append([f"`{s['step']}`: {STEPS[s['step']]}", share(s["after"]["VmRSS"] - s["before"]["VmRSS"]),
                     share(s["after"]["VmHWM"] - s["before"]["VmRSS"]), share(s["after"]["VmHWM"] - base)])
    peak = max([load_peak, *(s["after"]["VmHWM"] for s in steps)])
    rows.append(["set-up peak", "", "", share(peak - base)])
    body = md_table(["rank 0, in order", "left resident", "its peak above its start", "its peak above the baseline"],
                    rows)
    note = (f"A Llama-shaped directory of {params / 1e6:.0f}M parameters, {weights / MIB:,.0f} MiB of fp32 weights, "
            f"{args.nproc} ranks, so a partition is {1 / args.nproc:.2f} of the weights. The loading row is above the "
            "baseline (what the rank held before it built the model). Fractions are of the weights. A nested step "
            "resets the mark its container began with, so a container's peak covers only what follows its last "
            "child. What DeepSpeed allocates here is its design (a gradient "
            "partition, a gathered parameter while hooking it) except the fp32 master copy: "
            "`_create_fp32_partitions` skips the copy only when `partition.device == self.device`, and self.device "
            "is a str ('cpu', 'cuda:0') that a torch.device never equals, so an fp32 run holds its partition twice. "
            f"Without that copy DeepSpeed's design alone still holds, at set-up, the partition and its gradient "
            f"partition ({2 / args.nproc:.2f} of the weights together at {args.nproc} ranks) and then the largest "
            "parameter gathered whole while it is hooked: above issue 22's 0.50 target at 4 ranks whatever the "
            "loading does. The loading row is what dist_train controls.")
    write_section("zero3-setup", "Where zero3's set-up memory goes", body,
                  command=f"python bench/zero3_setup.py --nproc {args.nproc} --layers {args.layers} "
                          f"--hidden {args.hidden} --vocab {args.vocab}", note=note)


if __name__ == "__main__":
    main()
