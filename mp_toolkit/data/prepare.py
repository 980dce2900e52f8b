"""`mpt data prepare`: input files -> a prepared directory (`mp_toolkit.data.prepared`) of Megatron
indexed datasets, streamed, encoded by worker processes and restartable; `merge` joins the parts of a
sharded preparation and `verify` checks every byte.

    done = prepare(["data/"], "prepared/", vocab_size=8192, workers=8, val_fraction=0.01)
    print(done.line())                       # documents / sequences / tokens per split, MB/s
    corpus = PreparedCorpus.open(done.path)

    mpt data prepare --input data/ --output prepared/ --tokenizer gpt2/ --workers 16 --val-fraction 0.01
    mpt data prepare --input a.jsonl b.jsonl --output prepared/ --tokenizer t.json --shard 0/2   # and 1/2
    mpt data merge prepared/ && mpt data verify prepared/

The pipeline, in order:

1. The inputs are expanded (`sources.expand`: file k is the k-th, a fixed order) and a given tokenizer
   is read, before anything is written.
2. ``DIR/.lock`` is held (fcntl.flock) for the whole run, and the settings are compared with
   ``DIR/prepare.json`` (written by the first run): a re-run with other settings is refused.
3. A survey pass, only when needed, reads the documents without encoding them: the tokenizer's training
   sample (``vocab_size``) and the validation cut (``val_docs``).
4. ``DIR/tokenizer.json``: the given file copied, or our byte-level BPE (`tokens.train_tokenizer`) trained
   on the sample; with ``split_sentences`` the BERT specials are appended after training as
   `mp_toolkit.data.mlm.bert_tokenizer` does (``vocab_size`` counts them), and sentences are encoded by
   the BPE without them, so a literal "[SEP]" stays text, as in `mlm`.
5. The encode pass: documents go in batches to ``workers`` processes (at most `WINDOW_PER_WORKER` batches
   per worker in flight: memory does not grow with the corpus) and come back in order into chunk
   (k, c)'s two shards, ``train/fKKKKK-cCCCCC`` and ``val/fKKKKK-cCCCCC``; a finished chunk records
   itself in ``DIR/chunks/fKKKKK-cCCCCC.json``, last.
6. The manifest, written atomically from the chunk records (with ``shard``, the part's manifest).

Choices, each fixed here:

- Document j of file k (j counts the file's non-empty texts from 0) is in chunk j // chunk_docs.
- Validation is chosen by document: u(seed, k, j), a hash mapped to [0, 1), below ``val_fraction``; or,
  with ``val_docs`` K, the K documents of smallest u in the whole corpus (the survey keeps the K
  smallest: O(K) memory, one reading pass without encoding, over every input file, a part's too), so
  exactly K input documents (with ``split_sentences`` a document without a sentence is dropped from
  either split).
- A split of a chunk with no document writes no shard: its record says null, the manifest omits it.
- Sentences (``split_sentences``): a document's stripped non-empty lines, each cut where `SENTENCE_END`
  matches (., ! or ? then whitespace then a capital, digit, quote or opening bracket); a sentence that
  encodes to no token is dropped; a document with no sentence is skipped and counted.
- The end-of-document id is the first of `EOD_TOKENS` the tokenizer has, appended to each document's
  last sequence (by default unless ``split_sentences``; asked for and missing: an error).
- The tokenizer's sample: the documents of smallest u'(seed, k, j) (another hash), as many as fit in
  ``sample_bytes`` of UTF-8 taken in u' order (at least one), in corpus order: a seeded, uniform sample
  of whole documents, kept in a heap of at most ``sample_bytes`` during one reading pass.
- Restart: a chunk whose record exists (and whose shard files are there, encoded with this tokenizer)
  is not encoded again; its documents are read and passed over. Shards are written under ``*.partial``
  names until complete (`IndexedWriter`). A finished DIR (its manifest there) is left as it is.
- ``shard=(i, n)``: only files with k % n == i, the part's manifest ``manifest.part-i-of-n.json``, its
  own lock ``.lock-i-of-n`` (the parts of one DIR run at once); n > 1 needs a given tokenizer (every
  part must encode alike). `merge` writes manifest.json when every part is there.
"""

from __future__ import annotations

import fcntl
import hashlib
import heapq
import itertools
import json
import math
import multiprocessing
import os
import re
import signal
import sys
import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer
from tqdm import tqdm

