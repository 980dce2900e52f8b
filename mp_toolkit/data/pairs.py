"""BERT next-sentence pairs and MLM masking drawn from memory-mapped sentence shards.

A BERT corpus prepared with ``--split-sentences`` (`mp_toolkit.data.indexed`) holds one sequence
per sentence (its token ids, no special tokens) and groups consecutive sentences into documents.
`PairSamples` turns such shards into masked ``[CLS] A [SEP] B [SEP]`` rows without ever holding the
corpus: a read touches only the sentences of its rows.

    shards = [IndexedDataset("data/bert-00000"), IndexedDataset("data/bert-00001")]
    samples = PairSamples(shards, SpecialIds(pad=0, cls=101, sep=102, mask=103), vocab_size=30522,
                          never_mask=(0, 100, 101, 102, 103), seq_len=128, seed=0, cache_dir=".cache/mpt")
    rows = samples.order(epoch)[:8]                       # this micro-batch's samples
    (input_ids, token_type_ids, attention_mask), (mlm_labels, nsp_labels) = samples.read(rows, epoch)
    # each (8, 128) int64, nsp_labels (8,)

**Segments** (one per sample): within each document, the sentences that start in the same
``budget = seq_len - 3``-token window (tokens [w * budget, (w + 1) * budget) counted from the
document's first token) form a segment of about ``budget`` tokens. A segment of one sentence joins
the segment before it in its document (or, when it is the document's first, the one after), so the
only sentences that start no sample are those of **one-sentence documents**; they can still be
drawn as a random B. The index is built once per (shards, seq_len) with numpy over the shards'
``sequence_lengths`` / ``document_indices`` in chunks of whole documents (`CHUNK` sentences: memory
bounded whatever the corpus), in two passes (count, then fill), and cached under ``cache_dir`` as
memory-mapped ``.npy`` files keyed by each shard's prefix and its ``.idx`` size and mtime:

    segments   int64 (N, 4)  shard, first sentence, end sentence (global numbers), document
    documents  int64 (M, 3)  shard, first sentence, end sentence of each document with sentences

**Samples** (Devlin et al. 2019, section 3.1; Megatron's BERT dataset): sample ``row`` of ``epoch``
is drawn from ``np.random.default_rng([seed, epoch, row])``, whatever the layout or read order. A
is the segment's sentences up to a random sentence boundary; B is the rest of the segment (label
`IS_NEXT`), or with probability ``nsp_probability`` a run from a random sentence of a uniformly drawn
*other* document, taking sentences until A + B reach the budget (label `NOT_NEXT`). The pair is cut
to the budget as `truncate_pair` says (A loses its front, B its end), packed, then masked by
`mask_tokens` from the same generator.

**Cache files** are written under a temporary name and renamed (`atomic.int64_memmap`), so ranks racing to
build one read a complete file; a file that does not load, or whose shape or end rows do not fit
the shards, is rebuilt rather than trusted.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from mp_toolkit.data.atomic import int64_memmap, load_array
from mp_toolkit.data.buckets import fitting_bucket
from mp_toolkit.data.indexed import IndexedDataset, idx_path
from mp_toolkit.data.mlm import IS_NEXT, NOT_NEXT, SpecialIds, mask_tokens
from mp_toolkit.data.rows import FileRows
from mp_toolkit.errors import DataError

__all__ = ["CHUNK", "PairSamples", "index_key", "truncate_pair"]

CHUNK = 1 << 20  # sentences per step of the index build (a few arrays of this size at a time)
INDEX_VERSION = 1  # part of the cache key: a change to the segmenting rule makes new files
ORDER_STREAM = 0x6F7264  # [seed, epoch, 0, ORDER_STREAM]: apart from every sample's [seed, epoch, row]
RUN_WINDOW = 256  # sentence lengths read per step when a random B takes sentences


def truncate_pair(la: int, lb: int, budget: int) -> tuple[int, int]:
    """How many tokens of A and B fit ``budget``: the longer side is trimmed one token at a time
    (A ties lose to B) until they fit, as `mp_toolkit.data.mlm` trims; in closed form, so a huge
    sentence costs no loop. A then keeps its last tokens, B its first."""
    if la + lb <= budget:
        return la, lb
    if 2 * min(la, lb) <= budget:  # only the longer side is trimmed, down to what the shorter leaves
        return (budget - lb, lb) if la > lb else (la, budget - la)
    return (budget + 1) // 2, budget // 2  # both trimmed alternately, B first from a tie


def index_key(shards: Sequence[IndexedDataset], seq_len: int) -> str:
    """The segment index's cache key: each shard's prefix and its ``.idx`` size and mtime, and
    seq_len (a rewritten shard gets a new ``.idx`` and so a new index; the corpus is never hashed)."""
    ident = []
    for ds in shards:
        st = idx_path(ds.prefix).stat()
        ident.append([os.path.abspath(ds.prefix), st.st_size, st.st_mtime_ns])
    text = json.dumps({"version": INDEX_VERSION, "seq_len": seq_len, "shards": ident})
    return hashlib.sha256(text.encode()).hexdigest()[:24]


class PairSamples:
    """Masked NSP sentence pairs from memory-mapped sentence shards (module docstring).

    ``never_mask``: ids never chosen for masking nor drawn as random replacements (the special ids
    are added to it); replacements are the other ids below ``vocab_size``. ``hf_order``: the inputs
    as HF BERT takes them, ``(input_ids, attention_mask, token_type_ids)``.
    """

    def __init__(self, shards: list[IndexedDataset], special: SpecialIds, vocab_size: int,
                 never_mask: tuple[int, ...], seq_len: int, seed: int, cache_dir: str | os.PathLike,
                 nsp_probability: float = 0.5, mlm_probability: float = 0.15, hf_order: bool = False):
        _check_arguments(shards, seq_len, nsp_probability, mlm_probability)
        self.shards, self.special, self.seq_len, self.seed = list(shards), special, seq_len, seed
        self.nsp_probability, self.mlm_probability, self.hf_order = nsp_probability, mlm_probability, hf_order
        self.budget = seq_len - 3  # [CLS] A [SEP] B [SEP]
        # global number of each shard's first sentence; the last entry is the corpus's sentence count
        self.offsets = np.concatenate(([0], np.cumsum([len(ds) for ds in self.shards]))).astype(np.int64)
        self._never = np.union1d(np.asarray(never_mask, np.int64),
                                 np.asarray(dataclasses.astuple(special), np.int64))
        self._random_ids = np.setdiff1d(np.arange(vocab_size, dtype=np.int64), self._never)
        if len(self._random_ids) == 0:
            raise DataError(f"vocab_size={vocab_size} leaves no id outside never_mask for random replacements: "
                            "pass the model's vocabulary size")
        self._stem = Path(cache_dir) / "pairs" / index_key(self.shards, seq_len)
        self.segments, self.documents = self._index()

    def __len__(self) -> int:
        return len(self.segments)

    def _path(self, name: str) -> Path:
        return self._stem.with_name(f"{self._stem.name}-{name}.npy")

    def _index(self) -> tuple[np.ndarray, np.ndarray]:
        """(segments, documents), memory-mapped from the cache, built there first when missing or damaged."""
        seg_path, doc_path = self._path("segments"), self._path("documents")
        segments, documents = _load(seg_path, 4), _load(doc_path, 3)
        if segments is None or documents is None or not self._index_fits(segments, documents):
            _build_index(self.shards, self.offsets, self.budget, seg_path, doc_path)
            segments, documents = _load(seg_path, 4), _load(doc_path, 3)
        return segments, documents

    def _index_fits(self, segments: np.ndarray, documents: np.ndarray) -> bool:
        """The end rows of a loaded index lie inside the shards (O(1): a check against a stale or
        edited file, not a proof; reads check every range again)."""
        n_shards, off = len(self.shards), self.offsets

        def inside(shard, first, end, least):
            return 0 <= shard < n_shards and off[shard] <= first and first + least <= end <= off[shard + 1]

        return len(documents) >= 2 and all(
            inside(*row[:3], 2) and 0 <= row[3] < len(documents) for row in (segments[0], segments[-1])) and all(
            inside(*row, 1) for row in (documents[0], documents[-1]))

    def order(self, epoch: int) -> FileRows:
        """Epoch ``epoch``'s permutation of the samples (int64), drawn from (seed, epoch), cached under
        cache_dir and read as sliced (`mp_toolkit.data.rows`: no page of it stays mapped in the rank)."""
        path, n = self._path(f"order-{self.seed}-{epoch}"), len(self)
        cached = _load(path, None)
        if cached is None or cached.shape != (n,):
            perm = np.random.default_rng([self.seed, epoch, 0, ORDER_STREAM]).permutation(n)  # (N,) int64
            with int64_memmap(path, (n,)) as out:
                out[:] = perm
        return FileRows.npy(path)

    def read(self, rows: Sequence[int], epoch: int) -> tuple:
        """The micro-batch of samples ``rows`` in ``epoch``: ``((input_ids, token_type_ids,
        attention_mask), (mlm_labels, nsp_labels))``, int64, (B, seq_len) each and nsp (B,)."""
        n, t = len(rows), self.seq_len
        ids = np.full((n, t), self.special.pad, np.int64)
        types, attention, labels = np.zeros((n, t), np.int64), np.zeros((n, t), np.int64), np.zeros((n, t), np.int64)
        nsp = np.zeros(n, np.int64)
        for r, row in enumerate(rows):
            rng = np.random.default_rng([self.seed, epoch, int(row)])
            a, b, nsp[r] = self._pair(int(row), rng)
            end = len(a) + len(b) + 3
            ids[r, :end] = np.concatenate(([self.special.cls], a, [self.special.sep], b, [self.special.sep]))
            types[r, len(a) + 2 : end] = 1  # B and its [SEP]
            attention[r, :end] = 1
            ids[r], labels[r] = mask_tokens(ids[r], rng, self.special.mask, self._never, self._random_ids,
                                            self.mlm_probability)
        inputs = tuple(torch.from_numpy(x) for x in ((ids, attention, types) if self.hf_order else
                                                     (ids, types, attention)))
        return inputs, (torch.from_numpy(labels), torch.from_numpy(nsp))

    def bucket_length(self, rows: Sequence[int], epoch: int, inputs, buckets: tuple[int, ...]) -> int:
        """Padded pairs: the smallest bucket holding the micro-batch's longest pair (`fitting_bucket`)."""
        return fitting_bucket(buckets, inputs[1 if self.hf_order else 2])

    def _pair(self, row: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, int]:
        """(A tokens, B tokens, NSP label) of sample ``row``, cut to the budget; reads only their sentences."""
        shard, first, end, doc = (int(v) for v in self.segments[row])
        ds, base = self.shards[shard], int(self.offsets[shard])
        a0, a1 = first - base, first - base + int(rng.integers(1, end - first))  # A and B keep >= 1 sentence
        la = int(ds.sequence_lengths[a0:a1].sum(dtype=np.int64))
        if rng.random() < self.nsp_probability:
            j = int(rng.integers(len(self.documents) - 1))
            b_shard, d0, d1 = (int(v) for v in self.documents[j + (j >= doc)])  # any other document, uniformly
            b_ds, b_base = self.shards[b_shard], int(self.offsets[b_shard])
            b0 = d0 - b_base + int(rng.integers(d1 - d0))
            b1, label = _run_end(b_ds.sequence_lengths, b0, d1 - b_base, self.budget - la), NOT_NEXT
        else:
            b_ds, b0, b1, label = ds, a1, end - base, IS_NEXT
        lb = int(b_ds.sequence_lengths[b0:b1].sum(dtype=np.int64))
        na, nb = truncate_pair(la, lb, self.budget)
        return _tokens(ds, a0, a1, na, from_end=True), _tokens(b_ds, b0, b1, nb, from_end=False), label


