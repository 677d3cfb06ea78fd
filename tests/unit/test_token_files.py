"""Token files that cannot be right are refused before step 1: text, a size that is no whole number of ids, a
sidecar that disagrees with the file or the model, an id the model's vocabulary lacks (with or without a sidecar).

The scan (dist_train/token_files.py) and the checks, in this process. Five bad files through
`launch/train.py --check-config` as a user runs it: tests/launched/test_token_files.py.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from dist_train import token_files
from dist_train.checks import validate
from dist_train.config import ConfigError
from dist_train.token_files import looks_like_text, max_token_id, scan_max_id
from tests.helpers import run_config
from tests.token_files_support import NOTES, prepare_tokens_module, token_ids


# ---------------------------------------------------------------------------------------------------------------
# the scan and the text test, on their own


@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
@pytest.mark.parametrize("chunk_bytes", [64, 1000, 2**26])
def test_the_scan_finds_the_largest_id_whatever_the_chunks(tmp_path, dtype, chunk_bytes):
    path = tmp_path / "t.bin"
    ids = token_ids(largest=60_000, count=1001).astype(dtype)
    ids.tofile(path)
    assert scan_max_id(str(path), dtype=dtype, chunk_bytes=chunk_bytes) == 60_000 == int(ids.max())
    with open(path, "ab") as f:  # a trailing partial id is not an id
        f.write(b"\xff")
    assert scan_max_id(str(path), dtype=dtype, chunk_bytes=chunk_bytes) == 60_000
    path.write_bytes(b"")
    assert scan_max_id(str(path), dtype=dtype, chunk_bytes=chunk_bytes) == -1


def test_a_file_is_scanned_once_per_process_and_again_when_it_changes(tmp_path, monkeypatch):
    path = tmp_path / "t.bin"
    token_ids(largest=300).astype(np.uint16).tofile(path)
    scans: list[str] = []
    scan, notes = token_files.scan_max_id, []
    monkeypatch.setattr(token_files, "scan_max_id", lambda p, **kw: scans.append(p) or scan(p, **kw))
    monkeypatch.setattr(token_files, "LONG_SCAN_BYTES", 1000)  # this 1,000-byte file counts as a long scan
    assert max_token_id(str(path), dtype="uint16", announce=notes.append) == 300
    assert max_token_id(str(path), dtype="uint16", announce=notes.append) == 300
    assert len(scans) == 1 and len(notes) == 1 and f"{path} has no max_id in a sidecar" in notes[0]
    assert max_token_id(str(path), dtype="uint32", announce=None) > 2**16  # another dtype is another scan
    token_ids(largest=400, count=600).astype(np.uint16).tofile(path)  # rewritten: another size
    assert max_token_id(str(path), dtype="uint16") == 400 and len(scans) == 3


def test_text_looks_like_text_and_token_ids_do_not(tmp_path):
    def file(name: str, data: bytes) -> str:
        (tmp_path / name).write_bytes(data)
        return str(tmp_path / name)

    assert looks_like_text(file("notes.txt", NOTES.encode()))
    assert looks_like_text(file("euros.txt", ("€" * 3000).encode()))  # 4,096 bytes cut a 3-byte character
    byte_ids = np.frombuffer(NOTES.encode(), dtype=np.uint8)
    assert not looks_like_text(file("bytes16.bin", byte_ids.astype(np.uint16).tobytes()))  # the byte tokenizer's
    assert not looks_like_text(file("bytes32.bin", byte_ids.astype(np.uint32).tobytes()))
    for seed in range(20):  # ids of a GPT-2-sized vocabulary, uniform and Zipf-like (frequent ids are small)
        rng = np.random.default_rng(seed)
        uniform = rng.integers(0, 50257, size=4096).astype(np.uint16)
        zipf = np.minimum(rng.zipf(1.2, size=4096), 50256).astype(np.uint16)
        assert not looks_like_text(file("uniform.bin", uniform.tobytes())), seed
        assert not looks_like_text(file("zipf.bin", zipf.tobytes())), seed
    assert not looks_like_text(file("latin1.txt", ("Café crème. " * 400).encode("latin-1")))  # not UTF-8
    assert not looks_like_text(file("empty.bin", b""))


# ---------------------------------------------------------------------------------------------------------------
# the checks, in this process


def _refused(*overrides: str) -> str:
    _, run = run_config(*overrides)
    with pytest.raises(ConfigError) as err:
        validate(run, 1)
    assert "\n" not in str(err.value)
    return str(err.value)


def test_a_sidecars_max_id_is_used_and_the_file_is_scanned_without_one(tmp_path, monkeypatch):
    path = tmp_path / "t.bin"
    meta = prepare_tokens_module().write(token_ids(largest=255).tolist(), path, vocab_size=256, tokenizer="t",
                                         source="s")
    assert meta["max_id"] == 255 and json.loads(path.with_suffix(".json").read_text())["max_id"] == 255
    scans: list[str] = []
    scan = token_files.scan_max_id
    monkeypatch.setattr(token_files, "scan_max_id", lambda p, **kw: scans.append(p) or scan(p, **kw))
    _, run = run_config("data=tokens", f"data.path={path}")
    validate(run, 1)
    assert scans == []  # the sidecar said
    path.with_suffix(".json").write_text(json.dumps({k: v for k, v in meta.items() if k != "max_id"}))
    validate(run, 1)  # an older sidecar: the file is read
    assert scans == [str(path)]
    # a sidecar whose max_id is beyond the model's vocabulary (its own vocab_size fits)
    path.with_suffix(".json").write_text(json.dumps({**meta, "max_id": 256}))
    said = _refused("data=tokens", f"data.path={path}")
    assert said.startswith(f"data.path='{path}' holds token id 256 (read as uint16) but model.vocab_size=256; set "
                           "model.vocab_size=257 or more")


def test_a_sidecar_that_disagrees_names_both_sides(tmp_path):
    path, sidecar = tmp_path / "t.bin", tmp_path / "t.json"
    token_ids(largest=100).astype(np.uint16).tofile(path)
    base = {"dtype": "uint16", "vocab_size": 256, "num_tokens": 500, "max_id": 100}
    for meta, overrides, says in [
        ({**base}, ["data.dtype=uint32"], f"data.dtype=uint32 but {sidecar} says the file holds uint16 ids"),
        ({**base, "dtype": "int32"}, [], f"{sidecar} says dtype='int32'; a token file holds uint16 or uint32 ids"),
        ({**base, "vocab_size": 100_000}, [], f"{sidecar} says dtype=uint16 but vocab_size=100000: ids up to 99999"),
        ({**base, "num_tokens": 250}, [], f"has 1,000 bytes but its sidecar {sidecar} says 250 uint16 tokens (500 b"),
        ({**base, "vocab_size": 300, "tokenizer": "tok"}, [],
         "was tokenized with 'tok' (300 tokens) but model.vocab_size=256; set model.vocab_size=300 or more"),
    ]:
        sidecar.write_text(json.dumps(meta))
        assert says in _refused("data=tokens", f"data.path={path}", *overrides)
    sidecar.write_text("{not json")
    assert f"{sidecar} (the sidecar of {path}) is not JSON" in _refused("data=tokens", f"data.path={path}")


def test_eval_path_gets_the_same_checks(tmp_path):
    train, held_out = tmp_path / "train.bin", tmp_path / "eval.bin"
    token_ids(largest=100).astype(np.uint16).tofile(train)
    token_ids(largest=999).astype(np.uint16).tofile(held_out)
    said = _refused("data=tokens", f"data.path={train}", "eval.every_steps=5", f"eval.path={held_out}")
    assert said.startswith(f"eval.path='{held_out}' holds token id 999 (read as uint16) but model.vocab_size=256")


def test_a_model_directorys_vocabulary_is_the_one_checked(tmp_path):
    """model=hf: the vocabulary comes from model.path's config.json (resolved before the data checks)."""
    from transformers import GPT2Config

    GPT2Config(vocab_size=128, n_layer=1, n_embd=32, n_head=2, n_positions=128).save_pretrained(tmp_path / "m")
    path = tmp_path / "t.bin"
    token_ids(largest=200).astype(np.uint16).tofile(path)
    said = _refused("model=hf", f"model.path={tmp_path / 'm'}", "data=tokens", f"data.path={path}")
    assert said == (f"data.path='{path}' holds token id 200 (read as uint16) but model.path={tmp_path / 'm'} has 128 "
                    "tokens (its config.json); tokenize the text with its tokenizer: python launch/prepare_tokens.py "
                    f"SOURCE OUT.bin --model {tmp_path / 'm'}")


