"""Packed causal-LM data: corpus -> byte-level BPE -> fixed-length chunks -> micro-batches.

Every rank of a pipeline calls ``build_lm_dataset`` with the same arguments and gets a
bit-identical dataset (the first stage feeds ``input_ids``, the last stage scores ``labels``),
then iterates ``MicroBatches`` with its own data-parallel rank. The corpus is read by `corpus` (local
files, by default this interpreter's standard library), tokenized and cached by `tokens`; this
module packs the token stream into a dataset and deals it out as micro-batches.

    ds = build_lm_dataset("stdlib", vocab_size=4096, seq_len=128, seed=0, cache_dir=".cache/mpt")
    batches = MicroBatches(ds, micro_batch_size=8, dp_rank=0, dp_size=1, seed=0)
    input_ids, labels = next(batches)  # (8, 128) int64 each; labels[:, t] == input_ids[:, t + 1]
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

import datasets
import numpy as np
import torch
import torch.distributed as dist

from mp_toolkit.data.buckets import cut, drawn_bucket
from mp_toolkit.data.corpus import read_texts, stdlib_files
from mp_toolkit.data.tokens import cache_key, token_stream, tokenized_stream, train_tokenizer
from mp_toolkit.errors import DataError

SYNTHETIC_SEQUENCES = 4096


def _synthetic_dataset(vocab_size: int, seq_len: int, seed: int, tokens: int) -> datasets.Dataset:
    n = tokens // (seq_len + 1)
    if n == 0:
        raise DataError(f"synthetic_tokens={tokens} is less than one sequence of {seq_len + 1} tokens")
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab_size, (n, seq_len + 1), generator=g, dtype=torch.int64)
    return datasets.Dataset.from_dict({"input_ids": ids.numpy()})


def _packed_dataset(stream: np.ndarray, seq_len: int) -> datasets.Dataset:
    """Cut the token stream into contiguous chunks of seq_len + 1, dropping the remainder."""
    n = len(stream) // (seq_len + 1)
    if n == 0:
        raise DataError(
            f"corpus has {len(stream)} tokens, fewer than one sequence of {seq_len + 1}: "
            f"lower seq_len or add text"
        )
    chunks = stream[: n * (seq_len + 1)].reshape(n, seq_len + 1)  # (N, T + 1)
    return datasets.Dataset.from_dict({"input_ids": chunks})


def rank0_first(build, rank: int, agree=None):
    """Rank 0 builds first (training and caching the tokenizer); the others then load the cache.

    ``agree(error)``, when given, is the barrier: a barrier that also tells every rank whether rank 0
    failed (a DataError) and raises on every rank then, so the others do not wait for it in vain."""
    if agree is None:
        out = build() if rank == 0 else None
        if dist.is_initialized():
            dist.barrier()
        return out if out is not None else build()
    out, error = None, None
    if rank == 0:
        try:
            out = build()
        except DataError as e:
            error = e
    agree(error)
    return out if out is not None else build()


def build_lm_dataset(
    source: str | os.PathLike,
    vocab_size: int,
    seq_len: int,
    seed: int,
    cache_dir: Optional[str | os.PathLike],
    synthetic_tokens: Optional[int] = None,
    tokenizer_file: Optional[str | os.PathLike] = None,
    eos: Optional[int] = None,
) -> datasets.Dataset:
    """A shuffled, torch-formatted dataset of packed ``input_ids`` chunks of ``seq_len + 1``.

    ``source`` is "stdlib" (this interpreter's standard library), "synthetic" (uniform random ids
    from ``torch.Generator(seed)``, no tokenizer; ``synthetic_tokens`` tokens in all, default
    4096 sequences), or a file/directory path (see ``read_texts``). The tokenizer is cached under
    ``cache_dir`` (may be None only for "synthetic") beside the encoded token stream, so only the