from mp_toolkit.data.indexed import IndexedDataset, IndexedWriter, bin_path, idx_path, is_complete, token_dtype
from mp_toolkit.data.prepared import FORMAT, MANIFEST, SPLITS, TOKENIZER, VERSION, PreparedCorpus
from mp_toolkit.data.sources import Documents, Source, expand
from mp_toolkit.data.tokens import MIN_VOCAB, load_tokenizer_file, train_tokenizer
from mp_toolkit.errors import DataError
from mp_toolkit.progress import DELAY_S

EOD_TOKENS = ("<|endoftext|>", "<|end_of_text|>", "</s>", "[SEP]")
"""End-of-document tokens, in the order they are looked for: GPT-2 / ours, Llama 3, Llama 2 / T5, BERT."""
BERT_SPECIAL_TOKENS = ("[PAD]", "[CLS]", "[SEP]", "[MASK]")
"""`mp_toolkit.data.mlm.SPECIAL_TOKENS` (mlm imports torch, which preparing does not need; a test checks
the two agree)."""
SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z0-9\"'(\[])")
SETTINGS = "prepare.json"
CHUNKS = "chunks"
DEFAULT_CHUNK_DOCS = 100_000
DEFAULT_SAMPLE_BYTES = 64_000_000
BATCH_DOCS = 256  # documents per encode_batch call in a worker
BATCH_CHARS = 1 << 22  # ... or fewer, when they hold this many characters
WINDOW_PER_WORKER = 2  # batches in flight per worker: enough to keep it busy, bounded memory
HASH_BYTES = 1 << 20


@dataclass(frozen=True)
class Options:
    """What `prepare` is asked to do: its arguments, checked by `check` before anything is written."""

    inputs: tuple[str, ...]
    """Files, directories, save_to_disk directories or "stdlib" (`sources.expand`)."""
    output: Path
    """The prepared directory."""
    tokenizer: Path | None
    """A tokenizer.json or a directory holding one; or None and ``vocab_size``."""
    vocab_size: int | None
    """Train our byte-level BPE of this many ids (the BERT specials included with ``split_sentences``)."""
    workers: int
    """Encoding processes; 1 encodes in this process."""
    json_key: str
    """The JSON field, or Parquet / Arrow column, that holds a document's text."""
    split_sentences: bool
    """Sequences are sentences, grouped by document (BERT)."""
    append_eod: bool | None
    """End each document with the end-of-document id; None: when the tokenizer has one, unless ``split_sentences``."""
    val_fraction: float
    """The share of documents, chosen by hash, that go to val."""
    val_docs: int | None
    """Exactly this many documents go to val (instead of ``val_fraction``)."""
    seed: int
    """Seeds the val choice and the tokenizer's sample."""
    sample_bytes: int
    """UTF-8 bytes of whole documents the tokenizer trains on (at most; at least one document)."""
    chunk_docs: int
    """Input documents per chunk: a shard pair, and the unit a re-run skips."""
    shard: tuple[int, int]
    """(i, n): prepare files k with k % n == i only."""

    def check(self) -> None:
        if not self.inputs:
            raise DataError("no --input given: name files, directories or 'stdlib'")
        if (self.tokenizer is None) == (self.vocab_size is None):
            raise DataError("give exactly one of --tokenizer (a tokenizer.json or its directory) and --vocab-size "
                            "(train our byte-level BPE)")
        least = MIN_VOCAB + (len(BERT_SPECIAL_TOKENS) if self.split_sentences else 0)
        if self.vocab_size is not None and self.vocab_size < least:
            raise DataError(f"--vocab-size {self.vocab_size} is too small for byte-level BPE"
                            f"{' plus the 4 BERT special tokens' if self.split_sentences else ''}: use at least "
                            f"{least}")
        for name, value in (("--workers", self.workers), ("--chunk-docs", self.chunk_docs),
                            ("--tokenizer-sample-bytes", self.sample_bytes)):
            if value < 1:
                raise DataError(f"{name} {value} must be at least 1")
        if not 0.0 <= self.val_fraction < 1.0:
            raise DataError(f"--val-fraction {self.val_fraction} must be in [0, 1)")
        if self.val_docs is not None and (self.val_docs < 0 or self.val_fraction):
            raise DataError(f"--val-docs {self.val_docs}: give a count >= 0, and not with --val-fraction")
        i, n = self.shard
        if not 0 <= i < n:
            raise DataError(f"--shard {i}/{n} is not i/n with 0 <= i < n")
        if n > 1 and self.tokenizer is None:
            raise DataError(f"--shard {i}/{n} needs --tokenizer: every part must encode with the same tokenizer "
                            "(train one with an unsharded run, or use --shard 0/1)")