def test_byte_tokens_are_refused_for_pretrained_weights_that_learned_another_tokenizer(tmp_path):
    """Byte ids fit any vocabulary, so no id check stops them: a byte token file, or data=textfile, given to a
    pretrained model directory with a large vocabulary is refused; the same directory trained from scratch is not."""
    from transformers import GPT2Config, GPT2LMHeadModel

    model = tmp_path / "m"
    GPT2LMHeadModel(GPT2Config(vocab_size=2048, n_layer=1, n_embd=32, n_head=2, n_positions=128)).save_pretrained(model)
    notes = tmp_path / "notes.txt"
    notes.write_text(NOTES)
    tokens = tmp_path / "bytes.bin"
    prepare_tokens_module().write(NOTES.encode(), tokens, vocab_size=256, tokenizer="byte", source=str(notes))
    for data in (["data=textfile", f"data.path={notes}"], ["data=tokens", f"data.path={tokens}"]):
        said = _refused("model=hf", f"model.path={model}", *data)
        assert f"with the pretrained weights of model.path={model} (2048 tokens)" in said, said
        assert f"python launch/prepare_tokens.py SOURCE OUT.bin --model {model}" in said
        _, run = run_config("model=hf", f"model.path={model}", "model.init=random", *data)
        validate(run, 1)  # from scratch, bytes are a choice
