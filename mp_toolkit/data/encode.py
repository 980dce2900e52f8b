"""The encode pass of `mp_toolkit.data.prepare` (its module docstring, step 5): documents in batches to
worker processes, back in order into each chunk's train and val shards.

    encoder = Encoder(tokenizer.to_str(), "uint16", eod=0, split_sentences=False)
    tokens, lengths, counts = encoder(["one document", "another"])   # all tokens; per sequence; per document
    records = EncodePass(out, opts, sources, vocab, survey).encode_all(progress=True)

At most `WINDOW_PER_WORKER` batches per worker are in flight, so memory does not grow with the corpus; a
chunk with an intact record (`prepared_files.intact_records`) is read and passed over, not encoded again.
"""

from __future__ import annotations

import itertools
import multiprocessing
import os
import re
import signal
from collections import deque
from collections.abc import Iterator
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from mp_toolkit.data.indexed import token_dtype
from mp_toolkit.data.prepare_options import Options
from mp_toolkit.data.prepared_files import CHUNKS, ChunkWriter, chunk_name, intact_records, write_json
from mp_toolkit.data.sources import Documents, Source
from mp_toolkit.data.survey import Survey, Vocab, byte_bar, unit_hash

SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z0-9\"'(\[])")
BATCH_DOCS = 256  # documents per encode_batch call in a worker
BATCH_CHARS = 1 << 22  # ... or fewer, when they hold this many characters
WINDOW_PER_WORKER = 2  # batches in flight per worker: enough to keep it busy, bounded memory