def parse_shard(text: str) -> tuple[int, int]:
    """``"i/n"`` -> (i, n); a `DataError` for anything else."""
    m = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", text)
    if not m or not int(m[1]) < int(m[2]):
        raise DataError(f"--shard {text!r} is not i/n with 0 <= i < n (e.g. 0/4)")
    return int(m[1]), int(m[2])


@dataclass(frozen=True)
class PrepareSummary:
    """What `prepare` did: ``path`` is the prepared DIR; ``manifest`` what it wrote (or found there)."""

    path: Path
    manifest: dict
    bytes_in: int
    seconds: float
    workers: int
    chunks_encoded: int
    chunks_reused: int
    skipped_files: int
    skipped_documents: int

    def line(self) -> str:
        """The one summary line `mpt data prepare` prints."""
        totals = self.manifest["totals"]
        splits = "; ".join(f"{s} {t['documents']:,} documents, {t['sequences']:,} sequences, {t['tokens']:,} "
                           f"tokens" for s, t in totals.items())
        mb = self.bytes_in / 1e6
        rate = mb / self.seconds if self.seconds > 0 else 0.0
        shard = self.manifest.get("shard")
        what = f"part {shard[0]} of {shard[1]} of {self.path}" if shard else str(self.path)
        line = (f"prepared {what}: {splits}; {mb:,.2f} MB in, {self.seconds:.1f} s, {rate:,.2f} MB/s, "
                f"{self.workers} workers; {self.chunks_encoded} chunks encoded, {self.chunks_reused} done before")
        if self.skipped_files:
            line += f"; {self.skipped_files} non-UTF-8 stdlib files skipped"
        if self.skipped_documents:
            line += f"; {self.skipped_documents} documents without a sentence skipped"
        return line


def prepare(inputs, output, *, tokenizer: str | os.PathLike | None = None, vocab_size: int | None = None,
            workers: int = 1, json_key: str = "text", split_sentences: bool = False, append_eod: bool | None = None,
            val_fraction: float = 0.0, val_docs: int | None = None, seed: int = 0,
            sample_bytes: int = DEFAULT_SAMPLE_BYTES, chunk_docs: int = DEFAULT_CHUNK_DOCS,
            shard: tuple[int, int] = (0, 1), progress: bool = False, command: str | None = None) -> PrepareSummary:
    """Prepare ``inputs`` into the directory ``output`` (module docstring; each argument is the `Options`
    field of its name, ``sample_bytes`` is --tokenizer-sample-bytes); ``progress``: a bar on a terminal;
    ``command``: what the manifest records (default: the equivalent ``mpt data prepare`` line). Returns what
    was done, ``.path`` the directory `PreparedCorpus.open` reads. A re-run of a finished DIR does nothing."""
    start = time.monotonic()
    opts = Options(tuple(map(str, inputs)), Path(output), None if tokenizer is None else Path(tokenizer), vocab_size,
                   workers, json_key, split_sentences, append_eod, val_fraction, val_docs, seed, sample_bytes,
                   chunk_docs, tuple(shard))
    opts.check()
    sources = expand(list(opts.inputs), exclude=opts.output)
    given = _given_tokenizer(opts.tokenizer) if opts.tokenizer is not None else None
    if given is not None and opts.append_eod and _eod_id(given[0]) is None:
        raise DataError(f"--append-eod: tokenizer {opts.tokenizer} has none of {', '.join(EOD_TOKENS)} to end a "
                        "document with (drop --append-eod)")
    out = opts.output
    if out.exists() and not out.is_dir():
        raise DataError(f"--output {out} is a file: give a directory (new or empty, or one this command prepared)")
    out.mkdir(parents=True, exist_ok=True)
    i, n = opts.shard
    with _locked(out / (".lock" if n == 1 else f".lock-{i}-of-{n}")):
        _claim(out, _settings(opts, sources, given))
        target = out / (MANIFEST if n == 1 else part_name(i, n))
        if target.is_file():  # finished before: nothing to do
            manifest = json.loads(target.read_bytes())
            return PrepareSummary(out, manifest, 0, time.monotonic() - start, opts.workers, 0, 0, 0, 0)
        need_sample = given is None and not (out / TOKENIZER).is_file()
        survey = _survey(sources, opts, need_sample, progress) if need_sample or opts.val_docs is not None else None
        vocab = _tokenizer(out, opts, given, survey)
        run = _Run(out, opts, sources, vocab, survey)
        records = run.encode_all(progress)
        manifest = _manifest(opts, sources, vocab, survey, records, command or _command_line(opts))
        if n == 1:
            _check_not_empty(manifest, opts)
        _write_json(target, manifest)
    return PrepareSummary(out, manifest, run.bytes_in, time.monotonic() - start, opts.workers, run.encoded,
                          run.reused, len(run.skipped_files), run.skipped_documents)


