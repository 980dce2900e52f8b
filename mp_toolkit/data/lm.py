"""One data-parallel replica's micro-batches over any *samples* (`MicroBatches`), and GPT's synthetic samples.

A samples object (the protocol `MicroBatches` reads) has ``len(samples)`` (samples in one epoch),
``order(epoch)`` (that epoch's sample order: a permutation of ``range(len)``, possibly memory-mapped),
``read(rows, epoch)`` (the micro-batch of those rows: ``(inputs, labels)``, nested tuples of int64
tensors) and ``bucket_length(rows, epoch, inputs, buckets)``. They are: packed causal-LM samples of a
prepared corpus (`mp_toolkit.data.packed.PackedSamples`), BERT sentence pairs
(`mp_toolkit.data.pairs.PairSamples`), a weighted blend of either (`mp_toolkit.data.blend`), and
`SyntheticSamples` (uniform random ids, ``--data synthetic``). Every rank of a pipeline builds the same
samples (the first stage feeds the inputs, the last stage scores the labels) and iterates
``MicroBatches`` with its own data-parallel rank.

    samples = PackedSamples(PreparedCorpus.open("data/owt").train, seq_len=128, seed=0, cache_dir="data/owt/cache")
    batches = MicroBatches(samples, micro_batch_size=8, dp_rank=0, dp_size=1)
    input_ids, labels = next(batches)  # (8, 128) int64 each; labels[:, t] == input_ids[:, t + 1]
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import torch.distributed as dist

from mp_toolkit.data.buckets import cut, drawn_bucket
from mp_toolkit.errors import DataError

SYNTHETIC_SEQUENCES = 4096


class SyntheticSamples:
    """``--data synthetic`` for GPT: ``count`` sequences of ``seq_len + 1`` uniform random ids below
    ``vocab_size`` from ``torch.Generator(seed)`` (rows ``[first, first + count)`` of that draw), no
    tokenizer; epoch e's order is a permutation seeded with ``seed + e``."""

    def __init__(self, vocab_size: int, seq_len: int, seed: int, count: int, first: int = 0):
        if vocab_size <= 0:
            raise DataError(f"vocab_size={vocab_size} must be a positive integer")
        if count <= 0:
            raise DataError(f"synthetic data of {count} sequences: at least one sequence of {seq_len + 1} tokens")
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, vocab_size, (first + count, seq_len + 1), generator=g, dtype=torch.int64)
        self.ids, self.seed = ids[first:].clone(), seed

    @classmethod
    def split(cls, vocab_size: int, seq_len: int, seed: int, tokens: int | None,
              holdout: int) -> tuple[SyntheticSamples, SyntheticSamples | None]:
        """(training rows, the last ``holdout`` rows held out for validation, or None) of ``tokens`` ids
        (default `SYNTHETIC_SEQUENCES` sequences)."""
        n = (tokens if tokens is not None else SYNTHETIC_SEQUENCES * (seq_len + 1)) // (seq_len + 1)
        if n - holdout <= 0:
            raise DataError(f"synthetic data of {n} sequences cannot hold out {holdout} for validation" if holdout
                            else f"synthetic_tokens={tokens} is less than one sequence of {seq_len + 1} tokens")
        train = cls(vocab_size, seq_len, seed, n - holdout)
        return train, (cls(vocab_size, seq_len, seed, holdout, first=n - holdout) if holdout else None)

    def __len__(self) -> int:
        return len(self.ids)

    def order(self, epoch: int) -> np.ndarray:
        return torch.randperm(len(self.ids), generator=torch.Generator().manual_seed(self.seed + epoch)).numpy()

    def read(self, rows: Sequence[int], epoch: int) -> tuple[torch.Tensor, torch.Tensor]:
        chunk = self.ids[list(rows)]  # (mbs, T + 1) -> inputs (mbs, T), next-token labels (mbs, T)
        return chunk[:, :-1].contiguous(), chunk[:, 1:].contiguous()

    def bucket_length(self, rows: Sequence[int], epoch: int, inputs, buckets: Sequence[int]) -> int:
        return drawn_bucket(buckets, self.seed, epoch, int(rows[0]))


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


def check_holdout(validation, holdout: int) -> None:
    """``validation`` (samples or None) holds the ``holdout`` sequences evaluation reads."""
    if holdout and (validation is None or len(validation) < holdout):
        have = "no validation split" if validation is None else f"a validation split of {len(validation)} samples"
        raise DataError(f"the data has {have}, fewer than the {holdout} held-out sequences --eval-batches asks "
                        "for: lower --eval-batches (or the global batch), or prepare with a larger --val-fraction")