first build pays for training and encoding. Equal arguments give bit-identical data.
    With ``tokenizer_file`` (a ``tokenizer.json``) text is encoded by that tokenizer instead of a
    trained one (``tokenized_stream``; each document ends with ``eos`` when given).
    """
    if seq_len <= 0:
        raise DataError(f"seq_len={seq_len} must be a positive integer")
    if str(source) == "synthetic":
        if vocab_size <= 0:
            raise DataError(f"vocab_size={vocab_size} must be a positive integer")
        tokens = synthetic_tokens if synthetic_tokens is not None else SYNTHETIC_SEQUENCES * (seq_len + 1)
        ds = _synthetic_dataset(vocab_size, seq_len, seed, tokens)
    else:
        if cache_dir is None:
            raise DataError(f"source {str(source)!r} needs a cache_dir for its tokenizer")
        if str(source) == "stdlib":
            texts, _ = read_texts(stdlib_files())
        else:
            texts, _ = read_texts([source])
        if not texts:
            raise DataError(f"corpus {source} has no UTF-8 text")
        if tokenizer_file is not None:
            stream = tokenized_stream(texts, tokenizer_file, vocab_size, cache_dir, eos)
        else:
            tokenizer = train_tokenizer(texts, vocab_size, cache_dir)
            key = cache_key(texts, vocab_size)  # the tokenizer's key: same corpus, same vocabulary
            stream = token_stream(texts, tokenizer, Path(cache_dir), key)
        ds = _packed_dataset(stream, seq_len)
    return ds.shuffle(seed=seed).with_format("torch")


class MicroBatches:
    """Infinite, deterministic ``(input_ids, labels)`` micro-batches for one data-parallel rank.

    Each epoch orders the dataset (epoch 0: as given, which ``build_lm_dataset`` already
    shuffled; epoch e > 0: a permutation seeded with ``seed + e``), gives rank r the sequences
    r, r + dp_size, ... (every rank gets the same count, the remainder is dropped so ranks stay in
    step), and cuts them into micro-batches of ``micro_batch_size`` (a partial one is dropped).
    ``position`` counts micro-batches consumed over all epochs; ``state_dict()`` resumes it.

    ``holdout``: the dataset's last ``holdout`` rows are a validation split that training never
    reads (the dataset is shuffled once at build time, so they are a random sample); `held_out`
    iterates them. The split depends on the dataset and ``holdout`` only, so every (pp, tp, dp)
    layout, and a resumed run, holds out the same sequences.

    ``length_buckets`` (`mp_toolkit.data.buckets`, the dataset's sequence length among them): each
    micro-batch is cut to one bucket's length, drawn from (seed, epoch, its first row); () keeps
    every micro-batch whole.
    """

    def __init__(self, dataset, micro_batch_size: int, dp_rank: int = 0, dp_size: int = 1, seed: int = 0,
                 holdout: int = 0, length_buckets: tuple[int, ...] = ()):
        if micro_batch_size <= 0:
            raise DataError(f"micro_batch_size={micro_batch_size} must be a positive integer")
        if not 0 <= dp_rank < dp_size:
            raise DataError(f"dp_rank={dp_rank} must be in [0, dp_size={dp_size})")
        if not 0 <= holdout < len(dataset):
            raise DataError(f"dataset of {len(dataset)} sequences cannot hold out {holdout} for validation: "
                            "lower --eval-batches (or the global batch) or use more data")
        self.dataset = dataset
        self.micro_batch_size = micro_batch_size
        self.dp_rank, self.dp_size, self.seed = dp_rank, dp_size, seed
        self.holdout = holdout
        self.length_buckets = tuple(length_buckets)
        self.train_rows = len(dataset) - holdout  # rows [0, train_rows) train, the rest validate
        self.batches_per_epoch = (self.train_rows // dp_size) // micro_batch_size
        if self.batches_per_epoch == 0:
            held = f" after holding out {holdout} for validation" if holdout else ""
            raise DataError(
                f"dataset of {len(dataset)} sequences{held} is too small for dp_size={dp_size} x "
                f"micro_batch_size={micro_batch_size}: lower either or use more data"
            )
        self.epoch = 0
        self.position = 0
        self._shard = self._shard_for(0)

    def _shard_for(self, epoch: int) -> torch.Tensor:
        n = self.train_rows
        if epoch == 0:
            order = torch.arange(n)
        else:
            order = torch.randperm(n, generator=torch.Generator().manual_seed(self.seed + epoch))
        per_rank = self.batches_per_epoch * self.micro_batch_size
        return order[self.dp_rank :: self.dp_size][:per_rank]

    def __iter__(self) -> "MicroBatches":
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        offset = self.position - self.epoch * self.batches_per_epoch
        if offset == self.batches_per_epoch:
            self.epoch += 1
            self._shard = self._shard_for(self.epoch)
            offset = 0
        idx = self._shard[offset * self.micro_batch_size : (offset + 1) * self.micro_batch_size]
        self.position += 1
        return self.read(idx.tolist(), self.epoch)

    def read(self, rows: list[int], epoch: int):
        """The micro-batch of dataset ``rows``, cut to its length bucket when there are buckets."""
        out = self.batch(rows, epoch)
        return cut(out, self.bucket_length(rows, epoch, out[0])) if self.length_buckets else out

    def bucket_length(self, rows: list[int], epoch: int, inputs) -> int:
        """Packed sequences: a bucket drawn from (seed, epoch, first row) (`mp_toolkit.data.buckets`)."""
        return drawn_bucket(self.length_buckets, self.seed, epoch, rows[0])

    def batch(self, rows: list[int], epoch: int):
        """The micro-batch of dataset ``rows`` (read in ``epoch``)."""
        chunk = torch.as_tensor(self.dataset[rows]["input_ids"], dtype=torch.int64)
        # (mbs, T + 1) -> inputs (mbs, T) and next-token labels (mbs, T); contiguous for p2p sends
        return chunk[:, :-1].contiguous(), chunk[:, 1:].contiguous()

    def held_out(self):
        """This replica's micro-batches of the validation rows, from the first, once through: replica r
        takes held-out rows r, r + dp_size, ... (as training shards), each micro-batch read as in epoch 0."""
        rows = list(range(self.train_rows, len(self.dataset)))[self.dp_rank :: self.dp_size]
        for k in range(len(rows) // self.micro_batch_size):
            yield self.read(rows[k * self.micro_batch_size : (k + 1) * self.micro_batch_size], 0)

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        epoch, position = int(state["epoch"]), int(state["position"])
        offset = position - epoch * self.batches_per_epoch
        if not 0 <= offset <= self.batches_per_epoch:
            raise DataError(
                f"data state epoch={epoch} position={position} does not fit "
                f"{self.batches_per_epoch} micro-batches per epoch: was it saved with another "
                f"dataset, micro_batch_size or dp_size?"
            )
        self.epoch, self.position = epoch, position
        self._shard = self._shard_for(epoch)