# ---- settings, lock, atomic files --------------------------------------------------------------------------


@contextmanager
def _locked(path: Path):
    """Hold ``path`` with fcntl.flock (released when the process ends, however it ends)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            raise DataError(f"{path.parent} is being prepared by process {holder} (it holds {path.name}): wait "
                            "for it or use another --output") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)


def _settings(opts: Options, sources: list[Source], given: tuple[Tokenizer, bytes, str] | None) -> dict:
    """What a re-run must repeat to continue DIR's preparation (``DIR/prepare.json``)."""
    return {"format": "mp_toolkit.prepare-settings", "version": 1,
            "inputs": [{"path": str(s.path.resolve()), "bytes": s.size} for s in sources],
            "tokenizer": {"sha256": given[2]} if given else {"train_vocab_size": opts.vocab_size,
                                                            "sample_bytes": opts.sample_bytes},
            "json_keys": [opts.json_key], "split_sentences": opts.split_sentences, "append_eod": opts.append_eod,
            "val_fraction": opts.val_fraction, "val_docs": opts.val_docs, "seed": opts.seed,
            "chunk_docs": opts.chunk_docs, "shards": opts.shard[1]}


def _claim(out: Path, settings: dict) -> None:
    """Write DIR/prepare.json, or check that this run's settings are the ones there."""
    file = out / SETTINGS
    if not file.is_file():
        # hidden names are ours (locks, temporary files); prepare.json may be a part's started beside this one
        others = [p.name for p in out.iterdir() if not p.name.startswith(".") and p.name != SETTINGS]
        if others:
            raise DataError(f"--output {out} is not empty ({others[0]}, ...) and was not prepared by `mpt data "
                            "prepare`: give a new or empty directory")
        if _write_atomic(file, _json_bytes(settings), replace=False):
            return
    try:
        before = json.loads(file.read_bytes())
    except (OSError, ValueError) as e:
        raise DataError(f"cannot read {file}: {e}") from None
    for key, value in settings.items():
        if before.get(key) != value:
            if key == "inputs":
                old, new = before.get(key) or [], value
                diff = next((f"{a['path']} ({a['bytes']} bytes) there, {b['path']} ({b['bytes']} bytes) here"
                             for a, b in zip(old, new) if a != b), f"{len(old)} input files there, {len(new)} here")
                reason = f"other inputs ({diff})"
            else:
                reason = f"{key} {json.dumps(before.get(key))} there, {json.dumps(value)} here"
            raise DataError(f"--output {out} was prepared with other settings: {reason}; re-run with the same "
                            "settings to continue it, or use another --output")


def _json_bytes(doc: dict) -> bytes:
    return (json.dumps(doc, indent=1) + "\n").encode()


def _write_json(path: Path, doc: dict) -> None:
    _write_atomic(path, _json_bytes(doc))


