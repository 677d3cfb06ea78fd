"""Tokenize a local text file or dataset into a token file for `data=tokens` (nanoGPT's .bin: raw uint16/uint32 ids).

    python launch/prepare_tokens.py SOURCE OUT.bin [--tokenizer byte|NAME|DIR] [--model DIR] [--append-eos]
                                    [--split train] [--text-column text]

SOURCE is a local text file, or a local Hugging Face `datasets` dataset: a directory that `save_to_disk`
wrote (a Dataset, or a DatasetDict whose `--split` is taken). A dataset's `--text-column` holds one document
per row; the documents are tokenized one by one and concatenated (with --append-eos, each one ended by the
tokenizer's EOS; with the byte tokenizer, separated by a newline). The tokenizer is `byte` (the bytes themselves, vocabulary 256: what data=textfile
trains on), a local directory holding a Hugging Face tokenizer (`save_pretrained`'s files), or the name of
one already in the local Hugging Face cache. Nothing is downloaded: a tokenizer that is not available
offline is one error line. OUT.json beside OUT.bin records the dtype, the vocabulary size, the tokenizer,
the token count and the largest id; training checks them against the model's vocabulary.

`--model DIR` names the model directory you will train (`model=hf model.path=DIR`): its tokenizer is then the
default.

Then: `python launch/train.py data=tokens data.path=OUT.bin model.vocab_size=<at least the vocabulary>`, or with
your own model `python launch/train.py model=hf model.path=DIR data=tokens data.path=OUT.bin`.
"""

import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

from dist_train.entry import argument_parser, report_config_error  # noqa: E402

USAGE = "python launch/prepare_tokens.py SOURCE OUT.bin [--tokenizer byte|NAME|DIR] [--model DIR] [--append-eos] [--split S] " \
        "[--text-column C]"


def load_tokenizer(name: str):  # type: ignore[no-untyped-def]
    """A Hugging Face tokenizer from a local directory or the local cache; ValueError if neither has it."""
    import os

    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach for the network, even to check for updates
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(name, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ValueError(
            f"--tokenizer={name}: not available offline (no such local directory, and not in the local Hugging Face "
            f"cache); give a directory with the tokenizer's files, or --tokenizer=byte ({type(exc).__name__})"
        ) from exc


def tokenize(documents: list[str], tokenizer_name: str, *, append_eos: bool) -> tuple[list[int] | bytes, int, str]:
    """(token ids of the documents one after the other, vocabulary size, what tokenized them)."""
    if tokenizer_name == "byte":
        return "\n".join(documents).encode("utf-8"), 256, "byte"
    tok = load_tokenizer(tokenizer_name)
    ids: list[int] = []
    for doc in documents:
        ids.extend(tok(doc, add_special_tokens=False)["input_ids"])
        if append_eos and tok.eos_token_id is not None:
            ids.append(tok.eos_token_id)
    return ids, len(tok), getattr(tok, "name_or_path", tokenizer_name)


def model_tokenizer(model: Path | None) -> str:
    """The tokenizer of the model directory you will train (`--model`), else the byte tokenizer. A directory with
    no tokenizer (save_pretrained of a model alone, launch/export.py's output) is refused, never bytes instead:
    byte ids mean nothing to pretrained weights, and they fit any vocabulary, so no later check would stop them."""
    if model is None:
        return "byte"
    if not (model / "tokenizer.json").is_file() and not (model / "tokenizer_config.json").is_file():
        raise ValueError(f"--model={model}: no tokenizer there (tokenizer.json or tokenizer_config.json); copy the "
                         "tokenizer files of the model it came from into it, or pass --tokenizer=DIR with them "
                         "(--tokenizer=byte only for a model that learned bytes)")
    return str(model)


def read_documents(source: Path, *, split: str, text_column: str) -> list[str]:
    """A text file is one document; a `save_to_disk` directory gives its text column's rows. ValueError: why not."""
    if source.is_file():
        return [source.read_text(encoding="utf-8", errors="replace")]
    if not source.is_dir():
        raise ValueError(f"source={source}: no such file or directory")
    import os

    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # a local dataset only: never reach for the Hub
    try:
        import datasets
    except ImportError as exc:
        raise ValueError(f"source={source} is a directory: reading a Hugging Face dataset needs the datasets "
                         "package (pip install datasets)") from exc
    try:
        data = datasets.load_from_disk(str(source))
    except (FileNotFoundError, ValueError) as exc:
        raise ValueError(f"source={source}: not a dataset that datasets' save_to_disk wrote ({type(exc).__name__})") from exc
    if isinstance(data, datasets.DatasetDict):
        if split not in data:
            raise ValueError(f"--split={split}: the dataset has splits {', '.join(data)}")
        data = data[split]
    if text_column not in data.column_names:
        raise ValueError(f"--text-column={text_column}: the dataset's columns are {', '.join(data.column_names)}")
    return [str(t) for t in data[text_column]]


def write(ids: list[int] | bytes, out: Path, *, vocab_size: int, tokenizer: str, source: str) -> dict:
    dtype = "uint16" if vocab_size <= 2**16 else "uint32"
    array = np.frombuffer(ids, dtype=np.uint8).astype(dtype) if isinstance(ids, bytes) else np.asarray(ids, dtype=dtype)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".bin.tmp")
    array.tofile(tmp)
    tmp.replace(out)  # a reader never sees half a file
    # max_id lets training check the ids against the model's vocabulary from this file alone, without reading
    # every token of a file that may hold billions
    meta = {"dtype": dtype, "vocab_size": vocab_size, "tokenizer": tokenizer, "num_tokens": int(array.size),
            "max_id": int(array.max()) if array.size else -1, "source": source}
    out.with_suffix(".json").write_text(json.dumps(meta, indent=2) + "\n")
    return meta


