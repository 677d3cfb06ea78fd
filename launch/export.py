"""Export a dist_train checkpoint (any strategy) as a `transformers` save_pretrained directory.

    python launch/export.py CHECKPOINT OUT_DIR

CHECKPOINT is one checkpoint (`.../checkpoints/step-00000100`) or a directory of them (its newest complete
one). OUT_DIR then loads with `AutoModelForCausalLM.from_pretrained(OUT_DIR)`.
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

from dist_train.entry import report_config_error  # noqa: E402


class _OneLineParser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse prints usage + error; one line is enough
        sys.exit(report_config_error(f"{message} (usage: python launch/export.py CHECKPOINT OUT_DIR)"))


def main() -> int:
    parser = _OneLineParser(description=__doc__.strip().splitlines()[0])
    parser.add_argument("checkpoint", type=Path, help="a checkpoint (step-NNNNNNNN) or a directory of them")
    parser.add_argument("out_dir", type=Path, help="where to write config.json and the weights")
    args = parser.parse_args()
    from dist_train.export import export_pretrained

    try:
        source = export_pretrained(args.checkpoint, args.out_dir)
    except ValueError as exc:
        return report_config_error(str(exc))
    print(f"exported {source} -> {args.out_dir} (AutoModelForCausalLM.from_pretrained({str(args.out_dir)!r}))")
    return 0


if __name__ == "__main__":
    sys.exit(main())
