"""Real data: launch/prepare_tokens.py with a tokenizer available offline, and the checks of data=tokens."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import torch
import pytest

from dist_train.checks import validate
from dist_train.config import ConfigError
from dist_train.data import TokenFileDataset
from tests.helpers import ROOT, env
from tests.helpers import run_config

TEXT = "It was the best of times, it was the worst of times, it was the age of wisdom. " * 40


def _prepare(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "launch/prepare_tokens.py", *args], cwd=ROOT, env=env(),
                          capture_output=True, text=True, timeout=120)


def _local_tokenizer(directory) -> str:
    """A small BPE tokenizer trained here and saved as transformers saves one: a local tokenizer, no download."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.train_from_iterator([TEXT], trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<eos>"]))
    PreTrainedTokenizerFast(tokenizer_object=bpe, unk_token="<unk>", eos_token="<eos>").save_pretrained(directory)
    return str(directory)


def test_a_local_tokenizer_writes_ids_and_metadata_that_training_reads(tmp_path):
    text, out = tmp_path / "t.txt", tmp_path / "t.bin"
    text.write_text(TEXT)
    proc = _prepare(str(text), str(out), f"--tokenizer={_local_tokenizer(tmp_path / 'tok')}", "--append-eos")
    assert proc.returncode == 0, proc.stderr[-3000:]
    meta = json.loads(out.with_suffix(".json").read_text())
    ids = np.fromfile(out, dtype=meta["dtype"])
    assert meta["dtype"] == "uint16" and meta["num_tokens"] == ids.size and 2 < meta["vocab_size"] <= 300
    assert meta["max_id"] == ids.max()  # training checks the model's vocabulary from this, not by reading the file
    assert ids.size < len(TEXT) / 2 and ids.max() < meta["vocab_size"]  # merges: far fewer tokens than bytes
    assert ids[-1] == 1  # <eos>
    # the dataset reads the same ids, in windows of seq_len + 1
    windows = TokenFileDataset(path=str(out), dtype=meta["dtype"], seq_len=16, seed=0).batch(0, 4)
    assert windows.shape == (4, 17) and int(windows.max()) < meta["vocab_size"]
    # a model whose vocabulary is too small for that tokenizer is refused before anything starts
    _, run = run_config("data=tokens", f"data.path={out}", "model.vocab_size=2", "train.seq_len=16")
    with pytest.raises(ConfigError, match=f"set model.vocab_size={meta['vocab_size']} or more"):
        validate(run, 1)
    _, run = run_config("data=tokens", f"data.path={out}", "model.vocab_size=300", "train.seq_len=16")
    validate(run, 1)


def test_a_tokenizer_not_available_offline_is_one_line(tmp_path):
    text = tmp_path / "t.txt"
    text.write_text(TEXT)
    proc = _prepare(str(text), str(tmp_path / "t.bin"), "--tokenizer=no-such-org/no-such-tokenizer")
    lines = [line for line in proc.stderr.splitlines() if line.startswith("config error:")]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-3000:]
    assert "not available offline" in lines[0] and "Traceback" not in proc.stderr
    assert not (tmp_path / "t.bin").exists()


def test_a_local_datasets_dataset_is_tokenized_document_by_document(tmp_path):
    """A DatasetDict saved with save_to_disk: its split's text column, each document ended by EOS."""
    import datasets

    docs = ["the first document", "and the second one", "a third"]
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"body": docs, "n": [1, 2, 3]}),
                          "test": datasets.Dataset.from_dict({"body": ["held out"], "n": [0]})}).save_to_disk(tmp_path / "ds")
    tok = _local_tokenizer(tmp_path / "tok")
    out = tmp_path / "ds.bin"
    proc = _prepare(str(tmp_path / "ds"), str(out), f"--tokenizer={tok}", "--append-eos", "--text-column=body")
    assert proc.returncode == 0, proc.stderr[-3000:]
    ids = np.fromfile(out, dtype=json.loads(out.with_suffix(".json").read_text())["dtype"]).tolist()
    from transformers import AutoTokenizer

    t = AutoTokenizer.from_pretrained(tok)
    want = [i for d in docs for i in [*t(d, add_special_tokens=False)["input_ids"], t.eos_token_id]]
    assert ids == want  # the train split only, in order, one EOS after each document
    # what main() answers in one line (exit 2), asked in this process: each launch costs seconds of imports
    import importlib.util

    spec = importlib.util.spec_from_file_location("prepare_tokens", ROOT / "launch" / "prepare_tokens.py")
    prepare = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(prepare)
    for source, kw, needle in (("ds", {}, "--text-column=text: the dataset's columns are body, n"),
                               ("ds", {"split": "validation"}, "--split=validation: the dataset has splits train, test"),
                               ("tok", {}, "not a dataset that datasets' save_to_disk wrote"),
                               ("nothing", {}, "no such file or directory")):
        with pytest.raises(ValueError, match=needle):
            prepare.read_documents(tmp_path / source, **{"split": "train", "text_column": "text", **kw})


