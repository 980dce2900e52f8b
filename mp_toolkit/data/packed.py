"""Packed causal-LM samples of a prepared corpus, by index arrays memory-mapped from a cache.

A sample is ``seq_len + 1`` consecutive tokens of the corpus's documents laid end to end (each
document ends with its end-of-document token, `mp_toolkit.data.prepare`), as Megatron's GPT dataset
builds them. Per epoch, three arrays (computed once per (corpus, seq_len, seed, epoch), cached as
``.npy`` files and memory-mapped by every rank):

    documents  (D,)      int64  the epoch's document order: a permutation drawn from (seed, epoch)
    sample_doc (N + 1,)  int64  where sample i starts: the position (in ``documents``) of the document
    sample_off (N + 1,)  int64  and the offset in it of token i * seq_len of the epoch's concatenation
                                (samples overlap by one token, so every token but the first is a label)
    shuffle    (N,)      int64  the epoch's sample order: a permutation drawn from (seed, epoch)

``order(epoch)`` is ``shuffle``; ``read(rows, epoch)`` starts each row at its ``sample_doc`` /
``sample_off`` entry, so a read touches only the documents it returns. Every entry and token is read
with ``pread`` (`mp_toolkit.data.rows`): a memory map would keep each page a random read touched in the
rank's resident memory, which would then grow with the corpus. N is the same every epoch (the same
tokens, reordered). Nothing here holds the corpus: opening an existing cache is O(1); building one is
O(documents + samples) on the first rank that needs it (written atomically, `mp_toolkit.data.atomic`:
racing ranks build identical files and one wins).

    corpus = PreparedCorpus.open("data/owt")
    samples = PackedSamples(corpus.train, seq_len=1024, seed=0, cache_dir="data/owt/cache")
    inputs, labels = samples.read(samples.order(0)[:8].tolist(), 0)   # (8, 1024) int64 each
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from mp_toolkit.data.atomic import load_array, save_array
from mp_toolkit.data.buckets import drawn_bucket
from mp_toolkit.data.indexed import IndexedDataset, idx_path
from mp_toolkit.data.rows import FileRows
from mp_toolkit.errors import DataError

INDEX_STREAM = 0x6770  # keeps the index draws apart from any other use of the same seed
PARTS = ("documents", "sample_doc", "sample_off", "shuffle")


def corpus_key(shards: Sequence[IndexedDataset]) -> str:
    """Names the shards' contents without reading them: each .idx's path, size and modification time
    (a re-prepared corpus changes them, so its indices are built anew)."""
    h = hashlib.sha256()
    for ds in shards:
        st = idx_path(ds.prefix).stat()
        h.update(f"{os.path.abspath(ds.prefix)}:{st.st_size}:{st.st_mtime_ns}:{ds.bin_bytes}\n".encode())
    return h.hexdigest()[:16]


class DocumentSpans:
    """Every document of the shards, numbered across them: where its tokens lie (shard, token range).

    A document's tokens are contiguous in its shard's ``.bin`` (its sequences are written back to
    back), so a sentence-split corpus reads as whole documents too. Per-document arrays are the
    shards' own memory-mapped index arrays; only the shard boundaries (one int per shard) are held."""

    def __init__(self, shards: Sequence[IndexedDataset]):
        if not shards:
            raise DataError("no shards to read documents from")
        self.shards = tuple(shards)
        self.first_doc = np.cumsum([0] + [ds.num_documents for ds in shards])  # (S + 1,)
        self.count = int(self.first_doc[-1])

    def _token(self, ds: IndexedDataset, seq: int) -> int:
        """Where sequence ``seq`` of ``ds`` starts, in tokens (its end for seq == len(ds))."""
        return ds.num_tokens if seq == len(ds) else ds.entry(seq)[0] // ds.dtype.itemsize

    def lengths(self) -> np.ndarray:
        """(D,) int64 tokens per document (O(documents): used when an index is built)."""
        out = []
        for ds in self.shards:
            di = np.asarray(ds.document_indices)
            if len(ds) == 0:
                out.append(np.zeros(ds.num_documents, np.int64))
                continue
            pointers = np.asarray(ds.sequence_pointers)[np.minimum(di, len(ds) - 1)] // ds.dtype.itemsize
            out.append(np.diff(np.where(di < len(ds), pointers, ds.num_tokens)))  # (documents,)
        return np.concatenate(out) if out else np.zeros(0, np.int64)

    def span(self, doc: int) -> tuple[IndexedDataset, int, int, int]:
        """(its shard, its number there, its first token, the token after it) of document ``doc``."""
        s = int(np.searchsorted(self.first_doc, doc, side="right")) - 1
        ds, d = self.shards[s], doc - int(self.first_doc[s])
        first, end = ds.document_bounds(d)
        return ds, d, self._token(ds, first), self._token(ds, end)

    def tokens(self, doc: int, offset: int, most: int) -> np.ndarray:
        """Document ``doc``'s tokens from ``offset``, at most ``most`` of them (a copy read from its .bin)."""
        ds, d, start, end = self.span(doc)
        if not (0 <= offset < end - start and 0 <= start <= end <= ds.num_tokens):
            raise DataError(f"{idx_path(ds.prefix)}: document {d} does not hold token {offset}: the index changed "
                            "since the sample index was built (delete its cache)")
        return ds.read(start + offset, min(most, end - start - offset))