def main() -> int:
    parser = argument_parser(prog="python launch/prepare_tokens.py", doc=__doc__, usage=USAGE, examples=[
                                "python launch/prepare_tokens.py corpus.txt data/corpus.bin  # byte tokens",
                                "python launch/prepare_tokens.py corpus.txt data/corpus.bin --model my_model  "
                                "# the tokenizer of model=hf model.path=my_model",
                                "python launch/prepare_tokens.py my_dataset data/train.bin --tokenizer tok_dir "
                                "--split train --text-column text --append-eos  # a save_to_disk dataset",
                            ])
    parser.add_argument("source", type=Path,
                        help="a local text file, or a directory datasets' save_to_disk wrote")
    parser.add_argument("out", type=Path, help="the token file to write (OUT.bin; OUT.json beside it)")
    parser.add_argument("--tokenizer", default=None,
                        help="byte, a local tokenizer directory, or a cached name (default: --model's, else byte)")
    parser.add_argument("--model", type=Path, default=None, metavar="DIR",
                        help="the model directory you will train (model=hf model.path=DIR): its tokenizer by default "
                             "(default: none)")
    parser.add_argument("--append-eos", action="store_true",
                        help="end each document with the tokenizer's EOS token (default: off)")
    parser.add_argument("--split", default="train", help="a dataset's split (a DatasetDict; default: %(default)s)")
    parser.add_argument("--text-column", default="text", help="a dataset's column of documents (default: %(default)s)")
    args = parser.parse_args()
    if args.out.suffix != ".bin":
        return report_config_error(f"out={args.out}: name the token file *.bin (its metadata goes to *.json)")
    try:
        tokenizer = args.tokenizer or model_tokenizer(args.model)
        documents = read_documents(args.source, split=args.split, text_column=args.text_column)
        ids, vocab, name = tokenize(documents, tokenizer, append_eos=args.append_eos)
    except ValueError as exc:
        return report_config_error(str(exc))
    meta = write(ids, args.out, vocab_size=vocab, tokenizer=name, source=str(args.source))
    how = f"model=hf model.path={args.model}" if args.model is not None else f"model.vocab_size={vocab}"
    print(f"wrote {meta['num_tokens']:,} tokens ({meta['dtype']}, vocabulary {vocab:,}, tokenizer {name}) to "
          f"{args.out}; train with: data=tokens data.path={args.out} {how}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
