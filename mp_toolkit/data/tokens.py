"""Byte-level BPE tokenizers and the token caches: a corpus's documents -> one cached int32 token stream.

`train_tokenizer` trains a tokenizer once per (corpus, vocab_size) and caches it as
``tokenizer-<key>.json`` (`cache_key`); `token_stream` encodes the documents, each followed by
``<|endoftext|>``, into ``tokens-<key>-<tokenizer digest>.npy``; `tokenized_stream` does the same with a
given ``tokenizer.json``. Cache files are written atomically (`mp_toolkit.data.atomic`: 0600, fsynced)
and verified when read, so racing ranks never read a partial file and a damaged one is rebuilt.
`SPECIAL_TOKENS` are BERT's, appended after training by ``mpt data prepare --split-sentences``
(`mp_toolkit.data.survey`) and looked up by `mp_toolkit.data.mlm`.
"""
from __future__ import annotations

import hashlib
import os
from pathlib import Path

import datasets
import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from mp_toolkit.data.atomic import save_array, write_file
from mp_toolkit.errors import DataError
from mp_toolkit.progress import progress as progress_bar

EOS_TOKEN = "<|endoftext|>"
SPECIAL_TOKENS = ("[PAD]", "[CLS]", "[SEP]", "[MASK]")
"""BERT's special tokens, in the order a trained BERT tokenizer appends them as its last ids."""
# Bytes that UTF-8 never uses (C0, C1: overlong two-byte leads; F5..FF: past U+10FFFF). The corpus is
# strict UTF-8 text (`corpus.read_texts`), so a vocabulary too small for all 256 byte symbols plus
# <|endoftext|> leaves these out and still encodes every string, losslessly.
NON_UTF8_BYTES = frozenset({0xC0, 0xC1, *range(0xF5, 0x100)})
MIN_VOCAB = 256 - len(NON_UTF8_BYTES) + 1  # 243 byte symbols + <|endoftext|>
ENCODE_CHUNK = 64  # documents per encode_batch call while encoding a corpus (one progress step)


def _texts_digest(texts: list[str]) -> str:
    h = hashlib.sha256()
    for text in texts:
        data = text.encode("utf-8")
        h.update(len(data).to_bytes(8, "little"))  # length prefix: ["ab", "c"] != ["a", "bc"]
        h.update(data)
    return h.hexdigest()


def cache_key(texts: list[str], vocab_size: int) -> str:
    """The key of the tokenizer trained on ``texts`` with ``vocab_size``: its cache file is
    ``tokenizer-<key>.json`` (an export finds a run's tokenizer by it, `mp_toolkit.export.tokenizer`)."""
    return hashlib.sha256(f"{_texts_digest(texts)}:{vocab_size}".encode()).hexdigest()[:16]


def train_tokenizer(texts: list[str], vocab_size: int, cache_dir: str | os.PathLike,
                    progress: bool = True) -> Tokenizer:
    """Byte-level BPE with ``<|endoftext|>`` at id 0, trained once per (corpus, vocab_size) and cached.

    Its alphabet is every byte (`byte_alphabet`): all 256 from 257 ids up, the 243 that UTF-8 uses
    below that (GPT gpt-tiny's 256 ids: 243 bytes, <|endoftext|> and 12 merges).

    The cache file is ``cache_dir/tokenizer-<key>.json``; it is written atomically, so ranks that
    race to train the same (deterministic) tokenizer all end up reading one complete file.
    ``progress=False`` draws no bar (``mpt data prepare --no-progress``); True draws one on a terminal
    while `datasets`' bars are on (``mpt train --no-progress`` turns them off).
    """
    if vocab_size < MIN_VOCAB:
        raise DataError(
            f"vocab_size={vocab_size} is too small for byte-level BPE: use at least {MIN_VOCAB} "
            f"({MIN_VOCAB - 1} UTF-8 bytes + {EOS_TOKEN})"
        )
    cached = Path(cache_dir) / f"tokenizer-{cache_key(texts, vocab_size)}.json"
    if cached.is_file():
        try:
            tokenizer = Tokenizer.from_file(str(cached))
            if tokenizer.get_vocab_size() == vocab_size and tokenizer.token_to_id(EOS_TOKEN) == 0:
                return tokenizer
        except Exception:  # noqa: BLE001 -- tokenizers raises a bare Exception on a damaged file
            pass  # damaged (truncated, edited): trained again below and replaced

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],  # id 0
        initial_alphabet=byte_alphabet(vocab_size),  # every UTF-8 string is encodable
        show_progress=False,
    )
    # the bar counts documents read; the merges that follow are the tokenizer's own (quick) pass
    bar = progress_bar(texts, "training tokenizer", len(texts), progress and progress_bars_on(), "doc")
    tokenizer.train_from_iterator(bar, trainer=trainer, length=len(texts))

    write_file(cached, tokenizer.save)
    return tokenizer