def _write_atomic(path: Path, data: bytes, replace: bool = True) -> bool:
    """Write ``data`` under a temporary name, fsync, rename: ``path`` is whole or absent. ``replace=False``:
    only if ``path`` does not exist (linked, not renamed; False when it does). The file keeps the umask's
    mode, unlike `tokens`' 0600 caches: a prepared corpus is data to share."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        if replace:
            os.replace(tmp, path)
        else:
            os.link(tmp, path)
    except FileExistsError:
        return False
    finally:
        tmp.unlink(missing_ok=True)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return True


def part_name(i: int, n: int) -> str:
    return f"manifest.part-{i}-of-{n}.json"


def _command_line(opts: Options) -> str:
    """The ``mpt data prepare`` line equivalent to ``opts`` (for a manifest written by a Python caller)."""
    words = ["mpt data prepare --input", *opts.inputs, "--output", str(opts.output)]
    words += ["--tokenizer", str(opts.tokenizer)] if opts.tokenizer else ["--vocab-size", str(opts.vocab_size),
                                                                         "--tokenizer-sample-bytes",
                                                                         str(opts.sample_bytes)]
    words += ["--json-keys", opts.json_key] + (["--split-sentences"] if opts.split_sentences else [])
    if opts.append_eod is not None:
        words.append("--append-eod" if opts.append_eod else "--no-append-eod")
    words += ["--val-docs", str(opts.val_docs)] if opts.val_docs is not None else ["--val-fraction",
                                                                                   str(opts.val_fraction)]
    words += ["--seed", str(opts.seed), "--chunk-docs", str(opts.chunk_docs), "--shard", "/".join(map(str, opts.shard))]
    return " ".join(words)


# ---- documents, hashes and the survey -----------------------------------------------------------------------


def _unit(purpose: str, seed: int, k: int, j: int) -> float:
    """A hash of (purpose, seed, file k, document j) mapped to [0, 1): the same on every run and machine."""
    digest = hashlib.blake2b(f"{purpose}:{seed}:{k}:{j}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2.0**64


def _bar(total: int, desc: str, enabled: bool) -> tqdm:
    """Bytes of input under a tqdm bar on a terminal (as `mp_toolkit.progress`: after DELAY_S, stderr a TTY)."""
    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, delay=DELAY_S, file=sys.stderr, leave=False,
                dynamic_ncols=True, disable=not (enabled and sys.stderr.isatty()))


@dataclass
class _Survey:
    """One reading pass's findings: the tokenizer's sample, the val cut, the corpus's document count."""

    sample: list[str] = field(default_factory=list)
    val_cut: tuple[float, int, int] | None = None
    """The largest (u, k, j) that goes to val (``val_docs``); None: no document does."""
    documents: int = 0


def _survey(sources: list[Source], opts: Options, need_sample: bool, progress: bool) -> _Survey:
    """Read every file once, without encoding (module docstring: the sample and ``val_docs``)."""
    reader = Documents(sources, list(range(len(sources))), opts.json_key)
    sample: list[tuple[float, int, int, int, str]] = []  # max-heap by u: (-u, k, j, bytes, text)
    held, cut = 0, math.inf  # cut: the smallest u dropped; a document at or above it would be dropped too
    val: list[tuple[float, int, int]] = []  # max-heap of the val_docs smallest (u, k, j), negated
    result = _Survey()
    with _bar(reader.total, "reading corpus (tokenizer sample, val split)", progress) as bar:
        for k, j, text, read in reader:
            result.documents += 1
            bar.update(read - bar.n)
            u = _unit("sample", opts.seed, k, j) if need_sample else math.inf
            if u < cut:
                size = len(text.encode("utf-8"))
                heapq.heappush(sample, (-u, k, j, size, text))
                held += size
                while held > opts.sample_bytes and len(sample) > 1:
                    dropped = heapq.heappop(sample)
                    held, cut = held - dropped[3], -dropped[0]
            if opts.val_docs:
                heapq.heappush(val, (-_unit("val", opts.seed, k, j), -k, -j))
                if len(val) > opts.val_docs:
                    heapq.heappop(val)
    if not result.documents:
        raise DataError(f"the inputs ({', '.join(opts.inputs)}) hold no documents")
    if opts.val_docs is not None and opts.val_docs >= result.documents:
        raise DataError(f"--val-docs {opts.val_docs} leaves no training document: the corpus has "
                        f"{result.documents}")
    result.sample = [text for _, _, _, _, text in sorted(sample, key=lambda e: (e[1], e[2]))]
    if val:
        u, k, j = val[0]
        result.val_cut = (-u, -k, -j)
    return result


# ---- the tokenizer -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Vocab:
    """The tokenizer as preparing needs it."""

    encoding_json: str
    """What the workers encode with (the saved tokenizer; with trained BERT specials, the BPE without them)."""
    sha256: str
    """Of DIR/tokenizer.json."""
    vocab_size: int
    eod_id: int | None
    append_eod: bool