class MicroBatches:
    """Infinite, deterministic micro-batches of one data-parallel replica over ``samples`` (module docstring).

    Each epoch takes ``samples.order(epoch)``, gives replica r the samples r, r + dp_size, ... of it
    (every replica gets the same count, the remainder is dropped so replicas stay in step) and cuts
    them into micro-batches of ``micro_batch_size`` (a partial one is dropped). ``position`` counts
    micro-batches consumed over all epochs; ``state_dict()`` resumes it. A step of m micro-batches per
    replica reads samples [s G, (s + 1) G) of the epoch's order (G = dp x m x micro_batch), whatever
    the layout.

    ``validation`` (samples, or None): the held-out split training never reads; `held_out` iterates
    its first ``holdout`` samples (the same ones on every layout). ``length_buckets``
    (`mp_toolkit.data.buckets`, the sequence length among them): each micro-batch is cut to the
    bucket ``samples.bucket_length`` picks; () keeps every micro-batch whole. ``digest`` names the data
    (a prepared corpus's manifest digest) and ``tokenizer_digest`` its tokenizer.json's sha256, for the
    checkpoint; None for synthetic token ids.
    """

    def __init__(self, samples, micro_batch_size: int, dp_rank: int = 0, dp_size: int = 1, seed: int = 0,
                 holdout: int = 0, length_buckets: tuple[int, ...] = (), validation=None, digest: str | None = None,
                 tokenizer_digest: str | None = None):
        if micro_batch_size <= 0:
            raise DataError(f"micro_batch_size={micro_batch_size} must be a positive integer")
        if not 0 <= dp_rank < dp_size:
            raise DataError(f"dp_rank={dp_rank} must be in [0, dp_size={dp_size})")
        check_holdout(validation, holdout)
        self.samples, self.validation = samples, validation
        self.digest, self.tokenizer_digest = digest, tokenizer_digest
        self.micro_batch_size = micro_batch_size
        self.dp_rank, self.dp_size, self.seed = dp_rank, dp_size, seed
        self.holdout = holdout
        self.length_buckets = tuple(length_buckets)
        self.train_rows = len(samples)
        self.batches_per_epoch = (self.train_rows // dp_size) // micro_batch_size
        if self.batches_per_epoch == 0:
            raise DataError(
                f"the data holds {len(samples)} samples, too few for dp_size={dp_size} x "
                f"micro_batch_size={micro_batch_size}: lower either or use more data"
            )
        self.epoch = 0
        self.position = 0
        self._shard = self._shard_for(0)

    def _shard_for(self, epoch: int):
        """This replica's samples of ``epoch``, in order (a strided view: nothing is copied)."""
        per_rank = self.batches_per_epoch * self.micro_batch_size
        return self.samples.order(epoch)[self.dp_rank :: self.dp_size][:per_rank]

    def __iter__(self) -> "MicroBatches":
        return self

    def __next__(self):
        offset = self.position - self.epoch * self.batches_per_epoch
        if offset == self.batches_per_epoch:
            self.epoch += 1
            self._shard = self._shard_for(self.epoch)
            offset = 0
        rows = self._shard[offset * self.micro_batch_size : (offset + 1) * self.micro_batch_size]
        self.position += 1
        return self.read(self.samples, [int(r) for r in rows], self.epoch)

    def read(self, samples, rows: list[int], epoch: int):
        """The micro-batch of ``rows`` of ``samples``, cut to its length bucket when there are buckets."""
        out = samples.read(rows, epoch)
        return cut(out, samples.bucket_length(rows, epoch, out[0], self.length_buckets)) if self.length_buckets else out

    def held_out(self):
        """This replica's micro-batches of the validation samples, from the first, once through: replica r
        takes held-out samples r, r + dp_size, ... (as training shards), each read as in epoch 0."""
        rows = [int(r) for r in self.validation.order(0)[: self.holdout]][self.dp_rank :: self.dp_size]
        for k in range(len(rows) // self.micro_batch_size):
            yield self.read(self.validation, rows[k * self.micro_batch_size : (k + 1) * self.micro_batch_size], 0)

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position}

    def skip(self, n: int) -> None:
        """Pass over the next ``n`` micro-batches without reading them (into later epochs as needed)."""
        position = self.position + n
        epoch = max(self.epoch, -(-position // self.batches_per_epoch) - 1)
        self.load_state_dict({"epoch": epoch, "position": position})

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