def byte_alphabet(vocab_size: int) -> list[str]:
    """The byte symbols (as the ByteLevel pre-tokenizer spells them) a tokenizer of ``vocab_size``
    starts from: all 256 when they fit beside <|endoftext|>, else those UTF-8 text can contain."""
    if vocab_size > 256:
        return pre_tokenizers.ByteLevel.alphabet()
    # ByteLevel's byte -> symbol table is GPT-2's bytes_to_unicode: printable Latin-1 bytes stand for
    # themselves, the 68 others take U+0100 onwards in byte order
    shown = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
             *range(ord("\u00ae"), ord("\u00ff") + 1)]
    hidden = [b for b in range(256) if b not in shown]
    symbol = {**{b: chr(b) for b in shown}, **{b: chr(256 + i) for i, b in enumerate(hidden)}}
    return [symbol[b] for b in range(256) if b not in NON_UTF8_BYTES]


def progress_bars_on() -> bool:
    """Progress bars follow `datasets`' switch, which ``mpt train --no-progress`` turns off."""
    return not datasets.are_progress_bars_disabled()


def _cached_stream(cache_file: Path, vocab_size: int) -> np.ndarray | None:
    """The cached token stream when it is intact: a 1-d int32 array whose ids are all below
    ``vocab_size``; None when missing or damaged (truncated, another dtype, out-of-range ids),
    so the caller encodes the corpus again and replaces it."""
    if not cache_file.is_file():
        return None
    try:
        stream = np.load(cache_file, allow_pickle=False)
    except (OSError, ValueError, EOFError):
        return None
    if not isinstance(stream, np.ndarray) or stream.dtype != np.int32 or stream.ndim != 1:
        return None
    if len(stream) and (int(stream.min()) < 0 or int(stream.max()) >= vocab_size):
        return None
    return stream


def token_stream(texts: list[str], tokenizer: Tokenizer, cache_dir: Path, key: str,
                 eos: int | None = None) -> np.ndarray:
    """All documents' ids, each followed by ``eos`` (default: the tokenizer's <|endoftext|>; none when
    it has none), as one int32 array, cached as ``tokens-<key>-<tokenizer digest>.npy`` (encoding is
    slow): the name changes with the tokenizer, and a damaged cache is encoded again (`_cached_stream`)."""
    digest = hashlib.sha256(tokenizer.to_str().encode()).hexdigest()[:16]
    cache_file = cache_dir / f"tokens-{key}-{digest}.npy"
    vocab = max(tokenizer.get_vocab_size(), (eos + 1) if eos is not None else 0)
    cached = _cached_stream(cache_file, vocab)
    if cached is not None:
        return cached
    eos = tokenizer.token_to_id(EOS_TOKEN) if eos is None else eos
    end = [eos] if eos is not None else []
    chunks = range(0, len(texts), ENCODE_CHUNK)  # encode_batch per chunk: the same ids, with a bar
    docs = [enc.ids + end for i in progress_bar(chunks, "encoding corpus", len(chunks), progress_bars_on(), "chunk")
            for enc in tokenizer.encode_batch(texts[i : i + ENCODE_CHUNK])]
    stream = np.fromiter((t for doc in docs for t in doc), dtype=np.int32)
    save_array(cache_file, stream)
    return stream


def load_tokenizer_file(path: str | os.PathLike) -> tuple[Tokenizer, str]:
    """(a tokenizers ``tokenizer.json``, as HF's ``save_pretrained`` writes it, its content digest)."""
    try:
        raw = Path(path).read_bytes()
        return Tokenizer.from_str(raw.decode("utf-8")), hashlib.sha256(raw).hexdigest()
    except Exception as e:  # OSError, bad UTF-8, or the plain Exception tokenizers raises on a bad file
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise DataError(f"cannot read tokenizer {path}: {reason}") from None


def tokenized_stream(texts: list[str], tokenizer_file: str | os.PathLike, vocab_size: int,
                     cache_dir: str | os.PathLike, eos: int | None = None) -> np.ndarray:
    """The token stream of ``texts`` under a given tokenizer.json (HF's special tokens as its
    post-processor adds them, then ``eos``), cached by (corpus, tokenizer file, eos); every id must be
    below the model's ``vocab_size``."""
    tokenizer, digest = load_tokenizer_file(tokenizer_file)
    key = hashlib.sha256(f"{_texts_digest(texts)}:{digest}:{eos}".encode()).hexdigest()[:16]
    stream = token_stream(texts, tokenizer, Path(cache_dir), key, eos=eos)
    top = int(stream.max()) if len(stream) else -1
    if top >= vocab_size:
        raise DataError(f"tokenizer {tokenizer_file} gives token id {top}, but the model's vocab_size is {vocab_size}: "
                        "use the tokenizer the model was built for (ids must be below vocab_size)")
    return stream