def _given_tokenizer(path: Path) -> tuple[Tokenizer, bytes, str]:
    """(tokenizer, its file's bytes, their sha256) of a tokenizer.json or a directory holding one."""
    file = path / TOKENIZER if path.is_dir() else path
    if not file.is_file():
        raise DataError(f"--tokenizer {path}: {file} does not exist (give a tokenizer.json or its directory)")
    tok, digest = load_tokenizer_file(file)
    return tok, file.read_bytes(), digest


def _tokenizer(out: Path, opts: Options, given, survey: _Survey | None) -> _Vocab:
    """DIR/tokenizer.json written (or found, on a restart) and what encodes."""
    file = out / TOKENIZER
    if given is not None:
        tok, raw, digest = given
        if not file.is_file() or hashlib.sha256(file.read_bytes()).hexdigest() != digest:
            _write_atomic(file, raw)
        encoding = tok
    elif file.is_file():  # trained by an earlier run of this command (prepare.json matched)
        tok, digest = load_tokenizer_file(file)
        encoding = _without(tok, BERT_SPECIAL_TOKENS) if opts.split_sentences else tok
    else:
        n_special = len(BERT_SPECIAL_TOKENS) if opts.split_sentences else 0
        with _scratch(out) as cache:  # train_tokenizer caches by corpus; this sample is used once
            encoding = train_tokenizer(survey.sample, opts.vocab_size - n_special, cache)
        tok = Tokenizer.from_str(encoding.to_str())
        if n_special:
            tok.add_special_tokens(list(BERT_SPECIAL_TOKENS))
        raw = tok.to_str().encode()
        _write_atomic(file, raw)
        digest = hashlib.sha256(raw).hexdigest()
    vocab_size = max(tok.get_vocab(with_added_tokens=True).values()) + 1
    eod = _eod_id(tok)
    append = (eod is not None and not opts.split_sentences) if opts.append_eod is None else opts.append_eod
    return _Vocab(encoding.to_str(), digest, vocab_size, eod, append)


def _eod_id(tok: Tokenizer) -> int | None:
    return next((i for i in map(tok.token_to_id, EOD_TOKENS) if i is not None), None)


def _without(tok: Tokenizer, specials: tuple[str, ...]) -> Tokenizer:
    """``tok`` less the added tokens named (the BPE that `mlm` encodes with, from the one it decodes with)."""
    doc = json.loads(tok.to_str())
    doc["added_tokens"] = [t for t in doc["added_tokens"] if t["content"] not in specials]
    return Tokenizer.from_str(json.dumps(doc))


@contextmanager
def _scratch(out: Path):
    scratch = out / ".tokenizer-training"
    scratch.mkdir(exist_ok=True)
    try:
        yield scratch
    finally:
        for p in scratch.iterdir():
            p.unlink()
        scratch.rmdir()


# ---- encoding ------------------------------------------------------------------------------------------------


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


def chunk_name(k: int, c: int) -> str:
    return f"f{k:05d}-c{c:05d}"