@pytest.mark.parametrize(
    ("content", "overrides", "needle"),
    [
        (None, [], "data=tokens needs data.path="),
        (b"\x00" * 7, ["data.dtype=uint16"], "not a whole number of uint16 tokens"),
        (b"\x00" * 8, ["data.dtype=uint16"], "holds 4 tokens; train.seq_len=64 needs >= 65"),
        (b"\x00" * 8, ["data.dtype=int8"], "data.dtype='int8' is not supported"),
    ],
)
def test_bad_token_files_are_one_line(tmp_path, content, overrides, needle):
    path = tmp_path / "x.bin"
    if content is not None:
        path.write_bytes(content)
        overrides = [f"data.path={path}", *overrides]
    _, run = run_config("data=tokens", *overrides)
    with pytest.raises(ConfigError) as err:
        validate(run, 1)
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_the_prefetcher_gives_the_same_batches_built_in_its_own_thread(tmp_path):
    """Every step's batch equals the plain one, whether it was prefetched or asked out of order (a resume)."""
    import threading

    from dist_train.data import GlobalBatches, Prefetcher, WindowDataset

    tokens = np.arange(5000, dtype=np.uint16)

    def batches() -> GlobalBatches:
        return GlobalBatches(WindowDataset(tokens, seq_len=16, seed=3), global_batch_size=8, dp_rank=1, dp_size=2)

    builders: list[str] = []
    prefetcher = Prefetcher(batches(), pin=False, last_step=12)
    build = prefetcher._build
    prefetcher._build = lambda step: builders.append(threading.current_thread().name) or build(step)
    plain = batches()
    try:
        for step in [5, 6, 7, 8, 2, 3, 11]:  # a resume at 5, a jump back, the last step
            got, want = prefetcher.local_batch(step), plain.local_batch(step)
            assert torch.equal(got.input_ids, want.input_ids) and torch.equal(got.labels, want.labels), step
    finally:
        prefetcher.close()
    assert sum(name.startswith("dist_train-prefetch") for name in builders) >= 4  # 6, 7, 8 and 3 came ready


@pytest.mark.parametrize("kind", ["windows", "synthetic"])
def test_each_rank_reads_only_its_slice_and_the_slices_are_the_global_batch(kind):
    """Rank r of 4 gets samples [r B/4, (r+1) B/4) of global batch `step`, exactly as cut from the whole batch; from
    a token file it reads only those windows (at 1,024 ranks, 1/1,024 of the batch each, not all of it)."""
    from dist_train.data import GlobalBatches, SyntheticDataset, WindowDataset

    if kind == "windows":
        dataset = WindowDataset(np.arange(5000, dtype=np.uint16), seq_len=16, seed=3)
        read: list[int] = []
        sample = dataset.sample
        dataset.sample = lambda index: read.append(index) or sample(index)
    else:
        dataset = SyntheticDataset(vocab_size=256, seq_len=16, seed=3, noise=0.1)
    whole = dataset.batch(7, 8)
    assert whole.shape == (8, 17)
    for rank in range(4):
        if kind == "windows":
            read.clear()
        local = GlobalBatches(dataset, global_batch_size=8, dp_rank=rank, dp_size=4).local_batch(7)
        assert torch.equal(local.input_ids, whole[2 * rank: 2 * rank + 2, :-1]), rank
        assert torch.equal(local.labels, whole[2 * rank: 2 * rank + 2, 1:]), rank
        if kind == "windows":
            assert read == [7 * 8 + 2 * rank, 7 * 8 + 2 * rank + 1], read
