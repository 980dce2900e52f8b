"""What `mp_toolkit.data.prepare` settles before its encode pass (its module docstring, steps 3 and 4): the
survey, one reading pass without encoding that draws the tokenizer's sample and the val cut, and
DIR/tokenizer.json, given or trained on that sample.

    survey = survey_corpus(sources, opts, need_sample=True, progress=False)  # .sample, .val_cut, .documents
    vocab = settle_tokenizer(out, opts, None, survey, progress=False)        # what the workers encode with
    unit_hash("val", seed, k, j) < val_fraction                              # document j of file k: val

A document's hashes (`unit_hash`) are the same on every run and machine: they choose val and the sample.
"""

from __future__ import annotations

import hashlib
import heapq
import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path

from tokenizers import Tokenizer
from tqdm import tqdm

from mp_toolkit.data.atomic import write_bytes
from mp_toolkit.data.prepare_options import Options
from mp_toolkit.data.prepared import TOKENIZER
from mp_toolkit.data.sources import Documents, Source
from mp_toolkit.data.tokens import SPECIAL_TOKENS, load_tokenizer_file, train_tokenizer
from mp_toolkit.errors import DataError
from mp_toolkit.progress import DELAY_S

EOD_TOKENS = ("<|endoftext|>", "<|end_of_text|>", "</s>", "[SEP]")
"""End-of-document tokens, in the order they are looked for: GPT-2 / ours, Llama 3, Llama 2 / T5, BERT."""


def unit_hash(purpose: str, seed: int, k: int, j: int) -> float:
    """A hash of (purpose, seed, file k, document j) mapped to [0, 1): the same on every run and machine."""
    digest = hashlib.blake2b(f"{purpose}:{seed}:{k}:{j}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2.0**64


def byte_bar(total: int, desc: str, enabled: bool) -> tqdm:
    """Bytes of input under a tqdm bar on a terminal (as `mp_toolkit.progress`: after DELAY_S, stderr a TTY)."""
    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, delay=DELAY_S, file=sys.stderr, leave=False,
                dynamic_ncols=True, disable=not (enabled and sys.stderr.isatty()))


@dataclass
class Survey:
    """One reading pass's findings: the tokenizer's sample, the val cut, the corpus's document count."""

    sample: list[str] = field(default_factory=list)
    val_cut: tuple[float, int, int] | None = None
    """The largest (u, k, j) that goes to val (``val_docs``, or ``val_min_docs`` when it decides); None: no
    document does (``val_docs``) or ``val_fraction`` decides (``val_min_docs``)."""
    documents: int = 0
    val_share: float | None = None
    """The share of documents the cut sends to val (None: ``val_fraction``'s)."""


def survey_corpus(sources: list[Source], opts: Options, need_sample: bool, progress: bool) -> Survey:
    """Read every file once, without encoding (module docstring: the sample and ``val_docs``)."""
    reader = Documents(sources, list(range(len(sources))), opts.json_key)
    sample: list[tuple[float, int, int, int, str]] = []  # max-heap by u: (-u, k, j, bytes, text)
    held, cut = 0, math.inf  # cut: the smallest u dropped; a document at or above it would be dropped too
    under = 0  # documents under val_fraction (val_min_docs decides whether they are enough)
    val: list[tuple[float, int, int]] = []  # max-heap of the val_docs smallest (u, k, j), negated
    result = Survey()
    with byte_bar(reader.total, "reading corpus (tokenizer sample, val split)", progress) as bar:
        for k, j, text, read in reader:
            result.documents += 1
            bar.update(read - bar.n)
            u = unit_hash("sample", opts.seed, k, j) if need_sample else math.inf
            if u < cut:
                size = len(text.encode("utf-8"))
                heapq.heappush(sample, (-u, k, j, size, text))
                held += size
                while held > opts.sample_bytes and len(sample) > 1:
                    dropped = heapq.heappop(sample)
                    held, cut = held - dropped[3], -dropped[0]
            keep = opts.val_docs or opts.val_min_docs
            if keep:
                u_val = unit_hash("val", opts.seed, k, j)
                under += u_val < opts.val_fraction
                heapq.heappush(val, (-u_val, -k, -j))
                if len(val) > keep:
                    heapq.heappop(val)
    if not result.documents:
        raise DataError(f"the inputs ({', '.join(opts.inputs)}) hold no documents")
    if opts.val_docs is not None and opts.val_docs >= result.documents:
        raise DataError(f"--val-docs {opts.val_docs} leaves no training document: the corpus has "
                        f"{result.documents}")
    result.sample = [text for _, _, _, _, text in sorted(sample, key=lambda e: (e[1], e[2]))]
    if opts.val_docs is None and opts.val_min_docs:
        if under >= opts.val_min_docs or result.documents < 2:
            return result  # the fraction decides (a lone document always trains)
        while len(val) > min(opts.val_min_docs, result.documents - 1):
            heapq.heappop(val)
    if val:
        result.val_share = len(val) / result.documents
        u, k, j = val[0]
        result.val_cut = (-u, -k, -j)
    return result


