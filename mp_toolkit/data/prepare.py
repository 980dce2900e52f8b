"""`mpt data prepare`: input files -> a prepared directory (`mp_toolkit.data.prepared`) of Megatron
indexed datasets, streamed, encoded by worker processes and restartable; `merge` joins the parts of a
sharded preparation and `verify` checks every byte.

    done = prepare(["data/"], "prepared/", vocab_size=8192, workers=8, val_fraction=0.01)
    print(done.line())                       # documents / sequences / tokens per split, MB/s
    corpus = PreparedCorpus.open(done.path)

    mpt data prepare --input data/ --output prepared/ --tokenizer gpt2/ --workers 16 --val-fraction 0.01
    mpt data prepare --input a.jsonl b.jsonl --output prepared/ --tokenizer t.json --shard 0/2   # and 1/2
    mpt data merge prepared/ && mpt data verify prepared/

This module runs the pipeline (`prepare`) and keeps DIR's settings; the steps live beside it:
`prepare_options` (the arguments, checked), `survey` (steps 3-4: the reading pass, the tokenizer),
`encode` (step 5: the worker pool), `prepared_files` (the chunk records, the manifest, the lock, `merge`,
`verify`), `atomic` (every file whole or absent).

The pipeline, in order:

1. The inputs are expanded (`sources.expand`: file k is the k-th, a fixed order) and a given tokenizer
   is read, before anything is written.
2. ``DIR/.lock`` is held (fcntl.flock) for the whole run, and the settings are compared with
   ``DIR/prepare.json`` (written by the first run): a re-run with other settings is refused.
3. A survey pass, only when needed, reads the documents without encoding them: the tokenizer's training
   sample (``vocab_size``) and the validation cut (``val_docs``).
4. ``DIR/tokenizer.json``: the given file copied, or our byte-level BPE (`tokens.train_tokenizer`) trained
   on the sample; with ``split_sentences`` the BERT specials (`tokens.SPECIAL_TOKENS`) are appended after
   training as its last ids (``vocab_size`` counts them), and sentences are encoded by the BPE without
   them, so a literal "[SEP]" stays text.
5. The encode pass: documents go in batches to ``workers`` processes (at most `encode.WINDOW_PER_WORKER`
   batches per worker in flight: memory does not grow with the corpus) and come back in order into chunk
   (k, c)'s two shards, ``train/fKKKKK-cCCCCC`` and ``val/fKKKKK-cCCCCC``; a finished chunk records
   itself in ``DIR/chunks/fKKKKK-cCCCCC.json``, last.
6. The manifest, written atomically from the chunk records (with ``shard``, the part's manifest).

Choices, each fixed here:

- Document j of file k (j counts the file's non-empty texts from 0) is in chunk j // chunk_docs.
- Validation is chosen by document: u(seed, k, j), a hash mapped to [0, 1), below ``val_fraction`` (with
  ``val_min_docs`` M: when fewer than M fall under it, the M of smallest u, at most all but one); or,
  with ``val_docs`` K, the K documents of smallest u in the whole corpus (the survey keeps the K
  smallest: O(K) memory, one reading pass without encoding, over every input file, a part's too), so
  exactly K input documents (with ``split_sentences`` a document without a sentence is dropped from
  either split).
- A split of a chunk with no document writes no shard: its record says null, the manifest omits it.
- Sentences (``split_sentences``): a document's stripped non-empty lines, each cut where
  `encode.SENTENCE_END` matches (., ! or ? then whitespace then a capital, digit, quote or opening
  bracket); a sentence that encodes to no token is dropped; a document with no sentence is skipped and
  counted.
- The end-of-document id is the first of `survey.EOD_TOKENS` the tokenizer has, appended to each
  document's last sequence (by default unless ``split_sentences``; asked for and missing: an error).
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

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer

from mp_toolkit.data.atomic import write_bytes
from mp_toolkit.data.encode import EncodePass, sentences_of
from mp_toolkit.data.prepare_options import DEFAULT_CHUNK_DOCS, DEFAULT_SAMPLE_BYTES, Options, parse_shard
from mp_toolkit.data.prepared import MANIFEST, TOKENIZER
from mp_toolkit.data.prepared_files import (
    build_manifest,
    check_not_empty,
    json_bytes,
    lock_name,
    locked,
    merge,
    part_name,
    read_json_object,
    shard_counts,
    verify,
    write_json,
)
from mp_toolkit.data.sources import Source, expand
from mp_toolkit.data.survey import EOD_TOKENS, eod_id, read_given_tokenizer, settle_tokenizer, survey_corpus
from mp_toolkit.data.tokens import SPECIAL_TOKENS
from mp_toolkit.errors import DataError
from mp_toolkit.user_files import parse_json, special_kind, writing

__all__ = [  # prepare, and what `mpt data` and its tests take from here
    "DEFAULT_CHUNK_DOCS", "DEFAULT_SAMPLE_BYTES", "PrepareSummary", "merge", "parse_shard",
    "prepare", "sentences_of", "shard_counts", "verify",
]

SETTINGS = "prepare.json"


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
            shard: tuple[int, int] = (0, 1), progress: bool = False, command: str | None = None,
            val_min_docs: int = 0) -> PrepareSummary:
    """Prepare ``inputs`` into the directory ``output`` (module docstring; each argument is the `Options`
    field of its name, ``sample_bytes`` is --tokenizer-sample-bytes); ``progress``: a bar on a terminal;
    ``command``: what the manifest records (default: the equivalent ``mpt data prepare`` line). Returns what
    was done, ``.path`` the directory `PreparedCorpus.open` reads. A re-run of a finished DIR does nothing."""
    start = time.monotonic()
    opts = Options(tuple(map(str, inputs)), Path(output), None if tokenizer is None else Path(tokenizer), vocab_size,
                   workers, json_key, split_sentences, append_eod, val_fraction, val_docs, seed, sample_bytes,
                   chunk_docs, tuple(shard), val_min_docs)
    opts.check()
    sources = expand(list(opts.inputs), exclude=opts.output)
    given = read_given_tokenizer(opts.tokenizer) if opts.tokenizer is not None else None
    missing = [t for t in SPECIAL_TOKENS if given is not None and given[0].token_to_id(t) is None]
    if opts.split_sentences and missing:
        raise DataError(f"--split-sentences: tokenizer {opts.tokenizer} lacks {', '.join(missing)}, which BERT's "
                        "sentence pairs need (give a BERT tokenizer, or --vocab-size to train ours with them)")
    if given is not None and opts.append_eod and eod_id(given[0]) is None:
        raise DataError(f"--append-eod: tokenizer {opts.tokenizer} has none of {', '.join(EOD_TOKENS)} to end a "
                        "document with (drop --append-eod)")
    out = opts.output
    if out.exists() and not out.is_dir():
        raise DataError(f"--output {out} is {special_kind(out) or 'a file'}: give a directory (new or empty, or one "
                        "this command prepared)")
    with writing("--output", out):  # a place that cannot be made, a disk that fills: one line
        return _prepare_into(out, opts, sources, given, progress, command, start)


def _prepare_into(out: Path, opts: Options, sources: list[Source], given, progress: bool, command, start: float
                  ) -> PrepareSummary:
    out.mkdir(parents=True, exist_ok=True)
    i, n = opts.shard
    with locked(out / lock_name(i, n)):
        _claim(out, _settings(opts, sources, given))
        target = out / (MANIFEST if n == 1 else part_name(i, n))
        if target.is_file():  # finished before: nothing to do
            manifest = parse_json(target.read_bytes())
            return PrepareSummary(out, manifest, 0, time.monotonic() - start, opts.workers, 0, 0, 0, 0)
        need_sample = given is None and not (out / TOKENIZER).is_file()
        survey_needed = need_sample or opts.val_docs is not None or opts.val_min_docs > 0
        survey = survey_corpus(sources, opts, need_sample, progress) if survey_needed else None
        vocab = settle_tokenizer(out, opts, given, survey, progress)
        run = EncodePass(out, opts, sources, vocab, survey)
        records = run.encode_all(progress)
        manifest = build_manifest(opts, sources, vocab, survey, records, command or _command_line(opts))
        if n == 1:
            check_not_empty(manifest, opts)
        write_json(target, manifest)
    return PrepareSummary(out, manifest, run.bytes_in, time.monotonic() - start, opts.workers, run.encoded,
                          run.reused, len(run.skipped_files), run.skipped_documents)


def _settings(opts: Options, sources: list[Source], given: tuple[Tokenizer, bytes, str] | None) -> dict:
    """What a re-run must repeat to continue DIR's preparation (``DIR/prepare.json``)."""
    return {"format": "mp_toolkit.prepare-settings", "version": 1,
            "inputs": [{"path": str(s.path.resolve()), "bytes": s.size} for s in sources],
            "tokenizer": {"sha256": given[2]} if given else {"train_vocab_size": opts.vocab_size,
                                                            "sample_bytes": opts.sample_bytes},
            "json_keys": [opts.json_key], "split_sentences": opts.split_sentences, "append_eod": opts.append_eod,
            "val_fraction": opts.val_fraction, "val_docs": opts.val_docs, "val_min_docs": opts.val_min_docs,
            "seed": opts.seed,
            "chunk_docs": opts.chunk_docs, "shards": opts.shard[1]}


