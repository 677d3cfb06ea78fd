"""Export a dist_train checkpoint (any strategy) as a `transformers` save_pretrained directory.

    python launch/export.py CHECKPOINT OUT_DIR [--merge] [--overwrite]

CHECKPOINT is one checkpoint (`.../checkpoints/step-00000100`) or a directory of them (its newest complete
one). OUT_DIR then loads with `AutoModelForCausalLM.from_pretrained(OUT_DIR)`. An OUT_DIR that already holds files
(another model, the base model the run started from) is refused unless --overwrite is given.

A LoRA run (peft=lora | qlora) is exported as its adapter in peft's format (adapter_config.json +
adapter_model.safetensors: `PeftModel.from_pretrained(base_model, OUT_DIR)`). With --merge the adapters are
folded into the base weights (QLoRA: dequantized to fp32) and OUT_DIR holds that plain model, which
`from_pretrained(OUT_DIR)` and `model=hf model.path=OUT_DIR` load; the adapter then goes to OUT_DIR/adapter.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

from dist_train.entry import argument_parser, report_config_error  # noqa: E402

USAGE = "python launch/export.py CHECKPOINT OUT_DIR [--merge] [--overwrite]"


def main() -> int:
    parser = argument_parser(prog="python launch/export.py", doc=__doc__, usage=USAGE, examples=[
                                "python launch/export.py outputs/fsdp-20261122-080000/checkpoints hf_out",
                                "python launch/export.py outputs/single-20261122-080000/checkpoints/step-00000100 "
                                "hf_out  # one checkpoint",
                                "python launch/export.py outputs/lora-run/checkpoints merged --merge  "
                                "# a LoRA run: the merged model, its adapter in merged/adapter",
                            ])
    parser.add_argument("checkpoint", type=Path,
                        help="a checkpoint (step-NNNNNNNN) or a directory of them (its newest complete one)")
    parser.add_argument("out_dir", type=Path,
                        help="where to write the model (config.json + weights), or a LoRA run's adapter")
    parser.add_argument("--merge", action="store_true",
                        help="a LoRA/QLoRA run: also merge the adapters into the base weights and write that full "
                             "model to OUT_DIR (the adapter then to OUT_DIR/adapter); default: off, the adapter only")
    parser.add_argument("--overwrite", action="store_true",
                        help="write into OUT_DIR even if it holds files: its model and adapter files (config.json, "
                             "weights, adapter_*, OUT_DIR/adapter) are removed first, once every weight is read; "
                             "other files (a tokenizer) stay; default: off, such a directory is refused")
    args = parser.parse_args()
    from dist_train.export import export_pretrained

    try:
        done = export_pretrained(args.checkpoint, args.out_dir, merge=args.merge, overwrite=args.overwrite)
    except ValueError as exc:
        return report_config_error(str(exc))
    print(f"exported {done.checkpoint} -> {describe(done)}")
    return 0


def describe(done) -> str:
    """What was written and how each part loads, on one line."""
    parts = []
    if done.adapter_dir is not None:
        base = f"AutoModelForCausalLM.from_pretrained({done.base!r})" if done.base else \
            "the run's base model (dist_train's model.build_model of its config)"
        parts.append(f"peft={done.peft} adapter {done.adapter_dir} (peft.PeftModel.from_pretrained(base, "
                     f"{str(done.adapter_dir)!r}), base = {base})")
    if done.model_dir is not None:
        what = "merged model" if done.adapter_dir is not None else "model"
        parts.append(f"{what} {done.model_dir} (AutoModelForCausalLM.from_pretrained({str(done.model_dir)!r}); "
                     f"in dist_train: model=hf model.path={done.model_dir})")
    elif done.adapter_dir is not None:
        parts.append("no merged model (add --merge for one)")
    return "; ".join(parts)


if __name__ == "__main__":
    sys.exit(main())