def _check_arguments(shards, seq_len: int, nsp_probability: float, mlm_probability: float) -> None:
    if not shards:
        raise DataError("no shards given: pass at least one prepared corpus prefix (PREFIX.bin + PREFIX.idx)")
    if seq_len < 5:
        raise DataError(f"seq_len={seq_len} cannot hold [CLS] A [SEP] B [SEP]: use at least 5")
    if not 0.0 <= nsp_probability <= 1.0:
        raise DataError(f"nsp_probability={nsp_probability} must be in [0, 1]")
    if not 0.0 < mlm_probability < 1.0:
        raise DataError(f"mlm_probability={mlm_probability} must be in (0, 1)")
    odd = next((ds for ds in shards if ds.dtype != shards[0].dtype), None)
    if odd is not None:
        raise DataError(f"shard {odd.prefix} holds {odd.dtype} tokens but {shards[0].prefix} holds "
                        f"{shards[0].dtype}: prepare every shard with the same tokenizer and dtype")


def _run_end(lengths: np.ndarray, start: int, stop: int, need: int) -> int:
    """End (exclusive, at most ``stop``) of the shortest run of sentences from ``start`` holding
    >= ``need`` tokens, at least one sentence; reads lengths `RUN_WINDOW` at a time."""
    end, have = start + 1, int(lengths[start])
    while have < need and end < stop:
        reach = have + np.cumsum(lengths[end : min(stop, end + RUN_WINDOW)], dtype=np.int64)
        i = int(np.searchsorted(reach, need))  # the first sentence that brings the run to need
        if i < len(reach):
            return end + i + 1
        have, end = int(reach[-1]), end + len(reach)
    return end