@dataclass(frozen=True)
class Vocab:
    """The tokenizer as preparing needs it."""

    encoding_json: str
    """What the workers encode with (the saved tokenizer; with trained BERT specials, the BPE without them)."""
    sha256: str
    """Of DIR/tokenizer.json."""
    vocab_size: int
    eod_id: int | None
    append_eod: bool


def read_given_tokenizer(path: Path) -> tuple[Tokenizer, bytes, str]:
    """(tokenizer, its file's bytes, their sha256) of a tokenizer.json or a directory holding one."""
    file = path / TOKENIZER if path.is_dir() else path
    if not file.is_file():
        raise DataError(f"--tokenizer {path}: {file} does not exist (give a tokenizer.json or its directory)")
    tok, digest = load_tokenizer_file(file)
    return tok, file.read_bytes(), digest


def settle_tokenizer(out: Path, opts: Options, given, survey: Survey | None, progress: bool) -> Vocab:
    """DIR/tokenizer.json written (or found, on a restart) and what encodes; ``progress``: training's bar."""
    file = out / TOKENIZER
    if given is not None:
        tok, raw, digest = given
        if not file.is_file() or hashlib.sha256(file.read_bytes()).hexdigest() != digest:
            write_bytes(file, raw, private=False)
        encoding = tok
    elif file.is_file():  # trained by an earlier run of this command (prepare.json matched)
        tok, digest = load_tokenizer_file(file)
        encoding = _without(tok, SPECIAL_TOKENS) if opts.split_sentences else tok
    else:
        n_special = len(SPECIAL_TOKENS) if opts.split_sentences else 0
        encoding = train_tokenizer(survey.sample, opts.vocab_size - n_special, progress)
        tok = Tokenizer.from_str(encoding.to_str())
        if n_special:
            tok.add_special_tokens(list(SPECIAL_TOKENS))
        raw = tok.to_str().encode()
        write_bytes(file, raw, private=False)
        digest = hashlib.sha256(raw).hexdigest()
    vocab_size = max(tok.get_vocab(with_added_tokens=True).values()) + 1
    eod = eod_id(tok)
    append = (eod is not None and not opts.split_sentences) if opts.append_eod is None else opts.append_eod
    return Vocab(encoding.to_str(), digest, vocab_size, eod, append)


def eod_id(tok: Tokenizer) -> int | None:
    return next((i for i in map(tok.token_to_id, EOD_TOKENS) if i is not None), None)


def _without(tok: Tokenizer, specials: tuple[str, ...]) -> Tokenizer:
    """``tok`` less the added tokens named (the BPE sentences are encoded with, from the one DIR keeps)."""
    doc = json.loads(tok.to_str())
    doc["added_tokens"] = [t for t in doc["added_tokens"] if t["content"] not in specials]
    return Tokenizer.from_str(json.dumps(doc))