class PackedSamples:
    """The samples protocol (`mp_toolkit.data.lm.MicroBatches`) over a prepared causal-LM corpus.

    ``shuffle=False`` (validation): documents in corpus order and samples in order, the same set
    whatever the seed. ``vocab_size``: every read checks its ids against it (a corpus without a
    tokenizer, a bare Megatron prefix, cannot be checked beforehand without reading it all)."""

    def __init__(self, shards: Sequence[IndexedDataset], seq_len: int, seed: int, cache_dir: str | os.PathLike,
                 shuffle: bool = True, name: str = "train", vocab_size: int | None = None):
        if seq_len <= 0:
            raise DataError(f"seq_len={seq_len} must be a positive integer")
        self.docs = DocumentSpans(shards)
        self.seq_len, self.seed, self.shuffle, self.vocab_size = seq_len, seed, shuffle, vocab_size
        tag = f"{name}-{corpus_key(shards)}-L{seq_len}-" + (f"s{seed}" if shuffle else "ordered")
        self.cache = Path(cache_dir) / "gpt-index" / tag
        self._epochs: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        self._len = len(self.order(0))
        if self._len == 0:
            raise DataError(f"the corpus ({shards[0].prefix}, ...) holds fewer than {seq_len + 1} tokens: one sample "
                            f"needs seq_len + 1 = {seq_len + 1}; lower --seq-len or add text")

    def __len__(self) -> int:
        return self._len

    def _index(self, epoch: int) -> tuple[np.ndarray, ...]:
        """(documents, sample_doc, sample_off, shuffle) of ``epoch``: memory-mapped from the cache, built
        when missing or damaged."""
        if epoch in self._epochs:
            return self._epochs[epoch]
        key = epoch if self.shuffle else 0
        files = [self.cache / f"e{key}-{part}.npy" for part in PARTS]
        arrays = [load_array(f) for f in files]
        if not self._whole(arrays):
            for f, a in zip(files, self._build(key)):
                save_array(f, a)
            arrays = [load_array(f) for f in files]
            if not self._whole(arrays):
                raise DataError(f"cannot read back the sample index written under {self.cache}")
        # read by pread from here on: a memory map would keep every page a random row touched (`rows`)
        self._epochs = {epoch: tuple(FileRows.npy(f) for f in files)}  # one epoch's at a time
        return self._epochs[epoch]

    def _whole(self, arrays: list) -> bool:
        if any(a is None for a in arrays):
            return False
        documents, sample_doc, sample_off, shuffle = arrays
        return len(documents) == self.docs.count and len(sample_doc) == len(sample_off) == len(shuffle) + 1

    def _build(self, epoch: int) -> tuple[np.ndarray, ...]:
        rng = np.random.default_rng([self.seed, epoch, INDEX_STREAM])
        lengths = self.docs.lengths()
        documents = rng.permutation(self.docs.count).astype(np.int64) if self.shuffle else \
            np.arange(self.docs.count, dtype=np.int64)
        ends = np.cumsum(lengths[documents])  # (D,) the token after each document of the epoch's order
        total = int(ends[-1]) if len(ends) else 0
        n = max(0, (total - 1) // self.seq_len)
        starts = np.arange(n + 1, dtype=np.int64) * self.seq_len  # sample i: tokens [i L, i L + L + 1)
        sample_doc = np.searchsorted(ends, starts, side="right").astype(np.int64)
        sample_off = starts - np.where(sample_doc > 0, ends[np.maximum(sample_doc - 1, 0)], 0)
        shuffle = rng.permutation(n).astype(np.int64) if self.shuffle else np.arange(n, dtype=np.int64)
        return documents, sample_doc, sample_off, shuffle

    def order(self, epoch: int) -> FileRows:
        """The epoch's sample order: a permutation of range(len(self)), read from the cache as sliced."""
        return self._index(epoch)[3]

    def sample(self, row: int, epoch: int) -> np.ndarray:
        """(seq_len + 1,) int64 tokens of sample ``row`` of the epoch (its number before shuffling)."""
        documents, sample_doc, sample_off, _ = self._index(epoch)
        pos, offset = int(sample_doc[row]), int(sample_off[row])
        out = np.empty(self.seq_len + 1, np.int64)
        filled = 0
        while filled < len(out):  # across document boundaries (documents end with their end-of-document token)
            got = self.docs.tokens(int(documents[pos]), offset, len(out) - filled)  # one span lookup a document
            out[filled : filled + len(got)] = got
            filled, pos, offset = filled + len(got), pos + 1, 0
        return out

    def read(self, rows: Sequence[int], epoch: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The micro-batch of ``rows``: (inputs, next-token labels), each (len(rows), seq_len) int64."""
        chunk = torch.from_numpy(np.stack([self.sample(int(r), epoch) for r in rows]))  # (B, T + 1)
        if self.vocab_size is not None and int(chunk.max()) >= self.vocab_size:
            raise DataError(f"{self.docs.shards[0].prefix}: token id {int(chunk.max())} in epoch {epoch}'s samples "
                            f"{list(rows)} is not below the model's vocab_size {self.vocab_size}: train a model with "
                            "the corpus's vocabulary")
        return chunk[:, :-1].contiguous(), chunk[:, 1:].contiguous()

    def bucket_length(self, rows: Sequence[int], epoch: int, inputs, buckets: Sequence[int]) -> int:
        """Packed samples: a bucket drawn from (seed, epoch, first row) (`mp_toolkit.data.buckets`)."""
        return drawn_bucket(buckets, self.seed, epoch, int(rows[0]))
