"""What `mp_toolkit.data.prepare.prepare` is asked to do: `Options`, its arguments, checked by
`Options.check` before anything is written, and the ``--shard i/n`` parser.

    opts = Options(("data/",), Path("prepared/"), None, 8192, 8, "text", False, None, 0.01, None, 0,
                   DEFAULT_SAMPLE_BYTES, DEFAULT_CHUNK_DOCS, parse_shard("0/1"))
    opts.check()   # a DataError naming the flag, its value and what would work
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from mp_toolkit.data.tokens import MAX_VOCAB, MIN_VOCAB, SPECIAL_TOKENS
from mp_toolkit.errors import DataError

DEFAULT_CHUNK_DOCS = 100_000
MAX_WORKERS_PER_CORE = 8
"""--workers beyond this many per core are refused (100,000 would start as many processes)."""
DEFAULT_SAMPLE_BYTES = 64_000_000


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
    val_min_docs: int = 0
    """With ``val_fraction``: when fewer documents than this fall under it, the this many of smallest hash go to
    val instead (at most all but one document; one extra reading pass)."""

    def check(self) -> None:
        if not self.inputs:
            raise DataError("no --input given: name files, directories or 'stdlib'")
        if (self.tokenizer is None) == (self.vocab_size is None):
            raise DataError("give exactly one of --tokenizer (a tokenizer.json or its directory) and --vocab-size "
                            "(train our byte-level BPE)")
        least = MIN_VOCAB + (len(SPECIAL_TOKENS) if self.split_sentences else 0)
        if self.vocab_size is not None and self.vocab_size < least:
            raise DataError(f"--vocab-size {self.vocab_size} is too small for byte-level BPE"
                            f"{' plus the 4 BERT special tokens' if self.split_sentences else ''}: use at least "
                            f"{least}")
        if self.vocab_size is not None and self.vocab_size > MAX_VOCAB:
            raise DataError(f"--vocab-size {self.vocab_size} is more than a tokenizer we train takes (at most "
                            f"{MAX_VOCAB})")
        for name, value in (("--workers", self.workers), ("--chunk-docs", self.chunk_docs),
                            ("--tokenizer-sample-bytes", self.sample_bytes)):
            if value < 1:
                raise DataError(f"{name} {value} must be at least 1")
        most = MAX_WORKERS_PER_CORE * (os.cpu_count() or 1)
        if self.workers > most:
            raise DataError(f"--workers {self.workers} is more than {MAX_WORKERS_PER_CORE} per core ({most} here): "
                            "more would only wait on each other")
        if not 0.0 <= self.val_fraction < 1.0:
            raise DataError(f"--val-fraction {self.val_fraction} must be in [0, 1)")
        if self.val_docs is not None and (self.val_docs < 0 or self.val_fraction):
            raise DataError(f"--val-docs {self.val_docs}: give a count >= 0, and not with --val-fraction")
        if self.val_min_docs < 0 or (self.val_min_docs and self.val_docs is not None):
            raise DataError(f"--val-min-docs {self.val_min_docs}: give a count >= 0, with --val-fraction")
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
