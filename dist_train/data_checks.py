"""The data a run reads, checked before any process starts: data.name and its path (a token file's size, dtype,
sidecar and largest id against the model's vocabulary; a text file given to data=tokens; a text file's length),
and the held-out data of eval. One ConfigError line each, as every other check.

config.validate_fields judges the config's values on their own; these open the files they name. The pre-flight
check (dist_train.checks) and the estimator's composition (estimate/compose.py) run both."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

from dist_train.config import RunConfig, choice, require
from dist_train.errors import ConfigError
from dist_train.token_files import ITEM_BYTES, looks_like_text, max_token_id


def validate_data(run: RunConfig) -> None:
    """data.* and eval.*, with the files they name (ConfigError, one line)."""
    _validate_data(run)
    _validate_eval(run)


TOKEN_DTYPES = tuple(ITEM_BYTES)


def token_file_meta(path: str) -> dict[str, Any]:
    """The JSON beside a token file (`x.bin` -> `x.json`: dtype, vocab_size, tokenizer, num_tokens, max_id), or {}
    where there is none (nanoGPT's files). ConfigError if it is there but not a JSON object."""
    sidecar = Path(path).with_suffix(".json")
    if not sidecar.is_file():
        return {}
    try:
        meta = json.loads(sidecar.read_text())
    except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError both are
        raise ConfigError(f"{sidecar} (the sidecar of {path}) is not JSON ({exc}); launch/prepare_tokens.py writes "
                          "both files again, or remove it to read the file as uint16 ids") from exc
    require(isinstance(meta, dict), f"{sidecar} (the sidecar of {path}) is not a JSON object")
    return meta


def _validate_token_file(run: RunConfig) -> None:
    d = run.data
    require(bool(d.path), "data=tokens needs data.path=/path/to/tokens.bin (launch/prepare_tokens.py writes one)")
    _check_token_file(run, key="data.path", path=d.path)


def _check_token_file(run: RunConfig, *, key: str, path: str) -> None:
    """A token file against the model, before step 1: not text, a whole number of ids of its dtype (data.dtype,
    else the sidecar's, else uint16), as many as its sidecar says, one sample at least, and no id the model's
    vocabulary lacks (the sidecar's max_id, else a scan of the whole file)."""
    require(os.path.isfile(path), f"{key}={path!r} is not a readable file")
    require(not looks_like_text(path), _text_file_message(run, key=key, path=path))
    meta = token_file_meta(path)
    if meta.get("tokenizer") == "byte":
        _refuse_bytes_for_pretrained(run, what=f"{key}={path!r} (byte tokens, says its sidecar)")
    dtype = _token_dtype(run.data.dtype, meta, path=path)
    itemsize, size = ITEM_BYTES[dtype], os.path.getsize(path)
    require(size % itemsize == 0, f"{key}={path!r} has {size} bytes, not a whole number of {dtype} tokens "
                                  f"({itemsize} bytes each): a file cut short, or not a token file")
    count = meta.get("num_tokens")
    if count is not None:
        require(count * itemsize == size,
                f"{key}={path!r} has {size:,} bytes but its sidecar {Path(path).with_suffix('.json')} says {count:,} "
                f"{dtype} tokens ({count * itemsize:,} bytes): the sidecar's dtype is wrong or the file changed since; "
                "write both again with launch/prepare_tokens.py")
    need = run.train.seq_len + 1
    require(size // itemsize >= need,
            f"{key}={path!r} holds {size // itemsize} tokens; train.seq_len={run.train.seq_len} needs >= {need}")
    vocab = meta.get("vocab_size")
    require(vocab is None or vocab <= run.model.vocab_size,
            f"{key}={path!r} was tokenized with {meta.get('tokenizer')!r} ({vocab} tokens) but "
            f"{_vocab_fix(run, need=vocab or 0)}")
    largest = meta["max_id"] if count is not None and isinstance(meta.get("max_id"), int) else \
        max_token_id(path, dtype=dtype, announce=_announce)
    require(largest < run.model.vocab_size,
            f"{key}={path!r} holds token id {largest} (read as {dtype}) but {_vocab_fix(run, need=largest + 1)}")


def _token_dtype(configured: str | None, meta: dict[str, Any], *, path: str) -> str:
    """data.dtype, else the sidecar's, else uint16 (nanoGPT's); ConfigError where the two disagree, or the
    sidecar's cannot hold its own vocabulary."""
    written, sidecar = meta.get("dtype"), Path(path).with_suffix(".json")
    if written is not None:
        require(written in TOKEN_DTYPES, f"{sidecar} says dtype={written!r}; a token file holds "
                                         f"{' or '.join(TOKEN_DTYPES)} ids")
        require(configured in (None, written), f"data.dtype={configured} but {sidecar} says the file holds {written} "
                                               "ids; leave data.dtype unset to read it as its sidecar says")
        vocab = meta.get("vocab_size")
        require(written != "uint16" or vocab is None or vocab <= 2**16,
                f"{sidecar} says dtype=uint16 but vocab_size={vocab}: ids up to {vocab - 1 if vocab else 0} do not "
                "fit in 16 bits; write both files again with launch/prepare_tokens.py")
    dtype = configured or written or "uint16"
    choice("data.dtype", dtype, TOKEN_DTYPES)
    return dtype


def _vocab_fix(run: RunConfig, *, need: int) -> str:
    """`the model's vocabulary; how to make ids up to need - 1 fit`, for a preset or a model directory."""
    m = run.model
    if m.path is not None:  # the vocabulary is the directory's (config.json): its own tokenizer fits it
        return (f"model.path={m.path} has {m.vocab_size} tokens (its config.json); tokenize the text with its "
                f"tokenizer: python launch/prepare_tokens.py SOURCE OUT.bin --model {m.path}")
    return f"model.vocab_size={m.vocab_size}; set model.vocab_size={need} or more"


def _text_file_message(run: RunConfig, *, key: str, path: str) -> str:
    out = Path(path).with_suffix(".bin")
    if out == Path(path):
        out = out.with_name(f"{out.stem}-tokens.bin")
    tokenizer = f"--model {run.model.path}" if run.model.path is not None else "--model DIR (or --tokenizer byte)"
    return (f"{key}={path!r} looks like text, not token ids; tokenize it first with python launch/prepare_tokens.py "
            f"{path} {out} {tokenizer}, then pass {key}={out} (or train on its bytes with data=textfile)")


def _announce(line: str) -> None:
    """A pre-flight note on stderr, from one process of a launch (every rank runs the checks)."""
    if os.environ.get("RANK", "0") == "0":
        print(line, file=sys.stderr, flush=True)


def _validate_eval(run: RunConfig) -> None:
    e, d = run.eval, run.data
    require(e.every_steps >= 0, f"eval.every_steps={e.every_steps} must be >= 0 (0 = never)")
    require(e.batches >= 1, f"eval.batches={e.batches} must be >= 1")
    require(0 < e.holdout < 1, f"eval.holdout={e.holdout} must be in (0, 1): the fraction of data.path held out")
    if e.path is not None:
        require(d.name != "synthetic", f"eval.path={e.path!r} is a file of the same kind as data.path, but "
                                       "data=synthetic reads none (its held-out batches are a stream of their own)")
        require(os.path.isfile(e.path), f"eval.path={e.path!r} is not a readable file")
        if d.name == "tokens" and e.every_steps:  # read as data.path is: the same checks against the model
            _check_token_file(run, key="eval.path", path=e.path)
    elif e.every_steps and d.name != "synthetic" and d.path and os.path.isfile(d.path):
        seq, size = run.train.seq_len + 1, os.path.getsize(d.path)
        tokens = size if d.name == "textfile" else size // (4 if (d.dtype or token_file_meta(d.path).get("dtype")) == "uint32" else 2)
        require(int(tokens * e.holdout) >= seq,
                f"eval.holdout={e.holdout} of data.path={d.path!r} is {int(tokens * e.holdout)} tokens, fewer than one "
                f"sample of train.seq_len + 1 = {seq}; raise eval.holdout or pass eval.path=FILE")


def _validate_data(run: RunConfig) -> None:
    d = run.data
    choice("data.name", d.name, ("synthetic", "textfile", "tokens"))
    if d.name != "tokens":
        require(d.dtype is None, f"data.dtype={d.dtype} is read only by data=tokens (a token file); data={d.name} "
                                 "has no dtype to set")
    if d.name == "synthetic":
        require(d.path is None, f"data.path={d.path} is set but data=synthetic reads no file; pick data=tokens (a token "
                                "file from launch/prepare_tokens.py) or data=textfile (a text file, byte-level tokens)")
        require(0 <= d.noise <= 1, f"data.noise={d.noise} must be in [0, 1]")
        return
    if d.name == "tokens":
        _validate_token_file(run)
        return
    require(bool(d.path), "data=textfile needs data.path=/path/to/file.txt (a local text file)")
    require(os.path.isfile(d.path), f"data.path={d.path!r} is not a readable file")
    size = os.path.getsize(d.path)
    need = run.train.seq_len + 1
    require(size >= need, f"data.path={d.path!r} has {size} bytes; train.seq_len={run.train.seq_len} needs >= {need}")
    require(
        run.model.vocab_size >= 256,
        f"data=textfile uses a byte-level tokenizer (256 tokens) but model.vocab_size={run.model.vocab_size}; "
        "set model.vocab_size=256 or more",
    )
    _refuse_bytes_for_pretrained(run, what="data=textfile (its bytes as token ids)")


# A pretrained vocabulary this large is not bytes: byte ids fit it, so no id check would stop them.
BYTE_VOCAB_LIMIT = 1024


def _refuse_bytes_for_pretrained(run: RunConfig, *, what: str) -> None:
    """Byte tokens fed to pretrained weights that learned another tokenizer: they fit any vocabulary and train on
    meaningless ids without a word, so they are refused (a model of its own, model.init=random, may learn bytes)."""
    m = run.model
    require(
        not (m.path is not None and m.init == "pretrained" and m.vocab_size > BYTE_VOCAB_LIMIT),
        f"{what} with the pretrained weights of model.path={m.path} ({m.vocab_size} tokens): those weights learned "
        f"their own tokenizer; tokenize with it: python launch/prepare_tokens.py SOURCE OUT.bin --model {m.path}, "
        "then data=tokens data.path=OUT.bin (or model.init=random to learn bytes from scratch)",
    )