class _Run:
    """The encode pass of one `prepare` (module docstring, step 5): chunks written, records kept in order."""

    def __init__(self, out: Path, opts: Options, sources: list[Source], vocab: _Vocab, survey: _Survey | None):
        self.out, self.opts, self.vocab, self.survey = out, opts, vocab, survey
        i, n = opts.shard
        self.reader = Documents(sources, [k for k in range(len(sources)) if k % n == i], opts.json_key)
        self.dtype = token_dtype(vocab.vocab_size)
        self.done = dict(_records(out, vocab.sha256))
        self.order: list[str] = []  # every chunk met, in (file, chunk) order
        self.encoded = self.reused = self.skipped_documents = 0
        self.bytes_in = 0

    @property
    def skipped_files(self) -> list[Path]:
        return self.reader.skipped_files

    def in_val(self, k: int, j: int) -> bool:
        if self.opts.val_docs is None:
            return self.opts.val_fraction > 0 and _unit("val", self.opts.seed, k, j) < self.opts.val_fraction
        u = _unit("val", self.opts.seed, k, j)
        return self.survey.val_cut is not None and (u, k, j) <= self.survey.val_cut

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
            with _bar(self.reader.total, "preparing", progress) as bar:
                for meta, (tokens, lengths, counts) in stream:
                    seq_at = np.concatenate(([0], np.cumsum(lengths)))  # sequence s: tokens[seq_at[s]:seq_at[s+1]]
                    doc_at = np.concatenate(([0], np.cumsum(counts)))  # document d: sequences doc_at[d]..doc_at[d+1]
                    for d, (k, j, _) in enumerate(meta):
                        name = chunk_name(k, j // self.opts.chunk_docs)
                        if writer is None or writer.name != name:
                            if writer is not None:
                                self._finish(writer)
                            writer = _ChunkWriter(self.out, name, self.dtype)
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

    def _finish(self, writer: _ChunkWriter) -> None:
        record = writer.finalize(self.vocab.sha256)
        _write_json(self.out / CHUNKS / f"{writer.name}.json", record)  # last: the chunk is done
        self.done[writer.name] = record
        self.encoded += 1


class _ChunkWriter:
    """Chunk ``name``'s train and val shards, written side by side."""

    def __init__(self, out: Path, name: str, dtype: np.dtype):
        self.name = name
        self.writers = {split: IndexedWriter(out / split / name, dtype) for split in SPLITS}
        self.documents = dict.fromkeys(SPLITS, 0)

    def add(self, val: bool, sequences: list[np.ndarray]) -> None:
        split = "val" if val else "train"
        self.writers[split].add_document(sequences)
        self.documents[split] += 1

    def finalize(self, tokenizer_sha256: str) -> dict:
        """Both shards complete (a split with no document: none, its partial files removed); the record."""
        record = {"chunk": self.name, "tokenizer_sha256": tokenizer_sha256}
        for split, writer in self.writers.items():
            if self.documents[split]:
                record[split] = {"prefix": f"{split}/{self.name}", **writer.finalize()}
            else:
                writer.discard()
                record[split] = None
        return record

    def discard(self) -> None:
        for writer in self.writers.values():
            writer.discard()


def _records(out: Path, tokenizer_sha256: str) -> Iterator[tuple[str, dict]]:
    """The chunk records that still hold: same tokenizer, every shard they name complete at its size
    (a chunk whose record fails this is encoded again)."""
    for file in sorted((out / CHUNKS).glob("f*-c*.json")):
        try:
            record = json.loads(file.read_bytes())
        except (OSError, ValueError):
            continue
        if record.get("tokenizer_sha256") != tokenizer_sha256:
            continue
        if all(_shard_intact(out, record.get(split)) for split in SPLITS):
            yield file.stem, record


def _shard_intact(out: Path, shard: dict | None) -> bool:
    if shard is None:
        return True
    prefix = out / shard["prefix"]
    return is_complete(prefix) and bin_path(prefix).stat().st_size == shard["bin_bytes"] and \
        idx_path(prefix).stat().st_size == shard["idx_bytes"]


# ---- the manifest, merge, verify -----------------------------------------------------------------------------


def _totals(splits: dict[str, list[dict]]) -> dict:
    return {split: {key: sum(s[key] for s in shards) for key in ("documents", "sequences", "tokens")}
            for split, shards in splits.items()}


def _manifest(opts: Options, sources: list[Source], vocab: _Vocab, survey: _Survey | None, records: list[dict],
              command: str) -> dict:
    """The manifest (`mp_toolkit.data.prepared`'s format) of these chunk records."""
    splits = {split: [r[split] for r in records if r[split]] for split in SPLITS}
    fraction = opts.val_fraction if opts.val_docs is None else opts.val_docs / survey.documents
    doc = {"format": FORMAT, "version": VERSION,
           "tokenizer": {"file": TOKENIZER, "sha256": vocab.sha256, "vocab_size": vocab.vocab_size,
                         "eod_id": vocab.eod_id},
           "dtype": token_dtype(vocab.vocab_size).name, "split_sentences": opts.split_sentences,
           "append_eod": vocab.append_eod, "json_keys": [opts.json_key], "val_fraction": fraction,
           "val_docs": opts.val_docs, "seed": opts.seed, "splits": splits, "totals": _totals(splits),
           "inputs": [{"path": str(s.path), "bytes": s.size} for s in sources], "command": command,
           "created": datetime.now(timezone.utc).isoformat(timespec="seconds")}
    if opts.shard[1] > 1:
        doc["shard"] = list(opts.shard)
    return doc


def _check_not_empty(manifest: dict, opts: Options) -> None:
    totals = manifest["totals"]
    if not totals["train"]["documents"]:
        if totals["val"]["documents"]:
            raise DataError(f"every document went to validation: lower --val-fraction {opts.val_fraction} / "
                            f"--val-docs {opts.val_docs}")
        what = "a sentence" if opts.split_sentences else "a document"
        raise DataError(f"the inputs ({', '.join(opts.inputs)}) hold no {what}")


MERGED_KEYS = ("tokenizer", "dtype", "split_sentences", "append_eod", "json_keys", "val_fraction", "val_docs", "seed",
               "inputs")
"""What every part of one sharded preparation must agree on."""


def merge(directory) -> dict:
    """Join DIR's ``manifest.part-i-of-n.json`` into DIR/manifest.json (every part there, none still
    running, one tokenizer); the manifest."""
    out = Path(directory)
    found = sorted(out.glob("manifest.part-*-of-*.json"))
    if not found:
        raise DataError(f"{out} has no manifest.part-i-of-n.json: run `mpt data prepare --shard i/n --output {out}` "
                        "for each part first")
    n = int(re.fullmatch(r"manifest\.part-\d+-of-(\d+)\.json", found[0].name)[1])
    parts = []
    for i in range(n):
        file = out / part_name(i, n)
        with _locked(out / f".lock-{i}-of-{n}"):  # a part still running is refused here
            if not file.is_file():
                raise DataError(f"{out} lacks {file.name}: run `mpt data prepare ... --shard {i}/{n}` to finish it")
            parts.append(json.loads(file.read_bytes()))
    for i, part in enumerate(parts[1:], start=1):
        for key in MERGED_KEYS:
            if part.get(key) != parts[0].get(key):
                what = "tokenizer digests" if key == "tokenizer" else key
                raise DataError(f"{out}: {part_name(i, n)} and {part_name(0, n)} differ in {what}: the parts come "
                                "from different preparations")
    splits = {split: sorted((s for p in parts for s in p["splits"][split]), key=lambda s: s["prefix"])
              for split in SPLITS}
    for shard in splits["train"] + splits["val"]:
        if not _shard_intact(out, shard):
            raise DataError(f"{out / shard['prefix']}.bin/.idx, listed by a part, is missing or not the size it "
                            "records")
    manifest = {**parts[0], "splits": splits, "totals": _totals(splits), "command": f"mpt data merge {out}",
                "parts": [p["command"] for p in parts],
                "created": datetime.now(timezone.utc).isoformat(timespec="seconds")}
    manifest.pop("shard", None)
    if not manifest["totals"]["train"]["documents"]:
        raise DataError(f"{out}: the parts hold no training document")
    _write_json(out / MANIFEST, manifest)
    return manifest


def verify(path) -> PreparedCorpus:
    """Open ``path`` (`PreparedCorpus.open`), check every shard's index against its data
    (`IndexedDataset.validate`) and every file's sha256 against the manifest; a `DataError` names the
    first that is wrong."""
    corpus = PreparedCorpus.open(path)
    for ds in corpus.train + corpus.val:
        ds.validate()
    if corpus.path.is_dir():
        for split in SPLITS:
            for shard in corpus.manifest["splits"].get(split, []):
                prefix = corpus.path / shard["prefix"]
                for file, key in ((bin_path(prefix), "bin_sha256"), (idx_path(prefix), "idx_sha256")):
                    digest = _sha256(file)
                    if digest != shard[key]:
                        raise DataError(f"{file} has sha256 {digest[:12]}..., {corpus.path / MANIFEST} says "
                                        f"{shard[key][:12]}...: changed after preparing")
    return corpus


def _sha256(file: Path) -> str:
    h = hashlib.sha256()
    with open(file, "rb") as f:
        while block := f.read(HASH_BYTES):
            h.update(block)
    return h.hexdigest()


def shard_counts(shards: tuple[IndexedDataset, ...]) -> str:
    """``N shards, D documents, S sequences, T tokens`` of opened shards."""
    return (f"{len(shards)} shards, {sum(ds.num_documents for ds in shards):,} documents, "
            f"{sum(len(ds) for ds in shards):,} sequences, {sum(ds.num_tokens for ds in shards):,} tokens")