SETTING_DEFAULTS = {"val_min_docs": 0}
"""Settings added after the first prepared directories: what a prepare.json without them meant."""


def _claim(out: Path, settings: dict) -> None:
    """Write DIR/prepare.json, or check that this run's settings are the ones there."""
    file = out / SETTINGS
    if not file.is_file():
        # hidden names are ours (locks, temporary files); prepare.json may be a part's started beside this one
        others = [p.name for p in out.iterdir() if not p.name.startswith(".") and p.name != SETTINGS]
        if others:
            raise DataError(f"--output {out} is not empty ({others[0]}, ...) and was not prepared by `mpt data "
                            "prepare`: give a new or empty directory")
        if write_bytes(file, json_bytes(settings), private=False, replace=False):
            return
    before = read_json_object(file, "the settings file `mpt data prepare` writes: give a new or empty --output")
    for key, value in settings.items():
        if before.get(key, SETTING_DEFAULTS.get(key)) != value:  # a setting newer than DIR: its default there
            if key == "inputs":
                old, new = before.get(key) or [], value
                diff = next((f"{a['path']} ({a['bytes']} bytes) there, {b['path']} ({b['bytes']} bytes) here"
                             for a, b in zip(old, new) if a != b), f"{len(old)} input files there, {len(new)} here")
                reason = f"other inputs ({diff})"
            else:
                reason = f"{key} {json.dumps(before.get(key))} there, {json.dumps(value)} here"
            raise DataError(f"--output {out} was prepared with other settings: {reason}; re-run with the same "
                            "settings to continue it, or use another --output")


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
    words += ["--val-min-docs", str(opts.val_min_docs)] if opts.val_min_docs else []
    words += ["--seed", str(opts.seed), "--chunk-docs", str(opts.chunk_docs), "--shard", "/".join(map(str, opts.shard))]
    return " ".join(words)