class Encoder:
    """Texts -> (tokens, tokens per sequence, sequences per document) of one batch, as `IndexedWriter`
    takes them; pickles as its arguments, so a worker receives it once and loads the tokenizer itself."""

    def __init__(self, tokenizer_json: str, dtype: str, eod: int | None, split_sentences: bool):
        self.args = (tokenizer_json, dtype, eod, split_sentences)
        self.tokenizer = Tokenizer.from_str(tokenizer_json)
        self.dtype, self.eod, self.split = np.dtype(dtype), eod, split_sentences

    def __getstate__(self):
        return self.args

    def __setstate__(self, args):
        self.__init__(*args)

    def __call__(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        end = [] if self.eod is None else [self.eod]
        if not self.split:
            ids = [e.ids + end for e in self.tokenizer.encode_batch(texts, add_special_tokens=False)]
            counts = [1] * len(ids)
        else:
            sentences = [sentences_of(text) for text in texts]
            flat = self.tokenizer.encode_batch([s for doc in sentences for s in doc], add_special_tokens=False)
            ids, counts, at = [], [], 0
            for doc in sentences:
                kept = [e.ids for e in flat[at : at + len(doc)] if e.ids]
                at += len(doc)
                if kept:
                    kept[-1] = kept[-1] + end
                ids += kept
                counts.append(len(kept))
        lengths = np.fromiter(map(len, ids), np.int64, len(ids))
        tokens = np.fromiter(itertools.chain.from_iterable(ids), self.dtype, int(lengths.sum()))
        return tokens, lengths, np.asarray(counts, np.int64)


def sentences_of(text: str) -> list[str]:
    """A document's sentences: its stripped non-empty lines, each cut at `SENTENCE_END`."""
    return [s for line in text.splitlines() if line.strip() for s in SENTENCE_END.split(line.strip())]


_worker: dict[str, Encoder] = {}
"""A pool worker's encoder, set once by `_start_worker` (a Pool initializer hands state to its worker
only this way; Megatron's preprocess_data does the same with class attributes)."""


def _start_worker(encoder: Encoder) -> None:
    # one thread per worker: the workers are the parallelism (tokenizers would start a thread per core in each)
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C stops the parent, which ends the pool: one traceback
    _worker["encoder"] = encoder


def _encode_in_worker(texts: list[str]):
    return _worker["encoder"](texts)


def _encoded(batches, encoder: Encoder, workers: int):
    """(meta, encoder(texts)) for each (meta, texts) of ``batches``, in order, ``workers`` processes
    encoding (this one alone when 1) with at most WINDOW_PER_WORKER batches each in flight."""
    if workers == 1:
        for meta, texts in batches:
            yield meta, encoder(texts)
        return
    # forkserver (spawn where there is none): workers start from a fresh process, not from this one, whose
    # threads (tokenizers' pool after training, arrow's, tqdm's) a fork would copy mid-flight
    method = "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"
    context = multiprocessing.get_context(method)
    if method == "forkserver":
        context.set_forkserver_preload([__name__])
    with context.Pool(workers, initializer=_start_worker, initargs=(encoder,)) as pool:
        pending: deque = deque()
        for meta, texts in batches:
            pending.append((meta, pool.apply_async(_encode_in_worker, (texts,))))
            if len(pending) >= WINDOW_PER_WORKER * workers:
                meta, result = pending.popleft()
                yield meta, result.get()
        while pending:
            meta, result = pending.popleft()
            yield meta, result.get()


def _batches(documents) -> Iterator[tuple[list, list[str]]]:
    """Documents (k, j, text, read) -> ([(k, j, read), ...], [text, ...]) of at most BATCH_DOCS / BATCH_CHARS."""
    meta, texts, chars = [], [], 0
    for k, j, text, read in documents:
        meta.append((k, j, read))
        texts.append(text)
        chars += len(text)
        if len(texts) >= BATCH_DOCS or chars >= BATCH_CHARS:
            yield meta, texts
            meta, texts, chars = [], [], 0
    if texts:
        yield meta, texts


class EncodePass:
    """The encode pass of one `prepare`: chunks written, records kept in order (those done before too)."""

    def __init__(self, out: Path, opts: Options, sources: list[Source], vocab: Vocab, survey: Survey | None):
        self.out, self.opts, self.vocab, self.survey = out, opts, vocab, survey
        i, n = opts.shard
        self.reader = Documents(sources, [k for k in range(len(sources)) if k % n == i], opts.json_key)
        self.dtype = token_dtype(vocab.vocab_size)
        self.done = dict(intact_records(out, vocab.sha256))
        self.order: list[str] = []  # every chunk met, in (file, chunk) order
        self.encoded = self.reused = self.skipped_documents = 0
        self.bytes_in = 0

    @property
    def skipped_files(self) -> list[Path]:
        return self.reader.skipped_files

    def in_val(self, k: int, j: int) -> bool:
        u = unit_hash("val", self.opts.seed, k, j)
        if self.opts.val_docs is not None or (self.survey is not None and self.survey.val_cut is not None):
            return self.survey.val_cut is not None and (u, k, j) <= self.survey.val_cut
        return self.opts.val_fraction > 0 and u < self.opts.val_fraction

    def _to_encode(self) -> Iterator[tuple[int, int, str, int]]:
        """The documents of chunks without a record; notes every chunk met in `order`."""
        for k, j, text, read in self.reader:
            name = chunk_name(k, j // self.opts.chunk_docs)
            if not self.order or self.order[-1] != name:
                self.order.append(name)
                self.reused += name in self.done
            if name not in self.done:
                yield k, j, text, read

    def encode_all(self, progress: bool) -> list[dict]:
        """Encode and write every chunk not done before; the records of all, in order."""
        encoder = Encoder(self.vocab.encoding_json, self.dtype.name, self.vocab.eod_id if self.vocab.append_eod
                          else None, self.opts.split_sentences)
        writer, written = None, 0
        stream = _encoded(_batches(self._to_encode()), encoder, self.opts.workers)
        try:
            with byte_bar(self.reader.total, "preparing", progress) as bar:
                for meta, (tokens, lengths, counts) in stream:
                    seq_at = np.concatenate(([0], np.cumsum(lengths)))  # sequence s: tokens[seq_at[s]:seq_at[s+1]]
                    doc_at = np.concatenate(([0], np.cumsum(counts)))  # document d: sequences doc_at[d]..doc_at[d+1]
                    for d, (k, j, _) in enumerate(meta):
                        name = chunk_name(k, j // self.opts.chunk_docs)
                        if writer is None or writer.name != name:
                            if writer is not None:
                                self._finish(writer)
                            writer = ChunkWriter(self.out, name, self.dtype)
                        if counts[d] == 0:  # split_sentences: no sentence
                            self.skipped_documents += 1
                            continue
                        writer.add(self.in_val(k, j), [tokens[seq_at[s] : seq_at[s + 1]]
                                                       for s in range(doc_at[d], doc_at[d + 1])])
                    written += len(meta)
                    bar.set_postfix_str(f"{written:,} documents", refresh=False)
                    bar.update(meta[-1][2] - bar.n)
                if writer is not None:
                    self._finish(writer)
                    writer = None
        finally:
            stream.close()  # stops the workers at once on an error
            if writer is not None:
                writer.discard()
        self.bytes_in = self.reader.total
        return [self.done[name] for name in self.order]

    def _finish(self, writer: ChunkWriter) -> None:
        record = writer.finalize(self.vocab.sha256)
        write_json(self.out / CHUNKS / f"{writer.name}.json", record)  # last: the chunk is done
        self.done[writer.name] = record
        self.encoded += 1
