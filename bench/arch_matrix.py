"""Every architecture under every strategy: the first step's loss of a pretrained directory against transformers'.

    python bench/arch_matrix.py                                   # writes the 'arch-matrix' section of docs/BENCHMARKS.md
    python bench/arch_matrix.py --archs llama,gemma --strategies fsdp,tp
    python bench/arch_matrix.py --archs phi3,stablelm --section arch-matrix-more   # a section of its own

For each architecture the tests use (Llama with its weights in 9 safetensors shards, Mistral, Qwen2, Qwen3, Gemma,
GPT-2 with tied embeddings; and, asked by name, Phi-3 with its fused projections and StableLM, which has neither a
pipeline nor a tensor-parallel plan in transformers; tests/own_model_support.py makes the directories with
`save_pretrained`), trains one step
of `model=hf model.path=DIR` under each strategy and compares its first loss with
`AutoModelForCausalLM.from_pretrained` on the same batch (fp32, relative 1e-5: the target of issue 22), the global batch pinned at 4 sequences for every world size. The suite
runs a sample of these pairs end to end and the rest part by part; this runs them all (about 20 minutes on 2 CPU
cores). A strategy that refuses an architecture shows its one-line reason.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import PYTHON, ROOT, TORCHRUN, env, md_table, write_section  # noqa: E402

# Processes per strategy: 2, except what needs a 2 x 2 mesh, and what runs in one process.
NPROC = {"single": 0, "dp": 0, "pp_dp": 4, "fsdp_tp": 4, "hsdp": 4}
STRATEGIES = ["single", "dp", "ddp", "accelerate", "fsdp", "hsdp", "zero1", "zero2", "zero3", "gpipe", "1f1b", "pp_dp",
              "tp", "fsdp_tp"]
TOLERANCE = 1e-5
# hsdp's default is one replica per node: on one machine, 2 replicas x 2 shards asked for; its 4 data-parallel ranks
# take the global batch of 4 one sequence each
EXTRA = {"hsdp": ["strategy.replicate=2", "train.micro_batch_size=1"]}


def first_loss(strategy: str, model_dir: Path, run_dir: Path, seq: int) -> tuple[float | None, str]:
    """(the first step's loss, '') or (None, the run's one-line reason)."""
    nproc = NPROC.get(strategy, 2)
    launcher = [PYTHON] if nproc == 0 else [*TORCHRUN, f"--nproc_per_node={nproc}"]
    cmd = [*launcher, "launch/train.py", f"strategy={strategy}", "model=hf", f"model.path={model_dir}", "logger=none",
           "train.steps=1", "train.log_every=1", f"train.seq_len={seq}", "train.global_batch_size=4",
           f"hydra.run.dir={run_dir}", *EXTRA.get(strategy, [])]
    proc = subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        lines = ([ln for ln in proc.stderr.splitlines() if ln.startswith("config error:")]
                 or [ln for ln in proc.stderr.splitlines() if "error" in ln.lower()] or proc.stderr.splitlines() or ["?"])
        return None, lines[-1][:160]
    return json.loads((run_dir / "summary.json").read_text())["losses"][0], ""


def main() -> None:
    from tests.own_model_support import ARCHS, SEQ, make_model_dir, reference_loss

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--archs", default=",".join(ARCHS))
    parser.add_argument("--strategies", default=",".join(STRATEGIES))
    parser.add_argument("--section", default="arch-matrix", help="the section of docs/BENCHMARKS.md it writes")
    args = parser.parse_args()
    archs, strategies = args.archs.split(","), args.strategies.split(",")
    scratch = Path(tempfile.mkdtemp(prefix="dist_train_archs_"))
    rows, failures = [], 0
    for arch in archs:
        d = make_model_dir(scratch, arch, shard=arch == "llama", tie=arch == "gpt2")
        reference = reference_loss(d, global_batch=4)
        cells = []
        for strategy in strategies:
            loss, reason = first_loss(strategy, d, scratch / f"{arch}-{strategy}", SEQ)
            if loss is None:
                cells.append(f"refused: {reason}")
                failures += 1
                continue
            diff = abs(loss - reference) / abs(reference)
            cells.append(f"{'ok' if diff <= TOLERANCE else 'OFF'} {diff:.0e}")
            failures += diff > TOLERANCE
        rows.append([arch, f"{reference:.6f}", *cells])
        print(md_table(["architecture", "transformers' loss", *strategies], rows[-1:]), flush=True)
    body = md_table(["architecture", "transformers' loss", *strategies], rows)
    note = ("Each cell: the relative difference between the strategy's first logged loss and transformers' "
            f"(`from_pretrained`, fp32, the same first global batch of 4 sequences of {SEQ} tokens), 'ok' within "
            f"{TOLERANCE:g}. 2 processes per strategy (gloo, CPU); single and dp 1; pp_dp, fsdp_tp and hsdp 4 (a 2 x 2 "
            "mesh; hsdp with strategy.replicate=2 and micro-batches of 1). "
            f"{failures} of {len(rows) * len(strategies)} pairs off or refused.")
    cmd = f"python bench/arch_matrix.py --archs {args.archs} --strategies {args.strategies}"
    if args.section != "arch-matrix":
        cmd += f" --section {args.section}"
    title = "Every architecture under every strategy" + ("" if args.section == "arch-matrix" else f" ({args.archs})")
    write_section(args.section, title, body, command=cmd, note=note)
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
