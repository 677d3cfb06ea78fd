"""Deterministic data: global batch `step` depends only on the seed, the step and the batch size.

Every rank takes its data-parallel slice of the same global batch, so one config and seed trains on the
same samples in the same order whatever the strategy or world size. Synthetic batches are drawn in one go
per global batch (one generator seeded by the step: a few tensor ops, whatever the batch size) and sliced; a
text file's (bytes) or a token file's (nanoGPT's .bin, memory-mapped) windows are cut from a per-epoch
shuffle, and a rank reads only its slice's windows.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from dist_train.config import DataConfig, EvalConfig
from dist_train.data_checks import token_file_meta
from dist_train.contracts import Batch


class Dataset(Protocol):
    def batch(self, step: int, size: int, *, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """Tokens of samples [start, stop) of global batch `step` of `size` samples (all of them by default):
        int64 [stop - start, seq_len + 1]. A rank asks for its own slice only."""


class SyntheticDataset:
    """Learnable sequences: token k = (first + stride * k) mod vocab, with some tokens replaced by noise."""

    def __init__(self, *, vocab_size: int, seq_len: int, seed: int, noise: float) -> None:
        self.vocab_size, self.seq_len, self.seed, self.noise = vocab_size, seq_len, seed, noise

    def batch(self, step: int, size: int, *, start: int = 0, stop: int | None = None) -> torch.Tensor:
        # one generator stream per global batch: a slice is cut from the whole (cheap: generated, not read)
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        length = self.seq_len + 1
        first = torch.randint(self.vocab_size, (size, 1), generator=g)
        stride = torch.randint(1, 8, (size, 1), generator=g)
        tokens = (first + stride * torch.arange(length)) % self.vocab_size
        flip = torch.rand(size, length, generator=g) < self.noise
        random = torch.randint(self.vocab_size, (size, length), generator=g)
        return torch.where(flip, random, tokens).long()[start:stop]


class WindowDataset:
    """Windows of seq_len + 1 tokens cut from one token sequence (a numpy array, possibly memory-mapped: only
    the windows a batch needs are read); their order shuffled per epoch by the seed."""

    def __init__(self, tokens: np.ndarray, *, seq_len: int, seed: int) -> None:
        self.tokens, self.seq_len, self.seed = tokens, seq_len, seed
        self.num_windows = (len(tokens) - 1) // seq_len
        self._orders: dict[int, torch.Tensor] = {}

    def _order(self, epoch: int) -> torch.Tensor:
        if epoch not in self._orders:
            g = torch.Generator().manual_seed(self.seed * 7919 + epoch)
            self._orders = {epoch: torch.randperm(self.num_windows, generator=g)}
        return self._orders[epoch]

    def sample(self, index: int) -> torch.Tensor:
        epoch, pos = divmod(index, self.num_windows)
        start = int(self._order(epoch)[pos]) * self.seq_len
        return torch.from_numpy(self.tokens[start : start + self.seq_len + 1].astype(np.int64))

    def batch(self, step: int, size: int, *, start: int = 0, stop: int | None = None) -> torch.Tensor:
        # only the slice's windows are read: at 1,024 ranks each reads 1/1,024 of the global batch from the file
        return torch.stack([self.sample(step * size + i) for i in range(start, size if stop is None else stop)])


def _file_tokens(kind: str, path: str, dtype: str | None) -> np.ndarray:
    """A text file's bytes, or a token file's ids memory-mapped."""
    if kind == "textfile":
        return np.frombuffer(Path(path).read_bytes(), dtype=np.uint8)
    return np.memmap(path, dtype=np.dtype(dtype or token_file_meta(path).get("dtype", "uint16")), mode="r")


class TextFileDataset(WindowDataset):
    """Byte-level tokens of a local text file (vocabulary 256)."""

    def __init__(self, *, path: str, seq_len: int, seed: int) -> None:
        super().__init__(_file_tokens("textfile", path, None), seq_len=seq_len, seed=seed)


class TokenFileDataset(WindowDataset):
    """A token file as nanoGPT writes it (`launch/prepare_tokens.py` too): raw uint16 or uint32 token ids,
    memory-mapped, so a file larger than memory costs only the windows each batch reads."""

    def __init__(self, *, path: str, dtype: str | None, seq_len: int, seed: int) -> None:
        super().__init__(_file_tokens("tokens", path, dtype), seq_len=seq_len, seed=seed)


class HeldOutStream:
    """Synthetic data's held-out batches: the same distribution, from generator streams training never draws
    (batch i is the dataset's batch -(i + 1))."""

    def __init__(self, dataset: SyntheticDataset) -> None:
        self.dataset = dataset

    def batch(self, step: int, size: int, *, start: int = 0, stop: int | None = None) -> torch.Tensor:
        return self.dataset.batch(-(step + 1), size, start=start, stop=stop)


def build_dataset(cfg: DataConfig, *, vocab_size: int, seq_len: int, seed: int) -> Dataset:
    """The training data, whole (no evaluation split)."""
    return build_datasets(cfg, None, vocab_size=vocab_size, seq_len=seq_len, seed=seed)[0]


def build_datasets(cfg: DataConfig, evaluation: EvalConfig | None, *, vocab_size: int, seq_len: int,
                   seed: int) -> tuple[Dataset, Dataset | None]:
    """(training data, held-out data or None). With evaluation on and no eval.path, a file's last eval.holdout
    fraction is held out (training reads the rest); synthetic data holds out streams of its own."""
    on = evaluation is not None and evaluation.every_steps > 0
    if cfg.name == "synthetic":
        train = SyntheticDataset(vocab_size=vocab_size, seq_len=seq_len, seed=seed, noise=cfg.noise)
        return train, HeldOutStream(train) if on else None
    assert cfg.path is not None  # validated before start-up
    kind = cfg.name
    if not on:
        if kind == "textfile":
            return TextFileDataset(path=cfg.path, seq_len=seq_len, seed=seed), None
        return TokenFileDataset(path=cfg.path, dtype=cfg.dtype, seq_len=seq_len, seed=seed), None
    assert evaluation is not None
    tokens = _file_tokens(kind, cfg.path, cfg.dtype)
    if evaluation.path is not None:
        held_out = _file_tokens(kind, evaluation.path, cfg.dtype)
    else:
        cut = len(tokens) - int(len(tokens) * evaluation.holdout)
        tokens, held_out = tokens[:cut], tokens[cut:]
    return WindowDataset(tokens, seq_len=seq_len, seed=seed), WindowDataset(held_out, seq_len=seq_len, seed=seed)


class GlobalBatches:
    """Rank r of D takes the r-th contiguous slice of global batch `step` (B samples)."""

    def __init__(self, dataset: Dataset, *, global_batch_size: int, dp_rank: int, dp_size: int) -> None:
        assert global_batch_size % dp_size == 0
        self.dataset = dataset
        self.global_batch_size = global_batch_size
        self.local_batch_size = global_batch_size // dp_size
        self.first = dp_rank * self.local_batch_size

    def local_batch(self, step: int) -> Batch:
        tokens = self.dataset.batch(step, self.global_batch_size, start=self.first,
                                    stop=self.first + self.local_batch_size)
        return Batch(input_ids=tokens[:, :-1].contiguous(), labels=tokens[:, 1:].contiguous())


class Prefetcher:
    """The next step's batch, built in a background thread while this step trains.

    The batch is sliced (and, for a token file, read from the memory map) off the training thread; on CUDA
    it is also copied into pinned host memory there, so that `Batch.to` issues a non-blocking copy that
    overlaps the step. Batches are a pure function of the step, so prefetching changes no sample: a request
    for another step than the one prefetched (the first step after a resume) is built in place, after any
    build in flight, so that the dataset is never used from two threads at once."""

    def __init__(self, batches: GlobalBatches, *, pin: bool, last_step: int) -> None:
        from concurrent.futures import ThreadPoolExecutor

        self.batches, self.pin, self.last_step = batches, pin, last_step
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dist_train-prefetch")
        self._pending: tuple[int, Any] | None = None  # (step, Future)

    def local_batch(self, step: int) -> Batch:
        pending, self._pending = self._pending, None
        ready = pending[1].result() if pending is not None else None  # re-raises a failed build here
        batch = ready if pending is not None and pending[0] == step else self._build(step)
        if step + 1 < self.last_step:  # steps are 0-based here: the loop asks for step - 1
            self._pending = (step + 1, self._pool.submit(self._build, step + 1))
        return batch

    def _build(self, step: int) -> Batch:
        batch = self.batches.local_batch(step)
        return batch.pinned() if self.pin else batch

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