def _tokens(ds: IndexedDataset, lo: int, hi: int, n: int, from_end: bool) -> np.ndarray:
    """The first ``n`` tokens of sentences [lo, hi) of ``ds`` (the last ``n`` when ``from_end``),
    reading only those tokens."""
    parts, left = [], n
    for i in (range(hi - 1, lo - 1, -1) if from_end else range(lo, hi)):
        if left == 0:
            break
        size = int(ds.sequence_lengths[i])
        take = min(size, left)
        parts.append(ds.get(i, size - take if from_end else 0, take))
        left -= take
    if from_end:
        parts.reverse()
    return np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, np.int64)


def _chunks(ds: IndexedDataset) -> list[tuple[int, int]]:
    """Document ranges [d0, d1) of ``ds`` of about `CHUNK` sentences each (whole documents)."""
    cuts = np.searchsorted(ds.document_indices, np.arange(CHUNK, len(ds), CHUNK))
    cuts = np.unique(np.concatenate(([0], cuts, [ds.num_documents])))
    return list(zip(cuts[:-1].tolist(), cuts[1:].tolist()))


def _runs(starts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(first, end) of each run that a True in ``starts`` opens."""
    s = np.flatnonzero(starts)
    return s, np.append(s[1:], len(starts))


def _chunk_segments(ds: IndexedDataset, d0: int, d1: int, budget: int) -> tuple[np.ndarray, np.ndarray]:
    """Segments and documents of ``ds``'s documents [d0, d1), vectorised: segments (S, 3) as (first,
    end) shard sentence numbers and the document's number among this range's non-empty documents;
    documents (D, 2) as (first, end)."""
    di = np.asarray(ds.document_indices[d0 : d1 + 1])
    lo, hi = int(di[0]), int(di[-1])
    sizes = np.diff(di)  # (docs,) sentences per document
    nonempty = np.flatnonzero(sizes)
    documents = np.stack((di[nonempty], di[nonempty + 1]), axis=1)
    if hi == lo:
        return np.zeros((0, 3), np.int64), documents
    lens = ds.sequence_lengths[lo:hi].astype(np.int64)  # (n,)
    doc = np.repeat(np.arange(len(sizes)), sizes)  # (n,) each sentence's document
    head = (di[:-1] - lo)[doc]  # (n,) each sentence's document's first sentence
    before = np.cumsum(lens) - lens  # (n,) tokens before each sentence in the range
    window = (before - before[head]) // budget  # the budget window of its document it starts in
    first = np.arange(hi - lo) == head
    starts = first.copy()
    starts[1:] |= window[1:] != window[:-1]
    s, e = _runs(starts)
    starts[s[(e - s == 1) & ~first[s]]] = False  # a lone sentence joins the segment before it
    s, e = _runs(starts)
    lone_head = (e - s == 1) & (e < len(doc))
    lone_head &= doc[np.minimum(e, len(doc) - 1)] == doc[s]  # ... or, first of its document, the one after
    starts[e[lone_head]] = False
    s, e = _runs(starts)
    keep = e - s >= 2  # what is still alone is a one-sentence document
    rank = np.cumsum(sizes > 0) - 1  # each document's number among the non-empty ones
    return np.stack((lo + s[keep], lo + e[keep], rank[doc[s[keep]]]), axis=1), documents


def _build_index(shards: list[IndexedDataset], offsets: np.ndarray, budget: int, seg_path: Path,
                 doc_path: Path) -> None:
    """Write the segment and document tables: a counting pass, then a pass that fills the files."""
    parts = [(shard, d0, d1) for shard, ds in enumerate(shards) for d0, d1 in _chunks(ds)]
    n_seg = n_doc = 0
    for shard, d0, d1 in parts:
        segs, docs = _chunk_segments(shards[shard], d0, d1, budget)
        n_seg, n_doc = n_seg + len(segs), n_doc + len(docs)
    names = ", ".join(ds.prefix for ds in shards)
    if n_doc < 2:
        raise DataError(f"{names}: {n_doc} document(s) with sentences; next-sentence pairs need at least 2 "
                        "(a random B comes from a different document)")
    if n_seg == 0:
        raise DataError(f"{names}: no document has two sentences; documents need at least two sentences "
                        "(prepare BERT corpora with --split-sentences)")
    with int64_memmap(doc_path, (n_doc, 3)) as documents, int64_memmap(seg_path, (n_seg, 4)) as segments:
        at_seg = at_doc = 0
        for shard, d0, d1 in parts:
            segs, docs = _chunk_segments(shards[shard], d0, d1, budget)
            base = offsets[shard]
            segments[at_seg : at_seg + len(segs)] = np.column_stack(
                (np.full(len(segs), shard), segs[:, :2] + base, segs[:, 2] + at_doc))
            documents[at_doc : at_doc + len(docs)] = np.column_stack((np.full(len(docs), shard), docs + base))
            at_seg, at_doc = at_seg + len(segs), at_doc + len(docs)


def _load(path: Path, columns: int | None) -> np.ndarray | None:
    """The int64 array in ``path``, memory-mapped, of (rows, columns) (1-d when columns is None);
    None when missing, damaged (truncated, another dtype or shape) or empty."""
    arr = load_array(path, columns=columns)
    return arr if arr is not None and len(arr) > 0 else None
