"""Set-up memory of your own model: each rank's peak before its first step, by strategy, for a pretrained directory.

    python bench/setup_memory.py                    # writes the 'setup' section of docs/BENCHMARKS.md
    python bench/setup_memory.py --nproc 4 --layers 12 --hidden 768

Makes a Llama-shaped directory with `save_pretrained` (safetensors, an index of shards), then trains one step of
`model=hf model.path=DIR` under each strategy and reads from summary.json, for every rank, what it held before
building the model (`memory/setup_baseline_rss_bytes`), its peak once its weights were in
(`memory/load_peak_rss_bytes`) and before its first step (`memory/setup_peak_rss_bytes`; its anonymous memory:
`memory/setup_peak_anon_bytes` above `memory/setup_baseline_anon_bytes`), and through the first step.
The target (issue 22): the worst sharding rank's set-up peak above the baseline is at most half the weights' bytes.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import PYTHON, TORCHRUN, md_table, run, write_section  # noqa: E402

MIB = 2**20


def make_model(out: Path, *, layers: int, hidden: int, vocab: int) -> int:
    """A Llama-shaped pretrained directory; returns its parameter count."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
                      num_attention_heads=hidden // 64, num_key_value_heads=hidden // 64, max_position_embeddings=512,
                      tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    model.save_pretrained(out, max_shard_size="100MB")
    return sum(p.numel() for p in model.parameters())


def peaks(strategy: str, nproc: int, overrides: list[str], run_dir: Path) -> dict[str, int]:
    """The worst rank's figures, bytes: its baseline (resident before the model was built), load peak and set-up
    peak above that baseline, and its peak through the first step."""
    launcher = [PYTHON] if nproc == 0 else [*TORCHRUN, f"--nproc_per_node={nproc}"]
    run([*launcher, "launch/train.py", f"strategy={strategy}", *overrides, "logger=none", "train.steps=1",
         "train.seq_len=64", "train.micro_batch_size=1", "optimizer=sgd", "telemetry.activations=false",
         f"hydra.run.dir={run_dir}"], timeout=1800)
    ranks = json.loads((run_dir / "summary.json").read_text())["ranks"]

    def above(key: str) -> int:
        return max(r[key] - r["memory/setup_baseline_rss_bytes"] for r in ranks)

    return {"baseline": max(r["memory/setup_baseline_rss_bytes"] for r in ranks),
            "load": above("memory/load_peak_rss_bytes"), "setup": above("memory/setup_peak_rss_bytes"),
            # what the rank itself allocated: anonymous memory, file pages of the memory-mapped weights left out
            "anon": max(r["memory/setup_peak_anon_bytes"] - r["memory/setup_baseline_anon_bytes"] for r in ranks),
            "step": max(max(r["memory/setup_peak_rss_bytes"], r["memory/peak_rss_bytes"]) for r in ranks)}


def verdict(results: dict[str, dict[str, int]], weights: int) -> str:
    """Which of the sharding strategies measured meet the target, for loading and for all of set-up."""
    sharding = [s for s in results if s in ("fsdp", "zero3", "gpipe", "1f1b", "pp_dp")]
    out = []
    for key, what in (("load", "Loading"), ("setup", "All of set-up"), ("anon", "All of set-up, anonymous memory")):
        over = [s for s in sharding if results[s][key] > 0.5 * weights]
        out.append(f"{what}: {'every one within it' if not over else 'over it: ' + ', '.join(over)}.")
    return " ".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--strategies", default="fsdp,ddp,zero3,gpipe")
    args = parser.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="dist_train_setup_"))
    model_dir = scratch / "model"
    params = make_model(model_dir, layers=args.layers, hidden=args.hidden, vocab=args.vocab)
    hf = ["model=hf", f"model.path={model_dir}"]
    weights = 4 * params
    headers = ["strategy", "baseline, MiB", "load peak above it, MiB", "of the weights", "set-up peak above it, MiB",
               "of the weights", "anonymous set-up peak above its baseline, MiB", "of the weights",
               "peak through step 1, MiB"]
    rows, results = [], {}
    for strategy in ["single", *args.strategies.split(",")]:
        nproc = 0 if strategy == "single" else args.nproc
        p = results[strategy] = peaks(strategy, nproc, hf, scratch / strategy)
        rows.append([f"{strategy} ({max(nproc, 1)} process{'es' if nproc > 1 else ''})", f"{p['baseline'] / MIB:,.0f}",
                     f"{p['load'] / MIB:,.0f}", f"{p['load'] / weights:.2f}", f"{p['setup'] / MIB:,.0f}",
                     f"{p['setup'] / weights:.2f}", f"{p['anon'] / MIB:,.0f}", f"{p['anon'] / weights:.2f}",
                     f"{p['step'] / MIB:,.0f}"])
        print(md_table(headers, rows[-1:]), flush=True)
    body = md_table(headers, rows)
    note = (f"A Llama-shaped directory of {params / 1e6:.0f}M parameters ({args.layers} layers, hidden {args.hidden}, "
            f"vocabulary {args.vocab:,}; fp32 safetensors, 100 MB shards): {4 * params / MIB:,.0f} MiB of weights. "
            "Worst rank of each run, from summary.json's ranks[]. Baseline: memory/setup_baseline_rss_bytes, what the "
            "process held just before it built the model (imports, process group, the strategy's own libraries: "
            "DeepSpeed's for zero3). Load peak: memory/load_peak_rss_bytes, the kernel's high-water mark (VmHWM) once "
            "the rank's weights are in. Set-up peak: memory/setup_peak_rss_bytes, VmHWM before the first step, which "
            "adds what a strategy allocates for training at set-up (DeepSpeed's ZeRO-3 engine: its gradient "
            "partition, a quarter of the weights here; FSDP allocates its gradients at the first backward). VmHWM also counts "
            "the pages of memory-mapped safetensors a rank touched: shared, reclaimable page cache. The anonymous "
            "set-up peak leaves them out (memory/setup_peak_anon_bytes above memory/setup_baseline_anon_bytes: "
            "resident memory less file-backed pages, sampled every 20 ms): what the rank itself allocated. fsdp and "
            "the pipelines build on meta and zero3 under "
            "zero.Init; each rank then reads only what it holds from the files. single and ddp load the whole model "
            "(transformers memory-maps safetensors: pages become resident as they are read). Target (issue 22): fsdp, "
            "zero3 and the pipelines at most 0.50 of the weights above the baseline. " + verdict(results, weights)
            + " Where zero3's engine puts the rest: section \"Where zero3's set-up memory goes\" (bench/zero3_setup.py).")
    cmd = (f"python bench/setup_memory.py --nproc {args.nproc} --layers {args.layers} --hidden {args.hidden} "
           f"--vocab {args.vocab} --strategies {args.strategies}")
    write_section("setup", "Set-up memory of a pretrained directory", body, command=cmd, note=note)


if __name__ == "__main__":
    main()
